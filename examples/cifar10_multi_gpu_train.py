"""Trains the CIFAR-10 tutorial's network on several GPUs with `towers`.

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

The working version of TensorFlow's ``cifar10_multi_gpu_train.py`` on
`towers`: one replica of the network per GPU (``tower_0``, ``tower_1``, ...),
its variables shared on the CPU, the towers' gradients averaged and applied
once per step by plain gradient descent, and an exponential moving average
(0.9999) of every trainable variable updated with each step; evaluation uses
those averages. Without enough GPUs the towers run on virtual CPU devices
(one log line says so): the same graph, for correctness rather than speed.

--variable_device moves the one copy of the variables ('cpu', the
tutorial's; 'gpu'; 'balanced'), or, with 'replicated', gives every tower a
copy of its own, kept identical by the --all_reduce algorithm ('add_n',
'ring', 'collective'; 'auto': collective between GPUs, else add_n). The
checkpoints are the same in every mode (copy 0 and its moving average under
single-device names): cifar10_eval.py reads them, and a run may resume in
another mode. --all_reduce without --variable_device=replicated is refused.
--accumulate_steps=k sums k micro-batches of --batch_size per tower into
each step's update (and each step of the moving averages).
--pack_bytes (16384, towers' default; 0 turns it off) has the gradients of
at most that many bytes (the biases and softmax_linear's weights) reduced in
packs, in every mode: fewer transfers, the same results (bit for bit, but
with --all_reduce=collective over 3 or more towers).

--use_fp16 is the tutorial's flag with another meaning: the towers compute
in float16, but the variables stay float32 (master weights, averaged,
updated, averaged again by the moving averages and saved in float32 under
their float32 names, so cifar10_eval.py reads the checkpoints as they are),
and the loss is scaled dynamically (a step whose gradients overflow is
skipped and the scale halved; the scale is logged with each step line and
summarized as ``loss_scale``). The tutorial made the variables themselves
float16 and scaled nothing, so small float16 gradients were lost and its
checkpoints held float16 weights. The local response normalizations, the
weight decay and the loss are computed in float32 (cifar10_model.py).
--xla compiles each tower's network and gradient with XLA (the same
results within rounding). --stage_inputs reads each tower's batches ahead,
in a background queue runner, and stages them on its device.

The data are fetched into --data_dir on first use (``cifar-10-binary.tar.gz``,
about 170 MB, MD5-checked); offline, copy the tarball or its extracted
``cifar-10-batches-bin/`` there, or use --fake_data. One input pipeline on
the CPU applies the tutorial's distortions and each tower takes its own
--batch_size batch from it, so a step trains on batch_size x num_gpus
examples. The learning rate starts at 0.1 and falls tenfold every 350 epochs
counted in examples (the tutorial counted steps, decaying num_gpus times too
late with several GPUs).

Every --log_frequency steps the tutorial's line is logged, ``step %d, loss =
%.2f (%.1f examples/sec; %.3f sec/batch)``, with the mean loss over the
towers; a NaN loss stops training. A flag out of range (``--batch_size=0``,
``--pack_bytes=-1``) or a bad --train_dir (empty, a file, under a file,
not writable) stops the script at once with one line naming the flag.

Checkpoints (every --save_checkpoint_steps and at the last step) and
summaries (the final tower's, the learning rate, variable and gradient
histograms) go to --train_dir; rerunning with the same --train_dir resumes
from its latest checkpoint, and when that is already at --max_steps the
script says so and exits 0 without training. SIGTERM or SIGINT (Ctrl-C)
saves a checkpoint and exits with 128 + the signal's number (143, 130); a
second one kills at once. A second trainer on the same --train_dir is
refused (``train.lock`` names the holder's pid), and so is a directory whose
checkpoints it cannot safely resume from (the ``checkpoint`` state file
missing, unreadable or naming another directory, or the latest checkpoint
corrupt): the error names the newest intact checkpoint and the one-line
``echo 'model_checkpoint_path: "model.ckpt-N"' > DIR/checkpoint`` that
resumes from it. Nothing there is deleted (the tutorial wiped it) but the
Saver's leftover ``model.ckpt-N_temp/`` folders and the checkpoints it
rotates out.
"""

import collections
import functools
import os
from typing import Optional, Sequence

if __name__ == "__main__":
  # Before TensorFlow loads: its C++ INFO and WARNING lines stay out of the
  # log, unless the user chose a level (docs/examples.md, "The log").
  os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from absl import app
