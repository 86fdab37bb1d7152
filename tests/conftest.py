"""Test setup: fake 8 CPU devices before anything imports jax."""

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402  (must come after XLA_FLAGS)
import pytest  # noqa: E402

assert jax.device_count() == 8, "XLA_FLAGS was set too late: jax saw %d devices" % jax.device_count()


@pytest.fixture(scope="session")
def devices():
  return jax.devices()
