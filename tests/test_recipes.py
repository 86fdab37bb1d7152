"""Recipe configs (configs/*_wrn28_10.py, mnist_lenet5.py): each trains a few steps on
locally written TFDS data under the real data set's name and shape, its model builds at
full size, and its schedule, epochs and weight decay are the published recipe's. Also the
config fields those recipes rely on: train.epochs, precision, augment, micro-batches."""

import io
from pathlib import Path

import jax
import numpy as np
import pytest

import tensorflow_datasets as tfds  # In the test extra: these tests must run, not skip.
from PIL import Image

import dist_ens
from dist_ens.run.run_data import build_data
from dist_ens.run import mesh_layout
from dist_ens.config import specs
from dist_ens import plan as plan_lib
from dist_ens.run import assemble
from dist_ens.config import checks, loading
from dist_ens.core import optim
from dist_ens.errors import ConfigError

CONFIGS = Path(__file__).resolve().parents[1] / 'configs'


def _png(array):
  buffer = io.BytesIO()
  Image.fromarray(array.squeeze(-1) if array.shape[-1] == 1 else array).save(buffer, 'PNG')
  return buffer.getvalue()


def _mock_builder(name, shape, num_classes, extra=None):
  """A builder that writes `name` as TFDS's registered one reads it (same version and
  features), with 64 train and 16 test examples whose label is readable from the pixels."""
  real = tfds.builder_cls(name)
  extra = extra or {}

  class Mock(tfds.core.GeneratorBasedBuilder, skip_registration=True):
    VERSION = real.VERSION

    def _info(self):
      features = {'image': tfds.features.Image(shape=shape),
                  'label': tfds.features.ClassLabel(num_classes=num_classes), **extra}
      return tfds.core.DatasetInfo(builder=self, features=tfds.features.FeaturesDict(features),
                                   supervised_keys=('image', 'label'))

    def _split_generators(self, dl_manager):
      del dl_manager
      return {'train': self._generate_examples(0, 64), 'test': self._generate_examples(64, 16)}

    def _generate_examples(self, offset, n):
      for i in range(offset, offset + n):
        example = {'image': _png(np.full(shape, 20 * (i % 10), np.uint8)),
                   'label': i % num_classes}
        example.update({k: (f'id{i}' if k == 'id' else 0) for k in extra})
        yield i, example

  Mock.name = name
  return Mock


@pytest.fixture(scope='module')
def data_dir(tmp_path_factory):
  path = str(tmp_path_factory.mktemp('tfds'))
  for builder in (
      _mock_builder('cifar10', (32, 32, 3), 10, {'id': tfds.features.Text()}),
      _mock_builder('cifar100', (32, 32, 3), 100, {'id': tfds.features.Text(),
                                                  'coarse_label': tfds.features.ClassLabel(
                                                      num_classes=20)}),
      _mock_builder('mnist', (28, 28, 1), 10)):
    builder(data_dir=path, file_format='array_record').download_and_prepare()
  return path


RECIPES = {  # file: (data set, classes, train examples, steps at full size, params, members)
    'cifar10_wrn28_10.py': ('cifar10', 10, 50_000, 200 * 97, 36_479_194, 4),
    'cifar100_wrn28_10.py': ('cifar100', 100, 50_000, 200 * 97, 36_536_884, 4),
    'mnist_lenet5.py': ('mnist', 10, 60_000, 200 * 117, 61_706, 10),
}