from absl import flags
from absl import logging
import tensorflow.compat.v1 as tf

import cifar10_data
import cifar10_model
import common
import towers
import traindir

# The tutorial's schedule.
INITIAL_LEARNING_RATE = 0.1
LEARNING_RATE_DECAY_FACTOR = 0.1
NUM_EPOCHS_PER_DECAY = 350
# Where the input pipeline, the step counter, the schedule, the moving
# averages and (by default) the variables live, as in the tutorial.
CPU = "/cpu:0"

TrainGraph = collections.namedtuple("TrainGraph", [
    "train_op", "loss", "global_step", "learning_rate", "summary_op",
    "towers"])
TrainGraph.__doc__ = """What `build_train_graph` built.

Fields:
  train_op: one synchronous step over all towers, then the moving averages.
  loss: the global batch's mean loss (cross entropy plus weight decay).
  global_step: int64, +1 per step (not per tower).
  learning_rate: the learning rate of the current step.
  summary_op: the merged summaries (final tower's, learning rate, loss,
    variable and averaged-gradient histograms).
  towers: the `towers.Towers` built.
"""


# The bounds of `train`'s numeric arguments and of the flags of the same
# names, checked before anything is built (`common.check_args`).
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


def learning_rate(global_step: tf.Tensor, examples_per_step: int,
                  examples_per_epoch: int,
                  initial: float = INITIAL_LEARNING_RATE) -> tf.Tensor:
  """Returns the tutorial's staircase schedule, counted in examples.

  ``initial * 0.1 ** floor(examples_seen / (350 * examples_per_epoch))``
  with ``examples_seen = global_step * examples_per_step``, computed in
  integers so the steps fall exactly where the examples say.

  Args:
    global_step: the step counter.
    examples_per_step: the global batch, ``batch_size * num_gpus *
      accumulate_steps``.
    examples_per_epoch: the training set's size (50,000 for CIFAR-10).
    initial: the learning rate before the first decay.
  """
  examples_seen = tf.cast(global_step, tf.int64) * examples_per_step
  decays = examples_seen // (NUM_EPOCHS_PER_DECAY * examples_per_epoch)
  factor = tf.pow(tf.constant(LEARNING_RATE_DECAY_FACTOR, tf.float32),
                  tf.cast(decays, tf.float32))
  return tf.multiply(initial, factor, name="decayed_learning_rate")


def tower_loss(scope: str, images: tf.Tensor, labels: tf.Tensor, *,
               use_fp16: bool = False, xla: bool = False) -> tf.Tensor:
  """One tower's loss: the network on its own batch, with its weight decay.

  With `use_fp16` the network computes in float16 (its loss in float32);
  with `xla` it is built in an XLA ``jit_scope`` (`common.xla_scope`).
  """
  del scope  # The towers collect the summaries by scope themselves.
  with common.xla_scope(xla):
    logits, weight_decay = cifar10_model.inference(
        images, tf.float16 if use_fp16 else tf.float32)
    return cifar10_model.loss(logits, labels, weight_decay)


