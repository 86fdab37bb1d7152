"""README.md's Python snippets run as written, and the README and docs/ hold together.

Every ```python block of README.md runs ALONE (a reader pastes one, not the page: issue 62
item 8), each in a process of its own with fresh globals (forked from one interpreter that
has imported what the snippets' training imports: _FORK_A_PROCESS_PER_SNIPPET), from the
repository root (the snippets use relative paths such as configs/default.py and
examples.plain_jax), as a script file outside the repository: `python /elsewhere/snippet.py`
puts the script's folder on sys.path, not the cwd, the harder case for
'examples.plain_jax:...' import paths. A snippet runs on one CPU device unless it states the
XLA_FLAGS it needs (`XLA_FLAGS=...` in a comment), and compiles as the other tests do
(support.FAST_COMPILE). '/tmp/' workdirs are redirected into pytest's tmp_path so reruns
start fresh. A block preceded by the comment `<!-- not-run -->` is left out: that is only
for blocks that need hardware or downloads we do not have here (a GPU cluster, a TPU pod, a
TFDS dataset). Shell blocks are never run; the CLI has its own tests (tests/test_cli.py,
tests/test_train.py runs the install command's training).
"""

import ast
import json
import os
import queue
import re
import shlex
import subprocess
import sys
import threading
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
import support

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / 'README.md'
NOT_RUN = '<!-- not-run -->'
_FENCE = re.compile(r'^```(\w*)\s*$')


def code_blocks(text: str) -> list[tuple[str, str, bool]]:
  """(language, code, marked not-run) for every fenced block, in order."""
  blocks, lines, i = [], text.splitlines(), 0
  while i < len(lines):
    match = _FENCE.match(lines[i])
    if not match:
      i += 1
      continue
    previous = next((l.strip() for l in reversed(lines[:i]) if l.strip()), '')
    start = i + 1
    i = start
    while i < len(lines) and lines[i].strip() != '```':
      i += 1
    blocks.append((match.group(1), '\n'.join(lines[start:i]), previous == NOT_RUN))
    i += 1
  return blocks


def python_blocks() -> list[str]:
  """The README's ```python blocks that run here, in order."""
  return [code for lang, code, skip in code_blocks(README.read_text())
          if lang == 'python' and not skip]


def stated_xla_flags(code: str) -> list[str]:
  """The XLA flags a snippet says it needs, e.g. `# (one CPU: XLA_FLAGS=--xla_force_...=8`."""
  return re.findall(r'XLA_FLAGS=(--\S+?)[)\s]', code + '\n')


def test_readme_has_python_blocks_that_state_their_flags():
  blocks = python_blocks()
  assert len(blocks) >= 5, 'README.md lost its python blocks'
  # The member x model mesh needs 8 devices: the snippet says so, and the test reads it there.
  assert stated_xla_flags(next(b for b in blocks if 'mesh.model' in b)) == [
      '--xla_force_host_platform_device_count=8']


