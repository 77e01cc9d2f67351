r"""Evaluates MNIST checkpoints: precision @ 1 over all 10,000 test images.

  python examples/mnist_eval.py --data_dir=/tmp/mnist_data \
      --checkpoint_dir=/tmp/mnist_train --run_once
  python examples/mnist_eval.py --checkpoint_dir=/tmp/mnist_train  # each new
  python examples/mnist_eval.py --num_gpus=2 --run_once  # on 2 towers
  tensorboard --logdir=/tmp/mnist_train  # the eval/ subdirectory included

Restores the latest checkpoint of a training run (any number of towers and
any --variable_device: the variables keep single-device names, and
replicated training saves copy 0 alone) into the model, runs the test split
exactly once (the last batch may be partial), and logs
``precision @ 1 = 0.dddd`` (a fraction), also written as a summary to
--eval_dir (default: the checkpoint directory's ``eval/``, made only once
there is a checkpoint to evaluate). Pixels are scaled by the same
`mnist_data.normalize` as in training. With --num_gpus=N each batch is split
over N towers (`towers.infer`: forward only, the logits put back in batch
order); one tower is the single-device model. A flag out of range
(``--batch_size=0``) stops the script with one line naming it.
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

import common
import mnist_data
import mnist_model
import towers

EvalResult = collections.namedtuple(
    "EvalResult", ["precision", "num_correct", "num_examples", "global_step",
                   "checkpoint"])
EvalResult.__doc__ = """One checkpoint's evaluation.

Fields:
  precision: the fraction of test images whose top logit is the label.
  num_correct: how many test images that is.
  num_examples: how many test images were evaluated (all of them, once).
  global_step: the checkpoint's global step.
  checkpoint: the checkpoint's path.
