"""A worker that waits says what for, and never waits forever.

In a cluster a step can wait on other tasks: the parameter servers that hold
the variables, the other workers' gradients (``SyncReplicasOptimizer``'s
tokens), or, in collective mode, every worker's part of the all-reduce.
TensorFlow waits silently, and some waits have no end: a session created
against a dead parameter server blocks in ``CreateSession`` for as long as
the server is gone. `Watchdog` is a session hook whose thread watches the
time since the last step ended:

- after ``log_after_secs`` in one step (or in creating a session) it logs
  what the worker waits for, and which of its peers do not accept TCP
  connections now, again at least once a minute;
- after ``timeout_secs`` without a step it logs why it stops and what to do,
  and ends the process (exit code 1): a peer that has not come back by then
  is taken for dead;
- after SIGTERM or SIGINT (which the training loop handles after the current
  step) a step that does not end within ``grace_secs`` is given up: the
  chief first saves a checkpoint where `save` is given, then the process
  exits with 128 + the signal's number.

`explain` turns the error of a failed step (a ``DeadlineExceededError``
from the session's operation timeout, an ``UnavailableError`` from a peer
that went away: the `PEER_ERRORS`) into the same message, raised as
`PeerLost`. Any other error (a kernel's ``InvalidArgumentError``, say) is
the worker's own, not a peer's: it is raised as it is.
"""

import logging
import os
import re
import signal
import sys
import threading
import time
from typing import Callable, Optional, Sequence, Tuple

import tensorflow.compat.v1 as tf

from towers.training import _cluster
from towers.training import _traindir

# The exit code of a worker the watchdog stops: a script's usual code for an
# expected failure.
EXIT_STALLED = 1

# The errors a step gets from a peer that is gone or late (or from the
# collective that a failed peer aborted), not from its own graph.
PEER_ERRORS = (tf.errors.UnavailableError, tf.errors.DeadlineExceededError,
               tf.errors.AbortedError, tf.errors.CancelledError)


class PeerLost(RuntimeError):
  """A step or session failed or stalled on another task; says what to do."""


class Watchdog(tf.train.SessionRunHook):
  """Logs what a long step waits for, and ends a wait without bound.

  Create it before the training session and `start` it, so that creating
  the session is watched too; `stop` it once the session has closed.

  Args:
    global_step: the step counter, read to name the step in the messages.
    waiting_for: what a step of this worker waits for, in words
      (``'the collective all-reduce with workers 0-1'``).
    peers: ``(name, 'host:port')`` of the other tasks, checked for
      connections when a step is late.
    log_after_secs: a step (or session creation) running longer is logged,
      then again every ``min(60, log_after_secs)`` seconds.
    timeout_secs: with no step ending for this long the process exits;
      None waits forever (and logs).
    advice: returns the message's end: what was lost and how to resume.
  """

  def __init__(self, global_step: tf.Tensor, waiting_for: str,
               peers: Sequence[Tuple[str, str]], *,
               log_after_secs: float = 30.0,
               timeout_secs: Optional[float] = None,
               advice: Callable[[], str] = lambda: ""):
    self._global_step = global_step
    self._waiting_for = waiting_for
    self._peers = list(peers)
    self._log_after = log_after_secs
    self._log_every = min(60.0, log_after_secs)
    self._timeout = timeout_secs
    self._advice = advice
    self._lock = threading.Lock()
    self._step = None  # The global step of the last step that ended.
    self._since = time.time()  # When it ended (or the watch started).
    self._phase = "creating"  # Or "step", "between" (steps) or "closing".
    self._signalled: Callable[[], Optional[int]] = lambda: None
    self._grace = 10.0
    self._save: Optional[Callable[[], str]] = None
    self._stopping = threading.Event()
    self._thread: Optional[threading.Thread] = None
    self.session = None  # The raw session, once created (for `save`).

  def start(self, signalled: Callable[[], Optional[int]] = lambda: None,
            grace_secs: float = 10.0,
            save: Optional[Callable[[], str]] = None) -> None:
    """Starts the watching thread.

    Args:
      signalled: returns the number of a stop signal received, else None.
      grace_secs: how long a step may still run after that signal.
      save: saves a checkpoint (from the watching thread, beside the step
        still running) and returns its path; only where that is safe.
    """
    self._signalled = signalled
    self._grace = grace_secs
    self._save = save
    self._since = time.time()
    thread = threading.Thread(target=self._watch, daemon=True,
                              name="watchdog")
    thread.start()
    self._thread = thread

  def closing(self) -> None:
    """Says that training has stopped and the session is closing."""
    with self._lock:
      self._phase = "closing"
      self._since = time.time()

  def stop(self) -> None:
    self._stopping.set()
    if self._thread is not None:
      self._thread.join()

  def after_create_session(self, session, coord):
    del coord
    self.session = session
    step = int(session.run(self._global_step))
    with self._lock:
      self._step = step
      self._since = time.time()
      self._phase = "between"

  def before_run(self, run_context):
    with self._lock:
      self._phase = "step"
    return tf.train.SessionRunArgs(self._global_step)

  def after_run(self, run_context, run_values):
    with self._lock:
      self._step = int(run_values.results)
      self._since = time.time()
      self._phase = "between"

  def _unreachable(self) -> str:
    """The peers that do not accept a connection now, in words."""
    down = ["%s (%s)" % (name, host) for name, host in self._peers
            if not _cluster.accepts_connections(host)]
    return ("; not accepting connections: " + ", ".join(down) if down
            else "; every peer accepts connections")

  def _doing(self) -> str:
    with self._lock:
      step, phase = self._step, self._phase
    if phase == "closing":
      return "closing the session"
    if step is None:
      return "creating the session"
    if phase == "step":
      return "step %d" % (step + 1)
    # The other hooks' work (a checkpoint, summaries), or, with recovery, a
    # session recreated after a failed step: the watchdog cannot tell which.
    return "the work after step %d" % step

  def explain(self, error: Exception) -> str:
    """Says what failed, what the worker waited for, and what to do."""
    first = _cause(error)
    return "%s failed after %.0fs with %s (%s): it waited for %s%s. %s" % (
        self._doing(), time.time() - self._since, type(error).__name__,
        first, self._waiting_for, self._unreachable(), self._advice())

  def _watch(self) -> None:
    last_log = 0.0
    signal_seen = None
    while not self._stopping.wait(1.0):
      now = time.time()
      with self._lock:
        waited = now - self._since
        closing = self._phase == "closing"
      signum = self._signalled()
      if signum is not None and signal_seen is None:
        signal_seen = now
      # Closing, the chief saves its final checkpoint: the timeout bounds it.
      if (signum is not None and signal_seen is not None and not closing
          and now - signal_seen > self._grace):
        self._give_up_after_signal(signum, now - signal_seen)
      if self._timeout is not None and waited > self._timeout:
        tf.logging.error("No step for %.0fs (the timeout is %gs) in %s: it "
                         "waited for %s%s. Stopping: %s", waited, self._timeout,
                         self._doing(), self._waiting_for, self._unreachable(),
                         self._advice())
        _exit(EXIT_STALLED)
      # Closing waits for nothing of a peer's: only the timeout applies.
      if (waited > self._log_after and now - last_log >= self._log_every and
          not closing):
        doing = self._doing()
        tf.logging.warning("%s has waited %.0fs for %s%s",
                           doing[:1].upper() + doing[1:], waited,
                           self._waiting_for, self._unreachable())
        last_log = now

  def _give_up_after_signal(self, signum: int, waited: float) -> None:
    saved = ""
    if self._save is not None and self.session is not None:
      try:
        # This thread's default graph is not the session's (and under
        # TensorFlow 2 behaviour it executes eagerly).
        with self.session.graph.as_default():
          saved = "; saved %s first" % self._save()
      except Exception as e:  # pylint: disable=broad-except
        saved = "; could not save a checkpoint (%s)" % (
            str(e).strip().splitlines() or [type(e).__name__])[0]
    tf.logging.warning("Received %s, but %s still waits for %s after %.0fs%s: "
                       "exiting without it%s", signal.Signals(signum).name,
                       self._doing(), self._waiting_for, waited,
                       self._unreachable(), saved)
    _exit(128 + signum)


