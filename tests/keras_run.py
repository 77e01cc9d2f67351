"""Trains Keras models on towers against one device; run by test_keras.

A separate process, because TF_USE_LEGACY_KERAS must be set before
TensorFlow is imported (TensorFlow >= 2.16; older ones have Keras 2 built
in). Prints one line of JSON with what it measured, per model:
  names: the variables' names on towers equal one device's;
  gap_<mode>: the averaged gradient's largest difference from one device's
    on the global batch (inference-mode batch norm and dropout);
  steps_gap_<mode>: after a few training steps (batch norm and dropout in
    training mode), every variable's largest difference from one device
    that runs the model on each tower's shard and tower 0's updates;
  copies_gap: replicated, the copies' largest difference from copy 0.
Usage: python keras_run.py [--ref-variables]
"""

import json
import os
import sys
import tempfile
import zlib

os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")

import numpy as np  # pylint: disable=g-import-not-at-top
import tensorflow.compat.v1 as tf

import models
import towers

keras = tf.keras
TOWERS = 2
BATCH = 8
STEPS = 3
MODES = ("cpu", "replicated")


class Subclassed(keras.Model):
  """A model whose weights are made on its first call."""

  def __init__(self):
    super().__init__()
    self.conv = keras.layers.Conv2D(
        4, 3, kernel_regularizer=keras.regularizers.l2(0.01))
    self.bn = keras.layers.BatchNormalization()
    self.drop = keras.layers.Dropout(0.25, seed=3)
    self.dense = keras.layers.Dense(3)

  def call(self, inputs, training=None):
    net = tf.nn.relu(self.bn(self.conv(inputs), training=training))
    net = self.drop(keras.layers.Flatten()(net), training=training)
    return self.dense(net)


def small_cnn_layers():
  return [keras.layers.Conv2D(4, 3, kernel_regularizer=keras.regularizers.l2(
      0.01)), keras.layers.BatchNormalization(), keras.layers.ReLU(),
          keras.layers.Flatten(), keras.layers.Dropout(0.25, seed=3),
          keras.layers.Dense(3)]


def make(kind, shape):
  """A fresh model of `kind`, built as a user builds it for one device."""
  if kind == "sequential":
    return keras.Sequential(small_cnn_layers())
  if kind == "functional":
    inputs = keras.Input(shape[1:])
    net = inputs
    for layer in small_cnn_layers():
      net = layer(net)
    return keras.Model(inputs, net)
  if kind == "subclassed":
    return Subclassed()
  return keras.applications.MobileNetV2(
      input_shape=shape[1:], alpha=0.35, weights=None, classes=3)


def data(kind):
  rng = np.random.RandomState(0)
  side = 32 if kind == "mobilenet" else 6
  images = rng.normal(size=(BATCH, side, side, 3)).astype(np.float32)
  return images, rng.randint(0, 3, BATCH).astype(np.int32)


def loss_fn(model, training):
  def model_fn(scope, images, labels):
    del scope
    logits = model(images, training=training)
    loss = tf.losses.sparse_softmax_cross_entropy(labels, logits)
    return loss + tf.add_n(model.losses) if model.losses else loss
  return model_fn


def load(sess):
  """Sets every global variable from its name, the same in every graph (in
  one run: each run of new fetches costs a graph optimization)."""
  feeds = {}
  for var in tf.global_variables():
    rng = np.random.RandomState(zlib.crc32(var.op.name.encode()))
    value = rng.normal(size=var.shape.as_list()) * 0.3
    if "variance" in var.op.name:
      value = np.abs(value) + 0.5
    feeds[var.initializer.inputs[1]] = value.astype(np.float32)
  sess.run([v.initializer for v in tf.global_variables()], feeds)
  sess.run(tf.local_variables_initializer())


def values(sess):
  return sess.run({v.op.name: v for v in tf.global_variables()})


def gap(a, b):
  return max(float(np.abs(a[k] - b[k]).max()) for k in a)


def session(graph):
  return tf.Session(graph=graph, config=towers.virtual_cpu_config(TOWERS))


def one_device(kind, training):
  """Names, and the gradient on the global batch, on one device."""
  images, labels = data(kind)
  with tf.Graph().as_default() as graph:
    model = make(kind, images.shape)
    loss = loss_fn(model, training)("", tf.constant(images),
                                    tf.constant(labels))
    pairs = tf.train.GradientDescentOptimizer(0.1).compute_gradients(loss)
    with session(graph) as sess:
      load(sess)
      grads = sess.run({v.op.name: g for g, v in pairs})
    return sorted(v.op.name for v in tf.global_variables()), grads


