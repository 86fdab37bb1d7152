"""The lines `dist-ens plan` prints for a Plan (planner.make_plan)."""

from __future__ import annotations

import math
from typing import Any


from dist_ens.io.tables import counted
from dist_ens.parallel import mesh as mesh_lib

GB = 1e9
# What flops_per_example counts, as printed and in --json.
FLOPS_MEASURED = ('XLA cost analysis of the compiled train step (forward + backward + '
                  'update) / member-examples per device')
Plan = Any  # planner.Plan (not imported: planner imports this module)


def plan_lines(plan: Plan, title: str) -> str:
  """The plan as the lines `dist-ens plan` prints, after `title` (what runs on what)."""
  s = plan.step
  form = plan.parallelism + (f' (chunks of {plan.map_batch_size})' if plan.map_batch_size else '')
  devices = math.prod(plan.mesh_shape.values())
  lines = [
      title,
      f'mesh {plan.mesh_shape} over {counted(devices, f"{plan.platform} device")}: '
      f'{counted(s.members_per_device, "member")} per device, run with {form}',
      f'parameters per member          {plan.params_per_member:>16,}',
      (f'train FLOPs per example        {plan.flops_per_example:>16,.0f}  (per member: '
       f'{FLOPS_MEASURED})' if plan.flops_per_example is not None else
       'train FLOPs per example        this backend gives no cost analysis'),
      f'train steps                    {plan.train_steps:>16,}' + (
          f'  ({plan.steps_per_epoch:,} per epoch)' if plan.steps_per_epoch else ''),
      f'state bytes per member         {plan.state_bytes_per_member:>16,}  '
      '(parameters, optimizer state, frozen flag)',
      f'state bytes per device         {plan.state_bytes_per_device:>16,}  (its members, or '
      'its shards of them, by the layout below)',
      'parameters: path, shape [M, ...], spec, bytes per device',
      *(f'  {p.path:<36} {str(list(p.shape)):<18} {str(p.spec):<28} {p.bytes_per_device:>12,}'
        for p in plan.param_leaves),
      f'compiled train step, bytes per device ({counted(s.members_per_device, "member")}):',
      *step_memory_lines(s),
      f'bytes per member               {plan.bytes_per_member:>16,.0f}  (peak growth per added '
      f'member; {_fixed_part(plan)})',
  ]
  lines += _program_lines(plan)
  counts = 'state, step and programs' if plan.program_bytes else 'state and step'
  if plan.memory_bytes is None:
    lines.append(f'largest M: this {plan.platform} device reports no memory size; pass '
                 '--memory_gb=G (the memory of ONE device) to get it.')
  else:
    lines.append(f'largest M that fits {plan.memory_bytes / GB:,.2f} GB per device x '
                 f'{plan.mesh_shape[mesh_lib.MEMBER]} member shard(s): {plan.max_members:,}'
                 f' ({counts}; leave room for evaluation and the framework)')
  return '\n'.join(lines)


def step_memory_lines(s: Any) -> list[str]:
  """A compiled step's memory analysis (dry_run.StepMemory), one line a part."""
  return [f'  arguments                    {s.argument:>16,}  (state and batch)',
          f'  outputs                      {s.output:>16,}',
          f'  aliased (donated state)      {s.alias:>16,}',
          f'  temporaries                  {s.temp:>16,}',
          f'  peak                         {s.peak:>16,}  (arguments + outputs - aliased + '
          'temporaries)']


def _fixed_part(plan: Plan) -> str:
  if plan.fixed_bytes > 0 or plan.bytes_per_member <= 0:
    return f'fixed part {plan.fixed_bytes:,.0f}'
  return ('the peak more than doubles at twice the members, so this growth is an upper '
          'bound and no part is fixed')


def _program_lines(plan: Plan) -> list[str]:
  """On a CPU, the compiled programs' memory and the peak with them."""
  if plan.platform != 'cpu':
    return []
  if plan.program_bytes is None:
    return ['compiled programs              not measured (no /proc/self/status, or after '
            '--calibrate: run plan alone); on a CPU a run holds them on top of the peak above']
  lines = [f'compiled programs              {plan.program_bytes:>16,}  (CPU: resident memory '
           'compiling the step and init programs added to this process, as a run\'s do)']
  if plan.dry_run_peak_bytes is None:
    return lines + [f'predicted peak per device      {plan.peak_bytes:>16,.0f}  (step peak + '
                    'the programs\' share; no dry run: it would take over half the host\'s '
                    'available memory)']
  return lines + [f'predicted peak per device      {plan.peak_bytes:>16,.0f}  (a dry run\'s '
                  'peak over this process\'s baseline / its devices: compile, init and two '
                  'steps on zeros)']
