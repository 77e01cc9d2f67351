"""What the MNIST and CIFAR-10 examples share.

Devices (GPUs, or virtual CPUs with one log line saying so), flag checks
(directory flags included), the training loop with the original tutorial's
log line, NaN stop, checkpoints, summaries, resume and a checkpoint on
SIGTERM/SIGINT, the evaluation schedule, each TensorFlow log line once,
input pipelines whose session closes at once, and cached, hash-checked
downloads (the training directory's lock and checks are in traindir.py).
Example code, not part of the `towers` library.
"""

import contextlib
import functools
import hashlib
import logging as std_logging
import math
import os
import signal
import threading
import time
import urllib.request
from typing import (Callable, Iterable, List, Mapping, Optional, Sequence,
                    Tuple)

from absl import app
from absl import flags
from absl import logging
import tensorflow.compat.v1 as tf

import towers
import traindir


class FlagError(ValueError):
  """A flag, or the `train`/`evaluate` argument of the same name, is wrong."""


class DeviceError(FlagError):
  """The session lacks a tower device; the message names it and the fix."""


# Bounds, by keyword: the value must be >= at_least, > above, <= at_most and
# < below (each only when given).
Bounds = Mapping[str, float]


def _describe(bounds: Bounds) -> str:
  words = {"at_least": ">=", "above": ">", "at_most": "<=", "below": "<"}
  return " and ".join("%s %s" % (words[k], bounds[k]) for k in words
                      if k in bounds)


def _in_bounds(value, bounds: Bounds) -> bool:
  return (("at_least" not in bounds or value >= bounds["at_least"]) and
          ("above" not in bounds or value > bounds["above"]) and
          ("at_most" not in bounds or value <= bounds["at_most"]) and
          ("below" not in bounds or value < bounds["below"]))


def check_args(bounds: Mapping[str, Bounds], **args) -> None:
  """Checks `train`/`evaluate` arguments against a script's flag bounds.

  Each argument is named like its flag, so the error names the flag. None
  passes (it means "not set" for the optional flags).

  Raises:
    FlagError: for the first argument out of its bounds, e.g. ``--batch_size=0
      must be >= 1``.
  """
  for name, value in args.items():
    if value is not None and not _in_bounds(value, bounds[name]):
      raise FlagError("--%s=%s must be %s" % (name, value,
                                              _describe(bounds[name])))


# How a script uses a directory flag: WRITTEN, created if absent and written
# (--train_dir, --eval_dir); or READ, only read (--checkpoint_dir, waited
# for if absent; --data_dir, where MNIST's missing files are downloaded to,
# but which may be a read-only copy of the data).
WRITTEN = "written"
READ = "read"


def _dir_problem(path: Optional[str], kind: str
                ) -> Optional[Tuple[str, str]]:
  """(what is wrong with directory `path`, the fix), or None if nothing is."""
  if path is None:
    return None  # An optional flag left out.
  if not path:
    return ("is empty", "name a directory, or leave the flag out for its "
            "default")
  path = os.path.abspath(path)
  head = path  # The nearest part of `path` that exists.
  while not os.path.lexists(head):
    head = os.path.dirname(head)
  if not os.path.isdir(head):
    what = "a file" if os.path.isfile(head) else "not a directory"
    if head != path:
      return ("is under %s, which is %s" % (head, what),
              "point it at a directory")
    return ("is a file, not a directory" if what == "a file" else
            "is not a directory",
            "point it at a directory" +
            (" (it is created if absent)" if kind == WRITTEN else ""))
  if kind == WRITTEN and not os.access(head, os.W_OK | os.X_OK):
    return ("is not writable" if head == path else
            "cannot be created (%s is not writable)" % head,
            "point it at a directory you can write to")
  return None


def dir_problem(path: Optional[str], kind: str = WRITTEN) -> Optional[str]:
  """What makes `path` unusable for a directory flag, and the fix; or None.

  Refused: an empty path, a file, a path under a file; for a `kind`
  WRITTEN directory also one this process cannot write, or, absent, cannot
  create (its nearest existing parent is not writable). None passes (an
  optional flag left out). The words follow the flag: ``--train_dir=X is
  a file, not a directory: point it at a directory (it is created if
  absent)``.
  """
  problem = _dir_problem(path, kind)
  return None if problem is None else "%s: %s" % problem


def check_dir(name: str, path: Optional[str], kind: str = WRITTEN) -> None:
  """Checks the directory flag (or argument) `name` (see `dir_problem`).

  Raises:
    FlagError: naming the flag, what is wrong and the fix.
  """
  problem = dir_problem(path, kind)
  if problem is not None:
    raise FlagError("--%s=%s %s" % (name, path, problem))


