"""The Neural Testbed (Osband et al. 2022) with dist_ens agents: joint KL at tau 1 and 10.

  python -m benchmarks.testbed [--quick] [--separate 2] [--out benchmarks/results/testbed.json]

Problems (shared/references/neural_testbed.md has the facts): a random generative MLP
Linear(50) -> ReLU -> Linear(50) -> ReLU -> Linear(2) (weights truncated normal with stddev
1/sqrt(fan_in), the first bias N(0, 1/sqrt(d)) as its stddev, the others zero) whose logits
are divided by a temperature rho; inputs x ~ N(0, I_d); n = ratio * d training labels drawn
from softmax(logits / rho). The full grid: d in {2, 10, 100}, ratio in {1, 10, 100, 1000},
rho in {0.01, 0.1, 0.5}, 5 seeds (180 problems); --quick: see QUICK below.

Score per problem and tau: the mean over `--test_seeds` dyadic batches (kappa = 2 fresh
anchors, tau positions each an anchor picked uniformly, a label per position drawn from the
true model) of sum_t log p*(y_t | x_t) - log (1/M) sum_m prod_t p_m(y_t | x_t), M the
agent's samples of its predictive; divided by the same figure for a uniform predictor;
averaged over problems (mean and standard error).

Agents, the Testbed's recipes as far as dist_ens has them (Adam 1e-3, batch min(100, n),
`--steps` steps, an L2 term in the loss, c * sum of squared params, as coupled weight decay
2c before Adam; c = sqrt(rho) d / n, the Testbed's 'adaptive' scale, for all but the
epinet's 0.2 (d / n)^0.7); init std 1/sqrt(fan_in) as Haiku's:
  mlp        one MLP (50, 50)
  ensemble   `--members` MLPs (50, 50) (method 'deep', shared batches)
  ensemble+  the same with a frozen prior network of the same shape, scale 3 / sqrt(rho)
             (method 'prior')
  dropout    one MLP (100, 100), dropout 0.1; one predictive sample = one dropout mask,
             the same for every input
  epinet     one MLP (50, 50) with an epinet (15, 15), index_dim 8, 8 index draws per
             example per step, a prior epinet of the same shape scaled 0.3 / rho (method
             'epinet'); one predictive sample = one index z ~ N(0, I_8)
  laplace    one MLP (50, 50), then a last-layer Laplace (eval.laplace='last_layer_full',
             prior precision by marginal likelihood); one sample = one last-layer draw
`--samples` predictive samples for the last three (the members for the ensembles).

One program per agent and (d, ratio, rho): the problems' 5 seeds share shapes, so their
training sets are concatenated and data.member_split='blocks:S' gives block s (seed s) its
own members ([s K, (s + 1) K), K the agent's members per problem). `--separate N` also
trains N problems per agent as their own programs, to time a job per problem.
"""

import argparse
import itertools
import json
import math
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

import dist_ens
from benchmarks import harness
from dist_ens import data
from dist_ens.eval import joint

ROOT = Path(__file__).resolve().parents[1]
HIDDEN = 50
CLASSES = 2
TAUS = (1, 10)
# The leaderboard's grid (the full sweep: 3 x 4 x 3 x 5 seeds = 180 problems).
DIMS, RATIOS, TEMPERATURES, SEEDS = (2, 10, 100), (1, 10, 100, 1000), (0.01, 0.1, 0.5), 5
# --quick, chosen before any result was seen (a 2-core CPU budget): d in {2, 10}, ratio
# in {10, 100}, every rho, 5 seeds = 60 problems, 10 members, 100 predictive samples,
# 1000 test batches.
QUICK_DIMS, QUICK_RATIOS, QUICK_MEMBERS, QUICK_SAMPLES = (2, 10), (10, 100), 10, 100


class Problem(NamedTuple):
  """One synthetic problem: the generative MLP's weights and its training set."""
  d: int
  ratio: int
  rho: float
  seed: int
  weights: tuple[tuple[np.ndarray, np.ndarray], ...]  # ((W, b) per layer), float64

  def log_probs(self, x: np.ndarray) -> np.ndarray:
    """[N, 2] float64 log p*(y | x) of the true model."""
    h = np.asarray(x, np.float64)
    for i, (w, b) in enumerate(self.weights):
      h = h @ w + b
      if i < len(self.weights) - 1:
        h = np.maximum(h, 0.0)
    z = h / self.rho
    return z - np.logaddexp.reduce(z, axis=-1, keepdims=True)


