"""train() end to end, and the pieces in a user's own loop without it."""

import glob
import os
import re
import signal
import subprocess
import threading
import time

import pytest
import tensorflow.compat.v1 as tf

import towers
from towers import training


class _Runs(tf.train.SessionRunHook):
  """Counts the runs; sleeps `secs` after each, to pace a long run."""

  def __init__(self, secs=0.0):
    self.count = 0
    self._secs = secs

  def after_run(self, run_context, run_values):
    self.count += 1
    time.sleep(self._secs)


def _steps(logs):
  """{step: "step N, loss = X"} of the step lines logged."""
  found = {}
  for message in logs():
    match = re.match(r"(step (\d+), loss = [^ ]+) \(", message)
    if match:
      found[int(match.group(2))] = match.group(1)
  return found


def _listing(directory):
  return {n: os.path.getmtime(os.path.join(directory, n))
          for n in os.listdir(directory) if n != "train.lock"}


def test_train_runs_to_max_steps_and_a_second_call_resumes_from_there(
    tmp_path, train_tiny, logs, checkpoint_step):
  train_dir = tmp_path / "train"
  runs = _Runs()
  assert train_tiny(train_dir, 4, hooks=[runs], log_every_n_steps=2,
                    save_checkpoint_steps=None) == 4
  assert runs.count == 4
  assert sorted(_steps(logs)) == [2, 4]
  assert checkpoint_step(train_dir) == 4  # The final step, at the end.
  assert train_tiny(train_dir, 6) == 6
  assert sorted(_steps(logs)) == [2, 4, 5, 6]
  assert checkpoint_step(train_dir) == 6
  resumed = _steps(logs)
  # As one run of 6 steps: the variables came from the checkpoint.
  assert train_tiny(tmp_path / "once", 6) == 6
  once = _steps(logs)
  assert [resumed[5], resumed[6]] == [once[5], once[6]]


def test_a_finished_job_trains_no_step(tmp_path, train_tiny, logs,
                                       checkpoint_step):
  train_dir = str(tmp_path / "train")
  assert train_tiny(train_dir, 4, save_checkpoint_steps=2) == 4
  before = _listing(train_dir)
  assert train_tiny(train_dir, 4) == 4
  assert train_tiny(train_dir, 2) == 4
  assert logs()[-1] == (
      "Nothing to train: %s/model.ckpt-4 is at global step 4 and max_steps "
      "is 2 (raise it to train on)" % train_dir)
  assert _listing(train_dir) == before  # No checkpoint, no event file.
  fresh = tmp_path / "fresh"
  assert train_tiny(fresh, 0) == 0
  assert checkpoint_step(fresh) is None
  assert logs()[-1].startswith("Nothing to train: train_dir=")
  assert sorted(_steps(logs)) == [1, 2, 3, 4]  # The first run's only.


def _signal_at_step(step, signum, logs, done, timeout=60):
  """Sends `signum` to this process once `logs()` shows step `step`."""

  def send():
    deadline = time.time() + timeout
    while not any(m.startswith("step %d," % step) for m in logs()):
      if done.is_set() or time.time() > deadline:
        return
      time.sleep(0.01)
    if not done.is_set():
      os.kill(os.getpid(), signum)

  thread = threading.Thread(target=send, daemon=True)
  thread.start()
  return thread


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM],
                         ids=["SIGINT", "SIGTERM"])
def test_a_signal_saves_a_checkpoint_raises_interrupted_and_restores(
    tmp_path, train_tiny, logs, checkpoint_step, signum):
  train_dir = tmp_path / "train"
  before = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
  done = threading.Event()
  thread = _signal_at_step(3, signum, logs, done)
  try:
    with pytest.raises(training.Interrupted) as stopped:
      train_tiny(train_dir, 100000, hooks=[_Runs(secs=0.01)],
                 save_checkpoint_steps=None, save_checkpoint_secs=3600)
  finally:
    done.set()
    thread.join()
  name = signal.Signals(signum).name
  step = stopped.value.step
  assert stopped.value.signum == signum
  assert str(stopped.value) == "%s at step %d" % (name, step)
  assert step >= 3
  assert max(_steps(logs)) == step  # It stopped after that step,
  assert checkpoint_step(train_dir) == step  # which the chief saved.
  assert ("Received %s at step %d: saved a checkpoint, stopping"
          % (name, step)) in logs()
  assert (signal.getsignal(signal.SIGINT),
          signal.getsignal(signal.SIGTERM)) == before


def _summaries(directory):
  """{tag: [step, ...]} of the events files in `directory`."""
  found = {}
  for path in glob.glob(os.path.join(str(directory), "events.out.tfevents.*")):
    for event in tf.train.summary_iterator(path):
      for value in event.summary.value:
        found.setdefault(value.tag, []).append(event.step)
  return found


