"""Masksembles beside torch-uncertainty's: their layers, dist_ens's setting (issue 66, item 4).

Runs in its own venv (tools/.venv-tu, gitignored: `pip install 'torch-uncertainty[cpu]'`;
the plain package installs no torch, and its __init__ imports lightning; never in dist_ens's
venv); tools/torch_uncertainty/run.sh does every step:

  bash tools/torch_uncertainty/run.sh            # venv, data, dist_ens's row, this, JSON
  TEN_SEEDS=1 bash tools/torch_uncertainty/run.sh  # and seeds 0-9 of both ('ten_seeds')

or by hand:

  .venv/bin/python tools/torch_uncertainty/export_mnist1d.py /tmp/mnist1d_methods.npz
  .venv/bin/python -m benchmarks.methods --methods masksembles --seeds 0,1,2 \\
      --out /tmp/tu_cmp/methods_masksembles.json
  tools/.venv-tu/bin/python tools/torch_uncertainty/compare.py --data /tmp/mnist1d_methods.npz \\
      --dist_ens /tmp/tu_cmp/methods_masksembles.json

The setting is benchmarks/methods.py's masksembles row (configs/default.py): MNIST-1D's 3,500
training examples (4,000 less the 500 of the validation split), an MLP 40-256-256-10 with
ReLU, 4 members, scale 2.0, AdamW (lr 1e-3, b1 0.9, b2 0.999, eps 1e-8, decoupled weight
decay 0.1 on the weight matrices only), batch 128 for every member (the same 128 examples:
data.member_order='shared', in dist_ens's own order of batches for the seed), 1,000 steps,
seeds 0-2; scored on the 1,000 test examples by the members' mean softmax (accuracy, NLL,
Brier, ECE with dist_ens's 15 equal-width bins) and each member's own (the members' mean NLL).

The torch side is torch-uncertainty's own code, not a rewrite: `MaskedLinear`
(torch_uncertainty.layers: its `Mask1d` masks the layer's INPUT features, one mask per
estimator, on the batch split into num_estimators blocks), their mask generator
(`generation_wrapper`, called by Mask1d), their batch repeat (einops `repeat(x, 'b ... ->
(m b) ...')` as their `_MLP` and the legacy Masksembles ResNet do) and `RepeatTarget` for the
targets, and their evaluation rule (logits '(m b) c -> b m c', softmax, mean over m). Three
variants:

  hidden      Linear(40, 256), ReLU, MaskedLinear(256, 256), ReLU, MaskedLinear(256, 10):
              the masks where dist_ens puts them (every hidden layer's outputs; input and
              logits unmasked, as in their Masksembles ResNet, whose stem is a plain conv),
              torch's default init (nn.Linear: U(+-1/sqrt(fan_in)) for weights and biases)
  hidden_he   the same with dist_ens's init (He-normal weights, zero biases): isolates the init
  their_mlp   their own MLP class with layer=MaskedLinear (torch_uncertainty.models.mlp._mlp;
              it has no public masksembles_mlp): every layer a MaskedLinear, so the 40 INPUT
              features are masked too (21 of 40 per member), torch's init

One thing is changed about their generator: `_generate_masks` draws from
`np.random.default_rng()` with no seed (new OS entropy at every call), so their masks differ
from run to run; the tool hands it one numpy Generator seeded from (seed, layer), so a rerun
draws the same masks. The procedure is theirs, unchanged. torch runs on one thread
(torch.set_num_threads(1)): the machine is shared.

`--masks_fixture PATH` instead records what their generator draws for the widths compared
(and the CNN's 25 channels) into a small JSON that tests/test_masksembles_tu_masks.py checks
dist_ens's generator against without torch: ones per mask, units covered, and the mean
pairwise overlap over many draws.

Packed-Ensembles are tools/torch_uncertainty/packed.py (PACKED=1 bash run.sh): their
models.mlp.packed_mlp(40, 10, [256, 256], num_estimators=4, alpha=2, gamma=1), trained by
this file's loop pieces beside benchmarks/methods.py's packed row.
"""

