"""What every benchmark's results file opens with, and small helpers to fit what it measured.

  from benchmarks import harness          # python -m benchmarks.NAME, from the repository root
  header = harness.run_header()           # date, commit, load average, machine, packages, command
  for r, name in harness.rotating_rounds(variants, rounds):
    times[name].append(measure(name))
  ...
  harness.write_results(path, {**header, 'rows': rows, 'load_average_end': harness.load_average()})

The machine is shared (a test suite, other developers): absolute times move by up to 2x
between runs, so a results file carries the load average it ran under, and a benchmark
quotes ratios of figures measured side by side in one run.
"""

import datetime
import importlib.metadata
import json
import math
import os
import platform
import subprocess
import sys
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any, TypeVar

ROOT = Path(__file__).resolve().parents[1]
T = TypeVar('T')


def git_commit() -> dict[str, Any]:
  """The checked-out commit and whether the work tree differs from it (the figures are
  then of uncommitted code)."""
  def git(*args: str) -> str:
    return subprocess.run(['git', '-C', str(ROOT), *args], capture_output=True, text=True,
                          check=False).stdout.strip()
  return {'commit': git('rev-parse', 'HEAD') or None,
          'dirty': bool(git('status', '--porcelain', '--untracked-files=no'))}


def load_average() -> list[float]:
  """The 1, 5 and 15 minute load averages ([] where the OS has none)."""
  try:
    return [round(x, 2) for x in os.getloadavg()]
  except OSError:
    return []


def machine() -> dict[str, Any]:
  """CPU model, cores and memory of this machine, and the Python running."""
  cpu = platform.processor()
  try:
    with open('/proc/cpuinfo') as f:
      cpu = next((line.split(':', 1)[1].strip() for line in f if line.startswith('model name')),
                 cpu)
  except OSError:
    pass
  memory_gb = None
  try:
    with open('/proc/meminfo') as f:
      kb = next(int(line.split()[1]) for line in f if line.startswith('MemTotal:'))
    memory_gb = round(kb / 2**20, 1)
  except (OSError, StopIteration):
    pass
  return {'node': platform.node(), 'cpu': cpu, 'arch': platform.machine(),
          'cores': os.cpu_count(), 'memory_gib': memory_gb, 'python': platform.python_version()}


# The packages whose versions decide a benchmark's figures (XLA's code generation is
# jaxlib's): a figure that moves between two runs of one commit on one machine moved with
# them, or with XLA_FLAGS.
PACKAGES = ('jax', 'jaxlib', 'numpy', 'optax', 'orbax-checkpoint', 'grain', 'tensorflow-datasets')


def packages() -> dict[str, str | None]:
  """The installed version of each of PACKAGES (None: not installed), and XLA_FLAGS."""
  def version(name: str) -> str | None:
    try:
      return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
      return None
  return {**{name: version(name) for name in PACKAGES},
          'XLA_FLAGS': os.environ.get('XLA_FLAGS', '')}


def command(argv: Sequence[str] | None = None) -> str:
  """The command line that ran this process, as a reader would retype it: under
  `python -m benchmarks.NAME` sys.argv[0] is the file's absolute path, so it is given back
  as `-m benchmarks.NAME` (the path differs between checkouts, the module name does not)."""
  argv = list(sys.argv if argv is None else argv)
  spec = getattr(sys.modules.get('__main__'), '__spec__', None)
  if argv and argv[0] == sys.argv[0] and spec is not None and spec.name != '__main__':
    argv[0] = '-m ' + spec.name
  return 'python ' + ' '.join(argv)


def run_header(argv: Sequence[str] | None = None) -> dict[str, Any]:
  """date (UTC), commit, load average at the start, machine, package versions and the
  command line."""
  return {'date': datetime.datetime.now(datetime.timezone.utc).isoformat(timespec='seconds'),
          **git_commit(), 'load_average_start': load_average(), 'machine': machine(),
          'packages': packages(), 'command': command(argv)}


