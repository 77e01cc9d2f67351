"""minimize end to end: EMA, checkpoints, clipping, update ops, None."""

import numpy as np
import pytest
import tensorflow.compat.v1 as tf

import towers
from models import batch, devices, loss_fn, model_fn, session


def _inputs(size=8):
  x, y = batch(size)
  return tf.constant(x), tf.constant(y)


def test_moving_average_after_minimize_tracks_the_variables():
  with tf.Graph().as_default() as g:
    step = tf.train.get_or_create_global_step()
    train_op, t = towers.minimize(model_fn(), tf.train.AdamOptimizer(0.1), 2,
                                  inputs=_inputs(), devices=devices(2),
                                  global_step=step)
    ema = tf.train.ExponentialMovingAverage(0.5)
    with tf.control_dependencies([train_op]):
      train_op = ema.apply(tf.trainable_variables())
    weights = tf.trainable_variables()[0]
    with session(g, 2) as sess:
      sess.run(tf.global_variables_initializer())
      want = start = sess.run(weights)
      for _ in range(3):
        sess.run(train_op)
        value = sess.run(weights)
        want = 0.5 * want + 0.5 * value
      np.testing.assert_allclose(sess.run(ema.average(weights)), want,
                                 rtol=1e-5)
      assert sess.run(step) == 3
    assert not np.allclose(value, start)


@pytest.mark.parametrize("num", [2, 3])
def test_checkpoint_from_towers_restores_into_a_single_device_graph(
    tmp_path, num):
  x, y = batch(12, seed=5)
  path = str(tmp_path / "model.ckpt")
  with tf.Graph().as_default() as g:
    train_op, t = towers.minimize(
        model_fn(regularize=True),
        tf.train.MomentumOptimizer(0.1, 0.9), num,
        inputs=(tf.constant(x), tf.constant(y)), devices=devices(num),
        global_step=tf.train.get_or_create_global_step())
    with session(g, num) as sess:
      sess.run(tf.global_variables_initializer())
      for _ in range(4):
        sess.run(train_op)
      towers_loss = sess.run(t.loss)
      tf.train.Saver().save(sess, path)
  with tf.Graph().as_default() as g:
    # The plain model, no towers, no devices: names line up as they are.
    loss = loss_fn(tf.constant(x), tf.constant(y), regularize=True)
    with tf.Session(graph=g) as sess:
      tf.train.Saver(tf.trainable_variables()).restore(sess, path)
      np.testing.assert_allclose(sess.run(loss), towers_loss, rtol=1e-5)


def test_clip_norm_clips_the_averaged_gradients():
  with tf.Graph().as_default() as g:
    v = []

    def model(scope):
      v.append(tf.get_variable("v", initializer=[0.0, 0.0]))
      return tf.reduce_sum(v[-1] * [30.0, 40.0])

    train_op, t = towers.minimize(model, tf.train.GradientDescentOptimizer(1.0),
                                  2, devices=devices(2), clip_norm=5.0)
    with session(g, 2) as sess:
      sess.run(tf.global_variables_initializer())
      sess.run(train_op)
      # The averaged gradient [30, 40] has norm 50: clipped to [3, 4].
      np.testing.assert_allclose(sess.run(v[0]), [-3.0, -4.0], rtol=1e-6)


def test_first_towers_update_ops_run_once_per_step():
  with tf.Graph().as_default() as g:

    def model(scope):
      w = tf.get_variable("w", [], initializer=tf.ones_initializer())
      count = tf.get_variable("count", [], trainable=False,
                              initializer=tf.zeros_initializer())
      tf.add_to_collection(tf.GraphKeys.UPDATE_OPS, tf.assign_add(count, 1.0))
      return w * w

    train_op, t = towers.minimize(model, tf.train.GradientDescentOptimizer(0.1),
                                  3, devices=devices(3))
    with session(g, 3) as sess:
      sess.run(tf.global_variables_initializer())
      for _ in range(4):
        sess.run(train_op)
      count = [v for v in tf.global_variables() if v.op.name == "count"][0]
      assert sess.run(count) == 4.0


