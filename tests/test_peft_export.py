"""PEFT-format adapters of a LoRA ensemble on a Hugging Face model (dist_ens.io.peft_adapters):
peft's PeftModel.from_pretrained on the transformers model gives each member's outputs.

tests/data/hf/peft_llama/ holds what this file's `export` wrote (member_{i}/
adapter_config.json and adapter_model.safetensors) and peft_logits.npz, peft's outputs of
those adapters on tests/data/hf/llama's reference inputs (tools/make_peft_fixtures.py, run
with torch, transformers and peft, none of them dist_ens dependencies). Here the same
3-step run is trained again: its export is its members' own factors in PEFT's layout,
and our model with the committed adapters gives peft's outputs.

Regenerate: PYTHONPATH=. python tests/test_peft_export.py, then tools/make_peft_fixtures.py.
"""

import json
import sys
import tempfile
from pathlib import Path
from typing import Any

import jax
import numpy as np

import dist_ens
from dist_ens import data
from dist_ens.ensembles import lora
from dist_ens.io.peft_adapters import PREFIX, export_peft
from dist_ens.io.pretrained import flatten, read_orbax
from dist_ens.models import hf as hf_models
from dist_ens.models.hf.checkpoint import Tensors

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / 'tests' / 'data' / 'hf'
FIXTURE = DATA / 'peft_llama'


def _train(workdir: Path) -> None:
  rng = np.random.default_rng(0)
  seq = rng.integers(3, 96, (64, 8)).astype(np.int32)
  dataset = data.from_arrays(seq[:48, :-1], seq[:48, 1:], seq[48:, :-1], seq[48:, 1:],
                             num_classes=96, pad_id=-1)
  config = dist_ens.load_config(ROOT / 'configs' / 'default.py')
  config.task = 'token_classification'
  config.model.init_from = 'hf:tests/data/hf/llama'
  config.ensemble.own, config.ensemble.lora_rank = 'lora', 2
  config.ensemble.lora_targets = 'attn/|mlp/'
  # One member a device, on 2 devices: a 'data' axis adds programs (each leaf's
  # shardings) and nothing the export reads; the slow test below splits members.
  config.num_members, config.data.batch_size, config.mesh.member, config.mesh.data = 2, 16, 2, 1
  config.optim.learning_rate = 3e-2
  config.train.steps, config.train.log_every, config.train.eval_every = 3, 1, 0
  config.checkpoint.every, config.writers = 3, ('jsonl',)
  # No joint log-loss: nothing reads it (an evaluation after training: the fit is the same).
  config.eval.joint_tau = 0
  dist_ens.train(config, str(workdir), dataset=dataset, devices=jax.devices()[:2])


def _member_logits(ens: dist_ens.Ensemble, member=None) -> np.ndarray:
  """Each member's logits on the reference inputs; `member(i)` gives its params
  (default: ens.member(i))."""
  x = np.load(DATA / 'llama' / 'reference.npz')['inputs']
  apply = jax.jit(lambda p: ens.model.apply(p, {}, x, train=False)[0])
  member = member or ens.member
  return np.stack([np.asarray(apply(member(i))) for i in range(ens.num_members)])


def export(out: Path) -> None:
  """Trains the run and writes its PEFT adapters into `out` (the fixture's dist_ens half)."""
  with tempfile.TemporaryDirectory() as workdir:
    _train(Path(workdir))
    export_peft(workdir, out)


def _modules() -> dict[str, str]:
  """Each params path of the llama fixture -> its PEFT module key prefix."""
  _, _, family, arch = hf_models.describe('hf:tests/data/hf/llama', 'init_from')
  return {w.path: PREFIX + w.name[:-len('.weight')] for w in family.weights(arch)}


def _member_adapter(params: dict, m: int) -> dict[str, np.ndarray]:
  """Member m's factors and head from its checkpoint, as PEFT stores them: lora_A = A.T,
  lora_B = B.T, the head's torch weight = its kernel.T (llama's modules are Linears)."""
  out = {}
  for path, module in _modules().items():
    if f'{path}/{lora.A}' in params:
      out[module + '.lora_A.weight'] = params[f'{path}/{lora.A}'][m].T
      out[module + '.lora_B.weight'] = params[f'{path}/{lora.B}'][m].T
    elif f'{path}/own' in params:
      out[module + '.weight'] = params[f'{path}/own'][m].T
  return out


def _with_adapter(ens: dist_ens.Ensemble, params: dict, folder: Path, m: int) -> Any:
  """Member m's params (ens.member(m): kernels formed w + s A @ B) with the factors and
  head of the PEFT adapter in `folder` in place of its own."""
  modules, adapter = _modules(), Tensors.open(folder)

  def leaf(path, x):
    name = '/'.join(str(getattr(k, 'key', getattr(k, 'idx', k))) for k in path)
    module = modules.get(name, '')
    if f'{name}/{lora.A}' in params:
      a = adapter.read(module + '.lora_A.weight', ()).T
      b = adapter.read(module + '.lora_B.weight', ()).T
      return params[f'{name}/shared'] + params[f'{name}/{lora.SCALE}'] * (a @ b)
    if f'{name}/own' in params:
      return adapter.read(module + '.weight', ()).T
    return x

  return jax.tree_util.tree_map_with_path(leaf, ens.member(m))


