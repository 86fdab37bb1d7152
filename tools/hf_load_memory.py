"""Host peak memory of loading a Hugging Face checkpoint split over 'model', against the
file's size: config.model.init_from='hf:PATH' placing each device's slice on its own
(dist_ens.models.hf, lazy reads) versus reading every tensor whole first.

  python tools/hf_load_memory.py [--hidden 1024 --layers 4 --vocab 16000]

Writes a random Llama checkpoint (model.safetensors, float32) to a temporary folder,
then in a fresh process per mode places it on 8 fake CPU devices, mesh member 1 x data
1 x model 8, FSDP over 'model', and reports the rise of the process's peak resident
memory (VmHWM, reset just before loading) over its resident memory then. On a CPU the
devices' buffers are host memory too, so holding the placed weights alone costs 1.0x
the file: 'split' should stay near that; 'whole' (every tensor read into memory, then
placed) near 2x.
"""

import argparse
import json
import os
import struct
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]


def write_llama(folder: Path, hidden: int, layers: int, vocab: int) -> int:
  """A random LlamaForCausalLM checkpoint; returns the safetensors file's size."""
  heads, kv_heads, mlp = hidden // 64, hidden // 256, hidden * 11 // 4
  config = {'architectures': ['LlamaForCausalLM'], 'hidden_size': hidden,
            'intermediate_size': mlp, 'num_hidden_layers': layers,
            'num_attention_heads': heads, 'num_key_value_heads': kv_heads,
            'vocab_size': vocab, 'rms_norm_eps': 1e-6, 'tie_word_embeddings': False}
  head_dim = hidden // heads
  shapes = {'model.embed_tokens.weight': (vocab, hidden), 'model.norm.weight': (hidden,),
            'lm_head.weight': (vocab, hidden)}
  for i in range(layers):
    m = f'model.layers.{i}'
    shapes.update({f'{m}.input_layernorm.weight': (hidden,),
                   f'{m}.post_attention_layernorm.weight': (hidden,),
                   f'{m}.self_attn.q_proj.weight': (heads * head_dim, hidden),
                   f'{m}.self_attn.k_proj.weight': (kv_heads * head_dim, hidden),
                   f'{m}.self_attn.v_proj.weight': (kv_heads * head_dim, hidden),
                   f'{m}.self_attn.o_proj.weight': (hidden, heads * head_dim),
                   f'{m}.mlp.gate_proj.weight': (mlp, hidden),
                   f'{m}.mlp.up_proj.weight': (mlp, hidden),
                   f'{m}.mlp.down_proj.weight': (hidden, mlp)})
  header, offset = {}, 0
  for name, shape in shapes.items():
    size = 4 * int(np.prod(shape))
    header[name] = {'dtype': 'F32', 'shape': list(shape), 'data_offsets': [offset, offset + size]}
    offset += size
  text = json.dumps(header).encode()
  rng = np.random.default_rng(0)
  with open(folder / 'model.safetensors', 'wb') as f:
    f.write(struct.pack('<Q', len(text)) + text)
    for shape in shapes.values():
      f.write(rng.standard_normal(shape, np.float32).tobytes())
  (folder / 'config.json').write_text(json.dumps(config))
  return (folder / 'model.safetensors').stat().st_size


def _status(field: str) -> int:
  """A /proc/self/status field in bytes."""
  for line in Path('/proc/self/status').read_text().splitlines():
    if line.startswith(field + ':'):
      return int(line.split()[1]) * 1024
  raise RuntimeError(field)


def measure(folder: str, mode: str) -> None:
  """(In the child) place the checkpoint and print the peak rise in bytes."""
  import jax  # pylint: disable=import-outside-toplevel  # after XLA_FLAGS
  from dist_ens.io import init_from  # pylint: disable=import-outside-toplevel
  from dist_ens.models import hf  # pylint: disable=import-outside-toplevel
  from dist_ens.parallel import sharding_rules  # pylint: disable=import-outside-toplevel
  from dist_ens.parallel.layout import Layout  # pylint: disable=import-outside-toplevel

  source = f'hf:{folder}'
  mesh = jax.make_mesh((1, 1, 8), ('member', 'data', 'model'))
  layout = Layout(axes=('member', 'data', 'model'), rule=sharding_rules.fsdp('model',
                                                                             axis_size=8))
  model = hf.build(source)
  if mode == 'whole':  # the eager reader: every tensor in memory first
    leaves = hf.load_leaves
    hf_whole = lambda s, where='hf': {k: np.asarray(v) for k, v in leaves(s, where).items()}
    from dist_ens.io import pretrained  # pylint: disable=import-outside-toplevel
    pretrained.load_pretrained = lambda s: hf_whole(s)
    init_from.load_pretrained = pretrained.load_pretrained
  Path('/proc/self/clear_refs').write_text('5')  # resets VmHWM to the current RSS
  before = _status('VmRSS')
  placed = init_from.pretrained_leaves(init_from.InitFrom(source), model, (8,), 1, mesh,
                                       layout, owned=frozenset())
  jax.block_until_ready(placed)
  held = sum(s.data.nbytes for leaf in jax.tree.leaves(placed.params)
             for s in leaf.addressable_shards)
  print(json.dumps({'peak_rise': _status('VmHWM') - before, 'placed_bytes': held}))


def main() -> None:
  parser = argparse.ArgumentParser()
  parser.add_argument('--hidden', type=int, default=1024)
  parser.add_argument('--layers', type=int, default=4)
  parser.add_argument('--vocab', type=int, default=16000)
  parser.add_argument('--child', nargs=2)
  args = parser.parse_args()
  if args.child:
    measure(*args.child)
    return
  with tempfile.TemporaryDirectory() as tmp:
    size = write_llama(Path(tmp), args.hidden, args.layers, args.vocab)
    print(f'Llama checkpoint, hidden {args.hidden}, {args.layers} layers, vocab {args.vocab}: '
          f'model.safetensors {size / 2**20:.0f} MiB; mesh 1 x 1 x 8 (model), 8 CPU devices')
    env = {**os.environ, 'XLA_FLAGS': '--xla_force_host_platform_device_count=8',
           'JAX_PLATFORMS': 'cpu', 'PYTHONPATH': str(ROOT)}
    for mode in ('split', 'whole'):
      out = subprocess.run([sys.executable, __file__, '--child', tmp, mode], env=env,
                           check=True, capture_output=True, text=True).stdout
      result = json.loads(out.strip().splitlines()[-1])
      print(f'{mode:6s} peak host memory rise {result["peak_rise"] / 2**20:6.0f} MiB = '
            f'{result["peak_rise"] / size:.2f} x the file (the placed shards alone: '
            f'{result["placed_bytes"] / size:.2f} x)')


if __name__ == '__main__':
  main()
