"""What the MNIST and CIFAR-10 examples share, beside `towers.training`.

Flags and their checks (bounds, directories, the cluster flags), the
towers' log lines, devices (GPUs, or virtual CPUs with one log line saying
so), the evaluation schedule, a script's exit codes, each TensorFlow log
line once, input pipelines whose session closes at once, and cached,
hash-checked downloads.
"""

import contextlib
import functools
import hashlib
import inspect
import logging as std_logging
import os
import time
import urllib.request
from typing import (Callable, List, Mapping, Optional, Sequence,
                    Tuple)

from absl import app
from absl import flags
from absl import logging
import tensorflow.compat.v1 as tf

import towers
from towers import training


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


# --pack_bytes' default: towers.minimize's, written out because the examples
# use the library's public API only (a test checks that the two agree).
DEFAULT_PACK_BYTES = 16384
PRECISIONS = ("float32", "float16", "bfloat16")


def define_towers_flags(precision: bool = True) -> None:
  """Defines the flags passed to `towers.minimize` (--precision optional)."""
  flags.DEFINE_enum("variable_device", "cpu",
                    ["cpu", "gpu", "balanced", "replicated"],
                    "Where the variables live: one copy on the CPU (the "
                    "original's), on the first tower's device, balanced over "
                    "the towers; or a copy on every tower (replicated).")
  flags.DEFINE_enum("all_reduce", "auto",
                    ["auto", "add_n", "ring", "collective"],
                    "With --variable_device=replicated, how the copies' "
                    "gradients are summed (auto: collective between GPUs, "
                    "else add_n).")
  flags.DEFINE_integer("pack_bytes", DEFAULT_PACK_BYTES, "Gradients of at "
                       "most this many bytes are reduced in packs (0: "
                       "off); the results are the same.")
  if precision:
    flags.DEFINE_enum("precision", "float32", list(PRECISIONS),
                      "The dtype the towers compute in, on float32 master "
                      "weights; float16 adds dynamic loss scaling.")
  flags.DEFINE_boolean("xla", False, "Compile each tower's model and "
                       "gradient with XLA (the same results within "
                       "rounding).")
  flags.DEFINE_boolean("stage_inputs", False, "Read each tower's next "
                       "batch ahead and stage it on its device.")


def define_cluster_flags() -> None:
  """Defines the classic TF1 cluster flags, and the bounds of their waits."""
  flags.DEFINE_list("ps_hosts", [], "Parameter servers' host:port list, the "
                    "same on every task; empty: this machine alone, or, "
                    "with --worker_hosts, collective mode.")
  flags.DEFINE_list("worker_hosts", [], "Workers' host:port list, the same "
                    "on every task; the first is the chief.")
  flags.DEFINE_enum("job_name", "worker", ["ps", "worker"], "This task's "
                    "job.")
  flags.DEFINE_integer("task_index", 0, "This task's index in its job's "
                       "list.")
  flags.DEFINE_integer("replicas_to_aggregate", None, "Workers' gradients "
                       "per step (default all; fewer makes backup workers).")
  flags.DEFINE_float("startup_timeout_secs", 60, "Seconds a worker waits "
                     "for the other tasks and the chief.")
  flags.DEFINE_float("step_timeout_secs", 300, "A session op waiting longer "
                     "for another task fails; a worker with no step for 15 s "
                     "more stops, saying why and how to resume.")
  flags.DEFINE_float("stall_log_secs", 30, "A step waiting longer logs what "
                     "it waits for, then at least once a minute.")


