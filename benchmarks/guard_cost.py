"""What dist_ens's non-finite guard costs each member form, against the Python loop.

  python -m benchmarks.guard_cost                       # big MLP, M = 16 and 64 (~2 min)
  python -m benchmarks.guard_cost --models mlp_small --members 16

dist_ens's step freezes a member whose loss or gradient is not finite (core/step.py,
_nonfinite): before the optimizer runs, every gradient is read once more to check it.
This writes a candidate copy of the installed core/step.py whose check reads the loss
only (`loss_only`), and times, side by side in one run of benchmarks/throughput.py:
  loop, loop+guard        the Python loop without and with the full check;
  map, map@loss_only      dist_ens's 'map' with the full check and with the loss's only;
  vmap, vmap@loss_only    the same for 'vmap'.
The candidate is for measurement only: a gradient can be NaN or infinite while the loss
is finite (tests/test_step.py has such cases), and the full check is what dist_ens runs.
Writes benchmarks/results/guard_cost.json (throughput.py's format, with harness.run_header's
fields).
"""

import argparse
import tempfile
from pathlib import Path

from benchmarks import throughput

ROOT = Path(__file__).resolve().parents[1]

FULL_CHECK = '  return ~(jnp.isfinite(result.loss) & _all_finite(result.grads))\n'
LOSS_ONLY = '  return ~jnp.isfinite(result.loss)\n'


def write_candidate(folder: Path) -> Path:
  """A copy of the installed core/step.py whose _nonfinite reads the loss only."""
  source = (ROOT / 'dist_ens' / 'core' / 'step.py').read_text()
  if source.count(FULL_CHECK) != 1:
    raise RuntimeError('core/step.py no longer has the check this script replaces: '
                       f'{FULL_CHECK.strip()!r}')
  path = folder / 'step.py'
  path.write_text(source.replace(FULL_CHECK, LOSS_ONLY))
  return path


def main(argv: list[str] | None = None) -> None:
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument('--models', default='mlp_big')
  parser.add_argument('--members', default='16,64')
  parser.add_argument('--repeats', default='7')
  parser.add_argument('--out', default=str(ROOT / 'benchmarks' / 'results' / 'guard_cost.json'))
  args = parser.parse_args(argv)
  with tempfile.TemporaryDirectory(prefix='guard_cost_') as folder:
    candidate = write_candidate(Path(folder))
    throughput.main(['--models', args.models, '--members', args.members, '--no_torch',
                     '--repeats', args.repeats, '--candidate', f'loss_only={candidate}',
                     '--variants', 'loop,loop+guard,map,map@loss_only,vmap,vmap@loss_only',
                     '--out', args.out])


if __name__ == '__main__':
  main()