import argparse
import contextlib
import datetime
import json
import os
import platform
import re
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from einops import rearrange, repeat
from torch import nn

import torch_uncertainty
from torch_uncertainty.layers import MaskedLinear
from torch_uncertainty.layers import masksembles as tu_masksembles
from torch_uncertainty.models.mlp import _mlp
from torch_uncertainty.transforms import RepeatTarget

ROOT = Path(__file__).resolve().parents[2]
OUT = ROOT / 'benchmarks' / 'results' / 'masksembles_torch_uncertainty.json'

# benchmarks/methods.py's masksembles row on configs/default.py.
WIDTHS = (256, 256)
MEMBERS = 4
SCALE = 2.0
STEPS = 1000
BATCH = 128
LEARNING_RATE, B1, B2, EPS, WEIGHT_DECAY = 1e-3, 0.9, 0.999, 1e-8, 0.1
NUM_CLASSES = 10
LOG_EVERY = 250  # configs/default.py's train.log_every
ECE_BINS = 15  # dist_ens.eval.ranks.NUM_ECE_BINS: equal-width bins over [0, 1]
VARIANTS = ('hidden', 'hidden_he', 'their_mlp')
# The layers whose masks the fixture records: (width, members, scale).
FIXTURE_CASES = ((256, 4, 2.0), (40, 4, 2.0), (25, 4, 2.0), (256, 4, 4.0))


@contextlib.contextmanager
def seeded_mask_draws(seed: int, layer: int):
  """Their _generate_masks' `np.random.default_rng()` (unseeded) answered by one Generator
  seeded from (seed, layer): the same draws in the same order at every rerun."""
  rng = np.random.default_rng((seed, 0x7475, layer))
  original = tu_masksembles.np.random.default_rng

  class _Seeded:  # the module's `np`, whose random.default_rng() is that one stream
    def __getattr__(self, name):
      return getattr(np, name)

  class _Random:
    def __getattr__(self, name):
      return getattr(np.random, name)

    @staticmethod
    def default_rng(*args):
      return rng if not args else original(*args)

  seeded = _Seeded()
  seeded.random = _Random()
  tu_masksembles.np = seeded
  try:
    yield
  finally:
    tu_masksembles.np = np


class HiddenMasked(nn.Module):
  """Linear, ReLU, then a MaskedLinear per later layer: torch-uncertainty's layers with
  their masks on the hidden layers' outputs, where dist_ens puts them."""

  def __init__(self, in_features: int, seed: int):
    super().__init__()
    sizes = (in_features,) + WIDTHS + (NUM_CLASSES,)
    self.first = nn.Linear(sizes[0], sizes[1])
    masked = []
    for layer, (n_in, n_out) in enumerate(zip(sizes[1:-1], sizes[2:])):
      with seeded_mask_draws(seed, layer):
        masked.append(MaskedLinear(n_in, n_out, num_estimators=MEMBERS, scale=SCALE))
    self.masked = nn.ModuleList(masked)

  def forward(self, x: torch.Tensor) -> torch.Tensor:
    x = repeat(x, 'b ... -> (m b) ...', m=MEMBERS)  # as their _MLP.forward does
    h = F.relu(self.first(x))
    for i, layer in enumerate(self.masked):
      h = layer(h)
      if i < len(self.masked) - 1:
        h = F.relu(h)
    return h


def their_mlp(in_features: int, seed: int) -> nn.Module:
  """torch-uncertainty's _MLP with layer=MaskedLinear (every layer masks its input)."""
  layer = [0]
  original = MaskedLinear.__init__

  def init(self, *args, **kwargs):  # each MaskedLinear's masks from (seed, its index)
    with seeded_mask_draws(seed, 100 + layer[0]):
      original(self, *args, **kwargs)
    layer[0] += 1

  MaskedLinear.__init__ = init
  try:
    return _mlp(stochastic=False, in_features=in_features, num_outputs=NUM_CLASSES,
                hidden_dims=list(WIDTHS), layer=MaskedLinear,
                layer_args={'num_estimators': MEMBERS, 'scale': SCALE})
  finally:
    MaskedLinear.__init__ = original


