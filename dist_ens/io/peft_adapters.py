"""A LoRA ensemble on a Hugging Face model, exported as PEFT adapters (issue 47 item 5).

A run with config.model.init_from='hf:PATH' and config.ensemble.own='lora' trains, per
member m and adapted kernel w [in, out], factors A_m [in, r] and B_m [r, out] with
kernel w + s * A_m @ B_m (s = alpha / r; dist_ens/ensembles/lora.py). PEFT stores, per
torch module, lora_A.weight [r', in] and lora_B.weight [out', r'] with weight +
(lora_alpha / r') * lora_B @ lora_A in torch's [out, in] (transposed back for GPT-2's
Conv1D, whose weight is [in, out]: fan_in_fan_out=True). So lora_A = A.T and lora_B = B.T.

The weight tables (dist_ens/models/hf/*.py) give each params path its state-dict name,
so the module names and PEFT's keys ('base_model.model.<module>.lora_A.weight') come
from the same table loading uses. A module dist_ens splits into parts (GPT-2's fused
c_attn holds q, k and v) gets one adapter of rank parts x r: lora_A stacks the parts'
A's, lora_B is block-diagonal, which is exactly their deltas side by side
(rank_pattern / alpha_pattern keep the scale). The member's own head (own='lora' trains
one per member) goes in modules_to_save, under PEFT's saved name
'base_model.model.<module>.weight'.

Base model: the adapters apply to the checkpoint config.model.init_from names, unchanged,
so a run that trained the shared weights (ensemble.train_shared) is refused.
"""

import json
import os
import struct
import tempfile
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from dist_ens.ensembles import lora
from dist_ens.io.adapters import newest_params
from dist_ens.models import hf as hf_models
from dist_ens.models.hf import weights as weights_lib

PREFIX = 'base_model.model.'


def write_safetensors(path: Path, tensors: dict[str, np.ndarray]) -> None:
  """A float32 .safetensors file (the format's header and raw little-endian bytes),
  written atomically; no torch or safetensors package needed."""
  header, chunks, offset = {}, [], 0
  for name in sorted(tensors):
    raw = np.ascontiguousarray(tensors[name], '<f4').tobytes()
    header[name] = {'dtype': 'F32', 'shape': list(np.shape(tensors[name])),
                    'data_offsets': [offset, offset + len(raw)]}
    chunks.append(raw)
    offset += len(raw)
  text = json.dumps(header, separators=(',', ':')).encode()
  text += b' ' * (-len(text) % 8)  # the format pads the header to 8 bytes
  with tempfile.NamedTemporaryFile(dir=path.parent, suffix='.tmp', delete=False) as tmp:
    tmp.write(struct.pack('<Q', len(text)) + text + b''.join(chunks))
  os.chmod(tmp.name, 0o644)  # a temporary file is private; the adapter is not
  os.replace(tmp.name, path)


def _layout(weight: weights_lib.Weight) -> tuple[str, int]:
  """('linear', 0) for a torch Linear weight [out, in]; ('in_out', first column) for a
  weight stored [in, out] (Conv1D), the leaf its columns from `first` on."""
  if weight.convert is weights_lib._transpose:  # pylint: disable=protected-access
    return 'linear', 0
  probe = np.arange(int(np.prod(weight.shape))).reshape(weight.shape)
  got = np.asarray(weight.convert(probe))
  if got.ndim != 2 or weight.shape[0] != got.shape[0] or not np.array_equal(
      got, probe[:, int(got[0, 0]):int(got[0, 0]) + got.shape[1]]):
    raise ValueError(f'{weight.name}: its params leaf {weight.path} is not a torch Linear or '
                     'a column block of an [in, out] weight; PEFT export cannot place it.')
  return 'in_out', int(got[0, 0])


def _run_config(workdir: Path) -> dict[str, Any]:
  return json.loads((workdir / 'config.json').read_text())


