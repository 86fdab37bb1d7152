"""Issue 45 ("Correct at the edges"), items 5 to 11: a misspelt config field, bad data,
noise in a normal run and the faults that still printed a traceback each end in one
line (or none), found before anything trains."""

import json
import logging
import math
import re
import os
import sys
from pathlib import Path

import jax
import ml_collections
import numpy as np
import pytest

import forks
import support
from forks import Answer

import dist_ens
from dist_ens.run import mesh_layout
from dist_ens import data, importing
from dist_ens.run import assemble
from dist_ens.run.run_data import build_data
from dist_ens.config import loading
from dist_ens.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]
_LIMIT_S = 300


def _config():
  return support.config()


def _one_line(result: Answer) -> str:
  assert result.returncode not in (0, 124), result.stderr[-3000:]
  lines = result.stderr.strip().splitlines()
  assert len(lines) == 1, result.stderr[-3000:]
  return lines[0]


# Each command line and the Python run in a process of its own, for the price of one
# interpreter's imports (1.7-2.1 CPU s a command line in a fresh one; tests/forks.py): this
# child imports what dist_ens.main imports and this file (JAX, dist_ens's modules it names;
# no backend starts, so no JAX thread runs), as the Python script it replaces did before it
# trained, and forks a process per job. A command line runs dist_ens.main as __main__; the
# Python job trains support.config() from its workdir.
_FORK_A_PROCESS_PER_JOB = r"""
import os
from dist_ens import commands
from dist_ens.config import command_line
import forks
import test_edges

def train(workdir):
  from dist_ens.data import pipeline
  # The prefetch thread idle between two logs (it ran ahead while the step compiled, or a
  # read is slower than the interval): no examples and no busy time in the interval.
  pipeline.Batches.stats = property(lambda self: pipeline.PipelineStats(64, 0.5))
  config = test_edges._config()
  config.writers = ('jsonl', 'tensorboard')
  os.chdir(workdir)  # Run from outside the repository, as a user's script would be.
  test_edges.dist_ens.train(config, workdir)

def run(job, prefix):
  kind, args = job
  if kind == 'train':
    train(*args)
  else:
    forks.dist_ens_main(args)

forks.fork_each(run)
"""


@pytest.fixture(scope='module')
def answers(tmp_path_factory) -> dict[str, tuple[Answer, Path]]:
  """{job: (its answer, its folder)}: the command lines below and a Python run of
  support.config() (writers jsonl and tensorboard, the pipeline's stats idle), each in a
  process of its own, from one child process."""
  root = tmp_path_factory.mktemp('edges_answers')
  folders = {name: root / name for name in ('typo', 'dataset', 'foreign', 'long', 'train')}
  for folder in folders.values():
    folder.mkdir()
  (folders['typo'] / 'typo.py').write_text(
      f'from dist_ens import load_config\n'
      f'def get_config():\n'
      f'  c = load_config({str(ROOT / "configs" / "default.py")!r})\n'
      f'  c.optim.learing_rate = 0.5\n'
      f'  return c\n')
  jobs = {
      'typo': ('main', [f'--config={folders["typo"] / "typo.py"}',
                        f'--workdir={folders["typo"] / "run"}']),
      'dataset': ('main', ['--config=configs/default.py', f'--workdir={folders["dataset"]}',
                           '--config.data.name=mnist1']),
      'foreign': ('main', ['report', f'--workdir={folders["foreign"]}']),
      'long': ('main', ['--config=configs/default.py',
                        f'--workdir={folders["long"] / ("a" * 300) / "run"}']),
      'train': ('train', [str(folders['train'])]),
  }
  env = {k: v for k, v in os.environ.items() if not k.startswith(('SLURM_', 'OMPI_', 'PMI_'))}
  env.update(XLA_FLAGS=support.xla_flags(8), JAX_PLATFORMS='cpu')
  got = forks.answers(_FORK_A_PROCESS_PER_JOB, list(jobs.values()), root / 'answers', env,
                      _LIMIT_S)
  return {name: (answer, folders[name]) for (answer, _), name in zip(got, jobs)}


# Item 5: unknown fields from config files and from Python.

def test_a_config_files_misspelt_field_is_refused_in_one_line(answers):
  answer, folder = answers['typo']  # --config=typo.py, a file that sets c.optim.learing_rate
  line = _one_line(answer)
  assert line == ('dist-ens: error: config.optim.learing_rate is not a config field '
                  '(dist_ens/config/defaults.py), so nothing would read it; did you mean '
                  'config.optim.learning_rate?')
  assert not (folder / 'run').exists()


