r"""Trains the CIFAR-10 tutorial's network on several GPUs with `towers`.

  python examples/cifar10_multi_gpu_train.py --num_gpus=2 \
      --data_dir=/tmp/cifar10_data --train_dir=/tmp/cifar10_train
  python examples/cifar10_eval.py --data_dir=/tmp/cifar10_data \
      --checkpoint_dir=/tmp/cifar10_train --run_once
  tensorboard --logdir=/tmp/cifar10_train
  python examples/cifar10_multi_gpu_train.py --num_gpus=2 --fake_data \
      --max_steps=100 --train_dir=/tmp/cifar10_fake  # speed only
  python examples/cifar10_multi_gpu_train.py --num_gpus=4 \
      --variable_device=replicated --train_dir=/tmp/cifar10_replicated
  python examples/cifar10_multi_gpu_train.py --num_gpus=2 --use_fp16 \
      --xla --stage_inputs --train_dir=/tmp/cifar10_fast  # the fast paths

TensorFlow's ``cifar10_multi_gpu_train.py`` on `towers`, its bugs fixed
(docs/examples.md): one tower per GPU (virtual CPU devices without GPUs),
variables shared on the CPU, the towers' gradients averaged and applied once
per step by gradient descent, then the 0.9999 moving averages that
cifar10_eval.py restores. --use_fp16 computes in float16 on float32 master
weights, with loss scaling. The data (``cifar-10-binary.tar.gz``, 170 MB,
MD5-checked) are fetched into --data_dir on first use. The runner (resume,
signals, the step line) is `towers.training`.
"""

import collections
import functools
import os

if __name__ == "__main__":
  # Before TensorFlow loads: its C++ INFO and WARNING lines stay out of the
  # log, unless the user chose a level.
  os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from absl import app
from absl import flags
from absl import logging
import tensorflow.compat.v1 as tf

import cifar10_data
import cifar10_model
import common
import towers
from towers import training

# The tutorial's schedule.
INITIAL_LEARNING_RATE = 0.1
LEARNING_RATE_DECAY_FACTOR = 0.1
NUM_EPOCHS_PER_DECAY = 350
# Where the input pipeline, the step counter, the schedule, the moving
# averages and (by default) the variables live, as in the tutorial.
CPU = "/cpu:0"

TrainGraph = collections.namedtuple("TrainGraph", [
    "train_op", "towers", "summary_op", "learning_rate", "global_step"])

# Bounds of train()'s numeric arguments and of their flags (common.check_args).
BOUNDS = {
    "num_gpus": dict(at_least=1),
    "batch_size": dict(at_least=1),
    "accumulate_steps": dict(at_least=1),
    "max_steps": dict(at_least=0),
    "log_frequency": dict(at_least=1),
    "save_checkpoint_steps": dict(at_least=1),
    "save_summaries_steps": dict(at_least=0),
    "initial_learning_rate": dict(above=0),
    "shuffle_buffer": dict(at_least=1),
    "pack_bytes": dict(at_least=0),
}


def learning_rate(global_step, examples_per_step, examples_per_epoch,
                  initial=INITIAL_LEARNING_RATE):
  """The tutorial's staircase, 0.1x every 350 epochs counted in examples."""
  examples_seen = tf.cast(global_step, tf.int64) * examples_per_step
  decays = examples_seen // (NUM_EPOCHS_PER_DECAY * examples_per_epoch)
  factor = tf.pow(tf.constant(LEARNING_RATE_DECAY_FACTOR, tf.float32),
                  tf.cast(decays, tf.float32))
  return tf.multiply(initial, factor, name="decayed_learning_rate")


def tower_loss(scope, images, labels, *, use_fp16=False, xla=False):
  """One tower's loss: the network on its own batch, with its weight decay."""
  del scope  # The towers collect the summaries.
  with common.xla_scope(xla):
    logits, weight_decay = cifar10_model.inference(
        images, tf.float16 if use_fp16 else tf.float32)
    return cifar10_model.loss(logits, labels, weight_decay)


