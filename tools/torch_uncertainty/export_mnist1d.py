"""Writes the MNIST-1D arrays benchmarks/methods.py trains and scores on, for the torch side.

Run in dist_ens's venv (the torch venv cannot import dist_ens, and needs not):

  .venv/bin/python tools/torch_uncertainty/export_mnist1d.py /tmp/mnist1d_methods.npz

x_train/y_train: MNIST-1D's 4,000 training examples less the 500 of the validation split
(data.split_validation, the split every method of benchmarks/methods.py trains without);
x_val/y_val those 500; x_test/y_test the 1,000 test examples. Inputs as dist_ens reads
them: float32 [N, 40] (the trailing channel axis dropped: the MLP flattens it), no
standardisation (configs/default.py sets no data.mean / data.std).
"""

import argparse
from pathlib import Path

import numpy as np

import dist_ens  # installed in dist_ens's venv (pip install -e .)
from dist_ens import data
from dist_ens.config import specs

ROOT = Path(__file__).resolve().parents[2]
VALIDATION_SIZE = 500  # benchmarks/methods.py's for configs/default.py


def arrays(validation_size: int = VALIDATION_SIZE) -> dict[str, np.ndarray]:
  config = dist_ens.load_config(ROOT / 'configs' / 'default.py')
  config.data.validation_size = validation_size
  dataset = data.load_dataset(config.data.name, specs.data_spec(config))
  train, val = data.split_validation(dataset.train, validation_size)
  x, y = train.read(np.arange(train.num_examples))
  flat = lambda a: np.asarray(a, np.float32).reshape(len(a), -1)
  return {'x_train': flat(x), 'y_train': np.asarray(y, np.int64),
          'x_val': flat(val.x), 'y_val': np.asarray(val.y, np.int64),
          'x_test': flat(dataset.test.x), 'y_test': np.asarray(dataset.test.y, np.int64)}


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument('out', help='the .npz to write')
  args = parser.parse_args()
  out = arrays()
  np.savez(args.out, **out)
  print(f"wrote {args.out}: " + ', '.join(f'{k} {v.shape}' for k, v in out.items()))


if __name__ == '__main__':
  main()
