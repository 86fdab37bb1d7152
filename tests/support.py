"""What tests share: the XLA flags every test process (this one and the children it starts)
runs with, the tiny run of the tests that need "a small run" (config), and small helpers:
override, PreemptAt, assert_trees_equal, one_line_refusal, take_batches and
assert_same_batches (two input pipelines' batches, bit for bit), prepare_tfds_images (a
TFDS image set written as TFDS prepares one), check_load_predict_export (a method's run
loads, predicts and exports as it trained)."""

import importlib.util
import os
import signal
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Tests compile hundreds of small programs and run each for a few steps: XLA:CPU's
# compilation is most of the suite's time. Two flags make it cheaper (docs/testing.md,
# "Compiling at -O0"): XLA:CPU's older (non-MLIR) fusion emitters, and LLVM at -O0
# instead of XLA's default level 3 (42% less test time on 18 heavy files, 939 -> 544 s;
# the fast tier's pytest 1,338-1,415 s -> 917 s). Every bit-exact comparison the tests make, across meshes,
# layouts, processes and resumes, slow tier included, holds at -O0 too: both sides of
# each compile alike. A test that compares against XLA's default code compiles that
# side with XLA_DEFAULT (test_step, test_once). Runs and benchmarks outside the tests
# keep XLA's defaults.
LLVM_O0 = '--xla_backend_optimization_level=0'
FAST_COMPILE = ('--xla_cpu_use_fusion_emitters=false', LLVM_O0)
# Compiler options of XLA's own defaults, for a test's reference program compiled as runs
# compile: LLVM at level 3 and XLA:CPU's fusion emitters (FAST_COMPILE's two flags undone;
# the emitters give other bits than the older ones, not only another speed).
XLA_DEFAULT = {'xla_backend_optimization_level': 3, 'xla_cpu_use_fusion_emitters': True}


# Set in a test process that compiles at XLA's default level (run_at_xla_default).
AT_XLA_DEFAULT = 'DIST_ENS_TEST_AT_XLA_DEFAULT'


# XLA:CPU ends the whole process ("Termination timeout ... exceeded. Exiting to ensure a
# consistent program state") when one device's thread is late to a collective by more than
# this. 8 fake devices' threads on a 2-core machine at load 4-12 can be starved that long:
# the likeliest cause of the xdist worker that aborted there (issue 62 item 7; not
# reproduced). A real deadlock still ends, by this or by conftest's per-test limit.
COLLECTIVE_PATIENCE = '--xla_cpu_collective_call_terminate_timeout_seconds=600'


def xla_flags(devices: int) -> str:
  """XLA_FLAGS for a test process with `devices` fake CPU devices (compiling as runs
  compile, without FAST_COMPILE, where AT_XLA_DEFAULT is set)."""
  flags = [] if os.environ.get(AT_XLA_DEFAULT) else list(FAST_COMPILE)
  return ' '.join((f'--xla_force_host_platform_device_count={devices}', *flags,
                   COLLECTIVE_PATIENCE))


def run_at_xla_default(nodeid: str) -> None:
  """Runs the test `nodeid` in a child pytest whose programs compile as runs compile
  (XLA's defaults; the `xla_default` marker, tests/conftest.py): for tests of bits that
  the product's own compilation keeps and FAST_COMPILE's does not (whether two
  differently built programs agree to the last bit). Fails with the child's output."""
  env = {k: v for k, v in os.environ.items() if k not in ('PYTEST_ADDOPTS', 'XLA_FLAGS')}
  # The caller's own XLA flags (--xla_cpu_max_isa=AVX2, say) go on; the child's conftest
  # adds the test flags again, at XLA's default level this time.
  ours = set(xla_flags(8).split())
  env['XLA_FLAGS'] = ' '.join(f for f in os.environ.get('XLA_FLAGS', '').split() if f not in ours)
  env[AT_XLA_DEFAULT] = '1'
  command = [sys.executable, '-m', 'pytest', '-q', '-n', '0', '-p', 'no:randomly',
             '-p', 'no:cacheprovider', '-m', 'xla_default', nodeid]
  child = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=900, check=False)
  assert child.returncode == 0, f'{nodeid} at XLA\'s default level:\n{child.stdout[-6000:]}'