def build_train_graph(*, devices, batch_size, train_files, examples_per_epoch,
                      initial_learning_rate=INITIAL_LEARNING_RATE,
                      shuffle_buffer=None, variable_device="cpu",
                      all_reduce="auto", pack_bytes=common.DEFAULT_PACK_BYTES,
                      use_fp16=False, xla=False, stage_inputs=False,
                      accumulate_steps=1):
  """Builds the input pipeline, the towers and the step; a `TrainGraph`.

  Everything outside the towers is on the CPU, as in the tutorial; each
  tower dequeues its own batch there. The moving averages stay with the
  variables (copy 0 when replicated).
  """
  with tf.device(CPU):
    global_step = tf.train.get_or_create_global_step()
    lr = learning_rate(global_step, batch_size * len(devices) *
                       accumulate_steps, examples_per_epoch,
                       initial_learning_rate)
    dataset = (cifar10_data.fake_train_dataset(batch_size)
               if train_files is None else cifar10_data.train_dataset(
                   train_files, batch_size, examples_per_epoch,
                   shuffle_buffer))
    iterator = tf.data.make_one_shot_iterator(dataset)

    def next_batch():
      with tf.device(CPU):  # Wins over the tower's device.
        return iterator.get_next()

    apply_op, t = towers.minimize(
        functools.partial(tower_loss, use_fp16=use_fp16, xla=xla),
        tf.train.GradientDescentOptimizer(lr), len(devices),
        inputs=next_batch, devices=list(devices),
        variable_device=variable_device, all_reduce=all_reduce,
        pack_bytes=pack_bytes, global_step=global_step,
        compute_dtype="float16" if use_fp16 else None,
        stage_inputs=stage_inputs, accumulate_steps=accumulate_steps)
    # The tutorial grouped the averages with the update unordered; here they
    # read the updated values, and move only in a run that applies.
    averages = tf.train.ExponentialMovingAverage(
        cifar10_model.MOVING_AVERAGE_DECAY, global_step)
    if accumulate_steps == 1:
      with tf.control_dependencies([apply_op]):
        averages_op = averages.apply(tf.trainable_variables())
    else:
      # The averages' variables are made outside the condition (an
      # initializer cannot be inside one); the update inside reuses them.
      averages.apply(tf.trainable_variables())
      with tf.control_dependencies([apply_op]):
        applied = tf.identity(t.applies)
      averages_op = tf.cond(applied, lambda: tf.group(
          averages.apply(tf.trainable_variables())), tf.no_op)
    train_op = tf.group(apply_op, averages_op, name="train_op")
    summary_op = training.training_summaries(t, lr)
  return TrainGraph(train_op, t, summary_op, lr, global_step)


