"""Deep-ensemble regression on a UCI data set (Lakshminarayanan et al. 2017, Table 1).

  dist-ens --config=configs/uci.py --workdir=/tmp/uci                # energy, shipped
  dist-ens --config=configs/uci.py --config.data.name=uci:yacht --workdir=/tmp/yacht
  dist-ens --config=configs/uci.py --config.data.name=uci:/path/to/set.txt --workdir=...

The paper's protocol for one split (the 90/10 split `load_dataset('uci:NAME')` gives):
5 members, one hidden layer of 50 ReLUs predicting a mean and a variance, the Gaussian
NLL, Adam, batch 100, 40 epochs; inputs and targets standardised with the training
split's statistics, metrics (RMSE, NLL, CRPS, interval coverage) in the targets' units.
The paper also trained on adversarial examples; this config does not. Shipped sets:
concrete, energy, yacht, wine-quality-red (dist_ens/data/uci_data/README.md).
"""

from pathlib import Path

from dist_ens import load_config


def get_config():
  config = load_config(Path(__file__).with_name('default.py'))
  config.task = 'regression'
  config.num_members = 5
  config.model.name = 'mlp'
  config.model.widths = (50,)
  config.data.name = 'uci:energy'
  config.data.batch_size = 100
  config.optim.learning_rate = 1e-2
  config.optim.weight_decay = 0.0
  config.train.epochs = 40
  config.train.log_every = 40
  config.train.eval_every = 0
  config.checkpoint.every = 40
  config.select.metric = 'nll'
  return config