def test_an_unknown_group_from_python_is_refused_before_anything_is_written(tmp_path):
  config = _config()
  config.augmentation = ml_collections.ConfigDict(dict(kind='flip'))
  with pytest.raises(ConfigError, match=r'^config.augmentation is not a config field '
                     r'\(dist_ens/config/defaults.py\), so nothing would read it; config has '
                     r'checkpoint, data, '):
    dist_ens.train(config, str(tmp_path / 'run'))
  assert not (tmp_path / 'run').exists()


def test_fields_only_some_models_data_sets_or_factories_read_are_known():
  for path in sorted((ROOT / 'configs').glob('*.py')):  # resnet's depth, vit's heads, ...
    loading.check_known_fields(loading.load_config(path))
  config = _config()
  config.data.add_channel = False  # TFDS only
  config.model.kwargs = ml_collections.ConfigDict(dict(anything=1, nested=dict(x=2)))
  loading.check_known_fields(config)


# Item 7: no noise in a normal run.

def test_a_normal_run_writes_no_infinite_pipeline_capacity(answers):
  # The Python run's pipeline stats are idle between two logs (_FORK_A_PROCESS_PER_JOB's
  # train): no examples and no busy time in the interval. Its stderr holds every log line
  # (INFO and up) and anything else the run printed.
  answer, workdir = answers['train']
  assert answer.returncode == 0, answer.stderr[-3000:]
  assert 'step 4/4' in answer.stderr and 'NaN or Inf' not in answer.stderr, answer.stderr
  assert list((workdir / 'tensorboard').iterdir()), 'no tensorboard events'
  events = [json.loads(line) for line in (workdir / 'metrics.jsonl').read_text().splitlines()]
  train = [e for e in events if e['split'] == 'train']
  assert train
  for event in train:  # A finite figure, or none when the pipeline was idle.
    assert math.isfinite(event.get('input_pipeline_capacity_per_s', 0.0)), event


# Item 6: bad data is found when the data set is read.

@pytest.mark.parametrize('split', ['train', 'test'])
def test_nan_or_inf_inputs_are_refused_at_load_naming_the_split_and_row(tmp_path, split):
  rng = np.random.default_rng(0)
  arrays = {'train': rng.normal(size=(64, 5)), 'test': rng.normal(size=(16, 5))}
  arrays[split][7, 2], arrays[split][9, 0] = np.nan, np.inf
  dataset = data.from_arrays(arrays['train'], np.arange(64) % 2, arrays['test'],
                             np.arange(16) % 2, name='bad')
  with pytest.raises(ConfigError, match=rf"^dataset 'bad' \({split} split\): input row 7 "
                     r'holds NaN or Inf \(2 of \d+ rows do\)'):
    dist_ens.train(_config(), str(tmp_path / 'run'), dataset=dataset)
  assert not (tmp_path / 'run').exists()


def test_class_ids_as_regression_targets_get_one_warning(caplog):
  config = _config()
  config.task = 'regression'
  with caplog.at_level(logging.WARNING):
    build_data(config)
  warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
  assert warnings == ["dataset 'mnist1d' has integer labels 0..9, the class ids of a "
                      "classification data set, and config.task='regression' fits them as "
                      "numbers; use task='classification' if they are classes."], warnings
  caplog.clear()
  config.task = 'classification'
  with caplog.at_level(logging.WARNING):
    build_data(config)
  assert not [r for r in caplog.records if r.levelno == logging.WARNING]


# Item 11, the small ones.

def test_a_misspelt_embedded_dataset_gets_did_you_mean_in_one_line(answers, monkeypatch):
  line = _one_line(answers['dataset'][0])  # --config.data.name=mnist1; no leaked TFDS line.
  assert line == ("dist-ens: error: config.data.name='mnist1' is neither an embedded dataset "
                  'nor a TFDS one prepared in data_dir ~/tensorflow_datasets (TFDS_DATA_DIR); '
                  "did you mean 'mnist1d'?")
  monkeypatch.setitem(sys.modules, 'tensorflow_datasets', None)  # Not installed.
  with pytest.raises(ConfigError, match=r"^config.data.name='mnist1' is not an embedded "
                     r"dataset; did you mean 'mnist1d'\? \(Other names are TFDS"):
    data.load_dataset('mnist1')


