r"""Trains the MNIST CNN on several GPUs with synchronous updates (towers).

  python examples/mnist_multi_gpu_train.py --num_gpus=2 \
      --data_dir=/tmp/mnist_data --train_dir=/tmp/mnist_train
  python examples/mnist_eval.py --data_dir=/tmp/mnist_data \
      --checkpoint_dir=/tmp/mnist_train --run_once
  python examples/mnist_multi_gpu_train.py --num_gpus=4 \
      --variable_device=replicated --train_dir=/tmp/mnist_replicated
  python examples/launch_local_cluster.py --num_ps=1 --num_workers=2 -- \
      --num_gpus=2 --max_steps=500 --train_dir=/tmp/mnist_cluster

normanheckscher/mnist-multi-gpu's training script on `towers`, its bugs fixed
(docs/examples.md): one tower per GPU (virtual CPU devices without GPUs),
variables shared on the CPU, the towers' gradients averaged and applied once
per step. With --ps_hosts/--worker_hosts it is one task of a cluster
(docs/distributed.md). The runner (resume, signals, the step line, the
cluster's checks) is `towers.training`.
"""

import collections
import contextlib
import os

if __name__ == "__main__":
  # Before TensorFlow loads: its C++ INFO and WARNING lines stay out of the
  # log, unless the user chose a level.
  os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from absl import app
from absl import flags
from absl import logging
import tensorflow.compat.v1 as tf

import common
import mnist_data
import mnist_model
import towers
from towers import training

# Bounds of train()'s numeric arguments and of their flags (common.check_args).
BOUNDS = dict(
    num_gpus=dict(at_least=1), batch_size=dict(at_least=1),
    accumulate_steps=dict(at_least=1), max_steps=dict(at_least=0),
    learning_rate=dict(above=0), momentum=dict(at_least=0, below=1),
    learning_rate_decay=dict(above=0, at_most=1),
    epochs_per_decay=dict(above=0), weight_decay=dict(at_least=0),
    dropout_rate=dict(at_least=0, below=1), log_frequency=dict(at_least=1),
    save_checkpoint_secs=dict(at_least=1),
    save_checkpoint_steps=dict(at_least=1),
    save_summaries_steps=dict(at_least=0), pack_bytes=dict(at_least=0),
    task_index=dict(at_least=0), replicas_to_aggregate=dict(at_least=1),
    startup_timeout_secs=dict(above=0), step_timeout_secs=dict(above=0),
    stall_log_secs=dict(above=0))

TrainGraph = collections.namedtuple("TrainGraph", [
    "train_op", "towers", "summary_op", "learning_rate", "global_step",
    "optimizer"])


def build_train_graph(*, devices, batch_size, train_files, num_examples,
                      learning_rate, momentum, learning_rate_decay,
                      epochs_per_decay, weight_decay, dropout_rate,
                      pack_bytes=common.DEFAULT_PACK_BYTES,
                      precision="float32", xla=False, stage_inputs=False,
                      accumulate_steps=1, replicas=1, seed=None,
                      wrap_optimizer=None, **placement):
  """Builds the input pipeline, the towers and the step; a `TrainGraph`.

  `placement` holds `towers.minimize`'s variable_device, all_reduce,
  average_device and num_workers. The learning rate decays per epoch counted
  in examples, the same for any number of towers, workers and micro-batches.
  """
  if seed is not None:
    tf.set_random_seed(seed)
  # The pipeline, the step counter and the schedule live on the CPU.
  with tf.device(mnist_data.INPUT_DEVICE):
    global_step = tf.train.get_or_create_global_step()
    dataset = (mnist_data.fake_dataset(batch_size) if train_files is None
               else mnist_data.train_dataset(*train_files, batch_size,
                                             seed=seed))
    iterator = tf.data.make_one_shot_iterator(dataset)
    examples_seen = global_step * (batch_size * len(devices) * replicas *
                                   accumulate_steps)
    lr = tf.train.exponential_decay(
        learning_rate, examples_seen,
        decay_steps=max(1, int(round(epochs_per_decay * num_examples))),
        decay_rate=learning_rate_decay, staircase=True)

  def next_batch():
    # Called in each tower: every tower dequeues its own batch from the one
    # pipeline, on the CPU next to it.
    with tf.device(mnist_data.INPUT_DEVICE):
      return iterator.get_next()

  def model_fn(scope, images, labels):
    del scope  # The towers collect the summaries.
    with common.xla_scope(xla):
      logits, decay = mnist_model.inference(
          images, dropout_rate=dropout_rate, weight_decay=weight_decay,
          dtype=tf.as_dtype(precision))
      xent = mnist_model.cross_entropy(logits, labels)
      loss = tf.add(xent, decay, name="total_loss")
      tf.summary.scalar("losses/cross_entropy", xent)
      tf.summary.scalar("losses/weight_decay", decay)
      tf.summary.histogram("logits", logits)
    return loss

  opt = tf.train.MomentumOptimizer(lr, momentum)
  if wrap_optimizer is not None:
    opt = wrap_optimizer(opt)
  train_op, t = towers.minimize(
      model_fn, opt, len(devices), inputs=next_batch, devices=list(devices),
      global_step=global_step, compute_dtype=precision,
      stage_inputs=stage_inputs, pack_bytes=pack_bytes,
      accumulate_steps=accumulate_steps, **placement)
  return TrainGraph(train_op, t, training.training_summaries(t, lr), lr,
                    global_step, opt)


