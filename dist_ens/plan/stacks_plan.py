"""`dist-ens plan` for a run of several stacks joined in one step (parts.stacks: member
groups of different architectures, optimizers or methods, docs/groups.md).

Every stack is split over all devices and updated in turn inside one compiled step, so a
device holds every stack's state at once. The plan prices each stack on its own
(parameters, state bytes and train FLOPs per member, state bytes per device by its
layout, the member form its part of the step runs with) and measures the one compiled
step whole: its arguments, temporaries and peak per device are what the run needs. The
largest M of a one-stack plan (one architecture grown) has no single meaning here; a
memory budget is checked against the step's peak instead.
"""

import math
from typing import Any, NamedTuple

from dist_ens.io.tables import counted
from dist_ens.parallel import mesh as mesh_lib
from dist_ens.plan import dry_run, sizes
from dist_ens.plan.dry_run import StepMemory, step_memory
from dist_ens.plan.text import FLOPS_MEASURED, GB, step_memory_lines
from dist_ens.run import assemble, member_forms


class StackPlan(NamedTuple):
  """One stack's members, priced on their own."""
  name: str
  first_member: int
  count: int
  model_name: str  # its config.model.name
  model: dict[str, Any]  # the stack's overrides of config.model
  parallelism: str  # the member form its part of the step runs with
  params_per_member: int
  state_bytes_per_member: int
  state_bytes_per_device: int
  flops_per_example: float | None  # train FLOPs per member-example (None: no cost analysis)


class StacksPlan(NamedTuple):
  """A run of several stacks: each stack's plan and the joint step's memory."""
  num_members: int
  mesh_shape: dict[str, int]
  platform: str
  stacks: list[StackPlan]
  state_bytes_per_device: int  # every stack's, as the joint state lies on the mesh
  step: StepMemory  # the one compiled step that updates every stack
  memory_bytes: float | None
  train_steps: int

  @property
  def fits(self) -> bool | None:
    """Whether the step's peak fits memory_bytes (None: no budget)."""
    return None if self.memory_bytes is None else self.step.peak <= self.memory_bytes

  def to_dict(self) -> dict[str, Any]:
    out = self._asdict()
    out['stacks'] = [s._asdict() for s in self.stacks]
    out['step'] = {**self.step._asdict(), 'peak': self.step.peak}
    out['fits'], out['flops_measured'] = self.fits, FLOPS_MEASURED
    return out


def make_stacks_plan(run: assemble.Run, memory_bytes: float | None, batch: dry_run.StepBatch,
                     train_steps: int) -> StacksPlan:
  """The plan of a run of several stacks (assemble.build_run's), whose step takes `batch`."""
  parts, mesh = run.parts, run.parts.mesh
  per_device = parts.num_members // mesh.shape[mesh_lib.MEMBER]
  compiled, _ = dry_run.compile_step(parts, batch, run.form)
  stacks = [_stack_plan(stack, batch) for stack in parts.stacks]
  return StacksPlan(
      num_members=parts.num_members, mesh_shape=dict(mesh.shape),
      platform=mesh.devices.flat[0].platform, stacks=stacks,
      # Each stack's placement counts the one shared step counter: once is its share.
      state_bytes_per_device=(sum(s.state_bytes_per_device for s in stacks)
                              - (len(stacks) - 1) * parts.abstract_state.step.dtype.itemsize),
      step=step_memory(compiled, per_device), memory_bytes=memory_bytes,
      train_steps=train_steps)


def _stack_plan(parts: assemble.Parts, batch: dry_run.StepBatch) -> StackPlan:
  form = member_forms.member_form(parts, batch.size)
  compiled, _ = dry_run.compile_step(parts, batch, form)
  params, state_bytes = sizes.per_member_sizes(parts.abstract_state, parts.num_members)
  return StackPlan(
      name=parts.stack.name, first_member=parts.first_member, count=parts.num_members,
      model_name=parts.stack.model_name,
      model=dict((parts.stack.overrides or {}).get('model', {})), parallelism=form[0],
      params_per_member=params, state_bytes_per_member=state_bytes,
      state_bytes_per_device=sizes.placement_of(parts)['state_bytes_per_device'],
      flops_per_example=sizes.flops_per_example(compiled, parts, batch, form))


def stacks_plan_lines(plan: StacksPlan, data_name: str, batch_size: int) -> str:
  """The lines `dist-ens plan` prints for a run of several stacks."""
  devices = math.prod(plan.mesh_shape.values())
  lines = [
      f'{plan.num_members} members in {len(plan.stacks)} stacks on {data_name}, batch '
      f'{batch_size} per member, {plan.train_steps:,} train steps',
      f'mesh {plan.mesh_shape} over {counted(devices, f"{plan.platform} device")}: every '
      'stack split over all of them, updated in turn inside one step',
      f'  {"stack":<12} {"members":<9} {"model":<28} {"form":<5} {"params/member":>14} '
      f'{"state B/member":>15} {"state B/device":>15} {"FLOPs/example":>14}',
  ]
  for s in plan.stacks:
    model = ', '.join(f'{k}={v}' for k, v in s.model.items()) or s.model_name
    flops = f'{s.flops_per_example:,.0f}' if s.flops_per_example is not None else 'n/a'
    ids = f'{s.first_member}-{s.first_member + s.count - 1}'
    lines.append(f'  {s.name:<12} {ids:<9} {model[:28]:<28} {s.parallelism:<5} '
                 f'{s.params_per_member:>14,} {s.state_bytes_per_member:>15,} '
                 f'{s.state_bytes_per_device:>15,} {flops:>14}')
  lines += [
      f'train FLOPs per example: per member of the stack ({FLOPS_MEASURED})',
      f'state bytes per device         {plan.state_bytes_per_device:>16,}  (every stack\'s)',
      'compiled train step (every stack), bytes per device:',
      *step_memory_lines(plan.step),
  ]
  if plan.memory_bytes is None:
    lines.append(f'memory: this {plan.platform} device reports no size; pass --memory_gb=G '
                 '(the memory of ONE device) to check the peak against it.')
  else:
    lines.append(f'the step\'s peak {"fits" if plan.fits else "does NOT fit"} '
                 f'{plan.memory_bytes / GB:,.2f} GB per device (leave room for evaluation '
                 'and the framework)')
  return '\n'.join(lines)