def test_the_repositorys_examples_say_where_they_import_from(monkeypatch, tmp_path):
  monkeypatch.chdir(tmp_path)  # From the repository root they import (importing.py).
  monkeypatch.setattr(sys, 'path', [p for p in sys.path if Path(p or '.').resolve() != ROOT])
  examples = lambda: [m for m in sys.modules if m == 'examples' or m.startswith('examples.')]
  for name in examples():
    monkeypatch.delitem(sys.modules, name)
  try:
    with pytest.raises(ConfigError, match=r"^config.model.factory='examples.plain_jax:make_model' "
                       r"cannot be imported: ModuleNotFoundError: No module named 'examples[.a-z_]*' "
                       r'\(the examples/ folder is in the dist_ens repository, not in the '
                       rf'installed package: run from {ROOT}, or add it to PYTHONPATH\)$'):
      importing.load_object('examples.plain_jax:make_model', 'config.model.factory')
  finally:  # The failed import left dm-haiku's own `examples` namespace in sys.modules: later
    for name in examples():  # tests of this worker would import from it, not examples/.
      del sys.modules[name]


def _pbt_config():
  config = _config()
  config.num_members, config.train.steps, config.checkpoint.every = 4, 8, 8
  config.data.validation_size, config.writers = 100, ('jsonl',)
  config.optim.learning_rate = (1e-4, 1e-3, 1e-2, 3e-2)
  config.pbt.enabled, config.pbt.interval = True, 4
  return config


def test_pbt_says_each_round_in_one_line_and_its_report_draws_no_false_step(tmp_path, caplog):
  from dist_ens.report import pbt as report_pbt  # pylint: disable=import-outside-toplevel
  with caplog.at_level(logging.INFO):
    dist_ens.train(_pbt_config(), str(tmp_path))
  lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith('pbt round')]
  assert len(lines) == 1 and re.fullmatch(
      r'pbt round 1 at step 4: validation nll \d\.\d{4} to \d\.\d{4}; member \d copied '
      r'member \d', lines[0]), lines
  events = [json.loads(line) for line in (tmp_path / 'metrics.jsonl').read_text().splitlines()]
  s = report_pbt.schedules(_pbt_config(), events)
  for field in ('optim.b1', 'optim.momentum', 'optim.weight_decay'):  # Never explored.
    assert np.ptp(s['fields'][field]) == 0, (field, s['fields'][field])


def test_idle_devices_that_only_the_fixed_axis_leaves_idle_say_what_to_set(caplog):
  config = _config()
  config.num_members = 4  # mesh.member=-1, data=1: 4 x 1 on 8 devices; 4 x 2 uses them all.
  with caplog.at_level(logging.WARNING):
    mesh = mesh_layout.build_mesh(config, jax.devices())
  assert mesh.size == 4
  warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
  assert warned == ['4 of 8 devices stay idle: config.mesh.data=1 leaves no mesh over all of '
                    'them for num_members=4; set mesh.member=4 and mesh.data=2 to use every '
                    'device.'], warned


def test_log_lines_from_python_carry_no_absl_prefix(answers):
  result, _ = answers['train']  # dist_ens.train(support.config(), ...) from a Python script
  assert result.returncode == 0, result.stderr[-3000:]
  lines = result.stderr.splitlines()
  assert 'step 4/4' in result.stderr and lines[0].startswith('warning: 4 of 8 devices'), lines
  assert not [line for line in lines if ':absl:' in line], result.stderr


def test_report_on_a_missing_or_foreign_workdir_says_so(answers, tmp_path):
  # The command line once, on a foreign workdir (test_cli's test_missing_report_workdir_is_one_line
  # runs it on a missing one); the messages it prefixes, from report.make_report itself.
  from dist_ens.report import build as report  # pylint: disable=import-outside-toplevel
  answer, foreign = answers['foreign']  # report --workdir=an empty folder
  line = _one_line(answer)
  assert line == (f'dist-ens report: error: {foreign} is not a dist_ens workdir (it has no '
                  'config.json, checkpoints/ or final_metrics.json); name the workdir of a '
                  'finished run.')
  with pytest.raises(FileNotFoundError) as missing:
    report.make_report(str(tmp_path / 'nonexistent'))
  assert str(missing.value) == (f'{tmp_path / "nonexistent"} does not exist; name the '
                                'workdir of a finished run.')
  (tmp_path / 'config.json').write_text('{}')
  with pytest.raises(FileNotFoundError, match='has not finished'):
    report.make_report(str(tmp_path))