def he_init(model: nn.Module) -> None:
  """dist_ens's dense_init: He-normal weights (std sqrt(2 / fan_in)), zero biases."""
  for module in model.modules():
    if isinstance(module, nn.Linear):
      nn.init.normal_(module.weight, 0.0, (2.0 / module.in_features) ** 0.5)
      nn.init.zeros_(module.bias)


def build(variant: str, in_features: int, seed: int) -> nn.Module:
  torch.manual_seed(seed)
  if variant == 'their_mlp':
    return their_mlp(in_features, seed)
  model = HiddenMasked(in_features, seed)
  if variant == 'hidden_he':
    he_init(model)
  return model


def optimizer(model: nn.Module) -> torch.optim.Optimizer:
  """AdamW, weight decay on the weight matrices only (dist_ens's decay_mask='kernels');
  the masks (their frozen nn.Parameters, requires_grad=False) take no step."""
  trained = [p for p in model.parameters() if p.requires_grad]
  return torch.optim.AdamW(
      [{'params': [p for p in trained if p.ndim >= 2], 'weight_decay': WEIGHT_DECAY},
       {'params': [p for p in trained if p.ndim < 2], 'weight_decay': 0.0}],
      lr=LEARNING_RATE, betas=(B1, B2), eps=EPS)


def batches(n: int, seed: int):
  """Indices of BATCH examples a step, dist_ens's own order (data.Order, member_order
  'shared'): epoch e is np.random.default_rng([seed, e]).permutation(n), the remainder
  dropped, so both sides train on the same batches in the same order."""
  epoch = 0
  while True:
    order = np.random.default_rng([seed, epoch]).permutation(n)
    for start in range(0, n - BATCH + 1, BATCH):
      yield order[start:start + BATCH]
    epoch += 1


def member_log_probs(model: nn.Module, x: np.ndarray) -> np.ndarray:
  """[N, M, C] log-probabilities of each member (their evaluation: '(m b) c -> b m c')."""
  model.eval()
  with torch.no_grad():
    logits = model(torch.from_numpy(x))
  model.train()
  logits = rearrange(logits, '(m b) c -> b m c', m=MEMBERS)
  return F.log_softmax(logits.double(), -1).numpy()


def scores(log_probs: np.ndarray, y: np.ndarray) -> dict[str, float]:
  """Accuracy, NLL, Brier, ECE of the members' mean softmax, and the members' mean NLL."""
  probs = np.exp(log_probs).mean(1)
  rows = np.arange(len(y))
  confidence, predicted = probs.max(-1), probs.argmax(-1)
  correct = (predicted == y).astype(np.float64)
  bins = np.clip((confidence * ECE_BINS).astype(int), 0, ECE_BINS - 1)
  ece = sum(abs(correct[bins == b].sum() - confidence[bins == b].sum())
            for b in range(ECE_BINS)) / len(y)
  onehot = np.eye(probs.shape[-1])[y]
  return {'accuracy': float(correct.mean()),
          'nll': float(-np.log(np.maximum(probs[rows, y], 1e-30)).mean()),
          'brier': float(((probs - onehot) ** 2).sum(-1).mean()),
          'ece': float(ece),
          'member_nll': float(-log_probs[rows, :, y].mean())}


def mask_summary(model: nn.Module) -> list[dict]:
  """Each MaskedLinear's masks: width, ones per mask, units used, mean pairwise overlap."""
  out = []
  for name, module in model.named_modules():
    if isinstance(module, MaskedLinear):
      masks = module.mask.masks.detach().numpy() > 0
      out.append({'layer': name, 'width': masks.shape[1], 'ones_per_mask': sorted({int(r.sum()) for r in masks}),
                  'used': int(masks.any(0).sum()), 'mean_overlap': mean_overlap(masks)})
  return out


def mean_overlap(masks: np.ndarray) -> float:
  """Mean over pairs of masks of the units both use."""
  count = len(masks)
  pairs = [(masks[i] & masks[j]).sum() for i in range(count) for j in range(i + 1, count)]
  return float(np.mean(pairs)) if pairs else 0.0


