"""Packed-Ensembles beside torch-uncertainty's: their layers, dist_ens's setting (issue 66, item 4).

Runs in tools/.venv-tu (compare.py's venv; never dist_ens's), reusing compare.py's loop
pieces (dist_ens's batches in dist_ens's order, AdamW with decay on the weight tensors,
the members' mean-softmax scores):

  .venv/bin/python tools/torch_uncertainty/export_mnist1d.py /tmp/tu_cmp/mnist1d_methods.npz
  .venv/bin/python -m benchmarks.methods --methods deep,packed,deep16 --seeds 0,1,2 \\
      --out /tmp/tu_cmp/methods_packed.json
  tools/.venv-tu/bin/python tools/torch_uncertainty/packed.py \\
      --data /tmp/tu_cmp/mnist1d_methods.npz --dist_ens /tmp/tu_cmp/methods_packed.json \\
      --dist_ens_log /tmp/tu_cmp/methods_packed.log

The setting is benchmarks/methods.py's packed row: MNIST-1D (3,500 train / 1,000 test), the
MLP 40-256-256-10 packed with M=4, alpha=2, gamma=1 (each member 40-128-128-10), AdamW (lr
1e-3, decay 0.1 on weight tensors), batch 128 shared by the members, 1,000 steps, seeds 0-2.

The torch side is torch-uncertainty's own `models.mlp.packed_mlp(40, 10, [256, 256],
num_estimators=4, alpha=2, gamma=1)`: PackedLinear(40, 256, first=True) (one dense 40 ->
512 layer: groups 1), PackedLinear(256, 256) (512 -> 512 in 4 groups), PackedLinear(256, 10,
last=True) (512 -> 40 in 4 groups, rearranged '(m b) c'). Trained on their output layout
with `RepeatTarget` (no input repeat: the members are groups of one wide layer). At gamma=1
that is dist_ens's packed architecture exactly (at gamma > 1 their packed_mlp also groups
the output layer, dist_ens and their ResNets do not). Two variants: `packed` (their
init: kaiming_uniform(a=sqrt(5)) per group, U(+-1/sqrt(fan_in)) biases) and `packed_he`
(dist_ens's: He-normal at the group's fan-in, zero biases), to isolate the init.
"""

import argparse
import datetime
import json
import os
import platform
import re
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
import compare  # pylint: disable=g-import-not-at-top,wrong-import-position
from torch_uncertainty.layers import PackedLinear  # pylint: disable=g-import-not-at-top
from torch_uncertainty.models.mlp import packed_mlp  # pylint: disable=g-import-not-at-top
from torch_uncertainty.transforms import RepeatTarget  # pylint: disable=g-import-not-at-top

OUT = compare.ROOT / 'benchmarks' / 'results' / 'packed_torch_uncertainty.json'
ALPHA, GAMMA = 2.0, 1
VARIANTS = ('packed', 'packed_he')


def he_init(model: nn.Module) -> None:
  """dist_ens's init: He-normal weights at each group's fan-in, zero biases."""
  for module in model.modules():
    if isinstance(module, PackedLinear):
      fan_in = module.weight.shape[-1]  # [groups, out / groups, in / groups]
      nn.init.normal_(module.weight, 0.0, (2.0 / fan_in) ** 0.5)
      nn.init.zeros_(module.bias)


def build(variant: str, in_features: int, seed: int) -> nn.Module:
  torch.manual_seed(seed)
  model = packed_mlp(in_features, compare.NUM_CLASSES, list(compare.WIDTHS),
                     num_estimators=compare.MEMBERS, alpha=ALPHA, gamma=GAMMA)
  if variant == 'packed_he':
    he_init(model)
  return model


def train_one(variant: str, seed: int, data: dict[str, np.ndarray], steps: int) -> dict:
  x, y = data['x_train'], data['y_train']
  model = build(variant, x.shape[1], seed)
  opt = compare.optimizer(model)
  format_batch = RepeatTarget(num_repeats=compare.MEMBERS)
  xt, yt = torch.from_numpy(x), torch.from_numpy(y)
  losses = []
  start = time.perf_counter()
  for _, idx in zip(range(steps), compare.batches(len(y), seed)):
    inputs, targets = xt[idx], format_batch((xt[idx], yt[idx]))[1]
    loss = F.cross_entropy(model(inputs), targets)  # '(m b) c': the members' mean loss
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
    losses.append(float(loss.detach()))
  row = {'variant': variant, 'seed': seed, 'train_seconds': time.perf_counter() - start,
         'train_loss_last_250': float(np.mean(losses[-250:])),
         'train_loss_windows': [float(np.mean(losses[i:i + compare.LOG_EVERY]))
                                for i in range(0, len(losses), compare.LOG_EVERY)],
         'trained_parameters': sum(p.numel() for p in model.parameters() if p.requires_grad),
         'masks': []}
  row.update(compare.scores(compare.member_log_probs(model, data['x_test']), data['y_test']))
  train_lp = compare.member_log_probs(model, x)
  row['train_member_nll'] = float(-train_lp[np.arange(len(y)), :, y].mean())
  return row


