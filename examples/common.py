"""What the MNIST and CIFAR-10 examples share.

Devices (GPUs, or virtual CPUs with one log line saying so), the training
loop with the original tutorial's log line, NaN stop, checkpoints, summaries
and resume, the evaluation schedule, and cached, hash-checked downloads.
Example code, not part of the `towers` library.
"""

import hashlib
import math
import os
import time
import urllib.request
from typing import Callable, Iterable, List, Optional, Sequence, Tuple

from absl import app
from absl import logging
import tensorflow.compat.v1 as tf

import towers


def tower_setup(num_gpus: int, log_device_placement: bool = False
               ) -> Tuple[List[str], tf.ConfigProto]:
  """Returns the tower devices and the session config for `num_gpus` towers.

  GPUs when that many are visible; else as many virtual CPU devices, with one
  log line saying so.
  """
  devices = towers.tower_devices(num_gpus)
  if devices[0].startswith("/gpu"):
    config = tf.ConfigProto(allow_soft_placement=True,
                            log_device_placement=log_device_placement)
  else:
    logging.info(
        "Fewer GPUs visible than --num_gpus=%d: running the tower(s) on "
        "virtual CPU devices %s (correct, but they share this machine's "
        "cores)", num_gpus, ", ".join(devices))
    config = towers.virtual_cpu_config(
        num_gpus, log_device_placement=log_device_placement)
  return devices, config


def training_summaries(t: towers.Towers, learning_rate: tf.Tensor
                      ) -> tf.Tensor:
  """Merges the final tower's summaries, the learning rate and histograms.

  Histograms are of each variable and of its averaged gradient (what
  `towers.minimize` applied), tagged with the variable's name. Run by the
  session's summary hook in the same `sess.run` as the training step, so no
  extra input batch is consumed.
  """
  # Explicit tags: tf.summary.* derive the tag from a uniquified op name, so
  # a tag equal to an existing op's name ("conv1/weights") would become
  # "conv1/weights_1".
  with tf.name_scope("training_summaries"):
    summaries = list(t.summaries)
    summaries.append(_scalar("learning_rate", learning_rate))
    summaries.append(_scalar("loss", t.loss))
    for grad, var in t.grads_and_vars or []:
      summaries.append(_histogram(var.op.name, var))
      if grad is not None:
        values = grad.values if isinstance(grad, tf.IndexedSlices) else grad
        summaries.append(_histogram(var.op.name + "/gradients", values))
    return tf.summary.merge(summaries)


def _scalar(tag: str, value: tf.Tensor) -> tf.Tensor:
  return tf.raw_ops.ScalarSummary(tags=tag, values=value)


def _histogram(tag: str, values) -> tf.Tensor:
  return tf.raw_ops.HistogramSummary(tag=tag, values=values)


class StepLogger(tf.train.SessionRunHook):
  """Logs the original's line every `every` steps and stops on a NaN loss.

  ``step %d, loss = %.2f (%.1f examples/sec; %.3f sec/batch)``, where
  examples/sec counts the global batch and sec/batch is the step time
  divided by the number of towers, as in the tutorial.
  """

  def __init__(self, loss: tf.Tensor, global_step: tf.Tensor,
               examples_per_step: int, num_towers: int, every: int = 10,
               count_locally: bool = True):
    self._loss = loss
    self._global_step = global_step
    self._examples_per_step = examples_per_step
    self._num_towers = num_towers
    self._every = every
    self._count_locally = count_locally
    self._step = 0
    self._runs = 0
    self._start = None

  @property
  def step(self) -> int:
    """The global step after the last step this hook saw."""
    return self._step

  def after_create_session(self, session, coord):
    # The step the run resumes from (see after_run for how it goes on).
    self._step = int(session.run(self._global_step))
    self._start = time.time()

  def before_run(self, run_context):
    return tf.train.SessionRunArgs([self._loss, self._global_step])

  def after_run(self, run_context, run_values):
    loss, global_step = run_values.results
    loss = float(loss)
    # Alone, a process counts its own steps (the global step it fetched may
    # be read before or after this step's increment). In a cluster other
    # workers advance the global step too, so that is the count to show.
    self._runs += 1
    self._step = self._step + 1 if self._count_locally else int(global_step)
    if math.isnan(loss):
      raise FloatingPointError(
          "loss is NaN at step %d: training stopped, nothing saved from this "
          "step (lower the learning rate, or check the input); the last "
          "checkpoint is kept" % self._step)
    if self._runs % self._every == 0:
      duration = (time.time() - self._start) / self._every
      self._start = time.time()
      logging.info("step %d, loss = %.2f (%.1f examples/sec; %.3f sec/batch)",
                   self._step, loss, self._examples_per_step / duration,
                   duration / self._num_towers)