# Each snippet in a process of its own, as `python /elsewhere/readme_snippet_<i>.py` runs it,
# for the price of one interpreter's imports (1.6 of a snippet's 2.6-4.5 CPU s; the file took
# 29-36 CPU s with a fresh interpreter per snippet, 6-7 more than this). One child (the
# server) imports the modules the snippets import, records what is loaded then (what a fresh
# process has after their imports), imports what their dist_ens.train loads (JAX, optax,
# orbax, dist_ens's modules) without starting a JAX backend, and then forks a process for each
# snippet index a test writes to its stdin, answering with the index and its exit status:
# each test runs its own snippet (and pays its own time). XLA reads XLA_FLAGS when the first
# backend starts, so each fork runs with the flags its snippet states. The fork runs the
# snippet as __main__ with fresh globals (a name it does not import or define fails, as
# pasted alone), its script's folder first on sys.path and nothing of the repository there
# (-P; the sys.path of `python script`), and exits as Python exits (an uncaught exception:
# its traceback on stderr, status 1). What a fork does not reproduce is the modules loaded
# before the snippet's first line: a snippet that reached a submodule by attribute without
# importing it (`import jax`, then `jax.experimental.multihost_utils`) could run here and
# fail pasted alone; reached_unloaded_submodules finds those.
_FORK_A_PROCESS_PER_SNIPPET = r"""
import importlib, json, os, runpy, signal, sys
out, limit_s = sys.argv[1], int(sys.argv[2])
with open(os.path.join(out, 'snippets.json')) as f:
  snippets, imports = json.load(f)
for name in imports:  # What the snippets import themselves; then what a fresh process has.
  importlib.import_module(name)
fresh = sorted(sys.modules)
import dist_ens
dist_ens.train, dist_ens.Ensemble, dist_ens.data.from_arrays  # Their modules (PEP 562).
from jax._src import xla_bridge
assert not xla_bridge._backends, 'a backend started before the fork: XLA_FLAGS would be read'
with open(os.path.join(out, 'modules.json'), 'w') as f:
  json.dump({'fresh': fresh, 'forked': sorted(sys.modules)}, f)
answers = os.fdopen(os.dup(1), 'w')  # The requests' answers; the forks get files as 0, 1, 2.
print('ready', file=answers, flush=True)
for line in sys.stdin:
  i = int(line)
  script, xla_flags = snippets[i]
  sys.stdout.flush()
  sys.stderr.flush()
  pid = os.fork()
  if pid == 0:  # The snippet's process: from here on as `python script` runs it.
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
    for fd, stream in ((1, 'stdout'), (2, 'stderr')):
      os.dup2(os.open(os.path.join(out, f'{i}.{stream}'), os.O_WRONLY | os.O_CREAT), fd)
    signal.alarm(limit_s)
    os.environ['XLA_FLAGS'] = xla_flags
    sys.path.insert(0, os.path.dirname(script))
    sys.argv = [script]
    runpy.run_path(script, run_name='__main__')
    sys.exit(0)
  status = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
  print(json.dumps([i, status]), file=answers, flush=True)
"""
_SNIPPET_LIMIT_S = 240


class _SnippetServer:
  """The fork server above, started once for the module; run(i) runs snippet i in a fork."""

  def __init__(self, root: Path):
    self.snippets = []
    for index, code in enumerate(python_blocks()):
      code = code.replace("'/tmp/", f"'{root}/")
      script = root / 'elsewhere' / f'readme_snippet_{index}.py'
      script.parent.mkdir(exist_ok=True)
      script.write_text(code)
      self.snippets.append(
          (str(script), ' '.join((*support.FAST_COMPILE, *stated_xla_flags(code)))))
    self.out = root / 'runs'
    self.out.mkdir()
    (self.out / 'snippets.json').write_text(json.dumps([self.snippets, sorted(set().union(
        *(imported_modules(code) for code in python_blocks())))]))
    env = {k: v for k, v in os.environ.items() if k not in ('XLA_FLAGS', 'PYTHONPATH')}
    env.update(JAX_PLATFORMS='cpu', MPLBACKEND='Agg')
    self.stderr = root / 'server.stderr'
    # `timeout` bounds the whole server; each snippet is bounded by its own alarm.
    limit_s = _SNIPPET_LIMIT_S * len(self.snippets) + 60
    self.process = subprocess.Popen(
        ['timeout', '-k', '5', str(limit_s), sys.executable, '-P', '-c',
         _FORK_A_PROCESS_PER_SNIPPET, str(self.out), str(_SNIPPET_LIMIT_S)],
        cwd=ROOT, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        stderr=self.stderr.open('w'), text=True)
    self.answers = queue.Queue()
    threading.Thread(target=lambda: [self.answers.put(line) for line in self.process.stdout],
                     daemon=True).start()
    assert self._answer(120) == 'ready', self._server_said()
    self.modules = {k: set(v) for k, v in
                    json.loads((self.out / 'modules.json').read_text()).items()}

  def _answer(self, timeout_s: float) -> str:
    try:
      return self.answers.get(timeout=timeout_s).strip()
    except queue.Empty:
      return f'no answer within {timeout_s} s'

  def _server_said(self) -> str:
    return (f'the fork server: status {self.process.poll()}, stderr:\n'
            + self.stderr.read_text()[-5000:])

  def run(self, index: int) -> tuple[str, int, str, str]:
    """(script, exit status, stdout, stderr) of snippet `index` run alone."""
    self.process.stdin.write(f'{index}\n')
    self.process.stdin.flush()
    answer = self._answer(_SNIPPET_LIMIT_S + 30)
    assert answer.startswith('['), (answer, self._server_said())
    got, status = json.loads(answer)
    assert got == index, (got, index)
    # Nothing on the server's own stderr: the imports a fresh process makes print nothing.
    assert not self.stderr.read_text(), self._server_said()
    return (self.snippets[index][0], status, (self.out / f'{index}.stdout').read_text(),
            (self.out / f'{index}.stderr').read_text())

  def close(self) -> None:
    self.process.stdin.close()
    try:
      self.process.wait(timeout=30)
    except subprocess.TimeoutExpired:  # `timeout` passes SIGTERM on, then kills.
      self.process.terminate()
      self.process.wait()


