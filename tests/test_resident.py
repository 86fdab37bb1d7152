"""Resident data (dist_ens/data/resident.py): batches gathered on the devices are the host
pipeline's bit for bit, for every member order, member pool, steps per call, with indices,
resumed, in two processes and in a whole run; 'auto' and True against the budget.

This file also starts the two processes of the two-process test:
`python tests/test_resident.py probes OUT_DIR PORT HOSTS_ALONG[,...]` forks them, each
writing OUT_DIR/probe_{process id}.json.
"""

import functools
import json
import logging
import os
import sys
from pathlib import Path

import numpy as np
import pytest

import support

import dist_ens
from dist_ens import data
from dist_ens.config import checks
from dist_ens.data import orders, resident, uci
from dist_ens.parallel import mesh as mesh_lib
from dist_ens.run import run_data as run_data_lib

BATCH, MEMBERS = 16, 8


@pytest.fixture(scope='module')
def train():
  """200 MNIST-1D examples: 12 batches of 16 an epoch, so a few steps cross epochs."""
  full = data.load_dataset('mnist1d').train
  return data.Split(full.x[:200], full.y[:200])


def _order(kind, n, split_spec=''):
  return support.member_order(kind, n, BATCH, MEMBERS, split_spec)


def _mesh(kind):
  return mesh_lib.make_mesh(mesh_lib.MeshSpec(member=4, data=2) if kind == 'shared'
                            else mesh_lib.MeshSpec(member=2, data=4))


def _both(source, order, mesh, count, **kwargs):
  """(host items, resident items, their states, the resident pipeline's arrays' shardings)."""
  host = data.Batches(source, order, mesh, MEMBERS, **kwargs)
  # The devices derive per-member orders (on CPU devices 'auto' has the host send them).
  device = data.Batches(resident.ResidentSource(source, derive_orders=True), order, mesh,
                        MEMBERS, **kwargs)
  try:
    first = next(device)
    want_shardings = [a.sharding for a in next(host)]
    assert [a.sharding for a in first] == want_shardings
    got, got_state = support.take_batches(device, count)
    want, want_state = support.take_batches(host, count)
  finally:
    host.close()
    device.close()
  assert got_state == want_state
  return want, got


@pytest.mark.parametrize('split_spec', ['', 'kfold:2'])
@pytest.mark.parametrize('kind', data.MEMBER_ORDERS)
@pytest.mark.parametrize('k,with_index', [(1, False), (3, True)])
def test_batches_equal_the_host_pipelines_bit_for_bit(train, kind, split_spec, k, with_index):
  order = _order(kind, train.num_examples, split_spec)
  # 5 items of K=3 steps cross the 12-batch epoch; prefetching runs ahead of the state.
  want, got = _both(train, order, _mesh(kind), 5, steps_per_call=k, with_index=with_index,
                    prefetch=2)
  support.assert_same_batches(want, got)
  assert len(got[0]) == (3 if with_index else 2)


def test_member_scale_copies_are_the_host_arithmetic_bit_for_bit(train):
  """Per-member standardisation (member_split with a standardising task): one copy per
  split, computed as the host computes each batch; members gather from their split's."""
  splits = data.make_member_splits('kfold:4', train.num_examples, MEMBERS, 3)
  x = train.x.reshape(len(train.x), -1)
  y = train.y.astype(np.float32)  # regression-like targets
  source = data.Split(x, y)
  scales = [uci.Standardizer.fit(x[rows], y[rows]) for rows in splits.train]
  member_scale = uci.Standardizer(*(np.stack([scales[splits.split_of(m)][i]
                                              for m in range(MEMBERS)]) for i in range(4)))
  order = _order('shuffled', train.num_examples, 'kfold:4')
  for k in (1, 3):
    want, got = _both(source, order, _mesh('shuffled'), 4, steps_per_call=k,
                      member_scale=member_scale, prefetch=0)
    support.assert_same_batches(want, got)
  # One shared set of statistics: one copy, no per-member index.
  same = uci.Standardizer(*(np.repeat(a[:1], MEMBERS, 0) for a in member_scale))
  want, got = _both(source, order, _mesh('shuffled'), 2, member_scale=same, prefetch=0)
  support.assert_same_batches(want, got)


@pytest.mark.parametrize('kind,split_spec', [('shared', ''), ('bootstrap', 'kfold:2'),
                                             ('shuffled', '')])
