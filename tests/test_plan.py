"""dist-ens plan: its numbers against counts made by hand, and memory that grows with M."""

import contextlib
import gc
import io
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

import support

from dist_ens import plan as plan_lib
from dist_ens.run import assemble
from dist_ens.config.loading import load_config

CONFIGS = Path(__file__).resolve().parents[1] / 'configs'
DEFAULT = CONFIGS / 'default.py'

# MLP 40-256-256-10 (configs/default.py): weights and biases of each dense layer.
MLP_PARAMS = (40 * 256 + 256) + (256 * 256 + 256) + (256 * 10 + 10)
# The mnist1d CNN: 3 convs (kernel 5/3/3, 25 channels, stride 2 over 40 -> 20 -> 10 -> 5),
# then a dense layer from 5 x 25 features to 10 classes.
CNN_PARAMS = (5 * 1 * 25 + 25) + (3 * 25 * 25 + 25) + (3 * 25 * 25 + 25) + (5 * 25 * 10 + 10)


def _config(**overrides):
  config = load_config(DEFAULT)
  config.mesh.member, config.mesh.data = 1, 1
  return support.override(config, **overrides)


@pytest.fixture(scope='module')
def one_device():
  return jax.devices()[:1]


@pytest.fixture(scope='module')
def plans():
  """plans(devices, memory_bytes=None, measure=True, **overrides): make_plan of
  _config(**overrides), made once in this module. Each make_plan compiles the step at M and
  2M and, where `measure`, dry-runs it (init compiled, state made, two steps run): only the
  tests that read a dry run's figures ask for one. The tests that only read a plan (nothing
  patched) share one, and plans.arrays_left(devices, ...) is how many more live arrays
  there were after that make_plan than before it. The plans made with plan's parts
  patched are made by their own module fixtures (stand_in_plan, no_room_command_line) or
  tests."""
  made, left = {}, {}

  def key(devices, memory_bytes, measure, overrides):
    return (len(devices), memory_bytes, measure, tuple(sorted(overrides.items())))

  def plan(devices, memory_bytes=None, measure=True, **overrides):
    k = key(devices, memory_bytes, measure, overrides)
    if k not in made:
      # Earlier tests' garbage is collected first, so none of it is freed inside the count
      # (a CI counted -122: arrays of cycles an earlier test left, collected mid-plan).
      gc.collect()
      before = len(jax.live_arrays())
      made[k] = plan_lib.make_plan(_config(**overrides), devices, memory_bytes=memory_bytes,
                                   measure_programs=measure)
      gc.collect()
      left[k] = len(jax.live_arrays()) - before
    return made[k]

  def arrays_left(devices, memory_bytes=None, measure=True, **overrides):
    plan(devices, memory_bytes, measure, **overrides)
    return left[key(devices, memory_bytes, measure, overrides)]

  plan.arrays_left = arrays_left
  return plan


def _small(one_device, plans):
  """4 members on one device, dry-run (test_the_dry_run_frees_everything reads its dry
  run; the other tests that read this plan read the step's sizes, XLA's memory analysis
  and FLOPs)."""
  return plans(one_device, num_members=4)


@pytest.fixture(scope='module')
def fresh_plan():
  """`dist-ens plan --json` of 16 members on one device in a fresh process (the dist-ens
  command's plan; plan.main in this process is test_command_line_prints_the_plan's and
  no_room_command_line's): the parsed JSON, read by
  test_in_a_fresh_process_the_dry_run_sees_the_state_beside_the_programs and, as the plan
  at 16 members, by test_more_members_take_proportionally_more_memory."""
  env = {**os.environ, 'XLA_FLAGS': support.xla_flags(1)}
  result = subprocess.run(
      [sys.executable, '-m', 'dist_ens.main', 'plan', f'--config={DEFAULT}',
       '--config.num_members=16', '--config.mesh.member=1', '--config.mesh.data=1', '--json'],
      env=env, capture_output=True, text=True, timeout=300, check=False)
  assert result.returncode == 0, result.stderr
  return json.loads(result.stdout)


def _sizes_per_member(config, devices):
  """What make_plan reports as (params_per_member, state_bytes_per_member): plan.sizes'
  count of the run's abstract state, without compiling the step at M and 2M as make_plan
  does (tests/test_own_shared.py counts the shared part so too)."""
  run = assemble.build_run(config, devices=devices, shapes=plan_lib.data_shape(config))
  return plan_lib.sizes.per_member_sizes(run.parts.abstract_state, config.num_members)


