"""Towers inside each worker, synchronous across workers: real clusters.

Every test starts real ``tf.train.Server`` processes (the MNIST training
script as ps and worker tasks) on 127.0.0.1, and stops every one of them,
also when it fails.
"""

import os
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import tensorflow.compat.v1 as tf

import mnist_eval
from test_mnist import synthetic, write_split
from towers import _tf_versions
from towers import training

EXAMPLES = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..",
                                        "examples"))
TRAIN = os.path.join(EXAMPLES, "mnist_multi_gpu_train.py")
STEP = re.compile(r"\[(worker\d)\].*step (\d+), loss = (\d+\.\d+)")
# Collective mode across workers needs collectives that time out (TensorFlow
# 2's): towers refuses it where they would wait forever for a lost worker.
COLLECTIVES_TIME_OUT = _tf_versions.collectives_time_out()
REFUSED = ("this TensorFlow's collectives wait forever for a lost worker, so "
           "towers refuses collective mode across workers (the refusal: "
           "test_collective_mode_is_refused_where_collectives_never_time_out)")


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
  """The real MNIST where it is present, else synthetic IDX files."""
  path = os.environ.get("TOWERS_MNIST_DIR", os.path.join(
      EXAMPLES, "..", "..", "shared", "data", "mnist"))
  if os.path.exists(os.path.join(path, "train-images-idx3-ubyte.gz")):
    return os.path.abspath(path)
  directory = tmp_path_factory.mktemp("mnist")
  write_split(directory, "train", *synthetic(600, seed=0))
  write_split(directory, "test", *synthetic(200, seed=1))
  return str(directory)


class Log:
  """Collects a cluster's prefixed output lines (a file-like sink)."""

  def __init__(self):
    self.lines = []

  def write(self, text):
    self.lines.append(text)

  def flush(self):
    pass

  def text(self):
    return "".join(self.lines)

  def steps(self, worker=None):
    """[(worker, step, loss)] of the original's log lines."""
    found = [(m.group(1), int(m.group(2)), float(m.group(3)))
             for m in STEP.finditer(self.text())]
    return [f for f in found if worker is None or f[0] == worker]


def _train_args(data_dir, train_dir, max_steps, *extra):
  return ["--num_gpus=2", "--batch_size=32", "--max_steps=%d" % max_steps,
          "--data_dir=" + data_dir, "--train_dir=" + train_dir,
          "--log_frequency=5", "--save_checkpoint_steps=20",
          "--startup_timeout_secs=60", "--mirrors="] + list(extra)


def _wait(predicate, timeout, what, task=None, log=None):
  """Waits for `predicate`; fails at `timeout`, or at once if `task` exits.

  The failure shows the end of the cluster's `log` where it is given.
  """
  def fail(why):
    raise AssertionError(why + ("; the log ends:\n" + log.text()[-4000:]
                                if log else ""))

  deadline = time.time() + timeout
  while not predicate():
    if task is not None and task.poll() is not None:
      fail("the task exited with code %d before %s" % (task.returncode, what))
    if time.time() > deadline:
      fail("timed out waiting for " + what)
    time.sleep(0.5)


def test_two_workers_of_two_towers_train_synchronously(data_dir, tmp_path):
  train_dir = str(tmp_path / "train")
  log = Log()
  with training.LocalCluster(
      TRAIN, 1, 2, _train_args(data_dir, train_dir, 60), out=log) as c:
    # The chief last, so the test does not depend on who starts faster: a
    # worker joins within a second of the chief's initialization, where it
    # would poll every 30 s without `cluster.wait_for_model`.
    c.start("ps", 0)
    c.start("worker", 1)
    _wait(lambda: re.search(r"\[worker1\].*Waiting for the chief",
                            log.text()), 120, "worker1 to wait for the chief",
          log=log)
    c.start("worker", 0)
    code = c.wait_for_workers()
  assert code == 0, log.text()[-4000:]
  # A clean end: not even the chief's token queue runner's cancellation.
  assert "Traceback" not in log.text(), log.text()[-4000:]
  assert tf.train.load_variable(train_dir, "global_step") == 60
  chief = log.steps("worker0")
  assert chief and log.steps("worker1"), log.text()[-4000:]
  # Each worker built its step with the default --pack_bytes.
  for worker in ("worker0", "worker1"):
    assert re.search(r"\[%s\].*--pack_bytes=16384: 5 of the 8 gradients"
                     % worker, log.text()), log.text()[-4000:]
  losses = [loss for _, _, loss in chief]
  assert np.mean(losses[-3:]) < np.mean(losses[:3])
  # The chief's checkpoint restores into the single-device evaluation.
  result = mnist_eval.evaluate(checkpoint_dir=train_dir, data_dir=data_dir,
                               eval_dir=str(tmp_path / "eval"), run_once=True,
                               mirrors=())
  assert result.global_step == 60
  assert result.precision > 0.5


