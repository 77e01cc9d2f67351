"""The training directory, locked and checked before a session resumes from it.

A trainer must never lose or overwrite work it cannot see: a second trainer
in the same directory, a missing or unreadable checkpoint state file, a state
file naming another directory's checkpoints (a copied directory), a corrupt
latest checkpoint and the scratch folders of an interrupted save.
"""

import fcntl
import os
import re
import shlex
import shutil
from typing import List, Optional, Sequence, Tuple

import tensorflow.compat.v1 as tf

CHECKPOINT_BASENAME = "model.ckpt"  # MonitoredTrainingSession's prefix.
STATE_FILE = "checkpoint"  # The Saver's list of checkpoints.
LOCK_FILE = "train.lock"
_CHECKPOINT_FILE = re.compile(r"^model\.ckpt-(\d+)\.(index|data-.*|meta)$")
_TEMP_DIR = re.compile(r"^model\.ckpt-\d+_temp$")


class TrainDirError(RuntimeError):
  """The training directory cannot be trained in as it is; says what to do."""


class TrainDir:
  """Locks and checks a training directory; a context manager.

  Entering, the chief (a trainer alone is one) creates `path`, takes an
  exclusive lock (``train.lock``, holding its pid; the operating system drops
  it when the process ends, however it ends), removes the
  ``model.ckpt-<N>_temp/`` folders of an interrupted save, and checks what a
  session would restore: checkpoints without a readable ``checkpoint`` state
  file, a state file naming another directory's checkpoints, and a corrupt
  latest checkpoint are refused, naming the newest intact checkpoint and the
  one-line command that resumes from it. Another worker only reads the
  latest checkpoint's step. Leaving releases the lock.

  Use `scaffold` (or `saver`) for the session, so that the state file names
  checkpoints relative to `path` and a copied directory resumes from its own.

  Args:
    path: the training directory (``checkpoint_dir`` of the session).
    is_chief: whether this process writes `path`.
    name: how messages name the directory, e.g. the flag that set it.

  Attributes:
    global_step, checkpoint: the latest checkpoint's step and path, once
      entered; None without one.

  Raises:
    TrainDirError: on entering, for another trainer holding the lock, a
      directory that cannot be written, or checkpoints it cannot resume from.
  """

  def __init__(self, path: str, *, is_chief: bool = True,
               name: str = "train_dir"):
    self.path = path
    self.is_chief = is_chief
    self.name = name
    self.global_step: Optional[int] = None
    self.checkpoint: Optional[str] = None
    self._lock = None

  def __enter__(self) -> "TrainDir":
    if not self.is_chief:
      self.global_step = latest_step(self.path)
      return self
    try:
      os.makedirs(self.path, exist_ok=True)
      self._lock = _lock(self.path, self.name)
    except OSError as e:
      # What a flag's checks cannot see: a read-only file system, a path
      # changed since, a file system that refuses the lock.
      raise TrainDirError(
          "%s=%s cannot be created or written (%s: %s): point it at a "
          "directory you can write to"
          % (self.name, self.path, e.strerror or type(e).__name__,
             e.filename or self.path)) from None
    try:
      _remove_temp_dirs(self.path)
      self.checkpoint, self.global_step = _latest_intact_checkpoint(
          self.path, self.name)
    except BaseException:
      self.__exit__()
      raise
    return self

  def __exit__(self, *exc) -> None:
    if self._lock is not None:
      fcntl.flock(self._lock, fcntl.LOCK_UN)
      self._lock.close()
      self._lock = None

  def finished(self, max_steps: int) -> bool:
    """Whether the latest checkpoint is at `max_steps` or beyond; logs so.

    A job run again after it finished then trains no step and saves nothing
    (a session's saver would otherwise train and save one step more).
    """
    done = self.global_step or 0
    if done < max_steps:
      return False
    tf.logging.info("Nothing to train: %s is at global step %d and "
                    "max_steps is %d (raise it to train on)",
                    self.checkpoint or "%s=%s" % (self.name, self.path), done,
                    max_steps)
    return True

  def check_restores(self, variables: Optional[Sequence[tf.Variable]] = None
                    ) -> None:
    """Checks that the checkpoint to resume from holds each of `variables`.

    Call it once the graph is built (default: ``tf.global_variables()``). A
    run resumed with other settings may need a variable the checkpoint lacks
    (the loss scale of float16 training), and the session would fail in the
    middle of restoring. Variables the checkpoint holds beyond the graph are
    no error.

    Raises:
      TrainDirError: naming the checkpoint, the variables it lacks and the
        fix.
    """
    if self.checkpoint is None:
      return
    if variables is None:
      variables = tf.global_variables()
    held = {name for name, _ in tf.train.list_variables(self.checkpoint)}
    missing = [v.op.name for v in variables if v.op.name not in held]
    if missing:
      raise TrainDirError(
          "the latest checkpoint %s lacks %s, which this run would restore: "
          "it was written by a run with other settings (float16 training "
          "adds a loss scale, for one); resume with the settings it was "
          "trained with, or train in another %s"
          % (self.checkpoint, ", ".join(missing), self.name))

  @staticmethod
  def saver(**saver_kwargs) -> tf.train.Saver:
    """A sharded ``tf.train.Saver`` whose state file holds relative paths."""
    saver_kwargs.setdefault("save_relative_paths", True)
    saver_kwargs.setdefault("sharded", True)
    saver_kwargs.setdefault("allow_empty", True)
    return tf.train.Saver(**saver_kwargs)

  def scaffold(self, **scaffold_kwargs) -> tf.train.Scaffold:
    """A ``tf.train.Scaffold`` with `saver` (other arguments passed on)."""
    scaffold_kwargs.setdefault("saver", self.saver())
    return tf.train.Scaffold(**scaffold_kwargs)


