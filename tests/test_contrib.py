"""Models built from TensorFlow 1.x's ``tf.contrib`` train on towers as on
one device: ``tf.contrib.layers`` (``batch_norm`` both ways, the
``l2_regularizer``), ``tf.contrib.slim`` (``arg_scope``,
``model_variable``) and a ``tf.contrib.rnn`` cell.

``tf.contrib`` exists only in TensorFlow 1.x: on 2.x these tests skip.
"""

import numpy as np
import pytest
import tensorflow as tf_root
import tensorflow.compat.v1 as tf

import towers
from tests import models

contrib = getattr(tf_root, "contrib", None)
pytestmark = pytest.mark.skipif(
    contrib is None, reason="tf.contrib is TensorFlow 1.x's; TensorFlow %s "
    "has none" % tf.__version__)

CLASSES = 3
STEPS = 3


def _images(size, seed=0):
  rng = np.random.RandomState(seed)
  return (rng.normal(size=(size, 6, 6, 2)).astype(np.float32),
          rng.randint(0, CLASSES, size).astype(np.int32))


def _sequences(size, seed=0):
  rng = np.random.RandomState(seed)
  return (rng.normal(size=(size, 5, 3)).astype(np.float32),
          rng.randint(0, CLASSES, size).astype(np.int32))


def _slim(images, labels):
  """tf-slim's way: layers under an arg_scope with weight decay, a model
  variable of its own, the regularization losses added to the loss."""
  slim = contrib.slim
  with slim.arg_scope([slim.conv2d, slim.fully_connected],
                      weights_regularizer=slim.l2_regularizer(0.01),
                      activation_fn=tf.nn.relu):
    net = slim.conv2d(images, 4, [3, 3], scope="conv")
    net = slim.flatten(net)
    scale = slim.model_variable("scale", shape=[],
                                initializer=tf.ones_initializer())
    logits = slim.fully_connected(net * scale, CLASSES, activation_fn=None,
                                  scope="logits")
  loss = tf.losses.sparse_softmax_cross_entropy(labels, logits)
  return loss + tf.losses.get_regularization_loss()


def _layers_batch_norm(images, labels, updates_collections):
  """tf.contrib.layers with batch norm in training mode as the normalizer."""
  layers = contrib.layers
  net = layers.conv2d(
      images, 4, 3, normalizer_fn=layers.batch_norm,
      normalizer_params={"is_training": True, "decay": 0.99,
                         "updates_collections": updates_collections},
      weights_regularizer=layers.l2_regularizer(0.01),
      # Op seeds: the reference program slices its batch before the model.
      weights_initializer=tf.glorot_uniform_initializer(seed=1), scope="conv")
  logits = layers.fully_connected(
      layers.flatten(net), CLASSES, activation_fn=None,
      weights_initializer=tf.glorot_uniform_initializer(seed=2),
      scope="logits")
  loss = tf.losses.sparse_softmax_cross_entropy(labels, logits)
  return loss + tf.losses.get_regularization_loss()


def _rnn(sequences, labels):
  """An LSTM cell of tf.contrib.rnn, unrolled by tf.nn.dynamic_rnn (a v1
  while loop), its last output classified."""
  cell = contrib.rnn.LSTMCell(6, initializer=tf.glorot_uniform_initializer())
  outputs, _ = tf.nn.dynamic_rnn(cell, sequences, dtype=tf.float32,
                                 scope="rnn")
  logits = tf.layers.dense(outputs[:, -1], CLASSES, name="logits")
  return tf.losses.sparse_softmax_cross_entropy(labels, logits)


def _collected(images, labels):
  return _layers_batch_norm(images, labels, tf.GraphKeys.UPDATE_OPS)


MODELS = {"slim": (_slim, _images), "rnn": (_rnn, _sequences)}


def _per_shard(build, sizes):
  """One device's program of per-tower batch norm: `build` on each shard of
  `sizes` examples, its losses weighted by size, with the update ops of
  the first shard."""

  def program(x, y):
    losses, updates = [], []
    start = 0
    for i, size in enumerate(sizes):
      with tf.variable_scope(tf.get_variable_scope(), reuse=i > 0):
        losses.append(build(x[start:start + size], y[start:start + size])
                      * size / sum(sizes))
      if i == 0:
        updates = tf.get_collection(tf.GraphKeys.UPDATE_OPS)
      start += size
    return tf.add_n(losses), updates

  return program