def test_a_killed_backup_worker_does_not_stop_training(data_dir, tmp_path):
  train_dir = str(tmp_path / "train")
  log = Log()
  args = _train_args(data_dir, train_dir, 80, "--replicas_to_aggregate=2")
  with training.LocalCluster(TRAIN, 1, 3, args, out=log) as c:
    c.start_all()
    _wait(lambda: log.steps("worker2"), 240, "worker2's first step",
          c.tasks["worker2"], log)
    os.killpg(c.tasks["worker2"].pid, signal.SIGKILL)
    code = {}
    for name in ("worker0", "worker1"):
      code[name] = c.tasks[name].wait(timeout=300)
  assert code == {"worker0": 0, "worker1": 0}, log.text()[-4000:]
  assert c.tasks["worker2"].returncode == -signal.SIGKILL
  assert tf.train.load_variable(train_dir, "global_step") == 80


def test_sigterm_to_the_cluster_has_the_chief_save_before_the_ps_stop(
    data_dir, tmp_path):
  train_dir = str(tmp_path / "train")
  log = Log()
  # With the fast paths a cluster takes: bfloat16 (float16 is refused) and
  # staged inputs, whose reader is stopped with the session.
  args = _train_args(data_dir, train_dir, 100000,
                     "--save_checkpoint_secs=3600", "--precision=bfloat16",
                     "--stage_inputs")
  args.remove("--save_checkpoint_steps=20")
  with training.LocalCluster(TRAIN, 1, 1, args, out=log) as c:
    c.start_all()
    _wait(lambda: log.steps("worker0"), 240, "the chief's first step",
          c.tasks["worker0"], log)
    c.stop(signal.SIGTERM, grace_secs=60)
  assert c.tasks["worker0"].returncode == 128 + signal.SIGTERM, \
      log.text()[-4000:]
  saved = re.findall(r"\[worker0\].*Received SIGTERM at step (\d+): saved a "
                     r"checkpoint, stopping", log.text())
  assert len(saved) == 1, log.text()[-4000:]
  assert tf.train.load_variable(train_dir, "global_step") == int(saved[0])
  assert "Traceback" not in log.text(), log.text()[-4000:]
  for words in ["--precision=bfloat16: the towers compute in bfloat16",
                "--stage_inputs: each tower's batches are read ahead"]:
    assert words in log.text()


# A stand-in task for the launcher: it records when it starts, when it gets
# a signal and when it exits (after 0.5 s, as a chief saving); worker1
# ignores signals, so only SIGKILL ends it.
FAKE_TASK = r"""
import os, signal, sys, time
args = dict(a[2:].split("=", 1) for a in sys.argv[1:] if "=" in a)
name = args["job_name"] + args["task_index"]

def record(what):
  with open(os.path.join(args["log_dir"], name), "a") as f:
    f.write("%s %.3f\n" % (what, time.time()))

def handle(signum, frame):
  record("signal%d" % signum)
  if name != "worker1":
    time.sleep(0.5)
    record("exit")
    sys.exit(128 + signum)

signal.signal(signal.SIGTERM, handle)
signal.signal(signal.SIGINT, handle)
record("started")
with open(os.path.join(args["log_dir"], name), "a") as f:
  f.write("pid %d\n" % os.getpid())
while True:
  time.sleep(0.1)
"""


def _events(log_dir, name):
  """{event: time} of a fake task's record."""
  path = os.path.join(log_dir, name)
  if not os.path.exists(path):
    return {}
  with open(path) as f:
    return {w: float(t) for w, t in (line.split() for line in f)}


def _launch_stand_ins(tmp_path, task, *flags, output=True):
  """The launcher with 1 ps and 2 workers running `task`'s code, logging
  to tmp_path/log; its output piped as text, or dropped."""
  script = tmp_path / "task.py"
  script.write_text(task)
  log_dir = tmp_path / "log"
  log_dir.mkdir()
  env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
  return subprocess.Popen(
      [sys.executable, os.path.join(EXAMPLES, "launch_local_cluster.py"),
       "--num_ps=1", "--num_workers=2", "--script=%s" % script] +
      list(flags) + ["--", "--log_dir=%s" % log_dir], env=env,
      stdout=subprocess.PIPE if output else subprocess.DEVNULL,
      stderr=subprocess.STDOUT if output else subprocess.DEVNULL, text=True)


