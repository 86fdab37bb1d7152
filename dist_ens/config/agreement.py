"""That every process of a run resolved the same config (check_same_config).

It runs in training right after the config is validated: every process must train the
same ensemble, and a process launched with a different override would otherwise hang or
silently diverge at the first collective.
"""

import hashlib
import json
from typing import Any

import jax
import numpy as np

from dist_ens.config import loading
from dist_ens.errors import AgreedConfigError


def config_hash(config_dict: dict[str, Any]) -> bytes:
  """SHA-256 of the config's canonical JSON: equal configs, equal hashes."""
  return hashlib.sha256(_canonical(config_dict)).digest()


def _canonical(config_dict: dict[str, Any]) -> bytes:
  return json.dumps(config_dict, sort_keys=True, separators=(',', ':')).encode()


def describe_differences(config_dicts: list[dict[str, Any]]) -> str:
  """Names every field in which a process's config differs from process 0's.

  Args:
    config_dicts: the resolved config of each process, by process index.

  Returns:
    One line per differing process, e.g. "process 1: train.steps=30 (process 0:
    20)", or '' if all are equal.
  """
  lines = []
  for i, other in enumerate(config_dicts[1:], start=1):
    fields = loading.differences(config_dicts[0], other)
    if fields:
      shown = '; '.join(f'{f}={_lookup(other, f)!r} (process 0: {_lookup(config_dicts[0], f)!r})'
                        for f in fields)
      lines.append(f'process {i}: {shown}')
  return '\n'.join(lines)


def _lookup(config_dict: dict[str, Any], dotted: str) -> Any:
  node = config_dict
  for part in dotted.split('.'):
    if not isinstance(node, dict) or part not in node:
      return '<missing>'
    node = node[part]
  return node


def check_same_config(config_dict: dict[str, Any]) -> None:
  """Fails on every process if the processes resolved different configs.

  One process: returns at once, no collective. Several: all-gathers a 32-byte
  hash of each config; only if they differ are the full configs gathered, so the
  error can name the fields.

  Args:
    config_dict: this process's resolved config (config.loading.to_dict).

  Raises:
    AgreedConfigError: on every process, naming each differing field and its values.
  """
  if jax.process_count() == 1:
    return
  from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
  digest = np.frombuffer(config_hash(config_dict), np.uint8)
  digests = multihost_utils.process_allgather(digest)
  if (digests == digests[0]).all():
    return
  # Configs differ: gather them whole (padded to one length, as the collective needs).
  encoded = _canonical(config_dict)
  length = int(multihost_utils.process_allgather(np.int32(len(encoded))).max())
  padded = np.zeros(length, np.uint8)
  padded[:len(encoded)] = np.frombuffer(encoded, np.uint8)
  gathered = multihost_utils.process_allgather(padded)
  configs = [json.loads(bytes(row).rstrip(b'\0')) for row in gathered]
  raise AgreedConfigError(
      f'the {len(configs)} processes resolved different configs; every process must get '
      'the same --config file and overrides. Differing fields:\n'
      + describe_differences(configs))
