"""Ensembles fine-tuned from one pretrained ViT on a shifted task, at equal training compute.

  python -m benchmarks.finetune               # T = 110 (10 epochs), ~4 min on 2 shared cores
  python -m benchmarks.finetune --steps 11 --pretrain-steps 55 --out /tmp/ft.json  # a quick look
  python -m benchmarks.finetune --methods deep --full-lr 3e-4 --out /tmp/ft.json    # one method

The recipe of docs/finetune.md (issue 36, item 5), every run on ONE device:

1. Pretrain: configs/digits_vit.py (a 0.14M-parameter ViT, AdamW 1e-3, cosine, 550 steps)
   with num_members=1 on the clean 8x8 digits, evaluated with eval.shift='all' (its
   accuracy under every corruption family, which is how the shift below was chosen).
2. The downstream task is the same digits under a fixed corruption the pretrained model
   never saw: --shift (default contrast:3, the family that costs it the most accuracy among
   those a logistic regression still learns, docs/finetune.md). Fine-tuning trains on
   corrupted train inputs: config.data.augment names this module's function of that
   corruption by import path ('benchmarks.finetune:contrast_3'); a deterministic family is
   then exactly the transform eval.shift applies to the test split (checked below).
3. Fine-tune from the pretrained workdir (config.model.init_from, its member 0) at a budget
   of 4 x T member-steps (a member-step: one update of one member on a batch of 128):

     single     1 member, own='all', 4T steps, lr 1e-3 (a full fine-tune)
     deep       4 members, own='all', T steps, lr 1e-3 (a deep ensemble of full fine-tunes)
     lora       4 members, own='lora' (rank 8 on every kernel but the head), T steps, lr 3e-3
     head       4 members, own='head' (frozen shared backbone), T steps, lr 3e-3
     batchensemble  4 members, own='batchensemble', T steps, lr 1e-3
     scratch    reference: 4 members from random init (no init_from), T steps, lr 1e-3

   Every fine-tune keeps the pretraining recipe otherwise (AdamW, weight decay 0.05, cosine
   decay after a linear warm-up over 10 % of its steps, dropout 0.1, seed 0, batches shared
   by the members); each member's head starts fresh from (seed, member).

Reported per run: accuracy, NLL, ECE of the ensemble on the shifted test split (the run's
final_metrics 'shift' section for --shift), the same on the clean test split, OOD AUROC
by predictive entropy of digits_noise against the SHIFTED test split (the downstream
in-distribution; the run's own 'ood' section, against the clean split, is kept in the JSON
as ood_auroc_clean), parameters trained (the leaves with Adam moments), the train state's
bytes on the device (what `dist-ens plan` counts: params stored once where shared, optimizer
state, counters) and train seconds (the loop with compilation, evaluation left out). The
pretrained model itself, not fine-tuned, is the first row. Writes
benchmarks/results/finetune.json (rows, table, the pretrained model's accuracy per
corruption family, command, machine) and prints a Markdown table.
"""

import argparse
import functools
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

import dist_ens
from benchmarks import harness
from dist_ens import Ensemble, data
from dist_ens.data import corruptions
from dist_ens.eval import ood, ranks

# config.data.augment names 'benchmarks.finetune:...': dist_ens imports it by that path,
# which resolves because `python -m benchmarks.finetune` runs from the repository root.
ROOT = harness.ROOT

BASE = ROOT / 'configs' / 'digits_vit.py'
MEMBERS = 4
SHIFT_SEVERITY = 3


def _corrupt(name: str, severity: int, key: jax.Array, x: jax.Array) -> jax.Array:
  """One example x in [0, 1] under corruption `name` at `severity`, as eval.shift applies it
  (the family's function at that level, clipped to [0, 1]); the digits are not
  standardised, so the model's inputs are the raw pixels."""
  family = corruptions.CORRUPTION_TABLE[name]
  out = family.fn(key, x.astype(jnp.float32), jnp.float32(family.levels[severity - 1]))
  return jnp.clip(out, 0.0, 1.0).astype(x.dtype)


