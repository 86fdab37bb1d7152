"""Test setup: fake 8 CPU devices before anything imports jax."""

import functools
import os
import sys
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
# Where the environment says PYTHONDONTWRITEBYTECODE, every process would compile
# dist_ens's modules from source (0.2-0.6 CPU s each): the processes write bytecode to a
# folder of their own outside the tree instead, so the tree stays as clean as the setting
# asks. A prefix hides site-packages' own bytecode too, so the folder outlives the run: an
# empty one costs each process about 3.5 CPU s more to import jax and dist_ens (5.4 against
# 1.6-1.9 s), a filled one nothing. Python checks each file against its source.
if os.environ.pop("PYTHONDONTWRITEBYTECODE", None):
  os.environ.setdefault("PYTHONPYCACHEPREFIX", os.path.join(
      tempfile.gettempdir(), f"dist_ens_pycache_{os.getuid()}"))
  sys.pycache_prefix = os.environ["PYTHONPYCACHEPREFIX"]
  sys.dont_write_bytecode = False
# A developer's `dist-ens plan --calibrate` cache must not change the forms tests run.
os.environ["DIST_ENS_CALIBRATION"] = os.path.join(
    os.environ["JAX_COMPILATION_CACHE_DIR"], "no_calibration.json")

import shutil  # noqa: E402
import signal  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402  (must come after XLA_FLAGS)
import pytest  # noqa: E402

assert jax.device_count() == 8, "XLA_FLAGS was set too late: jax saw %d devices" % jax.device_count()


@pytest.fixture(scope="session")
def devices():
  return jax.devices()


# Finished runs that tests which only read a run share (tests/runs.py).
from runs import tiny_run, uci_run  # noqa: E402,F401  pylint: disable=g-import-not-at-top,unused-import


# A stuck test (a deadlock in C++ code, a child waited on forever) fails after this many
# seconds instead of holding the suite: pytest-timeout's thread method dumps every thread's
# stack and ends the worker, which xdist reports as a crash of that test and replaces. 34
# times the longest test (35 s idle, docs/testing.md) and above support.run_at_xla_default's
# own 900 s, so no test that is only slow under load reaches it. `--timeout`, PYTEST_TIMEOUT
# or an ini `timeout` overrides it; without pytest-timeout installed nothing changes.
TEST_TIMEOUT_S = 1200


@pytest.hookimpl(tryfirst=True)  # before pytest-timeout's own pytest_configure reads these
def pytest_configure(config):
  if config.pluginmanager.hasplugin("timeout"):
    if (config.getoption("timeout") is None and not os.environ.get("PYTEST_TIMEOUT")
        and not config.getini("timeout")):
      config.option.timeout = TEST_TIMEOUT_S
    if config.getoption("timeout_method") is None and not config.getini("timeout_method"):
      # 'signal' raises in the main thread only when it runs Python again: a thread stuck
      # in XLA never would. 'thread' ends the process from a watchdog thread.
      config.option.timeout_method = "thread"
  if config.pluginmanager.hasplugin("xdist") and not hasattr(config, "workerinput"):
    config.pluginmanager.register(DeadWorkerWatch(), "dist_ens_dead_worker_watch")
  if os.environ.get("RUN_COUNT_OUT"):  # what each test trains, compiles and starts (run_count.py)
    config.pluginmanager.import_plugin("run_count")


class DeadWorkerWatch:
  """In the xdist controller: a worker whose process has exited is reported as crashed
  within seconds, even when its pipe to the controller stays open.

  xdist learns that a worker died from the end of the worker's pipe: its read returns EOF
  when the last process holding the pipe's write end exits. A process the worker forked
  without exec (os.fork, a fork-start multiprocessing pool, a C library's fork) holds that
  write end too, so after an abort of the worker the controller and the other worker
  waited on their queues for as long as that process lived: the whole suite hung (issue 62
  item 7; tests/test_crashed_worker.py reproduces it). This watch polls each worker's
  process; when one has been gone for GRACE_S and xdist has not seen it go, the processes
  still holding its pipe (leaked descendants of the dead worker) are killed, which gives
  xdist its EOF and its usual crash report and worker replacement; where none can be
  found (no /proc), xdist is told the worker is down directly."""

  GRACE_S = 2.0  # xdist's own EOF comes within milliseconds of a worker's exit.
  POLL_S = 1.0

  def __init__(self):
    self._nodes = []
    self._lock = threading.Lock()
    self._thread = None

  @pytest.hookimpl
  def pytest_testnodeready(self, node):
    popen = getattr(getattr(node.gateway, "_io", None), "popen", None)
    if popen is None:  # not a local popen worker (ssh, socket): nothing to poll
      return
    with self._lock:
      self._nodes.append((node, popen))
      if self._thread is None:
        self._thread = threading.Thread(target=self._watch, name="dead-worker-watch", daemon=True)
        self._thread.start()

  def _watch(self):
    gone_since = {}
    while True:
      time.sleep(self.POLL_S)
      with self._lock:
        nodes = list(self._nodes)
      for node, popen in nodes:
        if getattr(node, "_down", False):  # finished or reported down: not ours to watch
          self._forget(node)
          continue
        if popen.poll() is None:
          continue
        first = gone_since.setdefault(id(node), time.monotonic())
        if time.monotonic() - first >= self.GRACE_S:
          self._forget(node)
          self._report(node, popen)

  def _forget(self, node):
    with self._lock:
      self._nodes = [(n, p) for n, p in self._nodes if n is not node]

  @staticmethod
  def _report(node, popen):
    holders = pipe_holders(popen.stdout.fileno())
    sys.stderr.write(
        f"\n[{node.gateway.id}] worker pid {popen.pid} exited (status {popen.returncode}) but "
        f"its pipe stays open in {len(holders)} process(es) it started "
        f"({', '.join(f'{pid}: {cmd}' for pid, cmd in holders) or 'none found'}): "
        "killing them so xdist reports the crash\n")
    for pid, _ in holders:
      try:
        os.kill(pid, signal.SIGKILL)
      except OSError:
        pass
    if not holders and not node._down:  # pylint: disable=protected-access
      # xdist's own handler of a closed pipe does the same; _down keeps a later EOF
      # from reporting the node down twice.
      node._down = True  # pylint: disable=protected-access
      node.notify_inproc("errordown", node=node,
                         error=f"worker pid {popen.pid} exited with status {popen.returncode}")