def _run_log(text: str) -> tuple[float, float]:
  """One run's last 'loss mean' line (the members' loss over the last log_every = 250 steps)
  and its final table's member-mean test NLL."""
  losses = re.findall(r'step \d+/\d+  loss mean ([0-9.]+)', text)
  (member,) = re.findall(r'\| member mean \| [0-9.]+ \| ([0-9.]+) \|', text)[-1:]
  return float(losses[-1]), float(member)


def dist_ens_row(path: Path, log: Path | None = None) -> dict:
  """benchmarks/methods.py's packed row (mean +- sd over its seeds), its deep row beside; from
  its printed log (runs in the order seed by seed, method by method, as the JSON's rows),
  the packed runs' train loss over steps 751-1000 and their members' mean test NLL."""
  results = json.loads(path.read_text())
  keep = ('accuracy', 'accuracy_sd', 'nll', 'nll_sd', 'brier', 'brier_sd', 'ece', 'ece_sd',
          'calibrated_nll', 'calibrated_nll_sd', 'ood_auroc', 'ood_auroc_sd', 'dee',
          'train_seconds', 'trained_parameters', 'seeds', 'overrides')
  rows = {r['method']: {k: r[k] for k in keep if k in r} for r in results['rows']}
  out = dict(rows['packed'])
  out['deep'] = rows.get('deep')
  out.update(source=path.name, date=results.get('date'), commit=results.get('commit'))
  if log is not None:
    runs = log.read_text().split('mesh {')[1:]
    order = [r['method'] for r in results['rows']]
    mine = [run for i, run in enumerate(runs) if order[i % len(order)] == 'packed']
    found = [_run_log(run) for run in mine]
    for metric, values in (('train_loss_last_250', [f[0] for f in found]),
                           ('member_nll', [f[1] for f in found])):
      out[metric] = float(np.mean(values))
      out[f'{metric}_sd'] = float(np.std(values, ddof=1)) if len(values) > 1 else 0.0
      out[f'{metric}_per_seed'] = values
  return out


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument('--data', default='/tmp/tu_cmp/mnist1d_methods.npz')
  parser.add_argument('--dist_ens', default='', help="benchmarks/methods.py's JSON")
  parser.add_argument('--dist_ens_log', default='', help='its printed output')
  parser.add_argument('--seeds', default='0,1,2')
  parser.add_argument('--variants', default=','.join(VARIANTS))
  parser.add_argument('--steps', type=int, default=compare.STEPS)
  parser.add_argument('--out', default=str(OUT))
  args = parser.parse_args()
  torch.set_num_threads(1)
  torch.set_num_interop_threads(1)
  load_start = os.getloadavg()
  seeds = [int(s) for s in args.seeds.split(',')]
  rows = compare.train_variants(train_one, args.data, args.variants.split(','), seeds,
                                args.steps)
  dist_ens = (dist_ens_row(Path(args.dist_ens),
                           Path(args.dist_ens_log) if args.dist_ens_log else None)
              if args.dist_ens else None)
  markdown = compare.table(dist_ens, rows).replace('dist_ens masksembles', 'dist_ens packed')
  print(markdown)
  out = {'date': datetime.datetime.now(datetime.timezone.utc).isoformat(timespec='seconds'),
         'command': ' '.join(['tools/torch_uncertainty/packed.py'] + sys.argv[1:]),
         'machine': {'platform': platform.platform(), 'cpu_count': os.cpu_count(),
                     'torch_threads': torch.get_num_threads()},
         'load_average_start': load_start, 'load_average_end': os.getloadavg(),
         'versions': {'torch': torch.__version__,
                      'torch_uncertainty': compare.torch_uncertainty_version(),
                      'numpy': np.__version__},
         'setting': {'widths': compare.WIDTHS, 'members': compare.MEMBERS, 'alpha': ALPHA,
                     'gamma': GAMMA, 'steps': args.steps, 'batch_size': compare.BATCH,
                     'optimizer': 'AdamW lr 1e-3, weight decay 0.1 on weight tensors',
                     'seeds': seeds},
         'dist_ens': dist_ens, 'torch_uncertainty': rows,
         'agreement': ({k: compare.agreement(dist_ens, r) for k, r in rows.items()}
                       if dist_ens else None),
         'markdown': markdown}
  path = Path(args.out)
  path.parent.mkdir(parents=True, exist_ok=True)
  path.write_text(json.dumps(out, indent=1) + '\n')
  print(f'wrote {args.out}')


if __name__ == '__main__':
  main()