def test_summaries_are_written_to_the_train_dir_when_train_returns(
    tmp_path, train_tiny):
  train_tiny(tmp_path, 4, summaries=True, save_summaries_steps=2)
  found = _summaries(tmp_path)
  for tag in ["loss", "learning_rate", "w", "w/gradients", "b/gradients",
              "tower_1/targets"]:
    assert sorted(found.get(tag, [])) == [1, 3], tag


def test_a_nan_loss_stops_training_with_a_clear_error(
    tmp_path, train_tiny, tiny_model, checkpoint_step):
  with pytest.raises(FloatingPointError, match=r"^loss is NaN at step \d+: "
                     "training stopped"):
    train_tiny(tmp_path, 50, model=tiny_model(learning_rate=1e30))
  assert checkpoint_step(tmp_path) is not None  # The last one is kept.


def test_a_nan_loss_saves_no_checkpoint_of_its_step(
    tmp_path, train_tiny, tiny_model, checkpoint_step):
  with pytest.raises(FloatingPointError) as error:
    train_tiny(tmp_path, 50, model=tiny_model(learning_rate=1e30))
  step = int(re.match(r"loss is NaN at step (\d+)",
                      str(error.value)).group(1))
  assert checkpoint_step(tmp_path) == step - 1  # "nothing saved from this"


# A user's own loop: TrainDir's scaffold and the signal hook, no train().
USER_LOOP = r"""
import os, sys, time
import tensorflow.compat.v1 as tf
import towers
from towers import training

train_dir, started = sys.argv[1:]
with tf.Graph().as_default():
  step = tf.train.get_or_create_global_step()

  def model_fn(scope, x):
    del scope
    w = tf.get_variable("w", [3, 1], initializer=tf.zeros_initializer())
    return tf.reduce_mean(tf.square(tf.matmul(x, w) - 1.0))

  train_op, t = towers.minimize(
      model_fn, tf.train.GradientDescentOptimizer(0.01), 2,
      inputs=tf.ones([4, 3]), devices=["/cpu:0", "/cpu:1"],
      global_step=step)
  with training.TrainDir(train_dir) as guard:
    hook = training.StopOnSignalHook()
    with tf.train.MonitoredTrainingSession(
        checkpoint_dir=train_dir, scaffold=guard.scaffold(), hooks=[hook],
        config=towers.virtual_cpu_config(2), save_checkpoint_secs=3600,
        save_summaries_steps=None, save_summaries_secs=None,
        log_step_count_steps=0) as sess:
      runs = 0
      while not sess.should_stop():
        sess.run(train_op)
        runs += 1
        if runs == 3:
          open(started, "w").close()
        time.sleep(0.01)
print("stopped by signal %s after %d steps" % (hook.received, runs))
"""


def test_a_users_own_loop_is_guarded_and_stops_saved_on_sigterm(
    tmp_path, python, wait_until, checkpoint_step):
  train_dir = str(tmp_path / "train")
  started = str(tmp_path / "started")
  script = tmp_path / "user_loop.py"
  script.write_text(USER_LOOP)
  proc = python.start([str(script), train_dir, started],
                      stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                      text=True)
  wait_until(lambda: os.path.exists(started), 60, "3 steps", proc)
  with pytest.raises(training.TrainDirError,
                     match=r"in use by another trainer \(pid %d holds"
                     % proc.pid):
    with training.TrainDir(train_dir):
      pass
  sent = time.time()
  proc.send_signal(signal.SIGTERM)
  out, err = proc.communicate(timeout=30)
  took = time.time() - sent
  assert proc.returncode == 0, err[-2000:]
  assert took < 15, took  # A step and a save, not a timeout.
  match = re.fullmatch(r"stopped by signal %d after (\d+) steps\n"
                       % signal.SIGTERM, out)
  assert match, (out, err[-2000:])
  steps = int(match.group(1))
  assert steps >= 3
  assert checkpoint_step(train_dir) == steps  # Its last step, saved.
  assert tf.train.load_variable(train_dir, "global_step") == steps
  with open(os.path.join(train_dir, "checkpoint")) as f:
    assert 'model_checkpoint_path: "model.ckpt-%d"' % steps in f.read()
  assert "Traceback" not in err
  with training.TrainDir(train_dir) as directory:  # Released.
    assert directory.global_step == steps