@pytest.mark.parametrize('name', sorted(RECIPES))
def test_recipe_is_the_published_one_at_full_size(name):
  dataset, classes, examples, steps, params, members = RECIPES[name]
  config = loading.load_config(CONFIGS / name)
  checks.validate(config)
  assert (config.data.name, config.num_members, config.data.batch_size) == (dataset, members, 512)
  assert (config.optim.name, config.optim.nesterov, config.optim.momentum) == ('sgd', True, 0.9)
  assert config.optim.learning_rate == pytest.approx(0.1 * 512 / 128)
  # L2 2e-4 (gradient 4e-4 w) through momentum 0.9 = decoupled decay 4e-3 on everything.
  assert config.optim.weight_decay == pytest.approx(4e-3) and config.optim.decay_mask == 'all'
  assert config.data.augment == ('crop_flip' if 'cifar' in name else 'none')
  resolved = checks.resolve_epochs(config, examples)
  assert resolved.train.steps == steps and config.train.epochs == 200
  multiplier = optim.schedule(specs.optim_spec(resolved), resolved.train.steps)
  per_epoch = steps // 200
  lr = {epoch: float(multiplier(epoch * per_epoch)) for epoch in (0, 1, 59, 60, 120, 160, 199)}
  assert lr[0] == 0 and lr[1] == lr[59] == 1  # One epoch of warm-up, then the peak.
  np.testing.assert_allclose([lr[60], lr[120], lr[160], lr[199]], [0.2, 0.04, 0.008, 0.008],
                             rtol=1e-5)
  # The full-size model, abstractly (eval_shape: no parameters materialised).
  mesh = mesh_layout.build_mesh(config, jax.devices()[:1])
  parts = assemble.build_parts(config, mesh, *plan_lib.data_shape(config))
  assert sum(x.size for x in jax.tree.leaves(parts.abstract_state.params)) == members * params


# cifar10_wrn28_10.py is cifar100_wrn28_10.py's base (only the data set differs), so it
# trains here through it; its own data set is read in the next test.
@pytest.mark.parametrize('name', ['cifar100_wrn28_10.py', 'mnist_lenet5.py'])
def test_recipe_trains_on_locally_written_tfds_data(tmp_path, data_dir, name):
  config = loading.load_config(CONFIGS / name)
  config.data.data_dir = data_dir
  # Small enough for a CPU test; data set, preprocessing, optimizer, schedule and the
  # model family are the recipe's (the full-size model is built in the test above).
  # One device and lax.conv: the quickest compile on a CPU (meshes are tested elsewhere).
  config.data.batch_size, config.num_members, config.mesh.member = 16, 2, 1
  config.train.epochs, config.train.steps = 0, 2
  config.train.log_every, config.train.eval_every, config.checkpoint.every = 2, 0, 2
  config.optim.warmup_steps = 1
  config.model.depth, config.model.widen_factor = 10, 1  # (read by the WRNs only)
  config.model.conv_impl = 'xla'
  final = dist_ens.train(config, str(tmp_path), devices=jax.devices()[:1])
  dataset, classes, *_ = RECIPES[name]
  assert final['step'] == 2 and final['num_members'] == config.num_members
  assert len(final['members']['accuracy']) == config.num_members
  assert final['train_step_traces'] == 1 and not final['frozen_members']
  assert (tmp_path / 'checkpoints').is_dir()
  del dataset, classes


def test_cifar10_recipe_reads_its_data_set(data_dir):
  config = loading.load_config(CONFIGS / 'cifar10_wrn28_10.py')
  config.data.data_dir, config.data.batch_size = data_dir, 16
  run_data = build_data(config)
  assert (run_data.dataset.input_shape, run_data.dataset.num_classes) == ((32, 32, 3), 10)
  x, y = run_data.dataset.train.read(np.arange(10))
  # Pixels 20 * label / 255, standardised with the recipe's CIFAR-10 statistics.
  expected = (20 * np.asarray(y)[:, None] / 255 - np.array(config.data.mean)) / np.array(
      config.data.std)
  np.testing.assert_allclose(x[:, 0, 0, :], expected, rtol=1e-5)


