r"""Trains a DCGAN on MNIST on several GPUs (towers): two losses and optimizers.

  python examples/dcgan_mnist_multi_gpu_train.py --num_gpus=2 \
      --data_dir=/tmp/mnist_data --train_dir=/tmp/dcgan_train

carpedm20/DCGAN-tensorflow's MNIST model on `towers`: each tower builds the
generator and the discriminator once and returns both losses; every step
runs the discriminator's update, then the generator's, each in its own
session run, averaged over the towers and applied to its own network. As
on one device, the generator's run computes only its loss: it reads no
real images. Batch norm is synchronized, so the towers train what one
device would on the global batch. At the end a grid of generated digits
goes to TensorBoard and to <train_dir>/generated.png.
"""

import os

if __name__ == "__main__":
  os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from absl import app
from absl import flags
from absl import logging
import numpy as np
import tensorflow.compat.v1 as tf

import common
import mnist_data
import towers
from towers import training

BOUNDS = dict(num_gpus=dict(at_least=1), batch_size=dict(at_least=1),
              max_steps=dict(at_least=0), z_dim=dict(at_least=1),
              learning_rate=dict(above=0), beta1=dict(at_least=0, below=1),
              log_frequency=dict(at_least=1))
GRID = 8  # The picture: GRID x GRID digits.


def _layer(x, shape, name, op=None, **kwargs):
  """A dense layer, or a (transposed) convolution `op`, with its bias."""
  with tf.variable_scope(name):
    w = tf.get_variable("w", shape,
                        initializer=tf.truncated_normal_initializer(0, 0.02))
    b = tf.get_variable("b", [shape[-2] if op is tf.nn.conv2d_transpose
                              else shape[-1]],
                        initializer=tf.zeros_initializer())
    y = tf.matmul(x, w) if op is None else op(x, w, padding="SAME", **kwargs)
    return y + b


def _bn(x, training_mode, name):
  return tf.nn.relu(towers.batch_normalization(x, training=training_mode,
                                               momentum=0.9, name=name))


def generator(z, training_mode=True):
  with tf.variable_scope("generator", reuse=tf.AUTO_REUSE):
    n = tf.shape(z)[0]
    h = _bn(_layer(z, [int(z.shape[-1]), 1024], "fc1"), training_mode, "bn1")
    h = _bn(_layer(h, [1024, 7 * 7 * 128], "fc2"), training_mode, "bn2")
    h = tf.reshape(h, [-1, 7, 7, 128])
    h = _layer(h, [5, 5, 64, 128], "deconv1", tf.nn.conv2d_transpose,
               output_shape=tf.stack([n, 14, 14, 64]), strides=2)
    h = _bn(tf.reshape(h, [-1, 14, 14, 64]), training_mode, "bn3")
    h = _layer(h, [5, 5, 1, 64], "deconv2", tf.nn.conv2d_transpose,
               output_shape=tf.stack([n, 28, 28, 1]), strides=2)
    return tf.tanh(tf.reshape(h, [-1, 28, 28, 1]))


def discriminator(images):
  with tf.variable_scope("discriminator", reuse=tf.AUTO_REUSE):
    h = tf.nn.leaky_relu(_layer(images, [5, 5, 1, 64], "conv1", tf.nn.conv2d,
                                strides=2), 0.2)
    h = _layer(h, [5, 5, 64, 128], "conv2", tf.nn.conv2d, strides=2)
    h = tf.nn.leaky_relu(towers.batch_normalization(
        h, training=True, momentum=0.9, name="bn2"), 0.2)
    return _layer(tf.reshape(h, [-1, 7 * 7 * 128]), [7 * 7 * 128, 1], "fc")


def _xent(logits, label):
  return tf.reduce_mean(tf.nn.sigmoid_cross_entropy_with_logits(
      labels=tf.fill(tf.shape(logits), label), logits=logits))


