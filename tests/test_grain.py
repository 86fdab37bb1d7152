"""config.data.loader='grain' (dist_ens/data/grain_loader.py): grain's worker processes
give the thread pipeline's batches bit for bit, on a TFDS CIFAR-shaped set of PNGs
written here, for every member order and member pools, K steps per call, the example
indices, each process's block of the batch (two processes simulated by their devices,
and two real ones), and resumed mid-epoch; a config or source it cannot serve is refused
in one line.

This file is also the probe each process of the two-process test runs:
`python tests/test_grain.py probe OUT PORT NUM_PROCESSES PROCESS_ID HOSTS_ALONG DATA_DIR`.
"""

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest
import support

from jax.sharding import NamedSharding, PartitionSpec as P

import dist_ens
from dist_ens import data
from dist_ens.config import checks
from dist_ens.config.loading import load_config
from dist_ens.data import grain_loader, pipeline, resident
from dist_ens.errors import ConfigError
from dist_ens.parallel import mesh as mesh_lib

ROOT = Path(__file__).resolve().parents[1]
BATCH, MEMBERS, WORKERS = 16, 2, 2  # 200 examples: 12 batches an epoch


@pytest.fixture(scope='module')
def data_dir(tmp_path_factory):
  """grain_cifar, CIFAR-shaped: 32x32x3 images of random pixels (so a wrong or misplaced
  decode shows), labels i % 10; 200 train examples (keys 0..199), 16 test (200..215)."""
  path = str(tmp_path_factory.mktemp('tfds'))
  pixels = np.stack([np.random.default_rng(i).integers(0, 256, (32, 32, 3), dtype=np.uint8)
                     for i in range(216)])
  labels = np.arange(216) % 10
  support.prepare_tfds_images(path, 'grain_cifar', {
      'train': (pixels[:200], labels[:200]), 'test': (pixels[200:], labels[200:], 200)}, 10)
  return path


@pytest.fixture(scope='module')
def train(data_dir):
  return data.load_dataset('grain_cifar', data.DataSpec('grain_cifar', data_dir=data_dir)).train


def _order(kind, n, split_spec=''):
  return support.member_order(kind, n, BATCH, MEMBERS, split_spec)


def _mesh(kind):
  spec = mesh_lib.MeshSpec(member=1, data=8) if kind == 'shared' else mesh_lib.MeshSpec(
      member=2, data=4)
  return mesh_lib.make_mesh(spec)


def _both(source, order, mesh, count, workers=WORKERS, **kwargs):
  """(thread items, grain items from `workers` worker processes) and their states, with
  the same arguments."""
  threads = data.Batches(source, order, mesh, MEMBERS, **kwargs)
  grained = data.Batches(source, order, mesh, MEMBERS, loader='grain', workers=workers,
                         **kwargs)
  try:
    first = next(grained)
    assert [a.sharding for a in first] == [a.sharding for a in next(threads)]
    got, got_state = support.take_batches(grained, count)
    want, want_state = support.take_batches(threads, count)
  finally:
    threads.close()
    grained.close()
  assert got_state == want_state
  return want, got


# Per-channel statistics for which float32 and float64 arithmetic round some pixels apart.
MEAN, STD = (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)


@pytest.fixture(scope='module')
def standardized(data_dir):
  """The training split of grain_cifar with data.mean and data.std set."""
  spec = data.DataSpec('grain_cifar', data_dir=data_dir, mean=MEAN, std=STD)
  return data.load_dataset('grain_cifar', spec).train


