"""What tests share: the XLA flags every test process (this one and the children it starts)
runs with."""

# Tests compile hundreds of small programs and run each for a few steps: XLA:CPU's
# compilation is most of the suite's time. LLVM at -O0 and the older (non-MLIR) fusion
# emitters compile those programs about 1.7x faster (a two-step regression run: 20.7 s ->
# 12.0 s on the 2-core CI machine). Results stay IEEE float32 (no fast-math); programs
# only run slower, which tiny test models do not notice. Runs and benchmarks outside the
# tests keep XLA's defaults.
FAST_COMPILE = ('--xla_cpu_use_fusion_emitters=false',)


def xla_flags(devices: int) -> str:
  """XLA_FLAGS for a test process with `devices` fake CPU devices."""
  return ' '.join((f'--xla_force_host_platform_device_count={devices}', *FAST_COMPILE))