def test_the_launcher_passes_a_signal_to_the_workers_then_stops_the_ps(
    tmp_path):
  log_dir = tmp_path / "log"
  launcher = _launch_stand_ins(tmp_path, FAKE_TASK, "--stop_grace_secs=2")
  try:
    _wait(lambda: all("started" in _events(str(log_dir), n)
                      for n in ("ps0", "worker0", "worker1")), 60,
          "the tasks to start")
    launcher.send_signal(signal.SIGINT)  # Ctrl-C.
    out, _ = launcher.communicate(timeout=60)
  finally:
    if launcher.poll() is None:
      launcher.kill()
      launcher.wait()
  assert launcher.returncode == 128 + signal.SIGINT, out
  assert out.count("Received SIGINT: passing it to the workers") == 1, out
  chief, stubborn, ps = (_events(str(log_dir), n)
                         for n in ("worker0", "worker1", "ps0"))
  # The workers get the signal itself; the chief has exited (saved) before
  # the parameter servers are stopped, with SIGTERM.
  assert "signal%d" % signal.SIGINT in chief and "exit" in chief
  assert "signal%d" % signal.SIGINT in stubborn
  assert ps["signal%d" % signal.SIGTERM] >= chief["exit"]
  # The worker that ignored it got SIGKILL after the 2 s grace, and only
  # then were the parameter servers stopped.
  assert "exit" not in stubborn
  assert ps["signal%d" % signal.SIGTERM] >= (
      stubborn["signal%d" % signal.SIGINT] + 1.9)


def _run_task(args, timeout=120):
  env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
  return subprocess.run([sys.executable, TRAIN] + args, capture_output=True,
                        text=True, timeout=timeout, env=env, check=False)


def test_a_wrong_task_index_is_a_clear_error(tmp_path):
  done = _run_task(["--ps_hosts=127.0.0.1:1", "--worker_hosts=127.0.0.1:2",
                    "--job_name=worker", "--task_index=3",
                    "--train_dir=%s" % tmp_path])
  assert done.returncode != 0
  assert "--task_index=3 but --worker_hosts lists 1 worker" in done.stderr


def test_an_unreachable_parameter_server_is_a_clear_error(tmp_path):
  ps, worker = training.free_ports(2)
  started = time.time()
  done = _run_task(["--ps_hosts=127.0.0.1:%d" % ps,
                    "--worker_hosts=127.0.0.1:%d" % worker,
                    "--job_name=worker", "--task_index=0",
                    "--startup_timeout_secs=3", "--train_dir=%s" % tmp_path])
  assert done.returncode != 0
  assert "cannot reach 127.0.0.1:%d" % ps in done.stderr
  assert time.time() - started < 60


def test_host_lists_that_differ_from_the_chiefs_are_a_clear_error(
    data_dir, tmp_path):
  log = Log()
  with training.LocalCluster(
      TRAIN, 1, 2, _train_args(data_dir, str(tmp_path / "train"), 1000),
      out=log) as c:
    c.start("ps", 0)
    c.start("worker", 0)
    # Task 1 believes in a third worker the chief does not know.
    hosts = c.worker_hosts + ["127.0.0.1:%d"
                              % training.free_ports(1)[0]]
    args = [("--worker_hosts=" + ",".join(hosts))
            if a.startswith("--worker_hosts=") else a
            for a in c.command("worker", 1)]
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    done = subprocess.run(args, capture_output=True, text=True, timeout=180,
                          env=env, check=False)
  assert done.returncode != 0
  assert "differs from the chief's" in done.stderr, done.stderr[-3000:]

# Failures. Each test bounds every wait; the cluster's context
# stops every task, also when the test fails, and on Linux a task dies with
# the process that started it.


def _steps(log, worker):
  return [step for _, step, _ in log.steps(worker)]


def _wait_for_step(log, worker, step, timeout):
  _wait(lambda: any(s >= step for s in _steps(log, worker)), timeout,
        "%s to reach step %d" % (worker, step), log=log)


def _exit_code(proc, timeout, log):
  """The task's exit code; fails the test when it runs past `timeout`."""
  try:
    return proc.wait(timeout=timeout)
  except subprocess.TimeoutExpired:
    raise AssertionError("still running after %ds:\n%s"
                         % (timeout, log.text()[-4000:])) from None


