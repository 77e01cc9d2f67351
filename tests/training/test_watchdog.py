"""Watchdog: a step that blocks is logged, then bounded; its words.

The bounds end the process (``os._exit``), so each runs in a subprocess
whose step is a dequeue from a queue that never gets an element.
"""

import os
import re
import signal
import subprocess

import pytest
import tensorflow.compat.v1 as tf

from towers import training
from towers.training import _watchdog

# argv: the mode, a port nothing listens on, a directory. Peer ps0 is on
# that port; peer worker1 listens (and accepts) in the script itself.
BLOCKED_STEP = r"""
import os, signal, socket, sys, threading
import tensorflow.compat.v1 as tf
from towers import training

mode, dead_port, directory = sys.argv[1:]
listening = socket.socket()
listening.bind(("127.0.0.1", 0))
listening.listen(16)


def accept():
  while True:
    listening.accept()[0].close()


threading.Thread(target=accept, daemon=True).start()
peers = [("ps0", "127.0.0.1:" + dead_port),
         ("worker1", "127.0.0.1:%d" % listening.getsockname()[1])]
with tf.Graph().as_default():
  step = tf.train.get_or_create_global_step()
  blocked = tf.FIFOQueue(1, tf.float32).dequeue()
  nothing = tf.no_op()
  saver = tf.train.Saver()
  hook = training.StopOnSignalHook()
  dog = training.Watchdog(
      step, "the test's empty queue", peers,
      log_after_secs=1 if mode == "timeout" else 60,
      timeout_secs={"timeout": 3, "flag": None, "sigterm": 3}[mode],
      advice=lambda: "Restart it.")

  def save():
    # From the watchdog's thread, whose default graph is not this one.
    with step.graph.as_default():
      return saver.save(dog.session, os.path.join(directory, "model.ckpt"),
                        global_step=step, write_meta_graph=False)

  def flag():
    exists = os.path.exists(os.path.join(directory, "signalled"))
    return signal.SIGTERM if exists else None

  if mode == "timeout":
    dog.start()
  else:
    dog.start(flag if mode == "flag" else lambda: hook.received,
              grace_secs=1, save=save)
  with tf.train.MonitoredSession(hooks=[hook, dog]) as sess:
    sess.run(nothing)
    open(os.path.join(directory, "blocking"), "w").close()
    sess.run(blocked)
print("unblocked")
"""


def _start_blocked_step(python, wait_until, tmp_path, mode):
  """Starts the script; returns it and its dead peer's port, once blocked
  in step 1 (global step 0: its first run, an op, stepped nothing)."""
  script = tmp_path / "blocked_step.py"
  script.write_text(BLOCKED_STEP)
  port = training.free_ports(1)[0]
  proc = python.start([str(script), mode, str(port), str(tmp_path)],
                      stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                      text=True)
  wait_until(lambda: (tmp_path / "blocking").exists(), 60,
             "the blocked step", proc)
  return proc, port


def test_a_blocked_step_is_logged_then_ends_the_process_with_status_1(
    python, wait_until, tmp_path):
  proc, port = _start_blocked_step(python, wait_until, tmp_path, "timeout")
  out, err = proc.communicate(timeout=30)
  assert proc.returncode == 1, err[-2000:]
  assert "unblocked" not in out
  # Only the peer that does not accept connections is named.
  down = r"; not accepting connections: ps0 \(127\.0\.0\.1:%d\)" % port
  waited = re.findall(r"Step 1 has waited (\d+)s for the test's empty "
                      r"queue%s$" % down, err, re.M)
  assert waited and int(waited[0]) >= 1, err[-2000:]
  assert len(re.findall(
      r"No step for \d+s \(the timeout is 3s\) in step 1: it waited for the "
      r"test's empty queue%s\. Stopping: Restart it\.$" % down, err,
      re.M)) == 1, err[-2000:]


def test_after_a_signal_a_step_past_the_grace_ends_the_process_saved(
    python, wait_until, tmp_path, checkpoint_step):
  proc, port = _start_blocked_step(python, wait_until, tmp_path, "flag")
  (tmp_path / "signalled").write_text("")
  out, err = proc.communicate(timeout=30)
  assert proc.returncode == 128 + signal.SIGTERM, err[-2000:]
  assert "unblocked" not in out
  saved = os.path.join(str(tmp_path), "model.ckpt-0")
  assert re.search(
      r"Received SIGTERM, but step 1 still waits for the test's empty "
      r"queue after \d+s; not accepting connections: ps0 \(127\.0\.0\.1:%d\)"
      r": exiting without it; saved %s first$" % (port, re.escape(saved)),
      err, re.M), err[-2000:]
  assert checkpoint_step(tmp_path) == 0  # Saved beside the blocked step.


def test_a_sigterm_during_a_blocked_step_reaches_the_watchdog(
    python, wait_until, tmp_path):
  proc, _ = _start_blocked_step(python, wait_until, tmp_path, "sigterm")
  proc.send_signal(signal.SIGTERM)
  _, err = proc.communicate(timeout=30)
  # Not the timeout's 1, 3 s on.
  assert proc.returncode == 128 + signal.SIGTERM, err[-2000:]


