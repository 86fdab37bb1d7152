"""Progress on the console: a tqdm bar on a terminal, plain log lines otherwise."""

import os
import sys
from typing import IO

import jax

from dist_ens.io.writers import is_writer
import numpy as np
from absl import logging


class _BarSafeStream:
  """A stream whose writes clear and redraw the progress bars on the same terminal."""

  def __init__(self, stream: IO[str]):
    self._stream = stream

  def write(self, text: str) -> None:
    from tqdm import tqdm  # pylint: disable=g-import-not-at-top
    tqdm.write(text, file=self._stream, end='')

  def flush(self) -> None:
    self._stream.flush()

  # absl compares its handler's stream with sys.stderr to avoid echoing a record
  # there twice; the wrapper must still count as the stream it wraps.
  def __eq__(self, other: object) -> bool:
    return other is self or other is self._stream

  def __hash__(self) -> int:
    return hash(self._stream)


class Progress:
  """A progress bar on an interactive terminal; plain log lines otherwise.

  `update(step, line)` moves the bar to `step` (cheap: call it every step) and, when
  `line` is given, logs it; on a terminal the bar stays below the log lines (absl's
  log stream is routed around it while the bar lives). Off a terminal, on processes
  other than 0, or with enabled=False there is no bar, only the log lines.

  Example:
    progress = Progress(total_steps=2000, start_step=0)
    for step in range(1, 2001):
      ...
      progress.update(step, line=f'step {step} loss ...' if step % 250 == 0 else None)
    progress.close()
  """

  def __init__(self, total_steps: int, start_step: int = 0, stream: IO[str] | None = None,
               enabled: bool | None = None):
    stream = sys.stderr if stream is None else stream
    if enabled is None:
      enabled = is_writer() and hasattr(stream, 'isatty') and stream.isatty()
    self._bar = None
    self._handler, self._handler_stream = None, None
    if not enabled:
      return
    from tqdm import tqdm  # pylint: disable=g-import-not-at-top
    # tqdm hides its bar on a terminal that reports a size of 0 x 0 (a pty nobody
    # sized, as under `script` or some IDE consoles): give such a one a fixed size.
    size = {}
    try:
      if os.get_terminal_size(stream.fileno()).columns == 0:
        size = {'ncols': 100, 'nrows': 40}
    except (AttributeError, OSError, ValueError):
      pass
    self._bar = tqdm(total=total_steps, initial=start_step, file=stream, unit='step',
                     dynamic_ncols=not size, leave=True, **size)
    handler = getattr(logging.get_absl_handler(), 'python_handler', None)
    if handler is not None and getattr(handler, 'stream', None) is stream:
      self._handler, self._handler_stream = handler, stream
      handler.stream = _BarSafeStream(stream)

  def update(self, step: int, line: str | None = None, postfix: str | None = None) -> None:
    """Moves the bar to `step`; logs `line`; shows `postfix` (e.g. the last loss, accuracy
    and member-examples/s) at the bar's end."""
    if self._bar is not None and step > self._bar.n:
      self._bar.update(step - self._bar.n)
    if self._bar is not None and postfix is not None:
      self._bar.set_postfix_str(postfix, refresh=False)
    if line is not None:
      prefix = f'[process {jax.process_index()}] ' if jax.process_count() > 1 else ''
      logging.info('%s%s', prefix, line)

  def close(self) -> None:
    if self._bar is not None:
      self._bar.close()
      self._bar = None
    if self._handler is not None:
      self._handler.stream = self._handler_stream
      self._handler = None


def _duration(seconds: float) -> str:
  seconds = int(round(seconds))
  return f'{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}'


# Short names of the task's batch metrics in progress lines.
_SHORT = {'accuracy': 'acc'}


def metrics_text(batch_metrics: dict[str, np.ndarray]) -> str:
  """'acc 0.812': each of the task's batch metrics, the mean over members, 3 decimals."""
  return '  '.join(f'{_SHORT.get(k, k)} {v.mean():.3f}' for k, v in batch_metrics.items())


def progress_line(step: int, total: int, loss: np.ndarray, batch_metrics: dict[str, np.ndarray],
                  examples_per_s: float, eta_s: float, input_demand_per_s: float | None = None,
                  input_capacity_per_s: float | None = None) -> str:
  """One log line: step, member loss mean/min/max, the task's batch metrics (train
  accuracy), throughput, ETA.

  With the input figures, at debug verbosity (dist-ens --verbose): the examples per
  second the step consumed and the rate the input pipeline could deliver (its examples
  per second of busy time), a detail only someone tuning the input needs.
  """
  line = (f'step {step}/{total}  loss mean {loss.mean():.4f} min {loss.min():.4f} '
          f'max {loss.max():.4f}  {metrics_text(batch_metrics)}  '
          f'{examples_per_s:,.0f} member-examples/s  ETA {_duration(eta_s)}')
  if (input_demand_per_s is not None and input_capacity_per_s is not None
      and logging.level_debug()):
    line += (f'  input: step takes {input_demand_per_s:,.0f} ex/s, pipeline gives '
             f'{input_capacity_per_s:,.0f} ex/s')
  return line
