"""The training directory: locked, checked and cleaned before training.

A trainer must never lose or overwrite work it cannot see: a second trainer
in the same directory, a missing or unreadable checkpoint state file, a state
file naming another directory's checkpoints (a copied directory), a corrupt
latest checkpoint and the scratch folders of an interrupted save are all
handled here, before a graph is built. Example code, not part of the
`towers` library.
"""

import collections
import fcntl
import os
import re
import shlex
import shutil
from typing import List, Optional, Sequence, Tuple

from absl import logging
import tensorflow.compat.v1 as tf

CHECKPOINT_BASENAME = "model.ckpt"  # MonitoredTrainingSession's prefix.
STATE_FILE = "checkpoint"  # The Saver's list of checkpoints.
LOCK_FILE = "train.lock"
_CHECKPOINT_FILE = re.compile(r"^model\.ckpt-(\d+)\.(index|data-.*|meta)$")
_TEMP_DIR = re.compile(r"^model\.ckpt-\d+_temp$")


class TrainDirError(RuntimeError):
  """--train_dir cannot be trained in as it is; the message says what to do."""


TrainDir = collections.namedtuple("TrainDir",
                                  ["lock", "global_step", "checkpoint"])
TrainDir.__doc__ = """What `prepare` found, and its lock.

Fields:
  lock: a `TrainDirLock` (a context manager); release it when training ends.
  global_step: the latest checkpoint's global step; None without one.
  checkpoint: the latest checkpoint's path; None without one.
"""


class TrainDirLock:
  """An exclusive lock on a training directory, held until `release`.

  ``fcntl.flock`` on ``train.lock`` in the directory, which holds the
  holder's pid. The operating system drops the lock when its process ends,
  however it ends (SIGKILL included), so a lock left by a killed trainer
  never blocks the next one. The file itself stays (removing it would let
  two processes lock two different files of that name).
  """

  def __init__(self, train_dir: Optional[str]):
    self._file = None
    if train_dir is None:  # Nothing to lock (a non-chief worker).
      return
    path = os.path.join(train_dir, LOCK_FILE)
    # "a+": opening must not erase the holder's pid before the lock is ours.
    f = open(path, "a+")
    try:
      fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
      f.seek(0)
      holder = f.read().strip() or "unknown"
      f.close()
      raise TrainDirError(
          "--train_dir=%s is in use by another trainer (pid %s holds %s): "
          "two trainers in one directory overwrite each other's checkpoints "
          "and event files; stop that one, or give this one another "
          "--train_dir" % (train_dir, holder, path)) from None
    f.seek(0)
    f.truncate()
    f.write("%d\n" % os.getpid())
    f.flush()
    self._file = f

  def release(self) -> None:
    if self._file is not None:
      fcntl.flock(self._file, fcntl.LOCK_UN)
      self._file.close()
      self._file = None

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.release()


def prepare(train_dir: str, *, is_chief: bool = True) -> TrainDir:
  """Checks and locks the training directory before a graph is built.

  The chief (a trainer alone is one) creates the directory, locks it
  (`TrainDirLock`), removes the ``model.ckpt-<N>_temp/`` folders a save
  killed midway left behind, and checks what the next session would restore:

  - checkpoint files without a readable ``checkpoint`` state file would be
    ignored (training would start again at step 0 and overwrite them);
  - a state file naming checkpoints in another directory (written by an
    older version with absolute paths, in a copied or moved directory)
    would resume from, then delete, that directory's checkpoints;
  - a corrupt latest checkpoint (a missing or truncated file, a checksum
    that does not match: every tensor is read) would fail in the middle of
    restoring.

  Each is a `TrainDirError` naming the newest intact checkpoint and the
  one-line command that resumes from it, or saying to start over in another
  --train_dir. Another worker in a cluster only reads the latest
  checkpoint's global step, if it can: the chief alone writes the directory.

  Args:
    train_dir: the training directory.
    is_chief: whether this process writes `train_dir`.

  Returns:
    A `TrainDir` holding the lock; release it when training ends.

  Raises:
    TrainDirError: as above, if another trainer holds the lock, or if the
      directory cannot be created or written.
  """
  if not is_chief:
    return TrainDir(TrainDirLock(None), latest_step(train_dir), None)
  try:
    os.makedirs(train_dir, exist_ok=True)
    lock = TrainDirLock(train_dir)
  except OSError as e:
    # What the flag's checks cannot see: a read-only file system, a path
    # changed since, a file system that refuses the lock.
    raise TrainDirError(
        "--train_dir=%s cannot be created or written (%s: %s): point it at "
        "a directory you can write to"
        % (train_dir, e.strerror or type(e).__name__,
           e.filename or train_dir)) from None
  try:
    _remove_temp_dirs(train_dir)
    checkpoint, step = _latest_intact_checkpoint(train_dir)
  except BaseException:
    lock.release()
    raise
  return TrainDir(lock, step, checkpoint)


