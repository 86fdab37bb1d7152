"""A distilled student loaded from its workdir (config.distill.student; workdir/student.npz,
dist_ens.io.student_file): one network on the default device, predicting with the mean
of its heads' probabilities.

  student = dist_ens.Ensemble.load('/tmp/run').student()
  out = student.predict(raw_x)            # out.probs [N, C], out.head_probs [H, N, C]
"""

from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from dist_ens.core.model import Model, init_shapes
from dist_ens.ensembles import students
from dist_ens.eval.evaluate import pad_rows, padded_chunks
from dist_ens.io import student_file


class StudentPrediction(NamedTuple):
  """The student's prediction for N inputs (numpy)."""
  probs: np.ndarray  # [N, C] the mean of its heads' probabilities
  log_probs: np.ndarray  # [N, C] their log, computed stably (what the run's NLL uses)
  head_probs: np.ndarray  # [H, N, C] every head's probabilities (H = 1 but for hydra)


class Student:
  """A distilled student: `predict(x)` like Ensemble.predict, from one network.

  Attributes:
    net: its functions (dist_ens.ensembles.students.StudentNet).
    params, state: its variables (numpy pytrees).
    meta: what student.npz says of it (kind, heads, step, temperature, shapes).
  """

  def __init__(self, net: students.StudentNet, params: Any, state: Any, meta: dict[str, Any],
               preprocess: Callable[[np.ndarray], np.ndarray], batch_size: int):
    self.net, self.params, self.state, self.meta = net, params, state, meta
    self.preprocess, self.batch_size = preprocess, batch_size

    def forward(params, state, x):
      logits, _ = net.heads(params, state, x, train=False)
      head_log_probs = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
      return net.log_probs(params, state, x), jnp.exp(head_log_probs)

    self._forward = jax.jit(forward)

  def predict(self, x: np.ndarray, batch_size: int | None = None, *,
              preprocessed: bool = False) -> StudentPrediction:
    """The student's probabilities for a batch of any size.

    Args:
      x: [N, ...] raw inputs (as Ensemble.predict takes them), or model inputs with
        preprocessed=True (a split of dist_ens.data.load_dataset).
      batch_size: examples per call (default the run's eval.batch_size); the last
        chunk is padded to a power of two, so few sizes compile.
    """
    x = np.asarray(x) if preprocessed else self.preprocess(x)
    if np.issubdtype(x.dtype, np.floating):
      x = x.astype(np.float32)
    if len(x) == 0:
      raise ValueError('Student.predict() got an empty batch; pass at least one input.')
    size = int(batch_size or self.batch_size)
    log_probs, heads = [], []
    for start, valid in padded_chunks(len(x), size):
      rows = size if valid == size else 1 << max(valid - 1, 0).bit_length()
      lp, hp = self._forward(self.params, self.state, pad_rows(x[start:start + valid], rows))
      log_probs.append(np.asarray(lp)[:valid])
      heads.append(np.asarray(hp)[:, :valid])
    log_probs = np.concatenate(log_probs)
    return StudentPrediction(np.exp(log_probs), log_probs, np.concatenate(heads, axis=1))


def load_student(workdir: str | Path, member_model: Model,
                 preprocess: Callable[[np.ndarray], np.ndarray], batch_size: int) -> Student:
  """The student saved in `workdir` by a run whose single member is `member_model`.

  Raises:
    FileNotFoundError: the run distilled no student (one line, naming the field).
  """
  meta = student_file.read_meta(Path(workdir))
  if meta is None:
    raise FileNotFoundError(f'{Path(workdir) / student_file.FILE} does not exist: the run '
                            "distilled no student; train with distill.student='same' (or "
                            "'hydra', or an import path; rerunning a finished run's command "
                            'with it distils without retraining).')
  net = students.make_student(meta['kind'], member_model, meta['num_outputs'],
                              meta['num_heads'])
  sample = jax.ShapeDtypeStruct((1, *meta['input_shape']), np.dtype(meta['input_dtype']))
  shapes = init_shapes(net, sample)
  params, state = student_file.read_variables(Path(workdir), *shapes)
  return Student(net, params, state, meta, preprocess, batch_size)
