"""Measures the package's architecture: the figures the architecture issue asks for.

  python tools/architecture.py [PACKAGE_DIR]   # default: dist_ens next to this file

Prints, for the package's modules:
  root_modules    modules at the package's root (its __init__ included);
  lines           lines of the package's Python files;
  raw_config      modules that take or read a raw ml_collections config (they import
                  ml_collections or name ConfigDict);
  config_readers  modules that read a config's fields (`config.x`, `<obj>.config.x`, x
                  one of the top-level fields config/defaults.py sets, where it exists),
                  pass an object's config on (`f(<obj>.config)`) or take a parameter
                  annotated ConfigDict;
  config_below    of those, the ones outside CONFIG_EDGE: the modules whose job is to turn
                  a config into specs (config/, run/: build_run) and the entry points
                  handed a config or a saved run's (the command line, train, plan,
                  Ensemble.load, the report). Below them everything reads specs;
  import_cycles   groups of modules that import each other, directly or not (module
                  level and function level imports both count, and importing a.b.c
                  imports the packages a.b and a first: their __init__s run; imports
                  under `if TYPE_CHECKING:` never run and do not count);
  back_arrows     imports from a lower layer to a higher one (LAYERS, ground floor first);
  num_classes     modules naming `num_classes`;
  mesh_axes       modules naming the mesh's axes (MEMBER / DATA, or 'member' / 'data'
                  as a PartitionSpec or axis name);
  member_groups   modules that name member groups (config.ensemble.groups, a spec's
                  .groups, or an import of the groups' own modules under any name:
                  config/groups.py, evaluators/groups.py).

  python tools/architecture.py --step [CONFIG]   # default: configs/default.py

Also prints the files one training step needs, in reading order: the package's modules
whose Python runs from build_step(parts) through tracing the step (the model, the
optimizer, the loss, the method's hooks, the member form, the step itself), each where
first entered; and the files build_run(config) wires that step's parts with.
"""

import ast
import json
import re
import sys
from pathlib import Path

# Ground floor first: a module may import its own layer and those before it.
LAYERS = [
    ('errors', 'importing'),
    ('core',),
    ('parallel', 'models', 'data'),
    ('eval', 'ensembles', 'tasks'),
    ('io', 'config', 'run', 'plan'),
    ('training', 'evaluators', 'inference', 'report', 'main', 'commands', '__init__'),
]
# Where a ConfigDict may be read: the config package, build_run's wiring, and the entry
# points that are given a config (or load a saved run's) and call build_run.
CONFIG_EDGE = ('dist_ens.config', 'dist_ens.run', 'dist_ens.main', 'dist_ens.commands',
               'dist_ens.training.trainer',  # train(config, workdir)
               'dist_ens.plan.planner',  # plan(config)
               # Ensemble.load(workdir): a saved run's config (Ensemble.config, public).
               'dist_ens.inference.saved_run', 'dist_ens.inference.ensemble',
               'dist_ens.report')  # a finished run's config.json
_AXES = re.compile(r"\b(MEMBER|DATA)\b|P\('(member|data)'|axis_name='(member|data)'")
# The field, a spec's .groups, or one of the groups' own modules under any name (an alias
# does not hide an import): config/groups.py, evaluators/groups.py (and the plan's module
# for groups, plan/groups_plan.py, until the plan priced every run's stacks alike).
_GROUPS = re.compile(r"\bmember_groups\b|ensemble\.groups\b|\.groups\b(?!\()|\bgroups_lib\b|"
                     r"\bgroups_plan\b|dist_ens\.\w+\.groups\b|"
                     r"from dist_ens\.\w+ import (\([^)]*|[^\n]*)\bgroups\b")


def _layer(module: str) -> int:
  top = module.split('.')[1] if '.' in module else '__init__'
  for i, names in enumerate(LAYERS):
    if top in names:
      return i
  return len(LAYERS)


def _type_checking_only(tree: ast.AST) -> set[int]:
  """ids of the nodes inside `if TYPE_CHECKING:` blocks: imports Python never runs."""
  return {id(inner) for node in ast.walk(tree) if isinstance(node, ast.If)
          and 'TYPE_CHECKING' in ast.unparse(node.test) for stmt in node.body
          for inner in ast.walk(stmt)}


