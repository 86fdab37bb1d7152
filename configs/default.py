"""The default run: 8 MLP members on MNIST-1D (generated offline), on whatever devices exist.

  dist-ens --config=configs/default.py --workdir=/tmp/run
  dist-ens --config=configs/default.py --workdir=/tmp/run --config.num_members=16

The package's defaults as they are (every field, its meaning and its check:
dist_ens/config/defaults.py, docs/config.md); the other presets here start from them.
"""

from dist_ens.config.defaults import get_config  # noqa: F401
