"""A float64 model on shards sized at run time gets float64 shares.

With the batch size known only at run time, each tower's share of the batch
is a tensor; a float32 share would leave the averaged float64 gradient about
3e-8 off one device's. Every path that weighs the towers is checked: the
tutorial's weightless ``average_gradients``, explicit ``weights=t.weights`` and
`towers.minimize`.
"""

import numpy as np
import pytest
import tensorflow.compat.v1 as tf

import towers
from models import CLASSES, IN, batch, devices, session

HIDDEN = 4
SPLITS = [(11, 2), (10, 3)]
MODES = ["cpu", "balanced", "replicated"]
# A float64 sum in another order: tens of ulps of gradients of order 1.
TOLERANCE = 1e-12


def _loss(x, y):
  rng = np.random.RandomState(0)
  w1 = tf.get_variable("w1", dtype=tf.float64,
                       initializer=rng.normal(0, 0.5, (IN, HIDDEN)))
  w2 = tf.get_variable("w2", dtype=tf.float64,
                       initializer=rng.normal(0, 0.5, (HIDDEN, CLASSES)))
  logits = tf.matmul(tf.tanh(tf.matmul(x, w1)), w2)
  return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
      labels=y, logits=logits))


def _one_device(x, y):
  with tf.Graph().as_default() as g:
    loss = _loss(tf.constant(x), tf.constant(y))
    variables = tf.trainable_variables()
    grads = tf.gradients(loss, variables)
    with session(g, 1) as sess:
      sess.run(tf.global_variables_initializer())
      return dict(zip([v.op.name for v in variables], sess.run(grads)))


def _towers(x, y, num, mode, path):
  with tf.Graph().as_default() as g:
    px = tf.placeholder(tf.float64, (None, IN))
    py = tf.placeholder(tf.int32, (None,))
    opt = tf.train.GradientDescentOptimizer(0.1)
    kwargs = dict(inputs=(px, py), devices=devices(num), variable_device=mode)

    def model_fn(scope, x, y):
      del scope
      return _loss(x, y)

    if path == "minimize":
      _, t = towers.minimize(model_fn, opt, num, **kwargs)
      averaged = t.grads_and_vars
    else:
      t = towers.build_towers(model_fn, opt, num, **kwargs)
      weights = t.weights if path == "weights" else None
      averaged = towers.average_gradients(t.tower_grads, weights)
    assert all(not isinstance(w, float) for w in t.weights)
    with session(g, num) as sess:
      sess.run(tf.global_variables_initializer())
      sess.run(tf.local_variables_initializer())
      values = sess.run([gr for gr, _ in averaged], {px: x, py: y})
  return {v.op.name: value for (_, v), value in zip(averaged, values)}


@pytest.mark.parametrize("path", ["minimize", "weights", "weightless"])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("size,num", SPLITS,
                         ids=["%d_over_%d" % s for s in SPLITS])
def test_float64_gradients_on_uneven_shards_are_one_devices(size, num, mode,
                                                             path):
  x, y = batch(size)
  x = x.astype(np.float64)
  want = _one_device(x, y)
  got = _towers(x, y, num, mode, path)
  assert sorted(got) == sorted(want)
  for name in want:
    assert got[name].dtype == np.float64
    np.testing.assert_allclose(got[name], want[name], rtol=0,
                               atol=TOLERANCE, err_msg=name)


def test_float64_shares_are_exact():
  with tf.Graph().as_default() as g:
    px = tf.placeholder(tf.float64, (None, IN))
    py = tf.placeholder(tf.int32, (None,))
    t = towers.build_towers(lambda scope, x, y: _loss(x, y),
                            tf.train.GradientDescentOptimizer(0.1), 2,
                            inputs=(px, py), devices=devices(2))
    x, y = batch(11)
    with session(g, 2) as sess:
      sess.run(tf.global_variables_initializer())
      shares = sess.run(t.weights, {px: x, py: y})
  assert list(shares) == [6 / 11, 5 / 11]


def test_float64_accumulation_over_micro_batches_of_two_sizes():
  first, second = batch(11), batch(9, seed=2)
  x = np.concatenate([first[0], second[0]]).astype(np.float64)
  y = np.concatenate([first[1], second[1]])
  want = _one_device(x, y)
  with tf.Graph().as_default() as g:
    px = tf.placeholder(tf.float64, (None, IN))
    py = tf.placeholder(tf.int32, (None,))
    train_op, _ = towers.minimize(
        lambda scope, x, y: _loss(x, y), tf.train.GradientDescentOptimizer(1.0),
        2, inputs=(px, py), devices=devices(2), accumulate_steps=2)
    variables = tf.trainable_variables()
    with session(g, 2) as sess:
      sess.run(tf.global_variables_initializer())
      sess.run(tf.local_variables_initializer())
      before = sess.run(variables)
      for part_x, part_y in (first, second):
        sess.run(train_op, {px: part_x.astype(np.float64), py: part_y})
      after = sess.run(variables)
  for var, old, new in zip(variables, before, after):
    np.testing.assert_allclose(old - new, want[var.op.name], rtol=0,
                               atol=TOLERANCE, err_msg=var.op.name)
