"""The CIFAR-10 tutorial's network and loss, for 24x24 RGB images.

Used by the CIFAR-10 example scripts; run them, not this module:

  python examples/cifar10_multi_gpu_train.py --num_gpus=2 --fake_data
  python examples/cifar10_eval.py --run_once

conv1 (5x5x64, ReLU), 3x3/2 max pool, local response normalization, conv2
(5x5x64, ReLU), normalization, 3x3/2 max pool, local3 (384, ReLU), local4
(192, ReLU), softmax_linear (10 logits): 1,068,298 parameters at 24x24. The
fully connected layers' weights carry an L2 weight decay of 0.004.

Variables are made with ``tf.get_variable`` in variable scopes named as in
the tutorial (``conv1/weights`` ...), so that towers share them and a
checkpoint has single-device names. Placement is left to the caller (the
towers' device function puts variables on the CPU). The batch size is never
fixed here: it comes from the images.

With ``dtype=tf.float16`` (the training script's --use_fp16) the network
asks for its weights in float16 and computes in it, as the tutorial's
--use_fp16 did; under `towers.minimize`'s ``compute_dtype`` the variables
are float32 master weights, so a checkpoint reads into the float32
evaluation graph. Unlike the tutorial, the local response normalizations,
the weight decay and the logits are computed in float32: LRN has no
float16 GPU kernel (nor a bfloat16 CPU one), and a sum of squares or a
softmax in float16 loses the small terms.
"""

import re
from typing import Tuple

import tensorflow.compat.v1 as tf

NUM_CLASSES = 10
WEIGHT_DECAY = 0.004
NUM_PARAMETERS = 1068298  # At 24x24 input; checked by a test.
# Training keeps this moving average of every trainable variable, and
# evaluation restores it in place of the raw weights.
MOVING_AVERAGE_DECAY = 0.9999

_TOWER_PREFIX = re.compile(r"^tower_\d+/")


def summary_tag(name: str) -> str:
  """Returns `name` inside the current name scope, without a tower prefix.

  Every tower builds the same summaries; without the ``tower_i/`` prefix the
  kept (final) tower's tags read the same for any number of towers.
  """
  scope = tf.get_default_graph().get_name_scope()
  return _TOWER_PREFIX.sub("", "%s/%s" % (scope, name) if scope else name)


def _add_summary(op: tf.Tensor) -> None:
  tf.add_to_collection(tf.GraphKeys.SUMMARIES, op)


def scalar_summary(name: str, value: tf.Tensor) -> None:
  """Adds a scalar summary tagged with `summary_tag(name)`."""
  _add_summary(tf.raw_ops.ScalarSummary(tags=summary_tag(name), values=value,
                                        name=name))


def _activation_summary(x: tf.Tensor) -> None:
  """Histogram and sparsity of a layer's output, as the tutorial keeps."""
  _add_summary(tf.raw_ops.HistogramSummary(
      tag=summary_tag("activations"), values=x, name="activations"))
  scalar_summary("sparsity", tf.nn.zero_fraction(x))


def _weights(shape, stddev: float, dtype: tf.DType) -> tf.Tensor:
  return tf.get_variable(
      "weights", shape, dtype,
      initializer=tf.truncated_normal_initializer(stddev=stddev))


def _biases(size: int, value: float, dtype: tf.DType) -> tf.Tensor:
  return tf.get_variable("biases", [size], dtype,
                         initializer=tf.constant_initializer(value))


def _conv(x: tf.Tensor, name: str, depth: int, bias: float) -> tf.Tensor:
  with tf.variable_scope(name):
    kernel = _weights([5, 5, int(x.shape[-1]), depth], 5e-2, x.dtype)
    conv = tf.nn.conv2d(x, kernel, [1, 1, 1, 1], padding="SAME")
    out = tf.nn.relu(tf.nn.bias_add(conv, _biases(depth, bias, x.dtype)))
    _activation_summary(out)
  return out


def _pool(x: tf.Tensor, name: str) -> tf.Tensor:
  return tf.nn.max_pool(x, ksize=[1, 3, 3, 1], strides=[1, 2, 2, 1],
                        padding="SAME", name=name)


def _norm(x: tf.Tensor, name: str) -> tf.Tensor:
  # In float32 whatever x's dtype (see the module docstring); a no-op cast
  # for float32.
  out = tf.nn.lrn(tf.cast(x, tf.float32), 4, bias=1.0, alpha=0.001 / 9.0,
                  beta=0.75, name=name)
  return tf.cast(out, x.dtype)


def inference(images: tf.Tensor, dtype: tf.DType = tf.float32
             ) -> Tuple[tf.Tensor, tf.Tensor]:
  """Builds the network on a batch of images.

  Args:
    images: ``[batch, 24, 24, 3]`` float32, per-image standardized; the
      batch size may be unknown.
    dtype: the dtype the network computes in: float32, or float16 (or
      bfloat16): its weights are asked for in it and the images cast to it.

  Returns:
    ``(logits, weight_decay)``: ``[batch, 10]`` float32 unnormalized log
    probabilities, and the scalar float32 L2 weight-decay term of this
    call's fully connected weights (as the network computes with them).
    Each call (each tower) returns its own term, so adding it to the
    tower's loss counts the decay exactly once per tower.
  """
  dtype = tf.as_dtype(dtype)
  decay = []
  x = _conv(tf.cast(images, dtype), "conv1", 64, bias=0.0)
  x = _norm(_pool(x, "pool1"), "norm1")
  x = _conv(x, "conv2", 64, bias=0.1)
  x = _pool(_norm(x, "norm2"), "pool2")
  # Flatten with the static feature size; the batch stays dynamic.
  x = tf.reshape(x, [-1, x.shape[1:].num_elements()])
  for name, size in (("local3", 384), ("local4", 192)):
    with tf.variable_scope(name):
      weights = _weights([int(x.shape[-1]), size], 0.04, dtype)
      decay.append(tf.multiply(tf.nn.l2_loss(tf.cast(weights, tf.float32)),
                               WEIGHT_DECAY, name="weight_loss"))
      x = tf.nn.relu(tf.matmul(x, weights) + _biases(size, 0.1, dtype))
      _activation_summary(x)
  with tf.variable_scope("softmax_linear"):
    weights = _weights([int(x.shape[-1]), NUM_CLASSES], 1 / 192.0, dtype)
    logits = tf.cast(tf.nn.bias_add(tf.matmul(x, weights),
                                    _biases(NUM_CLASSES, 0.0, dtype)),
                     tf.float32)
    _activation_summary(logits)
  return logits, tf.add_n(decay, name="weight_decay")


def loss(logits: tf.Tensor, labels: tf.Tensor,
         weight_decay: tf.Tensor) -> tf.Tensor:
  """Returns the mean cross entropy plus the weight decay, with summaries.

  Args:
    logits: ``[batch, 10]`` from `inference`.
    labels: ``[batch]`` int labels in 0-9.
    weight_decay: the scalar decay term from the same `inference` call.

  Returns:
    The scalar total loss.
  """
  cross_entropy = tf.reduce_mean(
      tf.nn.sparse_softmax_cross_entropy_with_logits(
          labels=tf.cast(labels, tf.int64), logits=logits),
      name="cross_entropy")
  total = tf.add(cross_entropy, weight_decay, name="total_loss")
  scalar_summary("cross_entropy", cross_entropy)
  scalar_summary("weight_decay", weight_decay)
  scalar_summary("total_loss", total)
  return total
