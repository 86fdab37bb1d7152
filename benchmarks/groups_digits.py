"""Member groups on digits, the recipe's figures (issue 48): a diverse ensemble against the
deep ensemble of the best single architecture, and an architecture sweep as one run
against separate runs.

  python -m benchmarks.groups_digits                     # both parts, ~1 h on 2 CPU cores
  python -m benchmarks.groups_digits --part diverse --seeds 0,1,2
  python -m benchmarks.groups_digits --part sweep --rounds 2
  python -m benchmarks.groups_digits --table             # the tables of the saved results

diverse: configs/digits_groups.py (4 seeds each of ResNet-20, a 2-D CNN, a ViT and an MLP,
  each group with its own recipe's optimizer, 400 steps each) is trained as ONE grouped
  `dist-ens` run per seed with eval.shift='all' (12 corruptions x 5 severities) and
  select.method='greedy' (K=4 picks with replacement over all 16 members, by validation
  NLL). From the finished workdir (Ensemble.load), every member predicts the validation
  split, the test split and the 60 corrupted test splits (corrupted as the run's eval.shift
  corrupts them: the same keys, checked against final_metrics.json), and each ensemble's
  metrics are computed from those member probabilities with dist_ens.eval.metrics:
    greedy     the library's selection (final_metrics.json 'greedy'; a member picked
               twice counts twice in the mean);
    best arch  the 4 members of the architecture whose own 4-member ensemble has the
               lowest validation NLL (the criterion greedy selection minimises, on the
               same 300 examples; the test split chooses nothing);
    every architecture's own 4-member deep ensemble, and the pool of 16.
  Equal compute means: both ensembles are at most K=4 members predicting, each member
  trained the same 400 steps on the same batches. It is not equal parameters or FLOPs
  (ResNet-20 costs 60x an MLP per example): each row gives its members' parameters and
  XLA's forward FLOPs per example; and the diverse ensemble needs the pool, 4x the
  training of the best architecture's 4 members (as neural ensemble search does).
  Disagreement is dist_ens.eval.metrics' (the mean over the ensemble's members, weighted
  by their picks, of [argmax p_m != argmax p_ensemble]) on the clean test split.
sweep: MLP widths {64, 128, 256} x depths {1, 2, 3} x 4 seeds on digits (36 members in 9
  groups, 550 steps = 50 epochs) as one `dist-ens` run against 9 runs of 4 members each,
  every run its own process (Python start, import, data, compile, training, evaluation,
  checkpoint), timed side by side in rounds that alternate which goes first; and the test
  metrics of each configuration from both. Member i's init depends on (seed, i): group g
  holds members 4g..4g+3, a separate run members 0-3, so only the first configuration's
  members are the same in both (to rounding); the others are other seeds of the same
  configuration, and agree within the spread of their members.
One CPU device (what `dist-ens` uses on this machine unless XLA_FLAGS says more).
Writes benchmarks/results/groups_digits.json (or --out) and prints Markdown tables.
"""

import argparse
import itertools
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import dist_ens
from benchmarks import harness
from dist_ens import models
from dist_ens.run.run_data import build_data
from dist_ens.config import specs
from dist_ens.data import corruptions
from dist_ens.eval import metrics, registry as metric_registry, shift as shift_lib, shift_spec
from dist_ens.parallel import strategy

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / 'benchmarks' / 'results' / 'groups_digits.json'
RECIPE = ROOT / 'configs' / 'digits_groups.py'
SWEEP_WIDTHS, SWEEP_DEPTHS, SWEEP_SEEDS, SWEEP_STEPS = (64, 128, 256), (1, 2, 3), 4, 550
COLUMNS = ('accuracy', 'nll', 'ece', 'cA', 'cNLL', 'disagreement')
SELECTIONS = ('greedy', 'forward select')  # the ensembles picked from the pool


def _cli(workdir: Path, config: Path, flags: list[str]) -> float:
  """Seconds of one `dist-ens` run in its own process, start to exit."""
  env = {k: v for k, v in os.environ.items() if k != 'XLA_FLAGS'}  # one CPU device
  start = time.perf_counter()
  done = subprocess.run([sys.executable, '-m', 'dist_ens.main', f'--config={config}',
                         f'--workdir={workdir}', *flags], env=env, cwd=ROOT,
                        capture_output=True, text=True, check=False)
  if done.returncode:
    raise RuntimeError(f'dist-ens failed ({workdir}):\n{done.stderr[-3000:]}')
  return time.perf_counter() - start