def test_parameter_and_state_counts_match_the_model_by_hand(one_device, plans):
  # The MLP's through make_plan (the module's shared plan); the CNN's from the count that
  # make_plan reports (make_plan's compiles of its step would measure memory, not read here).
  mlp = _small(one_device, plans)
  mlp_sizes = (mlp.params_per_member, mlp.state_bytes_per_member)
  assert _sizes_per_member(_config(num_members=4), one_device) == mlp_sizes
  cnn_sizes = _sizes_per_member(_config(num_members=4, model__name='cnn'), one_device)
  for (params, state_bytes), by_hand in ((mlp_sizes, MLP_PARAMS), (cnn_sizes, CNN_PARAMS)):
    assert params == by_hand
    # Adam keeps two moments: parameters + mu + nu in float32 = 12 bytes each, plus a
    # few scalars (step counts, the frozen flag).
    assert 0 < state_bytes - 12 * by_hand <= 64


def test_more_members_take_proportionally_more_memory(one_device, plans, fresh_plan):
  # The plan at 16 members is fresh_plan's (the same config planned in a fresh process:
  # XLA's memory analysis of the same programs).
  small, big = _small(one_device, plans), fresh_plan
  assert big['num_members'] == 16 and big['mesh_shape'] == {'member': 1, 'data': 1}
  assert small.params_per_member == big['params_per_member']
  assert small.state_bytes_per_member == big['state_bytes_per_member']
  # The arguments are the state, the per-member hyperparameters the step reads (Adam's
  # learning rate, weight decay and b1, and label smoothing: 4 float32; jit drops the
  # unused ones) and one shared batch: 12 more members add exactly 12 members' worth.
  assert (big['step']['argument'] - small.step.argument
          == 12 * (small.state_bytes_per_member + 16))
  # Each plan measures the slope on its own pair of compiles (M, 2M); they agree, and
  # the line through (4, 8) predicts the peak at 16 members.
  assert big['bytes_per_member'] == pytest.approx(small.bytes_per_member, rel=0.05)
  assert big['step']['peak'] == pytest.approx(small.fixed_bytes + 16 * small.bytes_per_member,
                                              rel=0.05)
  # A member costs at least its state, and the batch is paid once.
  assert small.bytes_per_member >= small.state_bytes_per_member
  assert small.fixed_bytes > 0


def _dry_run_of(monkeypatch, host):
  """Makes plan's dry run on a CPU say `host` (a dry_run.HostMemory, or None: no /proc)."""
  dry_run = plan_lib.dry_run
  monkeypatch.setattr(dry_run, 'dry_run', lambda parts, config, form: (
      dry_run.compile_step(parts, config, form)[0], host))


# What the stand-in dry run of stand_in_plan measured, and the memory its device reports.
STAND_IN_HOST = plan_lib.dry_run.HostMemory(programs=40_000_000, peak=64_000_000)
DEVICE_MEMORY = 80e6


@pytest.fixture(scope='module')
def stand_in_plan(one_device):
  """make_plan of 4 members on one device whose dry run is a stand-in that measured
  STAND_IN_HOST and whose device reports DEVICE_MEMORY (no budget given): one plan (its
  steps' programs _small's, from the cache) read by the three tests below it."""
  with pytest.MonkeyPatch.context() as monkeypatch:
    _dry_run_of(monkeypatch, STAND_IN_HOST)
    monkeypatch.setattr(plan_lib.planner, 'device_memory_bytes', lambda device: DEVICE_MEMORY)
    return plan_lib.make_plan(_config(num_members=4), one_device)


def test_largest_m_is_the_last_that_fits(stand_in_plan):
  plan = stand_in_plan
  assert plan.peak_bytes == STAND_IN_HOST.peak
  # The line through the dry run's peak at M=4 with the step's bytes per member.
  at = lambda m: STAND_IN_HOST.peak + (m - 4) * plan.bytes_per_member
  assert plan.max_members > 4
  assert at(plan.max_members) <= DEVICE_MEMORY < at(plan.max_members + 1)