def test_the_watchdog_saves_from_its_thread_in_the_sessions_graph(
    tmp_path, monkeypatch, wait_until, logs, checkpoint_step):
  # In this process, _exit only records: no step blocks, the grace is 0.
  exits = []
  monkeypatch.setattr(_watchdog, "_exit", exits.append)
  with tf.Graph().as_default():
    step = tf.train.get_or_create_global_step()
    saver = tf.train.Saver()
    dog = training.Watchdog(step, "nothing", [], log_after_secs=60)

    def save():  # As train() passes it.
      return saver.save(dog.session, os.path.join(str(tmp_path),
                                                  "model.ckpt"),
                        global_step=step, write_meta_graph=False)

    with tf.train.MonitoredSession(hooks=[dog]):
      dog.start(lambda: signal.SIGTERM, grace_secs=0, save=save)
      try:
        wait_until(lambda: exits, 10, "the watchdog to give up")
      finally:
        dog.stop()
  assert exits[0] == 128 + signal.SIGTERM
  assert any(m.endswith("exiting without it; saved %s first"
                        % os.path.join(str(tmp_path), "model.ckpt-0"))
             for m in logs()), logs()
  assert checkpoint_step(tmp_path) == 0


def test_a_peers_error_is_explained_and_the_workers_own_is_not():
  """Only a peer's errors become the watchdog's message; others stay theirs.

  A kernel's InvalidArgumentError in a cluster step was once reported as
  "InvalidArgumentError (no detail): it waited for the parameter servers",
  blaming peers that were fine.
  """
  dog = training.Watchdog(None, "the parameter servers (127.0.0.1:1)", [],
                          advice=lambda: "Restart it.")
  lost = tf.errors.UnavailableError(None, None, "Socket closed")
  assert isinstance(lost, training.PEER_ERRORS)
  assert re.fullmatch(
      r"creating the session failed after \d+s with UnavailableError "
      r"\(Socket closed\): it waited for the parameter servers "
      r"\(127\.0\.0\.1:1\); every peer accepts connections\. Restart it\.",
      dog.explain(lost))
  for error in (tf.errors.DeadlineExceededError, tf.errors.AbortedError,
                tf.errors.CancelledError):
    assert isinstance(error(None, None, "late"), training.PEER_ERRORS)
  grpc = tf.errors.UnavailableError(
      None, None, 'From /job:ps/replica:0/task:0:\n{"created":"@1",'
      'grpc_message:"Connection reset by peer",grpc_status:14}')
  assert "with UnavailableError (Connection reset by peer)" in dog.explain(
      grpc)
  own = tf.errors.InvalidArgumentError(
      None, None, "Graph execution error:\n\nDetected at node 'x' defined at "
      "(most recent call last):\n  File \"a.py\", line 1, in <module>\n\n"
      "Value for attr 'T' of bfloat16 is not in the list of allowed values")
  assert not isinstance(own, training.PEER_ERRORS)
  assert "(Value for attr 'T' of bfloat16 is not in the list" in \
      dog.explain(own)
  assert issubclass(training.PeerLost, RuntimeError)


def _task(collective, step_timeout_secs=None):
  """A worker 0 `Task` of a cluster on ports nothing listens on (no
  server: the watchdog reads the cluster only)."""
  hosts = ["127.0.0.1:%d" % p for p in training.free_ports(3)]
  jobs = {"worker": hosts[:2]} if collective else {"ps": hosts[2:],
                                                   "worker": hosts[:2]}
  return training.Task(
      server=None, cluster=tf.train.ClusterSpec(jobs), is_chief=True,
      worker_device="/job:worker/task:0", config=None, num_workers=2,
      collective=collective, step_timeout_secs=step_timeout_secs), hosts


@pytest.mark.parametrize("collective", [True, False],
                         ids=["collective", "parameter_servers"])
def test_watchdog_for_task_says_what_the_cluster_waits_for_and_how_to_resume(
    tmp_path, train_tiny, collective):
  task, hosts = _task(collective, step_timeout_secs=10)
  with tf.Graph().as_default():
    step = tf.train.get_or_create_global_step()
    dog = training.watchdog_for_task(task, step, str(tmp_path))
  lost = tf.errors.DeadlineExceededError(None, None, "timed out")
  message = dog.explain(lost)
  if collective:
    assert ("it waited for the collective all-reduce with every worker "
            "(%s, %s); not accepting connections: worker1 (%s). Collective "
            "mode has no backup workers: every worker stops. Restart every "
            "worker with the same flags: training resumes from the chief's "
            "last checkpoint in %s (the steps after it are lost)"
            % (hosts[0], hosts[1], hosts[1], tmp_path)) in message
  else:
    assert ("it waited for the parameter servers (%s) and, through "
            "SyncReplicasOptimizer's tokens, the other workers' gradients; "
            "not accepting connections: ps0 (%s), worker1 (%s). Restart the "
            "lost task with the same flags" % (hosts[2], hosts[2], hosts[1])
            ) in message
  train_tiny(tmp_path, 2)
  assert ("training resumes from the chief's last checkpoint, step 2 in %s "
          "(the steps after it are lost)" % tmp_path) in dog.explain(lost)