def check_default_eval_dir(checkpoint_dir: str) -> str:
  """Returns an evaluator's default event directory, checkpoint_dir/eval.

  Raises:
    FlagError: if it cannot be made or written, saying to give --eval_dir.
  """
  eval_dir = os.path.join(checkpoint_dir, "eval")
  problem = _dir_problem(eval_dir, WRITTEN)
  if problem is not None:
    raise FlagError(
        "--checkpoint_dir=%s: without --eval_dir the evaluation summaries go "
        "to %s, which %s: give --eval_dir" % (checkpoint_dir, eval_dir,
                                              problem[0]))
  return eval_dir


# --variable_device: the towers' one-copy placements (`towers.build_towers`'
# 'cpu', 'gpu', 'balanced'), or a copy of each variable on every tower.
VARIABLE_DEVICES = ("cpu", "gpu", "balanced", "replicated")
# --all_reduce: how replicated towers sum their gradients ('auto': towers'
# rule, 'collective' on distinct GPUs, else 'add_n').
ALL_REDUCE = ("auto", "add_n", "ring", "collective")


def check_variable_flags(variable_device: str, all_reduce: str,
                         distributed: bool = False,
                         collective: bool = False) -> None:
  """Checks a --variable_device and --all_reduce combination.

  --all_reduce chooses how the towers' copies of the variables are kept
  identical, so it is set only with --variable_device=replicated. A cluster
  with parameter servers (--ps_hosts) keeps one copy of each variable
  there, updated by a ``tf.train.SyncReplicasOptimizer``, which towers does
  not replicate: there --variable_device keeps its default. A collective
  cluster (`collective`: --worker_hosts without --ps_hosts) is always
  replicated and all-reduced with collective ops: the flags may say so, or
  keep their defaults.

  Raises:
    FlagError: for an unknown value, or a combination that cannot work,
      naming the flags and the fix.
  """
  for name, value, choices in (("variable_device", variable_device,
                                VARIABLE_DEVICES),
                               ("all_reduce", all_reduce, ALL_REDUCE)):
    if value not in choices:
      raise FlagError("--%s=%s must be one of %s"
                      % (name, value, ", ".join(choices)))
  if collective:
    if (variable_device not in ("cpu", "replicated") or
        all_reduce not in ("auto", "collective")):
      raise FlagError(
          "--variable_device=%s --all_reduce=%s: a cluster without "
          "--ps_hosts (collective mode) keeps a copy of the variables on "
          "every tower of every worker, all-reduced with collective ops: "
          "drop both flags, or give --ps_hosts"
          % (variable_device, all_reduce))
    return
  if all_reduce != "auto" and variable_device != "replicated":
    raise FlagError(
        "--all_reduce=%s applies to --variable_device=replicated only (it "
        "sums the gradients of the towers' copies of the variables); with "
        "--variable_device=%s the towers share one copy: add "
        "--variable_device=replicated, or drop --all_reduce"
        % (all_reduce, variable_device))
  if distributed and variable_device != "cpu":
    raise FlagError(
        "--variable_device=%s applies to training on one machine: with "
        "--ps_hosts the variables live on the parameter servers, one copy "
        "updated through SyncReplicasOptimizer (which towers does not "
        "replicate); drop --variable_device, or train without --ps_hosts "
        "and --worker_hosts (or --worker_hosts alone, collective mode)"
        % variable_device)


def define_variable_flags(note: str = "") -> None:
  """Defines --variable_device and --all_reduce; `note` ends the first help."""
  flags.DEFINE_enum("variable_device", "cpu", list(VARIABLE_DEVICES),
                    "Where the variables live: one copy on the CPU (the "
                    "original's), on the first tower's device, or balanced "
                    "over the towers' devices; or 'replicated', a copy on "
                    "every tower." + note)
  flags.DEFINE_enum("all_reduce", "auto", list(ALL_REDUCE),
                    "With --variable_device=replicated, how the copies' "
                    "gradients are summed: add_n (on the first tower's "
                    "device, exactly the one-copy step), ring (graph ops), "
                    "collective (NCCL on GPUs); auto: collective when every "
                    "tower is a GPU, else add_n.")


# --pack_bytes' default: towers.minimize's, written out because the examples
# use the library's public API only (a test checks that the two agree).
DEFAULT_PACK_BYTES = 16384


def define_pack_bytes_flag() -> None:
  """Defines --pack_bytes, passed to `towers.minimize` as `pack_bytes`."""
  flags.DEFINE_integer("pack_bytes", DEFAULT_PACK_BYTES,
                       "Gradients of at most this many bytes are packed: "
                       "those reduced alike are concatenated on each tower, "
                       "reduced in one transfer and split back. 0 turns "
                       "packing off. The results are the same either way "
                       "(bit for bit; with --all_reduce=collective over 3 "
                       "or more towers, within rounding).")