# Part 1: the diverse ensemble against the best architecture's.

def _log_probs(probs: np.ndarray) -> np.ndarray:
  return np.log(np.maximum(probs, np.finfo(np.float32).tiny))


def _scores(member_probs: np.ndarray, labels: np.ndarray, counts: np.ndarray) -> dict:
  """The ensemble of members weighted by `counts` (a member picked twice counts twice):
  dist_ens.eval.metrics' ensemble metrics of their probabilities."""
  picks = np.repeat(np.arange(len(counts)), counts)
  out = metrics.eval_batch(_log_probs(member_probs[picks]), labels, np.ones(len(labels), bool))
  return metric_registry.finalize(jax.device_get(out.sums))['ensemble']


def _member_predictions(workdir: Path) -> dict:
  """Every member's probabilities on validation, test and each corrupted test split."""
  ensemble = dist_ens.Ensemble.load(workdir)
  config = ensemble.config
  data = build_data(config)
  test = data.dataset.test
  predict = lambda x: ensemble.predict(np.asarray(x), preprocessed=True).member_probs
  pairs = shift_spec.resolve_shift(config.eval.shift, test.x.shape[1:])
  families = sorted({corruptions.corruption_id(name) for name, _ in pairs})
  frame = shift_lib.InputFrame.fit(test.x, config.data.std or 1.0, config.data.mean or 0.0,
                                   families)
  index = jnp.arange(len(test.y), dtype=jnp.int32)
  corrupt = jax.jit(lambda x, c, s: frame.corrupt(x, index, c, s, config.seed))
  shifted = {(name, severity): predict(corrupt(jnp.asarray(test.x),
                                               jnp.int32(corruptions.corruption_id(name)),
                                               jnp.int32(severity)))
             for name, severity in pairs}
  return {'ensemble': ensemble, 'validation': (predict(data.validation.x), data.validation.y),
          'test': (predict(test.x), test.y), 'shifted': shifted, 'input_shape': test.x.shape[1:]}


def _costs(ensemble, input_shape) -> tuple[list[int], list[float]]:
  """Each member's parameters and forward FLOPs per example (XLA's cost analysis)."""
  params, flops, by_config = [], [], {}
  for i in range(ensemble.num_members):
    count = int(sum(np.prod(leaf.shape) for leaf in jax.tree.leaves(ensemble.member(i))))
    spec = specs.model_spec(ensemble.member_config(i))
    if spec not in by_config:
      model = models.get_model(spec, ensemble.num_classes)
      by_config[spec] = strategy.forward_flops(model, input_shape, 64) / 64
    params.append(count)
    flops.append(by_config[spec])
  return params, flops


def forward_select(member_probs: np.ndarray, labels: np.ndarray, size: int) -> np.ndarray:
  """[M] counts of `size` distinct members chosen one at a time, WITHOUT replacement, each
  the one that most lowers the validation NLL of the averaged probabilities (ties to the
  lowest id): neural ensemble search's ForwardSelect, where dist_ens's select.method=
  'greedy' picks with replacement and keeps the best prefix."""
  true = member_probs[:, np.arange(len(labels)), labels].astype(np.float64)  # [M, N]
  chosen, total = [], np.zeros(true.shape[1])
  for n in range(1, size + 1):
    nll = -np.mean(np.log(np.maximum((total[None] + true) / n, 1e-300)), axis=1)
    nll[chosen] = np.inf
    chosen.append(int(np.argmin(nll)))
    total += true[chosen[-1]]
  return np.bincount(chosen, minlength=len(true))


def _ensemble_row(counts, predictions, params, flops) -> dict:
  probs, labels = predictions['test']
  clean = _scores(probs, labels, counts)
  shifted = [_scores(p, labels, counts) for p in predictions['shifted'].values()]
  members = np.flatnonzero(counts)
  return {'members': members.tolist(), 'picks': counts[members].tolist(),
          'distinct_members': len(members),
          'parameters': int(sum(params[i] for i in members)),
          'mflops_per_example': float(sum(flops[i] for i in members)) / 1e6,
          'validation_nll': _scores(*predictions['validation'], counts)['nll'],
          'accuracy': clean['accuracy'], 'nll': clean['nll'], 'ece': clean['ece'],
          'brier': clean['brier'], 'disagreement': clean['disagreement'],
          'cA': float(np.mean([s['accuracy'] for s in shifted])),
          'cNLL': float(np.mean([s['nll'] for s in shifted])),
          'cCE': float(np.mean([s['ece'] for s in shifted]))}