def train(*, data_dir, train_dir, num_gpus=1, batch_size=128,
          accumulate_steps=1, max_steps=1000000, fake_data=False,
          log_device_placement=False, log_frequency=10,
          save_checkpoint_steps=1000, save_summaries_steps=100,
          initial_learning_rate=INITIAL_LEARNING_RATE, shuffle_buffer=None,
          variable_device="cpu", all_reduce="auto",
          pack_bytes=common.DEFAULT_PACK_BYTES, use_fp16=False, xla=False,
          stage_inputs=False, urls=cifar10_data.URLS):
  """Trains until the global step reaches `max_steps`; returns that step.

  Arguments are the flags of the same names (see --help); `shuffle_buffer`
  None is the tutorial's 40% of an epoch.
  """
  common.check_args(BOUNDS, **{k: v for k, v in locals().items()
                               if k in BOUNDS})
  common.check_dir("train_dir", train_dir)
  common.check_dir("data_dir", data_dir, common.READ)
  devices, config = common.tower_setup(num_gpus, log_device_placement)
  if fake_data:
    logging.info("--fake_data: training on synthetic random images; the "
                 "examples/sec are real, the loss means nothing")
    train_files, examples_per_epoch = None, cifar10_data.NUM_TRAIN_EXAMPLES
  else:
    cifar10_data.maybe_download_and_extract(data_dir, urls)
    train_files = cifar10_data.data_files(data_dir, train=True)
    examples_per_epoch = cifar10_data.check_files(train_files)
    logging.info("Training on the %d images of %s", examples_per_epoch,
                 ", ".join(train_files))
  common.log_batch(num_gpus, batch_size, max_steps, examples_per_epoch,
                   accumulate_steps=accumulate_steps)
  with tf.Graph().as_default():
    g = build_train_graph(
        devices=devices, batch_size=batch_size, train_files=train_files,
        examples_per_epoch=examples_per_epoch,
        initial_learning_rate=initial_learning_rate,
        shuffle_buffer=shuffle_buffer, variable_device=variable_device,
        all_reduce=all_reduce, pack_bytes=pack_bytes, use_fp16=use_fp16,
        xla=xla, stage_inputs=stage_inputs,
        accumulate_steps=accumulate_steps)
    common.log_towers(g.towers, variable_device=variable_device,
                      all_reduce=all_reduce, pack_bytes=pack_bytes,
                      precision="float16" if use_fp16 else "float32",
                      xla=xla, stage_inputs=stage_inputs,
                      precision_flag="--use_fp16")
    with tf.device(CPU):  # The saver, as in the tutorial.
      return training.train(
          g.train_op, g.towers, train_dir=train_dir, max_steps=max_steps,
          examples_per_step=batch_size * num_gpus * accumulate_steps,
          summary_op=g.summary_op, config=config,
          log_every_n_steps=log_frequency,
          save_checkpoint_steps=save_checkpoint_steps,
          save_summaries_steps=save_summaries_steps)


FLAGS = flags.FLAGS


def define_flags():
  """Defines the script's flags (only when run as a script)."""
  flags.DEFINE_integer("num_gpus", 1, "Towers; virtual CPU devices stand in "
                       "for missing GPUs.")
  flags.DEFINE_integer("batch_size", 128, "Examples per tower per step.")
  flags.DEFINE_integer("accumulate_steps", 1, "Micro-batches of "
                       "--batch_size per tower summed into each update.")
  flags.DEFINE_string("data_dir", "/tmp/cifar10_data", "Holds "
                      "cifar-10-batches-bin/ (downloaded there when absent).")
  flags.DEFINE_string("train_dir", "/tmp/cifar10_train", "Checkpoints and "
                      "event files; a run resumes from it.")
  flags.DEFINE_integer("max_steps", 1000000, "The global step to stop at.")
  flags.DEFINE_boolean("fake_data", False, "Train on synthetic images "
                       "(throughput only).")
  flags.DEFINE_boolean("log_device_placement", False, "Log each op's "
                       "device.")
  flags.DEFINE_integer("log_frequency", 10, "Steps between log lines.")
  flags.DEFINE_integer("save_checkpoint_steps", 1000, "Steps between "
                       "checkpoints (the last step is always saved).")
  flags.DEFINE_integer("save_summaries_steps", 100, "Steps between "
                       "summaries (0: none).")
  flags.DEFINE_boolean("use_fp16", False, "Compute in float16 on float32 "
                       "master weights, with dynamic loss scaling.")
  common.define_towers_flags(precision=False)
  common.register_flag_checks(BOUNDS, directories=dict(
      train_dir=common.WRITTEN, data_dir=common.READ))
  flags.adopt_module_key_flags(common)  # --help lists the shared flags.


def main(argv):
  expected = (common.DownloadError, cifar10_data.CorruptDataError,
              FileNotFoundError, FloatingPointError, ValueError,
              training.TrainDirError)
  return common.run_main(argv, lambda: train(**common.flag_values(train)),
                         expected)


if __name__ == "__main__":
  define_flags()
  app.run(main)