@pytest.fixture(scope='module')
def snippet_server(tmp_path_factory):
  """The fork server of the README's python blocks. Each block is written to a script outside
  the repository (its '/tmp/' workdirs moved under pytest's tmp path) and runs from the
  repository root on one CPU device unless it states the XLA_FLAGS it needs, compiling as
  the other tests do (support.FAST_COMPILE). `.modules`: {'fresh': a fresh process's after
  the snippets' imports, 'forked': those the forks start with}."""
  server = _SnippetServer(tmp_path_factory.mktemp('readme_snippets'))
  yield server
  server.close()


def imported_modules(code: str) -> set[str]:
  """The modules `code`'s import statements import (absolute ones)."""
  return {alias.name for node in ast.walk(ast.parse(code)) if isinstance(node, ast.Import)
          for alias in node.names} | {node.module for node in ast.walk(ast.parse(code))
                                      if isinstance(node, ast.ImportFrom) and node.level == 0}


def reached_unloaded_submodules(code: str, modules: dict[str, set]) -> set[str]:
  """The submodules `code` reaches by attribute from a module it imports (`jax.experimental.
  multihost_utils` after `import jax`) without importing them, that a fresh process has not
  loaded after the snippets' imports and the fork server has: where a fork would hide a
  missing import. (One that works pasted alone only because a call before it loaded the
  submodule is reported too: the snippet should import what it reaches.) Not dist_ens's:
  its subpackages load on first use (PEP 562)."""
  tree, imported, bound = ast.parse(code), imported_modules(code), {}  # bound: name -> module
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      for alias in node.names:
        bound[alias.asname or alias.name.split('.')[0]] = (
            alias.name if alias.asname else alias.name.split('.')[0])
    elif isinstance(node, ast.ImportFrom) and node.level == 0:
      for alias in node.names:
        if f'{node.module}.{alias.name}' in modules['forked']:
          bound[alias.asname or alias.name] = f'{node.module}.{alias.name}'
  hidden = modules['forked'] - modules['fresh']
  reached = set()
  for node in ast.walk(tree):
    chain = []
    while isinstance(node, ast.Attribute):
      chain.insert(0, node.attr)
      node = node.value
    if not (chain and isinstance(node, ast.Name) and node.id in bound):
      continue
    dotted = bound[node.id]
    for attr in chain:
      dotted += '.' + attr
      if (dotted in hidden and not dotted.startswith('dist_ens.')
          and not any(m == dotted or m.startswith(dotted + '.') for m in imported)):
        reached.add(dotted)
  return reached


@pytest.mark.parametrize('index', range(len(python_blocks())))
def test_readme_python_block_runs_alone(index, snippet_server):
  script, status, stdout, stderr = snippet_server.run(index)
  code = python_blocks()[index]
  assert status == 0, (
      f'README.md python block {index} failed alone (script: {script}):\n'
      f'{code}\n{stdout[-3000:]}\n{stderr[-5000:]}')
  assert not reached_unloaded_submodules(code, snippet_server.modules), (
      f'README.md python block {index} reaches modules it does not import:\n{code}')