def test_resume_mid_epoch_is_exact(train, kind, split_spec):
  order = _order(kind, train.num_examples, split_spec)
  mesh, source = _mesh(kind), resident.ResidentSource(train, derive_orders=True)
  whole = data.Batches(source, order, mesh, MEMBERS, prefetch=2, steps_per_call=2)
  first, saved = support.take_batches(whole, 2)  # 4 batches in: mid-epoch
  after, end = support.take_batches(whole, 5)  # crosses into the next epoch (12, or 6 a pool of 100)
  whole.close()
  assert saved == data.IteratorState(0, 4)
  assert end == (data.IteratorState(2, 2) if split_spec else data.IteratorState(1, 2))
  resumed = data.Batches(source, order, mesh, MEMBERS, state=saved, prefetch=0,
                         steps_per_call=2)
  again, again_end = support.take_batches(resumed, 5)
  support.assert_same_batches(after, again)
  assert again_end == end
  host = data.Batches(train, order, mesh, MEMBERS, state=saved, prefetch=0, steps_per_call=2)
  support.assert_same_batches(after, support.take_batches(host, 5)[0])
  assert resumed.stats.examples == 5 * 2 * BATCH * (1 if kind == 'shared' else MEMBERS)
  del first


@pytest.mark.parametrize('kind', ['shuffled', 'bootstrap'])
def test_per_member_orders_are_derived_on_the_devices(train, kind, monkeypatch):
  """The host draws no per-member order for a resident split whose devices derive them
  (data/orders.py), however many epochs a call's K steps span; with 'auto' on CPU devices
  it draws them and sends indices. Both are the host pipeline's batches."""
  drawn, draw = [], orders.host_block
  monkeypatch.setattr(orders, 'host_block', lambda *args: drawn.append(args) or draw(*args))
  short = data.Split(train.x[:40], train.y[:40])  # 2 batches an epoch
  for split, k in [(train, 3), (short, 5)]:  # K = 5: 3 or 4 epochs a call
    host = data.Batches(split, _order(kind, split.num_examples), _mesh(kind), MEMBERS,
                        prefetch=0, steps_per_call=k)
    want, want_state = support.take_batches(host, 5)
    for derive in (True, 'auto'):
      drawn.clear()
      source = resident.ResidentSource(split, derive_orders=derive)
      device = data.Batches(source, _order(kind, split.num_examples), _mesh(kind), MEMBERS,
                            prefetch=0, steps_per_call=k)
      got, got_state = support.take_batches(device, 5)
      assert bool(drawn) == (derive == 'auto')  # CPU devices: the host draws
      support.assert_same_batches(want, got)
      assert got_state == want_state


def test_auto_picks_the_host_pipeline_over_the_budget_and_true_is_refused(train):
  need = resident.split_bytes(train)
  assert need == train.x.nbytes + train.y.nbytes
  fits = need / 2 ** 20
  assert isinstance(resident.choose('auto', fits, train), resident.ResidentSource)
  assert resident.choose('auto', fits * 0.99, train) is train
  assert resident.choose('auto', fits, train, copies=2) is train  # copies count
  assert resident.choose(False, 1e9, train) is train
  message = support.one_line_refusal(lambda: resident.choose(True, fits * 0.5, train))
  assert 'config.data.resident=True' in message and str(need) in message
  assert 'config.data.resident_budget_mb' in message
  assert 'config.data.resident' in support.one_line_refusal(
      lambda: resident.choose('yes', 1e9, train))


def test_build_data_decides_from_the_config():
  config = support.config()
  assert config.data.resident == 'auto'
  built = run_data_lib.build_data(config)
  assert isinstance(built.dataset.train, resident.ResidentSource)
  assert built.dataset.train.num_examples == 4000
  config.data.resident_budget_mb = 0.1  # MNIST-1D takes 0.63 MB
  assert isinstance(run_data_lib.build_data(config).dataset.train, data.Split)
  config.data.resident = True
  message = support.one_line_refusal(lambda: run_data_lib.build_data(config))
  assert 'config.data.resident=True' in message and '656000 bytes' in message
  config.data.resident = False
  config.data.resident_budget_mb = 1e6
  assert isinstance(run_data_lib.build_data(config).dataset.train, data.Split)


def test_a_setting_other_than_auto_true_or_false_is_refused_by_the_config_check():
  for bad in ('yes', 1, 0, None):
    config = support.config({'data.resident': bad})
    message = support.one_line_refusal(functools.partial(checks.validate, config))
    assert f'config.data.resident={bad!r}' in message and "'auto', True or False" in message
  for good in ('auto', True, False):
    checks.validate(support.config({'data.resident': good}))


