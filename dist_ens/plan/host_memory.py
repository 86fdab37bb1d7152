"""This process's resident memory, from Linux's /proc/self (None or False elsewhere).

A CPU device's buffers live in the host's memory, beside the compiled programs XLA:CPU
loads into the process (which its memory analysis does not count): `dist-ens plan`
measures those programs and a dry run of the step with these readings on a CPU
(dist_ens/plan/dry_run.py).
"""

STATUS = '/proc/self/status'


def status_bytes(field: str = 'VmRSS') -> int | None:
  """VmRSS (resident now), VmHWM (peak resident), RssAnon or RssFile of this process, in
  bytes; None where /proc is not there (not Linux)."""
  try:
    with open(STATUS) as f:
      for line in f:
        if line.startswith(field + ':'):
          return int(line.split()[1]) * 1024
  except OSError:
    return None
  raise KeyError(f'{field!r} is not a field of {STATUS}')


def reset_peak() -> bool:
  """Resets VmHWM to the present RSS (Linux >= 4.0); False where that is refused."""
  try:
    with open('/proc/self/clear_refs', 'w') as f:
      f.write('5')
    return True
  except OSError:
    return False


def available_bytes() -> int | None:
  """The memory the host can still give processes (MemAvailable), in bytes; None where
  /proc/meminfo is not there."""
  try:
    with open('/proc/meminfo') as f:
      for line in f:
        if line.startswith('MemAvailable:'):
          return int(line.split()[1]) * 1024
  except OSError:
    return None
  return None