def check_cluster_flags(ps_hosts: Sequence[str], worker_hosts: Sequence[str],
                        variable_device: str, all_reduce: str,
                        precision: str,
                        replicas_to_aggregate: Optional[int]) -> int:
  """Checks the flags a cluster changes; returns the replicas per step.

  Checked before the task's server starts, so that a wrong flag is an error
  at once rather than after the wait for the other tasks.

  Raises:
    FlagError: naming the flags and the fix.
  """
  collective = not ps_hosts
  replicas = replicas_to_aggregate or len(worker_hosts)
  if collective and (variable_device not in ("cpu", "replicated") or
                     all_reduce not in ("auto", "collective")):
    raise FlagError(
        "--variable_device=%s --all_reduce=%s: a cluster without --ps_hosts "
        "(collective mode) keeps a copy of the variables on every tower of "
        "every worker, all-reduced with collective ops: drop both flags, or "
        "give --ps_hosts" % (variable_device, all_reduce))
  if not collective and variable_device != "cpu":
    raise FlagError(
        "--variable_device=%s applies to training on one machine: with "
        "--ps_hosts the variables live on the parameter servers, one copy "
        "updated through SyncReplicasOptimizer; drop --variable_device"
        % variable_device)
  if precision == "float16":
    raise FlagError(
        "--precision=float16 needs loss scaling, which skips the steps whose "
        "gradients overflow, %s: use --precision=bfloat16 (float32's range, "
        "no loss scaling)" % (
            "and that skip is not tested across the workers of collective "
            "mode" if collective else "but with --ps_hosts "
            "SyncReplicasOptimizer needs every worker's gradients at every "
            "step"))
  if not worker_hosts:
    return 1  # start_task says what is missing.
  if collective and replicas != len(worker_hosts):
    raise FlagError(
        "--replicas_to_aggregate=%d but collective mode (no --ps_hosts) has "
        "no backup workers: drop --replicas_to_aggregate, or give --ps_hosts"
        % replicas)
  if not 1 <= replicas <= len(worker_hosts):
    raise FlagError(
        "--replicas_to_aggregate=%d but --worker_hosts lists %d workers; it "
        "must be between 1 and the number of workers"
        % (replicas, len(worker_hosts)))
  return replicas


def register_flag_checks(bounds: Mapping[str, Bounds],
                         directories: Optional[Mapping[str, str]] = None
                        ) -> None:
  """Has absl check the flags' bounds and directories when it parses them.

  A flag out of its `bounds`, or a directory flag `dir_problem` refuses
  (`directories` maps a flag to `WRITTEN` or `READ`), stops the script
  before anything is built, in one line naming the flag. Only defined flags
  are checked: `bounds` may hold `train` arguments that are not flags.
  """
  for name, b in bounds.items():
    if name in flags.FLAGS:
      flags.register_validator(
          name, lambda v, b=b: v is None or _in_bounds(v, b),
          message="must be %s" % _describe(b))
  for name, kind in (directories or {}).items():
    flags.register_validator(name, functools.partial(_check_dir_flag,
                                                     kind=kind))
  cluster = ("ps_hosts", "worker_hosts", "variable_device", "all_reduce",
             "precision", "replicas_to_aggregate")
  if all(name in flags.FLAGS for name in cluster):
    flags.register_multi_flags_validator(cluster, _check_cluster_flags)


def _check_cluster_flags(values: Mapping[str, object]) -> bool:
  if values["ps_hosts"] or values["worker_hosts"]:
    try:
      check_cluster_flags(**values)
    except FlagError as e:
      raise flags.ValidationError(str(e)) from None
  return True


def _check_dir_flag(path: Optional[str], kind: str) -> bool:
  problem = dir_problem(path, kind)
  if problem is not None:
    raise flags.ValidationError(problem)
  return True


def flag_values(function: Callable) -> dict:
  """The parsed flags named like `function`'s parameters, by name."""
  return {name: flags.FLAGS[name].value
          for name in inspect.signature(function).parameters
          if name in flags.FLAGS}


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


def log_towers(t: towers.Towers, *, variable_device, all_reduce: str,
               pack_bytes: int, precision: str, xla: bool, stage_inputs: bool,
               precision_flag: Optional[str] = None) -> None:
  """Logs the towers' variables (`variable_device` a mode name), packing and
  fast paths."""
  if isinstance(variable_device, str):
    log_variables(t, variable_device, all_reduce)
  log_packing(t, pack_bytes)
  log_fast_paths(t, precision, xla, stage_inputs, precision_flag)


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
  except training.Interrupted as e:
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
  if hasattr(options, "autotune"):
    options.autotune.enabled = False
  else:  # TensorFlow 1.15 keeps the switch with the graph optimizations.
    options.experimental_optimization.autotune = False
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
