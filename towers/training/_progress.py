"""What a run reports: the tutorial's step line, and the training summaries."""

import math
import time
from typing import Any, Dict, List, Optional

import tensorflow.compat.v1 as tf

import towers


def training_summaries(t: towers.Towers,
                       learning_rate: Optional[tf.Tensor] = None) -> Any:
  """Merges the towers' summaries, the loss and the variables' histograms.

  The final tower's summaries (`towers.Towers.summaries`), scalars of the
  loss, `learning_rate` (when given) and the loss scale (with one), and a
  histogram of each variable and of its averaged gradient, tagged with the
  variable's name. Under loss scaling a gradient's histogram holds its
  finite values only (an overflow step is skipped, not an error). With
  accumulated micro-batches the gradients' histograms are written by the
  runs that apply them. Pass the result as `train`'s ``summary_op`` (or the
  scaffold's): it runs in the same `sess.run` as the step, reading no extra
  batch. With several losses it is a dict by key, each key's to run with its
  own train op (`learning_rate` in the last key's).

  Args:
    t: the `towers.Towers` of `towers.minimize` (or of `build_towers`, whose
      ``grads_and_vars`` are then per tower's first).
    learning_rate: a scalar tensor, or None.

  Returns:
    A string tensor: the merged ``Summary``; a dict of them by key with
    several losses.
  """
  # Explicit tags: tf.summary.* derive the tag from a uniquified op name, so
  # a tag equal to an existing op's name ("conv1/weights") would become
  # "conv1/weights_1".
  with tf.name_scope("training_summaries"):
    losses = _by_loss(t.loss)
    tower_summaries = _by_loss(t.summaries)
    scales = {} if t.loss_scale is None else _by_loss(t.loss_scale)
    pairs = _by_loss(t.grads_and_vars or {key: [] for key in losses})
    merged = {}
    for key in losses:
      summaries = list(tower_summaries[key])
      if learning_rate is not None and key == list(losses)[-1]:
        summaries.append(_scalar("learning_rate", learning_rate))
      for name, values in (("loss", losses), ("loss_scale", scales)):
        if key in values:
          summaries.append(_scalar(
              name if key is None else "%s/%s" % (name, key), values[key]))
      summaries.extend(_histograms(t, pairs[key], key in scales))
      merged[key] = tf.summary.merge(summaries)
    return merged[None] if list(merged) == [None] else merged


def _histograms(t: towers.Towers, pairs, scaled: bool) -> List[tf.Tensor]:
  """Each variable's histogram and its averaged gradient's."""
  summaries, gradients = [], []
  for grad, var in pairs:
    summaries.append(_histogram(var.op.name, var))
    if grad is not None:
      values = grad.values if isinstance(grad, tf.IndexedSlices) else grad
      if scaled:
        values = tf.boolean_mask(values, tf.is_finite(values))
      gradients.append((var.op.name + "/gradients", values))

  def gradient_histograms() -> List[tf.Tensor]:
    return [_histogram(tag, values) for tag, values in gradients]

  applies = _applies(t)
  if applies is None or not gradients:
    return summaries + gradient_histograms()
  # An empty Summary where the run does not apply.
  return summaries + [tf.cond(
      applies, lambda: tf.summary.merge(gradient_histograms()),
      lambda: tf.constant(b""))]


def _by_loss(value) -> Dict[Optional[str], Any]:
  """`value` by loss: a dict of several losses' as it is, else ``{None:
  value}``."""
  return dict(value) if isinstance(value, dict) else {None: value}


def _applies(t: towers.Towers) -> Optional[tf.Tensor]:
  """`t.applies` where it varies by run (accumulation), else None."""
  if t.applies is None or tf.get_static_value(t.applies) is not None:
    return None
  return t.applies


def _scalar(tag: str, value: tf.Tensor) -> tf.Tensor:
  return tf.raw_ops.ScalarSummary(tags=tag, values=value)


def _histogram(tag: str, values) -> tf.Tensor:
  return tf.raw_ops.HistogramSummary(tag=tag, values=values)