def _imports(tree: ast.AST, module: str, is_package: bool, modules: set[str]) -> set[str]:
  """The package's modules whose top-level code importing `module` (or calling its
  functions) runs: each one named, and the __init__ of every package above it, which
  Python runs first (an import of a.b.c runs a/__init__ and a/b/__init__)."""
  out, skipped = set(), _type_checking_only(tree)
  for node in ast.walk(tree):
    if id(node) in skipped:
      continue
    if isinstance(node, ast.Import):
      out |= {a.name for a in node.names if a.name.startswith('dist_ens')}
    elif isinstance(node, ast.ImportFrom):
      base = node.module or ''
      if node.level:
        parts = module.split('.')[:len(module.split('.')) - node.level + (1 if is_package else 0)]
        base = '.'.join(parts + ([base] if base else []))
      if base.startswith('dist_ens'):
        named = {f'{base}.{a.name}' for a in node.names} & modules
        out |= named if named else {base}
  own = module if is_package else module.rsplit('.', 1)[0]
  parents = {'.'.join(m.split('.')[:i]) for m in out for i in range(2, m.count('.') + 1)}
  # The root's __init__ and this module's own packages are already running when it runs.
  return out | {p for p in parents if not (own == p or own.startswith(p + '.'))}


def _top_fields(root: Path) -> set[str] | None:
  """The config's top-level fields (`config.NAME = ...` in config/defaults.py), or None
  (any attribute counts) where the package has no such file."""
  path = root / 'config' / 'defaults.py'
  if not path.exists():
    return None
  return {t.attr for node in ast.walk(ast.parse(path.read_text()))
          if isinstance(node, ast.Assign) for t in node.targets
          if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name)
          and t.value.id == 'config'}


def _reads_config(tree: ast.AST, fields: set[str] | None) -> bool:
  """Whether the module reads a config's fields (among `fields` where given: another
  object named config, e.g. a Hugging Face model's, has others) or takes a ConfigDict."""
  for node in ast.walk(tree):
    if isinstance(node, ast.Attribute) and (fields is None or node.attr in fields):
      base = node.value
      if isinstance(base, ast.Name) and base.id == 'config':
        return True
      if isinstance(base, ast.Attribute) and base.attr == 'config':
        root = base
        while isinstance(root, ast.Attribute):
          root = root.value
        if not (isinstance(root, ast.Name) and root.id == 'dist_ens'):  # a module path
          return True
    if isinstance(node, ast.Call) and any(_is_config(a) for a in node.args):
      return True
    if (isinstance(node, ast.arg) and node.annotation is not None
        and 'ConfigDict' in ast.unparse(node.annotation)):
      return True
  return False


def _is_config(node: ast.AST) -> bool:
  """`<obj>.config` (not a module path such as dist_ens.config). A bare `config` passed
  on is not counted: other objects go by that name (a Hugging Face model's config); a
  function handed ours takes it as a ConfigDict parameter, which counts."""
  if not (isinstance(node, ast.Attribute) and node.attr == 'config'):
    return False
  while isinstance(node, ast.Attribute):
    node = node.value
  return not (isinstance(node, ast.Name) and node.id == 'dist_ens')


def _at_edge(module: str) -> bool:
  return any(module == e or module.startswith(e + '.') for e in CONFIG_EDGE)


def _modules(root: Path) -> dict[str, Path]:
  mods = {}
  for path in root.rglob('*.py'):
    rel = path.relative_to(root.parent).with_suffix('')
    name = '.'.join(rel.parts)
    mods[name.removesuffix('.__init__')] = path
  return mods


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
  """Strongly connected components of more than one module (Tarjan)."""
  index, low, stack, on, out = {}, {}, [], set(), []

  def visit(v):
    index[v] = low[v] = len(index)
    stack.append(v)
    on.add(v)
    for w in graph[v]:
      if w not in index:
        visit(w)
        low[v] = min(low[v], low[w])
      elif w in on:
        low[v] = min(low[v], index[w])
    if low[v] == index[v]:
      group = []
      while True:
        w = stack.pop()
        on.discard(w)
        group.append(w)
        if w == v:
          break
      if len(group) > 1:
        out.append(sorted(group))

  sys.setrecursionlimit(10000)
  for v in graph:
    if v not in index:
      visit(v)
  return out