def config(overrides=(), /, **fields):
  """The tests' shared tiny run, with `overrides` ({'train.steps': 8}) and `fields`
  (train__steps=8: '__' for '.') applied in that order.

  One config for every test that needs "a small run" and not a particular one: the
  steps, evaluations and checkpoints a test sets do not change the compiled programs
  (the default schedule is constant) while train.steps_per_call's automatic choice
  stays 2 (it divides every cadence: an odd one, or a resume from an odd step, makes it
  1, a second train program), so its runs read them from the persistent compilation
  cache (tests/conftest.py) that another test filled. 4 members of a (16,) MLP on MNIST-1D, batch 32, 4 steps, logged
  every 2, evaluated at the end, checkpointed at the end, events in jsonl only.
  """
  import dist_ens  # pylint: disable=g-import-not-at-top  (jax after conftest's XLA_FLAGS)
  out = dist_ens.load_config(ROOT / 'configs' / 'default.py')
  out.num_members, out.model.widths, out.data.batch_size = 4, (16,), 32
  out.train.steps, out.train.log_every, out.train.eval_every = 4, 2, 0
  out.checkpoint.every, out.writers = 4, ('jsonl',)
  return override(out, overrides, **fields)


def override(config, overrides=(), /, **fields):
  """`config` with `overrides` ({'train.steps': 8}) and then `fields` (train__steps=8:
  '__' for '.') set; returns it."""
  changes = {**dict(overrides), **{k.replace('__', '.'): v for k, v in fields.items()}}
  for dotted, value in changes.items():
    *parents, leaf = dotted.split('.')
    node = config
    for name in parents:
      node = node[name]
    node[leaf] = value
  return config


class PreemptAt:
  """An action that sends SIGTERM to this process after step `step`: the run saves that
  step and stops, as a preempted job does (the trainer's own signal handling)."""

  def __init__(self, step):
    self.step = step

  def on_step(self, call):
    if call.step == self.step:
      signal.raise_signal(signal.SIGTERM)

  def on_end(self, call):
    del call

  def close(self):
    pass


def assert_trees_equal(a, b):
  """The two pytrees have the same structure and bit-identical leaves."""
  import jax  # pylint: disable=g-import-not-at-top  (after conftest's XLA_FLAGS)
  import numpy as np  # pylint: disable=g-import-not-at-top
  assert jax.tree.structure(a) == jax.tree.structure(b)
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def one_line_refusal(call, error=None) -> str:
  """The message of the error (default: dist_ens's ConfigError) `call()` raises, checked
  to be one line."""
  import pytest  # pylint: disable=g-import-not-at-top
  from dist_ens.errors import ConfigError  # pylint: disable=g-import-not-at-top
  with pytest.raises(error or ConfigError) as raised:
    call()
  message = str(raised.value)
  assert '\n' not in message, message
  return message


def method_refusal(config) -> str:
  """The one-line refusal of config.ensemble.method's fields, as the run builds the method."""
  from dist_ens.config import specs  # pylint: disable=g-import-not-at-top
  from dist_ens.ensembles import methods  # pylint: disable=g-import-not-at-top
  return one_line_refusal(lambda: methods.from_spec(specs.method_spec(config)))


def refused_before_anything(train, config, workdir) -> str:
  """The one-line refusal `train(config, workdir)` raises, checked to leave `workdir`
  unmade."""
  message = one_line_refusal(lambda: train(config, workdir))
  assert not Path(workdir).exists(), message
  return message


def linear_student(num_outputs):
  """A user's own network given by import path (distill.student='support:linear_student'):
  one linear layer on the flattened input, 10 * (features + 1) parameters for 10 classes."""
  import jax  # pylint: disable=g-import-not-at-top  (after conftest's XLA_FLAGS)
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  import dist_ens  # pylint: disable=g-import-not-at-top

  def init(rng, x):
    n = int(np.prod(x.shape[1:]))
    return {'w': 0.01 * jax.random.normal(rng, (n, num_outputs)),
            'b': jnp.zeros((num_outputs,))}, {}

  def apply(params, state, x, *, train=False, rng=None):
    del train, rng
    return x.reshape(x.shape[0], -1) @ params['w'] + params['b'], state

  return dist_ens.Model(init, apply)


# float_tolerance's factor: two orders of summing n float terms differ by about
# eps * sqrt(n) relative to the terms' magnitude (each partial sum's rounding is a random
# walk of n steps of at most eps/2); 4 of those covers the tail of that spread and the few
# elementwise operations (each half an ulp) around a sum.
TOLERANCE_FACTOR = 4


