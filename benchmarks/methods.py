"""Ensemble methods compared at equal training compute on the embedded MNIST-1D data.

  python -m benchmarks.methods               # budget 4 x 1000 member-steps, 6 min on 2 cores at load 1-2
  python -m benchmarks.methods --steps 200   # a quick look
  python -m benchmarks.methods --seeds 0,1,2  # every method at 3 seeds: mean +- sd, DEE per seed (16 min)
  python -m benchmarks.methods --config configs/digits_resnet20.py   # ResNet-20 on digits,
      # T = the config's train.steps (110), OOD set digits_noise; writes methods_digits_resnet20.json
      # (49 min for one seed at load 2-4)

Every run is --config (configs/default.py: MLP 40-256-256-10, Adam 1e-3, batch 128, seed 0)
on ONE device, with config.eval.ood_dataset='<data.name>_noise' and a validation split
(data.validation_size: --validation_size, 500 of MNIST-1D's 4,000 training examples, 300 of
the digits' 1,437) that every method trains without and the calibrated NLL is fitted on.
The budget is B = 4 x T member-steps (a member-step is one update of one member on its
batch of 128), so each method trains for the same number of forward/backward passes:

  single      1 member, T steps (a quarter of the budget: the baseline)
  deep        4 independent members, T steps
  batchensemble  4 members sharing each weight (rank-1 factors), T steps
  mimo        1 network of 3 input slots and heads, 4T steps -> 3 heads predict
  ensemble+   4 members, T steps, each with a frozen randomized prior network (scale 3)
  laplace     4 members, T steps, each a last-layer K-FAC Laplace (probit predictive):
              its inference time is Ensemble.predict(x, laplace=True)'s on the test split
  snapshot    1 member, 4T steps, 4 cosine cycles -> 4 snapshots predict
  fge         fast geometric ensembling: 1 member, 4T steps, the cosine schedule over the
              first half, then 4 cosine cycles at 0.2x the rate -> 4 snapshots predict
  swag        1 member, 4T steps, SWAG over the last quarter (every 10 steps, rank 10)
              -> 16 weight samples predict
  multiswag   4 members, T steps, SWAG each -> 4 x 4 samples predict
  mc_dropout  1 member with dropout 0.2, 4T steps -> 16 MC dropout samples
  deep_dropout  4 members with dropout 0.2, T steps, evaluated without MC

  masksembles  4 members, T steps: one shared network, each member its fixed masks on the
              hidden units (scale 2)
  packed      Packed-Ensembles, 4 members, T steps: alpha 2, gamma 1, each member the MLP
              at width int(2 * 256) / 4 = 128 (40-128-128-10; 29% of deep's parameters)
  sngp        SNGP (Liu et al. 2020) on each of 4 members, T steps: hidden layers of
              spectral norm <= 0.95 (6 on a ResNet: every conv; the GP then reads the
              pooled features' unit vector), a GP output layer of 1,024 random features,
              its Laplace precision over the last 28 steps, logits / sqrt(1 + pi/8 var)
  rank1       rank-1 BNNs (Dusenberry et al. 2020), 4 members (mixture components), T
              steps: one shared W per kernel, Gaussian factors (prior N(1, 0.1^2), random-sign
              init), 1 draw per example in training, N = the training split's size, the KL
              annealed over 80% of the steps -> 4 fixed draws per member predict
  rank1_cauchy  the same with Cauchy priors and posteriors (the paper's best corrupted-data row)
  rank1_normal  the same (Gaussian) with the factors' locations starting at N(1, 0.5^2)
  sgmcmc      cyclical SGHMC (Zhang et al. 2020), 4 chains, T steps: 4 cosine cycles (peak
              rate 0.05, friction 0.1, T = 1, N = the training split's size, weight decay
              5e-4), sampling the last 20% of each -> 4 x 4 samples predict
  epinet      4 members, T steps, each with an epinet on its last features (index dim 8,
              8 index draws a step; 16 index samples predict)
  distilled   deep's 4 members distilled into one network of their architecture (soft
              targets at temperature 2, 2T steps: the student's cost beside the budget)
  deep16      16 independent members, T steps: the deep-ensemble curve for DEE (not a
              method at this budget)

Reported per method: test accuracy, NLL, Brier, ECE of the predicting ensemble, OOD AUROC
by predictive entropy (mnist1d_noise vs test), parameters trained and parameters that
predict, train time (`train_seconds`: the loop, compilation included, evaluation left
out) and inference time (the predicting members' log-probabilities on the 1,000 test
examples, median of 5 after a warm-up; MC dropout's K samples included), and as the
literature compares methods (Ashukha et al. 2020): the calibrated NLL, the test NLL after
temperature scaling (one temperature on the log of the method's predictive, fitted on the
validation split by dist_ens.eval.calibration.fit_temperature, the run's own
eval.temperature_scaling fit; the table shows it), and the deep-ensemble equivalent (DEE):
the number of deep16's members (the first k, interpolated linearly between whole k) whose
calibrated NLL equals the method's ('<1' and '>16' outside the curve), per seed. Writes
benchmarks/results/methods.json, prints a Markdown table and draws accuracy, NLL and
ECE per method (benchmarks/results/methods.png and .svg, as a run's report draws them).
"""

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

