"""Replicated copies start from copy 0 whatever the start-up's order.

A checkpoint is restored into replicated towers in each way TF1 programs
start: the initializers in one ``sess.run`` or two, before ``saver.restore``;
``tf.train.init_from_checkpoint``; ``MonitoredTrainingSession`` resuming a
``checkpoint_dir``; a ``Scaffold``'s ``init_fn``. The three steps that follow
must be one device's from the same checkpoint, and every copy (and every
copy's Momentum slot) must equal copy 0 after them. The checkpoint is two
Momentum steps in, so copy 0's weights and slots differ from their initial
values: a copy that missed the restore trains on other weights.
"""

import contextlib
import os

import numpy as np
import pytest
import tensorflow.compat.v1 as tf

import towers
from models import batch, devices, initial_values, model_fn

NUM, STEPS = 2, 3
ALL_REDUCE = ["add_n", "ring", "collective"]


def _config():
  config = towers.virtual_cpu_config(NUM)
  config.operation_timeout_in_ms = 30000
  return config


def _optimizer():
  return tf.train.MomentumOptimizer(0.1, 0.9)


def _build(num, all_reduce="auto", **kwargs):
  x, y = batch(8)
  step = tf.train.get_or_create_global_step()
  if num == 1:
    return towers.minimize(model_fn(True), _optimizer(), 1,
                           inputs=(tf.constant(x), tf.constant(y)),
                           devices=devices(1), global_step=step, **kwargs)
  return towers.minimize(model_fn(True), _optimizer(), num,
                         inputs=(tf.constant(x), tf.constant(y)),
                         devices=devices(num), global_step=step,
                         variable_device="replicated", all_reduce=all_reduce,
                         **kwargs)


def _values():
  return {v.op.name: v for v in tf.global_variables() + tf.local_variables()
          if v.dtype.base_dtype != tf.bool}


@pytest.fixture(scope="module", name="checkpoint")
def _checkpoint(tmp_path_factory):
  """A one-device checkpoint two steps in, and one device's next steps."""
  path = str(tmp_path_factory.mktemp("one_device") / "model.ckpt")
  with tf.Graph().as_default():
    train_op, t = _build(1)
    saver = tf.train.Saver()
    with tf.Session(config=_config()) as sess:
      sess.run(tf.global_variables_initializer())
      for _ in range(2):
        sess.run(train_op)
      saver.save(sess, path)
      losses, values = _train(sess, train_op, t)
      del values["global_step"]
  return path, losses, values


@contextlib.contextmanager
def _restored(path):
  """A session of the default graph: both initializers in one run, as TF1
  programs often start, then a restore of `path`."""
  init = tf.group(tf.global_variables_initializer(),
                  tf.local_variables_initializer())
  saver = tf.train.Saver()
  with tf.Session(config=_config()) as sess:
    sess.run(init)
    saver.restore(sess, path)
    yield sess


def _train(sess, train_op, t):
  """`STEPS` steps; each step's loss is fetched in a run of its own before
  it (the by-hand flow's update does not wait for the loss, which a ref
  variable's in-place update could race)."""
  losses = []
  for _ in range(STEPS):
    losses.append(sess.run(t.loss))
    sess.run(train_op)
  return losses, sess.run(_values())


def _assert_one_device(checkpoint, losses, values):
  _, want_losses, want = checkpoint
  np.testing.assert_allclose(losses, want_losses, rtol=1e-5, atol=1e-6)
  for name, value in want.items():
    np.testing.assert_allclose(values[name], value, rtol=1e-5, atol=1e-6,
                               err_msg=name)
  copies = [n for n in values if n.startswith("replica_")]
  assert len(copies) == len(want) * (NUM - 1)  # weights and slots
  for name in copies:
    np.testing.assert_array_equal(values[name], values[name.split("/", 1)[1]],
                                  err_msg=name)


@pytest.mark.parametrize("all_reduce", ALL_REDUCE)
def test_initializers_in_one_run_then_a_restore(checkpoint, all_reduce):
  with tf.Graph().as_default():
    train_op, t = _build(NUM, all_reduce)
    with _restored(checkpoint[0]) as sess:
      _assert_one_device(checkpoint, *_train(sess, train_op, t))


def test_initializers_in_two_runs_then_a_restore(checkpoint):
  with tf.Graph().as_default():
    train_op, t = _build(NUM)
    global_init = tf.global_variables_initializer()
    local_init = tf.local_variables_initializer()
    saver = tf.train.Saver()
    with tf.Session(config=_config()) as sess:
      sess.run(global_init)
      sess.run(local_init)
      saver.restore(sess, checkpoint[0])
      _assert_one_device(checkpoint, *_train(sess, train_op, t))


def test_init_from_checkpoint(checkpoint):
  with tf.Graph().as_default():
    train_op, t = _build(NUM)
    tf.train.init_from_checkpoint(checkpoint[0], {"hidden/": "hidden/",
                                                  "logits/": "logits/"})
    # The global step is not mapped: it starts at 0, which trains the same.
    init = tf.group(tf.global_variables_initializer(),
                    tf.local_variables_initializer())
    with tf.Session(config=_config()) as sess:
      sess.run(init)
      _assert_one_device(checkpoint, *_train(sess, train_op, t))