# One worker process a case here (each is a spawned Python, over a second of CPU): which
# worker reads an item does not depend on the order's kind; two workers interleave items in
# the shuffled case (shuffled_reads below). The bootstrap case standardises (data.mean and
# std): the workers' pixels are scaled as the thread scales them.
@pytest.mark.parametrize('kind,split_spec,k,with_index,scaled', [
    ('shared', '', 1, False, False),
    ('bootstrap', 'kfold:2', 1, True, True),
])
def test_batches_equal_the_thread_pipelines_bit_for_bit(train, standardized, kind, split_spec, k,
                                                        with_index, scaled):
  source = standardized if scaled else train
  order = _order(kind, source.num_examples, split_spec)
  # 5 items after the first cross the epoch (12 batches; 6 for a kfold:2 pool of 100);
  # prefetching runs ahead of the state.
  want, got = _both(source, order, _mesh(kind), 5, workers=1, steps_per_call=k,
                    with_index=with_index, prefetch=2)
  support.assert_same_batches(want, got)
  assert len(got[0]) == (3 if with_index else 2)
  assert got[0][0].dtype == np.float32 and got[0][0].shape[-3:] == (32, 32, 3)


# The shuffled case, K = 3 steps a call with the example indices (12 batches an epoch: 4
# items), read by the threads and two grain workers once for the two tests below: a
# checkpoint's state after 2 items (6 batches: mid-epoch) and 4 items more (across the epoch).
SHUFFLED = dict(steps_per_call=3, with_index=True, prefetch=2)
SAVED_AFTER, THEN = 2, 4


def _read_saving(batches):
  """(items 2.. of `batches` (its first read already), its state after SAVED_AFTER
  items, after SAVED_AFTER + THEN)."""
  before, saved = support.take_batches(batches, SAVED_AFTER - 1)
  after, end = support.take_batches(batches, THEN)
  return before + after, saved, end


@pytest.fixture(scope='module')
def shuffled_reads(train):
  """{'threads' / 'grain': (the items after the first, the state at SAVED_AFTER items, at
  the end) as _read_saving gives them; 'shardings': each first item's shardings}."""
  order, mesh = _order('shuffled', train.num_examples), _mesh('shuffled')
  threads = data.Batches(train, order, mesh, MEMBERS, **SHUFFLED)
  grained = data.Batches(train, order, mesh, MEMBERS, loader='grain', workers=WORKERS,
                         **SHUFFLED)
  try:
    shardings = [[a.sharding for a in next(b)] for b in (threads, grained)]
    return {'shardings': shardings, 'threads': _read_saving(threads),
            'grain': _read_saving(grained)}
  finally:
    threads.close()
    grained.close()


def test_two_workers_batches_equal_the_thread_pipelines_bit_for_bit(shuffled_reads):
  """Two grain workers interleave the items: the thread pipeline's bit for bit, with the
  same shardings and data positions."""
  want, want_saved, want_end = shuffled_reads['threads']
  got, got_saved, got_end = shuffled_reads['grain']
  assert shuffled_reads['shardings'][0] == shuffled_reads['shardings'][1]
  support.assert_same_batches(want, got)
  assert (got_saved, got_end) == (want_saved, want_end)
  assert len(got) == SAVED_AFTER - 1 + THEN and len(got[0]) == 3
  assert got[0][0].dtype == np.float32 and got[0][0].shape[-3:] == (32, 32, 3)


def test_with_data_mean_and_std_the_comparison_sees_the_arithmetic(data_dir, standardized):
  """The workers standardise as the thread does (tfds_source.preprocess): the bootstrap
  case of the batches test above compares grain's standardised batches with the thread's
  bit for bit; here, that comparison sees the arithmetic (the same pixels standardised in
  float64 differ)."""
  order = _order('bootstrap', standardized.num_examples, 'kfold:2')  # the batches test's
  unscaled = data.load_dataset('grain_cifar', data.DataSpec('grain_cifar', data_dir=data_dir))
  reader = pipeline.HostReader(standardized, order, (slice(0, MEMBERS), slice(0, BATCH)))
  start = data.IteratorState()
  x = reader(start)[0]
  pixels = np.rint(reader._replace(source=unscaled.train)(start)[0] * 255)  # exact: k / 255
  float64 = ((pixels / 255.0 - np.asarray(MEAN)) / np.asarray(STD)).astype(np.float32)
  assert float64.tobytes() != x.tobytes()