def rotating_rounds(names: Iterable[T], rounds: int) -> Iterator[tuple[int, T]]:
  """(round, name) for `rounds` rounds that each visit every name once, round r starting
  at name r (mod their count): every name is measured early in some rounds and late in
  others, so a change in the machine's load, or a cache the previous name warmed, does not
  favour one of them."""
  names = list(names)
  for r in range(rounds if names else 0):
    for name in names[r % len(names):] + names[:r % len(names)]:
      yield r, name


def run_rounds(jobs: dict[str, Callable[[], T]], rounds: int,
               line: Callable[[int, str, T], str]) -> dict[str, list[T]]:
  """{name: its results, one a round}: every job once a round, in rotating_rounds' order,
  printing `line(round, name, result)` as each ends (a long benchmark shows its progress)."""
  results: dict[str, list[T]] = {name: [] for name in jobs}
  for r, name in rotating_rounds(jobs, rounds):
    results[name].append(jobs[name]())
    print(line(r, name, results[name][-1]), flush=True)
  return results


def write_results(path: str | Path, results: dict[str, Any]) -> Path:
  """Writes `results` as indented JSON (NaN as null: the file stays strict JSON)."""
  path = Path(path)
  path.parent.mkdir(parents=True, exist_ok=True)
  path.write_text(json.dumps(_strict(results), indent=1) + '\n')
  return path


def _strict(value: Any) -> Any:
  if isinstance(value, float) and not math.isfinite(value):
    return None
  if isinstance(value, dict):
    return {k: _strict(v) for k, v in value.items()}
  if isinstance(value, (list, tuple)):
    return [_strict(v) for v in value]
  return value


def log_slope(xs: Sequence[float], ys: Sequence[float]) -> float | None:
  """The least-squares slope of log y against log x: 0 flat, 1 linear, 2 quadratic.
  None with fewer than two positive points."""
  pairs = [(math.log(x), math.log(y)) for x, y in zip(xs, ys)
           if x and y and x > 0 and y > 0 and math.isfinite(y)]
  if len(pairs) < 2:
    return None
  mx = sum(p[0] for p in pairs) / len(pairs)
  my = sum(p[1] for p in pairs) / len(pairs)
  var = sum((p[0] - mx) ** 2 for p in pairs)
  return sum((p[0] - mx) * (p[1] - my) for p in pairs) / var if var else None


def growth(slope: float | None) -> str:
  """A log-log slope in words: 'flat' (< 0.25), 'sublinear' (< 0.8), 'linear' (<= 1.2),
  'superlinear' beyond; 'n/a' without one."""
  if slope is None:
    return 'n/a'
  if slope < 0.25:
    return 'flat'
  if slope < 0.8:
    return 'sublinear'
  return 'linear' if slope <= 1.2 else 'superlinear'


def state_size(config: Any) -> tuple[int, int]:
  """(parameters trained, train-state bytes on one device) of a run of `config`, as
  `dist-ens plan` lays the state out: a trained leaf is one with Adam moments (mu)."""
  import jax  # pylint: disable=g-import-not-at-top  (the results header needs neither)
  from dist_ens.run import mesh_layout
  from dist_ens.config import specs
  from dist_ens import data  # pylint: disable=g-import-not-at-top
  from dist_ens.run import assemble
  from dist_ens.parallel import placement  # pylint: disable=g-import-not-at-top
  dataset = data.load_dataset(config.data.name, specs.data_spec(config))
  parts = assemble.build_parts(config, mesh_layout.build_mesh(config, jax.devices()[:1]),
                               dataset.input_shape, dataset.num_classes)
  state = parts.abstract_state
  moments = jax.tree_util.tree_flatten_with_path(state.opt_state)[0]
  trained = sum(leaf.size for path, leaf in moments if '.mu' in jax.tree_util.keystr(path))
  size = placement.state_bytes_per_device(parts.layout.state_specs(state), state,
                                          parts.mesh.shape)
  return int(trained), int(size)