"""

# The bounds of `evaluate`'s numeric arguments and of the flags of the same
# names (`common.check_args`).
BOUNDS = {
    "num_gpus": dict(at_least=1),
    "batch_size": dict(at_least=1),
    "eval_interval_secs": dict(above=0),
}


def evaluate(*, checkpoint_dir: str, data_dir: Optional[str] = None,
             dataset: str = "mnist", eval_dir: Optional[str] = None,
             batch_size: int = 1000, eval_interval_secs: float = 300,
             run_once: bool = False, num_gpus: int = 1,
             mirrors: Optional[Sequence[str]] = mnist_data.MNIST_MIRRORS
            ) -> Optional[EvalResult]:
  """Evaluates the latest checkpoint in `checkpoint_dir`, once or forever.

  Args:
    checkpoint_dir: a training run's train_dir.
    data_dir: the IDX files (see `mnist_data.find_split`); None for the
      dataset's default directory.
    dataset: 'mnist' or 'fashion_mnist'.
    eval_dir: where the precision summary goes; None for
      ``checkpoint_dir/eval``.
    batch_size: test images per batch; any size works, a partial last
      batch included.
    eval_interval_secs: seconds between looks for a new checkpoint.
    run_once: evaluate the latest checkpoint once and return.
    num_gpus: towers each batch is split over.
    mirrors: base URLs for downloading missing MNIST files; empty for none.

  Returns:
    With `run_once`, an `EvalResult`; otherwise it never returns.

  Raises:
    common.FlagError: for an argument out of its `BOUNDS`, or a directory
      `common.dir_problem` refuses (empty, a file, under a file, an event
      directory that cannot be written).
    common.DeviceError: if this machine cannot run `num_gpus` towers.
    FileNotFoundError: with `run_once`, if there is no checkpoint.
    mnist_data.MissingDataError, mnist_data.IdxError: as `find_split`.
    RuntimeError: if the pass did not count every test image exactly once.
  """
  common.check_args(BOUNDS, num_gpus=num_gpus, batch_size=batch_size,
                    eval_interval_secs=eval_interval_secs)
  for name, path, kind in (("checkpoint_dir", checkpoint_dir, common.READ),
                           ("data_dir", data_dir, common.READ),
                           ("eval_dir", eval_dir, common.WRITTEN)):
    common.check_dir(name, path, kind)
  if data_dir is None:
    data_dir = mnist_data.default_data_dir(dataset)
  if eval_dir is None:
    eval_dir = common.check_default_eval_dir(checkpoint_dir)
  images_file, labels_file = mnist_data.find_split(data_dir, "test", dataset,
                                                   mirrors)
  devices, config = common.tower_setup(num_gpus)
  with tf.Graph().as_default():
    with tf.device(mnist_data.INPUT_DEVICE):
      iterator = tf.data.make_initializable_iterator(
          mnist_data.eval_dataset(images_file, labels_file, batch_size))
      images, labels = iterator.get_next()
    global_step = tf.train.get_or_create_global_step()
    # Each tower takes its share of the batch; the logits come back in the
    # batch's order, next to the labels.
    logits = towers.infer(lambda scope, x: mnist_model.inference(x)[0],
                          num_gpus, inputs=images, devices=devices)
    correct = tf.reduce_sum(tf.cast(tf.nn.in_top_k(logits, labels, 1),
                                    tf.int64))
    count = tf.size(labels, out_type=tf.int64)
    saver = tf.train.Saver()
    # Made with the first result: no eval_dir for a checkpoint_dir without
    # a checkpoint (a mistyped one, say).
    writers = []

    def evaluate_once(checkpoint: str) -> EvalResult:
      with tf.Session(config=config) as sess:
        saver.restore(sess, checkpoint)
        step = int(sess.run(global_step))
        sess.run(iterator.initializer)
        num_correct, num_examples = 0, 0
        while True:
          try:
            c, n = sess.run([correct, count])
          except tf.errors.OutOfRangeError:
            break
          num_correct += int(c)
          num_examples += int(n)
      if num_examples != images_file.count:
        raise RuntimeError(
            "evaluated %d test images, expected exactly %d (%s); the "
            "evaluation pass must see each image once"
            % (num_examples, images_file.count, images_file.path))
      precision = num_correct / num_examples
      logging.info("step %d: precision @ 1 = %.4f (%d of %d test images)",
                   step, precision, num_correct, num_examples)
      summary = tf.Summary()
      summary.value.add(tag="precision @ 1", simple_value=precision)
      if not writers:
        writers.append(tf.summary.FileWriter(eval_dir))
      writers[0].add_summary(summary, step)
      writers[0].flush()
      return EvalResult(precision, num_correct, num_examples, step,
                        checkpoint)

    try:
      return common.evaluate_checkpoints(evaluate_once, checkpoint_dir,
                                         eval_interval_secs, run_once)
    finally:
      for writer in writers:
        writer.close()


FLAGS = flags.FLAGS


def define_flags() -> None:
  """Defines the script's flags (only when run as a script)."""
  flags.DEFINE_string("checkpoint_dir", "/tmp/mnist_train", "A training "
                      "run's --train_dir.")
  flags.DEFINE_enum("dataset", "mnist", list(mnist_data.DATASETS),
                    "mnist or fashion_mnist, as trained.")
  flags.DEFINE_string("data_dir", None, "Directory of the IDX files; "
                      "default /tmp/mnist_data for mnist, %s for "
                      "fashion_mnist." % mnist_data.FASHION_MNIST_DIR)
  flags.DEFINE_string("eval_dir", None, "Where the precision summary goes; "
                      "default <checkpoint_dir>/eval.")
  flags.DEFINE_integer("num_gpus", 1, "Towers each test batch is split "
                       "over; virtual CPU devices stand in for missing GPUs.")
  flags.DEFINE_integer("batch_size", 1000, "Test images per batch.")
  flags.DEFINE_integer("eval_interval_secs", 300, "Seconds between looks "
                       "for a new checkpoint.")
  flags.DEFINE_boolean("run_once", False, "Evaluate the latest checkpoint "
                       "once and exit.")
  flags.DEFINE_list("mirrors", list(mnist_data.MNIST_MIRRORS), "Base URLs "
                    "to download missing MNIST files from (comma "
                    "separated; empty for no download).")
  common.register_flag_checks(BOUNDS, directories=dict(
      checkpoint_dir=common.READ, data_dir=common.READ,
      eval_dir=common.WRITTEN))


def main(argv):
  expected = (mnist_data.DataError, FileNotFoundError, common.FlagError)
  return common.run_main(argv, lambda: evaluate(
      checkpoint_dir=FLAGS.checkpoint_dir, data_dir=FLAGS.data_dir,
      dataset=FLAGS.dataset, eval_dir=FLAGS.eval_dir,
      batch_size=FLAGS.batch_size, eval_interval_secs=FLAGS.eval_interval_secs,
      run_once=FLAGS.run_once, num_gpus=FLAGS.num_gpus,
      mirrors=FLAGS.mirrors), expected)


if __name__ == "__main__":
  define_flags()
  app.run(main)