def test_the_check_of_unimported_submodules_finds_them(snippet_server):
  reach = lambda code: reached_unloaded_submodules(code, snippet_server.modules)
  use = 'jax.experimental.multihost_utils.sync_global_devices("x")'
  assert reach(f'import jax\n{use}') == {'jax.experimental.multihost_utils'}
  assert reach(f'from jax import experimental as ex\n{use.replace("jax.experimental", "ex")}'
               ) == {'jax.experimental.multihost_utils'}
  assert not reach(f'import jax\nimport jax.experimental.multihost_utils\n{use}')
  assert not reach('import jax.experimental.multihost_utils as m\nm.sync_global_devices("x")')
  # Loaded by the snippets' own imports in a fresh process too; dist_ens's load on use.
  assert not reach('import numpy as np, jax\nnp.random.default_rng(0); jax.nn.relu(1.0)')
  assert not reach('import dist_ens\ndist_ens.data.from_arrays')


def test_readme_keeps_the_two_commands_and_stays_short():
  text = README.read_text()
  assert ('pip install -e . && dist-ens --config=configs/default.py '
          '--workdir=/tmp/dist_ens_run') in text
  assert "pip install -e '.[test]' && pytest -q" in text
  assert len(text.splitlines()) <= 320, 'README.md should stay a user guide; move detail to docs/'
  assert 'RESULTS_TABLE' not in text, 'paste the table of benchmarks/readme_results.py'


def test_links_in_readme_and_docs_resolve():
  broken = []
  for page in [README, *sorted((ROOT / 'docs').glob('*.md'))]:
    for target in re.findall(r'\]\(([^)\s]+)\)', page.read_text()):
      if re.match(r'[a-z]+://', target) or target.startswith('#'):
        continue
      path = (page.parent / target.split('#')[0]).resolve()
      if not path.exists():
        broken.append(f'{page.relative_to(ROOT)}: {target}')
  assert not broken, f'links to missing files: {broken}'


def test_mesh_picture_is_valid_svg():
  root = ET.parse(ROOT / 'docs' / 'mesh.svg').getroot()
  assert root.tag.endswith('svg')
  assert 'docs/mesh.svg' in README.read_text()


def test_the_accelerator_extras_the_readme_names_install_jaxs_own():
  # `pip install -e '.[cuda12]'` etc. cannot be tried here (no GPU, no such wheels needed):
  # check that every extra the README tells GPU/TPU users to install exists and pulls
  # jax's own extra of the same name, at least the supported jax.
  import tomllib  # pylint: disable=g-import-not-at-top
  extras = tomllib.loads((ROOT / 'pyproject.toml').read_text())['project'][
      'optional-dependencies']
  named = set(re.findall(r"'\.\[(\w+)\]'", (ROOT / 'README.md').read_text()))
  accelerators = named & {'cuda12', 'cuda13', 'tpu'}
  assert accelerators == {'cuda12', 'cuda13', 'tpu'}, named
  for extra in accelerators:
    assert extras[extra] == [f'jax[{extra}]>=0.10.2'], (extra, extras.get(extra))


# Repository paths the README names: a relative path with a folder (`configs/default.py`,
# `benchmarks/results/x.json`, `examples/`), a script by its bare name (`x.sh`, `x.py`), or a
# module run with `python -m`. Not paths of the repository: placeholders in capitals
# (WORKDIR/report/), absolute paths, URLs, a run's own files (final_metrics.json, members.csv),
# and slashes between words (BERT/RoBERTa, 50/90/95: no file extension, no trailing '/').
_PATH = re.compile(r'(?<![\w/:.~$-])((?:[a-z_.][\w.-]*/)+(?:[\w.-]+\.(?:py|sh|sbatch|json|md|svg|'
                   r'toml|csv|txt))?|[\w-]+\.(?:py|sh|sbatch))(?![\w/])')
_MODULE = re.compile(r'python -m ([\w.]+)')


