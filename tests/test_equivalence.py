"""N towers give the single-device gradient and training of the same batch."""

import numpy as np
import pytest
import tensorflow.compat.v1 as tf

import towers
from models import (batch, devices, model_fn, reference_gradients,
                    reference_training, session)

SPLITS = [(8, 1), (8, 2), (9, 3), (8, 4), (10, 4), (7, 3)]


def _tower_gradients(x, y, num, regularize, static_batch=True):
  with tf.Graph().as_default() as g:
    shape_x = x.shape if static_batch else (None,) + x.shape[1:]
    px = tf.placeholder(tf.float32, shape_x)
    py = tf.placeholder(tf.int32, y.shape if static_batch else (None,))
    t = towers.build_towers(model_fn(regularize),
                            tf.train.GradientDescentOptimizer(0.1), num,
                            inputs=(px, py), devices=devices(num))
    averaged = towers.average_gradients(t.tower_grads, t.weights)
    with session(g, num) as sess:
      sess.run(tf.global_variables_initializer())
      loss, grads = sess.run([t.loss, [gr for gr, _ in averaged]],
                             {px: x, py: y})
  return loss, {v.op.name: gv for (_, v), gv in zip(averaged, grads)}


@pytest.mark.parametrize("regularize", [False, True],
                         ids=["plain", "regularizer"])
@pytest.mark.parametrize("size,num", SPLITS,
                         ids=["%d_over_%d" % s for s in SPLITS])
def test_towers_give_the_single_device_gradient(size, num, regularize):
  x, y = batch(size)
  want_loss, want = reference_gradients(x, y, regularize)
  loss, got = _tower_gradients(x, y, num, regularize)
  assert sorted(got) == sorted(want)
  np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
  for name in want:
    np.testing.assert_allclose(got[name], want[name], rtol=1e-5, atol=1e-6,
                               err_msg=name)


@pytest.mark.parametrize("size,num", [(10, 4), (7, 3), (8, 2)])
def test_unknown_static_batch_gives_the_single_device_gradient(size, num):
  x, y = batch(size)
  want_loss, want = reference_gradients(x, y, regularize=True)
  loss, got = _tower_gradients(x, y, num, True, static_batch=False)
  np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
  for name in want:
    np.testing.assert_allclose(got[name], want[name], rtol=1e-5, atol=1e-6,
                               err_msg=name)


def _sgd():
  return tf.train.GradientDescentOptimizer(0.5)


def _train_towers(x, y, num, make_opt, steps, manual, regularize=True):
  with tf.Graph().as_default() as g:
    opt = make_opt()
    inputs = (tf.constant(x), tf.constant(y))
    if manual:
      # The original recipe's own flow, written out.
      t = towers.build_towers(model_fn(regularize), opt, num, inputs=inputs,
                              devices=devices(num))
      train_op = opt.apply_gradients(
          towers.average_gradients(t.tower_grads, t.weights))
    else:
      train_op, t = towers.minimize(model_fn(regularize), opt, num,
                                    inputs=inputs, devices=devices(num))
    with session(g, num) as sess:
      sess.run(tf.global_variables_initializer())
      losses = []
      for _ in range(steps):
        losses.append(sess.run(t.loss))
        sess.run(train_op)
      values = {v.op.name: sess.run(v) for v in tf.trainable_variables()}
  return losses, values


@pytest.mark.parametrize("manual", [False, True], ids=["minimize", "manual"])
@pytest.mark.parametrize("size,num", [(8, 2), (7, 3), (10, 4)])
def test_sgd_steps_track_single_device_sgd(size, num, manual):
  x, y = batch(size)
  want_losses, want = reference_training(x, y, _sgd, 5, regularize=True)
  losses, got = _train_towers(x, y, num, _sgd, 5, manual)
  np.testing.assert_allclose(losses, want_losses, rtol=1e-5)
  assert losses[-1] < losses[0]
  for name in want:
    np.testing.assert_allclose(got[name], want[name], rtol=1e-5, atol=1e-6,
                               err_msg=name)


OPTIMIZERS = {
    "adam": lambda: tf.train.AdamOptimizer(0.05),
    "nesterov": lambda: tf.train.MomentumOptimizer(0.1, 0.9,
                                                   use_nesterov=True),
    "rmsprop": lambda: tf.train.RMSPropOptimizer(0.05),
}


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_optimizers_with_slots_train_like_one_device(name):
  x, y = batch(9)
  want_losses, want = reference_training(x, y, OPTIMIZERS[name], 4,
                                         regularize=True)
  losses, got = _train_towers(x, y, 3, OPTIMIZERS[name], 4, manual=False)
  assert losses[-1] < losses[0]
  np.testing.assert_allclose(losses, want_losses, rtol=1e-4)
  for var in want:
    np.testing.assert_allclose(got[var], want[var], rtol=1e-4, atol=1e-5,
                               err_msg=var)