def _lines(log, worker, words):
  return [line for line in log.lines
          if line.startswith("[%s]" % worker) and words in line]


def _saved_step(train_dir):
  return int(tf.train.latest_checkpoint(train_dir).rsplit("-", 1)[1])


@pytest.mark.skipif(not COLLECTIVES_TIME_OUT, reason=REFUSED)
def test_collective_workers_stop_together_on_any_loss_and_resume(
    data_dir, tmp_path):
  """2 workers of 2 towers, no ps: a kill and a SIGTERM, each then a
  restart.

  A lost worker (SIGKILL, or SIGTERM to one) stops every other within
  seconds, with the message that says how to resume; every restart resumes
  from the chief's last checkpoint; SIGTERM to the chief saves first; at
  the end both workers hold identical variables, and the single-device
  evaluation restores the chief's checkpoint.
  """
  train_dir = str(tmp_path / "train")
  log = Log()
  args = _train_args(data_dir, train_dir, 60, "--save_checkpoint_steps=10",
                     "--step_timeout_secs=30", "--stall_log_secs=3")
  args.remove("--save_checkpoint_steps=20")
  stopped = "Collective mode has no backup workers: every worker stops"
  with training.LocalCluster(TRAIN, 0, 2, args, out=log) as c:
    resumed = 0
    # (A SIGKILLed chief takes the survivor down the same path as a
    # SIGKILLed non-chief: the all-reduce fails when the peer's socket
    # closes, whichever peer it is.)
    for victim, how in (("worker1", signal.SIGKILL),
                        ("worker0", signal.SIGTERM)):
      del log.lines[:]
      c.start_all()
      if resumed:
        _wait(lambda: _lines(log, "worker0", "Restoring parameters from")
              and _steps(log, "worker0"), 120, "the restart's first step",
              log=log)
        # The global step goes on from the checkpoint.
        assert min(_steps(log, "worker0")) > resumed, log.text()[-4000:]
      _wait_for_step(log, "worker0", resumed + 8, 120)
      os.killpg(c.tasks[victim].pid, how)
      killed = time.time()
      survivor = "worker1" if victim == "worker0" else "worker0"
      code = _exit_code(c.tasks[survivor], 60, log)
      # A peer that exits fails the all-reduce at once; well within the
      # --step_timeout_secs of a peer that hangs.
      assert time.time() - killed < 30, log.text()[-4000:]
      assert code == 1, log.text()[-4000:]
      message = _lines(log, survivor, stopped)
      assert message and ("resumes from the chief's last checkpoint, step %d"
                          % _saved_step(train_dir)) in message[0], message
      victim_code = _exit_code(c.tasks[victim], 60, log)
      if how == signal.SIGTERM:
        assert victim_code == 128 + signal.SIGTERM, log.text()[-4000:]
      if (victim, how) == ("worker0", signal.SIGTERM):
        saved = re.findall(r"\[worker0\].*Received SIGTERM at step (\d+): "
                           r"saved a checkpoint", log.text())
        assert saved and _saved_step(train_dir) == int(saved[0]), \
            log.text()[-4000:]
      resumed = _saved_step(train_dir)
    del log.lines[:]
    c.start_all()
    codes = [_exit_code(c.tasks[w], 120, log) for w in ("worker0", "worker1")]
  assert codes == [0, 0], log.text()[-4000:]
  assert tf.train.load_variable(train_dir, "global_step") == 60
  digests = re.findall(r"\[(worker\d)\].*Variables at step 60: sha256 (\w+)",
                       log.text())
  assert len(digests) == 2 and digests[0][1] == digests[1][1], digests
  result = mnist_eval.evaluate(checkpoint_dir=train_dir, data_dir=data_dir,
                               eval_dir=str(tmp_path / "eval"), run_once=True,
                               mirrors=())
  assert result.global_step == 60


@pytest.mark.skipif(COLLECTIVES_TIME_OUT, reason="this TensorFlow's "
                    "collectives time out, so collective mode runs (tested "
                    "above)")