def build_train_graph(*, devices: Sequence[str], batch_size: int,
                      train_files: Optional[Sequence[str]],
                      examples_per_epoch: int,
                      initial_learning_rate: float = INITIAL_LEARNING_RATE,
                      shuffle_buffer: Optional[int] = None,
                      variable_device: str = "cpu",
                      all_reduce: str = "auto",
                      pack_bytes: int = common.DEFAULT_PACK_BYTES,
                      use_fp16: bool = False, xla: bool = False,
                      stage_inputs: bool = False,
                      accumulate_steps: int = 1) -> TrainGraph:
  """Builds the input pipeline, the towers and the step in the default graph.

  Everything outside the towers is built on the CPU, as in the tutorial;
  each tower's ops go to its device except its dequeue, which stays next to
  the iterator on the CPU. The variables go where `variable_device` says;
  their moving averages and updates stay with them (with copy 0 when
  replicated: the copies are not trainable, so only copy 0 is averaged).

  Args:
    devices: ``[num_towers]`` tower devices (see `common.tower_setup`).
    batch_size: examples per tower per step.
    train_files: the checked training batch files, or None for synthetic
      images (`cifar10_data.fake_train_dataset`).
    examples_per_epoch: the training set's size, for the schedule and the
      shuffle buffer.
    initial_learning_rate: the learning rate before the first decay.
    shuffle_buffer: records in the shuffle buffer; None for the tutorial's
      40% of an epoch.
    variable_device: ``'cpu'`` (the tutorial's), ``'gpu'``, ``'balanced'``
      or ``'replicated'``, as for `towers.build_towers`.
    all_reduce: with ``variable_device='replicated'``, how the copies'
      gradients are summed (see `towers.build_towers`); else ``'auto'``.
    pack_bytes: the largest gradient, in bytes, reduced in a pack with
      others (see `towers.minimize`); 0 turns packing off.
    use_fp16: the towers compute in float16 on float32 master weights,
      with dynamic loss scaling (`towers.minimize`'s ``compute_dtype`` and
      its default ``loss_scale``).
    xla: whether each tower's network is built in an XLA ``jit_scope``.
    stage_inputs: whether each tower's batches are read ahead and staged
      on its device (`towers.minimize`'s ``stage_inputs``).
    accumulate_steps: micro-batches per step (`towers.minimize`'s
      ``accumulate_steps``); the moving averages step once per update.

  Returns:
    A `TrainGraph`.
  """
  num_towers = len(devices)
  with tf.device(CPU):
    global_step = tf.train.get_or_create_global_step()
    lr = learning_rate(global_step, batch_size * num_towers * accumulate_steps,
                       examples_per_epoch, initial_learning_rate)
    if train_files is None:
      dataset = cifar10_data.fake_train_dataset(batch_size)
    else:
      dataset = cifar10_data.train_dataset(train_files, batch_size,
                                           examples_per_epoch, shuffle_buffer)
    iterator = tf.data.make_one_shot_iterator(dataset)

    def next_batch():
      # Called once inside each tower: each tower dequeues its own batch
      # from the one shared pipeline. The explicit device wins over the
      # tower's, so the dequeue stays on the CPU with the iterator.
      with tf.device(CPU):
        return iterator.get_next()

    opt = tf.train.GradientDescentOptimizer(lr)
    apply_op, t = towers.minimize(
        functools.partial(tower_loss, use_fp16=use_fp16, xla=xla), opt,
        num_towers, inputs=next_batch, devices=list(devices),
        variable_device=variable_device, all_reduce=all_reduce,
        pack_bytes=pack_bytes, global_step=global_step,
        compute_dtype="float16" if use_fp16 else None,
        stage_inputs=stage_inputs, accumulate_steps=accumulate_steps)
    # The tutorial groups the averaging with the update unordered, so its
    # average may read a variable before or after the update; here it
    # always reads the updated value. (A step that loss scaling skips
    # leaves the variables as they were; their averages still take a step
    # towards them.)
    averages = tf.train.ExponentialMovingAverage(
        cifar10_model.MOVING_AVERAGE_DECAY, global_step)
    if accumulate_steps == 1:
      with tf.control_dependencies([apply_op]):
        averages_op = averages.apply(tf.trainable_variables())
    else:
      # Only a run that applies an update moves the averages. Their
      # variables are made outside the condition (an initializer cannot be
      # inside one); the update built inside it reuses them.
      averages.apply(tf.trainable_variables())
      with tf.control_dependencies([apply_op]):
        applied = tf.identity(t.applies)
      averages_op = tf.cond(applied, lambda: tf.group(
          averages.apply(tf.trainable_variables())), tf.no_op)
    train_op = tf.group(apply_op, averages_op, name="train_op")
    summary_op = common.training_summaries(t, lr, accumulate_steps)
  return TrainGraph(train_op=train_op, loss=t.loss, global_step=global_step,
                    learning_rate=lr, summary_op=summary_op, towers=t)