def train(*, train_dir, data_dir=None, dataset="mnist", num_gpus=2,
          batch_size=64, max_steps=5000, z_dim=100, learning_rate=2e-4,
          beta1=0.5, fake_data=False, log_frequency=10,
          save_checkpoint_secs=60, save_summaries_steps=100,
          variable_device="cpu", all_reduce="auto", seed=None):
  """Trains until the global step reaches `max_steps`; returns that step."""
  common.check_args(BOUNDS, **{k: v for k, v in locals().items()
                               if k in BOUNDS})
  common.check_dir("train_dir", train_dir)
  common.check_dir("data_dir", data_dir, common.READ)
  devices, config = common.tower_setup(num_gpus)
  files = None if fake_data else mnist_data.find_split(
      data_dir or mnist_data.default_data_dir(dataset), "train", dataset)
  with tf.Graph().as_default():
    if seed is not None:
      tf.set_random_seed(seed)
    with tf.device(mnist_data.INPUT_DEVICE):
      global_step = tf.train.get_or_create_global_step()
      data = (mnist_data.fake_dataset(batch_size) if files is None else
              mnist_data.train_dataset(*files, batch_size, seed=seed))
      iterator = tf.data.make_one_shot_iterator(data)

    def next_batch():
      with tf.device(mnist_data.INPUT_DEVICE):
        return iterator.get_next()[0] * 2.0  # [-0.5, 0.5] to tanh's range.

    def model_fn(scope, real):
      del scope
      z = tf.random.uniform([batch_size, z_dim], -1.0, 1.0)
      d_real, d_fake = discriminator(real), discriminator(generator(z))
      return {"d": _xent(d_real, 1.0) + _xent(d_fake, 0.0),
              "g": _xent(d_fake, 1.0)}

    opts = {key: tf.train.AdamOptimizer(learning_rate, beta1=beta1)
            for key in ("d", "g")}
    train_ops, t = towers.minimize(
        model_fn, opts, num_gpus, inputs=next_batch, devices=devices,
        var_list={"d": "discriminator/", "g": "generator/"},
        global_step=global_step, variable_device=variable_device,
        all_reduce=all_reduce)
    # The picture: fixed noise through the generator in inference mode.
    noise = np.random.RandomState(0).uniform(-1, 1, [GRID * GRID, z_dim])
    digits = generator(tf.constant(noise, tf.float32), training_mode=False)
    grid = tf.reshape(tf.transpose(tf.reshape(
        digits, [GRID, GRID, 28, 28]), [0, 2, 1, 3]), [1, GRID * 28,
                                                       GRID * 28, 1])
    pixels = tf.cast(tf.round((grid[0] + 1.0) * 127.5), tf.uint8)
    image = tf.summary.image("generated", grid, max_outputs=1)
    # Each network's summaries run with its own step.
    summary_op = training.training_summaries(t)
    summary_op["g"] = tf.summary.merge([summary_op["g"], image])
    common.log_batch(num_gpus, batch_size, max_steps,
                     60000 if files is None else files[0].count)
    step = training.train(
        train_ops, t, train_dir=train_dir, max_steps=max_steps,
        examples_per_step=batch_size * num_gpus, summary_op=summary_op,
        config=config, log_every_n_steps=log_frequency,
        save_checkpoint_secs=save_checkpoint_secs,
        save_summaries_steps=save_summaries_steps)
    with tf.Session(config=config) as sess:
      tf.train.Saver().restore(sess, tf.train.latest_checkpoint(train_dir))
      png, summary = sess.run([tf.image.encode_png(pixels), image])
    writer = tf.summary.FileWriterCache.get(train_dir)
    writer.add_summary(summary, step)
    writer.flush()
    path = os.path.join(train_dir, "generated.png")
    with tf.io.gfile.GFile(path, "wb") as f:
      f.write(png)
    if fake_data:  # Random pixels: the generator learns noise.
      logging.info("Wrote %d generated samples (fake data: noise by design) "
                   "to %s", GRID * GRID, path)
    else:
      logging.info("Wrote %d generated digits to %s", GRID * GRID, path)
    return step


def define_flags():
  integer, number, text = (flags.DEFINE_integer, flags.DEFINE_float,
                           flags.DEFINE_string)
  integer("num_gpus", 2, "Towers; virtual CPU devices stand in for GPUs.")
  integer("batch_size", 64, "Examples per tower per step.")
  flags.DEFINE_enum("dataset", "mnist", list(mnist_data.DATASETS),
                    "mnist, or fashion_mnist (the same format).")
  text("data_dir", None, "The IDX files; default /tmp/mnist_data for mnist.")
  text("train_dir", "/tmp/dcgan_train", "Checkpoints, event files and "
       "generated.png; a run resumes from it.")
  integer("max_steps", 5000, "The global step (a D and a G update) to stop "
          "at.")
  integer("z_dim", 100, "The generator's noise dimensions.")
  number("learning_rate", 2e-4, "Adam's learning rate, both networks.")
  number("beta1", 0.5, "Adam's beta1, both networks.")
  flags.DEFINE_boolean("fake_data", False, "Train on one synthetic batch.")
  integer("log_frequency", 10, "Steps between log lines.")
  integer("save_checkpoint_secs", 60, "Seconds between checkpoints.")
  integer("save_summaries_steps", 100, "Steps between summaries (0: none).")
  integer("seed", None, "Random seed of the weights, noise and shuffle.")
  flags.DEFINE_enum("variable_device", "cpu", ["cpu", "gpu", "replicated"],
                    "One copy of the variables on the CPU or the first GPU, "
                    "or a copy on every tower.")
  flags.DEFINE_enum("all_reduce", "auto", ["auto", "add_n", "ring",
                                           "collective"],
                    "Replicated: how the copies' gradients are summed.")
  common.register_flag_checks(BOUNDS, directories=dict(
      train_dir=common.WRITTEN, data_dir=common.READ))


def main(argv):
  expected = (mnist_data.DataError, FloatingPointError, ValueError,
              training.TrainDirError)
  return common.run_main(argv, lambda: train(**common.flag_values(train)),
                         expected)


if __name__ == "__main__":
  define_flags()
  app.run(main)