def train_one(variant: str, seed: int, data: dict[str, np.ndarray], steps: int = STEPS) -> dict:
  x, y = data['x_train'], data['y_train']
  model = build(variant, x.shape[1], seed)
  opt = optimizer(model)
  format_batch = RepeatTarget(num_repeats=MEMBERS)
  xt, yt = torch.from_numpy(x), torch.from_numpy(y)
  losses = []
  start = time.perf_counter()
  for _, idx in zip(range(steps), batches(len(y), seed)):
    inputs, targets = format_batch((xt[idx], yt[idx]))
    loss = F.cross_entropy(model(inputs), targets)  # mean over (m b): the members' mean
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
    losses.append(float(loss.detach()))
  seconds = time.perf_counter() - start
  row = {'variant': variant, 'seed': seed, 'train_seconds': seconds,
         'train_loss_last_250': float(np.mean(losses[-250:])),
         # dist_ens's log lines: the members' loss, mean over each 250 steps.
         'train_loss_windows': [float(np.mean(losses[i:i + LOG_EVERY]))
                                for i in range(0, len(losses), LOG_EVERY)],
         'trained_parameters': sum(p.numel() for p in model.parameters() if p.requires_grad),
         'masks': mask_summary(model)}
  row.update(scores(member_log_probs(model, data['x_test']), data['y_test']))
  train_lp = member_log_probs(model, x)
  row['train_member_nll'] = float(-train_lp[np.arange(len(y)), :, y].mean())
  return row


METRICS = ('accuracy', 'nll', 'member_nll', 'brier', 'ece', 'train_loss_last_250',
           'train_member_nll', 'train_seconds')


def train_variants(train: Callable[..., dict], data_path: str, variants: list[str],
                   seeds: list[int], steps: int) -> dict[str, dict]:
  """{variant: its rows over seeds}: `train(variant, seed, data, steps)` for each, each
  run's figures printed as it ends (compare.py's and packed.py's loop)."""
  with np.load(data_path) as f:
    data = {k: f[k] for k in f.files}
  rows = {}
  for variant in variants:
    per_seed = []
    for seed in seeds:
      per_seed.append(train(variant, seed, data, steps))
      r = per_seed[-1]
      print(f"{variant} seed {seed}: accuracy {r['accuracy']:.3f} nll {r['nll']:.3f} "
            f"member nll {r['member_nll']:.3f} train loss {r['train_loss_last_250']:.3f} "
            f"({r['train_seconds']:.0f} s)", flush=True)
    rows[variant] = over_seeds(per_seed)
  return rows


def over_seeds(rows: list[dict]) -> dict:
  out = {'variant': rows[0]['variant'], 'seeds': [r['seed'] for r in rows],
         'trained_parameters': rows[0]['trained_parameters']}
  for metric in METRICS:
    values = [r[metric] for r in rows]
    out[metric] = float(np.mean(values))
    out[f'{metric}_sd'] = float(np.std(values, ddof=1)) if len(values) > 1 else 0.0
  out['per_seed'] = rows
  return out


def dist_ens_row(path: Path) -> dict:
  """benchmarks/methods.py's masksembles row (mean +- sd over its seeds) from its JSON."""
  results = json.loads(path.read_text())
  (row,) = [r for r in results['rows'] if r['method'] == 'masksembles']
  keep = ('accuracy', 'accuracy_sd', 'nll', 'nll_sd', 'brier', 'brier_sd', 'ece', 'ece_sd',
          'calibrated_nll', 'calibrated_nll_sd', 'train_seconds', 'train_seconds_sd',
          'trained_parameters', 'seeds', 'overrides', 'member_steps')
  out = {k: row[k] for k in keep if k in row}
  out['per_seed'] = [{k: r[k] for k in ('seed', 'accuracy', 'nll', 'brier', 'ece')}
                     for r in row.get('per_seed', [row])]
  out.update(source=path.name, date=results.get('date'), commit=results.get('commit'),
             steps=results.get('steps'), validation_size=results.get('validation_size'),
             jax=results.get('jax'))
  return out


