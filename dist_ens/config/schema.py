"""What dist_ens/config/defaults.py declares of each field: its meaning and its check,
read from the file's comments, so a field is declared in one place. A built-in method
declares its own fields in its file (dist_ens/ensembles/<name>.py, registered in
ensembles/methods.py's METHODS) as a module-level `FIELDS = dict(...)`, commented the same
way: they are config.ensemble.<name>.* (`method_fields`, `method_defaults`). A config
module's feature declares its own fields so too (config/groups.py), placed by get_config's
`_declared_in(config.<section>, '<module>')` (`module_defaults`).

A field's comment (the comment lines right above its assignment, then the one beside
it) is its meaning; a check in brackets at the comment's end is what its value must be:

  config.train.steps = 1000  # steps to train [int >= 1]
  config.optim.b2 = 0.999  # Adam's second-moment decay [number in [0, 1)]
  config.reproducible = False  # ... [bool]

Checks: `int`, `number` (finite, not a bool) or `bool`, an int or number optionally
bounded (`>= 1`, `> 0`, or an interval `in [0, 1)` / `in (0, 1)`), or `one of 'a', 'b'`
(names no registry holds; a registry's names are checked where it is).
config.loading.check_declared applies every declared check (the refusal names the field
and reads "must be an int >= 1"): config.checks.validate runs it, and the command line
before it imports JAX; tools/gen_config_doc.py shows them in docs/config.md. What depends
on other fields (a multiple of train.steps_per_call, top_k at most num_members) stays in
config.checks.validate.

Only the standard library is used: tools read the file without importing jax.
"""

import ast
import dataclasses
import functools
import io
import math
import re
import tokenize
from pathlib import Path
from typing import Any

_CHECK = re.compile(r'\s*\[((?:int|number|bool|one of)\b[^\n]*)\]\s*$')
_BOUND = re.compile(r'^(int|number)\s*(?:(>=|>)\s*(\S+)|in\s*([\[(])\s*(\S+)\s*,\s*(\S+)\s*([\])]))?$')


@dataclasses.dataclass(frozen=True)
class Check:
  """What a field's value must be: kind 'int', 'number', 'bool' or 'one of' (`choices`),
  with optional bounds."""
  text: str  # as declared: 'int >= 1'
  kind: str
  low: float | None = None
  low_closed: bool = True
  high: float | None = None
  high_closed: bool = True
  choices: tuple[Any, ...] = ()

  def holds(self, value: Any) -> bool:
    if self.kind == 'bool':
      return isinstance(value, bool)
    if self.kind == 'one of':
      return isinstance(value, str) and value in self.choices
    if isinstance(value, bool) or not isinstance(value, (int, float)):
      return False
    if self.kind == 'int' and not isinstance(value, int):
      return False
    if not math.isfinite(value):
      return False
    if self.low is not None and not (value >= self.low if self.low_closed else value > self.low):
      return False
    return self.high is None or (value <= self.high if self.high_closed else value < self.high)

  @property
  def requirement(self) -> str:
    """'must be an int >= 1', as a refusal says it."""
    if self.kind == 'bool':
      return 'must be True or False'
    if self.kind == 'one of':
      return f'use one of {list(self.choices)}'
    return f"must be {'an' if self.kind == 'int' else 'a'} {self.text}"


def parse_check(text: str) -> Check:
  """A Check from its declaration ('int >= 1', 'number in [0, 1)', 'bool')."""
  text = ' '.join(text.split())
  if text == 'bool':
    return Check(text, 'bool')
  if text.startswith('one of '):
    choices = ast.literal_eval(f'({text[len("one of "):]},)')
    return Check(text, 'one of', choices=tuple(choices))
  match = _BOUND.match(text)
  if match is None:
    raise ValueError(f'check [{text}]: use int, number or bool, optionally bounded, or one '
                     "of: 'int >= 1', 'number > 0', 'number in [0, 1)', \"one of 'a', 'b'\".")
  kind, op, bound, left, low, high, right = match.groups()
  if op is not None:
    return Check(text, kind, float(bound), op == '>=')
  if left is not None:
    return Check(text, kind, float(low), left == '[', float(high), right == ']')
  return Check(text, kind)


