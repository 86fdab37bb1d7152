"""What each process of test_many_processes' runs reads from its input pipeline.

count_reads makes data.Batches read through a counting wrapper and write what it read to
OUT/reads_P.json (P: the process index) when it closes: in the test's own process (the
one-process reference) and, as the Python that launch/local.sh starts, in each process
of the multi-process run:

  python tests/many_processes_reads.py -m dist_ens.main FLAGS...   (OUT in $DIST_ENS_READS_DIR)

It imports only what dist_ens.main imports anyway (no pytest, no test helpers): each of
the run's processes pays for its own imports.
"""

import json
import os
import sys
from pathlib import Path

import numpy as np

READS_DIR = 'DIST_ENS_READS_DIR'


class _Counted:
  """A Source that records the indices and bytes of every read."""

  def __init__(self, source, reads: list):
    self._source, self._reads = source, reads

  @property
  def num_examples(self) -> int:
    return self._source.num_examples

  def read(self, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    x, y = self._source.read(indices)
    self._reads.append((np.array(indices), x.nbytes + y.nbytes))
    return x, y


def count_reads(out_dir: Path, set_attr=setattr) -> None:
  """Makes the train input pipeline (data.Batches) read through _Counted and, when it is
  closed, write what it read to out_dir/reads_P.json (P: the process index)."""
  import jax  # pylint: disable=g-import-not-at-top
  from dist_ens.data import pipeline  # pylint: disable=g-import-not-at-top
  init, close = pipeline.Batches.__init__, pipeline.Batches.close
  reads = []

  def counted_init(self, source, *args, **kwargs):
    init(self, _Counted(source, reads), *args, **kwargs)

  def counted_close(self):
    close(self)  # Joins the prefetching thread: `reads` is complete.
    Path(out_dir, f'reads_{jax.process_index()}.json').write_text(json.dumps({
        'rows': [len(i) for i, _ in reads], 'bytes': [b for _, b in reads],
        'first': reads[0][0].tolist(), 'examples': self.stats.examples}))

  set_attr(pipeline.Batches, '__init__', counted_init)
  set_attr(pipeline.Batches, 'close', counted_close)


if __name__ == '__main__':
  if sys.argv[1:3] != ['-m', 'dist_ens.main']:  # local.sh's other uses of $PYTHON.
    os.execv(sys.executable, [sys.executable, *sys.argv[1:]])
  count_reads(Path(os.environ[READS_DIR]))
  from dist_ens import main  # pylint: disable=g-import-not-at-top
  sys.argv = ['dist-ens', *sys.argv[3:]]
  main.entry()