def test_variable_without_gradient_is_left_alone():
  with tf.Graph().as_default() as g:

    def model(scope, x, y):
      tf.get_variable("unused", [3], initializer=tf.ones_initializer())
      return loss_fn(x, y)

    train_op, t = towers.minimize(model, tf.train.AdamOptimizer(0.1), 2,
                                  inputs=_inputs(), devices=devices(2))
    unused = [v for v in tf.trainable_variables() if v.op.name == "unused"][0]
    assert (None, unused) in [(g_, v) for g_, v in t.grads_and_vars
                              if v is unused]
    with session(g, 2) as sess:
      sess.run(tf.global_variables_initializer())
      first = sess.run(t.loss)
      for _ in range(5):
        sess.run(train_op)
      assert sess.run(t.loss) < first
      np.testing.assert_array_equal(sess.run(unused), np.ones(3))


def test_embedding_trains_sparsely_through_minimize():
  with tf.Graph().as_default() as g:
    table = np.arange(20, dtype=np.float32).reshape(10, 2)

    def model(scope, ids):
      emb = tf.get_variable("emb", initializer=table)
      return tf.reduce_mean(tf.square(tf.gather(emb, ids)))

    train_op, t = towers.minimize(model, tf.train.GradientDescentOptimizer(0.5),
                                  2, inputs=tf.constant([1, 2, 2, 7]),
                                  devices=devices(2))
    (grad, emb), = t.grads_and_vars
    assert isinstance(grad, tf.IndexedSlices)
    with session(g, 2) as sess:
      sess.run(tf.global_variables_initializer())
      sess.run(train_op)
      after = sess.run(emb)
    touched = [1, 2, 7]
    untouched = [i for i in range(10) if i not in touched]
    np.testing.assert_array_equal(after[untouched], table[untouched])
    # d/de of the mean over 4 rows x 2 columns of e^2 = 2 e * count / 8.
    for row, count in [(1, 1), (2, 2), (7, 1)]:
      np.testing.assert_allclose(
          after[row], table[row] - 0.5 * 2 * table[row] * count / 8,
          rtol=1e-6)


def test_minimize_reduces_on_the_average_device_when_given():
  with tf.Graph().as_default() as g:
    train_op, t = towers.minimize(model_fn(), tf.train.AdamOptimizer(0.1), 2,
                                  inputs=_inputs(), devices=devices(2),
                                  average_device="/cpu:3")
    assert all(grad.device == "/device:CPU:3" for grad, _ in t.grads_and_vars)
    with session(g, 4) as sess:
      sess.run(tf.global_variables_initializer())
      first = sess.run(t.loss)
      sess.run(train_op)
      assert sess.run(t.loss) < first


def test_clip_norm_works_for_a_mix_of_float_dtypes():
  # tf.clip_by_global_norm stacks the norms: float16 with float32 fails.
  with tf.Graph().as_default() as g:
    made = {}

    def model(scope):
      made["half"] = tf.get_variable("half", [2], tf.float16,
                                     initializer=tf.zeros_initializer())
      made["full"] = tf.get_variable("full", initializer=np.zeros(
          2, np.float32))
      return (tf.reduce_sum(tf.cast(made["half"] * np.float16(30.0),
                                    tf.float32)) +
              tf.reduce_sum(made["full"] * [0.0, 40.0]))

    train_op, _ = towers.minimize(model, tf.train.GradientDescentOptimizer(
        1.0), 2, devices=devices(2), clip_norm=5.0)
    with session(g, 2) as sess:
      sess.run(tf.global_variables_initializer())
      sess.run(train_op)
      half, full = sess.run([made["half"], made["full"]])
  # Gradients [30, 30] and [0, 40] have the global norm sqrt(3400): each is
  # scaled by 5 / sqrt(3400) in its own dtype.
  scale = 5.0 / np.sqrt(3400.0)
  assert half.dtype == np.float16 and full.dtype == np.float32
  np.testing.assert_allclose(half, [-30 * scale] * 2, rtol=1e-3)
  np.testing.assert_allclose(full, [0.0, -40 * scale], rtol=1e-6)
