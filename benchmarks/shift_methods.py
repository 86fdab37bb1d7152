"""Clean and corrupted test metrics of every ensemble method on MNIST-1D, side by side as
uncertainty-baselines' tables put them: the tables in docs/evaluation.md and README.md.

  python benchmarks/shift_methods.py              # T = 1000, seeds 0-2, ~17 min on 2 CPU cores
  python benchmarks/shift_methods.py --steps 50   # a quick look
  python benchmarks/shift_methods.py --table      # the table of the saved results
  python benchmarks/shift_methods.py --config configs/digits_resnet20.py   # ResNet-20 on
      # digits, T = the config's train.steps (110); writes shift_methods_digits_resnet20.json

--config (configs/default.py: MLP 40-256-256-10, Adam 1e-3, batch 128, seed 0) on ONE device, each
method at benchmarks/methods.py's equal budget of 4 x T member-steps (T = 1000; its single
model, FGE, single SWAG and dropout deep ensemble are left out, to stay near 5 minutes):

  deep           4 independent members, T steps
  batchensemble  4 members sharing each weight (rank-1 factors), T steps
  mimo           1 network, 3 heads, 4T steps
  snapshot       1 member, 4T steps, 4 cosine cycles -> 4 snapshots predict
  multiswag      4 members, T steps, SWAG over the last quarter -> 4 x 4 samples predict
  mc_dropout     1 member with dropout 0.2, 4T steps -> 16 MC dropout samples predict

Shift: eval.shift='all' as it applies to the data (MNIST-1D's 1-D signals: 11 families x 5
severities = 55 corrupted test sets, motion blur needs 2-D images; digits' grey 8x8 images:
12 x 5 = 60, saturate needs colour). Every method is
evaluated through its PREDICTING members (snapshots, SWAG samples, MC samples: the
in-run shift evaluation sees the trained members only) on the test split corrupted by
the run's own corruption keys (dist_ens.eval.shift.InputFrame, as EvaluateDecisions does):
clean accuracy / NLL / ECE beside cA / cNLL / cCE, the means over the corrupted sets. For the
deep ensemble this path must reproduce the run's own 'shift' section (both are printed).
Every method runs once per seed (--seeds, default 0,1,2: config.seed, so members' inits,
data orders, dropout and corruption keys all change); the table gives the mean over seeds
+- their sample standard deviation, and a gap between two methods smaller than those
spreads ranks nothing.
Writes benchmarks/results/shift_methods.json (default.py) or shift_methods_<config>.json.
"""

import argparse
import json
import tempfile
import time
from pathlib import Path

import jax  # pylint: disable=g-import-not-at-top
import jax.numpy as jnp
import numpy as np

import dist_ens
from benchmarks import harness
from dist_ens.config import specs
from dist_ens import Ensemble, data
from dist_ens.data import corruptions
from dist_ens.eval import evaluate, shift, shift_spec

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / 'benchmarks' / 'results'
DEFAULT_CONFIG = ROOT / 'configs' / 'default.py'
MEMBERS, MC_SAMPLES = 4, 16
STEPS = 1000  # T, as benchmarks/methods.py


def methods(steps: int) -> dict[str, dict]:
  """name -> config overrides (benchmarks/methods.py's, at T = steps)."""
  long = MEMBERS * steps
  swag = {'ensemble.swag.start': 0.75, 'ensemble.swag.every': 10, 'ensemble.swag.rank': 10}
  return {
      'deep': {'num_members': MEMBERS, 'train.steps': steps},
      'batchensemble': {'num_members': MEMBERS, 'train.steps': steps,
                        'ensemble.method': 'batchensemble'},
      'mimo': {'num_members': 1, 'train.steps': long, 'ensemble.method': 'mimo',
               'ensemble.mimo.heads': 3},
      'snapshot': {'num_members': 1, 'train.steps': long, 'ensemble.method': 'snapshot',
                   'ensemble.snapshot.cycles': MEMBERS, 'optim.schedule': 'cosine'},
      'multiswag': {'num_members': MEMBERS, 'train.steps': steps, 'ensemble.method': 'multiswag',
                    'ensemble.swag.samples': 4, **swag},
      'mc_dropout': {'num_members': 1, 'train.steps': long, 'model.dropout': 0.2,
                     'eval.mc_samples': MC_SAMPLES},
  }