_IMAGES = np.random.default_rng(0).integers(0, 256, (6, 8, 8, 3), dtype=np.uint8)


@pytest.mark.parametrize('x,mean,std', [
    (_IMAGES, MEAN, STD), (_IMAGES, MEAN, ()), (_IMAGES, (), STD), (_IMAGES, (), ()),
    (_IMAGES[:, ::2], MEAN, STD),  # not contiguous
    (np.asfortranarray(_IMAGES), MEAN, STD), (_IMAGES[:0], MEAN, STD),
    (_IMAGES[..., 0], (0.2860,), (0.3530,)),  # a channel axis added after
    (_IMAGES[:, 0, 0, :1], MEAN, STD),  # [6, 1]: the statistics widen it to [6, 3]
    (_IMAGES[:, 0, 0, 0], (0.5,), (0.25,)),
    (np.random.default_rng(1).normal(size=(6, 5, 3)).astype(np.float32), MEAN, STD),
    (np.random.default_rng(1).normal(size=(6, 5, 3)), MEAN, STD),
])
def test_preprocess_standardizes_with_the_plain_float32_arithmetic(x, mean, std):
  """tfds_source.preprocess standardises in place over whole examples (cheaper for grain's
  main process, which scales its workers' pixels): the bits of numpy's broadcast
  expression, whatever the layout, and the input untouched."""
  before = x.copy()
  scale = np.float32(1 / 255 if x.dtype == np.uint8 else 1.0)
  want = x.astype(np.float32) * scale
  if mean or std:
    want = (want - np.asarray(mean or 0.0, np.float32)) / np.asarray(std or 1.0, np.float32)
  got = data.preprocess(x, data.DataSpec('any', mean=mean, std=std))
  assert got.dtype == want.dtype == np.float32 and got.shape == want.shape
  assert got.tobytes() == want.tobytes()
  np.testing.assert_array_equal(x, before)


@pytest.mark.parametrize('kind', ['shared', 'shuffled'])
def test_each_simulated_process_reads_its_own_block(train, kind):
  """Two processes, each holding half the mesh's devices: the thread pipeline's function
  reads each one's block, the blocks tile the batch, and grain's workers read the second
  process's block as that function does (a block lost or replaced by the first process's
  on its way to the workers reads other rows; one spawned worker for each process costs
  over a second of CPU. The slow tier's two-process test reads both processes' blocks
  with grain)."""
  mesh, order = _mesh(kind), _order(kind, train.num_examples)
  spec, lead = ((P('data'), (BATCH,)) if kind == 'shared'
                else (P('member', 'data'), (MEMBERS, BATCH)))
  sharding = NamedSharding(mesh, spec)
  devices = list(mesh.devices.flat)
  whole = pipeline.HostReader(train, order, pipeline.host_block(sharding, lead, len(lead)))
  start = data.IteratorState(0, 10)  # 4 items: into the next epoch
  parts = []
  for process in range(2):
    mine = devices[process * 4:(process + 1) * 4]
    block = pipeline.host_block(sharding, lead, len(lead), devices=mine)
    reader = pipeline.HostReader(train, order, block, with_index=True)
    items = [reader(order.skip(start, t)) for t in range(4)]
    if process == 1:
      reads = grain_loader.Reads(reader, start, workers=1)  # (the batches tests run 2)
      try:
        got = [next(reads) for _ in range(4)]
      finally:
        reads.close()
      support.assert_same_batches(items, got)
      items = got
    parts.append((block, items))
  axis = len(lead) - 1 if kind == 'shared' else 0  # rows over 'data'; members over 'member'
  assert parts[0][0][axis].start == 0 < parts[1][0][axis].start  # the second is not the first
  assert parts[0][0][axis].stop == parts[1][0][axis].start  # two halves, in order
  for t in range(4):
    tiled = [np.concatenate([p[1][t][i] for p in parts], axis=axis) for i in range(2)]
    support.assert_same_batches([whole(order.skip(start, t))], [tuple(tiled)])