def test_a_peak_that_more_than_doubles_prints_no_negative_fixed_part(one_device, monkeypatch):
  # Peaks of 100 n^2 bytes at n members per device: from 4 to 8 members the peak grows
  # by 4,800, 1,200 a member, more than the 400 a member that 1,600 at 4 averages.
  monkeypatch.setattr(plan_lib.planner, 'step_memory', lambda compiled, n: (
      plan_lib.dry_run.StepMemory(n, 100 * n * n, 0, 0, 0)))
  _dry_run_of(monkeypatch, None)
  plan = plan_lib.make_plan(_config(num_members=4), one_device, memory_bytes=10_000)
  assert plan.bytes_per_member == 1_200 and plan.fixed_bytes == 0
  assert plan.max_members == 4 + (10_000 - 1_600) // 1_200  # The line through the peak at 4.
  text = plan_lib.format_plan(plan, _config(num_members=4))
  assert not re.search(r'-[0-9]', text), text
  assert 'the peak more than doubles at twice the members' in text
  # No /proc (the dry run gave nothing): said so, and the peak is the step's.
  assert plan.peak_bytes == plan.step.peak == 1_600
  assert 'compiled programs              not measured' in text


def test_the_devices_own_memory_is_the_default_budget(one_device, stand_in_plan):
  class Accelerator:  # What an accelerator's memory_stats gives (bytes_limit).
    def memory_stats(self):
      return {'bytes_limit': 80_000_000, 'bytes_in_use': 0}
  assert plan_lib.planner.device_memory_bytes(Accelerator()) == 80e6
  assert plan_lib.planner.device_memory_bytes(one_device[0]) is None  # A CPU: unknown.
  # make_plan given no budget plans for what the device reports (stand_in_plan's device:
  # DEVICE_MEMORY).
  plan = stand_in_plan
  assert plan.memory_bytes == DEVICE_MEMORY == 80e6
  at = lambda m: plan.peak_bytes + (m - 4) * plan.bytes_per_member
  assert at(plan.max_members) <= 80e6 < at(plan.max_members + 1)
  text = plan_lib.format_plan(plan, _config())
  assert 'largest M that fits 0.08 GB per device' in text


def test_a_cpu_plan_predicts_the_dry_runs_peak_shared_by_the_processs_devices(
    devices, plans, stand_in_plan):
  # Eight CPU devices of one process share its programs and its host memory: _split's
  # plan, whose real dry run ran on the 4 x 2 mesh's 8 devices.
  eight = _split(devices, plans)
  assert eight.dry_run_peak_bytes > 0
  assert eight.peak_bytes == pytest.approx(eight.dry_run_peak_bytes / 8)
  one = stand_in_plan  # One device: the dry run's figures as they are.
  assert (one.program_bytes, one.dry_run_peak_bytes, one.peak_bytes) == (40e6, 64e6, 64e6)
  text = plan_lib.format_plan(one, _config(num_members=4))
  assert re.search(r'compiled programs +40,000,000 ', text)
  assert re.search(r"predicted peak per device +64,000,000  \(a dry run's peak", text)
  # Too big for a dry run (the step's peak + the programs, and said so): the real path,
  # test_no_dry_run_where_it_would_not_fit_the_host. No /proc: that of
  # test_a_peak_that_more_than_doubles_prints_no_negative_fixed_part (its dry run gives
  # nothing).


def test_the_dry_run_frees_everything(one_device, plans):
  # Counted around the make_plan of _small's plan (a real dry run, in this process).
  plan = _small(one_device, plans)
  assert plans.arrays_left(one_device, num_members=4) == 0
  assert plan.dry_run_peak_bytes is not None and plan.peak_bytes == plan.dry_run_peak_bytes


def test_in_a_fresh_process_the_dry_run_sees_the_state_beside_the_programs(fresh_plan):
  """`dist-ens plan --json` in a fresh process (fresh_plan)."""
  plan = fresh_plan
  assert plan['num_members'] == 16 and plan['params_per_member'] == MLP_PARAMS
  assert plan['flops_per_example'] > 0 and 'XLA cost analysis' in plan['flops_measured']
  assert plan['train_steps'] == load_config(DEFAULT).train.steps
  # The 16 members' state was written (RSS counts written pages) beside the programs.
  state = 16 * plan['state_bytes_per_member']
  assert plan['dry_run_peak_bytes'] >= plan['program_bytes'] + state
  assert plan['peak_bytes'] == plan['dry_run_peak_bytes'] > plan['step']['peak']