# Item 8: faults that still showed a traceback.

def test_a_workdir_component_over_255_bytes_is_one_line(answers):
  answer, folder = answers['long']
  workdir = folder / ('a' * 300) / 'run'
  line = _one_line(answer)
  assert line == (f'dist-ens: error: --workdir={workdir}: its component {"a" * 40}... is 300 '
                  'bytes, over the 255 a file name may have; use a shorter name.')


def test_a_full_disks_unretrieved_future_prints_nothing(caplog):
  import asyncio  # pylint: disable=import-outside-toplevel
  import gc  # pylint: disable=import-outside-toplevel
  # Imported for its filters.  pylint: disable-next=import-outside-toplevel,unused-import
  import dist_ens.io.checkpoint  # noqa: F401

  def drop_failed_future(error):
    loop = asyncio.new_event_loop()
    future = loop.create_future()
    future.set_exception(error)
    del future
    gc.collect()
    loop.close()

  with caplog.at_level(logging.ERROR, logger='asyncio'):
    drop_failed_future(ValueError('Error writing "d/ocdbt.process_0/d/1": [errno 28] No space '
                                  'left on device'))
    assert not [r for r in caplog.records if r.name == 'asyncio'], caplog.text
    drop_failed_future(ValueError('another failure'))  # Not a full disk: still shown.
    assert [r for r in caplog.records if r.name == 'asyncio'], caplog.text


# Item 9 (parts).

def test_the_flops_estimate_traces_token_models_with_their_int_inputs(monkeypatch):
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  from dist_ens.parallel import strategy  # pylint: disable=import-outside-toplevel
  from dist_ens.training import cadence  # pylint: disable=import-outside-toplevel
  config = _config()
  config.model.name = 'token_transformer'
  config.model.vocab_size, config.model.hidden, config.model.depth = 16, 32, 1
  config.model.heads, config.model.mlp_dim = 4, 64
  parts = assemble.build_run(config, shapes=((12,), 3, jnp.int32)).parts
  traced = []
  forward = strategy._abstract_forward  # pylint: disable=protected-access
  monkeypatch.setattr(strategy, '_abstract_forward', lambda *a: traced.append(a) or forward(*a))
  assert cadence.step_flops(config.data.batch_size, parts) is not None
  assert [a[-1] for a in traced] == [jnp.int32]


def test_a_pbt_copy_perturbed_past_the_bound_is_no_clone_of_its_source():
  from dist_ens.core import hparams as hparams_lib  # pylint: disable=import-outside-toplevel
  from dist_ens.ensembles import pbt as pbt_lib  # pylint: disable=import-outside-toplevel
  lr = 'optim.learning_rate'
  spec = pbt_lib.make_spec(
      interval=4, metric='nll', quantile=0.5, fields=(lr,), perturb_factors=(0.8, 1.2),
      resample_probability=0.0, seed=0, configured={lr: 'loguniform(1e-4,1e-2)'},
      varying=(lr,), select_metrics={'nll': False})
  hp = {f: np.full(4, 0.5, np.float32) for f in hparams_lib.FIELDS}
  hp[lr] = np.array([1e-4, 1e-2, 1e-3, 2e-3], np.float32)  # The best two sit at the bounds.
  for round_index in range(1, 20):
    decision = pbt_lib.decide(spec, round_index, [0.2, 0.1, 0.5, 0.6], hp)
    for member in (2, 3):
      source = decision.sources[member]
      assert decision.hparams[lr][member] != hp[lr][source], (round_index, member)
      assert 1e-4 <= decision.hparams[lr][member] <= 1e-2


def test_orbax_errors_show_as_one_line_but_a_thread_outliving_the_close_not_at_all():
  from dist_ens.io import checkpoint  # pylint: disable=import-outside-toplevel
  [quiet] = [f for f in logging.getLogger('absl').filters if type(f).__name__ == '_QuietOrbax']

  def record(message):
    return logging.LogRecord('absl', logging.ERROR, '/site-packages/orbax/checkpoint/x.py', 1,
                             message, (), None)

  late = record('[thread=write_metadata_after_commits] _SignalingThread.run() raised an '
                'exception: cannot schedule new futures after shutdown')
  assert not quiet.filter(late)
  assert not quiet.filter(record(f'write failed: {checkpoint.FULL_DISK_TEXTS[0]}'))
  other = record('a save failed: permission denied\nTraceback ...')
  assert quiet.filter(other) and other.getMessage() == 'a save failed: permission denied'