os.environ.setdefault('MPLBACKEND', 'Agg')

import jax  # pylint: disable=g-import-not-at-top
import numpy as np

import dist_ens
from benchmarks import harness
from dist_ens.run import mesh_layout
from dist_ens.config import specs
from dist_ens import Ensemble, data
from dist_ens.run import assemble
from dist_ens.eval.ood import load_ood_split
from dist_ens.eval import calibration, evaluate
from dist_ens.report import scatter as report_scatter

ROOT = Path(__file__).resolve().parents[1]
MEMBERS = 4
MC_SAMPLES = 16
CURVE_MEMBERS = 16  # deep16: the deep-ensemble curve DEE reads


def methods(steps: int) -> dict[str, dict]:
  """name -> config overrides; every method trains MEMBERS * steps member-steps but 'single'."""
  long = MEMBERS * steps
  swag = {'ensemble.swag.start': 0.75, 'ensemble.swag.every': 10, 'ensemble.swag.rank': 10}
  return {
      'single': {'num_members': 1, 'train.steps': steps},
      'deep': {'num_members': MEMBERS, 'train.steps': steps},
      'batchensemble': {'num_members': MEMBERS, 'train.steps': steps,
                        'ensemble.method': 'batchensemble'},
      'mimo': {'num_members': 1, 'train.steps': long, 'ensemble.method': 'mimo',
               'ensemble.mimo.heads': 3},
      'snapshot': {'num_members': 1, 'train.steps': long, 'ensemble.method': 'snapshot',
                   'ensemble.snapshot.cycles': MEMBERS, 'optim.schedule': 'cosine'},
      'fge': {'num_members': 1, 'train.steps': long, 'ensemble.method': 'snapshot',
              'ensemble.snapshot.cycles': MEMBERS, 'ensemble.snapshot.start': 0.5,
              'ensemble.snapshot.cycle_rate': 0.2, 'optim.schedule': 'cosine'},
      'swag': {'num_members': 1, 'train.steps': long, 'ensemble.method': 'multiswag',
               'ensemble.swag.samples': 16, **swag},
      'multiswag': {'num_members': MEMBERS, 'train.steps': steps, 'ensemble.method': 'multiswag',
                    'ensemble.swag.samples': 4, **swag},
      'mc_dropout': {'num_members': 1, 'train.steps': long, 'model.dropout': 0.2,
                     'eval.mc_samples': MC_SAMPLES},
      'deep_dropout': {'num_members': MEMBERS, 'train.steps': steps, 'model.dropout': 0.2},
      # Randomized prior functions (Osband et al. 2018; the Testbed's ensemble+).
      'ensemble+': {'num_members': MEMBERS, 'train.steps': steps, 'ensemble.method': 'prior'},
      # A deep ensemble's members each with a last-layer K-FAC Laplace (mixture of
      # Laplaces); prior precision chosen on the validation split.
      'laplace': {'num_members': MEMBERS, 'train.steps': steps,
                  'eval.laplace': 'last_layer_kron'},
      'epinet': {'num_members': MEMBERS, 'train.steps': steps, 'ensemble.method': 'epinet'},
      'masksembles': {'num_members': MEMBERS, 'train.steps': steps,
                      'ensemble.method': 'masksembles', 'ensemble.masksembles.scale': 2.0},
      'packed': {'num_members': MEMBERS, 'train.steps': steps, 'ensemble.method': 'packed',
                 'ensemble.packed.alpha': 2.0, 'ensemble.packed.gamma': 1},
      'sgmcmc': {'num_members': MEMBERS, 'train.steps': steps, 'ensemble.method': 'sgmcmc',
                 'ensemble.sgmcmc.sampler': 'sghmc', 'ensemble.sgmcmc.cycles': MEMBERS,
                 'ensemble.sgmcmc.beta': 0.8, 'ensemble.sgmcmc.samples_per_cycle': 1,
                 'ensemble.sgmcmc.friction': 0.1, 'ensemble.sgmcmc.temperature': 1.0,
                 'optim.learning_rate': 0.05, 'optim.weight_decay': 5e-4},
      # SNGP (Liu et al. 2020) per member: the precision over the last epoch, 28 steps of
      # 128 of the 3,500 training examples (N set below, as sgmcmc's).
      'sngp': {'num_members': MEMBERS, 'train.steps': steps, 'ensemble.method': 'sngp',
               'ensemble.sngp.cov_steps': 28},
      # Rank-1 BNNs (Dusenberry et al. 2020) at the paper's defaults (N set below).
      'rank1': {'num_members': MEMBERS, 'train.steps': steps, 'ensemble.method': 'rank1'},
      'rank1_cauchy': {'num_members': MEMBERS, 'train.steps': steps, 'ensemble.method': 'rank1',
                       'ensemble.rank1.prior': 'cauchy'},
      'rank1_normal': {'num_members': MEMBERS, 'train.steps': steps, 'ensemble.method': 'rank1',
                       'ensemble.rank1.init': 'normal'},
      'distilled': {'num_members': MEMBERS, 'train.steps': steps, 'distill.student': 'same',
                    'distill.steps': 2 * steps, 'distill.temperature': 2.0},
      'deep16': {'num_members': CURVE_MEMBERS, 'train.steps': steps},
  }


