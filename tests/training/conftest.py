"""Shared by the towers.training tests: a tiny model, logs and processes.

The model is linear, on constant data, trained on two virtual CPU towers:
a step takes milliseconds, so a test pays for its session only.
"""

import collections
import os
import subprocess
import sys
import time

import numpy as np
import pytest
import tensorflow.compat.v1 as tf

import towers
from towers import training

NUM_TOWERS = 2
BATCH = 8  # Examples per step, over both towers.

Model = collections.namedtuple("Model", ["graph", "train_op", "t",
                                         "global_step"])


def _build(learning_rate=0.1, global_step=True, **minimize_kwargs):
  """y = x w + b by least squares on 2 towers, in a graph of its own.

  Each tower also writes a scalar summary, ``targets``. `minimize_kwargs`
  go to `towers.minimize` (compute_dtype, loss_scale, accumulate_steps).
  """
  rng = np.random.RandomState(0)
  x = rng.normal(0, 1, (BATCH, 3)).astype(np.float32)
  y = x.dot(np.array([[1.0], [-2.0], [0.5]], np.float32)) + 0.3

  # float32 master weights, used in the towers' compute_dtype.
  dtype = tf.as_dtype(minimize_kwargs.get("compute_dtype") or tf.float32)

  def model_fn(scope, features, targets):
    del scope
    w = tf.get_variable("w", [3, 1], dtype,
                        initializer=tf.zeros_initializer())
    b = tf.get_variable("b", [1], dtype, initializer=tf.zeros_initializer())
    predicted = tf.matmul(tf.cast(features, w.dtype), w) + b
    tf.summary.scalar("targets", tf.reduce_mean(targets))
    return tf.reduce_mean(tf.square(tf.cast(predicted, tf.float32) - targets))

  graph = tf.Graph()
  with graph.as_default():
    step = tf.train.get_or_create_global_step() if global_step else None
    train_op, t = towers.minimize(
        model_fn, tf.train.GradientDescentOptimizer(learning_rate),
        NUM_TOWERS, inputs=(tf.constant(x), tf.constant(y)),
        devices=["/cpu:0", "/cpu:1"], global_step=step, **minimize_kwargs)
  return Model(graph, train_op, t, step)


def _train(train_dir, max_steps, model=None, summaries=False, **kwargs):
  """`training.train` of a new tiny model (or `model`) into `train_dir`.

  Logs every step and saves a checkpoint every step unless told otherwise;
  with `summaries`, writes `training_summaries` every step.
  """
  model = model or _build()
  kwargs = dict(dict(examples_per_step=BATCH, log_every_n_steps=1,
                     config=towers.virtual_cpu_config(NUM_TOWERS),
                     save_checkpoint_steps=1, save_summaries_steps=1),
                **kwargs)
  with model.graph.as_default():
    if summaries:
      kwargs["summary_op"] = training.training_summaries(
          model.t, tf.constant(0.1))
    return training.train(model.train_op, model.t, train_dir=str(train_dir),
                          max_steps=max_steps, **kwargs)


@pytest.fixture(scope="session")
def tiny_model():
  """`build(learning_rate=0.1, global_step=True, **minimize_kwargs)`,
  returning a `Model`."""
  return _build


@pytest.fixture(scope="session")
def train_tiny():
  """`train(train_dir, max_steps, model=None, summaries=False, **kwargs)`:
  `training.train` of a tiny model; returns the step reached."""
  return _train


@pytest.fixture
def config():
  """The session config of the model's two virtual CPU towers."""
  return towers.virtual_cpu_config(NUM_TOWERS)



def checkpoint_step(directory):
  """The step of `directory`'s latest checkpoint (by its state file)."""
  path = tf.train.latest_checkpoint(str(directory))
  return None if path is None else int(path.rsplit("-", 1)[1])


def wait_until(done, timeout, what, proc=None):
  """Polls `done()`; fails at `timeout`, or at once if `proc` has exited."""
  deadline = time.time() + timeout
  while not done():
    if proc is not None and proc.poll() is not None:
      raise AssertionError("the process exited with %d before %s"
                           % (proc.returncode, what))
    if time.time() > deadline:
      raise AssertionError("timed out after %ss waiting for %s"
                           % (timeout, what))
    time.sleep(0.05)


@pytest.fixture(name="checkpoint_step", scope="session")
def checkpoint_step_fixture():
  """`checkpoint_step(directory)`: its latest checkpoint's step, or None."""
  return checkpoint_step


@pytest.fixture(name="wait_until", scope="session")
def wait_until_fixture():
  """`wait_until(done, timeout, what, proc=None)`."""
  return wait_until


class Python:
  """Runs this Python in subprocesses; kills those left at the test's end."""

  def __init__(self):
    self.env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    self._procs = []

  def run(self, args, timeout, **kwargs):
    """`subprocess.run` of ``python *args``, its output as text."""
    return subprocess.run([sys.executable] + list(args), env=self.env,
                          capture_output=True, text=True, timeout=timeout,
                          check=False, **kwargs)

  def start(self, args, **kwargs):
    """`subprocess.Popen` of ``python *args``."""
    kwargs.setdefault("env", self.env)
    proc = subprocess.Popen(  # pylint: disable=consider-using-with
        [sys.executable] + list(args), **kwargs)
    self._procs.append(proc)
    return proc

  def kill_all(self):
    for proc in self._procs:
      if proc.poll() is None:
        proc.kill()
      proc.wait()


@pytest.fixture
def python():
  """A `Python`: subprocesses that end with the test."""
  runner = Python()
  yield runner
  runner.kill_all()