def train(*, train_dir, data_dir=None, dataset="mnist", num_gpus=2,
          batch_size=64, accumulate_steps=1, max_steps=4700,
          learning_rate=0.02, momentum=0.9, learning_rate_decay=0.75,
          epochs_per_decay=1.0, weight_decay=5e-4, dropout_rate=0.5,
          fake_data=False, log_device_placement=False, log_frequency=10,
          save_checkpoint_secs=60, save_checkpoint_steps=None,
          save_summaries_steps=100, variable_device="cpu", all_reduce="auto",
          pack_bytes=common.DEFAULT_PACK_BYTES, precision="float32",
          xla=False, stage_inputs=False, ps_hosts=(), worker_hosts=(),
          job_name="worker", task_index=0, replicas_to_aggregate=None,
          startup_timeout_secs=60.0, step_timeout_secs=300.0,
          stall_log_secs=30.0, mirrors=mnist_data.MNIST_MIRRORS, seed=None):
  """Trains until the global step reaches `max_steps`; returns that step.

  Arguments are the flags of the same names (see --help).
  """
  common.check_args(BOUNDS, **{k: v for k, v in locals().items()
                               if k in BOUNDS})
  common.check_dir("train_dir", train_dir)
  common.check_dir("data_dir", data_dir, common.READ)
  task, replicas, scope, wrap = None, 1, None, None
  placement = dict(variable_device=variable_device, all_reduce=all_reduce)
  if ps_hosts or worker_hosts:
    replicas = common.check_cluster_flags(
        ps_hosts, worker_hosts, variable_device, all_reduce, precision,
        replicas_to_aggregate)
    # A parameter server serves here and never returns.
    task = training.start_task(
        ps_hosts, worker_hosts, job_name, task_index, num_gpus,
        log_device_placement=log_device_placement,
        startup_timeout_secs=startup_timeout_secs,
        step_timeout_secs=step_timeout_secs)
    devices = towers.tower_devices(num_gpus, task=task.worker_device)
    config = task.config
    seed = None if seed is None else seed + task_index  # Own shuffles.
    if task.collective:
      # Every worker's towers all-reduce in one collective group.
      scope = task.worker_device
      placement = dict(variable_device="replicated", all_reduce="collective",
                       num_workers=task.num_workers)
    else:
      # Variables and slots on the ps tasks, the rest on this worker.
      scope = training.device_setter(task)
      placement = dict(variable_device=scope,
                       average_device=task.worker_device + "/cpu:0")

      def wrap(opt):
        return tf.train.SyncReplicasOptimizer(
            opt, replicas_to_aggregate=replicas,
            total_num_replicas=task.num_workers)
  else:
    devices, config = common.tower_setup(num_gpus, log_device_placement)
  if fake_data:
    logging.info("--fake_data: training on synthetic images (one random "
                 "batch); the examples/sec are real, the loss means nothing")
    train_files, num_examples = None, 60000  # The real run's schedule.
  else:
    train_files = mnist_data.find_split(
        data_dir or mnist_data.default_data_dir(dataset), "train", dataset,
        mirrors)
    num_examples = train_files[0].count
  common.log_batch(num_gpus, batch_size, max_steps, num_examples, replicas,
                   accumulate_steps)
  with tf.Graph().as_default(), (
      tf.device(scope) if scope else contextlib.nullcontext()):
    g = build_train_graph(
        devices=devices, batch_size=batch_size, train_files=train_files,
        num_examples=num_examples, learning_rate=learning_rate,
        momentum=momentum, learning_rate_decay=learning_rate_decay,
        epochs_per_decay=epochs_per_decay, weight_decay=weight_decay,
        dropout_rate=dropout_rate, pack_bytes=pack_bytes, seed=seed,
        precision=precision, xla=xla, stage_inputs=stage_inputs,
        accumulate_steps=accumulate_steps, replicas=replicas,
        wrap_optimizer=wrap, **placement)
    common.log_towers(g.towers, variable_device=placement["variable_device"],
                      all_reduce=all_reduce, pack_bytes=pack_bytes,
                      precision=precision, xla=xla, stage_inputs=stage_inputs)
    return training.train(
        g.train_op, g.towers, train_dir=train_dir, max_steps=max_steps,
        examples_per_step=batch_size * num_gpus * accumulate_steps,
        summary_op=g.summary_op, config=config,
        log_every_n_steps=log_frequency,
        save_checkpoint_secs=save_checkpoint_secs,
        save_checkpoint_steps=save_checkpoint_steps,
        save_summaries_steps=save_summaries_steps, task=task,
        optimizer=g.optimizer, stall_log_secs=stall_log_secs)