@dataclasses.dataclass(frozen=True)
class Field:
  """One field of the config file: its dotted path, meaning, check, and whether it is a
  per-member field (assigned with per_member(...))."""
  path: str
  meaning: str
  check: Check | None
  per_member: bool
  line: int


def _comments(source: str) -> dict[int, tuple[str, bool]]:
  """line -> (comment text, whether the line holds only the comment)."""
  out, lines = {}, source.splitlines()
  for tok in tokenize.generate_tokens(io.StringIO(source).readline):
    if tok.type == tokenize.COMMENT:
      row, col = tok.start
      out[row] = (tok.string.lstrip('#').strip(), not lines[row - 1][:col].strip())
  return out


def _dotted(node: ast.expr) -> str | None:
  """'model.name' for `config.model.name`; None for anything else."""
  parts = []
  while isinstance(node, ast.Attribute):
    parts.append(node.attr)
    node = node.value
  if isinstance(node, ast.Name) and node.id == 'config' and parts:
    return '.'.join(reversed(parts))
  return None


def _comment_for(stmt: ast.stmt, comments: dict[int, tuple[str, bool]]) -> str:
  """The comment lines right above `stmt`, then the ones beside it, as one text."""
  above, row = [], stmt.lineno - 1
  while row in comments and comments[row][1]:
    above.insert(0, comments[row][0])
    row -= 1
  beside = [comments[r][0] for r in range(stmt.lineno, stmt.end_lineno + 1)
            if r in comments and not comments[r][1]]
  return ' '.join(above + beside).strip()


def _split_check(comment: str) -> tuple[str, Check | None]:
  """(the meaning, the check declared at the comment's end, or None)."""
  match = _CHECK.search(comment)
  if match is None:
    return comment, None
  return comment[:match.start()].rstrip(), parse_check(match.group(1))


# Where the config modules are whose features declare fields of their own (config/groups.py).
CONFIG_DIR = Path(__file__).resolve().parent


def assignments(source: str) -> list[tuple[str, ast.Assign | ast.keyword, str]]:
  """(dotted path, statement, comment) of every `config.x = ...` that get_config() makes,
  in order: its own, those of the file's functions it calls as `_group(config)` (one
  per group of fields), and where it calls `_declared_in(config.<section>, '<module>')`
  the fields config/<module>.py's FIELDS declares (each keyword as the statement)."""
  tree = ast.parse(source)
  comments = _comments(source)
  functions = {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef)}
  out = []

  def walk(function: ast.FunctionDef) -> None:
    for stmt in function.body:
      call = stmt.value if isinstance(stmt, ast.Expr) else None
      name = getattr(getattr(call, 'func', None), 'id', None)
      if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1:
        path = _dotted(stmt.targets[0])
        if path is not None:
          out.append((path, stmt, _comment_for(stmt, comments)))
      elif name == '_declared_in':  # _declared_in(config.<section>, '<module>')
        section, module = _dotted(call.args[0]), call.args[1].value
        module_source = (CONFIG_DIR / f'{module}.py').read_text()
        out.extend((f'{section}.{k.arg}', k, _comment_for(k, _comments(module_source)))
                   for k in _fields_dict(module_source).keywords)
      elif isinstance(call, ast.Call) and name in functions:
        walk(functions[name])

  walk(functions['get_config'])
  return out


def fields(source: str) -> dict[str, Field]:
  """Every field assigned in the file's get_config(), by dotted path."""
  out = {}
  for path, stmt, comment in assignments(source):
    meaning, check = _split_check(comment)
    per_member = any(isinstance(n, ast.Call) and getattr(n.func, 'id', None) == 'per_member'
                     for n in ast.walk(stmt.value))
    out[path] = Field(path, meaning, check, per_member, stmt.lineno)
  return out