def dist_ens_log(log: Path) -> dict[str, list]:
  """From a benchmarks/methods.py log, per run (seed, in the log's order): its lines'
  'loss mean' (each the members' loss, mean over the log_every steps before it) and the
  final table's member-mean test NLL."""
  text = log.read_text()
  runs, current = [], []
  for match in re.finditer(r'step (\d+)/(\d+)  loss mean ([0-9.]+)', text):
    current.append(float(match.group(3)))
    if match.group(1) == match.group(2):
      runs.append(current)
      current = []
  members = [float(m.group(1)) for m in
             re.finditer(r'\| member mean \| [0-9.]+ \| ([0-9.]+) \|', text)]
  return {'train_loss_windows': runs, 'member_nll_per_seed': members}


def agreement(dist_ens: dict, torch_row: dict) -> dict:
  """Per metric: the difference of the means and the larger of the two seed spreads."""
  out = {}
  for metric in ('accuracy', 'nll', 'brier', 'ece', 'member_nll', 'train_loss_last_250'):
    if metric in dist_ens:
      diff = torch_row[metric] - dist_ens[metric]
      spread = max(torch_row[f'{metric}_sd'], dist_ens.get(f'{metric}_sd', 0.0))
      out[metric] = {'difference': diff, 'larger_sd': spread,
                     'within_spread': abs(diff) <= spread}
  return out


def table(dist_ens: dict | None, rows: dict[str, dict]) -> str:
  cell = lambda r, m: f"{r[m]:.3f} +- {r.get(m + '_sd', 0.0):.3f}" if m in r else '-'
  lines = ['| implementation | accuracy | NLL | Brier | ECE | members\' mean NLL '
           '| train loss, steps 751-1000 | parameters trained |', '|---' * 8 + '|']
  if dist_ens:
    lines.append(f"| dist_ens masksembles | {cell(dist_ens, 'accuracy')} | {cell(dist_ens, 'nll')} "
                 f"| {cell(dist_ens, 'brier')} | {cell(dist_ens, 'ece')} | "
                 f"{cell(dist_ens, 'member_nll')} | {cell(dist_ens, 'train_loss_last_250')} | "
                 f"{dist_ens.get('trained_parameters', '-'):,} |")
  for name, r in rows.items():
    lines.append(f"| torch-uncertainty {name} | {cell(r, 'accuracy')} | {cell(r, 'nll')} | "
                 f"{cell(r, 'brier')} | {cell(r, 'ece')} | {cell(r, 'member_nll')} | "
                 f"{cell(r, 'train_loss_last_250')} | {r['trained_parameters']:,} |")
  return '\n'.join(lines)


def fixture(path: Path, draws: int) -> None:
  """Their generator's masks for FIXTURE_CASES, `draws` seeded draws each."""
  cases = []
  for width, count, scale in FIXTURE_CASES:
    ones, used, overlaps, distinct = set(), set(), [], 0
    for draw in range(draws):
      with seeded_mask_draws(draw, 1000 + width):
        masks = tu_masksembles.generation_wrapper(width, count, scale) > 0
      ones |= {int(r.sum()) for r in masks}
      used.add(int(masks.shape[1]))
      overlaps.append(mean_overlap(masks))
      distinct += len({r.tobytes() for r in masks}) == count
    cases.append({'width': width, 'count': count, 'scale': scale, 'draws': draws,
                  'ones_per_mask': sorted(ones), 'units': sorted(used),
                  'mean_overlap': float(np.mean(overlaps)),
                  'overlap_sd': float(np.std(overlaps, ddof=1)),
                  'all_distinct_fraction': distinct / draws})
  out = {'what': "torch-uncertainty's Masksembles mask generator "
                 '(torch_uncertainty.layers.masksembles.generation_wrapper), seeded draws: '
                 'ones per mask, units covered, mean over draws of the mean pairwise overlap. '
                 'Written by tools/torch_uncertainty/compare.py --masks_fixture; read by '
                 'tests/test_masksembles_tu_masks.py.',
         'torch_uncertainty': torch_uncertainty_version(), 'cases': cases}
  path.parent.mkdir(parents=True, exist_ok=True)
  path.write_text(json.dumps(out, indent=1) + '\n')
  print(json.dumps(cases, indent=1))