class _Adapters(NamedTuple):
  """What a LoRA checkpoint holds, per torch module: `factors` lists each adapted module's
  parts (first column, weight, A [M, in, r] or None, B [M, r, out] or None); `heads` the
  member-owned whole weights (layout, leaf [M, ...])."""
  factors: dict[str, list[tuple[int, weights_lib.Weight, Any, Any]]]
  heads: dict[str, tuple[str, Any]]
  layout: str  # 'linear' (torch [out, in]) or 'in_out' (GPT-2's Conv1D)
  rank: int
  scale: float
  num_members: int


def export_peft(workdir: str | os.PathLike, directory: str | os.PathLike) -> list[Path]:
  """Writes member i's adapter of a LoRA run on a Hugging Face model as PEFT does:
  directory/member_{i}/adapter_config.json and adapter_model.safetensors, loadable with
  `peft.PeftModel.from_pretrained(transformers_model, directory / 'member_0')`.

  Returns:
    The members' folders, in member order.

  Raises:
    FileNotFoundError: no checkpoint in `workdir`.
    ValueError: not a LoRA run on an hf: model, or one that trained the shared weights.
  """
  workdir = Path(workdir)
  source = _lora_source(workdir)
  folder, _, family, arch = hf_models.describe(source, 'config.model.init_from')
  table = {w.path: w for w in family.weights(arch)}
  adapters = _adapters(workdir, table, newest_params(workdir)[1])
  out = []
  for m in range(adapters.num_members):
    member = Path(directory) / f'member_{m}'
    member.mkdir(parents=True, exist_ok=True)
    tensors, adapter_config = _member_adapter(adapters, m)
    adapter_config['base_model_name_or_path'] = str(folder)
    write_safetensors(member / 'adapter_model.safetensors', tensors)
    (member / 'adapter_config.json').write_text(json.dumps(adapter_config, indent=2) + '\n')
    out.append(member)
  return out


def _lora_source(workdir: Path) -> str:
  """The run's init_from, refused where PEFT adapters cannot describe the run."""
  config = _run_config(workdir)
  source = config['model'].get('init_from') or ''
  if not hf_models.is_hf(source) or config['ensemble'].get('own') != 'lora':
    raise ValueError(f"{workdir}: PEFT export needs a run with config.model.init_from='hf:PATH' "
                     f"and config.ensemble.own='lora' (this one: init_from={source!r}, "
                     f"own={config['ensemble'].get('own')!r}).")
  if config['ensemble'].get('train_shared'):
    raise ValueError(f'{workdir}: config.ensemble.train_shared=True changed the base weights; '
                     "PEFT adapters apply to the unchanged checkpoint.")
  return source


def _adapters(workdir: Path, table: dict[str, weights_lib.Weight],
              params: dict[str, Any]) -> _Adapters:
  """The checkpoint's factors and heads by torch module (the weight table's names)."""
  modules: dict[str, list[str]] = {}  # torch module -> its params paths, in table order
  for path, weight in table.items():
    if weight.name.endswith('.weight'):
      modules.setdefault(weight.name[:-len('.weight')], []).append(path)
  adapted = {name[:-len('/' + lora.A)] for name in params if name.endswith('/' + lora.A)}
  rank = num_members = scale = None
  layouts, factors = set(), {}
  for module, paths in modules.items():
    if not any(p in adapted for p in paths):
      continue
    factors[module] = []
    for path in paths:
      layout, first = _layout(table[path])
      layouts.add(layout)
      a, b = (params.get(f'{path}/{k}') for k in (lora.A, lora.B))
      if a is not None:
        num_members, rank = a.shape[0], a.shape[-1]
        scale = float(params[f'{path}/{lora.SCALE}'])
      factors[module].append((first, table[path], a, b))
  if not factors:
    raise ValueError(f'{workdir}: the checkpoint holds no LoRA factors on the weight table.')
  if len(layouts) > 1:
    raise ValueError(f'{workdir}: the adapted kernels mix torch Linear and Conv1D weights, '
                     "which one PEFT config (fan_in_fan_out) cannot describe; narrow "
                     'config.ensemble.lora_targets.')
  heads = _heads(workdir, table, params, modules)
  return _Adapters(factors, heads, layouts.pop(), rank, scale, num_members)