def _config(base: Path, overrides: dict, validation_size: int):
  config = dist_ens.load_config(base)
  config.eval.ood_dataset = f'{config.data.name}_noise'
  config.data.validation_size = validation_size
  config.mesh.member, config.mesh.data = 1, 1
  config.update_from_flattened_dict(overrides)
  if config.ensemble.method == 'sgmcmc':  # N: the training split the chains sample over
    train = data.load_dataset(config.data.name, specs.data_spec(config)).train
    config.ensemble.sgmcmc.data_size = len(train.x) - validation_size
  if config.ensemble.method == 'sngp':  # N: the training split of its precision
    train = data.load_dataset(config.data.name, specs.data_spec(config)).train
    config.ensemble.sngp.data_size = len(train.x) - validation_size
  if config.ensemble.method == 'rank1':  # N: the training split the ELBO is per example of
    train = data.load_dataset(config.data.name, specs.data_spec(config)).train
    config.ensemble.rank1.data_size = len(train.x) - validation_size
  steps = config.train.steps
  config.train.log_every = min(config.train.log_every, steps)
  config.train.eval_every, config.checkpoint.every = 0, steps
  return config


def _scores(name: str, results: dict) -> tuple[dict, float]:
  """(test metrics of the predicting ensemble, its OOD AUROC by entropy)."""
  key = {'snapshot': 'snapshot', 'fge': 'snapshot', 'swag': 'multiswag',
         'multiswag': 'multiswag', 'mc_dropout': 'mc_dropout', 'laplace': 'laplace',
         'sgmcmc': 'sgmcmc'}.get(name)
  block = results[key] if key else results
  return block['ensemble'], block['ood']['ensemble']['auroc_entropy']


def _inference_seconds(ens: Ensemble, mc_samples: int) -> float:
  """Median wall time of the predicting members' outputs on the test split (a run with
  eval.laplace: the members' Laplace predictives, by Ensemble.predict)."""
  test = data.load_dataset(ens.config.data.name, specs.data_spec(ens.config)).test
  step = evaluate.make_outputs_step(ens.model, ens.mesh, mc_samples=mc_samples,
                                   combine=ens.task.combine, seed=ens.config.seed)
  variables = (ens.params, ens.model_state)
  if ens.laplace is not None:
    predict = lambda: ens.predict(test.x, 1000, preprocessed=True, laplace=True)
  else:
    predict = lambda: evaluate.split_outputs(step, variables, test, 1000, ens.mesh)
  return _timed(predict)