def _lock(train_dir: str, name: str):
  """Opens and locks ``train.lock`` (``fcntl.flock``); returns the file.

  The file stays after the lock is released: removing it would let two
  processes lock two different files of that name.
  """
  path = os.path.join(train_dir, LOCK_FILE)
  # "a+": opening must not erase the holder's pid before the lock is ours.
  f = open(path, "a+")  # pylint: disable=consider-using-with
  try:
    fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
  except BlockingIOError:  # EWOULDBLOCK: another process holds it.
    f.seek(0)
    holder = f.read().strip() or "unknown"
    f.close()
    raise TrainDirError(
        "%s=%s is in use by another trainer (pid %s holds %s): two trainers "
        "in one directory overwrite each other's checkpoints and event "
        "files; stop that one, or give this one another %s"
        % (name, train_dir, holder, path, name)) from None
  except OSError:  # A file system that refuses locks: TrainDir says so.
    f.close()
    raise
  f.seek(0)
  f.truncate()
  f.write("%d\n" % os.getpid())
  f.flush()
  return f


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
      tf.logging.info("Removed %s, left by a checkpoint save that was "
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


def _resume_advice(train_dir: str, intact: Optional[str], name: str) -> str:
  if intact is None:
    return ("no earlier checkpoint there is intact: start over with another "
            + name)
  state = os.path.join(train_dir, STATE_FILE)
  line = 'model_checkpoint_path: "%s"' % os.path.basename(intact)
  return ("to resume from the newest intact checkpoint, %s, run: echo %s > %s"
          " ; or start over with another %s"
          % (os.path.basename(intact), shlex.quote(line), shlex.quote(state),
             name))


def _latest_intact_checkpoint(train_dir: str, name: str
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
        "%s=%s holds checkpoints (model.ckpt-%d the newest) but its state "
        "file %s %s, so training would start again at step 0 and overwrite "
        "them; %s" % (name, train_dir, on_disk[0], state_path, problem,
                      _resume_advice(train_dir, _newest_intact(train_dir)[0],
                                     name)))
  here = os.path.realpath(train_dir)
  paths = [state.model_checkpoint_path] + list(
      state.all_model_checkpoint_paths)
  elsewhere = [p for p in paths
               if os.path.dirname(os.path.realpath(p)) != here]
  if elsewhere:
    raise TrainDirError(
        "the state file %s names checkpoints in another directory (%s): it "
        "was written with absolute paths (by an older trainer) and the "
        "directory was copied or moved; resuming would read, and "
        "later delete, that directory's checkpoints. In this directory, %s"
        % (state_path, elsewhere[0],
           _resume_advice(train_dir, _newest_intact(train_dir)[0], name)))
  latest = state.model_checkpoint_path
  damage, found = _verify(latest)
  if damage is not None:
    try:
      below = int(latest.rsplit("-", 1)[1])
    except ValueError:
      below = None
    raise TrainDirError(
        "the latest checkpoint %s is corrupt or incomplete (%s); %s"
        % (latest, damage,
           _resume_advice(train_dir, _newest_intact(train_dir, below)[0],
                          name)))
  return latest, found