@pytest.mark.parametrize('overrides', [
    {},
    {'data.member_order': 'bootstrap', 'data.augment': 'crop_flip', 'train.steps_per_call': 2},
], ids=['shared', 'bootstrap_augmented'])
def test_a_whole_run_ends_the_same_resident_or_not(tmp_path, caplog, overrides):
  caplog.set_level(logging.INFO, logger='absl')
  results = {}
  for setting in (True, False):
    config = support.config({**overrides, 'data.resident': setting})
    caplog.clear()
    results[setting] = dist_ens.train(config, str(tmp_path / str(setting)))
    assert ('resident data:' in caplog.text) == setting
  metrics = lambda r: json.dumps({k: v for k, v in r.items() if 'seconds' not in k},
                                 sort_keys=True)  # Everything but the clocks.
  assert metrics(results[True]) == metrics(results[False])
  assert 'nll' in results[True]['ensemble']


# ---------------------------------------------------------------------------------
# Two processes (jax.distributed on CPU, 4 fake devices each): each builds its block of
# every batch both ways, on a mesh laid out across the processes along 'data' and along
# 'member' (one pair of processes for both layouts: each process's start and
# jax.distributed's are most of the cost); the gathered global batches equal one process's.


def _probe_batches(hosts_along, sources=('host', 'resident')):
  """The items of the pipelines `sources` (default both) on a 4 x 2 mesh laid out with
  `hosts_along` across processes: a per-member order with K = 2 and indices, and the
  shared order."""
  mesh = mesh_lib.make_mesh(mesh_lib.MeshSpec(member=4, data=2, hosts_along=hosts_along))
  full = data.load_dataset('mnist1d').train
  train = data.Split(full.x[:200], full.y[:200])
  out = {}
  for kind, kwargs in (('shuffled', {'steps_per_call': 2, 'with_index': True}),
                       ('shared', {})):
    order = data.Order(kind, train.num_examples, BATCH, seed=3)
    for name in sources:
      source = train if name == 'host' else resident.ResidentSource(train, derive_orders=True)
      batches = data.Batches(source, order, mesh, 4, prefetch=1, **kwargs)
      out[kind, name] = [next(batches) for _ in range(7)]
      batches.close()
  return out


def _probe(out: str, port: str, num_processes: str, process_id: str, hosts_along: str) -> None:
  """Writes {layout: process_batches_agree's result} for each layout of the comma-separated
  `hosts_along`."""
  from dist_ens.parallel import distributed, launch  # pylint: disable=g-import-not-at-top
  distributed.initialize(launch.Launch(
      coordinator_address=f'localhost:{port}', num_processes=int(num_processes),
      process_id=int(process_id)))
  result = {layout: support.process_batches_agree(_probe_batches(layout), 'host', 'resident')
            for layout in hosts_along.split(',')}
  Path(out).write_text(json.dumps(result))


def _fork_probes(out_dir: str, port: str, hosts_along: str) -> None:
  """Forks the two processes, each running _probe as its process id, and waits for them;
  exits with the first failure's status. This interpreter imported what they import (JAX,
  dist_ens, pytest; no backend starts, so no JAX thread runs): each is a fresh process but
  for those imports, which a process of its own paid (~1 CPU s) again."""
  pids = []
  for process_id in range(2):
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:  # The process: it ends as a script ends (atexit: jax.distributed's shutdown).
      _probe(str(Path(out_dir) / f'probe_{process_id}.json'), port, '2', str(process_id),
             hosts_along)
      sys.exit(0)
    pids.append(pid)
  statuses = [os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) for pid in pids]
  sys.exit(next((s for s in statuses if s), 0))


LAYOUTS = ('data', 'member')


@pytest.fixture(scope='module')
def two_process_probes(tmp_path_factory):
  """Each of the two processes' probe result (_probe's), for every layout in LAYOUTS."""
  # test_multihost's process helpers: environment (4 fake devices), start, deadline, kill.
  # pylint: disable=g-import-not-at-top,protected-access
  import test_multihost as mh
  tmp_path = tmp_path_factory.mktemp('resident_probes')
  port = mh._free_port()
  procs = [mh._start(['timeout', '-k', '10', '150', sys.executable, __file__, 'probes',
                      str(tmp_path), str(port), ','.join(LAYOUTS)], mh._env())]
  [(status, out)] = mh._wait(procs, 180)
  assert status == 0, out[-5000:]
  return [json.loads((tmp_path / f'probe_{i}.json').read_text()) for i in range(2)]


@pytest.mark.parametrize('hosts_along', LAYOUTS)
def test_two_processes_gather_the_same_batches(two_process_probes, hosts_along):
  probes = [probe[hosts_along] for probe in two_process_probes]
  assert probes[0] == probes[1]
  one = _probe_batches(hosts_along, ('host',))  # this process: 8 devices, the same mesh shape
  for kind in ('shuffled', 'shared'):
    want = [[np.asarray(a).tobytes().hex() for a in item] for item in one[kind, 'host']]
    assert probes[0][kind] == want, kind


if __name__ == '__main__' and sys.argv[1:2] == ['probes']:
  _fork_probes(*sys.argv[2:5])