# Augmentations fn(key, x) by import path, 'benchmarks.finetune:NAME': the fine-tuning
# task's inputs. Named module attributes, since config.data.augment takes a path, not
# arguments. Noise families draw fresh noise per step (keys from (seed, member, step,
# example)); deterministic ones are the test split's transform exactly.
contrast_3 = functools.partial(_corrupt, 'contrast', 3)
brightness_3 = functools.partial(_corrupt, 'brightness', 3)
defocus_blur_3 = functools.partial(_corrupt, 'defocus_blur', 3)
gaussian_noise_3 = functools.partial(_corrupt, 'gaussian_noise', 3)
# --shift -> (this module's attribute, the augmentation).
SHIFTS = {'contrast:3': ('contrast_3', contrast_3),
          'brightness:3': ('brightness_3', brightness_3),
          'defocus_blur:3': ('defocus_blur_3', defocus_blur_3),
          'gaussian_noise:3': ('gaussian_noise_3', gaussian_noise_3)}


def methods(steps: int, full: float = 1e-3, adapter: float = 3e-3,
            fresh: float = 1e-3) -> dict[str, dict]:
  """name -> config overrides; each trains MEMBERS * steps member-steps. Learning rates:
  `full` for full fine-tunes, `adapter` for heads and LoRA factors, `fresh` for runs that
  start far from the pretrained function (random init, BatchEnsemble's random signs)."""
  members = {'num_members': MEMBERS, 'train.steps': steps}
  return {
      'single': {'num_members': 1, 'train.steps': MEMBERS * steps,
                 'optim.learning_rate': full},
      'deep': {**members, 'optim.learning_rate': full},
      'lora': {**members, 'ensemble.own': 'lora', 'optim.learning_rate': adapter},
      'head': {**members, 'ensemble.own': 'head', 'optim.learning_rate': adapter},
      'batchensemble': {**members, 'ensemble.own': 'batchensemble',
                        'optim.learning_rate': fresh},
      'scratch': {**members, 'optim.learning_rate': fresh, 'model.init_from': ''},
  }


