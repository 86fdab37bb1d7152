"""A user's Flax model with BatchNorm and dropout: member i is the same whatever M and the mesh.

BatchNorm's batch statistics are over a member's whole batch (all 'data' shards) and
dropout keys come from (seed, member, step), so only rounding separates the runs.

The three tests read one module-scoped reference run (4 members on one device) and each
trains at most one run of its own, so each pays for about one training: the first the
reference, the second the 6-member 2 x 2 run, the third the dropout-off run.
"""

import json
import sys
from pathlib import Path

import jax
import ml_collections
import numpy as np
import pytest

import dist_ens

pytest.importorskip('flax')
ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # examples/ is importable from the repository root.
  sys.path.insert(0, str(ROOT))
TOL = 2e-4  # Rounding from other vmap widths and data splits, after 12 steps.


def _run(workdir, members, member, data, dropout=0.1, load=True, steps=12):
  config = dist_ens.load_config(ROOT / 'configs' / 'default.py')
  config.model.factory = 'examples.flax_linen_resnet:make_model'
  config.model.kwargs = ml_collections.ConfigDict(dict(channels=4, num_blocks=1,
                                                       dropout_rate=dropout))
  config.num_members, config.data.batch_size = members, 64
  config.optim.learning_rate = 1e-2
  config.train.steps, config.train.log_every, config.train.eval_every = steps, 6, 0
  config.checkpoint.every = steps
  # No joint evaluation (its own programs) and jsonl events only: nothing here reads them.
  config.eval.joint_tau, config.writers = 0, ('jsonl',)
  config.mesh.member, config.mesh.data = member, data
  final = dist_ens.train(config, str(workdir), devices=jax.devices()[:member * data])
  if not load:
    return final, None
  ensemble = dist_ens.Ensemble.load(workdir, devices=jax.devices()[:1])
  return final, jax.tree.map(np.asarray, ensemble.model_state)


@pytest.fixture(scope='module')
def reference(tmp_path_factory):
  """(final metrics, model state as numpy, workdir) of 4 members on one device, 12 steps
  with dropout."""
  workdir = tmp_path_factory.mktemp('invariance') / 'ref'
  final, state = _run(workdir, 4, 1, 1)
  return final, state, workdir


def _assert_members_match(a, b, members):
  np.testing.assert_allclose(np.asarray(a[0]['members']['nll'])[members],
                             np.asarray(b[0]['members']['nll'])[members], atol=TOL)
  jax.tree.map(lambda x, y: np.testing.assert_allclose(x[members], y[members], atol=TOL),
               a[1], b[1])


def test_batchnorm_running_statistics_are_per_member(reference):
  stats = jax.tree.leaves(reference[1])
  assert stats and not np.allclose(stats[0][0], stats[0][1])  # Per-member running stats.


def test_batchnorm_and_dropout_members_do_not_depend_on_m_or_the_mesh(tmp_path, reference):
  # One run for both: M = 6 (3 members a device, not 4) on a 2 x 2 mesh (each member's
  # batch split over 'data'); its members 0-3 are the reference's.
  _assert_members_match(_run(tmp_path / 'six', 6, 2, 2), reference, slice(0, 4))


def test_dropout_is_on_in_training(tmp_path, reference):
  # Without dropout the members' training losses differ, over the first 6 steps (the
  # reference's first logged losses; 6 steps, not 12, of this run): the configs differ in
  # the dropout rate alone, so equal losses would mean dropout was off.
  _run(tmp_path / 'nodrop', 4, 1, 1, dropout=0.0, load=False, steps=6)
  plain, dropped = (_first_losses(workdir) for workdir in (tmp_path / 'nodrop', reference[2]))
  assert not np.allclose(plain, dropped, atol=1e-3), (plain, dropped)


def _first_losses(workdir):
  """The members' mean training loss over steps 1-6, as the run logged it at step 6."""
  events = [json.loads(line) for line in (workdir / 'metrics.jsonl').read_text().splitlines()]
  [first] = [e for e in events if e.get('split') == 'train' and e['step'] == 6]
  assert first['steps_averaged'] == 6
  return np.asarray(first['members']['loss'])