def _trained_parameters(config) -> int:
  """All parameters the optimizer trains (a BatchEnsemble's shared weights once)."""
  dataset = data.load_dataset(config.data.name, specs.data_spec(config))
  parts = assemble.build_parts(config, mesh_layout.build_mesh(config, jax.devices()[:1]),
                               dataset.input_shape, dataset.num_classes)
  return sum(leaf.size for leaf in jax.tree.leaves(parts.abstract_state.params))


def _member_log_probs(ens: Ensemble, name: str, split) -> np.ndarray:
  """[K, N, C] log-probabilities of the K members that predict for the method on `split`
  (the student alone for 'distilled'; MC dropout's K samples combined per member)."""
  log = lambda p: np.log(np.maximum(p, 1e-30))
  if name == 'distilled':
    return log(ens.student().predict(split.x, preprocessed=True).probs)[None]
  if ens.laplace is not None:
    return log(ens.predict(split.x, preprocessed=True, laplace=True).member_probs)
  mc = ens.config.eval.get('mc_samples', 0)
  if mc:
    step = evaluate.make_outputs_step(ens.model, ens.mesh, mc_samples=mc,
                                     combine=ens.task.combine, seed=ens.config.seed)
    outputs = evaluate.split_outputs(step, (ens.params, ens.model_state), split, 1000, ens.mesh)
    return np.asarray(jax.nn.log_softmax(outputs, -1))
  return log(ens.predict(split.x, preprocessed=True).member_probs)


def _nll(logits: np.ndarray, y: np.ndarray) -> float:
  top = logits.max(-1, keepdims=True)
  log_z = np.log(np.exp(logits - top).sum(-1)) + top[:, 0]
  return float(np.mean(log_z - logits[np.arange(len(y)), y]))


def _mixture(member_log_probs: np.ndarray) -> np.ndarray:
  """[N, C] log of the members' mean probabilities (float64)."""
  probs = np.exp(np.asarray(member_log_probs, np.float64)).mean(0)
  return np.log(np.maximum(probs, 1e-30))


def calibrated(val_log_probs: np.ndarray, val_y: np.ndarray, test_log_probs: np.ndarray,
               test_y: np.ndarray) -> tuple[float, float]:
  """(test NLL after temperature scaling, T): one temperature on the log of the members'
  mixture, fitted on the validation split (Ashukha et al. 2020) by the run's own fit
  (dist_ens.eval.calibration.fit_temperature, T in [T_MIN, T_MAX]), scored on test."""
  t = float(calibration.fit_temperature(_mixture(val_log_probs).astype(np.float32), val_y))
  return _nll(_mixture(test_log_probs) / t, test_y), t


def deep_curve(val_log_probs: np.ndarray, val_y: np.ndarray, test_log_probs: np.ndarray,
               test_y: np.ndarray) -> list[float]:
  """Calibrated NLL of the first k members' ensemble, k = 1..K."""
  return [calibrated(val_log_probs[:k], val_y, test_log_probs[:k], test_y)[0]
          for k in range(1, len(test_log_probs) + 1)]


def dee(value: float, curve: list[float]) -> float | str:
  """The deep-ensemble equivalent of a calibrated NLL: the (interpolated) number of
  members at which the deep-ensemble curve first reaches `value`."""
  if value > curve[0]:
    return '<1'
  for k in range(1, len(curve)):
    if curve[k] <= value:
      return k + (curve[k - 1] - value) / (curve[k - 1] - curve[k])
  return f'>{len(curve)}'


