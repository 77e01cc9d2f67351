"""SIGTERM and SIGINT end training after the current step, saved."""

import os
import signal
import threading
import time
from typing import Optional

import tensorflow.compat.v1 as tf

SIGNALS = (signal.SIGTERM, signal.SIGINT)


class StopOnSignalHook(tf.train.SessionRunHook):
  """Stops a training session cleanly on the first SIGTERM or SIGINT.

  From `begin` on, the first of these signals only records its number: the
  step running finishes, then the hook requests a stop, so the session ends
  normally and its ``CheckpointSaverHook`` saves the final checkpoint (a
  ``MonitoredTrainingSession`` chief's does). A second signal kills the
  process at once, by the signal's default action (within a second, with
  status 128 + the signal, while a step holds the main thread, where Python
  runs no handler; `received` is set at once either way). Handlers can only be
  installed in the main thread; elsewhere the hook does nothing. The
  previous handlers come back in `end`, or on leaving ``with hook:``, which
  also covers a session ended by an error (hooks' `end` is then not called).

  Attributes:
    received: the first signal's number, or None.
  """

  def __init__(self):
    self.received: Optional[int] = None
    self._previous = {}
    self._handled = 0
    self._wakeup = None

  def __enter__(self) -> "StopOnSignalHook":
    self._install()
    return self

  def __exit__(self, *exc) -> None:
    self._restore()

  def begin(self):
    self._install()

  def after_run(self, run_context, run_values):
    if self.received is not None:
      run_context.request_stop()

  def end(self, session):
    self._restore()

  def _install(self) -> None:
    if self._previous or (threading.current_thread()
                          is not threading.main_thread()):
      return
    for signum in SIGNALS:
      self._previous[signum] = signal.signal(signum, self._handle)
    # Python runs a handler in the main thread between two bytecodes: not
    # while a step holds that thread in TensorFlow's C++ code. The signal's
    # number also goes to the wakeup fd at once, where a thread of the hook
    # records it: a Watchdog sees it during that step.
    read, write = os.pipe()
    os.set_blocking(write, False)
    self._wakeup = (write, signal.set_wakeup_fd(
        write, warn_on_full_buffer=False))
    threading.Thread(target=self._record, args=(read,), daemon=True,
                     name="StopOnSignalHook").start()

  def _record(self, read: int) -> None:
    seen = 0
    try:
      while True:
        data = os.read(read, 64)
        if not data:  # _restore closed the write end.
          return
        for signum in data:
          if signum not in SIGNALS:
            continue
          seen += 1
          if self.received is None:
            self.received = signum
          if seen == 2:
            # The second signal kills: the handler does, unless the main
            # thread is held in a step, and then this thread does.
            time.sleep(1.0)
            os._exit(128 + signum)  # pylint: disable=protected-access
    finally:
      os.close(read)

  def _restore(self) -> None:
    for signum, handler in self._previous.items():
      # None: a handler not set from Python, which cannot be put back.
      signal.signal(signum, signal.SIG_DFL if handler is None else handler)
    self._previous.clear()
    if self._wakeup is not None:
      write, previous = self._wakeup
      signal.set_wakeup_fd(previous)
      os.close(write)
      self._wakeup = None

  def _handle(self, signum, frame):
    del frame
    # No logging here: the handler may interrupt a thread holding logging's
    # lock. The training loop logs once it has stopped.
    self._handled += 1
    if self.received is None:
      self.received = signum
    if self._handled == 1:
      return
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)