def test_resume_mid_epoch_is_exact(train, shuffled_reads):
  """A grain run stopped after 2 items (the state a checkpoint saves) and started again
  there reads what the uninterrupted one (shuffled_reads' two workers) reads next, across
  the epoch."""
  items, saved, end = shuffled_reads['grain']
  after = items[SAVED_AFTER - 1:]
  assert saved == data.IteratorState(0, 6) and end == data.IteratorState(1, 6)
  order, mesh = _order('shuffled', train.num_examples), _mesh('shuffled')
  resumed_kwargs = dict(SHUFFLED, prefetch=0)
  resumed = data.Batches(train, order, mesh, MEMBERS, state=saved, loader='grain', workers=1,
                         **resumed_kwargs)
  try:
    again, again_end = support.take_batches(resumed, THEN)
  finally:
    resumed.close()
  support.assert_same_batches(after, again)
  assert again_end == end
  threads = data.Batches(train, order, mesh, MEMBERS, state=saved, **resumed_kwargs)
  support.assert_same_batches(after, support.take_batches(threads, THEN)[0])
  assert resumed.stats.examples == THEN * SHUFFLED['steps_per_call'] * BATCH * MEMBERS


_KILLED_PARENT = """
import multiprocessing, sys, time
import numpy as np
from dist_ens import data
from dist_ens.data import grain_loader, pipeline, resident
train = data.load_dataset('grain_cifar', data.DataSpec('grain_cifar', data_dir=sys.argv[1])).train
order = data.Order('shared', train.num_examples, 16, 0)
reads = grain_loader.Reads(pipeline.HostReader(train, order, (slice(0, 16),)),
                           data.IteratorState(), workers=1)
next(reads)
print(*[p.pid for p in multiprocessing.active_children()], flush=True)
print(*sorted(m for m in sys.modules if m.startswith('dist_ens.models')), flush=True)
time.sleep(120)
"""


def test_workers_exit_when_their_parent_is_killed(data_dir):
  """kill -9 closes nothing: the workers notice their parent is gone and exit. That
  parent imported what a worker unpickles (the data package, a HostReader, a TFDS source)
  and grain: not dist_ens.models (every model; data/text.py imports its HF checkpoint
  reader only for a text set that names one), which a worker would import for nothing."""
  parent = subprocess.Popen([sys.executable, '-c', _KILLED_PARENT, data_dir], cwd=ROOT,
                            stdout=subprocess.PIPE, text=True)
  try:
    workers = [int(p) for p in parent.stdout.readline().split()]
    assert workers
    assert parent.stdout.readline().split() == []
  finally:
    parent.kill()
    parent.wait()
  deadline = time.monotonic() + 30
  alive = workers
  while alive and time.monotonic() < deadline:
    time.sleep(0.2)
    alive = [p for p in alive if _running(p)]
  assert not alive, f'grain workers {alive} outlived their killed parent'


def _running(pid):
  try:
    with open(f'/proc/{pid}/stat') as f:
      return f.read().split(')')[-1].split()[0] != 'Z'  # a zombie has exited
  except FileNotFoundError:
    return False


def _config(**data_fields):
  config = load_config(ROOT / 'configs' / 'default.py')
  config.data.update(data_fields)
  return config


def _refusal(config):
  with pytest.raises(ConfigError) as refused:
    checks.validate(config)
  message = str(refused.value)
  assert '\n' not in message and 'data.loader' in message
  return message


def test_a_bad_loader_is_refused_naming_what_works():
  message = _refusal(_config(loader='processes'))
  assert "'threads'" in message and "'grain'" in message
  checks.validate(_config(name='cifar10', loader='grain'))  # a TFDS name: accepted