def finished(state: TrainDir, train_dir: str, max_steps: int) -> bool:
  """Whether training in `train_dir` already reached `max_steps`; says so.

  A job run again after it finished (or with ``--max_steps=0``) then trains
  no step and saves nothing: the session's saver would otherwise train and
  save one step more.
  """
  done = state.global_step or 0
  if done < max_steps:
    return False
  logging.info("Nothing to train: %s is at global step %d and --max_steps=%d "
               "(raise --max_steps to train on)",
               state.checkpoint or "--train_dir=" + train_dir, done, max_steps)
  return True


def check_restores(state: TrainDir, variables: Sequence[tf.Variable]) -> None:
  """Checks that the checkpoint to resume from holds each of `variables`.

  Call it once the graph is built, with the variables its session restores
  (``tf.global_variables()``). A run resumed with other flags than those
  its checkpoint was written with may need a variable the checkpoint lacks:
  the loss scale, for one, comes with float16 training (``--precision=
  float16``, ``--use_fp16``), so a float32 run's checkpoint lacks it. The
  session would fail in the middle of restoring, with a traceback. What
  the checkpoint holds beyond the graph is not restored, and is no error
  (a float16 run's checkpoint resumes in float32).

  Raises:
    TrainDirError: naming the checkpoint, the variables it lacks and the
      fix.
  """
  if state.checkpoint is None:
    return
  held = {name for name, _ in tf.train.list_variables(state.checkpoint)}
  missing = [v.op.name for v in variables if v.op.name not in held]
  if missing:
    raise TrainDirError(
        "the latest checkpoint %s lacks %s, which this run would restore: it "
        "was written by a run with other flags (the loss scale comes with "
        "float16 training, --precision=float16 or --use_fp16); resume with "
        "the flags it was trained with, or train in another --train_dir"
        % (state.checkpoint, ", ".join(missing)))


def latest_step(train_dir: str) -> Optional[int]:
  """The global step of `train_dir`'s latest checkpoint; None if there is
  none or it cannot be read."""
  try:
    path = tf.train.latest_checkpoint(train_dir)
    return None if path is None else int(
        tf.train.load_variable(path, "global_step"))
  except (tf.errors.OpError, ValueError, OSError):
    return None


def _remove_temp_dirs(train_dir: str) -> None:
  # Only the Saver's own scratch folders, by their exact name; it removes
  # them itself when a save completes.
  for name in sorted(os.listdir(train_dir)):
    path = os.path.join(train_dir, name)
    if (_TEMP_DIR.match(name) and os.path.isdir(path)
        and not os.path.islink(path)):
      shutil.rmtree(path)
      logging.info("Removed %s, left by a checkpoint save that was "
                   "interrupted", path)


def _steps_on_disk(train_dir: str) -> List[int]:
  """The global steps of the model.ckpt-<N> files, newest first."""
  steps = {int(m.group(1)) for m in map(_CHECKPOINT_FILE.match,
                                        os.listdir(train_dir)) if m}
  return sorted(steps, reverse=True)