def _heads(workdir: Path, table: dict[str, weights_lib.Weight], params: dict[str, Any],
           modules: dict[str, list[str]]) -> dict[str, tuple[str, Any]]:
  """Each member-owned leaf (own='lora' trains a head per member) as its torch module."""
  heads = {}
  for path in sorted(name[:-len('/own')] for name in params if name.endswith('/own')):
    weight = table.get(path)
    if weight is None or not weight.name.endswith('.weight'):
      raise ValueError(f'{workdir}: the member-owned leaf {path} is not a whole module weight '
                       'of the checkpoint; PEFT export cannot save it.')
    layout, _ = _layout(weight)
    module = weight.name[:-len('.weight')]
    if len(modules[module]) != 1:
      raise ValueError(f'{workdir}: the member-owned leaf {path} is part of {module}.')
    heads[module] = (layout, params[f'{path}/own'])
  return heads


def _module_factors(adapters: _Adapters, module: str, m: int) -> tuple[np.ndarray, np.ndarray]:
  """Member m's (lora_A [k r, in], lora_B [out, k r]) of a module of k parts: the parts'
  A's stacked, their B's block-diagonal (their deltas side by side, in file order)."""
  factors, rank, linear = adapters.factors[module], adapters.rank, adapters.layout == 'linear'
  k = len(factors)
  fan_in = factors[0][1].shape[1 if linear else 0]
  outs = [w.shape[0] if linear else np.shape(w.convert(np.zeros(w.shape)))[1]
          for _, w, _, _ in factors]
  a_all = np.zeros((k * rank, fan_in), np.float32)
  b_all = np.zeros((sum(outs), k * rank), np.float32)
  row = 0
  for j in sorted(range(k), key=lambda j: factors[j][0]):  # columns in file order
    _, _, a, b = factors[j]
    if a is not None:
      a_all[j * rank:(j + 1) * rank] = np.asarray(a[m], np.float32).T
      b_all[row:row + outs[j], j * rank:(j + 1) * rank] = np.asarray(b[m], np.float32).T
    row += outs[j]
  return a_all, b_all


def _member_adapter(adapters: _Adapters, m: int) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
  """Member m's PEFT tensors and adapter_config (less base_model_name_or_path)."""
  tensors, rank_pattern, alpha_pattern = {}, {}, {}
  rank, scale = adapters.rank, adapters.scale
  for module, factors in adapters.factors.items():
    a, b = _module_factors(adapters, module, m)
    tensors[f'{PREFIX}{module}.lora_A.weight'] = a
    tensors[f'{PREFIX}{module}.lora_B.weight'] = b
    if len(factors) > 1:
      rank_pattern[module] = len(factors) * rank
      alpha_pattern[module] = scale * len(factors) * rank
  for module, (layout, leaf) in adapters.heads.items():
    own = np.asarray(leaf[m], np.float32)
    tensors[f'{PREFIX}{module}.weight'] = own.T if layout == 'linear' else own
  adapter_config = {
      'peft_type': 'LORA', 'task_type': None, 'base_model_name_or_path': None,
      'r': int(rank), 'lora_alpha': scale * rank, 'lora_dropout': 0.0, 'bias': 'none',
      'target_modules': sorted(adapters.factors),
      'fan_in_fan_out': adapters.layout == 'in_out',
      'modules_to_save': sorted(adapters.heads) or None, 'rank_pattern': rank_pattern,
      'alpha_pattern': alpha_pattern, 'use_rslora': False, 'use_dora': False,
      'init_lora_weights': True, 'inference_mode': True}
  return tensors, adapter_config
