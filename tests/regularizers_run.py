"""Trains every weight-regularizer style on towers against one device; run
by test_regularizers.

A separate process, because tf.compat.v1.layers and tf-slim need
TF_USE_LEGACY_KERAS=1 before TensorFlow is imported (TensorFlow >= 2.16).
Prints one line of JSON:
  cases: "style composition mode" -> the largest gap of any global variable
    (weights and Momentum slots) from one device's after 3 updates on the
    same batches, and of a replicated copy from copy 0; or the error;
  errors: the messages of the two models that must be refused;
  sends: what each weight's device sends to each tower in one step of the
    one-copy mode, per style (`models.weight_sends`);
  slim: whether tf-slim imported.
Usage: python regularizers_run.py [--ref-variables] [--shard K/N]
"""

import json
import os
import sys

os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")

import numpy as np  # pylint: disable=g-import-not-at-top
import tensorflow.compat.v1 as tf

import towers
from models import copies_gap, use_variables, weight_sends

try:
  import tf_slim as slim  # pylint: disable=g-import-not-at-top
except ImportError:
  slim = None

DECAY = 0.05
IN, HIDDEN, CLASSES = 6, 5, 3
BATCH = 8
UPDATES = 3
STYLES = ("get_variable", "layers_function", "layers_keras", "slim",
          "keras_model", "cifar10")
# The reported model: one tf.layers.dense, ce + get_regularization_loss().
REPORTED = ("reported_function", "reported_keras")
COMPOSITIONS = ("get_regularization_loss", "add_n", "get_total_loss")
# Mode name -> (minimize's arguments, micro-batches per update).
MODES = {
    "one_copy": (dict(variable_device="/cpu:0",
                      devices=["/cpu:1", "/cpu:2"]), 1),
    "add_n": (dict(variable_device="replicated", all_reduce="add_n"), 1),
    "ring": (dict(variable_device="replicated", all_reduce="ring"), 1),
    "collective": (dict(variable_device="replicated",
                        all_reduce="collective"), 1),
    "accumulate": (dict(variable_device="/cpu:0",
                        devices=["/cpu:1", "/cpu:2"], accumulate_steps=2), 2),
    "accumulate_replicated": (dict(variable_device="replicated",
                                   accumulate_steps=2), 2),
}


def _values():
  rng = np.random.RandomState(0)
  return {"fc/kernel": rng.normal(0, 0.5, (IN, CLASSES)),
          "fc1/kernel": rng.normal(0, 0.5, (IN, HIDDEN)),
          "fc1/bias": rng.normal(0, 0.1, (HIDDEN,)),
          "fc2/kernel": rng.normal(0, 0.5, (HIDDEN, CLASSES)),
          "fc2/bias": rng.normal(0, 0.1, (CLASSES,))}


VALUES = {k: v.astype(np.float32) for k, v in _values().items()}


def _l2(w):
  return DECAY * tf.nn.l2_loss(w)


def _init(name):
  return tf.constant_initializer(VALUES[name])


