"""Error types that the entry point turns into one readable message and exit code."""


class ConfigError(ValueError):
  """An invalid config, mesh, dataset or workdir, found before anything compiles."""


class TrainingError(RuntimeError):
  """Training stopped on purpose (e.g. a non-finite member with on_nonfinite='stop')."""
