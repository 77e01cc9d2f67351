"""Trains a tf.compat.v1.layers model on 2 towers, and checks
towers.batch_normalization against tf.layers; run by test_legacy_layers.

A separate process, because TF_USE_LEGACY_KERAS must be set before
TensorFlow is imported. Prints one line of JSON with what it measured.
Usage: python legacy_layers_run.py [--ref-variables]
"""

import json
import os
import sys
import tempfile

os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")

import numpy as np  # pylint: disable=g-import-not-at-top
import tensorflow.compat.v1 as tf

import towers


def model(scope, images, labels, batch_norm):
  """batch_norm: False, True (tf.layers) or "towers" (synchronized)."""
  net = tf.layers.conv2d(images, 4, 3, activation=tf.nn.relu, name="conv")
  if batch_norm == "towers":
    net = towers.batch_normalization(net, training=True, name="bn")
  elif batch_norm:
    net = tf.layers.batch_normalization(net, training=True, name="bn")
  net = tf.layers.flatten(net)
  logits = tf.layers.dense(net, 3, name="dense")
  return tf.losses.sparse_softmax_cross_entropy(labels, logits)


def data():
  rng = np.random.RandomState(0)
  return (rng.normal(size=(8, 6, 6, 2)).astype(np.float32),
          rng.randint(0, 3, 8).astype(np.int32))


def config(n):
  return towers.virtual_cpu_config(n)


def gradient_gap(batch_norm=False):
  """Max |towers - single device| over the gradients, 2 towers of `model`
  with `batch_norm` (see `model`)."""
  x, y = data()
  with tf.Graph().as_default() as g:
    loss = model(None, tf.constant(x), tf.constant(y), batch_norm)
    variables = tf.trainable_variables()
    want = tf.gradients(loss, variables)
    with tf.Session(graph=g, config=config(1)) as sess:
      sess.run(tf.global_variables_initializer())
      init = {v.op.name: sess.run(v) for v in variables}
      want = dict(zip([v.op.name for v in variables], sess.run(want)))
  with tf.Graph().as_default() as g:
    t = towers.build_towers(
        lambda scope, a, b: model(scope, a, b, batch_norm),
        tf.train.GradientDescentOptimizer(0.1), 2,
        inputs=(tf.constant(x), tf.constant(y)), devices=["/cpu:0", "/cpu:1"])
    averaged = towers.average_gradients(t.tower_grads, t.weights)
    with tf.Session(graph=g, config=config(2)) as sess:
      sess.run(tf.global_variables_initializer())
      for v in tf.trainable_variables():
        v.load(init[v.op.name], sess)
      got = sess.run([grad for grad, _ in averaged])
  return max(float(np.max(np.abs(a - want[v.op.name])))
             for a, (_, v) in zip(got, averaged))


def train_with_batch_norm():
  x, y = data()
  with tf.Graph().as_default() as g:
    train_op, t = towers.minimize(
        lambda scope, a, b: model(scope, a, b, True),
        tf.train.AdamOptimizer(0.05), 2,
        inputs=(tf.constant(x), tf.constant(y)), devices=["/cpu:0", "/cpu:1"])
    moving_mean = [v for v in tf.global_variables()
                   if v.op.name == "bn/moving_mean"][0]
    with tf.Session(graph=g, config=config(2)) as sess:
      sess.run(tf.global_variables_initializer())
      first = sess.run(t.loss)
      for _ in range(20):
        sess.run(train_op)
      last = sess.run(t.loss)
      mean = sess.run(moving_mean)
    kinds = sorted({v.op.type for v in tf.global_variables()})
  return {"first_loss": float(first), "last_loss": float(last),
          "moving_mean_moved": bool(np.any(mean != 0)),
          "update_ops": [op.name for op in t.update_ops],
          "variable_ops": kinds}


def replicated_batch_norm():
  """tf.layers with batch norm, replicated against the one-copy mode."""
  x, y = data()
  values, init = {}, None
  for mode in ["gpu", "replicated"]:
    with tf.Graph().as_default() as g:
      train_op, _ = towers.minimize(
          lambda scope, a, b: model(scope, a, b, True),
          tf.train.MomentumOptimizer(0.05, 0.9), 2,
          inputs=(tf.constant(x), tf.constant(y)),
          devices=["/cpu:0", "/cpu:1"], variable_device=mode)
      with tf.Session(graph=g, config=config(2)) as sess:
        sess.run(tf.global_variables_initializer())
        if init is None:
          init = {v.op.name: sess.run(v) for v in tf.global_variables()}
        for v in tf.global_variables():
          v.load(init[v.op.name], sess)
        sess.run(tf.local_variables_initializer())
        for _ in range(10):
          sess.run(train_op)
        values[mode] = {v.op.name: sess.run(v) for v in
                        tf.global_variables() + tf.local_variables()}
  got = values["replicated"]
  copies = sorted(n for n in got if n.startswith("replica_"))
  return {
      "replicated_gap": max(float(np.max(np.abs(got[n] - v)))
                            for n, v in values["gpu"].items()),
      "replicated_copies": copies,
      "copies_gap": max(float(np.max(np.abs(got[n] - got[n.split("/", 1)[1]])))
                        for n in copies),
  }


def keras_layer_per_tower_error():
  """A Keras Dense object built anew per tower: must be refused."""
  with tf.Graph().as_default():

    def per_tower(scope, a, b):
      layer = tf.keras.layers.Dense(3)
      return tf.reduce_mean(layer(tf.reshape(a, [-1, 72])))

    x, y = data()
    try:
      towers.build_towers(per_tower, tf.train.GradientDescentOptimizer(0.1),
                          2, inputs=(tf.constant(x), tf.constant(y)),
                          devices=["/cpu:0", "/cpu:1"])
    except ValueError as e:
      return str(e)
  return None


