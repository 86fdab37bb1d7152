"""workdir/laplace.npz: the last-layer Laplace posteriors a run fitted (config.eval.laplace),
which Ensemble.load reads so that predict(x, laplace=True) predicts with them.

An uncompressed numpy .npz, written once after training by process 0 (atomically, as
final_metrics.json: io/run_files.py), beside final_metrics.json and checkpoints/. Not an
orbax checkpoint: it is small next to the members (kron: F1^2 + C^2 floats per member,
diag: (F+1) C; full: ((F+1) C)^2, which the run holds per member anyway), every process
reads it whole, and numpy alone opens it. Keys (M members, F1 = features + 1, C
classes, P = F1 C):

  format            a one-line description of the file
  kind              'last_layer_diag' | 'last_layer_kron' | 'last_layer_full'
  samples           weight draws per member of the predictive; 0: the probit approximation
  kernel            the output kernel's '/'-joined path in a member's params
  step              the checkpoint step the posteriors were fitted on
  prior_precision   [M] float32, the chosen delta of each member
  q, lam            full: [M, P, P], [M, P] the GGN's eigenbasis; diag: lam [M, P] its
                    diagonal; kron: empty
  q_a, lam_a        kron: [M, F1, F1], [M, F1] the eigenbasis of A = sum psi psi^T
  q_g, lam_g        kron: [M, C, C], [M, C] that of G, the mean softmax Hessian
The posterior precision is (the GGN + delta I); dist_ens/eval/laplace.py has the math.

Where the members are several stacks of their own architectures (docs/groups.md), each
stack has its own fit (its head has its own width): `groups` holds their number G,
format/kind/samples/step are shared, and the per-member keys (kernel, prior_precision, the
posterior's) are given per stack as `group{g}/kernel` ..., [count] of stack g's members,
with `group{g}/first_member`, its first member's id.
"""

import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from dist_ens.eval import laplace
from dist_ens.eval.laplace_predictive import LaplaceFit
from dist_ens.io.run_files import write_npz

FILE = 'laplace.npz'
_FORMAT = ('dist_ens last-layer Laplace: per member, precision = GGN (eigenbasis q/lam, or '
           'q_a/lam_a kron q_g/lam_g) + prior_precision * I; see evaluators/laplace_file.py')


def write(workdir: str | os.PathLike, fits: Sequence[LaplaceFit]) -> None:
  """Writes a run's fits (one per stack, in id order) to
  workdir/laplace.npz (process 0 only; numpy arrays on every host)."""
  shared = {'format': np.asarray(_FORMAT), 'kind': np.asarray(fits[0].kind),
            'samples': np.asarray(fits[0].samples, np.int64),
            'step': np.asarray(fits[0].step, np.int64)}
  if len(fits) == 1 and not fits[0].first_member:
    write_npz(Path(workdir) / FILE, {**shared, **_stack_arrays(fits[0])})
    return
  grouped = {f'group{g}/{k}': v for g, fit in enumerate(fits)
             for k, v in {**_stack_arrays(fit), 'first_member': np.asarray(
                 fit.first_member, np.int64)}.items()}
  write_npz(Path(workdir) / FILE, {**shared, 'groups': np.asarray(len(fits), np.int64),
                                   **grouped})


def _stack_arrays(fit: LaplaceFit) -> dict[str, np.ndarray]:
  """The keys of one stack's fit (its members' kernel name, prior precisions, posterior)."""
  arrays = {name: np.asarray(a, np.float32) for name, a in fit.posterior._asdict().items()}
  return {'kernel': np.asarray(fit.kernel),
          'prior_precision': np.asarray(fit.prior_precision, np.float32), **arrays}


def read(workdir: str | os.PathLike) -> tuple[LaplaceFit, ...] | None:
  """workdir/laplace.npz as the run's fits (one per stack),
  or None where the run wrote none."""
  path = Path(workdir) / FILE
  if not path.is_file():
    return None
  with np.load(path, allow_pickle=False) as saved:
    prefixes = ([f'group{g}/' for g in range(int(saved['groups']))] if 'groups' in saved
                else [''])
    return tuple(LaplaceFit(
        kind=str(saved['kind']), samples=int(saved['samples']),
        kernel=str(saved[p + 'kernel']), step=int(saved['step']),
        prior_precision=saved[p + 'prior_precision'],
        posterior=laplace.Posterior(*(saved[p + f] for f in laplace.Posterior._fields)),
        first_member=int(saved[p + 'first_member']) if p else 0) for p in prefixes)
