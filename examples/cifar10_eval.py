r"""Evaluates CIFAR-10 checkpoints of the multi-GPU example on the test set.

  python examples/cifar10_eval.py --data_dir=/tmp/cifar10_data \
      --checkpoint_dir=/tmp/cifar10_train --run_once
  python examples/cifar10_eval.py --checkpoint_dir=/tmp/cifar10_train \
      --eval_dir=/tmp/cifar10_eval  # every 5 minutes, beside training
  tensorboard --logdir=/tmp/cifar10_eval

The working version of TensorFlow's ``cifar10_eval.py``: it restores the
exponential moving averages of the weights that training kept (not the raw
weights; the tutorial credits them with about 3% precision), runs the
network on the central 24x24 crop of each of the first --num_examples test
images exactly once (the last batch holds the remainder: 10,000 images, not
the tutorial's 10,112), and logs ``precision @ 1 = 0.dddd`` (a fraction),
also written to --eval_dir as a summary. Without --run_once it evaluates
each new checkpoint in --checkpoint_dir, looking every --eval_interval_secs.
Checkpoints of every --variable_device and --num_gpus read alike: the
variables and their averages keep single-device names (replicated training
saves copy 0 alone).
--eval_dir is created with the first result, never deleted (the tutorial
wiped it). A flag out of range (``--num_examples=0``) stops the script with
one line naming it.
"""

import collections
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

EvalGraph = collections.namedtuple("EvalGraph", [
    "graph", "init_op", "correct", "count", "saver", "num_examples"])
EvalGraph.__doc__ = """What `build_eval_graph` built.

Fields:
  graph: the ``tf.Graph`` holding the rest.
  init_op: (re)starts the pass over the test images.
  correct: int64, how many of the current batch are right at top 1.
  count: int32, the current batch's size (the last one may be smaller).
  saver: restores each trainable variable from its moving average.
  num_examples: how many test images one pass evaluates.
"""

EvalResult = collections.namedtuple("EvalResult", [
    "precision", "correct", "count", "global_step"])
EvalResult.__doc__ = """One checkpoint's evaluation.

Fields:
  precision: ``correct / count``, the precision @ 1.
  correct: test images whose top prediction is their label.
  count: test images evaluated, each exactly once.
  global_step: the checkpoint's training step.
"""

# The bounds of `evaluate`'s numeric arguments and of the flags of the same
# names (`common.check_args`).
BOUNDS = {
    "num_examples": dict(at_least=1),
    "batch_size": dict(at_least=1),
    "eval_interval_secs": dict(above=0),
}


def build_eval_graph(test_files: Sequence[str], num_examples: int,
                     batch_size: int) -> EvalGraph:
  """Builds the evaluation graph over the first `num_examples` test images.

  Args:
    test_files: the checked test batch files.
    num_examples: how many images to evaluate, at most the files' records.
    batch_size: images per batch.

  Returns:
    An `EvalGraph` in a new graph.
  """
  graph = tf.Graph()
  with graph.as_default():
    with tf.device("/cpu:0"):
      dataset = cifar10_data.eval_dataset(test_files, batch_size,
                                          num_examples)
      iterator = tf.data.make_initializable_iterator(dataset)
      images, labels = iterator.get_next()
    logits, _ = cifar10_model.inference(images)
    correct = tf.reduce_sum(
        tf.cast(tf.nn.in_top_k(logits, labels, 1), tf.int64))
    count = tf.size(labels)
    # Maps "conv1/weights/ExponentialMovingAverage" in the checkpoint to the
    # variable conv1/weights here: the network runs on the averages.
    averages = tf.train.ExponentialMovingAverage(
        cifar10_model.MOVING_AVERAGE_DECAY)
    saver = tf.train.Saver(averages.variables_to_restore())
  return EvalGraph(graph=graph, init_op=iterator.initializer,
                   correct=correct, count=count, saver=saver,
                   num_examples=num_examples)


def evaluate_checkpoint(g: EvalGraph, checkpoint_path: str,
                        summary_writer: Optional[tf.summary.FileWriter] = None
                       ) -> EvalResult:
  """Evaluates one checkpoint's moving averages on the test images.

  Args:
    g: from `build_eval_graph`.
    checkpoint_path: a checkpoint written by the training script.
    summary_writer: if given, gets ``precision @ 1`` at the checkpoint's
      global step.

  Returns:
    An `EvalResult`.
  """
  global_step = int(tf.train.load_variable(checkpoint_path, "global_step"))
  correct = count = 0
  with tf.Session(graph=g.graph) as sess:
    g.saver.restore(sess, checkpoint_path)
    sess.run(g.init_op)
    while True:
      try:
        batch_correct, batch_count = sess.run([g.correct, g.count])
      except tf.errors.OutOfRangeError:
        break
      correct += int(batch_correct)
      count += int(batch_count)
  precision = correct / count
  logging.info("step %d: precision @ 1 = %.4f (%d of %d test images)",
               global_step, precision, correct, count)
  if summary_writer is not None:
    summary = tf.Summary(value=[
        tf.Summary.Value(tag="precision @ 1", simple_value=precision)])
    summary_writer.add_summary(summary, global_step)
    summary_writer.flush()
  return EvalResult(precision=precision, correct=correct, count=count,
                    global_step=global_step)