def run_training(train_op: tf.Operation, loss: tf.Tensor,
                 global_step: tf.Tensor, summary_op: Optional[tf.Tensor], *,
                 train_dir: str, max_steps: int, examples_per_step: int,
                 num_towers: int, config: tf.ConfigProto,
                 log_every: int = 10, save_checkpoint_secs: int = 60,
                 save_checkpoint_steps: Optional[int] = None,
                 save_summaries_steps: int = 100, master: str = "",
                 is_chief: bool = True, stop_grace_period_secs: float = 120,
                 hooks: Iterable[tf.train.SessionRunHook] = (),
                 chief_only_hooks: Iterable[tf.train.SessionRunHook] = ()
                ) -> int:
  """Trains until the global step reaches `max_steps`; returns that step.

  Resumes from the latest checkpoint in `train_dir` (the global step goes
  on), saves one every `save_checkpoint_secs` and at the end, and writes
  `summary_op` every `save_summaries_steps`. `save_checkpoint_steps`, when
  given, replaces the time-based schedule. Nothing is ever deleted.
  """
  scaffold = tf.train.Scaffold(summary_op=summary_op)
  logger = StepLogger(loss, global_step, examples_per_step, num_towers,
                      log_every, count_locally=not master)
  all_hooks = [tf.train.StopAtStepHook(last_step=max_steps), logger]
  with tf.train.MonitoredTrainingSession(
      master=master, is_chief=is_chief, checkpoint_dir=train_dir,
      scaffold=scaffold, hooks=all_hooks + list(hooks),
      chief_only_hooks=list(chief_only_hooks), config=config,
      save_checkpoint_secs=None if save_checkpoint_steps else
      save_checkpoint_secs,
      save_checkpoint_steps=save_checkpoint_steps,
      save_summaries_steps=save_summaries_steps if summary_op is not None
      else None,
      log_step_count_steps=0,
      stop_grace_period_secs=stop_grace_period_secs) as sess:
    while not sess.should_stop():
      sess.run(train_op)
  return logger.step


def evaluate_checkpoints(evaluate_once: Callable[[str], float],
                         checkpoint_dir: str, eval_interval_secs: float,
                         run_once: bool) -> Optional[float]:
  """Calls `evaluate_once(path)` on each new checkpoint in `checkpoint_dir`.

  With `run_once`, evaluates the latest checkpoint once and returns its
  result (a missing checkpoint is a `FileNotFoundError`); otherwise loops
  forever, sleeping `eval_interval_secs` between looks.
  """
  last = None
  while True:
    path = tf.train.latest_checkpoint(checkpoint_dir)
    if path is None and run_once:
      raise FileNotFoundError(
          "no checkpoint in %s: train first, or point --checkpoint_dir at a "
          "training run's --train_dir" % checkpoint_dir)
    if path is None:
      logging.info("No checkpoint in %s yet; looking again in %ds",
                   checkpoint_dir, eval_interval_secs)
    elif path != last:
      result = evaluate_once(path)
      last = path
      if run_once:
        return result
    time.sleep(eval_interval_secs)


def run_main(argv: Sequence[str], call: Callable[[], object],
             expected: Tuple[type, ...]) -> int:
  """Runs a script's `call`; returns its exit code.

  An `expected` failure (missing data, a corrupt file, a NaN loss...) is
  logged as its one-line message and gives 1, not a traceback.
  """
  if len(argv) > 1:
    raise app.UsageError("unexpected arguments: %s" % " ".join(argv[1:]))
  try:
    call()
  except expected as e:
    logging.error("%s", e)
    return 1
  return 0


class DownloadError(OSError):
  """A data file could not be fetched or failed its hash check."""


def _digest(path: str, algorithm: str) -> str:
  # usedforsecurity=False: MD5 is only published for CIFAR-10, as a check
  # against corrupt downloads, not a security measure.
  digest = hashlib.new(algorithm, usedforsecurity=False)
  with open(path, "rb") as f:
    for block in iter(lambda: f.read(1 << 20), b""):
      digest.update(block)
  return digest.hexdigest()


def sha256_of(path: str) -> str:
  return _digest(path, "sha256")


def md5_of(path: str) -> str:
  return _digest(path, "md5")


def maybe_download(urls: Sequence[str], path: str,
                   sha256: Optional[str] = None, *,
                   md5: Optional[str] = None) -> str:
  """Returns `path`, downloading it from the first of `urls` that works.

  A file already at `path` is used as it is (the cache). A download goes to
  ``path + '.part'``, logs its progress every 10%, and is renamed into place
  only after its SHA-256 matches, so an interrupted or corrupt download never
  looks like a finished one. Where only an MD5 is published, pass `md5`
  instead of `sha256`; it is checked the same way.

  Raises:
    DownloadError: if every URL fails or the hash does not match.
    ValueError: if neither or both of `sha256` and `md5` are given.
  """
  if (sha256 is None) == (md5 is None):
    raise ValueError("expected exactly one of sha256 and md5 for %s, got "
                     "sha256=%r, md5=%r" % (path, sha256, md5))
  if os.path.exists(path):
    return path
  os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
  part = path + ".part"
  errors = []
  for url in urls:
    try:
      _fetch(url, part)
    except OSError as e:
      errors.append("%s: %s" % (url, e))
      continue
    kind, want = ("SHA-256", sha256) if md5 is None else ("MD5", md5)
    got = sha256_of(part) if md5 is None else md5_of(part)
    if got != want:
      os.remove(part)
      errors.append("%s: %s %s, expected %s" % (url, kind, got, want))
      continue
    os.replace(part, path)
    return path
  raise DownloadError("could not download %s (%s)"
                      % (os.path.basename(path), "; ".join(errors)))


def _fetch(url: str, part: str) -> None:
  logging.info("Downloading %s", url)
  with urllib.request.urlopen(url, timeout=30) as response, \
      open(part, "wb") as out:
    total = int(response.headers.get("Content-Length") or 0)
    done, next_report = 0, 0.1
    while True:
      block = response.read(1 << 16)
      if not block:
        break
      out.write(block)
      done += len(block)
      if total and done / total >= next_report:
        logging.info("  %s: %d%% of %d bytes", os.path.basename(part[:-5]),
                     int(100 * done / total), total)
        next_report += 0.1