def test_collective_mode_is_refused_where_collectives_never_time_out(
    data_dir, tmp_path):
  # Run as a user would: the launcher ends at once, each worker saying why.
  done = subprocess.run(
      [sys.executable, os.path.join(EXAMPLES, "launch_local_cluster.py"),
       "--num_ps=0", "--num_workers=2", "--"] +
      _train_args(data_dir, str(tmp_path / "train"), 60),
      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
      timeout=180, check=False, env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2"))
  out = done.stdout
  assert done.returncode == 1, out[-3000:]
  for worker in ("worker0", "worker1"):
    assert re.search(
        r"\[%s\] E.*num_workers=2 all-reduces across workers with "
        r"TensorFlow's collective ops, which on TensorFlow \S+ wait forever "
        r"for a worker that never comes .*: use TensorFlow 2\.12 or later, "
        r"or parameter servers" % worker, out), out[-3000:]
  assert "Traceback" not in out, out[-3000:]
  assert not tf.train.latest_checkpoint(str(tmp_path / "train"))


def test_parameter_server_mode_workers_killed_and_restarted_rejoin(
    data_dir, tmp_path):
  """A non-chief worker killed and restarted rejoins; a killed chief
  restarted resumes from its last checkpoint, the global step going on."""
  train_dir = str(tmp_path / "train")
  log = Log()
  args = _train_args(data_dir, train_dir, 80, "--save_checkpoint_steps=10",
                     "--step_timeout_secs=120", "--stall_log_secs=3")
  args.remove("--save_checkpoint_steps=20")
  with training.LocalCluster(TRAIN, 1, 2, args, out=log) as c:
    c.start_all()
    _wait_for_step(log, "worker1", 10, 180)
    os.killpg(c.tasks["worker1"].pid, signal.SIGKILL)
    c.tasks["worker1"].wait(timeout=10)
    time.sleep(3)
    del log.lines[:]
    c.start("worker", 1)
    _wait(lambda: _steps(log, "worker1"), 120, "worker1 to rejoin", log=log)
    os.killpg(c.tasks["worker0"].pid, signal.SIGKILL)
    c.tasks["worker0"].wait(timeout=10)
    before = _saved_step(train_dir)
    del log.lines[:]
    c.start("worker", 0)
    codes = [_exit_code(c.tasks[w], 180, log) for w in ("worker0", "worker1")]
  assert codes == [0, 0], log.text()[-4000:]
  assert _lines(log, "worker0", "Restoring parameters from %s"
                % os.path.join(train_dir, "model.ckpt-%d" % before)), \
      log.text()[-4000:]
  assert min(_steps(log, "worker0")) > before
  assert tf.train.load_variable(train_dir, "global_step") == 80


def test_a_lost_parameter_server_is_recovered_or_stops_the_workers(
    data_dir, tmp_path):
  """The workers say what they wait for; a ps back in time is recovered
  (the chief restores its last checkpoint into it); a ps gone for good
  stops every worker with a clear message within the bound."""
  train_dir = str(tmp_path / "train")
  log = Log()
  args = _train_args(data_dir, train_dir, 100000,
                     "--save_checkpoint_steps=10", "--step_timeout_secs=15",
                     "--stall_log_secs=3")
  args.remove("--save_checkpoint_steps=20")
  with training.LocalCluster(TRAIN, 1, 2, args, out=log) as c:
    c.start_all()
    _wait_for_step(log, "worker0", 12, 180)
    os.killpg(c.tasks["ps0"].pid, signal.SIGKILL)
    c.tasks["ps0"].wait(timeout=10)
    saved = _saved_step(train_dir)
    _wait(lambda: all(len(_lines(log, w, "not accepting connections: ps0"))
                      >= 2 for w in ("worker0", "worker1")), 30,
          "both workers to say twice that they wait for ps0", log=log)
    del log.lines[:]
    c.start("ps", 0)
    _wait(lambda: _lines(log, "worker0", "Restoring parameters from")
          and _steps(log, "worker0"), 60, "the chief to recover", log=log)
    assert min(_steps(log, "worker0")) > saved
    os.killpg(c.tasks["ps0"].pid, signal.SIGKILL)
    killed = time.time()
    codes = [_exit_code(c.tasks[w], 90, log) for w in ("worker0", "worker1")]
    took = time.time() - killed
  assert codes == [1, 1], log.text()[-4000:]
  # 15 s without a step, plus the 15 s the watchdog leaves the session's
  # own operation timeout, plus slack for a loaded machine.
  assert took < 60, log.text()[-4000:]
  for worker in ("worker0", "worker1"):
    stop = _lines(log, worker, "Stopping: Restart the lost task")
    assert stop and "ps0 (%s)" % c.ps_hosts[0] in stop[0], log.text()[-4000:]