def _truncated_normal(rng: np.random.Generator, shape: tuple[int, ...], std: float) -> np.ndarray:
  """Haiku's default initialiser: N(0, 1) truncated to [-2, 2], scaled so its stddev is
  `std` (the truncation's own stddev is 0.8796)."""
  out = rng.standard_normal(shape)
  bad = np.abs(out) > 2
  while bad.any():
    out[bad] = rng.standard_normal(bad.sum())
    bad = np.abs(out) > 2
  return out * std / 0.87962566103423978


def make_problem(d: int, ratio: int, rho: float, seed: int) -> Problem:
  """The problem (d, n = ratio * d, rho, seed); depends only on its arguments."""
  rng = np.random.default_rng([d, ratio, int(round(rho * 1000)), seed])
  sizes = (d, HIDDEN, HIDDEN, CLASSES)
  weights = []
  for i, (fan_in, fan_out) in enumerate(zip(sizes[:-1], sizes[1:])):
    w = _truncated_normal(rng, (fan_in, fan_out), 1 / np.sqrt(fan_in))
    b = rng.normal(0.0, 1 / np.sqrt(d), fan_out) if i == 0 else np.zeros(fan_out)
    weights.append((w, b))
  return Problem(d, ratio, rho, seed, tuple(weights))


def sample(problem: Problem, n: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
  """n inputs x ~ N(0, I_d) and labels drawn from the true model: float32 [n, d], int32 [n]."""
  x = rng.standard_normal((n, problem.d))
  p = np.exp(problem.log_probs(x))
  y = (rng.random(n) < p[:, 1]).astype(np.int32)
  return x.astype(np.float32), y


class DyadicTest(NamedTuple):
  """The test of one problem at one tau: S batches of kappa anchors and tau positions."""
  anchors: np.ndarray  # float32 [S, kappa, d]
  positions: np.ndarray  # int [S, tau]: which anchor each position shows
  labels: np.ndarray  # int [S, tau]: drawn from the true model per position
  true_joint: np.ndarray  # float64 [S]: sum_t log p*(y_t | x_t)


def dyadic_test(problem: Problem, tau: int, num_batches: int, seed: int = 0) -> DyadicTest:
  """The Testbed's dyadic test batches with fresh inputs and per-position labels."""
  rng = np.random.default_rng([problem.d, problem.ratio, int(round(problem.rho * 1000)),
                               problem.seed, tau, seed, 1])
  anchors = rng.standard_normal((num_batches, joint.KAPPA, problem.d))
  positions = rng.integers(joint.KAPPA, size=(num_batches, tau))
  log_p = problem.log_probs(anchors.reshape(-1, problem.d)).reshape(num_batches, joint.KAPPA,
                                                                    CLASSES)
  p1 = np.exp(np.take_along_axis(log_p[..., 1], positions, axis=1))  # [S, tau]
  labels = (rng.random((num_batches, tau)) < p1).astype(np.int64)
  true = np.take_along_axis(log_p, positions[..., None], axis=1)  # [S, tau, 2]
  true = np.take_along_axis(true, labels[..., None], axis=-1)[..., 0]
  return DyadicTest(anchors.astype(np.float32), positions, labels, true.sum(-1))


def normalised_kl(member_log_probs: np.ndarray, test: DyadicTest) -> dict[str, float]:
  """The agent's KL and the uniform agent's for one problem and tau, and their ratio.

  member_log_probs: [M, S, kappa, 2] the agent's log-probabilities at the anchors."""
  ll = np.take_along_axis(member_log_probs, test.positions[None, ..., None], axis=2)  # [M,S,tau,2]
  ll = np.take_along_axis(ll, test.labels[None, ..., None], axis=-1)[..., 0]  # [M, S, tau]
  agent = joint.joint_nll(ll).ensemble  # mean of -log (1/M) sum_m prod_t p_m
  tau = test.positions.shape[1]
  true_nll = -float(test.true_joint.mean())
  kl, uniform = agent - true_nll, tau * np.log(CLASSES) - true_nll
  return {'kl': kl, 'uniform_kl': uniform, 'normalised_kl': kl / uniform}


class Agent(NamedTuple):
  """How one agent trains (its config fields beyond the shared ones) and samples."""
  members: Callable[[argparse.Namespace], int]  # K per problem
  fields: Callable[[float], dict]  # rho -> dotted config overrides
  l2: Callable[[int, int, float], float]  # (d, n, rho) -> c of the loss' c * sum w^2
  sampler: str  # 'members', 'dropout', 'epinet' or 'laplace'


def _adaptive_l2(d: int, n: int, rho: float) -> float:
  return math.sqrt(rho) * d / n


AGENTS = {
    'mlp': Agent(lambda a: 1, lambda rho: {}, _adaptive_l2, 'members'),
    'ensemble': Agent(lambda a: a.members, lambda rho: {}, _adaptive_l2, 'members'),
    'ensemble+': Agent(lambda a: a.members, lambda rho: {
        'ensemble.method': 'prior', 'ensemble.prior.scale': 3 / math.sqrt(rho)},
                       _adaptive_l2, 'members'),
    'dropout': Agent(lambda a: 1, lambda rho: {'model.dropout': 0.1,
                                               'model.widths': (100, 100)},
                     _adaptive_l2, 'dropout'),
    'epinet': Agent(lambda a: 1, lambda rho: {
        'ensemble.method': 'epinet', 'ensemble.epinet.index_dim': 8,
        'ensemble.epinet.widths': (15, 15), 'ensemble.epinet.samples': 8,
        'ensemble.epinet.eval_samples': 1, 'ensemble.epinet.prior_scale': 0.3 / rho},
                    lambda d, n, rho: 0.2 * (d / n) ** 0.7, 'epinet'),
    'laplace': Agent(lambda a: 1, lambda rho: {'eval.laplace': 'last_layer_full'},
                     _adaptive_l2, 'laplace'),
}


def agent_config(agent: Agent, rho: float, n: int, problems: int, args):
  """One program of `problems` problems of n training examples each (blocks of the pool)."""
  config = dist_ens.load_config(ROOT / 'configs' / 'default.py')
  config.num_members = agent.members(args) * problems
  config.model.name, config.model.widths = 'mlp', (HIDDEN, HIDDEN)
  config.model.init_scale = 1 / math.sqrt(2)  # He-normal's sqrt(2 / fan_in) -> 1/sqrt(fan_in)
  config.data.batch_size, config.data.prefetch = min(100, n), 0
  config.data.member_split = f'blocks:{problems}' if problems > 1 else ''
  config.train.steps, config.train.log_every, config.train.eval_every = args.steps, args.steps, 0
  config.checkpoint.every = args.steps
  config.eval.joint_tau = 0  # scored here, against the true model
  config.eval.laplace_samples = args.samples
  config.writers = ()
  for dotted, value in agent.fields(rho).items():
    node, *path = config, *dotted.split('.')
    for key in path[:-1]:
      node = node[key]
    node[path[-1]] = value
  return config


def training_set(problem: Problem) -> tuple[np.ndarray, np.ndarray]:
  """The problem's n = ratio * d training examples (from its own seed stream)."""
  rng = np.random.default_rng([problem.d, problem.ratio, int(round(problem.rho * 1000)),
                               problem.seed, 0])
  return sample(problem, problem.ratio * problem.d, rng)


def train_group(name: str, problems: list[Problem], args, workdir: Path):
  """Trains agent `name` on `problems` (one d, ratio, rho) as ONE dist_ens program;
  returns the loaded Ensemble and the training seconds (compilation included)."""
  agent, first = AGENTS[name], problems[0]
  n = first.ratio * first.d
  sets = [training_set(p) for p in problems]
  x, y = np.concatenate([s[0] for s in sets]), np.concatenate([s[1] for s in sets])
  # The run's own test split only feeds its marginal metrics; the score is ours.
  dataset = data.from_arrays(x, y, x[:100], y[:100], name='testbed', num_classes=CLASSES)
  optimizer = optax.chain(optax.add_decayed_weights(2 * agent.l2(first.d, n, first.rho)),
                          optax.adam(1e-3))
  shutil.rmtree(workdir, ignore_errors=True)
  start = time.perf_counter()
  dist_ens.train(agent_config(agent, first.rho, n, len(problems), args), str(workdir),
                 dataset=dataset, optimizer=optimizer)
  seconds = time.perf_counter() - start
  return dist_ens.Ensemble.load(workdir), seconds


def _log(probs: np.ndarray) -> np.ndarray:
  return np.log(np.maximum(np.asarray(probs, np.float64), 1e-300))


def _epinet_draws(ens, member: int, x: np.ndarray, samples: int, key: jax.Array):
  """[S, N, C] probabilities of S index draws z ~ N(0, I_k) of one epinet member: each z
  one function (the member's evaluation indices replaced by that one z)."""
  params, state = ens.member(member), ens.member_state(member)
  z = jax.random.normal(key, (samples, state.indices.shape[-1]), jnp.float32)

  def one(z):
    logits, _ = ens.model.apply(params, state._replace(indices=z[None]), x, train=False)
    return jax.nn.softmax(logits, -1)
  return np.asarray(jax.jit(jax.vmap(one))(z))


def _dropout_draws(ens, member: int, x: np.ndarray, samples: int, key: jax.Array):
  """[S, N, C] probabilities of S dropout masks of one member: each key one function, the
  same mask for every input (each input runs alone under the key)."""
  params, state = ens.member(member), ens.member_state(member)

  def one(key):
    each = lambda xi: ens.model.apply(params, state, xi[None], train=False, rng=key)[0][0]
    return jax.nn.softmax(jax.vmap(each)(x), -1)
  return np.asarray(jax.jit(jax.vmap(one))(jax.random.split(key, samples)))


def group_log_probs(ens, agent: Agent, k: int, rows: list[np.ndarray], args,
                    seed: int) -> list[np.ndarray]:
  """Per problem s (members [s k, (s + 1) k), inputs rows[s]): [samples, N, C] float64
  log-probabilities of the agent's predictive samples."""
  if agent.sampler in ('members', 'laplace'):
    x = np.concatenate(rows)
    probs = (ens.predict(x).member_probs if agent.sampler == 'members'
             else ens.laplace_samples(x))  # [M, N, C] / [M, S, N, C]
    out, start = [], 0
    for s, r in enumerate(rows):
      p = np.asarray(probs[s * k:(s + 1) * k, ..., start:start + len(r), :])
      out.append(_log(p.reshape(-1, len(r), CLASSES)))
      start += len(r)
    return out
  draw = _dropout_draws if agent.sampler == 'dropout' else _epinet_draws
  keys = jax.random.split(jax.random.key(seed), len(rows))
  return [_log(draw(ens, s, r, args.samples, keys[s])) for s, r in enumerate(rows)]


def run_group(name: str, problems: list[Problem], args, workdir: Path) -> dict:
  """Trains agent `name` on `problems` as one program and scores every problem at every
  tau: {'agent', d, ratio, rho, problems, members, train_seconds, score_seconds, rows}."""
  ens, train_seconds = train_group(name, problems, args, workdir)
  start = time.perf_counter()
  tests = [{tau: dyadic_test(p, tau, args.test_seeds) for tau in TAUS} for p in problems]
  rows = [np.concatenate([t[tau].anchors.reshape(-1, p.d) for tau in TAUS])
          for p, t in zip(problems, tests)]
  first = problems[0]
  log_probs = group_log_probs(ens, AGENTS[name], AGENTS[name].members(args), rows, args,
                              seed=first.d * 7919 + first.ratio * 31 + int(first.rho * 1000))
  scored = []
  for p, t, lp in zip(problems, tests, log_probs):
    row, at = {'d': p.d, 'ratio': p.ratio, 'n': p.ratio * p.d, 'rho': p.rho, 'seed': p.seed}, 0
    for tau in TAUS:
      shape = t[tau].anchors.shape[:2]
      size = shape[0] * shape[1]
      row[f'tau_{tau}'] = normalised_kl(lp[:, at:at + size].reshape(-1, *shape, CLASSES), t[tau])
      at += size
    scored.append(row)
  shutil.rmtree(workdir, ignore_errors=True)
  out = {'agent': name, 'd': first.d, 'ratio': first.ratio, 'rho': first.rho,
         'problems': len(problems), 'members': AGENTS[name].members(args) * len(problems),
         'train_seconds': train_seconds, 'score_seconds': time.perf_counter() - start,
         'rows': scored}
  print(f"{name:9s} d={first.d} n={first.ratio * first.d} rho={first.rho} x{len(problems)}: "
        f"train {train_seconds:.1f} s; mean normalised KL tau 1 "
        f"{np.mean([r['tau_1']['normalised_kl'] for r in scored]):.3f}, tau 10 "
        f"{np.mean([r['tau_10']['normalised_kl'] for r in scored]):.3f}", flush=True)
  return out


def summarise(groups: list[dict]) -> dict:
  """Per agent and tau over its problems: the mean normalised KL and its standard error
  (the Testbed's figure), and the mean KL over the mean uniform KL (less swayed by the
  problems whose uniform KL is tiny, e.g. rho = 0.5 where p* is near 1/2)."""
  out = {}
  for name in dict.fromkeys(g['agent'] for g in groups):
    rows = [r for g in groups if g['agent'] == name for r in g['rows']]
    for tau in TAUS:
      pick = lambda field: np.array([r[f'tau_{tau}'][field] for r in rows])
      ratio = pick('normalised_kl')
      out.setdefault(name, {})[f'tau_{tau}'] = {
          'mean': float(ratio.mean()), 'se': float(ratio.std(ddof=1) / np.sqrt(len(ratio))),
          'median': float(np.median(ratio)),
          'mean_kl_over_mean_uniform_kl': float(pick('kl').mean() / pick('uniform_kl').mean()),
          'problems': len(rows)}
  return out


def paired(groups: list[dict], baseline: str = 'ensemble') -> dict:
  """Per agent and tau: the mean over problems of (agent's normalised KL - the
  baseline's on the same problem) and its standard error: the agents share problems, so
  the paired difference is what tells two agents apart."""
  by = {}
  for g in groups:
    for r in g['rows']:
      by.setdefault(g['agent'], {})[(r['d'], r['ratio'], r['rho'], r['seed'])] = r
  if baseline not in by:
    return {}
  out = {}
  for name, rows in by.items():
    keys = sorted(rows.keys() & by[baseline].keys())
    for tau in TAUS:
      diff = np.array([rows[k][f'tau_{tau}']['normalised_kl']
                       - by[baseline][k][f'tau_{tau}']['normalised_kl'] for k in keys])
      out.setdefault(name, {})[f'tau_{tau}'] = {
          'mean': float(diff.mean()), 'se': float(diff.std(ddof=1) / np.sqrt(len(diff))),
          'problems': len(diff)}
  return {'baseline': baseline, 'differences': out}


def grid(args) -> list[list[Problem]]:
  """The sweep's groups: per (d, ratio, rho), its seeds' problems."""
  dims, ratios = (QUICK_DIMS, QUICK_RATIOS) if args.quick else (DIMS, RATIOS)
  return [[make_problem(d, ratio, rho, seed) for seed in range(SEEDS)]
          for d, ratio, rho in itertools.product(dims, ratios, TEMPERATURES)]


def separate_jobs(groups: list[list[Problem]], args, workroot: Path) -> list[dict]:
  """`args.separate` problems per agent (seed 0 of groups spread over the sweep), each
  trained and scored as its own program: the per-job cost a sweep of jobs would pay."""
  picks = np.linspace(0, len(groups) - 1, args.separate).round().astype(int)
  jobs = []
  for name in args.agents:
    for i in picks:
      start = time.perf_counter()
      job = run_group(name, groups[i][:1], args, workroot / 'separate')
      jobs.append({**job, 'job_seconds': time.perf_counter() - start})
  return jobs


def timing(sweep: list[dict], sweep_seconds: float, jobs: list[dict]) -> dict:
  """The sweep's wall time beside separate jobs': per agent, a job's mean wall time
  (train + score) x the sweep's problems, an extrapolation from `jobs`."""
  per_agent = {}
  for name in dict.fromkeys(g['agent'] for g in sweep):
    mine = [g for g in sweep if g['agent'] == name]
    own = [j['job_seconds'] for j in jobs if j['agent'] == name]
    problems = sum(g['problems'] for g in mine)
    per_agent[name] = {
        'programs': len(mine), 'problems': problems,
        'train_seconds': sum(g['train_seconds'] for g in mine),
        'wall_seconds': sum(g['train_seconds'] + g['score_seconds'] for g in mine),
        'separate_job_seconds_mean': float(np.mean(own)) if own else None,
        'separate_jobs_measured': len(own),
        'separate_jobs_extrapolated_seconds': float(np.mean(own)) * problems if own else None}
  extrapolated = [a['separate_jobs_extrapolated_seconds'] for a in per_agent.values()]
  total = sum(extrapolated) if all(e is not None for e in extrapolated) else None
  return {'sweep_wall_seconds': sweep_seconds, 'per_agent': per_agent,
          'separate_jobs_extrapolated_seconds': total,
          'speedup_over_separate_jobs': total / sweep_seconds if total else None}


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--quick', action='store_true', help='the QUICK subset (60 problems)')
  parser.add_argument('--agents', nargs='+', default=list(AGENTS), choices=list(AGENTS))
  parser.add_argument('--members', type=int, default=None, help='ensembles: 100 (quick 10)')
  parser.add_argument('--samples', type=int, default=None,
                      help='predictive samples of dropout, epinet, Laplace: 1000 (quick 100)')
  parser.add_argument('--steps', type=int, default=1000)
  parser.add_argument('--test_seeds', type=int, default=1000)
  parser.add_argument('--separate', type=int, default=2,
                      help='problems per agent also run as their own programs (timing)')
  parser.add_argument('--out', default=str(ROOT / 'benchmarks' / 'results' / 'testbed.json'))
  parser.add_argument('--resummarise', action='store_true',
                      help="recompute --out's summaries from its per-problem rows, no training")
  args = parser.parse_args()
  if args.resummarise:
    resummarise(Path(args.out))
    return
  args.members = args.members or (QUICK_MEMBERS if args.quick else 100)
  args.samples = args.samples or (QUICK_SAMPLES if args.quick else 1000)
  header, groups = harness.run_header(), grid(args)
  sweep, jobs, start = [], [], time.perf_counter()
  with tempfile.TemporaryDirectory() as workroot:
    # Group by group, every agent: a run cut short still compares agents on equal problems.
    for problems, name in itertools.product(groups, args.agents):
      sweep.append(run_group(name, problems, args, Path(workroot) / 'group'))
      write(args, header, groups, sweep, time.perf_counter() - start, jobs, partial=True)
    sweep_seconds = time.perf_counter() - start
    if args.separate:
      jobs = separate_jobs(groups, args, Path(workroot))
  print_table(write(args, header, groups, sweep, sweep_seconds, jobs, partial=False))


def write(args, header: dict, groups: list, sweep: list[dict], sweep_seconds: float,
          jobs: list[dict], partial: bool) -> dict:
  """The results file (rewritten after every program: `partial` until the end)."""
  out = {**header, 'partial': partial, 'args': vars(args),
         'problems': sum(map(len, groups)),
         'problems_scored': sum(g['problems'] for g in sweep if g['agent'] == args.agents[0]),
         'summary': summarise(sweep), 'paired_with_ensemble': paired(sweep),
         'timing': timing(sweep, sweep_seconds, jobs),
         'separate_jobs_summary': summarise(jobs) if jobs else None,
         'load_average_end': harness.load_average(), 'groups': sweep, 'separate_jobs': jobs}
  harness.write_results(args.out, out)
  return out


def resummarise(path: Path) -> None:
  """Rewrites a results file's summaries from its own per-problem rows (the run's
  figures; a summary added after the run, without training again)."""
  out = json.loads(path.read_text())
  out.update(summary=summarise(out['groups']), paired_with_ensemble=paired(out['groups']),
             resummarised=harness.run_header())
  harness.write_results(path, out)
  print_table(out)


def print_table(out: dict) -> None:
  """The agents x tau table (mean normalised KL +- s.e.) and the timing, as markdown."""
  diffs = out.get('paired_with_ensemble', {}).get('differences', {})
  print('| agent | tau = 1 | tau = 10 | minus ensemble, tau = 1 | tau = 10 |\n|---|---|---|---|---|')
  for name, by_tau in out['summary'].items():
    cells = [by_tau[f'tau_{t}'] for t in TAUS] + [diffs[name][f'tau_{t}'] for t in TAUS
                                                  if name in diffs]
    print(f'| {name} | ' + ' | '.join(f"{c['mean']:.3f} ± {c['se']:.3f}" for c in cells) + ' |')
  t = out['timing']
  print(f"sweep {t['sweep_wall_seconds']:.0f} s; separate jobs (extrapolated) "
        f"{t['separate_jobs_extrapolated_seconds'] or float('nan'):.0f} s")


if __name__ == '__main__':
  main()