def train(*, data_dir: str, train_dir: str, num_gpus: int = 1,
          batch_size: int = 128, accumulate_steps: int = 1,
          max_steps: int = 1000000,
          fake_data: bool = False, log_device_placement: bool = False,
          log_frequency: int = 10, save_checkpoint_steps: int = 1000,
          save_summaries_steps: int = 100,
          initial_learning_rate: float = INITIAL_LEARNING_RATE,
          shuffle_buffer: Optional[int] = None,
          variable_device: str = "cpu", all_reduce: str = "auto",
          pack_bytes: int = common.DEFAULT_PACK_BYTES,
          use_fp16: bool = False, xla: bool = False,
          stage_inputs: bool = False,
          urls: Sequence[str] = cifar10_data.URLS) -> int:
  """Trains until the global step reaches `max_steps`; returns that step.

  Resumes from the latest checkpoint in `train_dir` once
  `traindir.prepare` has locked and checked it; if that checkpoint
  is already at `max_steps`, nothing is trained. SIGTERM or SIGINT stops
  training after a final checkpoint (`common.run_training`).

  Args:
    data_dir: holds (or receives) ``cifar-10-batches-bin/``; unused with
      `fake_data`.
    train_dir: checkpoints and event files; a run with the same directory
      resumes from its latest checkpoint. Never deleted.
    num_gpus: the number of towers.
    batch_size: examples per tower per step (the tutorial's 128); per
      micro-batch with `accumulate_steps`.
    accumulate_steps: micro-batches summed into each step's update.
    max_steps: the global step to stop at.
    fake_data: train on synthetic images, to measure throughput only.
    log_device_placement: log every op's device.
    log_frequency: steps between two log lines.
    save_checkpoint_steps: steps between checkpoints (the last step is
      always saved).
    save_summaries_steps: steps between summaries.
    initial_learning_rate: the learning rate before the first decay.
    shuffle_buffer: records in the shuffle buffer; None for 40% of an epoch.
    variable_device: one of `common.VARIABLE_DEVICES` (see
      `build_train_graph`).
    all_reduce: one of `common.ALL_REDUCE`; other than ``'auto'`` only with
      ``variable_device='replicated'``.
    pack_bytes: as for `build_train_graph`, in every variable mode.
    use_fp16, xla, stage_inputs: as for `build_train_graph`.
    urls: where to download the tarball from when it is absent.

  Returns:
    The global step reached.

  Raises:
    common.FlagError: for an argument out of its `BOUNDS`, a directory
      `common.dir_problem` refuses (empty, a file, under a file, a
      `train_dir` that cannot be written), or a `variable_device` and
      `all_reduce` combination that cannot work
      (`common.check_variable_flags`); common.DeviceError (one) if a session
      lacks a tower device.
    traindir.TrainDirError: if `train_dir` is in use by another trainer, or
      holds checkpoints it cannot safely resume from
      (`traindir.prepare`), or that lack a variable of this run's graph (a
      float32 run's, for `use_fp16`: `traindir.check_restores`).
    common.Interrupted: after SIGTERM or SIGINT, once the checkpoint is
      saved.
    common.DownloadError: if the data are absent and cannot be downloaded.
    cifar10_data.CorruptDataError: if a data file is truncated or corrupt.
    FileNotFoundError: if a batch file is missing from the data directory.
    FloatingPointError: if the loss becomes NaN.
  """
  common.check_args(
      BOUNDS, num_gpus=num_gpus, batch_size=batch_size,
      accumulate_steps=accumulate_steps, max_steps=max_steps,
      log_frequency=log_frequency,
      save_checkpoint_steps=save_checkpoint_steps,
      save_summaries_steps=save_summaries_steps,
      initial_learning_rate=initial_learning_rate,
      shuffle_buffer=shuffle_buffer, pack_bytes=pack_bytes)
  common.check_dir("train_dir", train_dir)
  common.check_dir("data_dir", data_dir, common.READ)
  common.check_variable_flags(variable_device, all_reduce)
  devices, config = common.tower_setup(num_gpus, log_device_placement)
  if fake_data:
    logging.info("--fake_data: training on synthetic random images; the "
                 "examples/sec are real, the loss means nothing")
    train_files = None
    examples_per_epoch = cifar10_data.NUM_TRAIN_EXAMPLES
  else:
    cifar10_data.maybe_download_and_extract(data_dir, urls)
    train_files = cifar10_data.data_files(data_dir, train=True)
    examples_per_epoch = cifar10_data.check_files(train_files)
    logging.info("Training on the %d images of %s", examples_per_epoch,
                 ", ".join(train_files))
  common.log_batch(num_gpus, batch_size, max_steps, examples_per_epoch,
                   accumulate_steps=accumulate_steps)
  state = traindir.prepare(train_dir)
  with state.lock:
    if traindir.finished(state, train_dir, max_steps):
      return state.global_step or 0
    with tf.Graph().as_default():
      g = build_train_graph(devices=devices, batch_size=batch_size,
                            train_files=train_files,
                            examples_per_epoch=examples_per_epoch,
                            initial_learning_rate=initial_learning_rate,
                            shuffle_buffer=shuffle_buffer,
                            variable_device=variable_device,
                            all_reduce=all_reduce, pack_bytes=pack_bytes,
                            use_fp16=use_fp16, xla=xla,
                            stage_inputs=stage_inputs,
                            accumulate_steps=accumulate_steps)
      traindir.check_restores(state, tf.global_variables())
      common.log_variables(g.towers, variable_device, all_reduce)
      common.log_packing(g.towers, pack_bytes)
      common.log_fast_paths(g.towers, "float16" if use_fp16 else "float32",
                            xla, stage_inputs, precision_flag="--use_fp16")
      with tf.device(CPU):  # The saver, as in the tutorial.
        return common.run_training(
            g.train_op, g.loss, g.global_step, g.summary_op,
            train_dir=train_dir, max_steps=max_steps,
            examples_per_step=batch_size * num_gpus * accumulate_steps,
            num_towers=num_gpus, config=config, log_every=log_frequency,
            save_checkpoint_steps=save_checkpoint_steps,
            save_summaries_steps=save_summaries_steps,
            loss_scale=g.towers.loss_scale, applies=g.towers.applies)