# --precision: the dtype the towers compute in (`towers.minimize`'s
# compute_dtype); the variables stay float32 whatever it is.
PRECISIONS = ("float32", "float16", "bfloat16")


def check_precision(precision: str, distributed: bool = False,
                    collective: bool = False) -> None:
  """Checks --precision, alone and with a cluster.

  In a cluster with parameter servers (--ps_hosts) a
  ``tf.train.SyncReplicasOptimizer`` applies the workers' gradients, and it
  needs every worker's gradients at every step, so float16's loss scaling,
  which skips the steps whose gradients overflow, cannot work there. In
  collective mode (`collective`: --worker_hosts alone) every worker would
  skip the same steps (they see the same all-reduced gradients), but that
  is not tested, so float16 is refused there too. bfloat16 needs no loss
  scaling. (The other fast paths, --xla and --stage_inputs, work in a
  cluster.)

  Raises:
    FlagError: for an unknown precision, or float16 in a cluster, naming
      the flags and the fix.
  """
  if precision not in PRECISIONS:
    raise FlagError("--precision=%s must be one of %s"
                    % (precision, ", ".join(PRECISIONS)))
  if collective and precision == "float16":
    raise FlagError(
        "--precision=float16 needs loss scaling, which skips the steps whose "
        "gradients overflow, and that skip is not tested across the workers "
        "of collective mode (--worker_hosts without --ps_hosts): use "
        "--precision=bfloat16 (float32's range, no loss scaling), or train "
        "without --worker_hosts")
  if distributed and precision == "float16":
    raise FlagError(
        "--precision=float16 needs loss scaling, which skips the steps whose "
        "gradients overflow, but with --ps_hosts SyncReplicasOptimizer needs "
        "every worker's gradients at every step: use --precision=bfloat16 "
        "(float32's range, no loss scaling), or train without --ps_hosts and "
        "--worker_hosts")


def define_precision_flag(note: str = "") -> None:
  """Defines --precision; `note` ends its help."""
  flags.DEFINE_enum("precision", "float32", list(PRECISIONS),
                    "The dtype the towers compute in. float16 or bfloat16: "
                    "the weights stay float32 (what is averaged, updated "
                    "and saved, under the float32 names) and each tower "
                    "computes on half-precision casts of them; float16 "
                    "adds dynamic loss scaling (the loss scale is logged "
                    "and summarized)." + note)


def define_xla_and_staging_flags() -> None:
  """Defines --xla and --stage_inputs."""
  flags.DEFINE_boolean("xla", False, "Compile each tower's model and its "
                       "gradient with XLA (tf.xla.experimental.jit_scope); "
                       "results agree with the default's within rounding, "
                       "not bit for bit.")
  flags.DEFINE_boolean("stage_inputs", False, "Read each tower's next batch "
                       "ahead, in a background queue runner, and stage it on "
                       "the tower's device, so a step's input copies run "
                       "while the steps before it compute.")


def xla_scope(xla: bool):
  """An XLA ``jit_scope`` with `xla`, else a scope that does nothing.

  Entered around the body of a `model_fn` (``towers``' documented way to
  XLA): the tower's forward ops, and so its gradient ops, are compiled with
  XLA. Ops XLA cannot compile, such as summaries, run as they would
  without it.
  """
  return tf.xla.experimental.jit_scope() if xla else contextlib.nullcontext()


def log_fast_paths(t: towers.Towers, precision: str, xla: bool,
                   stage_inputs: bool, precision_flag: Optional[str] = None
                  ) -> None:
  """Logs the fast paths in use (nothing when none is).

  `precision_flag` is the flag that chose a half `precision`, as the user
  typed it (default ``--precision=<precision>``).
  """
  if precision != "float32":
    logging.info(
        "%s: the towers compute in %s on float32 master weights (saved "
        "under the float32 names)%s",
        precision_flag or "--precision=" + precision, precision,
        "; dynamic loss scaling (its scale is logged with each step)"
        if t.loss_scale is not None else "")
  if xla:
    logging.info("--xla: each tower's model and its gradient are compiled "
                 "with XLA")
  if stage_inputs:
    logging.info("--stage_inputs: each tower's batches are read ahead and "
                 "staged on its device by a background queue runner")


def log_variables(t: towers.Towers, variable_device: str,
                  all_reduce: str) -> None:
  """Logs where the towers' variables live and how they are kept in step."""
  if t.all_reduce is None:
    logging.info("--variable_device=%s: one copy of each variable, shared "
                 "by the %d towers", variable_device, len(t.devices))
  else:
    logging.info(
        "--variable_device=replicated: a copy of each variable on each of "
        "the %d towers, their gradients summed by the '%s' all-reduce%s; "
        "checkpoints hold copy 0 (%s) under single-device names",
        len(t.devices), t.all_reduce,
        " (--all_reduce=auto)" if all_reduce == "auto" else "",
        t.devices[0])