@pytest.fixture(scope='module')
def no_room_command_line():
  """plan.main on SPLIT's mesh (its programs _split's, from the cache) with no budget, on a
  host with 1 MB available, too little for a dry run: (its exit code, what it printed, the
  plan make_plan gave it). Read by test_no_dry_run_where_it_would_not_fit_the_host and
  test_command_line_on_a_cpu_without_memory_asks_for_it."""
  made, make_plan = [], plan_lib.planner.make_plan
  printed = io.StringIO()
  with pytest.MonkeyPatch.context() as monkeypatch, contextlib.redirect_stdout(printed):
    monkeypatch.setattr(plan_lib.dry_run.host_memory, 'available_bytes', lambda: 1_000_000)
    monkeypatch.setattr(plan_lib.planner, 'make_plan', lambda *args, **kwargs: (
        made.append(make_plan(*args, **kwargs)) or made[-1]))
    code = plan_lib.main([f'--config={DEFAULT}', '--config.num_members=8',
                          '--config.mesh.member=4', '--config.mesh.data=2'])
  return code, printed.getvalue(), made[0]


def test_no_dry_run_where_it_would_not_fit_the_host(no_room_command_line):
  code, out, plan = no_room_command_line
  assert code == 0, out
  assert plan.program_bytes > 0 and plan.dry_run_peak_bytes is None
  # The step's peak + the programs, which the process's 8 devices share.
  assert plan.peak_bytes == pytest.approx(plan.step.peak + plan.program_bytes / 8)
  assert 'no dry run' in out


