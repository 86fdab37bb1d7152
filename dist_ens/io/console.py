"""How dist_ens's log lines look on a console: the message alone, as the command line
prints them, also when `dist_ens.train` is called from a Python script."""

import contextlib
import logging as std_logging
import sys
from collections.abc import Iterator


class PlainFormatter(std_logging.Formatter):
  """The lines a researcher reads: the message alone (absl's level, time, thread and
  source line say nothing to them); a warning or error still says it is one."""

  def __init__(self):
    super().__init__('%(message)s')

  def format(self, record: std_logging.LogRecord) -> str:
    text = super().format(record)
    if record.levelno >= std_logging.WARNING:
      return f'{record.levelname.lower()}: {text}'
    return text


def _is_basic(handler: std_logging.Handler) -> bool:
  """A handler logging.basicConfig() made with its defaults (absl calls it on its first
  line where nobody configured logging; importing orbax logs one)."""
  return (type(handler) is std_logging.StreamHandler  # pylint: disable=unidiomatic-typecheck
          and getattr(handler.formatter, '_fmt', None) == std_logging.BASIC_FORMAT)


@contextlib.contextmanager
def plain_lines_unless_configured() -> Iterator[None]:
  """While it is open, log lines print as PlainFormatter's where nobody configured
  Python's logging (a plain script or notebook), not as 'INFO:absl:message', the format
  of the logging.basicConfig() absl calls on its first line. A program that set up its
  own handlers (absl's app.run, pytest, the user's) keeps them as they are."""
  root = std_logging.getLogger()
  if not root.handlers:
    std_logging.basicConfig()  # What absl's first line would do, then made plain below.
  basic = [h for h in root.handlers if _is_basic(h)]
  if len(basic) != len(root.handlers):
    yield
    return
  formatters = [h.formatter for h in basic]
  for h in basic:
    h.setFormatter(PlainFormatter())
  try:
    yield
  finally:
    for h, formatter in zip(basic, formatters):
      h.setFormatter(formatter)


# The log lines that are a run's results (the final tables) carry this, as `extra=RESULT`
# of their logging call. The command line prints them on stdout and the rest (progress,
# warnings, errors) on stderr, so `dist-ens ... > results.md` keeps the results and the
# terminal still shows the progress.
RESULT = {'dist_ens_result': True}


def is_result(record: std_logging.LogRecord) -> bool:
  """Whether `record` is one of a run's results (logged with extra=RESULT)."""
  return getattr(record, 'dist_ens_result', False)


class _StdoutResults(std_logging.StreamHandler):
  """Results on stdout, as PlainFormatter prints them."""

  def __init__(self):
    super().__init__(sys.stdout)
    self.setFormatter(PlainFormatter())
    self.addFilter(is_result)


def _not_result(record: std_logging.LogRecord) -> bool:
  return not is_result(record)


def results_to_stdout(handler: std_logging.Handler) -> None:
  """From now on, results go to stdout and not through `handler` (the console's stderr
  handler: absl's); idempotent."""
  if _not_result not in handler.filters:
    handler.filters.insert(0, _not_result)  # First: before any filter that rewrites msg.
  root = std_logging.getLogger()
  if not any(isinstance(h, _StdoutResults) for h in root.handlers):
    root.addHandler(_StdoutResults())