def log_packing(t: towers.Towers, pack_bytes: int) -> None:
  """Logs --pack_bytes and how many of the step's gradients it may pack.

  Those at most `pack_bytes` bytes; `towers.minimize` packs those among them
  that are reduced alike (one dtype, the same devices), two or more at a
  time.
  """
  if pack_bytes == 0:
    logging.info("--pack_bytes=0: packing off, each gradient is reduced on "
                 "its own")
    return
  if len(t.devices) == 1:
    logging.info("--pack_bytes=%d: one tower, whose gradients need no "
                 "reduction, so none is packed", pack_bytes)
    return
  grads = [g for g, _ in t.grads_and_vars or [] if g is not None]
  small = [g for g in grads
           if isinstance(g, tf.Tensor) and g.shape.is_fully_defined() and
           g.shape.num_elements() * g.dtype.size <= pack_bytes]
  logging.info(
      "--pack_bytes=%d: %d of the %d gradients are at most %d bytes; those "
      "reduced alike (one dtype, the same devices) share a pack, one "
      "transfer per tower instead of one per gradient (0 turns packing off)",
      pack_bytes, len(small), len(grads), pack_bytes)


def register_flag_checks(bounds: Mapping[str, Bounds],
                         directories: Optional[Mapping[str, str]] = None
                        ) -> None:
  """Has absl check the script's flags when it parses them.

  A flag out of its `bounds`, a directory flag `dir_problem` refuses (each
  of `directories` maps a flag to its kind, `WRITTEN` or `READ`), a
  --variable_device and --all_reduce combination `check_variable_flags`
  refuses, or a --precision a cluster cannot take (`check_precision`), then
  stops the script before anything is built, with one line naming the flag
  (``flag --batch_size=0: must be >= 1``). Only flags that are defined are
  checked: `bounds` may also hold `train` arguments that are not flags.
  """
  for name, b in bounds.items():
    if name in flags.FLAGS:
      flags.register_validator(
          name, lambda v, b=b: v is None or _in_bounds(v, b),
          message="must be %s" % _describe(b))
  for name, kind in (directories or {}).items():
    flags.register_validator(name, functools.partial(_check_dir_flag,
                                                     kind=kind))
  # One check per group, so that absl's line names only the flags at fault
  # (with the host lists where the script has them: they decide the rules).
  hosts = ("ps_hosts", "worker_hosts")
  if not all(n in flags.FLAGS for n in hosts):
    hosts = ()
  for names, check in (
      (("variable_device", "all_reduce") + hosts, _check_variable_flags),
      (("precision",) + hosts, _check_precision)):
    if all(n in flags.FLAGS for n in names):
      flags.register_multi_flags_validator(names, check)


def _check_dir_flag(path: Optional[str], kind: str) -> bool:
  problem = dir_problem(path, kind)
  if problem is not None:
    raise flags.ValidationError(problem)
  return True


def _check_variable_flags(values: Mapping[str, object]) -> bool:
  try:
    check_variable_flags(
        values["variable_device"], values.get("all_reduce", "auto"),
        bool(values.get("ps_hosts") or values.get("worker_hosts")),
        bool(values.get("worker_hosts") and not values.get("ps_hosts")))
  except FlagError as e:
    raise flags.ValidationError(str(e)) from None
  return True


def _check_precision(values: Mapping[str, object]) -> bool:
  try:
    check_precision(values["precision"],
                    bool(values.get("ps_hosts") or values.get("worker_hosts")),
                    bool(values.get("worker_hosts")
                         and not values.get("ps_hosts")))
  except FlagError as e:
    raise flags.ValidationError(str(e)) from None
  return True


def tower_setup(num_gpus: int, log_device_placement: bool = False
               ) -> Tuple[List[str], tf.ConfigProto]:
  """Returns the tower devices and the session config for `num_gpus` towers.

  GPUs when that many are visible; virtual CPU devices when none is, with
  one log line saying so. Checks that a session made with the config has
  every tower device (see `check_devices`).

  Raises:
    DeviceError: if some GPUs are visible but fewer than `num_gpus`, or the
      session lacks a tower device.
  """
  try:
    devices = towers.tower_devices(num_gpus)
  except ValueError as e:
    raise DeviceError("--num_gpus=%d: %s" % (num_gpus, e)) from None
  if devices[0].startswith("/gpu"):
    config = tf.ConfigProto(allow_soft_placement=True,
                            log_device_placement=log_device_placement)
  else:
    logging.info(
        "No GPU visible: running the %d tower(s) on virtual CPU devices %s "
        "(correct, but they share this machine's cores)", num_gpus,
        ", ".join(devices))
    config = towers.virtual_cpu_config(
        num_gpus, log_device_placement=log_device_placement)
  check_devices(devices, config)
  return devices, config