def on_towers(kind, mode, training):
  images, labels = data(kind)
  with tf.Graph().as_default() as graph:
    model = make(kind, images.shape)
    built = towers.build_towers(
        loss_fn(model, training), tf.train.GradientDescentOptimizer(0.1),
        TOWERS, inputs=(tf.constant(images), tf.constant(labels)),
        devices=["/cpu:%d" % i for i in range(TOWERS)], variable_device=mode)
    pairs = towers.average_gradients(built.tower_grads)
    with session(graph) as sess:
      load(sess)
      grads = sess.run({v.op.name: g for g, v in pairs})
    return sorted(v.op.name for v in tf.global_variables()), grads


def steps_one_device(kind):
  """Training steps on one device: the model on each tower's shard in
  turn, the losses averaged, the first shard's updates run."""
  images, labels = data(kind)
  with tf.Graph().as_default() as graph:
    tf.set_random_seed(1)
    model = make(kind, images.shape)
    model_fn = loss_fn(model, True)
    shards = zip(np.split(images, TOWERS), np.split(labels, TOWERS))
    losses, first = [], []
    # A functional model has updates of its own construction, on its Input.
    before = set(model.updates)
    for i, (x, y) in enumerate(shards):
      with tf.name_scope("shard_%d" % i if i else None):
        losses.append(model_fn("", tf.constant(x), tf.constant(y)))
      if i == 0:
        first = [u for u in model.updates if u not in before]
    step = tf.train.GradientDescentOptimizer(0.1).minimize(
        tf.add_n(losses) / TOWERS)
    train_op = tf.group(step, *first)
    with session(graph) as sess:
      load(sess)
      for _ in range(STEPS):
        sess.run(train_op)
      return values(sess)


def steps_on_towers(kind, mode, checkpoint=None):
  images, labels = data(kind)
  with tf.Graph().as_default() as graph:
    tf.set_random_seed(1)
    model = make(kind, images.shape)
    train_op, _ = towers.minimize(
        loss_fn(model, True), tf.train.GradientDescentOptimizer(0.1), TOWERS,
        inputs=(tf.constant(images), tf.constant(labels)),
        devices=["/cpu:%d" % i for i in range(TOWERS)], variable_device=mode)
    with session(graph) as sess:
      load(sess)
      initial = values(sess)
      for _ in range(STEPS):
        sess.run(train_op)
      copies = sess.run(towers_copies())
      trained = values(sess)
      # What the steps changed: the weights and every moving statistic.
      moved = {k: float(np.abs(trained[k] - initial[k]).max())
               for k in trained}
      if checkpoint:
        tf.train.Saver().save(sess, checkpoint)
      return trained, copies, moved


def towers_copies():
  """Replicated: (copy, copy 0) of every trainable variable, by name."""
  by_name = {v.op.name: v for v in tf.trainable_variables()}
  return [(c, by_name[c.op.name.split("/", 1)[1]])
          for c in tf.local_variables()
          if c.op.name.startswith("replica_") and
          c.op.name.split("/", 1)[1] in by_name]


def checkpoints(kind, directory):
  """A towers checkpoint restores into the one-device model, and back."""
  path = os.path.join(directory, "towers")
  trained, _, _ = steps_on_towers(kind, "replicated", checkpoint=path)
  images, labels = data(kind)
  with tf.Graph().as_default() as graph:
    model = make(kind, images.shape)
    model(tf.constant(images), training=False)
    with session(graph) as sess:
      tf.train.Saver().restore(sess, path)
      restored = values(sess)
      back = os.path.join(directory, "one_device")
      tf.train.Saver().save(sess, back)
  with tf.Graph().as_default() as graph:
    model = make(kind, images.shape)
    towers.build_towers(
        loss_fn(model, True), tf.train.GradientDescentOptimizer(0.1), TOWERS,
        inputs=(tf.constant(images), tf.constant(labels)),
        devices=["/cpu:%d" % i for i in range(TOWERS)],
        variable_device="replicated")
    with session(graph) as sess:
      tf.train.Saver().restore(sess, back)
      sess.run(tf.local_variables_initializer())
      again = values(sess)
      copies_gap = max(float(np.abs(c - v).max())
                       for c, v in sess.run(towers_copies()))
  return {"to_one_device": gap(trained, restored),
          "back_to_towers": gap(trained, again), "copies": copies_gap}


def layers_model(scope, images, labels):
  """tf.layers without a name, the last a layer object, in a default-named
  scope: the names count on (dense, dense_1) in each call."""
  del scope
  with tf.variable_scope(None, default_name="bert"):
    net = tf.layers.conv2d(images, 4, 3, activation=tf.nn.relu)
    net = tf.layers.batch_normalization(net, training=False)
    net = tf.layers.dense(tf.layers.flatten(net), 5)
    logits = tf.layers.Dense(3)(net)
  return tf.losses.sparse_softmax_cross_entropy(labels, logits)