def test_resident_memory_readings_see_memory_written_and_its_peak():
  # The readings are the whole process's, and in a test worker other threads (a previous
  # run's checkpointer or prefetcher finishing) may free or take memory between two of
  # them: a CI run once read 18.6 MB for the 50 written. So up to three tries; a reading
  # in the wrong field or unit misses in all of them.
  status = plan_lib.dry_run.host_memory.status_bytes
  assert plan_lib.dry_run.host_memory.reset_peak()
  deltas = []
  for _ in range(3):
    before = status()
    kept = np.ones(50_000_000 // 8)
    deltas.append(status() - before)
    del kept
    if 45e6 <= deltas[-1] <= 60e6:
      break
  assert 45e6 <= deltas[-1] <= 60e6, deltas
  # The peak stays after the memory is freed: at least the try's start and its 50 MB.
  assert status('VmHWM') - before >= 45e6


# 8 members over a 4 x 2 mesh of 8 devices (_split's, and the command line tests').
SPLIT = {'num_members': 8, 'mesh__member': 4, 'mesh__data': 2}


def _split(devices, plans):
  """SPLIT's plan for 0.5 GB a device, dry-run (on this mesh: the dry run of 8 devices):
  the plan test_command_line_prints_the_plan prints, and whose step's sizes, FLOPs and
  largest M's rounding to whole shards the tests beside it read."""
  return plans(devices, 0.5e9, **SPLIT)


def test_members_split_over_devices_are_counted_per_device(devices, plans):
  plan = _split(devices, plans)
  assert plan.step.members_per_device == 2
  # Each device holds its 2 members' state; the batch is split over 'data'.
  assert plan.step.argument >= 2 * plan.state_bytes_per_member
  assert plan.step.argument < 3 * plan.state_bytes_per_member
  assert plan.max_members % 4 == 0  # Whole members on each of the 4 member shards.


def test_flops_per_example_count_a_training_step_whatever_the_mesh(one_device, devices,
                                                                   plans):
  small = _small(one_device, plans)
  # Training an MLP costs about 6 FLOPs per weight and example: 2 forward, 4 backward
  # (a little less without the input's gradient, a little more for biases and the loss).
  assert 5.5 * MLP_PARAMS < small.flops_per_example < 6.5 * MLP_PARAMS
  split = _split(devices, plans)  # The memory budget changes only the largest M.
  # Per member and example: neither M nor the mesh changes it (the optimizer update,
  # paid once per member and step, is ~2% of it here, and is spread over half the
  # examples per device when the batch is split in two).
  assert split.flops_per_example == pytest.approx(small.flops_per_example, rel=0.05)


def _mapped(one_device, plans, chunk):
  """8 members on one device, one chunk of `chunk` at a time ('map'; 0: one member), in a
  step that augments (crop_flip), no dry run (it measures memory, which the tests that read
  this plan do not read: test_the_dry_run_frees_everything and the tests beside it check
  the dry run). Read by test_flops_per_example_count_every_member_of_a_mapped_step and
  test_plans_a_step_that_augments."""
  return plans(one_device, measure=False, num_members=8, ensemble__member_parallelism='map',
               ensemble__map_batch_size=chunk, data__augment='crop_flip')


# Chunks of 2 members are the slow tier's: plan.sizes.flops_per_example counts a mapped
# step's FLOPs on a vmapped step of one member per device whatever the chunk (it reads the
# form's kind, not its chunk), which the fast case of one member at a time checks.
@pytest.mark.parametrize('chunk', [0, pytest.param(2, marks=pytest.mark.slow)])
def test_flops_per_example_count_every_member_of_a_mapped_step(one_device, plans, chunk):
  """Members one chunk at a time: XLA's cost analysis counts a loop's body once, and the
  plan still counts every member."""
  small = _small(one_device, plans)
  mapped = _mapped(one_device, plans, chunk)
  assert mapped.parallelism == 'map' and mapped.map_batch_size == (chunk or None)
  # The augmentation's own FLOPs (crops and flips: 0.07% here) are well inside the 5%.
  assert mapped.flops_per_example == pytest.approx(small.flops_per_example, rel=0.05)


def test_plans_a_step_that_augments(one_device, plans):
  # Augmentation makes the step take the examples' indices too (their keys' source): the
  # augmenting step of _mapped takes the arguments of the same 8 members' step without
  # augmentation (_small's step at twice its members; a member form does not change the
  # arguments) and one int32 index per example of the shared batch.
  plan, small = _mapped(one_device, plans, 0), _small(one_device, plans)
  assert plan.params_per_member == MLP_PARAMS
  assert small.step_doubled.members_per_device == plan.num_members == 8
  assert plan.step.argument == small.step_doubled.argument + 4 * _config().data.batch_size


def test_command_line_prints_the_plan(devices, plans, capsys, monkeypatch):
  # main's make_plan answers _split's plan: main's config is checked to be the one that
  # plan was made of (every field), with the same budget and dry run; not planned again.
  made, expected = _split(devices, plans), _config(**SPLIT).to_dict()

  def make_plan(config, memory_bytes, measure_programs):
    assert (config.to_dict(), memory_bytes, measure_programs) == (expected, 0.5e9, True)
    return made

  monkeypatch.setattr(plan_lib.planner, 'make_plan', make_plan)
  flags = [f'--config={DEFAULT}', '--config.num_members=8', '--config.mesh.member=4',
           '--config.mesh.data=2', '--memory_gb=0.5']
  code = plan_lib.main(flags)
  out = capsys.readouterr().out
  assert code == 0, out
  assert re.search(rf'parameters per member +{MLP_PARAMS:,}\n', out)
  assert re.search(r'train FLOPs per example +[0-9,]+  \(per member: XLA cost analysis', out)
  assert re.search(r'train steps +2,000  \(31 per epoch\)', out)  # 4000 // 128 an epoch.
  assert 'over 8 cpu devices: 2 members per device' in out
  assert 'largest M that fits 0.50 GB per device x 4 member shard(s):' in out
  # --json: the plan as one JSON object.
  code = plan_lib.main([*flags, '--json'])
  out, err = capsys.readouterr()
  assert code == 0, err
  plan = json.loads(out)
  assert plan['num_members'] == 8 and plan['params_per_member'] == MLP_PARAMS
  assert plan['step']['members_per_device'] == 2 and plan['memory_bytes'] == 0.5e9
  assert plan['max_members'] == made.max_members


def test_command_line_on_a_cpu_without_memory_asks_for_it(no_room_command_line):
  # No --memory_gb: the budget comes from the device, which on a CPU reports none.
  code, out, plan = no_room_command_line
  assert code == 0 and plan.memory_bytes is None and plan.max_members is None
  assert 'pass --memory_gb=G' in out


def test_command_line_errors_name_what_is_wrong(capsys):
  assert plan_lib.main([f'--config={DEFAULT}', '--config.num_members=6',
                        '--config.mesh.member=8']) == 1
  assert 'config.num_members=6' in capsys.readouterr().err
  assert plan_lib.main([f'--config={DEFAULT}', '--no_such_flag=1']) == 2
  assert 'no_such_flag' in capsys.readouterr().err
  assert plan_lib.main([]) == 2
  assert '--config=FILE is required' in capsys.readouterr().err
  assert plan_lib.main([f'--config={DEFAULT}', '--memory_gb=0']) == 2
