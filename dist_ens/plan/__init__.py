"""dist-ens plan: memory per device and the largest M that fits, before a run (planner.py);
on a CPU a dry run of the step in its own process (dry_run.py, host_memory.py); and
`--calibrate`, which times the member forms on this device (calibration.py); a run of
several stacks: each stack priced and the joint step measured (stacks_plan.py)."""

from dist_ens.plan import calibration, dry_run, host_memory, stacks_plan
from dist_ens.plan.planner import (FLOPS_MEASURED, GB, KNOWN_SHAPES, KNOWN_TRAIN_EXAMPLES, Plan,
                                   calibrate, data_shape, device_memory_bytes, format_plan,
                                   main, make_plan, train_examples)

__all__ = ['FLOPS_MEASURED', 'GB', 'KNOWN_SHAPES', 'KNOWN_TRAIN_EXAMPLES', 'Plan', 'calibrate',
           'calibration', 'data_shape', 'device_memory_bytes', 'dry_run', 'format_plan',
           'host_memory', 'main', 'make_plan', 'stacks_plan', 'train_examples']