def layers_default_names():
  images, labels = data("layers")
  result = {}
  with tf.Graph().as_default() as graph:
    loss = layers_model("", tf.constant(images), tf.constant(labels))
    pairs = tf.train.GradientDescentOptimizer(0.1).compute_gradients(loss)
    names = sorted(v.op.name for v in tf.global_variables())
    with session(graph) as sess:
      load(sess)
      reference = sess.run({v.op.name: g for g, v in pairs})
  result["variables"] = names
  for mode in MODES:
    with tf.Graph().as_default() as graph:
      built = towers.build_towers(
          layers_model, tf.train.GradientDescentOptimizer(0.1), TOWERS,
          inputs=(tf.constant(images), tf.constant(labels)),
          devices=["/cpu:%d" % i for i in range(TOWERS)],
          variable_device=mode)
      pairs = towers.average_gradients(built.tower_grads)
      result["names_" + mode] = sorted(
          v.op.name for v in tf.global_variables()) == names
      result["ops_" + mode] = sorted(
          op.name for op in graph.get_operations()
          if op.type == "MatMul" and "gradients" not in op.name)
      with session(graph) as sess:
        load(sess)
        result["gap_" + mode] = gap(
            reference, sess.run({v.op.name: g for g, v in pairs}))
  return result


def keras_inside_model_fn():
  images, labels = data("sequential")
  with tf.Graph().as_default():
    def model_fn(scope, images, labels):
      del scope
      logits = keras.Sequential(small_cnn_layers())(images)
      return tf.losses.sparse_softmax_cross_entropy(labels, logits)
    try:
      towers.build_towers(model_fn, tf.train.GradientDescentOptimizer(0.1),
                          TOWERS, inputs=(tf.constant(images),
                                          tf.constant(labels)),
                          devices=["/cpu:0", "/cpu:1"])
    except ValueError as e:
      return str(e)
  return None


def regularization_errors():
  """model.losses in tower 0's loss only, or every call's activity
  regularization in each tower's: clear errors; the tower's own losses,
  from get_losses_for, train."""
  images, labels = data("sequential")
  result = {"tower_0_only": None}
  with tf.Graph().as_default():
    model = make("sequential", images.shape)

    def first_only(scope, images, labels):
      loss = tf.losses.sparse_softmax_cross_entropy(labels, model(images))
      return loss + tf.add_n(model.losses) if scope == "tower_0/" else loss
    try:
      towers.build_towers(
          first_only, tf.train.GradientDescentOptimizer(0.1), TOWERS,
          inputs=(tf.constant(images), tf.constant(labels)),
          devices=["/cpu:%d" % i for i in range(TOWERS)])
    except ValueError as e:
      result["tower_0_only"] = str(e)
  for own in (False, True):
    with tf.Graph().as_default():
      model = keras.Sequential([keras.layers.Flatten(), keras.layers.Dense(
          3, activity_regularizer=keras.regularizers.l2(0.01))])

      def model_fn(scope, images, labels, own=own):
        del scope
        logits = model(images, training=True)
        losses = (model.get_losses_for(None) + model.get_losses_for(images)
                  if own else model.losses)
        return tf.losses.sparse_softmax_cross_entropy(
            labels, logits) + tf.add_n(losses)
      try:
        towers.build_towers(
            model_fn, tf.train.GradientDescentOptimizer(0.1), TOWERS,
            inputs=(tf.constant(images), tf.constant(labels)),
            devices=["/cpu:%d" % i for i in range(TOWERS)])
        result["own" if own else "all"] = None
      except ValueError as e:
        result["own" if own else "all"] = str(e)
  return result


def main():
  models.use_variables("--ref-variables" in sys.argv)
  result = {}
  for kind in ("sequential", "functional", "subclassed", "mobilenet"):
    case = {}
    names, reference = one_device(kind, training=False)
    reference_steps = steps_one_device(kind)
    for mode in MODES:
      got_names, grads = on_towers(kind, mode, training=False)
      case["names_" + mode] = got_names == names
      case["gap_" + mode] = gap(reference, grads)
      trained, copies, moved = steps_on_towers(kind, mode)
      case["steps_gap_" + mode] = gap(reference_steps, trained)
      case["moving_moved_" + mode] = min(
          v for k, v in moved.items() if "moving" in k)
      case["weights_moved_" + mode] = max(
          v for k, v in moved.items() if "moving" not in k)
      if mode == "replicated":
        case["copied"] = len(copies)
        case["copies_gap"] = max(float(np.abs(c - v).max())
                                 for c, v in copies)
    case["variables"] = len(names)
    case["trainable"] = len(reference)
    result[kind] = case
  with tempfile.TemporaryDirectory() as directory:
    result["checkpoints"] = checkpoints("sequential", directory)
  result["inside_error"] = keras_inside_model_fn()
  result["layers"] = layers_default_names()
  result["regularization"] = regularization_errors()
  print(json.dumps(result))


if __name__ == "__main__":
  main()
