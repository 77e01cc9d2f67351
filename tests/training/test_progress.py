"""What a run reports: StepLoggerHook's line and training_summaries."""

import itertools
import re
import types

import numpy as np
import pytest
import tensorflow.compat.v1 as tf

from towers import training
from towers.training import _progress

LINE = r"step %d, loss = %s \(%s examples/sec; %s sec/batch\)"


@pytest.fixture
def clock(monkeypatch):
  """The step logger's clock, one second further at each reading."""
  seconds = itertools.count()
  monkeypatch.setattr(_progress, "time", types.SimpleNamespace(
      time=lambda: float(next(seconds))))


def _log_runs(model, config, runs, **logger_kwargs):
  """Runs the train op `runs` times under a StepLoggerHook of 8 examples
  per step; returns the hook and each run's loss."""
  logger = training.StepLoggerHook(model.t, 8, **logger_kwargs)
  losses = []
  with model.graph.as_default():
    with tf.train.SingularMonitoredSession(hooks=[logger],
                                           config=config) as sess:
      for _ in range(runs):
        losses.append(sess.run([model.train_op, model.t.loss])[1])
  return logger, losses


def _step_lines(logs):
  return [m for m in logs() if m.startswith("step ")]


def test_the_step_line_every_n_steps(tiny_model, config, logs, clock):
  del clock
  logger, losses = _log_runs(tiny_model(), config, 5, every_n_steps=2)
  # Each line: 2 steps in 1 s (8 examples a step), each over 2 towers.
  assert _step_lines(logs) == [
      "step %d, loss = %.2f (16.0 examples/sec; 0.250 sec/batch)"
      % (n, losses[n - 1]) for n in (2, 4)]
  assert logger.step == 5
  assert losses[4] < losses[0]


def test_the_step_line_format_on_a_real_clock(tiny_model, config,
                                              logs):
  _log_runs(tiny_model(), config, 2, every_n_steps=1)
  number = r"\d+\.\d"
  assert [bool(re.fullmatch(LINE % (n, number + r"\d", number,
                                    number + r"\d\d"), line))
          for n, line in enumerate(_step_lines(logs), 1)] == [True] * 2


def test_under_loss_scaling_the_line_ends_with_the_loss_scale(
    tiny_model, config, logs, clock):
  del clock
  # A fixed scale: a dynamic one may change in the step, read before or
  # after it.
  model = tiny_model(compute_dtype="float16", loss_scale=64.0)
  _, losses = _log_runs(model, config, 2, every_n_steps=1)
  assert _step_lines(logs) == [
      "step %d, loss = %.2f (8.0 examples/sec; 0.500 sec/batch), loss scale "
      "= 64" % (n, losses[n - 1]) for n in (1, 2)]


def test_with_accumulated_micro_batches_only_the_runs_that_apply_count(
    tiny_model, config, logs, clock):
  del clock
  model = tiny_model(accumulate_steps=2)
  logger, losses = _log_runs(model, config, 6, every_n_steps=1)
  # Every second run applies: its micro-batch's loss is the one shown.
  assert _step_lines(logs) == [
      "step %d, loss = %.2f (8.0 examples/sec; 0.500 sec/batch)"
      % (n, losses[2 * n - 1]) for n in (1, 2, 3)]
  assert logger.step == 3


def test_a_nan_loss_raises_floating_point_error_naming_the_step(
    tiny_model, config):
  model = tiny_model(learning_rate=1e30)  # Diverges: inf, then NaN.
  logger = training.StepLoggerHook(model.t, 8, every_n_steps=1)
  runs = 0
  with model.graph.as_default():
    with pytest.raises(FloatingPointError) as error:
      with tf.train.SingularMonitoredSession(hooks=[logger],
                                             config=config) as sess:
        for runs in range(1, 21):
          sess.run(model.train_op)
  assert 1 < runs < 20
  assert str(error.value) == (
      "loss is NaN at step %d: training stopped, nothing saved from this "
      "step (lower the learning rate, or check the input); the last "
      "checkpoint is kept" % runs)
  assert logger.step == runs - 1


def test_the_step_logger_needs_a_global_step(tiny_model):
  model = tiny_model(global_step=False)
  with model.graph.as_default():
    with pytest.raises(ValueError, match="StepLoggerHook needs a global "
                       "step: create it with tf.train.get_or_create_global"):
      training.StepLoggerHook(model.t, 8).begin()


def _summary(serialized):
  return {v.tag: v for v in tf.Summary.FromString(serialized).value}


@pytest.mark.parametrize("learning_rate", [0.1, None])
def test_training_summaries_hold_the_loss_learning_rate_and_histograms(
    tiny_model, config, learning_rate):
  model = tiny_model()
  with model.graph.as_default():
    summary_op = training.training_summaries(
        model.t, None if learning_rate is None else tf.constant(0.1))
    with tf.Session(config=config) as sess:
      sess.run(tf.global_variables_initializer())
      _, loss, summary = sess.run([model.train_op, model.t.loss,
                                   summary_op])
  values = _summary(summary)
  # The final tower's own summaries, the variables' tags exactly their
  # names.
  assert sorted(values) == sorted(
      ["tower_1/targets", "loss", "w", "w/gradients", "b", "b/gradients"]
      + ([] if learning_rate is None else ["learning_rate"]))
  assert values["loss"].simple_value == pytest.approx(loss)
  if learning_rate is not None:
    assert values["learning_rate"].simple_value == pytest.approx(0.1)
  assert values["w"].histo.num == values["w/gradients"].histo.num == 3
  assert values["b/gradients"].histo.num == 1


@pytest.mark.parametrize("loss_scale,finite", [(2.0 ** 40, 0), (1.0, 3)])
def test_under_loss_scaling_gradient_histograms_hold_the_finite_values(
    tiny_model, config, loss_scale, finite):
  # A scale of 2**40 overflows every float16 gradient: the step is skipped,
  # and its summaries must not fail on the infinite gradients.
  model = tiny_model(compute_dtype="float16", loss_scale=loss_scale)
  with model.graph.as_default():
    summary_op = training.training_summaries(model.t, tf.constant(0.1))
    w = [v for v in tf.global_variables() if v.op.name == "w"][0]
    with tf.Session(config=config) as sess:
      sess.run(tf.global_variables_initializer())
      _, summary = sess.run([model.train_op, summary_op])
      w_value, global_step = sess.run([w, model.global_step])
  values = _summary(summary)
  assert values["loss_scale"].simple_value == loss_scale
  assert values["w/gradients"].histo.num == finite
  assert values["w"].histo.num == 3
  skipped = not finite
  assert global_step == (0 if skipped else 1)
  assert (not np.any(w_value)) == skipped  # Zeros unless it applied.


def test_with_accumulated_micro_batches_the_runs_that_apply_write_gradients(
    tiny_model, config):
  model = tiny_model(accumulate_steps=2)
  with model.graph.as_default():
    summary_op = training.training_summaries(model.t)
    with tf.Session(config=config) as sess:
      sess.run([tf.global_variables_initializer(),
                tf.local_variables_initializer()])
      runs = [sess.run([model.train_op, model.t.applies, summary_op])[1:]
              for _ in range(4)]
  assert [bool(applies) for applies, _ in runs] == [False, True] * 2
  for applies, summary in runs:
    tags = set(_summary(summary))
    assert {"loss", "w", "b"} <= tags
    assert ("w/gradients" in tags) == bool(applies), tags
