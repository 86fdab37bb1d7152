"""Distillation on MNIST-1D (config.distill; docs/ensemble_methods.md, "Distillation"): an
ensemble trained once, then distilled into a 'same' student and, by rerunning the
finished run's command, into a 'hydra' student; the 'distill' sections side by side.

  python -m benchmarks.distill                         # 4 members, T = 1000, 2000 student steps
  python -m benchmarks.distill --steps 200 --distill_steps 300   # a quick look

configs/default.py (MLP 40-256-256-10, Adam 1e-3, batch 128, seed 0), --members members on
this machine's devices; students at T = --temperature, Adam --lr. Writes
benchmarks/results/distill.json (--out: another name).
"""

import argparse
import platform
import tempfile
import time
from pathlib import Path

import dist_ens
from benchmarks import harness

ROOT = Path(__file__).resolve().parents[1]
KEYS = ('nll_gain_kept', 'accuracy', 'nll', 'ece', 'nll_member_mean', 'nll_ensemble',
        'loss_first', 'loss_last', 'cost')


def _config(args, student):
  config = dist_ens.load_config(ROOT / 'configs' / 'default.py')
  config.num_members, config.train.steps = args.members, args.steps
  config.train.log_every, config.checkpoint.every = args.steps, args.steps
  config.distill.student, config.distill.steps = student, args.distill_steps
  config.distill.temperature, config.distill.learning_rate = args.temperature, args.lr
  return config


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--members', type=int, default=4)
  parser.add_argument('--steps', type=int, default=1000)
  parser.add_argument('--distill_steps', type=int, default=2000)
  parser.add_argument('--temperature', type=float, default=2.0)
  parser.add_argument('--lr', type=float, default=1e-3)
  parser.add_argument('--out', default='distill.json', help='under benchmarks/results/')
  args = parser.parse_args()
  # platform.platform(): the OS and libc, which this file recorded before the header did.
  out = {**harness.run_header(), 'args': vars(args), 'platform': platform.platform(),
         'students': {}}
  with tempfile.TemporaryDirectory() as workdir:
    for student in ('same', 'hydra'):  # The second distils the finished run again.
      start = time.perf_counter()
      final = dist_ens.train(_config(args, student), workdir)
      d = final['distill']
      out['students'][student] = {**{k: d[k] for k in KEYS},
                                  'seconds_with_evaluation': time.perf_counter() - start}
      print(f"{student}: keeps {d['nll_gain_kept']:.3f} of the NLL gain; NLL {d['nll']:.4f} "
            f"(member mean {d['nll_member_mean']:.4f}, ensemble {d['nll_ensemble']:.4f}); "
            f"accuracy {d['accuracy']:.4f}; ECE {d['ece']:.4f}; "
            f"FLOPs {d['cost']['flops_ratio']:.3f} and params {d['cost']['params_ratio']:.3f} "
            "of the ensemble's")
  path = harness.write_results(ROOT / 'benchmarks' / 'results' / args.out,
                               {**out, 'load_average_end': harness.load_average()})
  print('wrote', path)


if __name__ == '__main__':
  main()