# towers.batch_normalization against tf.layers.batch_normalization on one
# device: input shape and arguments (4-D inputs take tf.layers' fused kernel
# unless fused=False).
LAYER_CASES = [
    ((8, 5), {}),
    ((8, 3, 3, 2), {}),
    ((8, 3, 3, 2), {"fused": False}),
    ((8, 2, 3), {"axis": 1}),
    ((8, 3, 3, 2), {"center": False, "momentum": 0.9, "epsilon": 0.01}),
    ((8, 3, 3, 2), {"scale": False, "training": False}),
]


def layer_against_tf_layers(shape, kwargs):
  """Variables, outputs, gradients and moving averages after one update."""
  rng = np.random.RandomState(len(shape))
  x = (rng.normal(size=shape) * 3 + 2).astype(np.float32)
  r = rng.normal(size=shape).astype(np.float32)
  kwargs = dict({"training": True}, **kwargs)
  results = []
  for layer in [tf.layers.batch_normalization, towers.batch_normalization]:
    with tf.Graph().as_default():
      inputs = tf.constant(x)
      out = layer(layer(inputs, **kwargs), **kwargs)
      variables = tf.global_variables()
      trainable = tf.trainable_variables()
      grads = tf.gradients(tf.reduce_sum(out * r), [inputs] + trainable)
      updates = tf.get_collection(tf.GraphKeys.UPDATE_OPS)
      with tf.Session() as sess:
        sess.run(tf.global_variables_initializer())
        values = sess.run([out] + grads)
        sess.run(updates)
        values += sess.run(variables)
      results.append({
          "variables": [(v.op.name, v.shape.as_list()) for v in variables],
          "trainable": [v.op.name for v in trainable],
          "updates": len(updates), "values": values})
  want, got = results
  same = all(want[k] == got[k] for k in ["variables", "trainable", "updates"])
  gap = max(float(np.max(np.abs(a - b)))
            for a, b in zip(want["values"], got["values"]))
  return {"shape": list(shape), "kwargs": repr(kwargs),
          "same_variables": same, "gap": gap}


def checkpoints_interchange(directory):
  """A tf.layers model's checkpoint restores into synchronized towers, and
  theirs into it; the restored towers' loss is the tf.layers loss."""
  x, y = data()
  path = os.path.join(directory, "layers.ckpt")
  with tf.Graph().as_default() as g:
    loss = model(None, tf.constant(x), tf.constant(y), True)
    opt = tf.train.MomentumOptimizer(0.05, 0.9)
    with tf.control_dependencies(tf.get_collection(tf.GraphKeys.UPDATE_OPS)):
      step = opt.minimize(loss)
    with tf.Session(graph=g, config=config(1)) as sess:
      sess.run(tf.global_variables_initializer())
      for _ in range(3):
        sess.run(step)
      saved = {v.op.name: sess.run(v) for v in tf.global_variables()}
      want_loss = sess.run(loss)
      tf.train.Saver().save(sess, path)
  result = {}
  with tf.Graph().as_default() as g:
    _, t = towers.minimize(
        lambda scope, a, b: model(scope, a, b, "towers"),
        tf.train.MomentumOptimizer(0.05, 0.9), 2,
        inputs=(tf.constant(x), tf.constant(y)), devices=["/cpu:0", "/cpu:1"])
    result["same_names"] = sorted(
        v.op.name for v in tf.global_variables()) == sorted(saved)
    with tf.Session(graph=g, config=config(2)) as sess:
      tf.train.Saver().restore(sess, path)
      restored = {v.op.name: sess.run(v) for v in tf.global_variables()}
      result["restored_gap"] = max(float(np.max(np.abs(restored[n] - v)))
                                   for n, v in saved.items())
      result["loss_gap"] = float(abs(sess.run(t.loss) - want_loss))
      for v in tf.global_variables():
        v.load(restored[v.op.name] * 0.5, sess)
      tf.train.Saver().save(sess, os.path.join(directory, "towers.ckpt"))
  with tf.Graph().as_default() as g:
    model(None, tf.constant(x), tf.constant(y), True)
    tf.train.MomentumOptimizer(0.05, 0.9).minimize(
        tf.add_n(tf.get_collection(tf.GraphKeys.LOSSES)))
    with tf.Session(graph=g, config=config(1)) as sess:
      tf.train.Saver().restore(sess, os.path.join(directory, "towers.ckpt"))
      result["back_gap"] = max(
          float(np.max(np.abs(sess.run(v) - restored[v.op.name] * 0.5)))
          for v in tf.global_variables())
  return result


def main():
  if "--ref-variables" in sys.argv:
    tf.disable_v2_behavior()
  else:
    # TensorFlow 2's default; TensorFlow 1.15 makes ref variables unless asked.
    tf.enable_resource_variables()
  result = {"tf": tf.__version__, "gradient_gap": gradient_gap(),
            "keras_error": keras_layer_per_tower_error()}
  result.update(train_with_batch_norm())
  result.update(replicated_batch_norm())
  result["layer_cases"] = [layer_against_tf_layers(shape, kwargs)
                           for shape, kwargs in LAYER_CASES]
  with tempfile.TemporaryDirectory() as directory:
    result["checkpoints"] = checkpoints_interchange(directory)
  # The weights' gradient gap to one device: tf.layers per tower, and
  # towers.batch_normalization.
  result["per_tower_gaps"] = {"tf_layers": gradient_gap(True),
                              "synchronized": gradient_gap("towers")}
  print(json.dumps(result))


if __name__ == "__main__":
  main()