def torch_uncertainty_version() -> str:
  from importlib import metadata  # pylint: disable=g-import-not-at-top
  return metadata.version('torch-uncertainty')


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument('--data', default='/tmp/mnist1d_methods.npz',
                      help="export_mnist1d.py's arrays")
  parser.add_argument('--dist_ens', default='',
                      help="benchmarks/methods.py's JSON with the masksembles row, to put beside")
  parser.add_argument('--dist_ens_log', default='',
                      help="benchmarks/methods.py's printed output, for its train-loss lines")
  parser.add_argument('--seeds', default='0,1,2')
  parser.add_argument('--variants', default=','.join(VARIANTS))
  parser.add_argument('--steps', type=int, default=STEPS)
  parser.add_argument('--out', default=str(OUT))
  parser.add_argument('--section', default='',
                      help='write this run under that key of the existing --out JSON')
  parser.add_argument('--masks_fixture', default='',
                      help='write the generator fixture here instead of training')
  parser.add_argument('--fixture_draws', type=int, default=200)
  args = parser.parse_args()
  torch.set_num_threads(1)
  torch.set_num_interop_threads(1)
  if args.masks_fixture:
    fixture(Path(args.masks_fixture), args.fixture_draws)
    return
  load_start = os.getloadavg()
  seeds = [int(s) for s in args.seeds.split(',')]
  rows = train_variants(train_one, args.data, args.variants.split(','), seeds, args.steps)
  dist_ens = dist_ens_row(Path(args.dist_ens)) if args.dist_ens else None
  if dist_ens and args.dist_ens_log:
    dist_ens.update(dist_ens_log(Path(args.dist_ens_log)))
    last = [run[-1] for run in dist_ens['train_loss_windows']]
    for metric, values in (('member_nll', dist_ens['member_nll_per_seed']),
                           ('train_loss_last_250', last)):
      if len(values) > 1:
        dist_ens[metric] = float(np.mean(values))
        dist_ens[f'{metric}_sd'] = float(np.std(values, ddof=1))
  markdown = table(dist_ens, rows)
  print(markdown)
  out = {'date': datetime.datetime.now(datetime.timezone.utc).isoformat(timespec='seconds'),
         'command': ' '.join(['tools/torch_uncertainty/compare.py'] + sys.argv[1:]),
         'machine': {'platform': platform.platform(), 'cpu_count': os.cpu_count(),
                     'torch_threads': torch.get_num_threads()},
         'load_average_start': load_start, 'load_average_end': os.getloadavg(),
         'versions': {'torch': torch.__version__, 'torch_uncertainty': torch_uncertainty_version(),
                      'numpy': np.__version__},
         'setting': {'data': 'MNIST-1D, 3,500 train (4,000 less the 500-example validation '
                             'split) / 1,000 test', 'widths': WIDTHS, 'members': MEMBERS,
                     'scale': SCALE, 'steps': args.steps, 'batch_size': BATCH,
                     'optimizer': {'name': 'AdamW', 'learning_rate': LEARNING_RATE, 'b1': B1,
                                   'b2': B2, 'eps': EPS, 'weight_decay': WEIGHT_DECAY,
                                   'decay': 'weight matrices only'},
                     'batch': 'the same 128 examples for every member (repeated M times)',
                     'seeds': seeds},
         'dist_ens': dist_ens, 'torch_uncertainty': rows,
         'agreement': {k: agreement(dist_ens, r) for k, r in rows.items()} if dist_ens else None,
         'markdown': markdown}
  path = Path(args.out)
  if args.section:  # Into the existing JSON under that key, the rest of it kept.
    whole = json.loads(path.read_text())
    whole[args.section] = out
    out = whole
  path.parent.mkdir(parents=True, exist_ok=True)
  path.write_text(json.dumps(out, indent=1) + '\n')
  print(f'wrote {args.out}' + (f' ({args.section})' if args.section else ''))


if __name__ == '__main__':
  main()