def _check_against_run(rows: dict, final: dict) -> dict:
  """The recomputed figures beside the run's own (the same members, corruptions and
  metrics: they must agree to float32 rounding, else this benchmark scores other data)."""
  diffs = {'pool accuracy': rows['pool']['accuracy'] - final['ensemble']['accuracy'],
           'pool nll': rows['pool']['nll'] - final['ensemble']['nll'],
           'pool cA': rows['pool']['cA'] - final['shift']['cA'],
           'pool cNLL': rows['pool']['cNLL'] - final['shift']['cNLL'],
           'greedy nll': rows['greedy']['nll'] - final['greedy']['ensemble']['nll']}
  for name, group in final['groups'].items():
    diffs[f'{name} nll'] = rows[name]['nll'] - group['ensemble']['nll']
  worst = max(abs(v) for v in diffs.values())
  if worst > 1e-3:
    raise RuntimeError(f'recomputed metrics differ from final_metrics.json: {diffs}')
  return {'max_abs_difference': worst, 'differences': diffs}


def diverse_seed(seed: int, workdir: Path, steps: int | None = None) -> dict:
  """One grouped run of configs/digits_groups.py and its ensembles' figures (steps: a
  quick look with fewer steps than the recipe's)."""
  flags = [f'--config.seed={seed}', '--config.eval.shift=all']
  if steps:
    flags += ['--config.train.epochs=0', f'--config.train.steps={steps}',
              f'--config.train.log_every={steps}', f'--config.checkpoint.every={steps}']
  load = harness.load_average()
  wall = _cli(workdir, RECIPE, flags)
  return {'seed': seed, 'wall_seconds': wall, 'load_average_before': load, **score(workdir)}


def score(workdir: Path) -> dict:
  """The figures of a finished run of configs/digits_groups.py with eval.shift='all'."""
  final = json.loads((workdir / 'final_metrics.json').read_text())
  predictions = _member_predictions(workdir)
  ensemble = predictions['ensemble']
  params, flops = _costs(ensemble, predictions['input_shape'])
  m = ensemble.num_members
  counts = {'greedy': np.asarray(final['greedy']['counts']),
            'forward select': forward_select(*predictions['validation'],
                                             ensemble.config.select.greedy_size),
            'pool': np.ones(m, int)}
  for name, group in final['groups'].items():
    counts[name] = np.bincount(group['members'], minlength=m)
  rows = {name: _ensemble_row(c, predictions, params, flops) for name, c in counts.items()}
  groups = list(final['groups'])
  best = min(groups, key=lambda g: rows[g]['validation_nll'])
  return {'train_seconds': final['train_seconds'], 'best_architecture': best,
          'greedy_picks': final['greedy']['picks'],
          'member_groups': {g: final['groups'][g]['members'] for g in groups},
          'rows': rows, 'check': _check_against_run(rows, final)}


def _spread(values) -> dict:
  values = [float(v) for v in values]
  return {'mean': float(np.mean(values)), 'min': min(values), 'max': max(values),
          'values': values}


def diverse_summary(seeds: list[dict]) -> dict:
  """Means over seeds with their ranges; per seed the paired difference of each selected
  ensemble and the best architecture's, and in how many seeds it is better or worse."""
  names = [*SELECTIONS, 'best arch', *seeds[0]['member_groups'], 'pool']
  row = lambda s, name: s['rows'][s['best_architecture'] if name == 'best arch' else name]
  table = {name: {c: _spread(row(s, name)[c] for s in seeds)
                  for c in (*COLUMNS, 'parameters', 'mflops_per_example', 'distinct_members')}
           for name in names}
  lower_is_better = {'nll', 'ece', 'cNLL'}
  paired = {}
  for selection in SELECTIONS:
    paired[selection] = {}
    for c in COLUMNS:
      diffs = [row(s, selection)[c] - row(s, 'best arch')[c] for s in seeds]
      # Disagreement is diversity, neither better nor worse: 'better' counts it higher.
      better = [(d < 0) if c in lower_is_better else (d > 0) for d in diffs]
      paired[selection][c] = {**_spread(diffs), 'better_in': sum(better),
                              'worse_in': sum(d != 0 and not b for d, b in zip(diffs, better))}
  return {'table': table, 'paired': paired}


# Part 2: an architecture sweep as one run against separate runs.

def _sweep_names():
  return [(f'w{w}d{d}', (w,) * d) for d, w in itertools.product(SWEEP_DEPTHS, SWEEP_WIDTHS)]