class Net:
  """A two-layer net (``fc1``, tanh, ``fc2``) whose fc1 kernel, fc2 kernel
  and fc2 bias a regularizer `style` decays (``layers_keras``: fc1's
  activity too), built as that style builds it; made once per graph (a
  Keras model is held by the object)."""

  def __init__(self, style):
    self.style = style
    if style == "keras_model":
      keras = tf.keras
      l2 = keras.regularizers.l2(DECAY)
      self.model = keras.Sequential([
          keras.layers.Dense(HIDDEN, tf.tanh, name="fc1",
                             kernel_initializer=_init("fc1/kernel"),
                             bias_initializer=_init("fc1/bias"),
                             kernel_regularizer=l2),
          keras.layers.Dense(CLASSES, name="fc2",
                             kernel_initializer=_init("fc2/kernel"),
                             bias_initializer=_init("fc2/bias"),
                             kernel_regularizer=l2, bias_regularizer=l2)])

  def logits(self, x):
    style = self.style
    if style == "keras_model":
      return self.model(x)
    if style in REPORTED:
      reg = _l2 if style == "reported_function" else \
          tf.keras.regularizers.l2(DECAY)
      return tf.layers.dense(x, CLASSES, kernel_regularizer=reg, name="fc",
                             kernel_initializer=_init("fc/kernel"))
    if style in ("layers_function", "layers_keras"):
      reg = _l2 if style == "layers_function" else tf.keras.regularizers.l2(
          DECAY)
      # With Keras regularizers, fc1's activity too: each tower's own, on
      # its batch (Keras divides the sum by the batch size: a mean).
      net = tf.layers.dense(
          x, HIDDEN, tf.tanh, name="fc1",
          kernel_initializer=_init("fc1/kernel"),
          bias_initializer=_init("fc1/bias"), kernel_regularizer=reg,
          activity_regularizer=None if reg is _l2 else reg)
      return tf.layers.dense(net, CLASSES, name="fc2",
                             kernel_initializer=_init("fc2/kernel"),
                             bias_initializer=_init("fc2/bias"),
                             kernel_regularizer=reg, bias_regularizer=reg)
    if style == "slim":
      reg = slim.l2_regularizer(DECAY)
      net = slim.fully_connected(x, HIDDEN, tf.tanh, scope="fc1",
                                 weights_initializer=_init("fc1/kernel"),
                                 biases_initializer=_init("fc1/bias"),
                                 weights_regularizer=reg)
      return slim.fully_connected(net, CLASSES, None, scope="fc2",
                                  weights_initializer=_init("fc2/kernel"),
                                  biases_initializer=_init("fc2/bias"),
                                  weights_regularizer=reg,
                                  biases_regularizer=reg)
    net = x
    for layer, decayed in (("fc1", ("kernel",)), ("fc2", ("kernel", "bias"))):
      with tf.variable_scope(layer):
        weights = {}
        for part in ("kernel", "bias"):
          reg = _l2 if style == "get_variable" and part in decayed else None
          weights[part] = tf.get_variable(
              part, VALUES[layer + "/" + part].shape,
              initializer=_init(layer + "/" + part), regularizer=reg)
          if style == "cifar10" and part in decayed:
            # The CIFAR-10 tutorial's weight decay, in the tower's losses.
            tf.add_to_collection("losses", tf.multiply(
                tf.nn.l2_loss(weights[part]), DECAY, name="weight_loss"))
        net = tf.matmul(net, weights["kernel"]) + weights["bias"]
      if layer == "fc1":
        net = tf.tanh(net)
    return net

  def loss(self, scope, x, y, composition):
    """The model's loss in `scope` (None on one device), composed as named
    (a Keras model's regularizers are its model.losses, added to each)."""
    ce = tf.losses.sparse_softmax_cross_entropy(y, self.logits(x))
    data = tf.add_n(tf.get_collection(tf.GraphKeys.LOSSES, scope))
    if composition == "reported":
      loss = ce + tf.losses.get_regularization_loss()
    elif composition == "get_regularization_loss":
      loss = data + tf.losses.get_regularization_loss()
    elif composition == "add_n":
      loss = tf.add_n([data] + tf.losses.get_regularization_losses())
    elif composition == "get_total_loss":
      loss = tf.losses.get_total_loss(
          add_regularization_losses=False,
          scope=scope) + tf.losses.get_regularization_loss()
    else:  # The tutorial's, which counts only the scope's regularization.
      loss = tf.losses.get_total_loss(scope=scope)
    if self.style == "keras_model":
      loss += tf.add_n(self.model.losses)
    return loss


def batches(count, size=BATCH):
  rng = np.random.RandomState(1)
  return [(rng.normal(0, 1, (size, IN)).astype(np.float32),
           rng.randint(0, CLASSES, size).astype(np.int32))
          for _ in range(count)]


def _optimizer():
  return tf.train.MomentumOptimizer(0.2, 0.9)


def one_device(style, composition, micro):
  """Global variables after `UPDATES` one-device steps, each on `micro`
  batches together, and how far the weights moved."""
  data = batches(UPDATES * micro)
  with tf.Graph().as_default():
    x = tf.placeholder(tf.float32, [None, IN])
    y = tf.placeholder(tf.int32, [None])
    loss = Net(style).loss(None, x, y, composition)
    train_op = _optimizer().minimize(
        loss, gate_gradients=tf.train.Optimizer.GATE_GRAPH)
    with tf.Session(config=towers.virtual_cpu_config(1)) as sess:
      sess.run(tf.global_variables_initializer())
      weights = tf.trainable_variables()
      initial = sess.run(weights)
      for k in range(UPDATES):
        group = data[k * micro:(k + 1) * micro]
        sess.run(train_op, {x: np.concatenate([b[0] for b in group]),
                            y: np.concatenate([b[1] for b in group])})
      moved = max(float(np.max(np.abs(a - b)))
                  for a, b in zip(initial, sess.run(weights)))
      return {v.op.name: sess.run(v) for v in tf.global_variables()}, moved