def test_a_dict_of_train_ops_runs_each_in_turn_as_one_step(tmp_path,
                                                           logs):
  # Two losses, each with its own variable: a step runs "a" then "b", the
  # hooks (step count, log line, stop) see the last run.
  with tf.Graph().as_default():
    x = tf.constant([[1.0], [2.0], [3.0], [4.0]])

    def model_fn(scope, x):
      del scope
      a = tf.get_variable("a", [], initializer=tf.zeros_initializer())
      b = tf.get_variable("b", [], initializer=tf.zeros_initializer())
      return {"a": tf.reduce_mean(tf.square(x - a)),
              "b": tf.reduce_mean(tf.square(x * a - b))}

    global_step = tf.train.get_or_create_global_step()
    opts = {key: tf.train.GradientDescentOptimizer(0.1) for key in "ab"}
    train_ops, t = towers.minimize(model_fn, opts, 2, inputs=x,
                                   devices=["/cpu:0", "/cpu:1"],
                                   var_list={"a": "a", "b": "b"},
                                   global_step=global_step)
    runs = _Runs()
    assert training.train(
        train_ops, t, train_dir=str(tmp_path / "train"), max_steps=3,
        examples_per_step=4, config=towers.virtual_cpu_config(2),
        log_every_n_steps=1, hooks=[runs]) == 3
  assert runs.count == 3
  lines = [m for m in logs() if m.startswith("step ")]
  assert [re.match(r"step (\d+), loss a = \d+\.\d+, b = \d+\.\d+ \(",
                   m).group(1) for m in lines] == ["1", "2", "3"], lines
  reader = tf.train.load_checkpoint(str(tmp_path / "train"))
  # Each step's "b" update reads "a" as that step's "a" update left it.
  a = b = 0.0
  for _ in range(3):
    a -= 0.1 * 2 * (a - 2.5)
    b += 0.1 * 2 * (2.5 * a - b)
  assert abs(reader.get_tensor("a") - a) < 1e-5
  assert abs(reader.get_tensor("b") - b) < 1e-5
  assert reader.get_tensor("global_step") == 3


def test_each_key_of_a_dict_reads_only_its_own_inputs_and_summaries(
    tmp_path, logs):
  # Loss "a" reads the pipeline, "b" does not: "b"'s run, its step line and
  # its summaries pull no batch. The pipeline holds exactly the batches of
  # three steps (two towers, one each), so one extra read would end the
  # training early.
  train_dir = str(tmp_path / "train")
  with tf.Graph().as_default():
    batches = tf.data.Dataset.from_tensor_slices(
        tf.reshape(tf.range(12.0), [6, 2, 1]))
    iterator = tf.data.make_one_shot_iterator(batches)

    def model_fn(scope, x):
      del scope
      a = tf.get_variable("a", [], initializer=tf.zeros_initializer())
      b = tf.get_variable("b", [], initializer=tf.zeros_initializer())
      tf.summary.scalar("x_mean", tf.reduce_mean(x))
      return {"a": tf.reduce_mean(tf.square(x - a)),
              "b": tf.square(b - 2.0)}

    global_step = tf.train.get_or_create_global_step()
    opts = {key: tf.train.GradientDescentOptimizer(0.1) for key in "ab"}
    train_ops, t = towers.minimize(model_fn, opts, 2,
                                   inputs=iterator.get_next,
                                   devices=["/cpu:0", "/cpu:1"],
                                   var_list={"a": "a", "b": "b"},
                                   global_step=global_step)
    summary_op = training.training_summaries(t)
    assert sorted(summary_op) == ["a", "b"]
    assert training.train(
        train_ops, t, train_dir=train_dir, max_steps=3, examples_per_step=4,
        config=towers.virtual_cpu_config(2), log_every_n_steps=1,
        summary_op=summary_op, save_summaries_steps=1) == 3
  lines = [m for m in logs() if m.startswith("step ")]
  assert len(lines) == 3 and all(
      re.match(r"step \d, loss a = \d+\.\d+, b = \d+\.\d+ \(", m)
      for m in lines), lines
  found = _summaries(train_dir)
  for tag in ["loss/a", "loss/b", "a", "a/gradients", "b", "b/gradients",
              "tower_1/x_mean"]:
    assert sorted(found.get(tag, [])) == [1, 2, 3], (tag, found)


def test_summaries_under_keys_the_train_ops_lack_are_refused(tmp_path):
  with tf.Graph().as_default():
    op = tf.no_op()
    with pytest.raises(ValueError, match=r"summary_op is a dict with the "
                       r"keys 'c', but the train ops' keys are 'a', 'b'"):
      training.train({"a": op, "b": op}, None, train_dir=str(tmp_path),
                     max_steps=1, examples_per_step=1,
                     summary_op={"c": tf.constant(b"")})
  assert not os.listdir(tmp_path)


def test_a_dict_of_train_ops_with_parameter_servers_is_refused(tmp_path):
  # A real worker task of a cluster with one ps, both served here.
  ps_port, worker_port = training.free_ports(2)
  ps_hosts, worker_hosts = (["127.0.0.1:%d" % ps_port],
                            ["127.0.0.1:%d" % worker_port])
  tf.train.Server(tf.train.ClusterSpec({"ps": ps_hosts,
                                        "worker": worker_hosts}),
                  job_name="ps", task_index=0)
  task = training.start_task(ps_hosts, worker_hosts, "worker", 0, 2,
                             startup_timeout_secs=30)
  assert not task.collective
  with tf.Graph().as_default():
    op = tf.no_op()
    with pytest.raises(ValueError, match=r"dict of train ops \('d', 'g'\).*"
                       r"with parameter servers"):
      training.train({"d": op, "g": op}, None, train_dir=str(tmp_path),
                     max_steps=1, examples_per_step=1, task=task)
  assert not os.listdir(tmp_path)  # Refused before the directory is used.