@pytest.mark.parametrize('name', ['mnist1d', 'uci:energy', 'text:/tmp/x'])
def test_grain_refuses_data_held_in_memory(name):
  assert "data.loader='threads'" in _refusal(_config(name=name, loader='grain'))


def test_grain_refuses_resident_true():
  message = _refusal(_config(name='cifar10', loader='grain', resident=True))
  assert 'data.resident' in message


def test_grain_refuses_a_source_it_cannot_read(train):
  """An in-memory or user's source (e.g. from an import path loader) has no files."""
  split = data.Split(*train.read(np.arange(32)))
  with pytest.raises(ConfigError, match="data.loader='grain' reads TFDS"):
    data.Batches(split, data.Order('shared', 32, BATCH, 0), _mesh('shared'), MEMBERS,
                 loader='grain')
  # A validation split carved from a TFDS split still reads its files.
  assert grain_loader.is_tfds(data.Subset(train, np.arange(10)))


def test_a_resident_split_reads_nothing_on_the_host(train):
  """data.resident='auto' put the split on the devices: grain has no batch to read."""
  split = data.Split(*train.read(np.arange(64)))
  order, mesh = data.Order('shared', 64, BATCH, 0), _mesh('shared')
  batches = data.Batches(resident.ResidentSource(split), order, mesh, MEMBERS, prefetch=0,
                         loader='grain')
  threads = data.Batches(split, order, mesh, MEMBERS, prefetch=0)
  support.assert_same_batches(support.take_batches(threads, 2)[0], support.take_batches(batches, 2)[0])


def test_without_grain_installed_it_says_how_to_install(train, monkeypatch):
  monkeypatch.setitem(sys.modules, 'grain', None)  # `import grain` raises ImportError
  message = _refusal(_config(name='cifar10', loader='grain'))
  assert "pip install 'dist_ens[grain]'" in message
  with pytest.raises(ConfigError, match=r'dist_ens\[grain\]'):
    data.Batches(train, data.Order('shared', train.num_examples, BATCH, 0), _mesh('shared'),
                 MEMBERS, loader='grain')


# ---------------------------------------------------------------------------------
# Two processes (jax.distributed on CPU, 4 fake devices each), each with its own grain
# workers: each reads its block both ways; the gathered global batches equal one process's.


def _probe_batches(data_dir, hosts_along):
  """The items of both loaders on a 4 x 2 mesh laid out with `hosts_along` across
  processes: a per-member order with K = 2 and indices, and the shared order."""
  train = data.load_dataset('grain_cifar', data.DataSpec('grain_cifar', data_dir=data_dir)).train
  mesh = mesh_lib.make_mesh(mesh_lib.MeshSpec(member=4, data=2, hosts_along=hosts_along))
  out = {}
  for kind, kwargs in (('shuffled', {'steps_per_call': 2, 'with_index': True}),
                       ('shared', {})):
    order = data.Order(kind, train.num_examples, BATCH, seed=3)
    for loader in ('threads', 'grain'):
      batches = data.Batches(train, order, mesh, 4, prefetch=1, loader=loader, workers=1,
                             **kwargs)
      out[kind, loader] = [next(batches) for _ in range(7)]  # 14 batches of K=2: 2 epochs
      batches.close()
  return out


def _probe(out, port, num_processes, process_id, hosts_along, data_dir):
  from dist_ens.parallel import distributed, launch  # pylint: disable=g-import-not-at-top
  distributed.initialize(launch.Launch(
      coordinator_address=f'localhost:{port}', num_processes=int(num_processes),
      process_id=int(process_id)))
  items = _probe_batches(data_dir, hosts_along)
  result = support.process_batches_agree(items, 'threads', 'grain')
  Path(out).write_text(json.dumps(result))


