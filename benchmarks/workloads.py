"""The benchmarked models: the examples' MNIST and CIFAR-10 CNNs, unchanged.

The models are imported from examples/ (not copied), so the benchmark times
exactly what the examples train. Each workload is a loss function of one
batch, ``loss_fn(images, labels) -> scalar loss``, built from
``tf.get_variable`` calls: the graph variants call it in each tower, the
MirroredStrategy worker calls it inside TF2's variable-scope shim.
"""

import collections
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
  name: the key in results ("mnist", "cifar10").
  title: a human-readable name for tables and charts.
  image_shape: one image's shape, ``[height, width, channels]``.
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


def _mnist_loss(images: tf.Tensor, labels: tf.Tensor) -> tf.Tensor:
  mnist_model, _ = _import_examples()
  # The training example's defaults: dropout 0.5, weight decay 5e-4.
  logits, decay = mnist_model.inference(images, dropout_rate=0.5,
                                        weight_decay=5e-4)
  return tf.add(mnist_model.cross_entropy(logits, labels), decay,
                name="total_loss")


def _cifar10_loss(images: tf.Tensor, labels: tf.Tensor) -> tf.Tensor:
  _, cifar10_model = _import_examples()
  logits, decay = cifar10_model.inference(images)
  # The tutorial's loss adds summaries to a collection; no benchmarked step
  # runs them, so they cost nothing at run time.
  return cifar10_model.loss(logits, labels, decay)


WORKLOADS = {
    "mnist": Workload("mnist", "MNIST CNN", [28, 28, 1], _mnist_loss),
    "cifar10": Workload("cifar10", "CIFAR-10 CNN", [24, 24, 3],
                        _cifar10_loss),
}


def synthetic_batch(workload: Workload, batch_size: int,
                    seed: int = 0) -> Tuple[np.ndarray, np.ndarray]:
  """Returns one fixed random batch: float32 images and int64 labels."""
  rng = np.random.RandomState(seed)
  images = rng.standard_normal([batch_size] + workload.image_shape)
  labels = rng.randint(0, NUM_CLASSES, size=[batch_size])
  return images.astype(np.float32), labels.astype(np.int64)
