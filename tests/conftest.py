"""Test setup: fake 8 CPU devices before anything imports jax."""

import os
import tempfile

import support

# 8 fake CPU devices, compiling fast (support.FAST_COMPILE says why).
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + support.xla_flags(8)).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# One persistent compilation cache for the run, shared by the xdist workers and the
# subprocesses they start: most tests train small runs whose steps compile to the same
# programs, and a fresh jit of a known program is then a cache read instead of a compile.
_OWN_CACHE = "JAX_COMPILATION_CACHE_DIR" not in os.environ
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", os.path.join(
    tempfile.gettempdir(), "dist_ens_test_jax_cache_" + os.environ.get(
        "PYTEST_XDIST_TESTRUNUID", str(os.getpid()))))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
# A developer's `dist-ens plan --calibrate` cache must not change the forms tests run.
os.environ["DIST_ENS_CALIBRATION"] = os.path.join(
    os.environ["JAX_COMPILATION_CACHE_DIR"], "no_calibration.json")

import shutil  # noqa: E402

import jax  # noqa: E402  (must come after XLA_FLAGS)
import pytest  # noqa: E402

assert jax.device_count() == 8, "XLA_FLAGS was set too late: jax saw %d devices" % jax.device_count()


@pytest.fixture(scope="session")
def devices():
  return jax.devices()


def pytest_sessionfinish(session):
  """The run's compilation cache goes with it (the controller removes it, not a worker)."""
  if _OWN_CACHE and not hasattr(session.config, "workerinput"):
    shutil.rmtree(os.environ["JAX_COMPILATION_CACHE_DIR"], ignore_errors=True)


# Test files by their measured time on 2 cores (pytest --durations=0), the longest first.
# `--dist loadfile` hands files to the workers in collection order, so the long ones start
# early instead of leaving one worker busy at the end. Unlisted files keep their order.
_LONGEST_FIRST = (
    "test_reproducible.py", "test_checkpoint.py", "test_adapters.py", "test_multihost.py",
    "test_step.py", "test_train.py", "test_reliability.py", "test_methods.py",
    "test_models.py", "test_hparams.py", "test_tfds.py", "test_posthoc.py", "test_cli.py",
)


# The slow tier (pyproject.toml; `pytest -m slow`): more layouts, processes and pairs for
# properties the fast tier checks on fewer. test_combinations.py marks its own cases.
_SLOW_TIER = (
    # Bit-identity of reproducible mode over 11 layouts and 2 processes; fast:
    # test_pbt's rounds on two meshes in reproducible mode, the matrix's 'reproducible'.
    "test_reproducible.py::test_members_are_bit_identical_across_layouts",
    "test_reproducible.py::test_runs_differ_where_they_should",
    "test_reproducible.py::test_two_processes_match_one",
    # Variants of test_two_processes_match_one and test_killed_process_stops_the_other.
    "test_multihost.py::test_two_processes_with_several_steps_per_call_match_one",
    "test_multihost.py::test_a_killed_coordinator_stops_the_other_naming_it",
    # Kills at random steps; fast: the kill and SIGTERM resume tests at fixed steps.
    "test_checkpoint.py::test_kill9_at_random_steps_then_resume_is_bit_exact",
    # The largest recipe; the others run in the fast tier.
    "test_recipes.py::test_recipe_trains_on_locally_written_tfds_data[cifar100_wrn28_10.py]",
)


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by marker
def pytest_collection_modifyitems(items):
  rank = {name: i for i, name in enumerate(_LONGEST_FIRST)}
  items.sort(key=lambda item: rank.get(item.path.name, len(rank)))
  for item in items:
    if item.nodeid.split("/")[-1].startswith(_SLOW_TIER):
      item.add_marker(pytest.mark.slow)
