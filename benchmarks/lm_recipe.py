"""A LoRA ensemble of a small decoder language model against one LoRA fine-tune and an
ensemble of full fine-tunes, at equal compute (issue 47, item 6; docs/pretrained.md).

  python -m benchmarks.lm_recipe                       # tiny GPT-2, ~10 min on 2 shared cores
  python -m benchmarks.lm_recipe --steps 10 --pretrain-steps 20 --out /tmp/lm.json  # a look
  python -m benchmarks.lm_recipe --size gpt2 ...       # GPT-2 small's shape (the GPU stage)

The path, every run on ONE device:

1. A tokenizer: byte-level BPE (GPT-2's kind) with --vocab ids, learnt from the train
   split of tests/data/text (18 clauses of three public-domain novels).
2. A random GPT-2: config.json (GPT2LMHeadModel of --size, output layer untied so that
   each LoRA member owns one), tokenizer.json and model.safetensors of the model's own
   init, written as a Hugging Face folder (benchmarks/lm_checkpoint.py).
3. "Pretraining": no pretrained language model exists on this machine and there is no
   network, so dist_ens trains ONE member from that folder ('hf:' + folder) on the same
   18 train clauses for --pretrain-steps (few: near its lowest test NLL; trained longer
   it memorises them, docs/pretrained.md); its member 0 is written as a second folder,
   the checkpoint every fine-tune starts from. The fine-tunes thus continue on text their
   base has seen: this measures the recipe's mechanics and how to read its metrics, not
   what LoRA gains on a model pretrained on other text.
4. The arms, from that checkpoint (config.model.init_from='hf:...', the output layer
   loaded too: model.init_owned_from_file), at equal compute: M x T member-steps, each
   one member's update on a batch of --batch sequences:
     lora_ensemble  M members, own='lora' (rank --rank on the attention and MLP
                    kernels), T steps
     lora_single    1 member, own='lora', M x T steps (trained M times as long)
     full_ensemble  M members, own='all' (full fine-tunes), T steps
   Each member draws its own batch order (data.member_order='shuffled') and dropout
   (0.1); AdamW without weight decay, cosine decay after a 10 % warm-up; learning rate
   --lora-lr for the LoRA arms, --full-lr for full fine-tunes, not tuned per arm.

Reported per arm (and for the base model itself): per-token test NLL, accuracy and ECE
of the ensemble and the mean member; the ensemble's mean per-token mutual information,
entropy and NLL on the test split and on tests/data/text_ood's test split (technical
prose written for the project: text of another kind), computed from Ensemble.predict;
OOD AUROC by the sequences' mean MI and entropy (the run's own 'ood' section); the
parameters trained and the train state's bytes on the device (as `dist-ens plan`
counts them); the median step time from the run's metrics.jsonl (the first logged
interval, which compiles, left out). Writes benchmarks/results/lm_recipe.json and
prints a Markdown table of the means over --seeds.
"""

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import jax
import numpy as np

import dist_ens
from benchmarks import harness, lm_checkpoint
from dist_ens.config import specs
from dist_ens import Ensemble, data

ROOT = harness.ROOT
CORPUS = ROOT / 'tests' / 'data' / 'text'
OOD = ROOT / 'tests' / 'data' / 'text_ood'
LORA_TARGETS = 'attn/|mlp/'
PAD = -1  # next-token targets past a sequence's end (data.text, token_classification)
LOG_EVERY = 5
PRETRAINED = ('no pretrained language model: the base is this GPT-2 trained by dist_ens from '
              'random init on the same train split for --pretrain-steps (the module doc)')
EQUAL_COMPUTE = ('members x steps x batch sequences, each a forward and backward pass of the '
                 'whole network (a LoRA step too)')


def arms(members: int, steps: int, full_lr: float, lora_lr: float, rank: int
         ) -> dict[str, dict[str, Any]]:
  """name -> config overrides; each arm trains members x steps member-steps."""
  lora = {'ensemble.own': 'lora', 'ensemble.lora_rank': rank,
          'ensemble.lora_targets': LORA_TARGETS, 'optim.learning_rate': lora_lr}
  return {
      'lora_ensemble': {'num_members': members, 'train.steps': steps, **lora},
      'lora_single': {'num_members': 1, 'train.steps': members * steps, **lora},
      'full_ensemble': {'num_members': members, 'train.steps': steps, 'ensemble.own': 'all',
                        'optim.learning_rate': full_lr},
  }


