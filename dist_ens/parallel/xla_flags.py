"""The XLA flags reproducible mode (config.reproducible) needs, set before JAX's backend starts.

Reproducible mode gives every member one fixed per-member program (core/step.py), but
XLA still compiles the programs around it differently for different meshes, and two
backend choices then change the last bit of a result:

* CPU: LLVM fuses a multiply and an add into one FMA instruction (one rounding instead
  of two) wherever instruction selection sees the pair, which depends on the fusion
  around it. Measured on x86-64: one Adam step on 1 device vs on 8 devices differs by
  3e-8 from step 2 on with AVX2 (FMA) code, and is bit-identical with
  --xla_cpu_max_isa=AVX (no FMA instructions). There is no flag that turns off only
  the contraction.
* GPU: scatter-adds and some reductions use atomics unless deterministic ops are
  asked for.

XLA reads XLA_FLAGS once, when the first backend starts; `set_flags` must run before
that (the command line does it first thing). `missing` tells a running process what
it lacks, so a Python caller who set nothing gets a warning that says what to set.
"""

import os
import platform

# x86-64 only: --xla_cpu_max_isa names x86 ISAs.
_CPU_FLAGS = ('--xla_cpu_max_isa=AVX',)
_GPU_FLAGS = ('--xla_gpu_deterministic_ops=true',)


def flags_for(machine: str | None = None) -> tuple[str, ...]:
  """The flags reproducible mode sets on this machine (every backend's: XLA reads the
  ones of the backend it starts)."""
  machine = (machine or platform.machine()).lower()
  cpu = _CPU_FLAGS if machine in ('x86_64', 'amd64') else ()
  return cpu + _GPU_FLAGS


def missing(xla_flags: str | None = None, machine: str | None = None) -> list[str]:
  """The flags of flags_for(machine) that xla_flags (default: $XLA_FLAGS) lacks; a flag
  counts as present when its name is there with any value."""
  present = (os.environ.get('XLA_FLAGS', '') if xla_flags is None else xla_flags).split()
  names = {f.split('=', 1)[0] for f in present}
  return [f for f in flags_for(machine) if f.split('=', 1)[0] not in names]


def set_flags() -> list[str]:
  """Appends the missing flags to $XLA_FLAGS (before any backend starts) and returns them."""
  added = missing()
  if added:
    os.environ['XLA_FLAGS'] = ' '.join([os.environ.get('XLA_FLAGS', ''), *added]).strip()
  return added


def warning(platform_name: str) -> str | None:
  """What a reproducible run on `platform_name` lacks, as one line, or None."""
  lacking = [f for f in missing() if f.startswith(f'--xla_{platform_name}_')]
  if not lacking:
    return None
  return (f'config.reproducible=True on {platform_name} without XLA_FLAGS {" ".join(lacking)}: '
          'members are reproducible on this mesh but may differ in the last bit on another '
          'mesh or device count. The dist-ens command sets them; from Python, set '
          f'os.environ["XLA_FLAGS"] += " {" ".join(lacking)}" before JAX starts.')
