"""Staged inputs: every example trained once and in order, a clean end of the
data, no hang at start, end or restore, exact weights for uneven batches."""

import threading
import time

import numpy as np
import pytest
import tensorflow.compat.v1 as tf

import towers

from tests import models

TIMEOUT_MS = 30000


def config():
  cfg = towers.virtual_cpu_config(3)
  cfg.operation_timeout_in_ms = TIMEOUT_MS
  return cfg


def counting_model_fn(scope, x):
  """Loss ``mean(x * w)``: its gradient is the mean of the batch seen."""
  del scope
  w = tf.get_variable("w", [], initializer=tf.ones_initializer())
  return tf.reduce_mean(tf.cast(x, tf.float32) * w), x


def build(dataset, *, split, variable_device="cpu", lr=0.0):
  iterator = tf.data.make_one_shot_iterator(dataset)
  inputs = iterator.get_next() if split else iterator.get_next
  global_step = tf.train.get_or_create_global_step()
  train_op, t = towers.minimize(
      counting_model_fn, tf.train.GradientDescentOptimizer(lr), 2,
      inputs=inputs, devices=["/cpu:1", "/cpu:2"],
      variable_device=variable_device, global_step=global_step,
      stage_inputs=True)
  return train_op, t, global_step


def train_to_the_end(train_op, t, global_step, **session_kwargs):
  """Steps until the session stops; returns what each step's towers saw."""
  steps = []
  with tf.train.MonitoredTrainingSession(config=config(),
                                         **session_kwargs) as sess:
    while not sess.should_stop():
      # Read apart: fetched with the step, it could be read after the update.
      step = sess.run(global_step)
      _, seen, weights, grads = sess.run(
          [train_op, t.outputs, t.weights, t.grads_and_vars[0][0]])
      steps.append((step, [list(s) for s in seen], weights, grads))
  return steps


@pytest.mark.parametrize("variable_device", ["cpu", "replicated"])
@pytest.mark.parametrize("split,size,batch", [
    (True, 23, 8),    # the global batch split; the last one of 7: 4 and 3
    (False, 22, 4),   # a batch per tower; the last step's are 4 and 2
    (False, 24, 4)])
def test_every_example_once_in_order_and_a_clean_end(split, size, batch,
                                                     variable_device):
  with tf.Graph().as_default():
    train_op, t, global_step = build(
        tf.data.Dataset.range(size).batch(batch), split=split,
        variable_device=variable_device)
    steps = train_to_the_end(train_op, t, global_step)
  seen = [x for _, towers_seen, _, _ in steps for s in towers_seen for x in s]
  assert seen == list(range(size))
  assert [s[0] for s in steps] == list(range(len(steps)))
  for _, towers_seen, weights, grad in steps:
    sizes = np.array([len(s) for s in towers_seen], np.float32)
    np.testing.assert_allclose(weights, sizes / sizes.sum(), rtol=1e-6)
    # The averaged gradient is the mean of the whole step's examples.
    examples = [x for s in towers_seen for x in s]
    np.testing.assert_allclose(grad, np.mean(examples), rtol=1e-6)


def test_batches_are_staged_on_the_tower_devices():
  with tf.Graph().as_default() as g:
    build(tf.data.Dataset.range(8).batch(2), split=False)
    stages = {op.name: op.device for op in g.get_operations()
              if op.type in ("Stage", "Unstage")}
    runners = tf.get_collection(tf.GraphKeys.QUEUE_RUNNERS)
  assert len(runners) == 1
  for name, device in stages.items():
    tower = name.split("/")[0]
    assert tower in ("tower_0", "tower_1"), name
    assert device.endswith("CPU:%d" % (int(tower[-1]) + 1)), (name, device)
  assert len(stages) == 4


def test_resume_after_a_restart_stages_again(tmp_path):
  train_dir = str(tmp_path)
  seen = []
  # The input restarts where the checkpoint's step left it: 2 examples a
  # tower per step.
  for stop in (3, 7):
    with tf.Graph().as_default():
      start = tf.train.latest_checkpoint(train_dir)
      first = 0 if start is None else int(start.rsplit("-", 1)[1]) * 4
      train_op, t, global_step = build(
          tf.data.Dataset.range(first, 100).batch(2), split=False, lr=0.01)
      steps = train_to_the_end(
          train_op, t, global_step, checkpoint_dir=train_dir,
          save_checkpoint_steps=1,
          hooks=[tf.train.StopAtStepHook(last_step=stop)])
    seen.extend(steps)
  assert [s[0] for s in seen] == list(range(7))
  flat = [x for _, towers_seen, _, _ in seen for s in towers_seen for x in s]
  assert flat == list(range(28))


def test_plain_session_with_queue_runners_stops_without_hanging():
  # Other tests' threads (their event writers' cached for the process)
  # are not this one's.
  before = threading.active_count()
  with tf.Graph().as_default() as g:
    train_op, t, _ = build(tf.data.Dataset.range(10 ** 9).batch(4),
                           split=True)
    with tf.Session(graph=g, config=config()) as sess:
      sess.run(tf.global_variables_initializer())
      coord = tf.train.Coordinator()
      threads = tf.train.start_queue_runners(sess, coord)
      firsts = []
      for _ in range(3):
        _, seen = sess.run([train_op, t.outputs])
        firsts.append(int(seen[0][0]))
      start = time.time()
      coord.request_stop()
      coord.join(threads, stop_grace_period_secs=10)
  assert firsts == [0, 4, 8]
  assert time.time() - start < 10
  assert not any(th.is_alive() for th in threads)
  assert threading.active_count() <= before


def test_staging_a_placeholder_is_refused():
  with tf.Graph().as_default():
    x = tf.placeholder(tf.float32, [8])
    with pytest.raises(ValueError, match="placeholder.*tf.data"):
      towers.build_towers(counting_model_fn,
                          tf.train.GradientDescentOptimizer(0.1), 2,
                          inputs=x * 2.0, devices=models.devices(2),
                          stage_inputs=True)


def test_staging_without_inputs_is_refused():
  with tf.Graph().as_default():
    with pytest.raises(ValueError, match="stage_inputs.*inputs is None"):
      towers.build_towers(lambda scope: tf.constant(1.0),
                          tf.train.GradientDescentOptimizer(0.1), 2,
                          devices=models.devices(2), stage_inputs=True)


def test_staging_a_callable_that_returns_a_number_is_refused():
  with tf.Graph().as_default():
    with pytest.raises(TypeError, match="stages tensors.*tower_0"):
      towers.build_towers(lambda scope, x: tf.constant(1.0),
                          tf.train.GradientDescentOptimizer(0.1), 2,
                          inputs=lambda: 3, devices=models.devices(2),
                          stage_inputs=True)


def test_a_step_cut_short_by_the_end_of_the_data_stages_nothing():
  # 5 batches for 2 towers: the third step has tower 0's batch only.
  with tf.Graph().as_default():
    train_op, t, global_step = build(tf.data.Dataset.range(10).batch(2),
                                     split=False)
    steps = train_to_the_end(train_op, t, global_step)
  seen = [x for _, towers_seen, _, _ in steps for s in towers_seen for x in s]
  assert seen == list(range(8))