def readme_repo_paths(text: str) -> set[str]:
  paths = {p for p in _PATH.findall(text) if p.endswith('/') or '.' in p.rsplit('/', 1)[-1]}
  modules = {m.replace('.', '/') for m in _MODULE.findall(text)}
  return paths | {m + '.py' if not (ROOT / m).is_dir() else m for m in modules}


def test_every_repository_path_the_readme_names_exists():
  named = readme_repo_paths(README.read_text())
  # The extractor finds what it should (three of these lacked benchmarks/, issue 62 item 8).
  assert {'benchmarks/results/readme_results.json', 'benchmarks/results/default_run_gpu.json',
          'benchmarks/gpu_session.sh', 'configs/default.py', 'examples/',
          'benchmarks/readme_results.py', 'launch/tpu_pod.sh'} <= named, sorted(named)
  assert not readme_repo_paths('see WORKDIR/report/, BERT/RoBERTa, 50/90/95, /tmp/x.py, '
                               'gs://b/r.json, members.csv')
  missing = sorted(p for p in named if not (ROOT / p).exists())
  assert not missing, f'README.md names paths the repository does not have: {missing}'


def test_the_tpu_launcher_installs_the_jax_the_readme_supports():
  # It pinned jax[tpu]>=0.10,<0.11 of its own while the README supports 0.10.2 to 0.12
  # (issue 62 item 8): it installs the package's tpu extra, whose pin the test above checks.
  done = subprocess.run(['bash', str(ROOT / 'launch' / 'tpu_pod.sh'), '--name', 'pod', '--zone',
                         'z', '--repo-dir', 'my dir', '--setup', '--dry-run', '--',
                         '--workdir=x'], capture_output=True, text=True, timeout=30)
  assert done.returncode == 0, done.stderr
  [install] = [line for line in done.stdout.splitlines() if 'pip install' in line]
  command = shlex.split(install)[-1].removeprefix('--command=')
  assert shlex.split(command) == ['pip', 'install', '-e', 'my dir[tpu]'], install


def test_readme_results_writes_the_tracked_file_only_when_asked_and_removes_its_runs(
    tmp_path, monkeypatch, capsys):
  # It rewrote benchmarks/results/readme_results.json on every run, a quick --steps look
  # too, and left its workdirs (14 MB) in /tmp (issue 62 item 8). Training is faked: what is
  # tested is where things are written.
  import json  # pylint: disable=g-import-not-at-top
  import tempfile  # pylint: disable=g-import-not-at-top
  from benchmarks import readme_results  # pylint: disable=g-import-not-at-top
  tracked = ROOT / 'benchmarks' / 'results' / 'readme_results.json'
  before, workdirs = tracked.read_bytes(), []

  def train(config, workdir):
    workdirs.append(Path(workdir))
    (Path(workdir) / 'checkpoints').mkdir()  # What a run leaves.
    metrics = readme_results.METRICS
    return {'train_seconds': 1.0, 'frozen_members': [],
            'members': {m: [0.5] * config.num_members for m in metrics},
            'ensemble': {m: 0.6 for m in metrics}}

  monkeypatch.setattr(readme_results.dist_ens, 'train', train)
  (tmp_path / 'tmp').mkdir()
  monkeypatch.setattr(tempfile, 'tempdir', str(tmp_path / 'tmp'))
  monkeypatch.setattr(sys, 'argv', ['readme_results', '--configs', 'default', '--steps', '5'])
  readme_results.main()
  assert tracked.read_bytes() == before
  assert workdirs and not list((tmp_path / 'tmp').iterdir())
  assert 'left as it was (--write updates it)' in capsys.readouterr().out
  out = tmp_path / 'readme_results.json'
  monkeypatch.setattr(sys, 'argv', [*sys.argv, '--write', '--out', str(out)])
  readme_results.main()
  assert [(r['config'], r['steps']) for r in json.loads(out.read_text())['rows']] == [
      ('configs/default.py', 5)]
  assert len(workdirs) == 2 and not list((tmp_path / 'tmp').iterdir())