@pytest.mark.slow  # Two jax processes and their workers: tens of seconds; the fast tier
# has the simulated processes above.
@pytest.mark.parametrize('hosts_along', ['data', 'member'])
def test_two_processes_read_the_same_batches(tmp_path, data_dir, hosts_along):
  # test_multihost's process helpers: environment (4 fake devices), start, deadline, kill.
  # pylint: disable=g-import-not-at-top,protected-access
  import test_multihost as mh
  port = mh._free_port()
  outs = [tmp_path / f'probe_{i}.json' for i in range(2)]
  procs = [mh._start(['timeout', '-k', '10', '300', sys.executable, __file__, 'probe',
                      str(outs[i]), str(port), '2', str(i), hosts_along, data_dir], mh._env())
           for i in range(2)]
  for status, out in mh._wait(procs, 330):
    assert status == 0, out[-5000:]
  probes = [json.loads(p.read_text()) for p in outs]
  assert probes[0] == probes[1]
  one = _probe_batches(data_dir, hosts_along)  # this process: 8 devices, the same mesh shape
  for kind in ('shuffled', 'shared'):
    want = [[np.asarray(a).tobytes().hex() for a in item] for item in one[kind, 'threads']]
    assert probes[0][kind] == want, kind


if __name__ == '__main__' and sys.argv[1:2] == ['probe']:
  _probe(*sys.argv[2:8])


def _train(workdir, data_dir, loader, steps, **fields):
  """A short run of 2 MLPs on the PNG set, saved at step 8 and at the end (both kept: the
  resume needs one before the end); the members' params as numpy. No joint log-loss and
  jsonl events only: what no test here reads. One grain worker: the batches tests check
  two workers' interleaving."""
  config = _config(name='grain_cifar', data_dir=data_dir, loader=loader, grain_workers=1,
                   resident=False, batch_size=BATCH, member_order='shuffled')
  config.num_members, config.model.widths = MEMBERS, (16,)
  config.train.steps, config.train.eval_every, config.checkpoint.every = steps, 0, 8
  config.checkpoint.keep, config.eval.joint_tau, config.writers = 2, 0, ('jsonl',)
  for field, value in fields.items():
    config.train[field] = value
  dist_ens.train(config, workdir)
  loaded = dist_ens.Ensemble.load(workdir)
  return [np.asarray(leaf) for leaf in jax.tree.leaves(loaded.params)]


def test_a_run_with_grain_trains_the_thread_runs_members_and_resumes_with_either(
    tmp_path, data_dir, monkeypatch, caplog):
  """config.data.loader reaches the run (grain's reader is started): 14 steps (more than
  an epoch of 12 batches) with grain end where the thread pipeline's run ends, bit for
  bit; and that grain run, killed after its step-8 checkpoint (the later checkpoints and
  the final metrics removed from a copy), resumes with the threads (the loader may change
  on resume: same batches)."""
  started = []
  reads = grain_loader.Reads
  monkeypatch.setattr(grain_loader, 'Reads',
                      lambda *args, **kwargs: started.append(1) or reads(*args, **kwargs))
  threads = _train(tmp_path / 'threads', data_dir, 'threads', 14)
  assert not started
  grain = _train(tmp_path / 'grain', data_dir, 'grain', 14)
  assert started
  for a, b in zip(threads, grain, strict=True):
    np.testing.assert_array_equal(a, b)
  # What a kill between the checkpoints of steps 8 and 14 leaves.
  switch = shutil.copytree(tmp_path / 'grain', tmp_path / 'switch')
  saved = sorted(int(d.name) for d in (switch / 'checkpoints').iterdir() if d.name.isdigit())
  assert saved == [8, 14], saved
  shutil.rmtree(switch / 'checkpoints' / '14')
  (switch / 'final_metrics.json').unlink()
  started.clear()
  caplog.clear()
  with caplog.at_level('INFO'):
    switched = _train(switch, data_dir, 'threads', 14)
  assert 'resuming from the checkpoint at step 8' in caplog.text
  assert not started
  for a, b in zip(threads, switched, strict=True):
    np.testing.assert_array_equal(a, b)