def float_tolerance(dtype, reduction_size: int) -> float:
  """The relative tolerance for two forms of one float computation (vmap and a loop, two
  meshes, two CPUs' vector widths) whose largest sum has `reduction_size` terms: they may
  add in different orders, so results agree to TOLERANCE_FACTOR * eps * sqrt(n) of the
  values' magnitude, not to the last bit. Multiply by the compared values' scale (e.g. the
  leaf's largest magnitude) for an absolute tolerance. Not for results that go through a
  normalisation that amplifies rounding (Adam's update of a near-zero gradient)."""
  import numpy as np  # pylint: disable=g-import-not-at-top
  return TOLERANCE_FACTOR * float(np.finfo(dtype).eps) * float(np.sqrt(reduction_size))


def assert_trees_close(a, b, reduction_size: int):
  """The two pytrees have the same structure and float leaves within float_tolerance of
  each leaf's largest magnitude (non-float leaves equal)."""
  import jax  # pylint: disable=g-import-not-at-top  (after conftest's XLA_FLAGS)
  import numpy as np  # pylint: disable=g-import-not-at-top
  assert jax.tree.structure(a) == jax.tree.structure(b)
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    x, y = np.asarray(x), np.asarray(y)
    if not np.issubdtype(x.dtype, np.floating):
      np.testing.assert_array_equal(x, y)
      continue
    scale = float(max(np.abs(x).max(initial=0), np.abs(y).max(initial=0)))
    np.testing.assert_allclose(x, y, rtol=0,
                               atol=float_tolerance(x.dtype, reduction_size) * scale)