def run_config(checkpoint: Path, overrides: dict[str, Any], batch: int, length: int):
  """configs/default.py as a next-token run on the corpus from 'hf:' + checkpoint, one
  device, tests/data/text_ood as the OOD set, with `overrides`."""
  config = dist_ens.load_config(ROOT / 'configs' / 'default.py')
  config.task = 'token_classification'
  config.model.init_from, config.model.init_owned_from_file = f'hf:{checkpoint}', True
  config.model.dropout = 0.1
  config.data.name, config.data.text_targets = f'text:{CORPUS}', 'next_token'
  config.data.text_length, config.data.batch_size = length, batch
  config.data.member_order = 'shuffled'
  config.eval.ood_dataset, config.eval.joint_tau, config.eval.batch_size = f'text:{OOD}', 0, 64
  config.optim.schedule, config.optim.weight_decay = 'cosine', 0.0
  config.mesh.member, config.mesh.data = 1, 1
  config.writers = ('jsonl',)
  config.update_from_flattened_dict(overrides)
  steps = config.train.steps
  config.optim.warmup_steps = max(1, steps // 10)
  config.train.log_every, config.train.eval_every = min(LOG_EVERY, steps), 0
  config.checkpoint.every = steps
  return config


def token_means(prediction: Any, targets: np.ndarray) -> dict[str, float]:
  """The ensemble's means over the scored tokens (targets != PAD) of a prediction
  (Ensemble.predict's: probs [N, T, C], entropy and mutual_information [N, T])."""
  targets = np.asarray(targets)
  keep = targets != PAD
  taken = np.take_along_axis(np.asarray(prediction.probs, np.float64),
                             np.where(keep, targets, 0)[..., None], axis=-1)[..., 0]
  return {'nll': float(-np.log(np.maximum(taken[keep], 1e-30)).mean()),
          'entropy': float(np.asarray(prediction.entropy, np.float64)[keep].mean()),
          'mutual_information': float(
              np.asarray(prediction.mutual_information, np.float64)[keep].mean()),
          'tokens': int(keep.sum())}


def uncertainty(workdir: str, config) -> dict[str, float]:
  """token_means of the run's ensemble on the test split ('test_...') and the OOD set's
  test split ('ood_...'), both tokenised as the run reads them."""
  ens = Ensemble.load(workdir, devices=jax.devices()[:1])
  spec = specs.data_spec(config)
  out = {}
  for prefix, name in (('test', config.data.name), ('ood', config.eval.ood_dataset)):
    split = data.load_dataset(name, spec).test
    means = token_means(ens.predict(split.x, preprocessed=True), split.y)
    out.update({f'{prefix}_{k}': v for k, v in means.items()})
  return out


def step_seconds(workdir: str, members: int, batch: int) -> float | None:
  """The median seconds per step over the run's logged train intervals but the first
  (which holds the compile): members x batch / member_examples_per_s."""
  lines = (Path(workdir) / 'metrics.jsonl').read_text().splitlines()
  rates = [e['member_examples_per_s'] for e in map(json.loads, lines)
           if e.get('split') == 'train' and 'member_examples_per_s' in e]
  return statistics.median(members * batch / r for r in rates[1:]) if rates[1:] else None


def row(arm: str, seed: int, config, results: dict[str, Any], workdir: str) -> dict[str, Any]:
  """One run's figures (the module doc)."""
  members, ensemble = results['members'], results['ensemble']
  ood = results['ood']['ensemble']
  trained, size = harness.state_size(config)
  mean = lambda k: float(np.mean(members[k]))
  mi = ensemble.get('mutual_information')
  m, steps, batch = config.num_members, config.train.steps, config.data.batch_size
  return {
      'arm': arm, 'seed': seed, 'members': m, 'steps': steps, 'batch': batch,
      'member_steps': m * steps, 'own': config.ensemble.own,
      'learning_rate': config.optim.learning_rate,
      'nll': float(ensemble['nll']), 'nll_members': mean('nll'),
      'accuracy': float(ensemble['accuracy']), 'accuracy_members': mean('accuracy'),
      'ece': float(ensemble['ece']), 'ece_members': mean('ece'),
      'test_mutual_information_trainer': None if mi is None else float(mi),
      **uncertainty(workdir, config),
      'ood_auroc_mi': float(ood['auroc_mi']), 'ood_auroc_entropy': float(ood['auroc_entropy']),
      'trained_parameters': trained, 'state_bytes': size,
      'step_seconds': step_seconds(workdir, m, batch),
      'train_seconds': float(results['train_seconds']), 'load_average': harness.load_average()}


def train(arm: str, seed: int, config, root: Path) -> tuple[dict[str, Any], str]:
  """Trains `config` with `seed` in a new workdir under root: (its row, the workdir)."""
  config.seed = seed
  workdir = tempfile.mkdtemp(prefix=f'{arm}_{seed}_', dir=root)
  results = dist_ens.train(config, workdir, devices=jax.devices()[:1])
  return row(arm, seed, config, results, workdir), workdir


def pretrain(root: Path, args: argparse.Namespace) -> tuple[Path, dict[str, Any]]:
  """Steps 1-3 of the module doc: (the pretrained checkpoint folder, the base's row)."""
  lines = (CORPUS / 'train.jsonl').read_text().splitlines()
  texts = [json.loads(line)['text'] for line in lines]
  tokenizer = lm_checkpoint.train_tokenizer(texts, args.vocab)
  fresh = lm_checkpoint.write_checkpoint(
      root / 'random', lm_checkpoint.gpt2_config(args.size, tokenizer), tokenizer)
  overrides = {'num_members': 1, 'train.steps': args.pretrain_steps,
               'optim.learning_rate': args.pretrain_lr}
  base, workdir = train('base', 0, run_config(fresh, overrides, args.batch, args.length), root)
  return lm_checkpoint.checkpoint_from_workdir(workdir, fresh, root / 'pretrained'), base


SPREAD = ('nll', 'ece', 'test_mutual_information', 'ood_mutual_information')


def summarize(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
  """One row per arm: the mean over its seeds of every number, and for SPREAD the half
  range over seeds ('..._spread'; 0 with one seed)."""
  out = []
  for arm in dict.fromkeys(r['arm'] for r in rows):
    runs = [r for r in rows if r['arm'] == arm]
    mean = {k: (float(np.mean([r[k] for r in runs])) if isinstance(v, float) else v)
            for k, v in runs[0].items() if k != 'seed'}
    spread = {f'{k}_spread': (max(r[k] for r in runs) - min(r[k] for r in runs)) / 2
              for k in SPREAD}
    out.append({**mean, **spread, 'seeds': len(runs)})
  return out


def _pm(r: dict[str, Any], key: str, digits: int = 3) -> str:
  """The mean, and ± the half range over seeds where there are several."""
  spread = r.get(f'{key}_spread')
  return f'{r[key]:.{digits}f}' + (f' ±{spread:.{digits}f}' if r['seeds'] > 1 else '')


def table(summary: list[dict[str, Any]]) -> str:
  """The summary as a Markdown table (the module doc says what each column is)."""
  lines = ['| arm | members x steps | trained params | state KB / device | test NLL: ens. '
           '(members) | accuracy: ens. (members) | ECE: ens. (members) | MI test | MI OOD '
           '| NLL OOD | OOD AUROC by MI | step ms |', '|---' * 12 + '|']
  for r in summary:
    lines.append(
        f"| {r['arm']} | {r['members']} x {r['steps']} | {r['trained_parameters']:,} | "
        f"{r['state_bytes'] / 1024:,.0f} | {_pm(r, 'nll')} ({r['nll_members']:.3f}) | "
        f"{r['accuracy']:.3f} ({r['accuracy_members']:.3f}) | {_pm(r, 'ece')} "
        f"({r['ece_members']:.3f}) | {_pm(r, 'test_mutual_information', 4)} | "
        f"{_pm(r, 'ood_mutual_information', 4)} | {r['ood_nll']:.3f} | {r['ood_auroc_mi']:.3f} | "
        f"{1e3 * (r['step_seconds'] or float('nan')):.1f} |")
  return '\n'.join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument('--size', default='tiny', choices=sorted(lm_checkpoint.SIZES))
  parser.add_argument('--vocab', type=int, default=384, help="the tokenizer's ids")
  parser.add_argument('--length', type=int, default=64, help='data.text_length')
  parser.add_argument('--batch', type=int, default=8, help="each member's sequences a step")
  parser.add_argument('--members', type=int, default=4, help='M')
  parser.add_argument('--steps', type=int, default=30, help="T: an M-member arm's steps")
  parser.add_argument('--pretrain-steps', type=int, default=60)
  parser.add_argument('--pretrain-lr', type=float, default=1e-3)
  parser.add_argument('--full-lr', type=float, default=1e-4)
  parser.add_argument('--lora-lr', type=float, default=1e-3)
  parser.add_argument('--rank', type=int, default=8)
  parser.add_argument('--seeds', type=int, default=2, help='seeds per arm (one base)')
  parser.add_argument('--workdir', default='', help="the runs' folder (default: a new temp)")
  parser.add_argument('--out', default=str(ROOT / 'benchmarks' / 'results' / 'lm_recipe.json'))
  return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
  args = parse_args(argv)
  header, start = harness.run_header(), time.perf_counter()
  root = Path(args.workdir or tempfile.mkdtemp(prefix='lm_recipe_'))
  root.mkdir(parents=True, exist_ok=True)
  # The seeds' runs compile the same programs: read them from a cache (step times leave
  # the compile out either way).
  jax.config.update('jax_compilation_cache_dir', str(root / 'jax_cache'))
  pretrained, base = pretrain(root, args)
  chosen = arms(args.members, args.steps, args.full_lr, args.lora_lr, args.rank)
  rows = [base] + [train(arm, seed, run_config(pretrained, overrides, args.batch,
                                               args.length), root)[0]
                   for seed in range(args.seeds) for arm, overrides in chosen.items()]
  summary = summarize(rows)
  print(table(summary))
  out = harness.write_results(args.out, {
      **header, 'settings': vars(args), 'device': jax.devices()[0].device_kind,
      'pretrained': PRETRAINED, 'equal_compute': EQUAL_COMPUTE,
      'jax': jax.__version__, 'workdir': str(root), 'rows': rows, 'summary': summary,
      'markdown': table(summary), 'wall_seconds': time.perf_counter() - start,
      'load_average_end': harness.load_average()})
  print(f'wrote {out} ({time.perf_counter() - start:.0f} s)')


if __name__ == '__main__':
  main()