def _cause(error: Exception) -> str:
  """The line of a TensorFlow error that says what failed on the wire."""
  text = getattr(error, "message", None) or str(error)
  grpc = re.search(r'grpc_message:"([^"]+)"', text)
  if grpc:
    return grpc.group(1)
  for line in text.splitlines():
    if re.search(r"(?i)timed out|deadline|abort|closed|reset|refused",
                 line) and not line.strip().startswith("File "):
      return line.strip()
  # Else the first line of TensorFlow's own, past the traceback of where the
  # node was built that graph errors begin with.
  text = text.rsplit("most recent call last):", 1)[-1]
  for line in text.splitlines():
    line = line.strip()
    if line and not line.startswith(("File ", "Graph execution error")):
      return line
  return "no detail"


def _exit(code: int) -> None:
  """Ends the process now, its log flushed: the main thread is stuck."""
  for handler in tf.get_logger().handlers + logging.getLogger().handlers:
    handler.flush()
  sys.stdout.flush()
  sys.stderr.flush()
  os._exit(code)  # pylint: disable=protected-access


def watchdog_for_task(task: _cluster.Task, global_step: tf.Tensor,
                      train_dir: str, *,
                      stall_log_secs: float = 30.0) -> Watchdog:
  """A `Watchdog` for a worker of `task`'s cluster, its words and bounds.

  It says what this kind of cluster waits for and how to resume from the
  chief's last checkpoint in `train_dir`, and stops the worker 15 s after
  the task's ``step_timeout_secs`` without a step (never, without one).
  """
  if task.collective:
    waiting_for = ("the collective all-reduce with every worker (%s)"
                   % ", ".join(task.cluster.job_tasks("worker")))
  else:
    waiting_for = ("the parameter servers (%s) and, through "
                   "SyncReplicasOptimizer's tokens, the other workers' "
                   "gradients" % ", ".join(task.cluster.job_tasks("ps")))

  def advice():
    # None where this worker cannot read it: the chief's own directory.
    step = _traindir.latest_step(train_dir)
    resume = ("the chief's last checkpoint, step %d in %s" % (step, train_dir)
              if step is not None else
              "the chief's last checkpoint in %s" % train_dir)
    if task.collective:
      return ("Collective mode has no backup workers: every worker stops. "
              "Restart every worker with the same flags: training resumes "
              "from %s (the steps after it are lost)" % resume)
    return ("Restart the lost task with the same flags (the workers recover "
            "a parameter server that comes back); or restart the cluster: "
            "training resumes from %s (the steps after it are lost)"
            % resume)

  timeout = task.step_timeout_secs
  return Watchdog(global_step, waiting_for, _cluster.peers(task),
                  log_after_secs=stall_log_secs,
                  timeout_secs=timeout + 15 if timeout else None,
                  advice=advice)