def check_devices(devices: Sequence[str], config: tf.ConfigProto) -> None:
  """Checks that a session made with `config` has each of `devices`.

  Without this, a missing tower device fails at the first step with
  TensorFlow's "Cannot assign a device", or, with soft placement, is
  silently replaced by another device.

  Raises:
    DeviceError: naming the missing devices, those the session has, and the
      fix.
  """
  with tf.Graph().as_default(), tf.Session(config=config) as sess:
    present = [tf.DeviceSpec.from_string(d.name) for d in sess.list_devices()]
  have = {(d.device_type.upper(), d.device_index) for d in present}
  missing = []
  for device in devices:
    spec = tf.DeviceSpec.from_string(device)
    if (spec.device_type.upper(), spec.device_index or 0) not in have:
      missing.append(device)
  if missing:
    raise DeviceError(
        "--num_gpus=%d needs the tower devices %s, which a session of this "
        "process lacks (it has %s): use fewer --num_gpus, or make the "
        "session's config with towers.virtual_cpu_config(%d) to run the "
        "towers on virtual CPU devices"
        % (len(devices), ", ".join(missing),
           ", ".join("/%s:%d" % (d.device_type.lower(), d.device_index)
                     for d in present), len(devices)))


def log_batch(num_towers: int, batch_size: int, max_steps: int,
              examples_per_epoch: int, replicas: int = 1,
              accumulate_steps: int = 1) -> None:
  """Logs the global batch and how many epochs `max_steps` steps are."""
  per_step = replicas * num_towers * batch_size * accumulate_steps
  workers = "%d workers x " % replicas if replicas > 1 else ""
  micro = " x %d micro-batches" % accumulate_steps \
      if accumulate_steps > 1 else ""
  logging.info("%s%d towers x %d examples%s = %d examples per step; "
               "--max_steps=%d is %.1f epochs of %d examples", workers,
               num_towers, batch_size, micro, per_step, max_steps,
               max_steps * per_step / examples_per_epoch, examples_per_epoch)


def training_summaries(t: towers.Towers, learning_rate: tf.Tensor,
                       accumulate_steps: int = 1) -> tf.Tensor:
  """Merges the final tower's summaries, the learning rate and histograms.

  Histograms are of each variable and of its averaged gradient (what
  `towers.minimize` applied), tagged with the variable's name. With a loss
  scale (`towers.Towers.loss_scale`) there is a ``loss_scale`` scalar too,
  and a gradient's histogram holds its finite values only: a step whose
  gradients overflow is skipped, not an error, and a histogram of an
  infinity would fail the step. With `accumulate_steps` > 1 the averaged
  gradients exist only in a run that applies them: their histograms are
  written by those runs (``towers.Towers.applies``). Run by the session's
  summary hook in the same `sess.run` as the training step, so no extra
  input batch is consumed.
  """
  # Explicit tags: tf.summary.* derive the tag from a uniquified op name, so
  # a tag equal to an existing op's name ("conv1/weights") would become
  # "conv1/weights_1".
  with tf.name_scope("training_summaries"):
    summaries = list(t.summaries)
    summaries.append(_scalar("learning_rate", learning_rate))
    summaries.append(_scalar("loss", t.loss))
    if t.loss_scale is not None:
      summaries.append(_scalar("loss_scale", t.loss_scale))
    gradients = []
    for grad, var in t.grads_and_vars or []:
      summaries.append(_histogram(var.op.name, var))
      if grad is not None:
        values = grad.values if isinstance(grad, tf.IndexedSlices) else grad
        if t.loss_scale is not None:
          values = tf.boolean_mask(values, tf.is_finite(values))
        gradients.append((var.op.name + "/gradients", values))

    def gradient_histograms() -> List[tf.Tensor]:
      return [_histogram(tag, values) for tag, values in gradients]

    if accumulate_steps == 1 or not gradients:
      summaries.extend(gradient_histograms())
    else:
      # An empty Summary where the run does not apply.
      summaries.append(tf.cond(
          t.applies, lambda: tf.summary.merge(gradient_histograms()),
          lambda: tf.constant(b"")))
    return tf.summary.merge(summaries)


def _scalar(tag: str, value: tf.Tensor) -> tf.Tensor:
  return tf.raw_ops.ScalarSummary(tags=tag, values=value)


def _histogram(tag: str, values) -> tf.Tensor:
  return tf.raw_ops.HistogramSummary(tag=tag, values=values)


