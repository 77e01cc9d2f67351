"""The benchmarked models: the examples' CNNs, and many small variables.

The CNNs are imported from examples/ (not copied), so the benchmark times
exactly what the examples train. The third model (`small_variables`) is
synthetic: little compute and many small variables, like a network's biases
and batch-norm scales and offsets, where a reduction's fixed cost per tensor
shows (gradient packing). Each workload is a loss function of one
batch, ``loss_fn(images, labels) -> scalar loss``, built from
``tf.get_variable`` calls: the graph variants call it in each tower, the
MirroredStrategy worker calls it inside TF2's variable-scope shim. The CNNs
also compute in float16 or bfloat16 (`computing_in`), for the mixed
precision rows of `benchmarks.fast_paths`.
"""

import collections
import functools
import os
import sys
from typing import Tuple

import numpy as np
import tensorflow.compat.v1 as tf

EXAMPLES_DIR = os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")

NUM_CLASSES = 10

Workload = collections.namedtuple(
    "Workload", ["name", "title", "image_shape", "loss_fn"])
Workload.__doc__ = """One benchmarked model.

Fields:
  name: the key in results ("mnist", "cifar10", "many_small").
  title: a human-readable name for tables and charts.
  image_shape: one example's shape, ``[height, width, channels]`` (a
    vector's, ``[width]``, for `small_variables`).
  loss_fn: ``loss_fn(images, labels)`` builds the model on one batch (with
    ``tf.get_variable``) and returns its scalar training loss.
"""


def _import_examples():
  """Returns the examples' model modules, adding examples/ to sys.path."""
  if EXAMPLES_DIR not in sys.path:
    sys.path.insert(0, EXAMPLES_DIR)
  import cifar10_model  # pylint: disable=g-import-not-at-top
  import mnist_model  # pylint: disable=g-import-not-at-top
  return mnist_model, cifar10_model


def _mnist_loss(images: tf.Tensor, labels: tf.Tensor,
                dtype: tf.DType = tf.float32) -> tf.Tensor:
  mnist_model, _ = _import_examples()
  # The training example's defaults: dropout 0.5, weight decay 5e-4.
  logits, decay = mnist_model.inference(images, dropout_rate=0.5,
                                        weight_decay=5e-4, dtype=dtype)
  return tf.add(mnist_model.cross_entropy(logits, labels), decay,
                name="total_loss")


def _cifar10_loss(images: tf.Tensor, labels: tf.Tensor,
                  dtype: tf.DType = tf.float32) -> tf.Tensor:
  _, cifar10_model = _import_examples()
  logits, decay = cifar10_model.inference(images, dtype=dtype)
  # The tutorial's loss adds summaries to a collection; no benchmarked step
  # runs them, so they cost nothing at run time.
  return cifar10_model.loss(logits, labels, decay)


# The CNNs' losses, which compute in a dtype (`computing_in`).
_CNN_LOSSES = {"mnist": _mnist_loss, "cifar10": _cifar10_loss}


def small_variables(width: int, num_variables: int,
                    name: str = "many_small") -> Workload:
  """Returns a model of `num_variables` variables of `width` floats each.

  Layer ``k`` computes ``h = tanh(h * scale_k + offset_k)`` on an input of
  ``[batch, width]`` floats, with ``scale_k`` (ones) and ``offset_k``
  (zeros) of shape ``[width]``, as batch norm's gamma and beta: two
  variables per layer and a few elementwise ops per example and float. The
  logits are the last layer's first `NUM_CLASSES` columns, the loss their
  mean sparse softmax cross-entropy.

  Args:
    width: floats per variable (and per example), at least `NUM_CLASSES`.
    num_variables: the trainable variables, an even number (two per layer).
    name: the workload's key in results.

  Raises:
    ValueError: if `num_variables` is odd or not positive, or `width` is
      below `NUM_CLASSES`.
  """
  if num_variables < 2 or num_variables % 2:
    raise ValueError("expected an even number of variables (a scale and an "
                     "offset per layer), got %d" % num_variables)
  if width < NUM_CLASSES:
    raise ValueError("expected a width of at least %d floats (the logits' "
                     "columns), got %d" % (NUM_CLASSES, width))

  def loss_fn(images: tf.Tensor, labels: tf.Tensor) -> tf.Tensor:
    h = images
    for k in range(num_variables // 2):
      with tf.variable_scope("layer_%d" % k):
        scale = tf.get_variable("scale", [width],
                                initializer=tf.ones_initializer())
        offset = tf.get_variable("offset", [width],
                                 initializer=tf.zeros_initializer())
      h = tf.tanh(h * scale + offset)
    logits = h[:, :NUM_CLASSES]
    return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
        labels=labels, logits=logits), name="total_loss")

  title = "Many small variables (%d x %d floats)" % (num_variables, width)
  return Workload(name, title, [width], loss_fn)


# "many_small": 200 variables of 4 KiB each, 800 KiB in all, every gradient
# under the library's default pack_bytes (16 KiB).
MANY_SMALL_WIDTH = 1024
MANY_SMALL_VARIABLES = 200

WORKLOADS = {
    "mnist": Workload("mnist", "MNIST CNN", [28, 28, 1], _mnist_loss),
    "cifar10": Workload("cifar10", "CIFAR-10 CNN", [24, 24, 3],
                        _cifar10_loss),
    "many_small": small_variables(MANY_SMALL_WIDTH, MANY_SMALL_VARIABLES),
}


def computing_in(workload: Workload, compute_dtype: str) -> Workload:
  """Returns a CNN workload that computes in `compute_dtype`.

  The examples' own mixed precision (their ``inference(..., dtype=...)``):
  the model asks for its weights in `compute_dtype` and casts its images to
  it; its logits, weight decay and loss are float32. Built under
  `towers.minimize` with the same ``compute_dtype``, the variables are
  float32 master weights of the same names and shapes; without it, they
  would be made in `compute_dtype`.

  Args:
    workload: "mnist" or "cifar10" (`WORKLOADS`).
    compute_dtype: "float16" or "bfloat16" ("float32": the workload as it
      is).

  Raises:
    ValueError: for another workload.
  """
  if workload.name not in _CNN_LOSSES:
    raise ValueError("expected a CNN workload (%s) to compute in %s, got %r"
                     % (", ".join(_CNN_LOSSES), compute_dtype, workload.name))
  dtype = tf.as_dtype(compute_dtype)
  if dtype == tf.float32:
    return workload
  return Workload(workload.name, "%s, %s" % (workload.title, dtype.name),
                  workload.image_shape,
                  functools.partial(_CNN_LOSSES[workload.name], dtype=dtype))


def synthetic_batch(workload: Workload, batch_size: int,
                    seed: int = 0) -> Tuple[np.ndarray, np.ndarray]:
  """Returns one fixed random batch: float32 examples and int64 labels."""
  rng = np.random.RandomState(seed)
  images = rng.standard_normal([batch_size] + workload.image_shape)
  labels = rng.randint(0, NUM_CLASSES, size=[batch_size])
  return images.astype(np.float32), labels.astype(np.int64)