def _student_scores(ens: Ensemble, log_probs: np.ndarray, test) -> tuple[dict, float]:
  """The student's test metrics and OOD AUROC by entropy, by the task's own scorer."""
  scorer = evaluate.Scorer.of(ens.task)
  ensemble = scorer.metrics(log_probs, test.y)['ensemble']
  spec = specs.data_spec(ens.config)
  ood = load_ood_split(ens.config.eval.ood_dataset, data.load_dataset(ens.config.data.name, spec),
                       spec)
  ood_log_probs = _member_log_probs(ens, 'distilled', ood)
  auroc = scorer.ood(log_probs, ood_log_probs, test.y)['ensemble']['auroc_entropy']
  return ensemble, auroc


def _timed(fn) -> float:
  times = []
  for _ in range(6):  # The first call compiles.
    start = time.perf_counter()
    fn()
    times.append(time.perf_counter() - start)
  return statistics.median(times[1:])


def _splits(config) -> tuple:
  """(validation, test): the run's validation split (data.split_validation) and test."""
  dataset = data.load_dataset(config.data.name, specs.data_spec(config))
  return data.split_validation(dataset.train, config.data.validation_size)[1], dataset.test


def run(base: Path, name: str, overrides: dict, validation_size: int) -> dict:
  config = _config(base, overrides, validation_size)
  workdir = tempfile.mkdtemp(prefix=f'methods_{name}_')
  results = dist_ens.train(config, workdir, devices=jax.devices()[:1])
  ens = Ensemble.load(workdir, devices=jax.devices()[:1])
  val, test = _splits(config)
  log_probs = _member_log_probs(ens, name, test)
  val_log_probs = _member_log_probs(ens, name, val)
  calibrated_nll, temperature = calibrated(val_log_probs, val.y, log_probs, test.y)
  per_member = sum(int(np.prod(a.shape[1:])) for a in jax.tree.leaves(ens.params))
  mc = config.eval.get('mc_samples', 0)
  heads = config.ensemble.mimo.heads if config.ensemble.method == 'mimo' else 1
  row = {'method': name, 'overrides': overrides,
         'member_steps': config.num_members * config.train.steps,
         'trained_parameters': _trained_parameters(config),
         'predicting_members': ens.num_members * max(mc, 1) * heads,
         'predicting_parameters': per_member * ens.num_members,
         'train_seconds': results['train_seconds'],
         'calibrated_nll': calibrated_nll, 'temperature': temperature,
         'validation_nll': _nll(_mixture(val_log_probs), val.y)}
  if name == 'distilled':
    ensemble, auroc = _student_scores(ens, log_probs, test)
    student = ens.student()
    row.update(student_steps=config.distill.steps, predicting_members=1,
               predicting_parameters=per_member,
               inference_seconds=_timed(lambda: student.predict(test.x, preprocessed=True)))
  else:
    ensemble, auroc = _scores(name, results)
    row['inference_seconds'] = _inference_seconds(ens, mc)
  if name == 'deep16':
    row['curve'] = deep_curve(val_log_probs, val.y, log_probs, test.y)
  row.update(accuracy=ensemble['accuracy'], nll=ensemble['nll'], brier=ensemble['brier'],
             ece=ensemble['ece'], ood_auroc=auroc)
  return row


def _dee_text(r: dict) -> str:
  """The DEE, or each seed's ('4.0 / 3.8 / 4.2') over several seeds."""
  values = r.get('dee', '-')
  text = lambda v: f'{v:.1f}' if isinstance(v, float) else v
  return ' / '.join(map(text, values)) if isinstance(values, list) else text(values)


def _cell(r: dict, metric: str, digits: int = 3) -> str:
  """A metric's value, or its mean +- the seeds' standard deviation over several seeds."""
  sd = r.get(f'{metric}_sd')
  return f'{r[metric]:.{digits}f}' + (f' +- {sd:.{digits}f}' if sd is not None else '')


def table(rows: list[dict]) -> str:
  head = ('| method | member-steps | predicting members | accuracy | NLL | calibrated NLL (T) '
          '| DEE | Brier | ECE | OOD AUROC | parameters trained / predicting | train s '
          '| inference ms |')
  lines = [head, '|---' * 13 + '|']
  for r in rows:
    steps = f"{r['member_steps']:,}" + (f" + {r['student_steps']:,}" if 'student_steps' in r
                                         else '')
    lines.append(
        f"| {r['method']} | {steps} | {r['predicting_members']} | "
        f"{_cell(r, 'accuracy')} | {_cell(r, 'nll')} | {_cell(r, 'calibrated_nll')} "
        f"({r['temperature']:.2f}) | {_dee_text(r)} | {_cell(r, 'brier')} | {_cell(r, 'ece')} | "
        f"{_cell(r, 'ood_auroc')} | {r['trained_parameters']:,} / {r['predicting_parameters']:,} | "
        f"{r['train_seconds']:.1f} | {1000 * r['inference_seconds']:.0f} |")
  return '\n'.join(lines)