class StepLoggerHook(tf.train.SessionRunHook):
  """Logs the tutorial's step line every few steps; stops on a NaN loss.

  ``step %d, loss = %.2f (%.1f examples/sec; %.3f sec/batch)``: examples/sec
  counts `examples_per_step`, and sec/batch is the step's time over the
  number of towers, as in the tutorial. Under loss scaling the line ends
  with ``, loss scale = %g``; several losses show as ``loss d = %.2f, g =
  %.2f``: the last key's from the run this hook sees, the others' as
  `record` gets them. With accumulated micro-batches a step is a run
  that applies an update (`towers.Towers.applies`), and the loss is that
  run's micro-batch's. Needs the graph's global step. Logs through
  TensorFlow's logger: ``tf.logging.set_verbosity(tf.logging.INFO)`` shows it.

  Args:
    t: the `towers.Towers` trained (its loss, loss scale, applies, devices).
    examples_per_step: the examples of one update, over all towers.
    every_n_steps: steps between two lines.
    count_locally: count this process's own steps (from the restored global
      step); False in a parameter-server cluster, where every worker
      advances the global step, which is then the step shown.

  Raises:
    FloatingPointError: from the run whose loss is NaN, before the hooks
      after this one (a saver placed there saves nothing of that run).
  """

  def __init__(self, t: towers.Towers, examples_per_step: float, *,
               every_n_steps: int = 10, count_locally: bool = True):
    self._applies = _applies(t)
    losses = _by_loss(t.loss)
    # Each key's loss as fetched with its own train op: the last key's in
    # the run hooked, the others' from their own runs (`record`).
    self._last = list(losses)[-1]
    self._loss = losses[self._last]
    self._recorded: Dict[Optional[str], Any] = {}
    self._loss_scale = t.loss_scale
    self._global_step = None
    self._examples_per_step = examples_per_step
    self._num_towers = len(t.devices)
    self._every = every_n_steps
    self._count_locally = count_locally
    self._step = 0
    self._runs = 0
    self._start = None

  @property
  def step(self) -> int:
    """The global step after the last step this hook saw."""
    return self._step

  def record(self, losses: Dict[Any, Any]) -> None:
    """Takes this step's losses of keys before the last, each fetched with
    its own train op (`train` passes them); raises FloatingPointError for a
    NaN one."""
    self._check(losses)
    self._recorded.update(losses)

  def _check(self, losses: Dict[Optional[str], Any]) -> None:
    for key, value in losses.items():
      if math.isnan(float(value)):
        raise FloatingPointError(
            "loss%s is NaN at step %d: training stopped, nothing saved from "
            "this step (lower the learning rate, or check the input); the "
            "last checkpoint is kept"
            % ("" if key is None else " %r" % (key,), self._step + 1))

  def begin(self):
    self._global_step = tf.train.get_global_step()
    if self._global_step is None:
      raise ValueError("StepLoggerHook needs a global step: create it with "
                       "tf.train.get_or_create_global_step() before the "
                       "session")

  def after_create_session(self, session, coord):
    # The step the run resumes from (see after_run for how it goes on).
    self._step = int(session.run(self._global_step))
    self._start = time.time()

  def before_run(self, run_context):
    fetches = {"loss": self._loss, "global_step": self._global_step}
    if self._applies is not None:
      fetches["applies"] = self._applies
    if self._loss_scale is not None:
      fetches["loss_scale"] = self._loss_scale
    return tf.train.SessionRunArgs(fetches)

  def after_run(self, run_context, run_values):
    loss, global_step = (run_values.results[k]
                         for k in ("loss", "global_step"))
    applied = run_values.results.get("applies", True)
    loss_scale = run_values.results.get("loss_scale")
    losses = {**self._recorded, self._last: loss}
    self._check(losses)
    if not applied:
      return
    # Alone, a process counts its own steps (the global step it fetched may
    # be read before or after this step's increment). In a cluster other
    # workers advance the global step too, so that is the count to show.
    self._runs += 1
    self._step = self._step + 1 if self._count_locally else int(global_step)
    if self._runs % self._every == 0:
      duration = (time.time() - self._start) / self._every
      self._start = time.time()
      tf.logging.info("step %d, %s (%.1f examples/sec; %.3f sec/batch)%s",
                      self._step, _values("loss", losses, "%.2f"),
                      self._examples_per_step / duration,
                      duration / self._num_towers,
                      "" if loss_scale is None else
                      ", " + _values("loss scale", _by_loss(loss_scale), "%g"))


def _values(name: str, values: Dict[Optional[str], Any], spec: str) -> str:
  """``loss = 0.12``, or for several losses ``loss d = 0.12, g = 3.40``."""
  if list(values) == [None]:
    return ("%s = " + spec) % (name, values[None])
  return "%s %s" % (name, ", ".join(("%s = " + spec) % (key, value)
                                     for key, value in values.items()))
