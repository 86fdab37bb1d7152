"""`dist-ens plan` for a run with member groups (config.ensemble.groups).

Every group is split over all devices and updated in turn inside one compiled step
(docs/groups.md), so a device holds every group's state at once. The plan prices each
group on its own (parameters, state bytes and train FLOPs per member, state bytes per
device by the group's layout, the member form its step runs with) and measures the one
compiled step whole: its arguments, temporaries and peak per device are what the run
needs. The largest M of a plan without groups (one architecture grown) has no single
meaning here; a memory budget is checked against the step's peak instead.
"""

import math
from typing import Any, NamedTuple

import ml_collections

from dist_ens.run import member_forms
from dist_ens.run import assemble
from dist_ens.config import groups as member_groups
from dist_ens.io.tables import counted
from dist_ens.parallel import mesh as mesh_lib
from dist_ens.plan import dry_run, sizes
from dist_ens.plan.dry_run import StepMemory, step_memory
from dist_ens.plan.text import FLOPS_MEASURED, GB, step_memory_lines


class GroupPlan(NamedTuple):
  """One group's members, priced on their own."""
  name: str
  first_member: int
  count: int
  model: dict[str, Any]  # the group's overrides of config.model
  parallelism: str  # the member form its part of the step runs with
  params_per_member: int
  state_bytes_per_member: int
  state_bytes_per_device: int
  flops_per_example: float | None  # train FLOPs per member-example (None: no cost analysis)


class GroupsPlan(NamedTuple):
  """A run with member groups: each group's plan and the joint step's memory."""
  num_members: int
  mesh_shape: dict[str, int]
  platform: str
  groups: list[GroupPlan]
  state_bytes_per_device: int  # every group's, as the joint state lies on the mesh
  step: StepMemory  # the one compiled step that updates every group
  memory_bytes: float | None
  train_steps: int

  @property
  def fits(self) -> bool | None:
    """Whether the step's peak fits memory_bytes (None: no budget)."""
    return None if self.memory_bytes is None else self.step.peak <= self.memory_bytes

  def to_dict(self) -> dict[str, Any]:
    out = self._asdict()
    out['groups'] = [g._asdict() for g in self.groups]
    out['step'] = {**self.step._asdict(), 'peak': self.step.peak}
    out['fits'], out['flops_measured'] = self.fits, FLOPS_MEASURED
    return out


def make_groups_plan(config: ml_collections.ConfigDict, run: assemble.Run,
                     memory_bytes: float | None, batch: dry_run.StepBatch) -> GroupsPlan:
  """The plan of a run with groups, built by assemble.build_run, whose step takes `batch`."""
  parts, mesh = run.parts, run.parts.mesh
  per_device = config.num_members // mesh.shape[mesh_lib.MEMBER]
  compiled, _ = dry_run.compile_step(parts, batch, run.form)
  groups = []
  for spec, g in zip(member_groups.group_specs(config), parts.stacks):
    one = member_groups.group_config(config, spec)
    rebuild = lambda m, one=one, g=g: assemble.build_parts(
        one, g.mesh, g.input_shape, g.num_outputs, num_members=m)
    groups.append(_group_plan(spec, g, batch, rebuild))
  return GroupsPlan(
      num_members=config.num_members, mesh_shape=dict(mesh.shape),
      platform=mesh.devices.flat[0].platform, groups=groups,
      # Each group's placement counts the one shared step counter: once is its share.
      state_bytes_per_device=(sum(g.state_bytes_per_device for g in groups)
                              - (len(groups) - 1) * parts.abstract_state.step.dtype.itemsize),
      step=step_memory(compiled, per_device), memory_bytes=memory_bytes,
      train_steps=config.train.steps)


def _group_plan(spec: member_groups.GroupSpec, parts: assemble.Parts, batch: dry_run.StepBatch,
                rebuild: Any) -> GroupPlan:
  form = member_forms.member_form(parts, batch.size)
  compiled, _ = dry_run.compile_step(parts, batch, form)
  params, state_bytes = sizes.per_member_sizes(parts.abstract_state, spec.group.count)
  return GroupPlan(
      name=spec.name, first_member=spec.group.first, count=spec.group.count,
      model=dict(spec.model), parallelism=form[0], params_per_member=params,
      state_bytes_per_member=state_bytes,
      state_bytes_per_device=sizes.placement_of(parts)['state_bytes_per_device'],
      flops_per_example=sizes.flops_per_example(compiled, parts, batch, form, rebuild))


def format_groups_plan(plan: GroupsPlan, config: ml_collections.ConfigDict) -> str:
  """The lines `dist-ens plan` prints for a run with groups."""
  s = plan.step
  devices = math.prod(plan.mesh_shape.values())
  lines = [
      f'{plan.num_members} members in {len(plan.groups)} groups on {config.data.name}, batch '
      f'{config.data.batch_size} per member, {plan.train_steps:,} train steps',
      f'mesh {plan.mesh_shape} over {counted(devices, f"{plan.platform} device")}: every '
      'group split over all of them, updated in turn inside one step',
      f'  {"group":<12} {"members":<9} {"model":<28} {"form":<5} {"params/member":>14} '
      f'{"state B/member":>15} {"state B/device":>15} {"FLOPs/example":>14}',
  ]
  for g in plan.groups:
    model = ', '.join(f'{k}={v}' for k, v in g.model.items()) or config.model.name
    flops = f'{g.flops_per_example:,.0f}' if g.flops_per_example is not None else 'n/a'
    ids = f'{g.first_member}-{g.first_member + g.count - 1}'
    lines.append(f'  {g.name:<12} {ids:<9} {model[:28]:<28} {g.parallelism:<5} '
                 f'{g.params_per_member:>14,} {g.state_bytes_per_member:>15,} '
                 f'{g.state_bytes_per_device:>15,} {flops:>14}')
  lines += [
      f'train FLOPs per example: per member of the group ({FLOPS_MEASURED})',
      f'state bytes per device         {plan.state_bytes_per_device:>16,}  (every group\'s)',
      'compiled train step (every group), bytes per device:',
      *step_memory_lines(s),
  ]
  if plan.memory_bytes is None:
    lines.append(f'memory: this {plan.platform} device reports no size; pass --memory_gb=G '
                 '(the memory of ONE device) to check the peak against it.')
  else:
    lines.append(f'the step\'s peak {"fits" if plan.fits else "does NOT fit"} '
                 f'{plan.memory_bytes / GB:,.2f} GB per device (leave room for evaluation '
                 'and the framework)')
  return '\n'.join(lines)