def evaluate(*, data_dir: str, checkpoint_dir: str, eval_dir: str,
             num_examples: int = 10000, batch_size: int = 128,
             eval_interval_secs: float = 300, run_once: bool = False,
             urls: Sequence[str] = cifar10_data.URLS) -> Optional[float]:
  """Evaluates the checkpoints in `checkpoint_dir` as they appear.

  Args:
    data_dir: holds (or receives) ``cifar-10-batches-bin/``.
    checkpoint_dir: the training run's directory.
    eval_dir: where the ``precision @ 1`` summaries go; never deleted.
    num_examples: how many test images to evaluate (at most the test set's
      10,000; fewer if the test file holds fewer).
    batch_size: images per batch; it does not change the result.
    eval_interval_secs: seconds between looks for a new checkpoint.
    run_once: evaluate the latest checkpoint once and return.
    urls: where to download the tarball from when it is absent.

  Returns:
    With `run_once`, the precision @ 1; otherwise it never returns.

  Raises:
    FileNotFoundError: with `run_once`, if there is no checkpoint; or if the
      test batch file is missing.
    common.DownloadError: if the data are absent and cannot be downloaded.
    cifar10_data.CorruptDataError: if the test file is truncated or corrupt.
    common.FlagError: for an argument out of its `BOUNDS`, or a directory
      `common.dir_problem` refuses (empty, a file, under a file, an
      --eval_dir that cannot be written).
  """
  common.check_args(BOUNDS, num_examples=num_examples, batch_size=batch_size,
                    eval_interval_secs=eval_interval_secs)
  for name, path, kind in (("checkpoint_dir", checkpoint_dir, common.READ),
                           ("data_dir", data_dir, common.READ),
                           ("eval_dir", eval_dir, common.WRITTEN)):
    common.check_dir(name, path, kind)
  cifar10_data.maybe_download_and_extract(data_dir, urls)
  test_files = cifar10_data.data_files(data_dir, train=False)
  present = cifar10_data.check_files(test_files)
  if num_examples > present:
    logging.warning("--num_examples=%d but %s holds %d images: evaluating "
                    "those %d", num_examples, ", ".join(test_files), present,
                    present)
    num_examples = present
  g = build_eval_graph(test_files, num_examples, batch_size)
  # Made with the first result: no eval_dir for a checkpoint_dir without a
  # checkpoint (a mistyped one, say).
  writers = []

  def evaluate_once(path: str) -> float:
    if not writers:
      with g.graph.as_default():
        writers.append(tf.summary.FileWriter(eval_dir, g.graph))
    return evaluate_checkpoint(g, path, writers[0]).precision

  try:
    return common.evaluate_checkpoints(evaluate_once, checkpoint_dir,
                                       eval_interval_secs, run_once)
  finally:
    for writer in writers:
      writer.close()


FLAGS = flags.FLAGS


def define_flags() -> None:
  """Defines the script's flags (only when run as a script)."""
  flags.DEFINE_string("eval_dir", "/tmp/cifar10_eval", "Directory for the "
                      "precision summaries.")
  flags.DEFINE_string("checkpoint_dir", "/tmp/cifar10_train", "The training "
                      "run's --train_dir.")
  flags.DEFINE_string("data_dir", "/tmp/cifar10_data", "Directory holding "
                      "cifar-10-batches-bin/ (downloaded there when absent).")
  flags.DEFINE_integer("eval_interval_secs", 60 * 5, "Seconds between looks "
                       "for a new checkpoint.")
  flags.DEFINE_integer("num_examples", 10000, "Test images to evaluate, "
                       "each once.")
  flags.DEFINE_integer("batch_size", 128, "Images per evaluation batch.")
  flags.DEFINE_boolean("run_once", False, "Evaluate the latest checkpoint "
                       "once and exit.")
  common.register_flag_checks(BOUNDS, directories=dict(
      checkpoint_dir=common.READ, data_dir=common.READ,
      eval_dir=common.WRITTEN))


def main(argv):
  expected = (common.DownloadError, cifar10_data.CorruptDataError,
              FileNotFoundError, common.FlagError)
  return common.run_main(argv, lambda: evaluate(
      data_dir=FLAGS.data_dir, checkpoint_dir=FLAGS.checkpoint_dir,
      eval_dir=FLAGS.eval_dir, num_examples=FLAGS.num_examples,
      batch_size=FLAGS.batch_size, eval_interval_secs=FLAGS.eval_interval_secs,
      run_once=FLAGS.run_once), expected)


if __name__ == "__main__":
  define_flags()
  app.run(main)