def define_flags():
  """Defines the script's flags (only when run as a script)."""
  integer, number, text = (flags.DEFINE_integer, flags.DEFINE_float,
                           flags.DEFINE_string)
  integer("num_gpus", 2, "Towers; virtual CPU devices stand in for missing "
          "GPUs.")
  integer("batch_size", 64, "Examples per tower per step.")
  integer("accumulate_steps", 1, "Micro-batches of --batch_size per tower "
          "summed into each step's update.")
  flags.DEFINE_enum("dataset", "mnist", list(mnist_data.DATASETS),
                    "mnist, or fashion_mnist (the same format).")
  text("data_dir", None, "The IDX files; default /tmp/mnist_data for mnist "
       "(downloaded there when absent), %s for fashion_mnist."
       % mnist_data.FASHION_MNIST_DIR)
  text("train_dir", "/tmp/mnist_train", "Checkpoints and event files; a "
       "run resumes from it.")
  integer("max_steps", 4700, "The global step to stop at (10 epochs of "
          "128 examples).")
  number("learning_rate", 0.02, "Initial learning rate.")
  number("momentum", 0.9, "Momentum.")
  number("learning_rate_decay", 0.75, "Learning rate factor per "
         "--epochs_per_decay.")
  number("epochs_per_decay", 1.0, "Epochs (counted in examples) between "
         "two decays.")
  number("weight_decay", 5e-4, "L2 coefficient of the dense weights.")
  number("dropout_rate", 0.5, "Fraction of the hidden units dropped.")
  flags.DEFINE_boolean("fake_data", False, "Train on one synthetic batch "
                       "(throughput only).")
  flags.DEFINE_boolean("log_device_placement", False, "Log each op's "
                       "device.")
  integer("log_frequency", 10, "Steps between log lines.")
  integer("save_checkpoint_secs", 60, "Seconds between checkpoints (the "
          "final step is always saved).")
  integer("save_checkpoint_steps", None, "Steps between checkpoints; "
          "replaces --save_checkpoint_secs.")
  integer("save_summaries_steps", 100, "Steps between summaries (0: none).")
  integer("seed", None, "Random seed of the weights, dropout and shuffle.")
  flags.DEFINE_list("mirrors", list(mnist_data.MNIST_MIRRORS), "Base URLs "
                    "to download missing MNIST files from (empty: none).")
  common.define_towers_flags()
  common.define_cluster_flags()
  common.register_flag_checks(BOUNDS, directories=dict(
      train_dir=common.WRITTEN, data_dir=common.READ))
  flags.adopt_module_key_flags(common)  # --help lists the shared flags.


def main(argv):
  expected = (mnist_data.DataError, FloatingPointError, TimeoutError,
              ValueError, training.TrainDirError, training.PeerLost)
  return common.run_main(argv, lambda: train(**common.flag_values(train)),
                         expected)


if __name__ == "__main__":
  define_flags()
  app.run(main)