def _train(build, data, steps, num_towers=None):
  """Values of every global variable after `steps` momentum steps on
  `data`, by name, and each step's loss: on one device (`num_towers`
  None) or on towers; both graphs start from one seed. On one device,
  `build` may return ``(loss, update_ops)``."""
  with tf.Graph().as_default() as graph:
    tf.set_random_seed(7)
    x = tf.placeholder(tf.float32, [None] + list(data[0].shape[1:]))
    y = tf.placeholder(tf.int32, [None])
    opt = tf.train.MomentumOptimizer(0.1, 0.9)
    if num_towers is None:
      loss = build(x, y)
      loss, updates = loss if isinstance(loss, tuple) else (
          loss, tf.get_collection(tf.GraphKeys.UPDATE_OPS))
      with tf.control_dependencies(updates):
        train = opt.minimize(loss)
    else:
      train, t = towers.minimize(lambda scope, a, b: build(a, b), opt,
                                 num_towers, inputs=(x, y),
                                 devices=models.devices(num_towers))
      loss = t.loss
    names = [v.op.name for v in tf.global_variables()]
    with models.session(graph) as sess:
      sess.run(tf.global_variables_initializer())
      sess.run(tf.local_variables_initializer())
      losses = []
      for _ in range(steps):
        # The loss before each step, in a run of its own: fetched with the
        # step, one device's varies from run to run under ref variables on
        # TensorFlow 1.15.5 (measured: 6 runs of 20); towers' does not.
        losses.append(sess.run(loss, {x: data[0], y: data[1]}))
        sess.run(train, {x: data[0], y: data[1]})
      values = dict(zip(names, sess.run(tf.global_variables())))
  return values, losses


@pytest.mark.parametrize("size", [8, 7])
@pytest.mark.parametrize("name", ["slim", "rnn"])
def test_contrib_model_trains_as_on_one_device(name, size):
  build, make = MODELS[name]
  data = make(size)
  want, want_losses = _train(build, data, STEPS)
  got, got_losses = _train(build, data, STEPS, num_towers=2)
  np.testing.assert_allclose(got_losses, want_losses, rtol=1e-5, atol=1e-6)
  for var, value in want.items():
    np.testing.assert_allclose(got[var], value, rtol=1e-5, atol=1e-6,
                               err_msg=var)


@pytest.mark.parametrize("size", [8, 7])
def test_contrib_batch_norm_trains_as_per_tower_batch_norm_on_one_device(
    size):
  """Each tower normalizes with its own shard's statistics, as one device
  would on each shard, and tower 0's collected update stands for all."""
  data = _images(size)
  reference = _per_shard(_collected, [(size + 1) // 2, size // 2])
  want, want_losses = _train(reference, data, STEPS)
  got, got_losses = _train(_collected, data, STEPS, num_towers=2)
  np.testing.assert_allclose(got_losses, want_losses, rtol=1e-5, atol=1e-6)
  assert len([name for name in want if "moving_" in name]) == 2
  for var, value in want.items():
    np.testing.assert_allclose(got[var], value, rtol=1e-5, atol=1e-6,
                               err_msg=var)


@pytest.mark.parametrize("size", [8, 7])
def test_contrib_batch_norm_in_place_updates_in_every_tower(size):
  """With ``updates_collections=None`` every tower updates the moving
  statistics in place; the rest trains exactly as with collected updates,
  which one device matches (above).

  The statistics are only checked to have moved: N updates a step run in
  no order, and under ref variables they race (one device's program with
  two such updates gives other statistics from run to run on TensorFlow
  1.15.5, measured).
  """
  data = _images(size)

  def in_place(images, labels):
    return _layers_batch_norm(images, labels, None)

  want, want_losses = _train(_collected, data, STEPS, num_towers=2)
  got, got_losses = _train(in_place, data, STEPS, num_towers=2)
  np.testing.assert_allclose(got_losses, want_losses, rtol=1e-6, atol=1e-7)
  moving = [name for name in want if "moving_" in name]
  assert len(moving) == 2
  for var, value in want.items():
    if var in moving:
      start = 1.0 if "variance" in var else 0.0
      assert np.all(np.isfinite(got[var])) and np.any(got[var] != start), var
      continue
    np.testing.assert_allclose(got[var], value, rtol=1e-6, atol=1e-7,
                               err_msg=var)
