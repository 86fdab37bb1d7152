"""Population-based training across two jax.distributed processes equals one process.

The exploit copies a member's whole train state along 'member' inside one compiled
gather; with hosts laid along 'member' a copy between members on different hosts is a
cross-process collective. Here the same PBT run trains as 2 processes x 4 CPU devices
and as this pytest process x 8 devices, on the same 4 x 2 mesh, and must agree on every
round's decisions, on each member's whole stacked state after every round (bit for bit:
params, Adam's moments and count, the frozen flag, model state where a model has any) and
on the saved checkpoint.

The learning rates put the weak members (1e-5 and the like) on mesh rows 2-3 and the
strong on rows 0-1, so the first round's bottom members copy top members held by the
other process; the test checks that from where each process's shards actually are.

This file is also the child each process runs:
`python tests/test_pbt_multiprocess.py child OUT PORT PROCESS_ID WORKDIR`.
"""

import hashlib
import json
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding

import dist_ens
from dist_ens.config.loading import load_config
from dist_ens.core.axes import MEMBER
from dist_ens.io.pretrained import read_orbax
from dist_ens.parallel import distributed, launch
from test_multihost import _env, _free_port, _kill_session, _start, _wait

ROOT = Path(__file__).resolve().parents[1]
STEPS, INTERVAL = 24, 8  # Rounds at steps 8 and 16 (none at the last step).
# Members 0-3 learn, 4-7 barely move: round 1's worst quarter is among 4-7, its best among 0-3.
RATES = [3e-3, 2e-3, 5e-3, 1e-3, 1e-5, 3e-5, 2e-5, 5e-5]
# A generous bound for two processes compiling and training on a loaded 2-core machine.
TIMEOUT_S = 300


def _config():
  config = load_config(ROOT / 'configs' / 'default.py')
  config.num_members = 8
  config.optim.learning_rate = RATES
  config.train.steps, config.train.log_every, config.train.eval_every = STEPS, INTERVAL, 0
  config.checkpoint.every = STEPS
  config.data.batch_size = 64
  config.data.validation_size = 200
  config.writers = ('jsonl',)
  # A (32,) MLP and no joint evaluation: less to compile and run in each of the three
  # processes; members at 1e-3 and up still pull away from those at 1e-5 by step 8.
  config.model.widths, config.eval.joint_tau = (32,), 0
  config.mesh.member, config.mesh.data, config.mesh.hosts_along = 4, 2, 'member'
  config.pbt.enabled, config.pbt.interval = True, INTERVAL
  return config


def _member_digests(state) -> dict[int, str]:
  """sha256 of each member's whole stacked state that this process holds in full.

  Built from the process's addressable shards only, so on a multi-process run it
  says both which members live on this process and what their bytes are.
  """
  stacked = [leaf for leaf in jax.tree.leaves(state)
             if leaf.ndim and isinstance(leaf.sharding, NamedSharding)
             and leaf.sharding.spec and leaf.sharding.spec[0] == MEMBER]
  members = stacked[0].shape[0]
  hashes = [hashlib.sha256() for _ in range(members)]
  held = set(range(members))
  for leaf in stacked:
    host, covered = np.zeros(leaf.shape, leaf.dtype), np.zeros(leaf.shape, bool)
    for shard in leaf.addressable_shards:
      host[shard.index] = np.asarray(shard.data)
      covered[shard.index] = True
    held &= {i for i in range(members) if covered[i].all()}
    for i in range(members):
      hashes[i].update(host[i].tobytes())
  return {i: hashes[i].hexdigest() for i in sorted(held)}


def _train(workdir: str) -> tuple[dict, dict[int, dict[int, str]]]:
  """dist_ens.train with the member digests right after each round's step (and the last)."""
  digests = {}

  def record(call):  # Runs after the step's PBT round (user actions come last).
    digests[call.step] = _member_digests(call.state)

  result = dist_ens.train(_config(), workdir, actions=[dist_ens.every(INTERVAL, record,
                                                                      at_end=False)])
  return result, digests


def _child(out: str, port: str, process_id: str, workdir: str) -> None:
  distributed.initialize(launch.Launch(coordinator_address=f'localhost:{port}',
                                            num_processes=2, process_id=int(process_id)))
  _, digests = _train(workdir)
  Path(out).write_text(json.dumps({'process_index': jax.process_index(), 'digests': digests}))


@pytest.fixture(scope='module')
def started(tmp_path_factory):
  """The two processes of `two`, started before `one` trains, which it does while they
  import JAX and meet; whatever is left of them is killed when the module ends."""
  tmp = tmp_path_factory.mktemp('pbt_two')
  port, outs = _free_port(), [tmp / f'child_{i}.json' for i in range(2)]
  procs = [_start(['timeout', '-k', '15', str(TIMEOUT_S - 20), sys.executable, __file__,
                   'child', str(outs[i]), str(port), str(i), str(tmp / 'w')], _env())
           for i in range(2)]
  yield tmp, outs, procs
  for proc in procs:
    _kill_session(proc)  # Only what a failure left running.


