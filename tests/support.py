"""What tests share: the XLA flags every test process (this one and the children it starts)
runs with."""

# Tests compile hundreds of small programs and run each for a few steps: XLA:CPU's
# compilation is most of the suite's time (a two-step regression run: 18 s of its 23 s).
# XLA:CPU's older (non-MLIR) fusion emitters compile them faster (that run: 20.7 s ->
# 16.5 s), and every bit-exact comparison across meshes and processes still holds.
# LLVM at -O0 (--xla_backend_optimization_level=0) would add more (12.0 s with both) but
# changes bits those comparisons check, so it is left out. Runs and benchmarks outside
# the tests keep XLA's defaults.
FAST_COMPILE = ('--xla_cpu_use_fusion_emitters=false',)


def xla_flags(devices: int) -> str:
  """XLA_FLAGS for a test process with `devices` fake CPU devices."""
  return ' '.join((f'--xla_force_host_platform_device_count={devices}', *FAST_COMPILE))
