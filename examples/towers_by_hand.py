"""The tower recipe by hand: a tower loop, one average, one update.

  python examples/towers_by_hand.py --num_gpus=2 --steps=300

The CIFAR-10 tutorial's manual flow on synthetic MNIST-sized data:
`towers.build_towers` runs the model once per tower (``tower_0``,
``tower_1``, ...) on its own shard of the batch, with the variables shared
on the CPU;
`towers.average_gradients` is the synchronization point; one
``opt.apply_gradients`` updates the variables. Without GPUs the towers run
on virtual CPU devices. `towers.minimize` is these three steps in one call.
"""

import os

if __name__ == "__main__":
  # Before TensorFlow loads: its C++ INFO and WARNING lines stay out of the
  # log, unless the user chose a level.
  os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np
from absl import app
from absl import flags
from absl import logging
import tensorflow.compat.v1 as tf

import towers

flags.DEFINE_integer("num_gpus", 2, "Towers.", lower_bound=1)
flags.DEFINE_integer("batch_size", 64, "Examples per tower per step.",
                     lower_bound=1)
flags.DEFINE_integer("steps", 300, "Training steps.", lower_bound=0)
FLAGS = flags.FLAGS


def synthetic_data(count, seed=0):
  """Images whose labels a hidden linear model gives: learnable, no files."""
  rng = np.random.RandomState(seed)
  images = rng.randn(count, 784).astype(np.float32)
  teacher = rng.randn(784, 10).astype(np.float32)
  return images, np.argmax(images @ teacher, axis=1).astype(np.int64)


def model_fn(scope, images, labels):
  """One tower: a two-layer network on its shard; returns its loss."""
  del scope
  hidden = tf.nn.relu(tf.matmul(images, tf.get_variable("w1", [784, 128])))
  logits = tf.matmul(hidden, tf.get_variable("w2", [128, 10]))
  return tf.losses.sparse_softmax_cross_entropy(labels, logits)


def main(argv):
  del argv
  tf.disable_eager_execution()
  images, labels = synthetic_data(FLAGS.batch_size * FLAGS.num_gpus * 16)
  dataset = tf.data.Dataset.from_tensor_slices((images, labels)).repeat()
  batch = tf.data.make_one_shot_iterator(
      dataset.batch(FLAGS.batch_size * FLAGS.num_gpus)).get_next()
  global_step = tf.train.get_or_create_global_step()
  opt = tf.train.MomentumOptimizer(0.01, 0.9)

  # 1. The tower loop: each tower's gradients on its shard of the batch.
  t = towers.build_towers(model_fn, opt, FLAGS.num_gpus, inputs=batch)
  # 2. The synchronization point: the towers' gradients averaged.
  grads_and_vars = towers.average_gradients(t.tower_grads, t.weights)
  # 3. One update.
  train_op = opt.apply_gradients(grads_and_vars, global_step=global_step)

  config = towers.virtual_cpu_config(FLAGS.num_gpus)
  with tf.Session(config=config) as sess:
    sess.run(tf.global_variables_initializer())
    for step in range(1, FLAGS.steps + 1):
      _, loss = sess.run([train_op, t.loss])
      if step % 50 == 0 or step == 1:
        logging.info("step %d, loss = %.3f", step, loss)


if __name__ == "__main__":
  app.run(main)
