"""Multi-process runs: jax.distributed start-up and cross-process config checks.

(Placeholder; the multi-host issue fills this in.)
"""

from typing import Any


def check_same_config(config_dict: dict[str, Any]) -> None:
  """Fails with a clear error if the processes resolved different configs (no-op for now)."""
  del config_dict
