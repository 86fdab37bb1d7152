"""A workdir written by the previous release (checkpoint format 2, before tasks, specs and
the 'model' axis: tests/data/format2_workdir, 2 MLP members trained 4 steps by commit
7422a05) still loads and resumes."""

import json
import shutil
from pathlib import Path

import ml_collections
import numpy as np

import dist_ens
from dist_ens.config import command_line, loading

FIXTURE = Path(__file__).parent / 'data' / 'format2_workdir'
DEFAULT = Path(__file__).parent.parent / 'configs' / 'default.py'


def _workdir(tmp_path):
  workdir = tmp_path / 'old'
  shutil.copytree(FIXTURE, workdir)
  return workdir


def test_an_old_workdir_loads_and_predicts(tmp_path):
  saved = json.loads((FIXTURE / 'config.json').read_text())
  assert 'task' not in saved and 'model' not in saved['mesh']  # Truly the old format.
  ensemble = dist_ens.Ensemble.load(str(_workdir(tmp_path)))
  assert ensemble.step == 4 and ensemble.num_members == 2
  probs = ensemble.predict(np.zeros((3, 40), np.float32)).probs
  assert probs.shape == (3, 10) and np.allclose(probs.sum(-1), 1, atol=1e-5)


def test_an_old_workdir_resumes_with_todays_config(tmp_path):
  workdir = _workdir(tmp_path)
  config = dist_ens.load_config(DEFAULT)
  config.num_members, config.model.widths = 2, (8,)
  config.train.steps, config.train.log_every, config.train.eval_every = 8, 2, 0
  config.checkpoint.every, config.writers = 4, ('jsonl',)
  final = dist_ens.train(config, str(workdir))
  steps = [json.loads(line)['step'] for line in (workdir / 'metrics.jsonl').open()
           if json.loads(line)['split'] == 'train']
  assert steps == [2, 4, 6, 8] and final['step'] == 8  # Continued from the old step 4.


def test_a_field_added_later_takes_its_default_or_the_old_behaviour():
  """upgrade() fills what an old config lacks from configs/default.py, except the fields
  whose default would change what the old run did (loading.OLD_BEHAVIOUR)."""
  saved = json.loads((FIXTURE / 'config.json').read_text())
  upgraded = loading.upgrade(saved)
  defaults = loading.to_dict(dist_ens.load_config(DEFAULT))
  assert loading.differences(upgraded, defaults)  # The old run's own values stay...
  assert set(command_line.config_fields(ml_collections.ConfigDict(upgraded))) >= set(
      command_line.config_fields(ml_collections.ConfigDict(defaults)))  # ...and none lacks.
  assert upgraded['eval']['joint_tau'] == 0 != defaults['eval']['joint_tau']
  assert upgraded['eval']['laplace'] == defaults['eval']['laplace']
