"""What loading a data set reads of config.data, as a frozen spec (specs.data_spec)."""

import dataclasses


@dataclasses.dataclass(frozen=True)
class DataSpec:
  """How to load and preprocess a data set.

  name: an embedded set, 'uci:NAME', an import path, or a TFDS name (config.data.name).
  data_dir: TFDS's data_dir; '' = TFDS's default.
  mean, std: per-channel standardisation after uint8 images are scaled to [0, 1];
    () = none.
  train_split, test_split, add_channel: TFDS only, for data sets whose splits are
    named otherwise or whose 1-D/2-D inputs need no channel axis (config.data may set
    them; configs/default.py does not, so their defaults live here).
  text_length, text_targets, pad_id, tokenizer: 'text:PATH' only (data/text.py;
    configs/default.py holds their defaults; assemble reads them for text alone).
  checkpoint: config.model.init_from when it is 'hf:PATH' (else ''): 'text:PATH' reads
    its tokenizer, pad_token_id and vocab_size.
  """
  name: str
  data_dir: str = ''
  mean: tuple[float, ...] = ()
  std: tuple[float, ...] = ()
  train_split: str = 'train'
  test_split: str = 'test'
  add_channel: bool = True
  text_length: int = 0
  text_targets: str = 'label'
  pad_id: int = -1
  tokenizer: str = ''
  checkpoint: str = ''


# config.data's fields that only 'text:PATH' reads.
TEXT_FIELDS = ('text_length', 'text_targets', 'pad_id', 'tokenizer')
