"""Weight decay next to its variable: each tower moves each variable once.

A model's weight decay reads its weights a second time. Computed in each
tower, that read (and its gradient) would bring each regularized weight to
every tower twice per step; the towers compute it next to the weights
instead, with the single-device result.
"""

import numpy as np
import pytest
import tensorflow.compat.v1 as tf

import towers
from models import batch, device_index, weight_sends

DECAY = 0.05


def _model(scope, x, y):
  """Two layers: one decayed in the model (the CIFAR-10 tutorial's way),
  one by its regularizer (tf.get_variable's)."""
  del scope
  rng = np.random.RandomState(0)
  w1 = tf.get_variable("w1", initializer=rng.normal(
      0, 0.5, (6, 5)).astype(np.float32))
  w2 = tf.get_variable(
      "w2", initializer=rng.normal(0, 0.5, (5, 3)).astype(np.float32),
      regularizer=lambda w: DECAY * tf.nn.l2_loss(w))
  logits = tf.matmul(tf.tanh(tf.matmul(x, w1)), w2)
  xent = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
      labels=y, logits=logits))
  weight_loss = tf.multiply(tf.nn.l2_loss(w1), DECAY, name="weight_loss")
  return xent + weight_loss + tf.losses.get_regularization_loss()


def _one_device(x, y, steps):
  with tf.Graph().as_default():
    loss = _model("", tf.constant(x), tf.constant(y))
    train_op = tf.train.GradientDescentOptimizer(0.5).minimize(loss)
    with tf.Session() as sess:
      sess.run(tf.global_variables_initializer())
      for _ in range(steps):
        sess.run(train_op)
      return {v.op.name: sess.run(v) for v in tf.trainable_variables()}


# Reduced next to each variable, or on a device of its own (a parameter-server
# worker's, where the weight decay is added next to the variable afterwards).
@pytest.mark.parametrize("variable_device,average_device", [
    ("/cpu:0", None), ("balanced", None), ("/cpu:0", "/cpu:3")])
def test_weight_decay_runs_next_to_the_weights_with_the_one_device_result(
    variable_device, average_device):
  x, y = batch(8)
  tower_devices = ["/cpu:1", "/cpu:2"]
  with tf.Graph().as_default() as graph:
    train_op, _ = towers.minimize(
        _model, tf.train.GradientDescentOptimizer(0.5), 2,
        inputs=(tf.constant(x), tf.constant(y)), devices=tower_devices,
        variable_device=variable_device, average_device=average_device)
    homes = {v.op.name: v.device for v in tf.trainable_variables()}
    with tf.Session(config=towers.virtual_cpu_config(4)) as sess:
      sess.run(tf.global_variables_initializer())
      metadata = tf.RunMetadata()
      sess.run(train_op, run_metadata=metadata,
               options=tf.RunOptions(output_partition_graphs=True))
      for _ in range(4):
        sess.run(train_op)
      got = {v.op.name: sess.run(v) for v in tf.trainable_variables()}
  want = _one_device(x, y, 5)
  for name, value in want.items():
    np.testing.assert_allclose(got[name], value, rtol=1e-5, atol=1e-6,
                               err_msg=name)
  # What each weight's device sends to the towers: the weight, once each.
  sent = weight_sends(graph, metadata, graph.get_collection(
      tf.GraphKeys.TRAINABLE_VARIABLES))
  assert sent == {name: {d: 1 for d in (1, 2) if d != device_index(home)}
                  for name, home in homes.items()}


def test_only_the_weight_decay_moves_whatever_feeds_the_towers():
  # Fed through a placeholder made outside the towers: the model's ops read
  # data, so they stay on the towers; the decay alone moves.
  x, y = batch(8)
  with tf.Graph().as_default() as graph:
    images = tf.placeholder(tf.float32, [None, 6])
    labels = tf.placeholder(tf.int32, [None])

    def model_fn(scope):
      index = int(scope.rstrip("/").rsplit("_", 1)[1])
      return _model(scope, images[index * 4:index * 4 + 4],
                    labels[index * 4:index * 4 + 4])

    train_op, t = towers.minimize(
        model_fn, tf.train.GradientDescentOptimizer(0.5), 2,
        devices=["/cpu:1", "/cpu:2"], variable_device="/cpu:0")
    # Resource reads go next to their variable anyway (TensorFlow 1.15 says
    # so in the graph, 2.x in its placer).
    moved = {op.name for op in graph.get_operations()
             if op.name.startswith(t.scopes[1]) and op.device.endswith(
                 "CPU:0") and op.type != "ReadVariableOp"}
    # The decay, its gradient, and each weight's gradient's sum of both.
    decay = ("L2Loss", "weight_loss", "Regularizer", "regularization_loss",
             "gradients/AddN")
    assert moved and all(any(k in name for k in decay) for name in moved), (
        sorted(moved))
    with tf.Session(config=towers.virtual_cpu_config(3)) as sess:
      sess.run(tf.global_variables_initializer())
      for _ in range(5):
        sess.run(train_op, {images: x, labels: y})
      got = {v.op.name: sess.run(v) for v in tf.trainable_variables()}
  for name, value in _one_device(x, y, 5).items():
    np.testing.assert_allclose(got[name], value, rtol=1e-5, atol=1e-6,
                               err_msg=name)