def _verify(prefix: str) -> Tuple[Optional[str], Optional[int]]:
  """Reads every tensor of a checkpoint; returns (what is wrong, step)."""
  try:
    reader = tf.train.load_checkpoint(prefix)
    names = reader.get_variable_to_shape_map()
    for name in names:
      reader.get_tensor(name)  # Checks the tensor's checksum.
    step = int(reader.get_tensor("global_step")) if "global_step" in names \
        else int(prefix.rsplit("-", 1)[1])
  except Exception as e:  # pylint: disable=broad-except
    # The reader reports damage as OpErrors, but also as IndexError ("Read
    # less bytes than requested") and others: any failure means not intact.
    lines = str(getattr(e, "message", e)).strip().splitlines() or [
        type(e).__name__]
    return lines[0][:200], None
  return None, step


def _newest_intact(train_dir: str, below: Optional[int] = None
                  ) -> Tuple[Optional[str], Optional[int]]:
  for step in _steps_on_disk(train_dir):
    if below is None or step < below:
      prefix = os.path.join(train_dir, "%s-%d" % (CHECKPOINT_BASENAME, step))
      problem, global_step = _verify(prefix)
      if problem is None:
        return prefix, global_step
  return None, None


def _resume_advice(train_dir: str, intact: Optional[str]) -> str:
  if intact is None:
    return ("no earlier checkpoint there is intact: start over with another "
            "--train_dir")
  state = os.path.join(train_dir, STATE_FILE)
  line = 'model_checkpoint_path: "%s"' % os.path.basename(intact)
  return ("to resume from the newest intact checkpoint, %s, run: echo %s > %s"
          " ; or start over with another --train_dir"
          % (os.path.basename(intact), shlex.quote(line), shlex.quote(state)))


def _latest_intact_checkpoint(train_dir: str
                             ) -> Tuple[Optional[str], Optional[int]]:
  """Returns the checkpoint the session will restore and its global step."""
  on_disk = _steps_on_disk(train_dir)
  state_path = os.path.join(train_dir, STATE_FILE)
  if not os.path.exists(state_path) and not on_disk:
    return None, None  # A new run.
  try:
    state = tf.train.get_checkpoint_state(train_dir)
  except (ValueError, tf.errors.OpError):
    state = None
  if state is None:
    if not on_disk:
      return None, None  # An unreadable list of no checkpoint: nothing lost.
    problem = "is missing" if not os.path.exists(state_path) else (
        "cannot be read")
    raise TrainDirError(
        "--train_dir=%s holds checkpoints (model.ckpt-%d the newest) but its "
        "state file %s %s, so training would start again at step 0 and "
        "overwrite them; %s" % (train_dir, on_disk[0], state_path, problem,
                                _resume_advice(train_dir,
                                               _newest_intact(train_dir)[0])))
  here = os.path.realpath(train_dir)
  paths = [state.model_checkpoint_path] + list(
      state.all_model_checkpoint_paths)
  elsewhere = [p for p in paths
               if os.path.dirname(os.path.realpath(p)) != here]
  if elsewhere:
    raise TrainDirError(
        "the state file %s names checkpoints in another directory (%s): it "
        "was written with absolute paths by an older version of this script "
        "and the directory was copied or moved; resuming would read, and "
        "later delete, that directory's checkpoints. In this directory, %s"
        % (state_path, elsewhere[0],
           _resume_advice(train_dir, _newest_intact(train_dir)[0])))
  latest = state.model_checkpoint_path
  problem, step = _verify(latest)
  if problem is not None:
    try:
      below = int(latest.rsplit("-", 1)[1])
    except ValueError:
      below = None
    raise TrainDirError(
        "the latest checkpoint %s is corrupt or incomplete (%s); %s"
        % (latest, problem,
           _resume_advice(train_dir, _newest_intact(train_dir, below)[0])))
  return latest, step