def _sweep_flags(steps: int) -> list[str]:
  return ['--config.data.name=digits', f'--config.train.steps={steps}',
          '--config.train.eval_every=0', f'--config.train.log_every={steps // 5}',
          f'--config.checkpoint.every={steps}']


def sweep(rounds: int, steps: int) -> dict:
  default = ROOT / 'configs' / 'default.py'
  names = _sweep_names()
  groups = repr(tuple({'count': SWEEP_SEEDS, 'model': {'widths': widths}, 'name': name}
                      for name, widths in names))
  grouped_flags = [*_sweep_flags(steps), f'--config.num_members={SWEEP_SEEDS * len(names)}',
                   f'--config.ensemble.groups={groups}']
  times = {'grouped': [], 'separate': []}
  loads, finals = [], {}
  with tempfile.TemporaryDirectory(prefix='groups_digits_sweep_') as tmp:
    for r in range(rounds):
      order = ('grouped', 'separate') if r % 2 == 0 else ('separate', 'grouped')
      for which in order:
        loads.append({'round': r, 'run': which, 'load_average': harness.load_average()})
        if which == 'grouped':
          workdir = Path(tmp) / f'grouped{r}'
          times['grouped'].append(_cli(workdir, default, grouped_flags))
          finals[('grouped', r)] = json.loads((workdir / 'final_metrics.json').read_text())
        else:
          one = {}
          for name, widths in names:
            workdir = Path(tmp) / f'{name}_{r}'
            one[name] = _cli(workdir, default, [
                *_sweep_flags(steps), f'--config.num_members={SWEEP_SEEDS}',
                f'--config.model.widths={widths}'])
            finals[(name, r)] = json.loads((workdir / 'final_metrics.json').read_text())
          times['separate'].append(one)
  grouped = finals[('grouped', 0)]
  configs = {}
  for g, (name, widths) in enumerate(names):
    ids = slice(g * SWEEP_SEEDS, (g + 1) * SWEEP_SEEDS)
    alone = finals[(name, 0)]
    member_nll = {'grouped': grouped['members']['nll'][ids], 'separate': alone['members']['nll']}
    configs[name] = {
        'widths': widths, 'grouped_member_ids': list(range(ids.start, ids.stop)),
        'grouped': {k: grouped['groups'][name]['ensemble'][k] for k in ('accuracy', 'nll', 'ece')},
        'separate': {k: alone['ensemble'][k] for k in ('accuracy', 'nll', 'ece')},
        'member_nll': {k: _spread(v) for k, v in member_nll.items()}}
  separate_totals = [sum(one.values()) for one in times['separate']]
  return {'steps': steps, 'members_per_configuration': SWEEP_SEEDS, 'rounds': rounds,
          'grouped_seconds': times['grouped'], 'separate_seconds': times['separate'],
          'separate_totals': separate_totals,
          'ratios': [g / s for g, s in zip(times['grouped'], separate_totals)],
          'load_averages': loads, 'configurations': configs}


# Tables.

def _cell(spread: dict, digits: int = 4) -> str:
  return f"{spread['mean']:.{digits}f} ({spread['min']:.{digits}f}-{spread['max']:.{digits}f})"


def diverse_tables(result: dict) -> str:
  summary, seeds = result['summary'], result['seeds']
  lines = [f"{len(seeds)} seeds ({', '.join(str(s['seed']) for s in seeds)}): mean (min-max).",
           '', '| ensemble | distinct members | parameters | MFLOPs / example | '
           + ' | '.join(COLUMNS) + ' |', '|---|---:|---:|---:|' + '---:|' * len(COLUMNS)]
  for name, row in summary['table'].items():
    distinct = row['distinct_members']
    lines.append(f"| {name} | {distinct['mean']:.1f} | {row['parameters']['mean']:,.0f} | "
                 f"{row['mflops_per_example']['mean']:.2f} | "
                 + ' | '.join(_cell(row[c]) for c in COLUMNS) + ' |')
  for selection in SELECTIONS:
    paired = summary['paired'][selection]
    lines += ['', f'| {selection} - best arch | ' + ' | '.join(COLUMNS) + ' |',
              '|---|' + '---:|' * len(COLUMNS)]
    for s, seed in enumerate(seeds):
      members = seed['rows'][selection]['members']
      lines.append(f"| seed {seed['seed']} (best arch {seed['best_architecture']}; members "
                   f"{members}) | "
                   + ' | '.join(f"{paired[c]['values'][s]:+.4f}" for c in COLUMNS) + ' |')
    lines.append(f'| seeds {selection} is better / worse (disagreement: higher / lower) | '
                 + ' | '.join(f"{paired[c]['better_in']} / {paired[c]['worse_in']}"
                              for c in COLUMNS) + ' |')
  lines += ['', '| seed | best arch | greedy picks | wall s (grouped run, eval.shift) | '
            'train s | load average before | recomputed - final_metrics.json, max abs |',
            '|---|---|---|---:|---:|---|---:|']
  for seed in seeds:
    lines.append(f"| {seed['seed']} | {seed['best_architecture']} | {seed['greedy_picks']} | "
                 f"{seed['wall_seconds']:.0f} | {seed['train_seconds']:.0f} | "
                 f"{seed['load_average_before']} | {seed['check']['max_abs_difference']:.1e} |")
  return '\n'.join(lines)