# Where the built-in methods' files are: each method that methods.py registers and whose
# file declares FIELDS is a group of config.ensemble named after the file.
METHODS_DIR = Path(__file__).resolve().parents[1] / 'ensembles'


def _fields_dict(source: str) -> ast.Call | None:
  """The `FIELDS = dict(...)` call at the module level of `source`, or None."""
  for stmt in ast.parse(source).body:
    if (isinstance(stmt, ast.Assign) and len(stmt.targets) == 1
        and getattr(stmt.targets[0], 'id', None) == 'FIELDS'):
      if not (isinstance(stmt.value, ast.Call) and getattr(stmt.value.func, 'id', None) == 'dict'
              and not stmt.value.args):
        raise ValueError('FIELDS must be dict(name=default, ...), one keyword per field.')
      return stmt.value
  return None


def registered_modules(source: str) -> list[str]:
  """The module names the METHODS dict of methods.py's `source` maps names to, in order
  ('swag' for `'multiswag': swag`, through `import x as y`)."""
  tree = ast.parse(source)
  aliases = {a.asname or a.name: a.name for node in tree.body
             if isinstance(node, ast.ImportFrom) for a in node.names}
  for stmt in tree.body:
    target = stmt.targets[0] if isinstance(stmt, ast.Assign) else getattr(stmt, 'target', None)
    if getattr(target, 'id', None) == 'METHODS' and isinstance(stmt.value, ast.Dict):
      return [aliases.get(v.id, v.id) for v in stmt.value.values if isinstance(v, ast.Name)]
  raise ValueError('methods.py has no METHODS = {name: module, ...}.')


def _method_sources() -> dict[str, str]:
  """group -> source of each registered method's file that declares FIELDS."""
  out = {}
  for name in registered_modules((METHODS_DIR / 'methods.py').read_text()):
    source = (METHODS_DIR / f'{name}.py').read_text()
    if _fields_dict(source) is not None:
      out[name] = source
  return out


@functools.cache
def method_fields() -> dict[str, Field]:
  """Every field the method files declare, by dotted path ('ensemble.swag.rank')."""
  out = {}
  for group, source in _method_sources().items():
    comments = _comments(source)
    for keyword in _fields_dict(source).keywords:
      meaning, check = _split_check(_comment_for(keyword, comments))
      path = f'ensemble.{group}.{keyword.arg}'
      out[path] = Field(path, meaning, check, False, keyword.lineno)
  return out


@functools.cache
def method_defaults() -> dict[str, dict[str, Any]]:
  """group -> {field: default} of every method file that declares FIELDS (literals only)."""
  return {group: {k.arg: ast.literal_eval(k.value) for k in _fields_dict(source).keywords}
          for group, source in _method_sources().items()}


def feature_modules(source: str) -> list[str]:
  """The config modules whose features declare their fields beside their code: the
  `<module>` of each `_declared_in(config.<section>, '<module>')` in the defaults file's
  `source` (config/groups.py's 'groups'), in order."""
  return [node.args[1].value for node in ast.walk(ast.parse(source))
          if isinstance(node, ast.Call) and getattr(node.func, 'id', None) == '_declared_in']


@functools.cache
def module_defaults(module: str) -> dict[str, Any]:
  """{field: default} that config/<module>.py's FIELDS declares (literals only)."""
  source = (CONFIG_DIR / f'{module}.py').read_text()
  return {k.arg: ast.literal_eval(k.value) for k in _fields_dict(source).keywords}


@functools.cache
def declared(path: Path) -> dict[str, Field]:
  """fields() of the config file at `path` (read once), then the methods' fields."""
  return {**fields(Path(path).read_text()), **method_fields()}
