"""Measures the package's architecture: the figures the architecture issue asks for.

  python tools/architecture.py [PACKAGE_DIR]   # default: dist_ens next to this file

Prints, for the package's modules:
  root_modules    modules at the package's root (its __init__ included);
  lines           lines of the package's Python files;
  raw_config      modules that take or read a raw ml_collections config (they import
                  ml_collections or name ConfigDict);
  import_cycles   groups of modules that import each other, directly or not (module
                  level and function level imports both count);
  back_arrows     imports from a lower layer to a higher one (LAYERS, ground floor first);
  num_classes     modules naming `num_classes`;
  mesh_axes       modules naming the mesh's axes (MEMBER / DATA, or 'member' / 'data'
                  as a PartitionSpec or axis name);
  member_groups   modules that name member groups (config.ensemble.groups, the
                  member_groups module, a Parts' .groups or core/groups.py).
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
    ('training', 'inference', 'report', 'main', 'commands', '__init__'),
]
_AXES = re.compile(r"\b(MEMBER|DATA)\b|P\('(member|data)'|axis_name='(member|data)'")
_GROUPS = re.compile(r"\bmember_groups\b|ensemble\.groups\b|\.groups\b|\bgroups_lib\b|"
                     r"dist_ens\.core\.groups\b|from dist_ens\.core import [^\n]*\bgroups\b")


def _layer(module: str) -> int:
  top = module.split('.')[1] if '.' in module else '__init__'
  for i, names in enumerate(LAYERS):
    if top in names:
      return i
  return len(LAYERS)


def _imports(tree: ast.AST, module: str, is_package: bool, modules: set[str]) -> set[str]:
  out = set()
  for node in ast.walk(tree):
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
  return out


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
  graph, texts = {}, {}
  for name, path in mods.items():
    texts[name] = path.read_text()
    imported = _imports(ast.parse(texts[name]), name, path.name == '__init__.py', set(mods))
    graph[name] = {m for m in imported if m in mods and m != name}
  # A package's __init__ re-exports its modules: leave those edges out of cycles.
  deps = {v: {w for w in ws if not (v == w.rsplit('.', 1)[0])} for v, ws in graph.items()}
  back = sorted(f'{v} -> {w}' for v, ws in deps.items() for w in ws if _layer(v) < _layer(w))
  return {
      'modules': len(mods),
      'root_modules': sum(1 for path in mods.values() if path.parent == root),
      'lines': sum(text.count('\n') for text in texts.values()),
      'raw_config': sorted(n for n, t in texts.items()
                           if 'ml_collections' in t or 'ConfigDict' in t),
      'import_cycles': _cycles(deps),
      'back_arrows': back,
      'num_classes': sorted(n for n, t in texts.items() if 'num_classes' in t),
      'mesh_axes': sorted(n for n, t in texts.items() if _AXES.search(t)),
      'member_groups': sorted(n for n, t in texts.items() if _GROUPS.search(t)),
  }


def main() -> None:
  root = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).parents[1] / 'dist_ens'
  result = measure(root.resolve())
  for key, value in result.items():
    count = value if isinstance(value, int) else len(value)
    print(f'{key:14s} {count}')
  print(json.dumps({k: v for k, v in result.items() if not isinstance(v, int)}, indent=1))


if __name__ == '__main__':
  main()