def _out(base: Path) -> Path:
  return RESULTS / ('shift_methods.json' if base == DEFAULT_CONFIG else
                    f'shift_methods_{base.stem}.json')


def _config(base: Path, overrides: dict, shift_spec_: str):
  config = dist_ens.load_config(base)
  config.mesh.member, config.mesh.data, config.writers = 1, 1, ('jsonl',)
  config.update_from_flattened_dict(overrides)
  steps = config.train.steps
  config.train.log_every = min(config.train.log_every, steps)
  config.train.eval_every, config.checkpoint.every = 0, steps
  config.eval.shift = shift_spec_  # the in-run evaluation (a cross-check for 'deep')
  return config


def shifted_metrics(workdir: str, pairs: list[tuple[str, int]]) -> dict:
  """Clean and per-pair metrics of the loaded (predicting) ensemble on corrupted test sets."""
  ens = Ensemble.load(workdir, devices=jax.devices()[:1])
  config = ens.config
  test = data.load_dataset(config.data.name, specs.data_spec(config)).test
  frame = shift.InputFrame.fit(test.x, config.data.std or 1.0, config.data.mean or 0.0)
  corrupt = jax.jit(lambda x, i, c, s: frame.corrupt(x, i, c, s, config.seed))
  step = evaluate.make_outputs_step(ens.model, ens.mesh, mc_samples=config.eval.mc_samples,
                                   combine=ens.task.combine, seed=config.seed)
  scorer = evaluate.Scorer.of(ens.task)
  variables, index = (ens.params, ens.model_state), jnp.arange(len(test.y))
  assert not np.any(ens.frozen)  # no member is left out: every predicting member counts

  def metrics_of(corruption: int, severity: int) -> dict:
    x = np.asarray(corrupt(test.x, index, jnp.int32(corruption), jnp.int32(severity)))
    # [M, N, C]: an MC dropout member's samples and MIMO's heads come averaged per member.
    outputs = evaluate.split_outputs(step, variables, data.Split(x, test.y), 1000, ens.mesh)
    out = scorer.metrics(outputs, test.y)
    members = {k: float(np.mean(out['members'][k])) for k in ('accuracy', 'nll', 'ece')}
    return {'ensemble': {k: float(out['ensemble'][k]) for k in ('accuracy', 'nll', 'ece')},
            'mean_member': members}

  per_pair = {f'{name}:{severity}': metrics_of(corruptions.corruption_id(name), severity)
              for name, severity in pairs}
  # Members averaged inside a 'member' (MC samples, MIMO heads) count as methods.py counts them.
  heads = config.ensemble.mimo.heads if config.ensemble.method == 'mimo' else 1
  predicting = ens.num_members * max(config.eval.mc_samples, 1) * heads
  return {'clean': metrics_of(0, 0), 'pairs': per_pair, 'predicting': predicting}


def summarise(name: str, final: dict, found: dict, wall: float) -> dict:
  row = {'method': name, 'predicting': found['predicting'], 'wall_seconds': wall}
  for who in ('ensemble', 'mean_member'):
    clean = found['clean'][who]
    means = {short: float(np.mean([r[who][metric] for r in found['pairs'].values()]))
             for short, metric in (('cA', 'accuracy'), ('cNLL', 'nll'), ('cCE', 'ece'))}
    row[who] = {**clean, **means}
  if name == 'deep':  # the in-run evaluation saw the same members and the same inputs
    row['run_cA'], row['run_cNLL'] = final['shift']['cA'], final['shift']['cNLL']
  return row