class StepLogger(tf.train.SessionRunHook):
  """Logs the original's line every `every` steps and stops on a NaN loss.

  ``step %d, loss = %.2f (%.1f examples/sec; %.3f sec/batch)``, where
  examples/sec counts the global batch and sec/batch is the step time
  divided by the number of towers, as in the tutorial. With a `loss_scale`
  the line ends with ``, loss scale = %g``, the scale the step used. With
  `applies` (``towers.Towers.applies``, for accumulated micro-batches) a
  step is a run that applies an update, and the loss logged is that run's
  micro-batch's.
  """

  def __init__(self, loss: tf.Tensor, global_step: tf.Tensor,
               examples_per_step: int, num_towers: int, every: int = 10,
               count_locally: bool = True,
               loss_scale: Optional[tf.Tensor] = None,
               applies: Optional[tf.Tensor] = None):
    self._applies = applies
    self._loss = loss
    self._loss_scale = loss_scale
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
    fetches = {"loss": self._loss, "global_step": self._global_step}
    if self._applies is not None:
      fetches["applies"] = self._applies
    if self._loss_scale is not None:
      fetches["loss_scale"] = self._loss_scale
    return tf.train.SessionRunArgs(fetches)

  def after_run(self, run_context, run_values):
    loss, global_step = (run_values.results[k]
                         for k in ("loss", "global_step"))
    applied = run_values.results.get("applies", True)
    loss_scale = run_values.results.get("loss_scale")
    loss = float(loss)
    if math.isnan(loss):
      raise FloatingPointError(
          "loss is NaN at step %d: training stopped, nothing saved from this "
          "step (lower the learning rate, or check the input); the last "
          "checkpoint is kept" % (self._step + 1))
    if not applied:
      return
    # Alone, a process counts its own steps (the global step it fetched may
    # be read before or after this step's increment). In a cluster other
    # workers advance the global step too, so that is the count to show.
    self._runs += 1
    self._step = self._step + 1 if self._count_locally else int(global_step)
    if self._runs % self._every == 0:
      duration = (time.time() - self._start) / self._every
      self._start = time.time()
      logging.info("step %d, loss = %.2f (%.1f examples/sec; %.3f sec/batch)%s",
                   self._step, loss, self._examples_per_step / duration,
                   duration / self._num_towers,
                   "" if loss_scale is None else
                   ", loss scale = %g" % loss_scale)


class Interrupted(Exception):
  """Training stopped on SIGTERM or SIGINT, after the chief saved a checkpoint.

  Attributes:
    signum: the signal's number; a script exits with ``128 + signum``.
    step: the global step reached (and saved, by the chief).
  """

  def __init__(self, signum: int, step: int):
    super().__init__("%s at step %d" % (signal.Signals(signum).name, step))
    self.signum = signum
    self.step = step


class StopOnSignals:
  """Turns the first SIGTERM or SIGINT into a request to stop; a context.

  Within the context the first of these signals only sets `received`: the
  training loop checks it after each step, so the session ends cleanly and
  the final checkpoint is saved. A second signal kills the process at once
  (the signal's default action). Handlers can only be installed in the main
  thread: elsewhere this does nothing. The previous handlers are restored on
  exit.
  """

  SIGNALS = (signal.SIGTERM, signal.SIGINT)

  def __init__(self):
    self.received = None  # The first signal's number.
    self._previous = {}

  def __enter__(self):
    if threading.current_thread() is threading.main_thread():
      for signum in self.SIGNALS:
        self._previous[signum] = signal.signal(signum, self._handle)
    return self

  def __exit__(self, *exc):
    for signum, handler in self._previous.items():
      # None: a handler not set from Python, which cannot be put back.
      signal.signal(signum, signal.SIG_DFL if handler is None else handler)
    self._previous.clear()

  def _handle(self, signum, frame):
    del frame
    # No logging here: the handler may interrupt a thread holding logging's
    # lock. The training loop logs once it has stopped.
    if self.received is None:
      self.received = signum
      return
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)