def measure(root: Path) -> dict:
  mods = _modules(root)
  graph, texts, readers, fields = {}, {}, [], _top_fields(root)
  for name, path in mods.items():
    texts[name] = path.read_text()
    tree = ast.parse(texts[name])
    if _reads_config(tree, fields):
      readers.append(name)
    imported = _imports(tree, name, path.name == '__init__.py', set(mods))
    graph[name] = {m for m in imported if m in mods and m != name}
  # A package's __init__ re-exports its modules: no layer is climbed. But it runs them
  # before any module of the package that an outside module asked for, so for circles
  # those edges count (_imports leaves out a module's edges to its own packages, already
  # running when it runs).
  deps = {v: {w for w in ws if not (v == w.rsplit('.', 1)[0])} for v, ws in graph.items()}
  back = sorted(f'{v} -> {w}' for v, ws in deps.items() for w in ws if _layer(v) < _layer(w))
  return {
      'modules': len(mods),
      'root_modules': sum(1 for path in mods.values() if path.parent == root),
      'lines': sum(text.count('\n') for text in texts.values()),
      'raw_config': sorted(n for n, t in texts.items()
                           if 'ml_collections' in t or 'ConfigDict' in t),
      'config_readers': sorted(readers),
      'config_below': sorted(n for n in readers if not _at_edge(n)),
      'import_cycles': _cycles(graph),
      'back_arrows': back,
      'num_classes': sorted(n for n, t in texts.items() if 'num_classes' in t),
      'mesh_axes': sorted(n for n, t in texts.items() if _AXES.search(t)),
      'member_groups': sorted(n for n, t in texts.items() if _GROUPS.search(t)),
  }


def _entered(root: Path, fn) -> tuple[list[str], object]:
  """(the files under `root` whose functions `fn()` enters, in the order first entered,
  what fn returned)."""
  seen: dict[str, None] = {}
  prefix = str(root) + '/'

  def profile(frame, event, arg):  # pylint: disable=unused-argument
    if event == 'call' and frame.f_code.co_filename.startswith(prefix):
      seen.setdefault(f'{root.name}/{frame.f_code.co_filename[len(prefix):]}', None)
  sys.setprofile(profile)
  try:
    result = fn()
  finally:
    sys.setprofile(None)
  return list(seen), result


def step_files(config_path: Path) -> dict[str, list[str]]:
  """{'step': the files one step needs, 'wiring': those build_run wires its parts with},
  each in the order first entered, for the config at `config_path` (shapes only: no data
  is loaded, nothing runs on a device)."""
  # jax and the package load only here: the static measures above run on any package.
  sys.path.insert(0, str(Path(__file__).parents[1]))
  import jax  # pylint: disable=import-outside-toplevel
  import dist_ens  # pylint: disable=import-outside-toplevel
  from dist_ens.config.loading import load_config  # pylint: disable=import-outside-toplevel
  from dist_ens.plan import dry_run, planner  # pylint: disable=import-outside-toplevel
  from dist_ens.run import assemble  # pylint: disable=import-outside-toplevel
  root = Path(dist_ens.__file__).parent
  config = load_config(str(config_path))
  shapes = planner.data_shape(config)
  wiring, run = _entered(
      root, lambda: assemble.build_run(config, devices=jax.devices()[:1], shapes=shapes))
  batch = planner.step_batch(config)
  # The harness's own calls, made outside the count.
  arguments = {i: dry_run.step_arguments(run.parts, batch, i) for i in (False, True)}

  def trace():
    step = assemble.build_step(run.parts, per_member_batches=batch.per_member, form=run.form)
    step.fn.lower(*arguments[step.uses_index])
  return {'step': _entered(root, trace)[0], 'wiring': wiring}


def main() -> None:
  if '--step' in sys.argv:
    args = [a for a in sys.argv[1:] if a != '--step']
    path = Path(args[0]) if args else Path(__file__).parents[1] / 'configs' / 'default.py'
    files = step_files(path)
    for key, names in files.items():
      print(f'{key}_files {len(names)}')
    print(json.dumps(files, indent=1))
    return
  root = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).parents[1] / 'dist_ens'
  result = measure(root.resolve())
  for key, value in result.items():
    count = value if isinstance(value, int) else len(value)
    print(f'{key:14s} {count}')
  print(json.dumps({k: v for k, v in result.items() if not isinstance(v, int)}, indent=1))


if __name__ == '__main__':
  main()