def over_seeds(rows: list[dict]) -> dict:
  """One method's per-seed rows -> their mean and sample standard deviation per metric
  ('ensemble', 'ensemble_sd', 'mean_member', 'mean_member_sd'), the rows kept."""
  out = {'method': rows[0]['method'], 'predicting': rows[0]['predicting'],
         'seeds': [r['seed'] for r in rows], 'per_seed': rows,
         'wall_seconds': sum(r['wall_seconds'] for r in rows)}
  for who in ('ensemble', 'mean_member'):
    values = {k: [r[who][k] for r in rows] for k in rows[0][who]}
    out[who] = {k: float(np.mean(v)) for k, v in values.items()}
    out[f'{who}_sd'] = {k: float(np.std(v, ddof=1)) if len(v) > 1 else 0.0
                        for k, v in values.items()}
  return out


def table(rows: list[dict]) -> str:
  """Mean (and, over several seeds, +- the seeds' standard deviation) per method."""
  columns = ('accuracy', 'nll', 'ece', 'cA', 'cNLL', 'cCE')

  def cell(r: dict, c: str) -> str:
    sd = r.get('ensemble_sd', {}).get(c)
    return f"{r['ensemble'][c]:.3f}" + (f' +- {sd:.3f}' if sd else '')

  lines = ['| method | predicting | accuracy | NLL | ECE | cA | cNLL | cCE |',
           '|---|---|---|---|---|---|---|---|']
  for r in rows:
    lines.append(f"| {r['method']} | {r['predicting']} | "
                 + ' | '.join(cell(r, c) for c in columns) + ' |')
  return '\n'.join(lines)


def run_one(name: str, base: Path, overrides: dict, seed: int,
            pairs: list[tuple[str, int]]) -> dict:
  """One method at one seed: trained on one device, then scored clean and shifted."""
  start = time.perf_counter()
  workdir = tempfile.mkdtemp(prefix=f'shift_methods_{name}_')
  config = _config(base, {**overrides, 'seed': seed}, 'all' if name == 'deep' else '')
  final = dist_ens.train(config, workdir, devices=jax.devices()[:1])
  row = summarise(name, final, shifted_metrics(workdir, pairs), time.perf_counter() - start)
  row['seed'] = seed
  print(f"{name} seed {seed}: {row['ensemble']} ({row['wall_seconds']:.0f} s)", flush=True)
  if name == 'deep':
    print(f"deep seed {seed}: the run's own cA {row['run_cA']:.6f} / cNLL "
          f"{row['run_cNLL']:.6f}, this script's {row['ensemble']['cA']:.6f} / "
          f"{row['ensemble']['cNLL']:.6f}", flush=True)
  return row


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--config', default=str(DEFAULT_CONFIG))
  parser.add_argument('--steps', type=int, default=0,
                      help="T: steps of a 4-member run (0: 1000 for default.py, else the config's "
                           'train.steps)')
  parser.add_argument('--methods', default='', help='comma-separated subset')
  parser.add_argument('--seeds', default='0,1,2',
                      help='comma-separated seeds; the table gives mean +- sd over them')
  parser.add_argument('--table', action='store_true', help='print the saved results only')
  args = parser.parse_args()
  base = Path(args.config).resolve()
  out = _out(base)
  if args.table:
    print(table(json.loads(out.read_text())['rows']))
    return
  default_steps = STEPS if base == DEFAULT_CONFIG else dist_ens.load_config(base).train.steps
  steps = args.steps or default_steps
  chosen = methods(steps)
  names = [n for n in args.methods.split(',') if n] or list(chosen)
  seeds = [int(s) for s in args.seeds.split(',')]
  data_name = dist_ens.load_config(base).data.name
  pairs = shift_spec.resolve_shift('all', data.load_dataset(data_name).input_shape)
  rows = [over_seeds([run_one(name, base, chosen[name], seed, pairs) for seed in seeds])
          for name in names]
  print(table(rows))
  if steps == default_steps and not args.methods:
    harness.write_results(out, {**harness.run_header(), 'config': base.name, 'rows': rows,
                                'steps': steps, 'seeds': seeds, 'pairs': len(pairs),
                                'markdown': table(rows), 'jax': jax.__version__})
    print(f'wrote {out}')


if __name__ == '__main__':
  main()