def run_training(train_op: tf.Operation, loss: tf.Tensor,
                 global_step: tf.Tensor, summary_op: Optional[tf.Tensor], *,
                 train_dir: str, max_steps: int, examples_per_step: int,
                 num_towers: int, config: tf.ConfigProto,
                 log_every: int = 10, save_checkpoint_secs: int = 60,
                 save_checkpoint_steps: Optional[int] = None,
                 save_summaries_steps: int = 100, master: str = "",
                 is_chief: bool = True, stop_grace_period_secs: float = 120,
                 loss_scale: Optional[tf.Tensor] = None,
                 applies: Optional[tf.Tensor] = None,
                 hooks: Iterable[tf.train.SessionRunHook] = (),
                 chief_only_hooks: Iterable[tf.train.SessionRunHook] = (),
                 local_init_op: Optional[tf.Operation] = None,
                 recover: bool = True, watchdog=None,
                 save_when_stuck: bool = False) -> int:
  """Trains until the global step reaches `max_steps`; returns that step.

  Resumes from the latest checkpoint in `train_dir` (the global step goes
  on), saves one every `save_checkpoint_secs` and at the end, and writes
  `summary_op` every `save_summaries_steps`. `save_checkpoint_steps`, when
  given, replaces the time-based schedule. The ``checkpoint`` state file
  names checkpoints relative to `train_dir`, so a copied directory resumes
  from its own. Nothing is ever deleted but the checkpoints the Saver
  rotates out (it keeps the latest 5). `loss_scale`, when given (the
  towers' `loss_scale`), is logged with each step line; `applies`, when
  given (the towers' `applies`, with accumulated micro-batches), makes the
  logger count and time applied updates.

  SIGTERM or SIGINT (in the main thread) ends training after the current
  step: the chief saves a checkpoint, one line is logged, and `Interrupted`
  is raised. A second signal kills at once. Call `traindir.prepare` first.

  In a cluster: `local_init_op` replaces the scaffold's default (collective
  mode's broadcast from the chief). With `recover` (parameter servers) the
  session is recreated after a task it needs was lost
  (``MonitoredTrainingSession``); without it (collective mode: the
  collectives of a lost peer cannot be replayed) the error is raised, and
  every worker creates its session as a chief would, only `is_chief`
  restoring, saving and writing summaries. `watchdog` (a
  `watchdog.Watchdog`) watches session creation and every step, and after a
  signal gives up a step that does not end (with `save_when_stuck`, the
  chief saving from beside it first).

  Raises:
    Interrupted: after a SIGTERM or SIGINT.
    FloatingPointError: if the loss becomes NaN.
  """
  saver = tf.train.Saver(save_relative_paths=True, sharded=True,
                         allow_empty=True)
  scaffold = tf.train.Scaffold(summary_op=summary_op, saver=saver,
                               local_init_op=local_init_op)
  logger = StepLogger(loss, global_step, examples_per_step, num_towers,
                      log_every, count_locally=not master or not recover,
                      loss_scale=loss_scale, applies=applies)
  all_hooks = [tf.train.StopAtStepHook(last_step=max_steps), logger]
  all_hooks += list(hooks) + ([watchdog] if watchdog is not None else [])
  with StopOnSignals() as signals:
    if watchdog is not None:
      def save():
        return saver.save(watchdog.session,
                          os.path.join(train_dir, traindir.CHECKPOINT_BASENAME),
                          global_step=global_step, write_meta_graph=False)

      watchdog.start(lambda: signals.received,
                     save=save if is_chief and save_when_stuck else None)
    try:
      with _training_session(
          recover, master=master, is_chief=is_chief, train_dir=train_dir,
          scaffold=scaffold, hooks=all_hooks,
          chief_only_hooks=list(chief_only_hooks), config=config,
          save_checkpoint_secs=None if save_checkpoint_steps else
          save_checkpoint_secs,
          save_checkpoint_steps=save_checkpoint_steps,
          save_summaries_steps=save_summaries_steps if summary_op is not None
          else None,
          stop_grace_period_secs=stop_grace_period_secs) as sess:
        while not sess.should_stop() and signals.received is None:
          sess.run(train_op)
        if watchdog is not None:
          watchdog.closing()
    finally:
      if watchdog is not None:
        watchdog.stop()
    # The session has closed: the chief's final checkpoint is saved. Its
    # hooks' event writer is cached for the process and flushed only every
    # 2 minutes: flush it, so the directory is complete on return.
    if is_chief:
      tf.summary.FileWriterCache.get(train_dir).flush()
  if signals.received is not None and logger.step < max_steps:
    step = logger.step
    if is_chief:
      # The step saved: in a cluster the logger's count may lag it by one.
      saved = tf.train.latest_checkpoint(train_dir)
      step = int(saved.rsplit("-", 1)[1]) if saved else step
    logging.info("Received %s at step %d: %s, stopping",
                 signal.Signals(signals.received).name, step,
                 "saved a checkpoint" if is_chief else
                 "the chief saves the checkpoints")
    raise Interrupted(signals.received, step)
  return logger.step