@pytest.fixture(scope='module')
def one(started, tmp_path_factory):
  """The reference: this pytest process, 1 process x 8 devices, the same 4 x 2 mesh."""
  del started  # Started first: see there.
  workdir = tmp_path_factory.mktemp('pbt_one') / 'w'
  result, digests = _train(str(workdir))
  return workdir, result, digests


@pytest.fixture(scope='module')
def two(started):
  """2 processes x 4 devices; per process, the members it held and their digests."""
  tmp, outs, procs = started
  for status, out in _wait(procs, TIMEOUT_S):  # Kills both and fails at the deadline.
    assert status == 0, out[-5000:]
  children = [json.loads(p.read_text()) for p in outs]
  assert [c['process_index'] for c in children] == [0, 1]
  digests = [{int(s): {int(m): h for m, h in d.items()} for s, d in c['digests'].items()}
             for c in children]
  return tmp / 'w', json.loads((tmp / 'w' / 'final_metrics.json').read_text()), digests


def _pbt_events(workdir: Path) -> list[dict]:
  events = [json.loads(line) for line in (workdir / 'metrics.jsonl').read_text().splitlines()]
  return [e for e in events if e['split'] == 'pbt']


def test_a_round_copies_members_between_processes(one, two):
  _, result, _ = one
  _, _, digests = two
  held = [set(d[INTERVAL]) for d in digests]  # Members whose every shard the process holds.
  assert held[0] | held[1] == set(range(8)) and not held[0] & held[1], held
  process_of = {m: p for p, members in enumerate(held) for m in members}
  rounds = result['pbt']['rounds']
  assert [r['step'] for r in rounds] == [INTERVAL, 2 * INTERVAL]
  copies = [(r['step'], src, dst) for r in rounds for dst, src in enumerate(r['sources'])
            if src != dst]
  assert len(copies) == 4, copies  # ceil(0.25 * 8) per round
  across = [c for c in copies if process_of[c[1]] != process_of[c[2]]]
  assert across, f'every copy stayed on one process: {copies}, layout {held}'


def test_rounds_hyperparameters_and_metrics_equal_one_process(one, two):
  one_dir, ref, _ = one
  two_dir, got, _ = two
  assert got['pbt'] == ref['pbt']  # Rounds (step, sources) and each member's lineage.
  assert got['hyperparameters'] == ref['hyperparameters']
  # Each round's logged validation values, sources and explored hyperparameters.
  assert _pbt_events(two_dir) == _pbt_events(one_dir)
  for metric in ('nll', 'accuracy', 'brier', 'ece'):
    assert got['members'][metric] == ref['members'][metric], metric
  assert got['ensemble']['nll'] == ref['ensemble']['nll']


def test_state_after_every_round_is_one_process_state_bit_for_bit(one, two):
  _, result, ref = one
  _, _, digests = two
  for step in (INTERVAL, 2 * INTERVAL, STEPS):
    merged = {**digests[0][step], **digests[1][step]}
    assert merged == ref[step], f'members differ at step {step}'
  for r in result['pbt']['rounds']:  # A copied member is its source, wherever each lives.
    merged = {**digests[0][r['step']], **digests[1][r['step']]}
    for dst, src in enumerate(r['sources']):
      assert merged[dst] == merged[src], (r['step'], dst, src)
    # And only those are equal: the digests tell members apart.
    assert len(set(merged.values())) == len(set(r['sources'])), r


def test_saved_checkpoint_equals_one_process_bit_for_bit(one, two):
  one_dir, _, _ = one
  two_dir, _, _ = two
  for item in ('model', 'optimizer'):  # Params, frozen flags, step; Adam's moments, count.
    a = read_orbax(one_dir / 'checkpoints' / str(STEPS) / item)
    b = read_orbax(two_dir / 'checkpoints' / str(STEPS) / item)
    paths_a, leaves_a = zip(*jax.tree_util.tree_flatten_with_path(a)[0])
    paths_b, leaves_b = zip(*jax.tree_util.tree_flatten_with_path(b)[0])
    assert paths_a == paths_b, item
    for path, x, y in zip(paths_a, leaves_a, leaves_b):
      np.testing.assert_array_equal(np.asarray(x), np.asarray(y),
                                    err_msg=f'{item}{jax.tree_util.keystr(path)}')
  ens_a = dist_ens.Ensemble.load(one_dir, devices=jax.devices()[:1])
  ens_b = dist_ens.Ensemble.load(two_dir, devices=jax.devices()[:1])
  for x, y in zip(jax.tree.leaves(ens_a.params), jax.tree.leaves(ens_b.params), strict=True):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


if __name__ == '__main__':
  if sys.argv[1:2] == ['child']:
    _child(*sys.argv[2:])
  else:
    sys.exit(f'usage: {sys.argv[0]} child OUT PORT PROCESS_ID WORKDIR')
