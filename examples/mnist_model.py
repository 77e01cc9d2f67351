"""The MNIST CNN of the examples: two 5x5 convolutions, 1024 units, 10 logits.

  python examples/mnist_multi_gpu_train.py --num_gpus=2
  python examples/mnist_eval.py --run_once

conv1 (5x5x32, ReLU) -> 2x2 max pool -> conv2 (5x5x64, ReLU) -> 2x2 max pool
-> local3 (1024 units, ReLU, dropout in training) -> softmax_linear (10
logits). The reference ended with a ReLU'd 10-unit layer and then a 10x10
linear layer; a ReLU before the logits zeroes every negative score and can
kill classes outright, so here the 1024 units feed the logits directly.
Variables come from ``tf.get_variable`` under the reference's scope names
(``conv1/weights``, ..., ``softmax_linear/biases``), so towers share them and
a checkpoint from any number of towers restores into the single-device
evaluation graph. The model places nothing: the towers' device function does.

With ``dtype=tf.float16`` or ``tf.bfloat16`` the network computes in that
dtype: it asks ``tf.get_variable`` for its weights in it and casts the
images, while the logits, the weight decay and so the loss stay float32
(a softmax or a sum of squares in half precision loses the small terms).
Under `towers.minimize`'s ``compute_dtype`` the variables themselves are
float32 master weights with the names above, so the float32 evaluation
graph restores them unchanged. Example code, not part of the `towers`
library.
"""

from typing import Tuple, Union

import tensorflow.compat.v1 as tf

import mnist_data

HIDDEN_UNITS = 1024


def _relu_init():
  # He initialization keeps the activations' scale through ReLU layers.
  return tf.variance_scaling_initializer(scale=2.0,
                                         distribution="truncated_normal")


def _conv_relu(name: str, inputs: tf.Tensor, filters: int) -> tf.Tensor:
  with tf.variable_scope(name):
    channels = inputs.shape[-1]
    kernel = tf.get_variable("weights", [5, 5, channels, filters],
                             inputs.dtype, initializer=_relu_init())
    biases = tf.get_variable("biases", [filters], inputs.dtype,
                             initializer=tf.zeros_initializer())
    conv = tf.nn.conv2d(inputs, kernel, strides=[1, 1, 1, 1], padding="SAME")
    return tf.nn.relu(tf.nn.bias_add(conv, biases))


def _pool(inputs: tf.Tensor, name: str) -> tf.Tensor:
  return tf.nn.max_pool2d(inputs, ksize=2, strides=2, padding="SAME",
                          name=name)


def inference(images: tf.Tensor, *,
              dropout_rate: Union[float, tf.Tensor] = 0.0,
              weight_decay: float = 0.0,
              dtype: tf.DType = tf.float32) -> Tuple[tf.Tensor, tf.Tensor]:
  """Builds the CNN on a batch of images; returns (logits, weight decay).

  The batch size is never fixed in the graph, so any batch (a final partial
  evaluation batch included) goes through. The weight decay, ``weight_decay
  * sum(l2_loss(w))`` over the two fully connected layers' weights, is
  returned rather than put in a collection: each tower adds it to its own
  loss, so the towers' mean loss holds it once. It is summed in float32,
  over the weights as the network computes with them (in `dtype`).

  Args:
    images: ``[batch, 28, 28, 1]`` float32 images, normalized by
      `mnist_data.normalize`.
    dropout_rate: the fraction of local3's units dropped (0 for evaluation).
    weight_decay: the L2 coefficient of the fully connected weights.
    dtype: the dtype the network computes in: float32, or float16 or
      bfloat16 (the weights are asked for in it and the images cast to it).

  Returns:
    ``(logits, decay)``: ``[batch, 10]`` float32 logits and a scalar.
  """
  dtype = tf.as_dtype(dtype)
  conv1 = _conv_relu("conv1", tf.cast(images, dtype), 32)
  pool1 = _pool(conv1, "pool1")
  conv2 = _conv_relu("conv2", pool1, 64)
  pool2 = _pool(conv2, "pool2")
  size = mnist_data.IMAGE_SIZE // 4
  flat = tf.reshape(pool2, [-1, size * size * 64])
  with tf.variable_scope("local3"):
    weights3 = tf.get_variable("weights", [size * size * 64, HIDDEN_UNITS],
                               dtype, initializer=_relu_init())
    biases3 = tf.get_variable("biases", [HIDDEN_UNITS], dtype,
                              initializer=tf.zeros_initializer())
    local3 = tf.nn.relu(tf.matmul(flat, weights3) + biases3)
  if not isinstance(dropout_rate, (int, float)):
    local3 = tf.nn.dropout(local3, rate=tf.cast(dropout_rate, dtype))
  elif dropout_rate > 0:
    local3 = tf.nn.dropout(local3, rate=dropout_rate)
  with tf.variable_scope("softmax_linear"):
    weights4 = tf.get_variable(
        "weights", [HIDDEN_UNITS, mnist_data.NUM_CLASSES], dtype,
        initializer=tf.glorot_uniform_initializer())
    biases4 = tf.get_variable("biases", [mnist_data.NUM_CLASSES], dtype,
                              initializer=tf.zeros_initializer())
    logits = tf.cast(tf.matmul(local3, weights4) + biases4, tf.float32)
  with tf.name_scope("weight_decay"):
    decay = weight_decay * tf.add(
        tf.nn.l2_loss(tf.cast(weights3, tf.float32)),
        tf.nn.l2_loss(tf.cast(weights4, tf.float32)))
  return logits, decay


def cross_entropy(logits: tf.Tensor, labels: tf.Tensor) -> tf.Tensor:
  """Returns the batch's mean softmax cross-entropy (labels are class ids)."""
  return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
      labels=labels, logits=logits), name="cross_entropy")