def _training_session(recover: bool, *, master: str, is_chief: bool,
                      train_dir: str, scaffold: tf.train.Scaffold, hooks,
                      chief_only_hooks, config: tf.ConfigProto,
                      save_checkpoint_secs: Optional[int],
                      save_checkpoint_steps: Optional[int],
                      save_summaries_steps: Optional[int],
                      stop_grace_period_secs: float):
  """A ``MonitoredTrainingSession``, or, without `recover`, its equal.

  Without `recover`: a ``SingularMonitoredSession`` (which raises what a
  step raises instead of recreating the session) created as a chief's, with
  the hooks ``MonitoredTrainingSession`` gives a chief, when `is_chief`:
  the checkpoint saver and the summary writer.
  """
  if recover:
    return tf.train.MonitoredTrainingSession(
        master=master, is_chief=is_chief, checkpoint_dir=train_dir,
        scaffold=scaffold, hooks=hooks, chief_only_hooks=chief_only_hooks,
        config=config, save_checkpoint_secs=save_checkpoint_secs,
        save_checkpoint_steps=save_checkpoint_steps,
        save_summaries_steps=save_summaries_steps, log_step_count_steps=0,
        stop_grace_period_secs=stop_grace_period_secs)
  hooks = list(hooks)
  if is_chief:
    hooks += chief_only_hooks
    if save_summaries_steps:
      hooks.append(tf.train.SummarySaverHook(
          save_steps=save_summaries_steps, output_dir=train_dir,
          scaffold=scaffold))
    hooks.append(tf.train.CheckpointSaverHook(
        train_dir, save_secs=save_checkpoint_secs,
        save_steps=save_checkpoint_steps, scaffold=scaffold))
  return tf.train.SingularMonitoredSession(
      hooks=hooks, scaffold=scaffold, master=master, config=config,
      checkpoint_dir=train_dir if is_chief else None,
      stop_grace_period_secs=stop_grace_period_secs)


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

  An `expected` failure (missing data, a corrupt file, a NaN loss, a bad
  flag, a training directory refused...) is logged as its one-line message
  and gives 1, not a traceback. Training stopped by a signal gives 128 + the
  signal's number (143 for SIGTERM, 130 for SIGINT), as a shell reports a
  process the signal killed. TensorFlow's own log lines are printed once,
  in absl's format (`log_tensorflow_through_absl`).
  """
  if len(argv) > 1:
    raise app.UsageError("unexpected arguments: %s" % " ".join(argv[1:]))
  log_tensorflow_through_absl()
  try:
    call()
  except Interrupted as e:
    return 128 + e.signum
  except expected as e:
    logging.error("%s", e)
    return 1
  return 0


def log_tensorflow_through_absl() -> None:
  """Has TensorFlow's Python log lines printed once, by absl's handler.

  TensorFlow gives its logger a handler of its own (``INFO:tensorflow:...``
  on stderr) when the logger is first used while the root logger has none:
  at import, before ``app.run`` gives the root logger absl's. Its records
  also reach absl's handler, so every line came out twice, in two formats.
  This removes TensorFlow's handler once absl's is in place (in a script,
  after ``app.run``); elsewhere it does nothing.
  """
  if logging.get_absl_handler() not in std_logging.getLogger().handlers:
    return  # No absl handler to print TensorFlow's lines instead.
  logger = tf.get_logger()
  for handler in list(logger.handlers):
    logger.removeHandler(handler)


def without_autotune(dataset: tf.data.Dataset) -> tf.data.Dataset:
  """Returns `dataset` with tf.data's autotuning model off.

  The model's thread sleeps between its rounds, longer each time (up to 60
  s once a pipeline has run for a minute or two), and a session closing
  waits for it to wake up (TensorFlow 2.21: the iterator's destructor joins
  it), so a finished run could sit silent for up to a minute after its
  final checkpoint. Without the model there is no such thread; ``AUTOTUNE``
  prefetch buffers are still sized by prefetch's own autotuner, and an
  ``AUTOTUNE`` map runs as many calls at once as the machine has cores (at
  most 16), the model's starting point.
  """
  options = tf.data.Options()
  options.autotune.enabled = False
  return dataset.with_options(options)


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
  directory = os.path.dirname(path) or "."
  try:
    created = make_dirs(directory)
  except OSError as e:
    raise DownloadError("could not download %s: %s cannot be created (%s)"
                        % (os.path.basename(path), directory,
                           e.strerror or e)) from None
  part = path + ".part"
  errors = []
  try:
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
      created = []  # Success: the directories stay.
      return path
  finally:
    if os.path.exists(part):
      os.remove(part)  # A download that failed or was interrupted.
    remove_empty_dirs(created)
  raise DownloadError("could not download %s (%s)"
                      % (os.path.basename(path), "; ".join(errors)))


def make_dirs(path: str) -> List[str]:
  """Creates `path` and its missing parents; returns those it created.

  Deepest last, for `remove_empty_dirs` to undo on failure.
  """
  missing = []
  head = os.path.abspath(path)
  while not os.path.exists(head):
    missing.append(head)
    head = os.path.dirname(head)
  os.makedirs(path, exist_ok=True)
  return missing[::-1]


def remove_empty_dirs(created: Sequence[str]) -> None:
  """Removes the directories `make_dirs` created, deepest first, if empty.

  Only those, and only when empty (``os.rmdir`` refuses a directory with
  anything in it): a failure leaves nothing of its own behind, and never
  removes anything of the user's.
  """
  for directory in reversed(created):
    try:
      os.rmdir(directory)
    except OSError:
      return  # Not empty (nor then its parents), or already gone.


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