def test_monitored_session_resumes_its_checkpoint_dir(checkpoint):
  with tf.Graph().as_default():
    train_op, t = _build(NUM)
    with tf.train.MonitoredTrainingSession(
        checkpoint_dir=os.path.dirname(checkpoint[0]), config=_config(),
        save_checkpoint_secs=None, save_summaries_steps=None,
        log_step_count_steps=None) as sess:
      _assert_one_device(checkpoint, *_train(sess, train_op, t))


def test_scaffold_init_fn_restores(checkpoint):
  with tf.Graph().as_default():
    train_op, t = _build(NUM)
    saver = tf.train.Saver()
    scaffold = tf.train.Scaffold(
        init_fn=lambda scaffold, sess: saver.restore(sess, checkpoint[0]))
    with tf.train.MonitoredTrainingSession(
        scaffold=scaffold, config=_config(), save_checkpoint_secs=None,
        save_summaries_steps=None, log_step_count_steps=None) as sess:
      _assert_one_device(checkpoint, *_train(sess, train_op, t))


def test_accumulated_steps_start_from_the_restore(checkpoint):
  # Two micro-batches of half the batch make each step: the first update
  # comes at the second run, after the copies were read twice.
  x, y = batch(8)
  with tf.Graph().as_default():
    halves = [tf.constant(x[:4]), tf.constant(y[:4]),
              tf.constant(x[4:]), tf.constant(y[4:])]
    which = tf.placeholder(tf.int32, [])
    inputs = tf.cond(tf.equal(which, 0), lambda: halves[:2],
                     lambda: halves[2:])
    step = tf.train.get_or_create_global_step()
    train_op, t = towers.minimize(
        model_fn(True), _optimizer(), NUM, inputs=tuple(inputs),
        devices=devices(NUM), global_step=step,
        variable_device="replicated", accumulate_steps=2)
    with _restored(checkpoint[0]) as sess:
      losses = []
      for _ in range(STEPS):
        parts = [sess.run([train_op, t.loss], {which: k})[1] for k in (0, 1)]
        losses.append(np.mean(parts))
      values = sess.run(_values())
  _assert_one_device(checkpoint, losses, values)


def test_the_by_hand_flow_starts_from_the_restore(checkpoint):
  x, y = batch(8)
  with tf.Graph().as_default():
    step = tf.train.get_or_create_global_step()
    opt = _optimizer()
    t = towers.build_towers(model_fn(True), opt, NUM,
                            inputs=(tf.constant(x), tf.constant(y)),
                            devices=devices(NUM),
                            variable_device="replicated")
    train_op = opt.apply_gradients(towers.average_gradients(t.tower_grads),
                                   global_step=step)
    with _restored(checkpoint[0]) as sess:
      _assert_one_device(checkpoint, *_train(sess, train_op, t))


@pytest.mark.parametrize("beside_training", [False, True])
def test_inference_reads_the_restored_copies(checkpoint, beside_training):
  x, _ = batch(8)

  def logits(scope, x):
    del scope
    return _logits(x)

  with tf.Graph().as_default():
    if beside_training:
      # The evaluation towers read the copies the training towers made.
      _build(NUM)
      tf.get_variable_scope().reuse_variables()
    out = towers.infer(logits, NUM, inputs=tf.constant(x),
                       devices=devices(NUM), variable_device="replicated")
    with _restored(checkpoint[0]) as sess:
      got = sess.run(out)
  with tf.Graph().as_default():
    out = _logits(tf.constant(x))
    saver = tf.train.Saver()
    with tf.Session() as sess:
      saver.restore(sess, checkpoint[0])
      want = sess.run(out)
  np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


def test_a_restore_after_the_first_step_needs_the_local_init_op(checkpoint):
  with tf.Graph().as_default():
    train_op, t = _build(NUM)
    init = tf.group(tf.global_variables_initializer(),
                    tf.local_variables_initializer())
    local_init = tf.local_variables_initializer()
    saver = tf.train.Saver()
    with tf.Session(config=_config()) as sess:
      sess.run(init)
      sess.run(train_op)
      saver.restore(sess, checkpoint[0])
      # Once training has begun the copies are left alone: the local init
      # op sets them again.
      copy, primary = sess.run([_values()["replica_1/hidden/w"],
                                _values()["hidden/w"]])
      assert np.abs(copy - primary).max() > 1e-3
      sess.run(local_init)
      _assert_one_device(checkpoint, *_train(sess, train_op, t))


def _logits(x):
  values = initial_values()
  with tf.variable_scope("hidden"):
    w = tf.get_variable("w", initializer=values["hidden/w"])
    b = tf.get_variable("b", initializer=values["hidden/b"])
  hidden = tf.tanh(tf.matmul(x, w) + b)
  with tf.variable_scope("logits"):
    w = tf.get_variable("w", initializer=values["logits/w"])
    b = tf.get_variable("b", initializer=values["logits/b"])
  return tf.matmul(hidden, w) + b