def build(style, composition, mode):
  """The towers' train op and inputs, on 2 towers in `mode`."""
  kwargs, _ = MODES[mode]
  kwargs = dict(dict(devices=["/cpu:0", "/cpu:1"]), **kwargs)
  x = tf.placeholder(tf.float32, [BATCH, IN])
  y = tf.placeholder(tf.int32, [BATCH])
  net = Net(style)
  train_op, _ = towers.minimize(
      lambda scope, a, b: net.loss(scope, a, b, composition), _optimizer(),
      2, inputs=(x, y), **kwargs)
  return train_op, x, y


def on_towers(style, composition, mode):
  """Global variables after `UPDATES` updates, and the copies' gap."""
  micro = MODES[mode][1]
  data = batches(UPDATES * micro)
  with tf.Graph().as_default():
    train_op, x, y = build(style, composition, mode)
    config = towers.virtual_cpu_config(3)
    config.operation_timeout_in_ms = 60000
    with tf.Session(config=config) as sess:
      sess.run(tf.global_variables_initializer())
      sess.run(tf.local_variables_initializer())
      for bx, by in data:
        sess.run(train_op, {x: bx, y: by})
      values = {v.op.name: sess.run(v) for v in tf.global_variables()}
      return values, copies_gap(sess, values)


def case(style, composition, mode, references):
  micro = MODES[mode][1]
  key = (style, composition, micro)
  if key not in references:
    references[key] = one_device(style, composition, micro)
  want, moved = references[key]
  try:
    got, copies_gap = on_towers(style, composition, mode)
  except (ValueError, TypeError) as e:
    return {"error": str(e)}
  missing = sorted(set(want) - set(got))
  gap = max(float(np.max(np.abs(got[k] - v))) for k, v in want.items()
            if k in got)
  return {"gap": gap, "copies_gap": copies_gap, "missing": missing,
          "moved": moved, "variables": len(want)}


def error(style, composition, mode):
  with tf.Graph().as_default():
    try:
      build(style, composition, mode)
    except ValueError as e:
      return str(e)
  return None


def sends(style):
  """{weight: {tower device index: sends}} of one one-copy step."""
  with tf.Graph().as_default() as graph:
    train_op, x, y = build(style, "get_regularization_loss", "one_copy")
    with tf.Session(config=towers.virtual_cpu_config(3)) as sess:
      sess.run(tf.global_variables_initializer())
      metadata = tf.RunMetadata()
      bx, by = batches(1)[0]
      sess.run(train_op, {x: bx, y: by}, run_metadata=metadata,
               options=tf.RunOptions(output_partition_graphs=True))
    kernels = [v for v in tf.trainable_variables() if v.shape.rank == 2]
    return weight_sends(graph, metadata, kernels)


def main():
  use_variables("--ref-variables" in sys.argv)
  # --shard K/N: the styles K, K + N, ... of the list below.
  shard, shards = (int(n) for n in (sys.argv[sys.argv.index("--shard") + 1]
                                    if "--shard" in sys.argv else "0/1"
                                   ).split("/"))
  styles = [s for s in STYLES if s != "slim" or slim is not None]
  planned = [(style, composition, mode) for style in styles
             for composition in COMPOSITIONS for mode in MODES]
  planned += [(style, "reported", mode) for style in REPORTED
              for mode in MODES]
  # The tutorial's loss: each replicated tower's scope holds its own
  # layers' regularization, so it is exact there.
  planned += [(style, "scoped_total_loss", "add_n")
              for style in ("layers_function", "slim") if style in styles]
  mine = (styles + list(REPORTED))[shard::shards]
  references = {}
  result = {
      "cases": {" ".join(c): case(*c, references) for c in planned
                if c[0] in mine},
      "sends": {style: sends(style) for style in mine
                if style in styles and style != "cifar10"},
      "slim": slim is not None,
  }
  if shard == 0:
    result["errors"] = {
        # tf.get_variable's regularizer is beside the variable, outside
        # every scope; a layer's is in tower 0's scope only.
        "dropped": error("get_variable", "scoped_total_loss", "one_copy"),
        "unequal": error("layers_function", "scoped_total_loss", "one_copy"),
    }
  print(json.dumps(result))


if __name__ == "__main__":
  main()