FLAGS = flags.FLAGS


def define_flags() -> None:
  """Defines the script's flags (only when run as a script)."""
  flags.DEFINE_integer("num_gpus", 1, "How many towers (GPUs) to use; "
                       "virtual CPU devices stand in for missing GPUs.")
  flags.DEFINE_integer("batch_size", 128, "Examples per tower per step; the "
                       "global batch is batch_size x num_gpus.")
  flags.DEFINE_integer("accumulate_steps", 1, "Micro-batches of batch_size "
                       "per tower summed into each step's update: the "
                       "global batch grows by this factor, memory does "
                       "not.")
  flags.DEFINE_string("data_dir", "/tmp/cifar10_data", "Directory holding "
                      "cifar-10-batches-bin/ (downloaded there when absent).")
  flags.DEFINE_string("train_dir", "/tmp/cifar10_train", "Directory for "
                      "checkpoints and event logs; a run resumes from it.")
  flags.DEFINE_integer("max_steps", 1000000, "The global step to stop at.")
  flags.DEFINE_boolean("fake_data", False, "Train on synthetic images, to "
                       "measure throughput only (no data needed).")
  flags.DEFINE_boolean("log_device_placement", False, "Log each op's "
                       "device.")
  flags.DEFINE_integer("log_frequency", 10, "Steps between log lines.")
  flags.DEFINE_integer("save_checkpoint_steps", 1000, "Steps between "
                       "checkpoints (the last step is always saved).")
  flags.DEFINE_integer("save_summaries_steps", 100, "Steps between "
                       "summaries (0: none).")
  common.define_variable_flags()
  common.define_pack_bytes_flag()
  flags.DEFINE_boolean("use_fp16", False, "Compute in float16, as the "
                       "tutorial's flag, but on float32 master weights "
                       "(averaged, updated and saved in float32, under the "
                       "float32 names) with dynamic loss scaling; the "
                       "tutorial made the variables themselves float16 and "
                       "scaled nothing.")
  common.define_xla_and_staging_flags()
  common.register_flag_checks(BOUNDS, directories=dict(
      train_dir=common.WRITTEN, data_dir=common.READ))
  # --help lists the main module's key flags: the shared ones count too.
  flags.adopt_module_key_flags(common)


def main(argv):
  expected = (common.DownloadError, cifar10_data.CorruptDataError,
              FileNotFoundError, FloatingPointError, common.FlagError,
              traindir.TrainDirError)
  return common.run_main(argv, lambda: train(
      data_dir=FLAGS.data_dir, train_dir=FLAGS.train_dir,
      num_gpus=FLAGS.num_gpus, batch_size=FLAGS.batch_size,
      accumulate_steps=FLAGS.accumulate_steps,
      max_steps=FLAGS.max_steps, fake_data=FLAGS.fake_data,
      log_device_placement=FLAGS.log_device_placement,
      log_frequency=FLAGS.log_frequency,
      save_checkpoint_steps=FLAGS.save_checkpoint_steps,
      save_summaries_steps=FLAGS.save_summaries_steps,
      variable_device=FLAGS.variable_device, all_reduce=FLAGS.all_reduce,
      pack_bytes=FLAGS.pack_bytes, use_fp16=FLAGS.use_fp16, xla=FLAGS.xla,
      stage_inputs=FLAGS.stage_inputs), expected)


if __name__ == "__main__":
  define_flags()
  app.run(main)
