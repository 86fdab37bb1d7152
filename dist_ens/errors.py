"""Error types that the entry point turns into one readable message and exit code."""


class ConfigError(ValueError):
  """An invalid config, mesh, dataset or workdir, found before anything compiles."""


class TrainingError(RuntimeError):
  """Training stopped on purpose (e.g. a non-finite member with on_nonfinite='stop')."""


class AgreedConfigError(ConfigError):
  """A ConfigError every process of a multi-process run found from the same gathered data
  (e.g. processes resolved different configs). Each process says it before any exits, so
  no process reads another's exit as a lost peer."""
