"""Writes docs/config.md, the configuration reference, from configs/default.py.

  python tools/gen_config_doc.py            # regenerate docs/config.md
  python tools/gen_config_doc.py --check    # exit 1 if docs/config.md is stale

Every field that get_config() assigns becomes a row: its dotted name, its default (the
value get_config() returns) and its comment (the comment lines right above the
assignment, then the one beside it). A comment above a section's assignment
(`config.mesh = ...`) introduces the section. Fields built with `per_member(...)`
are marked "per member". tests/test_config_doc.py fails when the committed file
differs from what this prints, so the reference cannot go stale: edit the comments in
configs/default.py and rerun this script.

Only the standard library and ml_collections are needed: the config file is loaded
as a module, never through dist_ens.
"""

import argparse
import ast
import importlib.util
import io
import sys
import tokenize
from pathlib import Path
from typing import Any

import ml_collections

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / 'configs' / 'default.py'
OUT = ROOT / 'docs' / 'config.md'


def _load_config(path: Path) -> ml_collections.ConfigDict:
  spec = importlib.util.spec_from_file_location('_dist_ens_default_config', path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config()


def _comments(source: str) -> dict[int, tuple[str, bool]]:
  """line -> (comment text, whether the line holds only the comment)."""
  out = {}
  lines = source.splitlines()
  for tok in tokenize.generate_tokens(io.StringIO(source).readline):
    if tok.type == tokenize.COMMENT:
      row, col = tok.start
      alone = not lines[row - 1][:col].strip()
      out[row] = (tok.string.lstrip('#').strip(), alone)
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
  above = []
  row = stmt.lineno - 1
  while row in comments and comments[row][1]:
    above.insert(0, comments[row][0])
    row -= 1
  beside = [comments[r][0] for r in range(stmt.lineno, stmt.end_lineno + 1)
            if r in comments and not comments[r][1]]
  return ' '.join(above + beside).strip()


def _inline_keys(value: ast.expr) -> set[str]:
  """The keys a group's assignment gives inline: {'member', 'data'} for
  `ConfigDict(dict(member=-1, data=1))` or `ConfigDict({'member': -1, 'data': 1})`."""
  if not (isinstance(value, ast.Call) and value.args):
    return set()
  arg = value.args[0]
  if isinstance(arg, ast.Call):
    return {k.arg for k in arg.keywords if k.arg}
  if isinstance(arg, ast.Dict):
    return {k.value for k in arg.keys if isinstance(k, ast.Constant)}
  return set()


def _get(config: ml_collections.ConfigDict, dotted: str) -> Any:
  value = config
  for part in dotted.split('.'):
    value = value[part]
  return value


def _leaves(value: Any, prefix: str) -> list[tuple[str, Any]]:
  if isinstance(value, ml_collections.ConfigDict) and len(value):
    out = []
    for key in value.keys():
      out += _leaves(value[key], f'{prefix}.{key}')
    return out
  return [(prefix, value)]


def _format(value: Any) -> str:
  if isinstance(value, ml_collections.ConfigDict):
    return '`{}`'
  return f'`{value!r}`'


def _cell(text: str) -> str:
  return text.replace('|', '\\|')


def generate(config_path: Path = CONFIG) -> str:
  """The Markdown of docs/config.md for the config file at `config_path`."""
  source = config_path.read_text()
  tree = ast.parse(source)
  comments = _comments(source)
  config = _load_config(config_path)
  get_config = next(n for n in tree.body
                    if isinstance(n, ast.FunctionDef) and n.name == 'get_config')
  sections: dict[str, dict[str, Any]] = {'': {'intro': '', 'rows': []}}
  for stmt in get_config.body:
    if not isinstance(stmt, ast.Assign) or len(stmt.targets) != 1:
      continue
    name = _dotted(stmt.targets[0])
    if name is None:
      continue
    comment = _comment_for(stmt, comments)
    per_member = 'per_member(' in ast.get_source_segment(source, stmt.value)
    value = _get(config, name)
    if '.' not in name and isinstance(value, ml_collections.ConfigDict):
      section = sections.setdefault(name, {'intro': '', 'rows': []})
      section['intro'] = comment
      # Fields given inline (config.mesh = ConfigDict(dict(...))) have no own line; the
      # group's later assignments (config.mesh.model = 1) are rows of their own below.
      inline = _inline_keys(stmt.value)
      for leaf, leaf_value in _leaves(value, name):
        if leaf.split('.')[1] in inline:
          section['rows'].append((leaf, leaf_value, '', False))
      continue
    if isinstance(value, ml_collections.ConfigDict) and len(value):
      continue  # A subgroup (config.ensemble.swag = ConfigDict()): its fields are the rows.
    section = name.split('.')[0] if '.' in name else ''
    sections.setdefault(section, {'intro': '', 'rows': []})['rows'].append(
        (name, value, comment, per_member))

  doc = ast.get_docstring(tree) or ''
  out = ['# Configuration reference', '',
         '<!-- Generated by tools/gen_config_doc.py from configs/default.py: do not edit by hand. '
         'Edit the comments there and rerun the script (tests/test_config_doc.py checks). -->', '',
         'Every field of `configs/default.py`, its default and what it means. Override any of '
         'them on the command line (`--config.optim.learning_rate=3e-3`) or in Python '
         '(`config.optim.learning_rate = 3e-3`). Fields marked **per member** take a number, a '
         'list of `num_members` numbers or a sweep spec (see [sweeps.md](sweeps.md)). A field '
         'this file does not have, set on the command line, in a config file or in Python, is '
         'refused in one line with the closest names ("did you mean"), before anything runs; '
         'the exceptions are the fields only some models read (`model.depth`, `model.heads`, '
         '... in [models.md](models.md)), the TFDS-only `data.train_split`, '
         '`data.test_split` and `data.add_channel`, and anything under `model.kwargs`.', '']
  if doc:
    out += ['From the file\'s docstring:', '', '```', doc, '```', '']
  for key, section in sections.items():
    if not section['rows']:
      continue
    out += [f'## `{key}`' if key else '## Top level', '']
    if section['intro']:
      out += [section['intro'], '']
    out += ['| field | default | meaning |', '|---|---|---|']
    for name, value, comment, per_member in section['rows']:
      meaning = ('**per member.** ' if per_member else '') + comment
      out.append(f'| `{name}` | {_cell(_format(value))} | {_cell(meaning)} |')
    out.append('')
  return '\n'.join(out)


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--check', action='store_true', help='exit 1 if docs/config.md is stale')
  args = parser.parse_args()
  text = generate()
  if args.check:
    if not OUT.exists() or OUT.read_text() != text:
      print(f'{OUT} is stale: run python tools/gen_config_doc.py', file=sys.stderr)
      return 1
    return 0
  OUT.write_text(text)
  print(f'wrote {OUT}')
  return 0


if __name__ == '__main__':
  sys.exit(main())