def add_dee(rows: list[dict]) -> None:
  """Each row's DEE on deep16's curve of its own seed (rows without that run get none)."""
  curves = {r.get('seed'): r['curve'] for r in rows if 'curve' in r}
  for r in rows:
    if r.get('seed') in curves:
      r['dee'] = dee(r['calibrated_nll'], curves[r.get('seed')])


# The metrics a row averages over seeds.
METRICS = ('accuracy', 'nll', 'calibrated_nll', 'temperature', 'brier', 'ece', 'ood_auroc',
           'train_seconds', 'inference_seconds')


def over_seeds(rows: list[dict]) -> dict:
  """One method's per-seed rows -> one row: each metric's mean over the seeds and, with
  several, '<metric>_sd' (the seeds' sample standard deviation) and each seed's DEE; the
  per-seed rows kept under 'per_seed'. One seed: its row as it is."""
  if len(rows) == 1:
    return rows[0]
  out = {k: v for k, v in rows[0].items() if k not in ('curve', 'seed', 'dee')}
  for metric in METRICS:
    values = [r[metric] for r in rows]
    out[metric], out[f'{metric}_sd'] = float(np.mean(values)), float(np.std(values, ddof=1))
  out.update(dee=[r.get('dee', '-') for r in rows], seeds=[r['seed'] for r in rows],
             per_seed=rows)
  return out


def main(argv: list[str] | None = None) -> None:
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument('--config', default=str(ROOT / 'configs' / 'default.py'))
  parser.add_argument('--steps', type=int, default=0,
                      help="T: steps of a 4-member run (0: 1000 for default.py, else the config's "
                           'train.steps)')
  parser.add_argument('--methods', default='', help='comma-separated subset')
  parser.add_argument('--seeds', default='0',
                      help='comma-separated config.seed values; several: mean +- sd per metric')
  parser.add_argument('--validation_size', type=int, default=0,
                      help='data.validation_size (0: 500 for default.py, else 300)')
  parser.add_argument('--out', default='', help='default: benchmarks/results/methods[_CONFIG].json')
  args = parser.parse_args(argv)
  header = harness.run_header()
  base = Path(args.config)
  suffix = '' if base.stem == 'default' else f'_{base.stem}'
  args.out = args.out or str(ROOT / 'benchmarks' / 'results' / f'methods{suffix}.json')
  steps = args.steps or (1000 if base.stem == 'default' else dist_ens.load_config(base).train.steps)
  chosen = methods(steps)
  names = [n for n in args.methods.split(',') if n] or list(chosen)
  unknown = sorted(set(names) - set(chosen))
  if unknown:
    parser.error(f'unknown methods {unknown}; use some of {list(chosen)}')
  args.validation_size = args.validation_size or (500 if base.stem == 'default' else 300)
  seeds = [int(seed) for seed in args.seeds.split(',')]
  runs = [run(base, name, {**chosen[name], 'seed': seed}, args.validation_size) | {'seed': seed}
          for seed in seeds for name in names]
  add_dee(runs)
  rows = [over_seeds([r for r in runs if r['method'] == name]) for name in names]
  print(table(rows))
  out = {**header, 'config': base.name, 'rows': rows, 'markdown': table(rows), 'steps': steps,
         'members': MEMBERS, 'seeds': seeds, 'validation_size': args.validation_size, 'jax': jax.__version__, 'load_average_end': harness.load_average()}
  harness.write_results(args.out, out)
  # The same bars as a run's report (dist_ens.report.scatter), the single model first.
  report_scatter.plot_methods(Path(args.out).parent, {r['method']: r for r in rows},
                            name=Path(args.out).stem)
  print(f'wrote {args.out} and its .png / .svg figure beside it')


if __name__ == '__main__':
  main()