def test_exported_adapters_give_peft_the_members_outputs(tmp_path):
  """The export is our members' own factors as PEFT stores them (exact), and our model
  given the committed adapters computes what peft computed from them (a forward pass).
  The committed adapters were trained on another CPU: Adam's steps turn its rounding into
  differences no float tolerance bounds, so they are compared as adapters, not as ours."""
  _train(tmp_path / 'run')
  ens = dist_ens.Ensemble.load(str(tmp_path / 'run'))  # loaded once: exported and applied
  members = ens.export_adapters(tmp_path / 'peft')
  assert [m.name for m in members] == ['member_0', 'member_1']
  params = flatten(read_orbax(tmp_path / 'run' / 'checkpoints' / '3' / 'model')['params'])
  for m, member in enumerate(members):
    config = json.loads((member / 'adapter_config.json').read_text())
    committed = json.loads((FIXTURE / member.name / 'adapter_config.json').read_text())
    assert config == committed
    assert config['modules_to_save'] == ['lm_head'] and not config['fan_in_fan_out']
    ours, theirs = Tensors.open(member), Tensors.open(FIXTURE / member.name)
    assert sorted(ours) == sorted(theirs) == sorted(_member_adapter(params, m))
    assert 'base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight' in ours
    for name, expected in _member_adapter(params, m).items():
      np.testing.assert_array_equal(ours.read(name, ()), expected, err_msg=name)
  peft_logits = np.load(FIXTURE / 'peft_logits.npz')['logits']
  base = np.load(DATA / 'llama' / 'reference.npz')['logits']
  logits = _member_logits(ens, lambda m: _with_adapter(ens, params, FIXTURE / f'member_{m}', m))
  assert logits.shape == peft_logits.shape == (2, *base.shape)
  assert np.abs(logits - peft_logits).max() <= 1e-4
  assert np.abs(peft_logits - base).max() > 0.1  # the adapters change the model


def test_a_decoders_lora_ensemble_split_over_model_resumes_predicts_and_exports(tmp_path):
  """Issue 47's whole path: a LoRA ensemble of a decoder from an hf: folder on 8 devices
  with each member split over mesh.model=2 resumes exactly after a kill, loads still split,
  predicts per-token uncertainty and exports PEFT adapters."""
  from test_methods import _Stop  # pylint: disable=g-import-not-at-top

  def config():
    out = dist_ens.load_config(ROOT / 'configs' / 'default.py')
    out.task, out.model.init_from = 'token_classification', f'hf:{DATA / "llama"}'
    out.ensemble.own, out.ensemble.lora_rank, out.ensemble.lora_targets = 'lora', 2, 'attn/'
    out.num_members, out.data.batch_size = 2, 8
    out.mesh.member, out.mesh.data, out.mesh.model = 2, 2, 2
    out.mesh.fsdp_min_size = 16  # the fixture's kernels are small: split them anyway
    out.train.steps, out.train.log_every, out.train.eval_every = 4, 2, 0
    out.checkpoint.every, out.writers, out.eval.joint_tau = 2, ('jsonl',), 0
    return out

  rng = np.random.default_rng(1)
  seq = rng.integers(3, 96, (48, 8)).astype(np.int32)
  dataset = data.from_arrays(seq[:32, :-1], seq[:32, 1:], seq[32:, :-1], seq[32:, 1:],
                             num_classes=96, pad_id=-1)
  straight = dist_ens.train(config(), str(tmp_path / 'a'), dataset=dataset)
  try:
    dist_ens.train(config(), str(tmp_path / 'b'), dataset=dataset, actions=[_Stop(2)])
  except RuntimeError as e:
    assert 'injected fault' in str(e)
  resumed = dist_ens.train(config(), str(tmp_path / 'b'), dataset=dataset)
  assert resumed['members'] == straight['members']
  ens = dist_ens.Ensemble.load(str(tmp_path / 'b'))
  split = [leaf for leaf in jax.tree.leaves(ens._stored)  # pylint: disable=protected-access
           if 'model' in jax.tree.leaves(tuple(leaf.sharding.spec))]
  assert split, 'no leaf is split over the model axis after loading'
  out = ens.predict(seq[32:35, :-1])
  assert out.member_probs.shape == (2, 3, 7, 96) and out.mutual_information.shape == (3, 7)
  assert (out.mutual_information > -1e-5).all() and out.mutual_information.max() > 0
  members = ens.export_adapters(tmp_path / 'peft')
  assert [m.name for m in members] == ['member_0', 'member_1']
  for member in members:
    assert json.loads((member / 'adapter_config.json').read_text())['r'] == 2
    assert 'base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight' in Tensors.open(member)

if __name__ == '__main__':
  sys.path.insert(0, str(ROOT / 'tests'))
  import conftest  # noqa: F401  (8 fake devices, as the test)
  export(FIXTURE)
