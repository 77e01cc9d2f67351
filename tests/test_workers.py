"""Towers across workers: collective all-reduce between real tf.train.Server
processes on loopback, against one worker with all the towers.

Each run is a process of ``workers_run.py``; a cluster's workers run side by
side and every collective runs under ``operation_timeout_in_ms``, and each
process under a timeout, so a hang fails the test instead of stalling it.
"""

import importlib.util
import json
import os
import subprocess
import sys
import time

import numpy as np
import pytest
import tensorflow.compat.v1 as tf

import towers
from towers import _tf_versions
from towers import training

# Clusters of workers that all-reduce: refused where collectives cannot time
# out (TensorFlow 1.15), which test_workers_are_refused_without_timeouts
# checks.
needs_timeouts = pytest.mark.skipif(
    not _tf_versions.collectives_time_out(),
    reason="%s's collectives ignore operation_timeout_in_ms: towers refuses "
    "num_workers > 1 there" % _tf_versions.describe())

HERE = os.path.dirname(os.path.abspath(__file__))
TIMEOUT_SECS = 300


def _ports(count):
  return ",".join(map(str, training.free_ports(count)))


def _start(pytestconfig, out, *flags, env=None):
  args = [sys.executable, os.path.join(HERE, "workers_run.py"),
          "--out", str(out)] + [str(f) for f in flags]
  if pytestconfig.getoption("--ref-variables"):
    args.append("--ref-variables")
  return subprocess.Popen(args, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True,
                          env=env or dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2"))


def _finish(procs):
  """Waits for every process; returns each one's last JSON line."""
  deadline = time.time() + TIMEOUT_SECS
  outputs = []
  try:
    for proc in procs:
      outputs.append(proc.communicate(
          timeout=max(1, deadline - time.time())))
    # Every failed process's end, so a cluster's failure shows each side.
    failed = ["process %d (%s) exited with %d:\n%s" % (
        i, " ".join(proc.args[2:]), proc.returncode, err[-2000:])
              for i, (proc, (_, err)) in enumerate(zip(procs, outputs))
              if proc.returncode != 0]
    assert not failed, "\n".join(failed)
    return [json.loads(out.strip().splitlines()[-1]) for out, _ in outputs]
  finally:
    for proc in procs:
      if proc.poll() is None:
        proc.kill()
        proc.wait()


def _cluster(pytestconfig, tmp, name, towers_per_worker, flags=(),
             chief_flags=(), env=None):
  """Starts 2 workers; worker 1 starts from other values (seed 1)."""
  ports = _ports(2)
  return [_start(pytestconfig, tmp / ("%s%d.npz" % (name, k)),
                 "--task", k, "--ports", ports, "--towers",
                 towers_per_worker, "--init_seed", k, *flags,
                 *(chief_flags if k == 0 else ()), env=env)
          for k in range(2)]


@pytest.fixture(scope="module")
def runs(pytestconfig, tmp_path_factory):
  """2 workers x 2 towers, and one worker of 4 towers (replicated with the
  collective, and the classic one-copy mode), 20 steps each."""
  tmp = tmp_path_factory.mktemp("workers")
  procs = _cluster(pytestconfig, tmp, "w", 2,
                   chief_flags=("--save", tmp / "model.ckpt"))
  procs.append(_start(pytestconfig, tmp / "ref.npz", "--towers", 4))
  procs.append(_start(pytestconfig, tmp / "cpu.npz", "--towers", 4,
                      "--variable_device", "cpu"))
  results = _finish(procs)
  return tmp, results


def _load(path):
  with np.load(path) as data:
    return {k: data[k] for k in data.files}


def _gap(a, b):
  return max(float(np.max(np.abs(a[k].astype(np.float64) - b[k])))
             for k in a)


@needs_timeouts
def test_two_workers_of_two_towers_equal_one_worker_of_four(runs):
  tmp, results = runs
  chief, other = _load(tmp / "w0.npz"), _load(tmp / "w1.npz")
  reference, one_copy = _load(tmp / "ref.npz"), _load(tmp / "cpu.npz")
  assert sorted(chief) == sorted(reference)
  assert all(len(v) == 21 for v in chief.values())
  # Every step of the 20, every variable: the model, its Momentum slots,
  # the batch-norm statistics (synchronized across all 4 towers), the
  # embedding (a sparse gradient) and the global step.
  # Bitwise the replicated collective's: the same group of 4, one sum order.
  assert _gap(chief, reference) == 0.0
  assert _gap(chief, one_copy) <= 1e-6
  assert list(chief["global_step"]) == list(range(21))
  # The workers stay identical, bit for bit, from the broadcast on.
  assert _gap(chief, other) == 0.0
  for result in results[:2]:
    assert result["copies"] > 0 and result["copies_gap"] == 0.0
    assert result["global_step"] == 20


@needs_timeouts
def test_the_broadcast_gives_every_worker_the_chiefs_initial_values(runs):
  tmp, _ = runs
  chief, other = _load(tmp / "w0.npz"), _load(tmp / "w1.npz")
  # Worker 1 initialized with other values (seed 1); the step-0 rows are
  # what the first step started from.
  for name in chief:
    np.testing.assert_array_equal(chief[name][0], other[name][0])
  seed1 = np.random.RandomState(1)
  assert not np.allclose(seed1.randn(6, 8), other["w1"][0])


@needs_timeouts
def test_the_chiefs_checkpoint_restores_into_a_single_device_graph(runs):
  tmp, _ = runs
  chief = _load(tmp / "w0.npz")
  names = [n for n, _ in tf.train.list_variables(str(tmp / "model.ckpt"))]
  assert sorted(names) == sorted(chief)
  assert not [n for n in names if "replica_" in n or "tower" in n]
  with tf.Graph().as_default():
    x = tf.zeros([4, 6])
    hidden = tf.matmul(x, tf.get_variable("w1", [6, 8])) + tf.gather(
        tf.get_variable("emb", [10, 8]), tf.zeros([4], tf.int32))
    hidden = towers.batch_normalization(tf.nn.relu(hidden), training=False)
    logits = tf.matmul(hidden, tf.get_variable("w2", [8, 3]))
    model = sorted(tf.global_variables(), key=lambda v: v.op.name)
    with tf.Session() as sess:
      tf.train.Saver().restore(sess, str(tmp / "model.ckpt"))
      values = sess.run(model)
      assert np.all(np.isfinite(sess.run(logits)))
  for var, value in zip(model, values):
    np.testing.assert_array_equal(value, chief[var.op.name][-1])


@needs_timeouts
def test_a_restarted_cluster_resumes_from_the_chiefs_checkpoint(
    pytestconfig, runs):
  tmp, _ = runs
  saved = _load(tmp / "w0.npz")
  results = _finish(_cluster(pytestconfig, tmp, "resumed", 2,
                             flags=("--steps", 2),
                             chief_flags=("--restore", tmp / "model.ckpt")))
  chief, other = _load(tmp / "resumed0.npz"), _load(tmp / "resumed1.npz")
  # Only the chief restored; worker 1 (initialized from seed 1) got the
  # checkpoint's values from it, the global step included.
  for name in saved:
    np.testing.assert_array_equal(chief[name][0], saved[name][-1])
    np.testing.assert_array_equal(other[name][0], saved[name][-1])
  assert list(other["global_step"]) == [20, 21, 22]
  assert _gap(chief, other) == 0.0
  assert [r["global_step"] for r in results] == [22, 22]


@needs_timeouts
def test_one_tower_per_worker_equals_one_worker_of_two(pytestconfig,
                                                     tmp_path):
  procs = _cluster(pytestconfig, tmp_path, "w", 1, flags=("--steps", 8))
  procs.append(_start(pytestconfig, tmp_path / "ref.npz", "--towers", 2,
                      "--steps", 8))
  _finish(procs)
  chief = _load(tmp_path / "w0.npz")
  assert _gap(chief, _load(tmp_path / "ref.npz")) == 0.0
  assert _gap(chief, _load(tmp_path / "w1.npz")) == 0.0


@needs_timeouts
def test_accumulated_micro_batches_across_workers_equal_one_worker_of_four(
    pytestconfig, tmp_path):
  flags = ("--steps", 4, "--accumulate_steps", 3)
  procs = _cluster(pytestconfig, tmp_path, "w", 2, flags=flags)
  procs.append(_start(pytestconfig, tmp_path / "ref.npz", "--towers", 4,
                      *flags))
  results = _finish(procs)
  chief = _load(tmp_path / "w0.npz")
  # 4 updates of 3 micro-batches each: the global step counts updates.
  assert list(chief["global_step"]) == list(range(5))
  assert float(np.max(np.abs(chief["w1"][-1] - chief["w1"][0]))) > 1e-3
  assert _gap(chief, _load(tmp_path / "ref.npz")) == 0.0
  assert _gap(chief, _load(tmp_path / "w1.npz")) == 0.0
  assert [r["global_step"] for r in results] == [4, 4, 4]
  assert all(r["copies_gap"] == 0.0 for r in results)


@needs_timeouts
def test_every_regularizer_style_trains_across_workers_as_on_one_device(
    pytestconfig, tmp_path, legacy_keras_env):
  # tf.layers', tf-slim's (where it imports), a Keras layer's,
  # tf.get_variable's and the CIFAR-10 tutorial's weight decay; the one
  # device is one tower holding the whole global batch.
  flags = ("--model", "regularized", "--steps", 3)
  procs = _cluster(pytestconfig, tmp_path, "w", 2, flags=flags,
                   env=legacy_keras_env)
  procs.append(_start(pytestconfig, tmp_path / "one.npz", *flags, "--towers",
                      1, "--per_tower", 16, "--variable_device", "cpu",
                      env=legacy_keras_env))
  results = _finish(procs)
  chief, one = _load(tmp_path / "w0.npz"), _load(tmp_path / "one.npz")
  assert sorted(chief) == sorted(one)
  assert {"fc1/kernel", "emb", "w2", "dense/kernel"} <= set(chief)
  assert ("fc2/weights" in chief) == bool(importlib.util.find_spec("tf_slim"))
  assert _gap(chief, one) <= 1e-5
  assert float(np.max(np.abs(one["fc1/kernel"][-1] -
                             one["fc1/kernel"][0]))) > 1e-3
  assert _gap(chief, _load(tmp_path / "w1.npz")) == 0.0
  assert all(r["copies_gap"] == 0.0 for r in results[:2])


@needs_timeouts
def test_a_gan_trains_across_workers_as_on_one_device(pytestconfig, tmp_path):
  # D step then G step, each all-reduced over every worker's towers, the
  # generator's batch norm synchronized across them; the one device is one
  # tower holding the whole global batch.
  flags = ("--model", "gan", "--steps", 3)
  procs = _cluster(pytestconfig, tmp_path, "w", 2, flags=flags)
  procs.append(_start(pytestconfig, tmp_path / "one.npz", *flags, "--towers",
                      1, "--per_tower", 16, "--variable_device", "cpu"))
  results = _finish(procs)
  chief, one = _load(tmp_path / "w0.npz"), _load(tmp_path / "one.npz")
  assert sorted(chief) == sorted(one)
  assert {"g_w1", "g_bn/moving_mean", "d_w1", "d_w1/Momentum"} <= set(chief)
  assert _gap(chief, one) <= 1e-5
  assert float(np.max(np.abs(one["g_w2"][-1] - one["g_w2"][0]))) > 1e-3
  assert _gap(chief, _load(tmp_path / "w1.npz")) == 0.0
  assert all(r["copies_gap"] == 0.0 and r["global_step"] == 3
             for r in results)


@needs_timeouts
def test_a_missing_peer_fails_the_step_under_the_operation_timeout(
    pytestconfig, tmp_path):
  # Worker 0 (the group leader) alone: its first collective waits for
  # worker 1 until operation_timeout_in_ms (3 s), then fails.
  start = time.time()
  proc = _start(pytestconfig, tmp_path / "w0.npz", "--task", 0, "--ports",
                _ports(2), "--towers", 2, "--timeout_ms", 3000)
  _, err = proc.communicate(timeout=TIMEOUT_SECS)
  assert proc.returncode != 0
  assert "DeadlineExceededError" in err
  assert time.time() - start < 120


def _model_fn(_, x):
  w = tf.get_variable("w", [3, 1])
  return tf.reduce_mean(tf.matmul(x, w))


WORKER_1 = ["/job:worker/task:1/cpu:0", "/job:worker/task:1/cpu:1"]


@pytest.mark.parametrize("kwargs, error, words", [
    (dict(num_workers=0), ValueError, "num_workers >= 1"),
    (dict(num_workers="2"), TypeError, "num_workers to be an int"),
    (dict(num_workers=2, variable_device="cpu"), ValueError,
     "variable_device='replicated'"),
    (dict(num_workers=2, all_reduce="ring"), ValueError,
     "all_reduce='collective'"),
    (dict(num_workers=2, devices=["/cpu:0", "/cpu:1"]), ValueError,
     "tower_devices(n, task="),
    (dict(num_workers=2, devices=["/job:worker/task:0/cpu:0",
                                  "/job:worker/task:1/cpu:1"]), ValueError,
     "own task"),
    (dict(num_workers=2, devices=["/job:worker/task:2/cpu:0",
                                  "/job:worker/task:2/cpu:1"]), ValueError,
     "tasks 0-1"),
])
def test_bad_num_workers_are_clear_errors(kwargs, error, words):
  kwargs = dict(dict(devices=WORKER_1, variable_device="replicated"),
                **kwargs)
  with tf.Graph().as_default():
    with pytest.raises(error) as raised:
      towers.build_towers(_model_fn, tf.train.GradientDescentOptimizer(0.1),
                          2, inputs=tf.zeros([4, 3]), **kwargs)
  assert words in str(raised.value)


@needs_timeouts
@pytest.mark.skipif(_tf_versions.collectives_time_out(),
                    reason="%s's collectives time out: towers across workers "
                    "run there" % _tf_versions.describe())
def test_workers_are_refused_without_timeouts():
  with tf.Graph().as_default():
    with pytest.raises(ValueError) as raised:
      towers.build_towers(_model_fn, tf.train.GradientDescentOptimizer(0.1),
                          2, inputs=tf.zeros([4, 3]), devices=WORKER_1,
                          variable_device="replicated", num_workers=2)
  for words in ["num_workers=2", "TensorFlow %s" % tf.__version__,
                "wait forever", "TensorFlow 2.12 or later",
                "tf.train.replica_device_setter"]:
    assert words in str(raised.value)


@needs_timeouts
def test_one_graph_is_one_worker():
  with tf.Graph().as_default():
    towers.build_towers(_model_fn, tf.train.GradientDescentOptimizer(0.1), 2,
                        inputs=tf.zeros([4, 3]), devices=WORKER_1,
                        variable_device="replicated", num_workers=2)
    with tf.variable_scope("other"), pytest.raises(ValueError) as raised:
      towers.build_towers(_model_fn, tf.train.GradientDescentOptimizer(0.1),
                          2, inputs=tf.zeros([4, 3]), devices=WORKER_1,
                          variable_device="replicated", num_workers=3)
  assert "one graph is one worker" in str(raised.value)


@needs_timeouts
def test_the_graph_of_a_worker_reduces_across_workers():
  with tf.Graph().as_default() as graph:
    train_op, built = towers.minimize(
        _model_fn, tf.train.GradientDescentOptimizer(0.1), 2,
        inputs=tf.zeros([4, 3]), devices=WORKER_1,
        variable_device="replicated", num_workers=2)
    with tf.control_dependencies(
        [tf.train.Scaffold.default_local_init_op()]):
      sync = towers.broadcast_variables()
  assert built.all_reduce == "collective"
  reduces = [op for op in graph.get_operations()
             if op.type == "CollectiveReduceV2"]
  assert reduces and {op.device for op in reduces} == {
      "/job:worker/task:1/device:CPU:0", "/job:worker/task:1/device:CPU:1"}
  # One group of the 4 towers of both workers (its size is an input).
  sizes = {int(tf.get_static_value(op.inputs[1])) for op in reduces}
  assert sizes == {4}
  # Worker 1 receives; the chief sends.
  kinds = {op.type for op in graph.get_operations()
           if op.type.startswith("CollectiveBcast")}
  assert kinds == {"CollectiveBcastRecvV2"}
  assert train_op is not None and sync.type == "NoOp"


@needs_timeouts
def test_each_set_of_a_workers_towers_spans_the_workers_its_plan_names():
  seen = []

  def model_fn(scope, x):
    seen.append(towers.tower_context().num_workers)
    return _model_fn(scope, x)

  with tf.Graph().as_default() as graph:
    built = towers.build_towers(
        model_fn, tf.train.GradientDescentOptimizer(0.1), 2,
        inputs=tf.zeros([4, 3]), devices=WORKER_1,
        variable_device="replicated", num_workers=2)
    # Lists made by hand after the towers: found by their copies.
    scaled = [[(g * 0.5, v) for g, v in pairs] for pairs in built.tower_grads]
    towers.average_gradients(scaled)
    # Towers of this worker alone (an evaluation's) span what they name.
    towers.infer(lambda scope, x: seen.append(
        towers.tower_context().num_workers) or x, 2, inputs=tf.zeros([4]),
                 devices=WORKER_1)
  assert seen == [2, 2, 1, 1]
  sizes = {int(tf.get_static_value(op.inputs[1]))
           for op in graph.get_operations() if op.type == "CollectiveReduceV2"}
  assert sizes == {4}


def test_broadcast_variables_on_one_worker_is_a_no_op_and_checks_its_input():
  with tf.Graph().as_default():
    tf.get_variable("w", [2])
    assert towers.broadcast_variables().type == "NoOp"
    with pytest.raises(TypeError) as raised:
      towers.broadcast_variables([tf.zeros([2])])
  assert "expected var_list to hold variables" in str(raised.value)