def load_tool(name: str):
  """tools/NAME.py as a module, by its path (the tools are scripts, not a package)."""
  path = Path(__file__).resolve().parents[1] / 'tools' / f'{name}.py'
  spec = importlib.util.spec_from_file_location(name, path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def take_batches(batches, count):
  """(count items of a data.Batches as numpy tuples, its data position after them)."""
  import numpy as np  # pylint: disable=g-import-not-at-top
  items = [tuple(np.asarray(a) for a in next(batches)) for _ in range(count)]
  return items, batches.state


def assert_same_batches(want, got):
  """The same items: values, dtypes, shapes and bits (NaN-safe: compared as bytes)."""
  assert len(want) == len(got)
  for a, b in zip(want, got):
    assert len(a) == len(b)
    for u, v in zip(a, b):
      assert u.dtype == v.dtype and u.shape == v.shape
      assert u.tobytes() == v.tobytes()


def process_batches_agree(items, want: str, got: str) -> dict:
  """In one process of a multi-process test, for each order kind of items[kind, name]
  (lists of batches from two pipelines): `got`'s batches hold `want`'s shards, the same
  bytes on the same devices; returns {kind: `got`'s batches gathered over the processes,
  as hex} for the parent to compare across processes."""
  import numpy as np  # pylint: disable=g-import-not-at-top
  from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
  result = {}
  for kind in sorted({k for k, _ in items}):
    for a, b in zip(items[kind, want], items[kind, got]):
      for u, v in zip(a, b):
        assert u.sharding == v.sharding
        for su, sv in zip(u.addressable_shards, v.addressable_shards):
          assert su.index == sv.index and su.device == sv.device
          assert np.asarray(su.data).tobytes() == np.asarray(sv.data).tobytes()
    gathered = [[multihost_utils.process_allgather(a, tiled=True) for a in item]
                for item in items[kind, got]]
    result[kind] = [[np.asarray(a).tobytes().hex() for a in item] for item in gathered]
  return result


def member_order(kind: str, n: int, batch: int, members: int, split_spec: str = ''):
  """A data.Order of `kind` over n examples (seed 3), with config.data.member_split's
  member pools where split_spec names one."""
  from dist_ens import data  # pylint: disable=g-import-not-at-top
  if not split_spec:
    return data.Order(kind, n, batch, seed=3)
  splits = data.make_member_splits(split_spec, n, members, 3)
  return data.Order(kind, n, batch, seed=3, pools=splits.train,
                    member_pool=[splits.split_of(m) for m in range(members)])


def prepare_tfds_images(data_dir, dataset_name: str, splits: dict, num_classes: int,
                        config: str | None = None) -> None:
  """Writes the TFDS image dataset `dataset_name` (its builder config `config`, where
  given) into data_dir as TFDS prepares its own: ArrayRecord files of PNG-encoded Image
  features (encoded with PIL, so no TensorFlow) and ClassLabel labels. `splits`:
  {split: (uint8 images [N, H, W, C], labels[, first key])}; example i is stored under
  key first + i (default 0), and TFDS orders a split's examples by their keys' hashes."""
  import io  # pylint: disable=g-import-not-at-top
  import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top
  from PIL import Image  # pylint: disable=g-import-not-at-top

  def png(array):
    buffer = io.BytesIO()
    Image.fromarray(array.squeeze(-1) if array.shape[-1] == 1 else array).save(buffer, 'PNG')
    return buffer.getvalue()

  class _Images(tfds.core.GeneratorBasedBuilder, skip_registration=True):
    name = dataset_name
    VERSION = tfds.core.Version('1.0.0')
    BUILDER_CONFIGS = [tfds.core.BuilderConfig(name=config)] if config else []

    def _info(self):
      shape = next(iter(splits.values()))[0].shape[1:]
      return tfds.core.DatasetInfo(builder=self, features=tfds.features.FeaturesDict({
          'image': tfds.features.Image(shape=shape),
          'label': tfds.features.ClassLabel(num_classes=num_classes)}),
                                   supervised_keys=('image', 'label'))

    def _split_generators(self, dl_manager):
      del dl_manager
      return {split: self._generate_examples(*arrays) for split, arrays in splits.items()}

    def _generate_examples(self, images, labels, first=0):
      for i, (image, label) in enumerate(zip(images, labels)):
        yield int(first) + i, {'image': png(image), 'label': int(label)}

  _Images(config=config, data_dir=str(data_dir), file_format='array_record'
          ).download_and_prepare()


def check_load_predict_export(workdir, final, member_logits, members: int = 2):
  """A method's MNIST-1D run of `members` members (`final` its result) loads and predicts
  as it trained: Ensemble.load(workdir) on one device predicts the test split with the
  run's ensemble accuracy (within 2e-3) and as the mean of the members' softmax of
  member_logits(ens, m, x) (a numpy forward of member m's stored params; atol 1e-5); each
  exported member's file holds ens.member(m); the report names the run. Returns the
  loaded ensemble."""
  import jax  # pylint: disable=g-import-not-at-top  (after conftest's XLA_FLAGS)
  import numpy as np  # pylint: disable=g-import-not-at-top
  import dist_ens  # pylint: disable=g-import-not-at-top
  from dist_ens import data  # pylint: disable=g-import-not-at-top
  from dist_ens.report import build as report  # pylint: disable=g-import-not-at-top
  ens = dist_ens.Ensemble.load(workdir, devices=jax.devices()[:1])
  test = data.load_dataset('mnist1d').test
  prediction = ens.predict(test.x, preprocessed=True)
  accuracy = float(np.mean(prediction.probs.argmax(-1) == test.y))
  assert abs(accuracy - final['ensemble']['accuracy']) <= 2e-3
  probs = []
  for m in range(members):
    logits = member_logits(ens, m, test.x)
    e = np.exp(logits - logits.max(-1, keepdims=True))
    probs.append(e / e.sum(-1, keepdims=True))
  np.testing.assert_allclose(prediction.probs, np.mean(probs, 0), atol=1e-5)
  paths = ens.export(Path(workdir) / 'members')
  for m in range(members):
    jax.tree.map(np.testing.assert_array_equal, dist_ens.load_member(paths[m]), ens.member(m))
  assert report.make_report(workdir) == Path(workdir) / 'report'
  assert f'{members} x mlp on mnist1d' in (Path(workdir) / 'report' / 'report.md').read_text()
  return ens


def _by_path(tree):
  """{'a/0/w': (dtype, shape, bytes)}: a pytree's leaves under their key paths (a dict's
  keys, a sequence's indices, a NamedTuple's field names), as Ensemble.export's files
  hold them."""
  import jax  # pylint: disable=g-import-not-at-top  (after conftest's XLA_FLAGS)
  import numpy as np  # pylint: disable=g-import-not-at-top
  name = lambda k: str(getattr(k, 'key', getattr(k, 'idx', getattr(k, 'name', k))))
  as_saved = lambda a: (a.dtype.str, a.shape, a.tobytes())
  return {'/'.join(map(name, path)): as_saved(np.asarray(leaf))
          for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]}