def pipe_holders(fd):
  """(pid, command line) of the other processes that hold the pipe `fd` is one end of
  (Linux /proc; empty elsewhere)."""
  target = "pipe:[%d]" % os.fstat(fd).st_ino
  found = []
  try:
    pids = [int(p) for p in os.listdir("/proc") if p.isdigit()]
  except OSError:
    return found
  for pid in pids:
    if pid == os.getpid():
      continue
    try:
      fds = os.listdir(f"/proc/{pid}/fd")
      if any(os.readlink(f"/proc/{pid}/fd/{f}") == target for f in fds):
        with open(f"/proc/{pid}/cmdline", "rb") as f:
          found.append((pid, f.read().replace(b"\0", b" ").decode(errors="replace")[:120]))
    except OSError:  # gone meanwhile, or not ours to read
      continue
  return found


def pytest_sessionfinish(session):
  """The run's compilation cache goes with it (the controller removes it, not a worker)."""
  if _OWN_CACHE and not hasattr(session.config, "workerinput"):
    shutil.rmtree(os.environ["JAX_COMPILATION_CACHE_DIR"], ignore_errors=True)


# Test files by their measured time on 2 cores (CI's JUnit of 2026-11-29), the longest first.
# `--dist loadfile` hands files to the workers in collection order, so the long ones start
# early instead of leaving one worker busy at the end. Unlisted files keep their order.
_LONGEST_FIRST = (
    "test_combinations.py", "test_groups.py", "test_multihost.py", "test_plan.py",
    "test_rank1.py", "test_corruptions.py", "test_reliability.py", "test_adapters.py",
    "test_readme.py", "test_grain.py", "test_step.py", "test_masksembles.py", "test_sngp.py",
    "test_train.py", "test_regression_run.py", "test_checkpoint.py", "test_cli.py",
    "test_many_processes.py", "test_seq_classification.py", "test_model_axis.py",
    "test_task_steps.py", "test_architectures.py", "test_resident.py", "test_own_shared.py",
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
    # Second checks of a property the fast tier checks once, on a cheaper case (CI time:
    # issue 45 item 11). Resume, load and predict of a collecting method; fast: the
    # combination matrix's multiswag and snapshot rows.
    "test_methods.py::test_resume_is_exact_and_ensemble_load_predicts_with_the_methods_members",
    # Shift metrics on several meshes and M; fast: test_corruptions' bitwise independence
    # of sharding, order and members, and shift_eval's one program for every severity.
    "test_shift_eval.py::test_corrupted_examples_and_metrics_are_the_same_on_any_mesh_and_m",
    "test_corruptions.py::test_severity_zero_is_the_identity",  # fast: levels' dist[0] == 0
    # Training through each framework's adapter; fast: every adapter's contract test
    # (init, BatchNorm state, dropout) and plain JAX and linen (BatchNorm, dropout,
    # resume) end to end.
    "test_adapters.py::test_trains_end_to_end[flax_nnx_mlp",
    "test_adapters.py::test_trains_end_to_end[equinox_mlp",
    "test_adapters.py::test_trains_end_to_end[haiku_mlp",
    "test_adapters.py::test_equinox_batchnorm_trains_end_to_end",
    # Resharding a checkpoint onto another model size; fast: test_checkpoint's restore
    # onto another mesh and the model-axis load/predict/export test.
    "test_model_axis.py::test_a_run_resumes_onto_another_model_size",
    # More layouts and shapes of one property; fast: the others of each parametrization.
    "test_train.py::test_topology_does_not_change_results[1-8]",
    "test_models.py::test_conv_impls_compute_the_same_function[input_shape1",
    "test_models.py::test_conv_impls_compute_the_same_function[input_shape2",
    "test_architectures.py::test_resnets_train[wrn10]",
    "test_tfds.py::test_real_configs_run_on_same_shaped_data[cifar10_cnn.py",
    "test_tfds.py::test_real_configs_run_on_same_shaped_data[fashion_mnist_cnn.py",
    "test_step.py::test_matches_python_loop_over_members[8-1-adam]",
    "test_step.py::test_matches_python_loop_over_members[1-8-adam]",
    "test_step.py::test_init_compiled_faster_on_a_cpu_gives_xlas_default_bits[cnn]",
    # Post-hoc steps per token; fast: the matrix's token_classification case (greedy
    # selection per token) and its refusal of token_classification with mimo; MC dropout
    # and temperature per token only here and in the matrix's slow token rows.
    "test_token_task.py::test_post_hoc_steps_run_per_token_and_mimo_is_refused",
    # Calibrating a real step; fast: calibration's tests on a timed stand-in.
    "test_calibration.py::test_calibrating_a_real_step_times_every_candidate",
    # The digits ViT recipe trained; fast: test_vit's training and VIT_RULES tests.
    "test_vit.py::test_digits_vit_trains_through_dist_ens",
    # Exact resume of a task's or a model's run (a killed run and its rerun); fast: the
    # combination matrix's token_classification cases (SIGTERM, resume, load, predict),
    # test_checkpoint's bit-exact resume, and each test's own train-and-predict half.
    "test_token_task.py::test_next_token_prediction_resumes_exactly",
    # More meshes of one property; fast: the other parametrizations.
    "test_model_axis.py::test_members_follow_the_same_trajectory_on_every_mesh[shape1]",
    # own='batchensemble' formed for prediction; fast: the [head] case (the same forming
    # path) and test_pretrained's BatchEnsemble member formed from w and its factors.
    "test_shared_eval.py::test_ensemble_load_predicts_as_its_formed_members[batchensemble]",
    # train_shared under a frozen-base epinet; fast: test_own_shared's train_shared tests
    # (the same summed-gradient path) and the epinet's frozen-base tests.
    "test_epinet_frozen_base.py::test_train_shared_trains_the_one_base_by_the_members_summed",
    # A causal token_transformer's SGD steps reduce its loss; fast: test_token_task's
    # next-token run (a causal token_transformer trained through dist_ens, its loss falls
    # below 0.7x the first) and test_causal_mask_hides_later_tokens.
    "test_token_transformer.py::test_sgd_steps_reduce_the_loss[True]",
    # A GPT-2 decoder on raw text with own='all'; fast: the tied decoder's LoRA test (the
    # same config path, trained and scored), own='all' from hf: in test_hf and the BERT run.
    "test_text_source.py::test_a_decoder_trains_on_next_tokens_of_raw_text",
    # Resume under a frozen-base epinet; fast: test_epinet's bit-for-bit resume (epinet
    # parameters, priors, indices), test_own's and test_own_shared's exact resumes with a
    # shared part stored once.
    "test_epinet_frozen_base.py::test_resume_ends_bit_for_bit_where_an_uninterrupted_run_ends",
    # A regex-owned shared leaf moved by the members' summed gradient; fast: the [head] and
    # [lora] cases (the same path) and test_own's regex test.
    "test_own_shared.py::test_one_step_moves_a_shared_leaf_by_the_sum_of_the_members_gradients[^1/",
    # Issue 47's whole path in one run (a Llama from hf:, own='lora', model=2, resume,
    # predict, PEFT export); fast, each part: the matrix's own=lora case (resume, load,
    # predict), test_peft_export's PEFT parity of exported adapters, test_model_axis's
    # split load/predict/export and test_hf's init from hf:.
    "test_peft_export.py::test_a_decoders_lora_ensemble_split_over_model_resumes_predicts_and_exports",
)


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by marker
def pytest_collection_modifyitems(items):
  rank = {name: i for i, name in enumerate(_LONGEST_FIRST)}
  items.sort(key=lambda item: rank.get(item.path.name, len(rank)))
  for item in items:
    # The file's name and the rest of the node id (a parameter id may hold '/').
    name = item.path.name + item.nodeid[item.nodeid.index("::"):]
    if name.startswith(_SLOW_TIER):
      item.add_marker(pytest.mark.slow)
    # Tests of bits that only XLA's default optimisation keeps run in a child process
    # compiled at it (support.FAST_COMPILE says why the suite compiles at -O0).
    if item.get_closest_marker("xla_default") and not os.environ.get(support.AT_XLA_DEFAULT):
      item.runtest = functools.partial(support.run_at_xla_default, item.nodeid)
