"""Runs `towers.testing.assert_matches_one_device` on Keras and
tf.compat.v1.layers models; run by test_testing.

A separate process, because TF_USE_LEGACY_KERAS must be set before
TensorFlow is imported (TensorFlow >= 2.16). Prints one line of JSON: for
each model, None where the assertion passed, else its message.
Usage: python testing_run.py [--ref-variables]
"""

import json
import os
import sys

os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")

import numpy as np  # pylint: disable=g-import-not-at-top
import tensorflow.compat.v1 as tf

import models
import towers
from towers import testing

keras = tf.keras


def keras_model(batch_norm):
  """A maker of the model function: a Keras model belongs to one graph, so
  each program builds its own, once, outside the model function."""

  def make():
    layers = [keras.layers.Conv2D(4, 3, kernel_regularizer=keras.regularizers
                                  .l2(0.01)), keras.layers.ReLU()]
    if batch_norm:
      layers.append(keras.layers.BatchNormalization())
    model = keras.Sequential(layers + [keras.layers.Flatten(),
                                       keras.layers.Dense(3)])

    def model_fn(scope, images, labels):
      del scope
      loss = tf.losses.sparse_softmax_cross_entropy(
          labels, model(images, training=True))
      return loss + tf.add_n(model.losses)
    return model_fn
  return make


def layers_model(batch_norm):
  """tf.layers with their batch norm per tower, or the synchronized one."""

  def model_fn(scope, images, labels):
    del scope
    net = tf.layers.conv2d(images, 4, 3, activation=tf.nn.relu)
    if batch_norm == "towers":
      net = towers.batch_normalization(net, training=True)
    else:
      net = tf.layers.batch_normalization(net, training=True)
    logits = tf.layers.dense(tf.layers.flatten(net), 3)
    return tf.losses.sparse_softmax_cross_entropy(labels, logits)
  return model_fn


def message(model_fn, variable_device=None):
  rng = np.random.RandomState(0)
  batch = (rng.normal(size=(8, 5, 5, 2)).astype(np.float32),
           rng.randint(0, 3, 8))
  try:
    testing.assert_matches_one_device(
        model_fn, lambda: tf.train.MomentumOptimizer(0.1, 0.9), batch,
        variable_device=variable_device)
  except AssertionError as e:
    return str(e)
  return None


def main():
  models.use_variables("--ref-variables" in sys.argv)
  print(json.dumps({
      "keras": message(keras_model(False)),
      # The failures in one mode (and its uneven split): the message is
      # the same in every mode.
      "keras_batch_norm": message(keras_model(True), "cpu"),
      "layers_per_tower_batch_norm": message(layers_model("tf.layers"),
                                             "cpu"),
      "layers_synchronized_batch_norm": message(layers_model("towers")),
  }))


if __name__ == "__main__":
  main()