def sweep_tables(result: dict) -> str:
  lines = ['| round | one grouped run (36 members, 9 groups) | 9 separate runs | ratio |',
           '|---|---:|---:|---:|']
  for r in range(result['rounds']):
    lines.append(f"| {r} | {result['grouped_seconds'][r]:.1f} s | "
                 f"{result['separate_totals'][r]:.1f} s | {result['ratios'][r]:.2f}x |")
  lines += ['', '| configuration | member ids in the grouped run | grouped: ensemble accuracy '
            '/ NLL / ECE | separate (ids 0-3): ensemble accuracy / NLL / ECE | member NLL, '
            'grouped: mean (min-max) | member NLL, separate |', '|---|---|---|---|---|---|']
  for name, row in result['configurations'].items():
    g, s, ids = row['grouped'], row['separate'], row['grouped_member_ids']
    lines.append(f"| {name} | {ids[0]}-{ids[-1]} | {g['accuracy']:.4f} / {g['nll']:.4f} / "
                 f"{g['ece']:.4f} | {s['accuracy']:.4f} / {s['nll']:.4f} / {s['ece']:.4f} | "
                 f"{_cell(row['member_nll']['grouped'])} | "
                 f"{_cell(row['member_nll']['separate'])} |")
  return '\n'.join(lines)


def tables(result: dict) -> str:
  out = []
  if 'diverse' in result:
    out += ['## Diverse ensemble against the best architecture', diverse_tables(result['diverse'])]
  if 'sweep' in result:
    out += ['## Architecture sweep: one run against separate runs', sweep_tables(result['sweep'])]
  return '\n\n'.join(out)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--part', choices=('both', 'diverse', 'sweep'), default='both')
  parser.add_argument('--seeds', default='0,1,2', help='config.seed of each diverse run')
  parser.add_argument('--rounds', type=int, default=2, help='sweep rounds, alternating order')
  parser.add_argument('--sweep_steps', type=int, default=SWEEP_STEPS)
  parser.add_argument('--diverse_steps', type=int, default=None,
                      help='a quick look: train.steps of the diverse runs (not written '
                      'to the default --out)')
  parser.add_argument('--out', default=str(OUT))
  parser.add_argument('--table', action='store_true', help='print the saved results only')
  args = parser.parse_args()
  if args.table:
    print(tables(json.loads(Path(args.out).read_text())))
    return
  result = {**harness.run_header(), 'devices': f'{jax.device_count()} x cpu'}
  start = time.perf_counter()
  if args.part in ('both', 'diverse'):
    seeds = []
    with tempfile.TemporaryDirectory(prefix='groups_digits_') as tmp:
      for seed in (int(s) for s in args.seeds.split(',')):
        seeds.append(diverse_seed(seed, Path(tmp) / f'seed{seed}', args.diverse_steps))
        print(f"seed {seed}: {seeds[-1]['wall_seconds']:.0f} s, best "
              f"{seeds[-1]['best_architecture']}, greedy picks {seeds[-1]['greedy_picks']}",
              flush=True)
    result['diverse'] = {'config': 'configs/digits_groups.py', 'seeds': seeds,
                         'summary': diverse_summary(seeds)}
  if args.part in ('both', 'sweep'):
    result['sweep'] = sweep(args.rounds, args.sweep_steps)
  result.update(wall_seconds=time.perf_counter() - start,
                load_average_end=harness.load_average())
  print(tables(result))
  if args.diverse_steps and args.out == str(OUT):
    return
  harness.write_results(args.out, result)
  print(f'wrote {args.out}')


if __name__ == '__main__':
  main()