def check_loaded_run(workdir, dataset, final):
  """The contract of a finished run (`final` its results) on `dataset`: Ensemble.load
  predicts finite outputs on the test split that give the reported ensemble accuracy
  (a collecting method's: of its predicting members; scored targets; one example apart
  at most, as a near-tie may fall the other way in another program) and NLL, or RMSE
  and the mixture's NLL (rel 1e-3); loaded on one device it predicts the same on the
  split's first 64 examples, to float rounding (rtol 1e-3: up to 2e-4 measured, SWAG's
  samples through a transformer); export writes one file per predicting member holding
  its leaves under their '/'-joined paths. Returns the loaded ensemble."""
  import jax  # pylint: disable=g-import-not-at-top  (after conftest's XLA_FLAGS)
  import numpy as np  # pylint: disable=g-import-not-at-top
  import pytest  # pylint: disable=g-import-not-at-top
  import dist_ens  # pylint: disable=g-import-not-at-top
  ensemble = dist_ens.Ensemble.load(str(workdir))
  prediction = ensemble.predict(dataset.test.x)
  arrays = {k: np.asarray(v) for k, v in prediction._asdict().items() if hasattr(v, 'dtype')}
  assert arrays and all(np.isfinite(a).all() for a in arrays.values()
                        if np.issubdtype(a.dtype, np.floating)), arrays
  # A collecting method (snapshot, MultiSWAG) predicts with its K rows per member: its
  # own section reports them; 'ensemble' is the trained members'.
  own = final.get(ensemble.config.ensemble.method)
  own = own if isinstance(own, dict) and 'ensemble' in own else final
  y, reported = np.asarray(dataset.test.y), own['ensemble']
  if hasattr(prediction, 'probs'):
    probs, scored = np.asarray(prediction.probs, np.float64), y >= 0  # Tokens: -1 pads.
    hits = (probs.argmax(-1) == y)[scored]
    assert abs(hits.mean() - reported['accuracy']) <= 1 / hits.size + 1e-9, (
        hits.mean(), reported['accuracy'])
    picked = np.take_along_axis(probs, np.where(scored, y, 0)[..., None], -1)[..., 0]
    nll = -np.mean(np.log(np.maximum(picked[scored], 1e-30)))
    assert nll == pytest.approx(reported['nll'], rel=1e-3, abs=1e-4), (nll, reported['nll'])
  else:
    mean = np.asarray(prediction.mean, np.float64)
    rmse = np.sqrt(np.mean((mean - y.reshape(mean.shape)) ** 2))
    assert rmse == pytest.approx(reported['rmse'], rel=1e-3)
    # The mixture's NLL over the members that predict (joint over target dims).
    mu, var = (np.asarray(a, np.float64)[~np.asarray(ensemble.frozen)]
               for a in (prediction.member_mean, prediction.member_variance))
    log_p = -0.5 * ((y.reshape(mu.shape[1:]) - mu) ** 2 / var + np.log(2 * np.pi * var))
    log_p = log_p.reshape(*log_p.shape[:2], -1).sum(-1)
    top = log_p.max(0)
    nll = -np.mean(top + np.log(np.mean(np.exp(log_p - top), 0)))
    assert nll == pytest.approx(reported['nll'], rel=1e-3, abs=1e-4), (nll, reported['nll'])
  alone = dist_ens.Ensemble.load(str(workdir), devices=jax.devices()[:1])
  for name, value in alone.predict(dataset.test.x[:64])._asdict().items():  # Its first 64.
    if hasattr(value, 'dtype'):
      first = arrays[name][:, :64] if name.startswith('member_') else arrays[name][:64]
      np.testing.assert_allclose(value, first, rtol=1e-3, atol=1e-4, err_msg=name)
  paths = ensemble.export(Path(workdir) / 'exported')
  assert len(paths) == ensemble.num_members
  for i, path in enumerate(paths):
    with np.load(path) as saved:
      got = {k: (saved[k].dtype.str, saved[k].shape, saved[k].tobytes()) for k in saved.files}
    assert _by_path(ensemble.member(i)) == got, i
  return ensemble