def _config(overrides: dict):
  """configs/digits_vit.py on a 1 x 1 mesh, OOD set digits_noise, with `overrides`."""
  config = dist_ens.load_config(BASE)
  config.eval.ood_dataset = 'digits_noise'
  config.mesh.member, config.mesh.data = 1, 1
  config.update_from_flattened_dict(overrides)
  steps = config.train.steps
  config.optim.warmup_steps = min(config.optim.warmup_steps, max(1, steps // 10))
  config.train.log_every = min(config.train.log_every, steps)
  config.train.eval_every, config.checkpoint.every = 0, steps
  return config


def _shifted_test(shift: str, seed: int) -> np.ndarray:
  """The test split's inputs under `shift`, as a run with eval.shift=`shift` corrupts them
  (same keys, jitted, its program holding that family's branch alone)."""
  name, severity = corruptions.resolve(shift)[0]
  x = jnp.asarray(data.load_dataset('digits').test.x)
  family = corruptions.corruption_id(name)
  corrupt = jax.jit(functools.partial(corruptions.corrupt_batch, families=(family,)))
  return np.asarray(corrupt(x, jnp.arange(len(x)), family, severity, seed))


def _ood_auroc(workdir: str, shifted_x: np.ndarray) -> float:
  """AUROC of digits_noise against the shifted test split by the ensemble's entropy."""
  ens = Ensemble.load(workdir, devices=jax.devices()[:1])
  entropy = lambda x: ens.predict(x).entropy
  return ranks.auroc(entropy(shifted_x), entropy(ood.digits_noise().x))


def _row(name: str, config, results: dict, workdir: str, shifted_x: np.ndarray,
         shift: str) -> dict:
  family, severity = corruptions.resolve(shift)[0]
  shifted = results['shift']['corruptions'][family][str(severity)]['ensemble']
  trained, size = harness.state_size(config)
  return {
      'method': name, 'members': config.num_members, 'steps': config.train.steps,
      'member_steps': config.num_members * config.train.steps if name != 'pretrained' else 0,
      'own': config.ensemble.own, 'learning_rate': config.optim.learning_rate,
      'accuracy': shifted['accuracy'], 'nll': shifted['nll'], 'ece': shifted['ece'],
      'clean_accuracy': results['ensemble']['accuracy'], 'clean_nll': results['ensemble']['nll'],
      'clean_ece': results['ensemble']['ece'],
      'ood_auroc': _ood_auroc(workdir, shifted_x),
      'ood_auroc_clean': results['ood']['ensemble']['auroc_entropy'],
      'trained_parameters': trained, 'state_bytes': size,
      'train_seconds': results['train_seconds']}


def pretrain(workdir: str, steps: int, shift: str) -> tuple[dict, dict]:
  """The M=1 backbone on clean digits: (its row on the shifted task, its accuracy per
  corruption family at SHIFT_SEVERITY from eval.shift='all')."""
  config = _config({'num_members': 1, 'train.steps': steps})
  config.eval.shift = 'all'
  results = dist_ens.train(config, workdir, devices=jax.devices()[:1])
  families = {name: by_severity[str(SHIFT_SEVERITY)]['ensemble']['accuracy']
              for name, by_severity in results['shift']['corruptions'].items()}
  row = _row('pretrained', config, results, workdir,
             _shifted_test(shift, results['shift']['seed']), shift)
  return row, families


def finetune(name: str, overrides: dict, pretrained: str, shift: str) -> dict:
  config = _config({'model.init_from': pretrained, **overrides})
  config.data.augment = f'benchmarks.finetune:{SHIFTS[shift][0]}'
  config.eval.shift = shift
  workdir = tempfile.mkdtemp(prefix=f'finetune_{name}_')
  results = dist_ens.train(config, workdir, devices=jax.devices()[:1])
  return _row(name, config, results, workdir,
              _shifted_test(shift, results['shift']['seed']), shift)


def check_shift_matches(shift: str) -> bool:
  """Whether the training augmentation of `shift` equals eval.shift's test transform,
  bit for bit, both jitted as in a run (deterministic families; noise draws other keys)."""
  x = jnp.asarray(data.load_dataset('digits').test.x)
  augment = jax.jit(jax.vmap(SHIFTS[shift][1]))
  trained = augment(jax.random.split(jax.random.key(0), len(x)), x)
  return bool(np.array_equal(np.asarray(trained), _shifted_test(shift, 0)))


def table(rows: list[dict]) -> str:
  lines = ['| method | members x steps | lr | accuracy | NLL | ECE | clean accuracy | clean NLL '
           '| OOD AUROC | parameters trained | state KB | train s |', '|---' * 12 + '|']
  for r in rows:
    budget = f"{r['members']} x {r['steps']}" if r['member_steps'] else 'pretrained only'
    lines.append(
        f"| {r['method']} | {budget} | {r['learning_rate']:g} | {r['accuracy']:.3f} | "
        f"{r['nll']:.3f} | {r['ece']:.3f} | {r['clean_accuracy']:.3f} | {r['clean_nll']:.3f} | "
        f"{r['ood_auroc']:.3f} | {r['trained_parameters']:,} | {r['state_bytes'] / 1024:,.0f} | "
        f"{r['train_seconds']:.1f} |")
  return '\n'.join(lines)


def main(argv: list[str] | None = None) -> None:
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument('--steps', type=int, default=110, help='T: steps of a 4-member run')
  parser.add_argument('--pretrain-steps', type=int, default=0,
                      help="the backbone's steps (0: configs/digits_vit.py's 550)")
  parser.add_argument('--shift', default='contrast:3', choices=sorted(SHIFTS))
  parser.add_argument('--full-lr', type=float, default=1e-3, help='single and deep')
  parser.add_argument('--adapter-lr', type=float, default=3e-3, help='lora and head')
  parser.add_argument('--methods', default='', help='comma-separated subset')
  parser.add_argument('--out', default=str(ROOT / 'benchmarks' / 'results' / 'finetune.json'))
  args = parser.parse_args(argv)
  chosen = methods(args.steps, args.full_lr, args.adapter_lr)
  names = [n for n in args.methods.split(',') if n] or list(chosen)
  if unknown := sorted(set(names) - set(chosen)):
    parser.error(f'unknown methods {unknown}; use some of {list(chosen)}')
  header, start = harness.run_header(), time.perf_counter()
  pretrained = tempfile.mkdtemp(prefix='finetune_pretrain_')
  pretrain_steps = args.pretrain_steps or dist_ens.load_config(BASE).train.steps
  row, families = pretrain(pretrained, pretrain_steps, args.shift)
  rows = [row] + [finetune(n, chosen[n], pretrained, args.shift) for n in names]
  print(table(rows))
  out = {**header, 'config': BASE.name, 'pretrain_steps': pretrain_steps, 'shift': args.shift,
         'steps': args.steps, 'members': MEMBERS,
         'shift_matches_training': check_shift_matches(args.shift),
         'pretrained_accuracy_by_family': families, 'rows': rows, 'markdown': table(rows),
         'wall_seconds': time.perf_counter() - start, 'devices': '1 x cpu',
         'jax': jax.__version__, 'load_average_end': harness.load_average()}
  harness.write_results(args.out, out)
  print(f"wrote {args.out} ({out['wall_seconds']:.0f} s)")


if __name__ == '__main__':
  main()