def test_plan_needs_no_data_on_disk_and_resolves_epochs(tmp_path):
  config = loading.load_config(CONFIGS / 'mnist_lenet5.py')
  config.data.data_dir = str(tmp_path / 'nothing here')
  # Batch 50: the plan's dry run (a few real steps at -O0) costs a tenth of batch 500's;
  # the sizes, epochs and FLOPs an example checked do not depend on it.
  config.num_members, config.mesh.member, config.data.batch_size = 2, 1, 50
  config.model.conv_impl = 'xla'  # Compiles faster than patches on a CPU.
  plan = plan_lib.make_plan(config, jax.devices()[:1])
  assert plan.params_per_member == 61_706
  assert (plan.train_steps, plan.steps_per_epoch) == (200 * 1200, 1200)
  # LeNet-5 forward is ~0.85 MFLOPs an example (2 x 416k multiply-adds); training
  # (forward, backward, update) costs about three forwards.
  assert 1.5e6 < plan.flops_per_example < 5e6
  assert not (tmp_path / 'nothing here').exists()


@pytest.mark.parametrize('field,value,match', [
    ('precision', 'float16', r"config.precision='float16' is invalid: use one of \['float32', "
                             r"'bfloat16'\]"),
    ('reproducible', None, 'config.reproducible=None is invalid: must be True or False'),
    ('data.augment', 'flip', r"config.data.augment='flip' is invalid: use one of \['crop_flip', "
                             r"'none'\], or your own .*'my_pkg.aug:fn'"),
    ('train.micro_batches', 3, 'config.train.micro_batches=3 is invalid: must divide '
                               'data.batch_size=128, e.g. 2'),
    ('train.micro_batches', 0, 'config.train.micro_batches=0 is invalid: must be an int >= 1'),
    ('train.epochs', -1, 'config.train.epochs=-1 is invalid: must be an int >= 0'),
])
def test_bad_fields_are_one_line_naming_the_field(field, value, match):
  config = loading.load_config(CONFIGS / 'default.py')
  section, _, key = field.rpartition('.')
  (config[section] if section else config)[key] = value
  with pytest.raises(ConfigError, match=match):
    checks.validate(config)


def test_good_fields_pass():
  config = loading.load_config(CONFIGS / 'default.py')
  config.precision, config.reproducible = 'bfloat16', True
  config.data.augment, config.train.micro_batches = 'my_pkg.aug:fn', 4
  checks.validate(config)


def test_epochs_set_steps_once_the_data_size_is_known():
  config = loading.load_config(CONFIGS / 'default.py')
  config.lock()
  assert checks.resolve_epochs(config, 4000) is config  # epochs=0: steps count.
  config.train.epochs = 3
  checks.validate(config)  # train.steps no longer has to suit steps_per_call.
  resolved = checks.resolve_epochs(config, 4000 + 127)
  assert resolved.train.steps == 3 * 32 and config.train.steps == 2000  # A copy.
  assert resolved.is_locked
  config.train.steps_per_call, config.train.log_every = 10, 250
  with pytest.raises(ConfigError, match=r'config.train.epochs=3 is invalid: gives '
                                        r'train.steps=96 \(32 steps an epoch\), not a multiple '
                                        r'of train.steps_per_call=10'):
    checks.resolve_epochs(config, 4000 + 127)


def test_warmup_in_epochs_sets_warmup_steps_in_step_and_epoch_runs():
  config = loading.load_config(CONFIGS / 'default.py')
  config.optim.schedule, config.optim.warmup_epochs = 'cosine', 2.5
  checks.validate(config)
  # 4000 examples at batch 128: 31 steps an epoch, so 2.5 epochs are 78 steps.
  assert checks.resolve_epochs(config, 4000).optim.warmup_steps == 78
  config.train.epochs = 10
  resolved = checks.resolve_epochs(config, 4000)
  assert (resolved.train.steps, resolved.optim.warmup_steps) == (310, 78)
  config.optim.warmup_steps = 5
  with pytest.raises(ConfigError, match=r'optim.warmup_epochs=2.5 is invalid: and '
                                        r'optim.warmup_steps=5 are both set'):
    checks.validate(config)
