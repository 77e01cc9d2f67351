"""StopOnSignalHook in a plain MonitoredTrainingSession loop."""

import os
import signal
import subprocess
import threading
import time

import pytest
import tensorflow.compat.v1 as tf

from towers import training

SIGNALS = (signal.SIGTERM, signal.SIGINT)


class _SignalAtRun(tf.train.SessionRunHook):
  """Sends `signum` to this process in run number `run`, before its step."""

  def __init__(self, run, signum):
    self._run = run
    self._signum = signum
    self.runs = 0

  def before_run(self, run_context):
    self.runs += 1
    if self.runs == self._run:
      os.kill(os.getpid(), self._signum)


def _handlers():
  return {s: signal.getsignal(s) for s in SIGNALS}


def _is_the_hooks(handler, hook):
  return getattr(handler, "__self__", None) is hook


def _session(config, hooks, checkpoint_dir=None):
  return tf.train.MonitoredTrainingSession(
      checkpoint_dir=checkpoint_dir, hooks=hooks, config=config,
      save_checkpoint_secs=3600, save_summaries_steps=None,
      save_summaries_secs=None, log_step_count_steps=0)


@pytest.fixture
def handlers_kept():
  """The handlers before the test, put back after it whatever happened."""
  before = _handlers()
  yield before
  for signum, handler in before.items():
    signal.signal(signum, handler)


@pytest.mark.parametrize("signum", SIGNALS, ids=["SIGTERM", "SIGINT"])
def test_a_signal_ends_the_loop_after_its_step_which_the_session_saves(
    tiny_model, config, tmp_path, checkpoint_step, handlers_kept, signum):
  model = tiny_model()
  hook = training.StopOnSignalHook()
  runs = 0
  with model.graph.as_default():
    with _session(config, [_SignalAtRun(3, signum), hook],
                  str(tmp_path)) as sess:
      while not sess.should_stop():
        assert all(_is_the_hooks(h, hook) for h in _handlers().values())
        sess.run(model.train_op)
        runs += 1
  assert hook.received == signum
  assert runs == 3  # The step it came in finished, and was the last.
  assert checkpoint_step(tmp_path) == 3  # Saved by the session's saver.
  assert tf.train.load_variable(str(tmp_path), "global_step") == 3
  assert _handlers() == handlers_kept  # Put back by `end`.


def test_leaving_with_hook_restores_the_handlers_after_an_error(
    tiny_model, config, handlers_kept):
  model = tiny_model()
  hook = training.StopOnSignalHook()
  with model.graph.as_default():
    with hook:
      assert all(_is_the_hooks(h, hook) for h in _handlers().values())
      with pytest.raises(ValueError, match="the loop failed"):
        with _session(config, [hook]) as sess:
          sess.run(model.train_op)
          raise ValueError("the loop failed")
      # A session ended by an error calls no hook's `end`.
      assert all(_is_the_hooks(h, hook) for h in _handlers().values())
    assert _handlers() == handlers_kept
  assert hook.received is None


def test_off_the_main_thread_the_hook_installs_nothing(handlers_kept):
  hook = training.StopOnSignalHook()
  errors = []

  def begin():
    try:
      hook.begin()
    except Exception as e:  # pylint: disable=broad-except
      errors.append(e)

  thread = threading.Thread(target=begin)
  thread.start()
  thread.join()
  assert not errors
  assert _handlers() == handlers_kept
  hook.end(None)
  assert _handlers() == handlers_kept


def test_a_second_signal_kills_at_once(python):
  code = ("import os, signal, time\n"
          "from towers import training\n"
          "with training.StopOnSignalHook() as hook:\n"
          "  os.kill(os.getpid(), signal.SIGINT)\n"
          "  assert hook.received == signal.SIGINT\n"
          "  print('first one only recorded', flush=True)\n"
          "  os.kill(os.getpid(), signal.SIGINT)\n"
          "  time.sleep(30)\n"
          "  print('still alive')\n")
  done = python.run(["-c", code], timeout=60)
  assert done.stdout == "first one only recorded\n", done.stderr[-2000:]
  assert done.returncode == -signal.SIGINT


BLOCKED = r"""
import os, sys
import tensorflow.compat.v1 as tf
from towers import training

with tf.Graph().as_default():
  blocked = tf.FIFOQueue(1, tf.float32).dequeue()
  with tf.train.MonitoredSession(hooks=[training.StopOnSignalHook()]) as sess:
    open(sys.argv[1], "w").close()
    sess.run(blocked)
print("unblocked")
"""


def test_a_second_signal_kills_even_while_a_step_holds_the_main_thread(
    python, wait_until, tmp_path):
  # Python runs handlers in the main thread only between bytecodes, which a
  # step held in TensorFlow's C++ code never reaches.
  script = tmp_path / "blocked.py"
  script.write_text(BLOCKED)
  marker = tmp_path / "blocking"
  proc = python.start([str(script), str(marker)], stdout=subprocess.PIPE,
                      stderr=subprocess.PIPE, text=True)
  wait_until(marker.exists, 60, "the blocked step", proc)
  proc.send_signal(signal.SIGTERM)
  time.sleep(0.5)
  assert proc.poll() is None  # The first one only asks to stop.
  proc.send_signal(signal.SIGTERM)
  out, err = proc.communicate(timeout=30)
  assert proc.returncode == 128 + signal.SIGTERM, err[-2000:]
  assert "unblocked" not in out
