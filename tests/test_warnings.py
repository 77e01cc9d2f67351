"""No warning points into towers/: building every feature and running a step
of it logs no TensorFlow deprecation and raises no Python warning whose
location is a file of the package (named in the message, or, for a
deprecation behind one of TensorFlow's wrappers, the caller of the wrapper).

TensorFlow logs each deprecated function once per process, the first time
anything calls it, so an earlier test would hide it: the features are built
in a process of their own, this file run as a script, with the run's kind of
variables. A canary, a throwaway module that calls deprecated functions and
warns, goes first: a capture that sees nothing fails the test. Not built
here: parameter-server clusters (`training.start_task` with ps hosts).
Usage (the test starts it): python test_warnings.py CANARY [--ref-variables]
"""

import argparse
import importlib.util
import json
import logging
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import warnings

import numpy as np
import pytest
import tensorflow.compat.v1 as tf

import models
import towers
from towers import training

TOWERS_DIR = os.path.dirname(os.path.realpath(towers.__file__))
# The repository: the script imports the towers the test runs.
ROOT = os.path.dirname(TOWERS_DIR)
TIMEOUT_SECS = 300
DEVICES = ["/cpu:0", "/cpu:1"]
BATCH = 8
# A file:line in a message (TensorFlow's deprecations say "From FILE:LINE").
LOCATION = re.compile(r"([^\s:'\"()]+\.py):\d+")
# The frames between a deprecated function's caller and the record: the
# logging module's and TensorFlow's decorators' (2.x's dispatch wrapper
# stands between some deprecated functions and their caller, and the message
# names the wrapper).
WRAPPERS = tuple(os.sep + os.path.join(*p) for p in [
    ("logging", "__init__.py"), ("python", "util", "deprecation.py"),
    ("python", "util", "dispatch.py"), ("python", "util", "tf_decorator.py"),
    ("python", "util", "traceback_utils.py"),
    ("python", "platform", "tf_logging.py")])

# Deprecated functions towers does not call (the first call anywhere would
# hide towers' own), to_float behind 2.x's dispatch wrapper.
CANARY = '''
import warnings
import tensorflow.compat.v1 as tf


def run():
  with tf.Graph().as_default() as graph:
    tf.constant(1.0, name="c")
    tf.graph_util.extract_sub_graph(graph.as_graph_def(), ["c"])
    tf.to_float(tf.constant(1))
  warnings.warn("the canary's warning")
'''


# The script's side: every feature, each in a graph of its own, run for a
# step.


def config():
  proto = towers.virtual_cpu_config(4)
  # A collective missing a member fails the step instead of hanging it.
  proto.operation_timeout_in_ms = 60000
  return proto


def batch():
  rng = np.random.RandomState(0)
  return (rng.normal(size=(BATCH, 6)).astype(np.float32),
          rng.randint(0, 10, BATCH).astype(np.int32),
          rng.randint(0, 3, BATCH).astype(np.int32))


def inputs():
  return tuple(tf.constant(t) for t in batch())


def model_fn(dtype=tf.float32, training_tensor=False):
  """A dense layer with weight decay, an embedding (a sparse gradient),
  synchronized batch norm on a 4-D (fused) and a 2-D input, cross-entropy."""

  def fn(scope, x, ids, y):
    del scope
    decay = lambda w: 1e-3 * tf.nn.l2_loss(w)  # noqa: E731
    w1 = tf.get_variable("w1", [6, 8], dtype, regularizer=decay)
    emb = tf.get_variable("emb", [10, 8], dtype)
    hidden = tf.matmul(tf.cast(x, dtype), w1) + tf.gather(emb, ids)
    is_training = tf.placeholder_with_default(True, []) if training_tensor \
        else True
    hidden = towers.batch_normalization(tf.reshape(hidden, [-1, 2, 2, 2]),
                                        training=is_training, name="bn1")
    hidden = tf.nn.relu(tf.reshape(hidden, [-1, 8]))
    hidden = towers.batch_normalization(hidden, training=is_training)
    w2 = tf.get_variable("w2", [8, 3], dtype)
    logits = tf.cast(tf.matmul(hidden, w2), tf.float32)
    return (tf.losses.sparse_softmax_cross_entropy(y, logits) +
            tf.losses.get_regularization_loss())

  return fn


def centered(scope, x, ids, y):
  """The model on inputs centred on the global batch's mean, a sum of the
  tower context."""
  totals = towers.tower_context().all_sum(tf.stack(
      [tf.reduce_sum(x), tf.cast(tf.size(x), tf.float32)]))
  return model_fn()(scope, x - totals[0] / totals[1], ids, y)


def opt():
  return tf.train.MomentumOptimizer(0.1, 0.9)


def run_steps(graph, fetches, steps=1):
  with tf.Session(graph=graph, config=config()) as sess:
    sess.run(tf.global_variables_initializer())
    sess.run(tf.local_variables_initializer())
    for _ in range(steps):
      for fetch in fetches:
        sess.run(fetch)


def minimize(steps=1, model=None, optimizer=None, **kwargs):
  with tf.Graph().as_default() as graph:
    train_op, _ = towers.minimize(
        model or model_fn(), optimizer or opt(), 2, inputs=inputs(),
        devices=DEVICES, global_step=tf.train.get_or_create_global_step(),
        clip_norm=1.0, **kwargs)
    run_steps(graph, [train_op], steps)


def several_losses():
  """A GAN: a generator with synchronized batch norm, a discriminator."""

  def gan(scope, x, ids, y):
    del scope, y
    z = tf.one_hot(ids, 10)
    with tf.variable_scope("generator"):
      fake = towers.batch_normalization(tf.matmul(z, tf.get_variable(
          "w", [10, 6])), training=True)
    with tf.variable_scope("discriminator"):
      w = tf.get_variable("w", [6, 1])
    d_real, d_fake = tf.matmul(x, w), tf.matmul(fake, w)
    xent = lambda logits, label: tf.reduce_mean(  # noqa: E731
        tf.nn.sigmoid_cross_entropy_with_logits(
            labels=tf.fill(tf.shape(logits), label), logits=logits))
    return {"d": xent(d_real, 1.0) + xent(d_fake, 0.0),
            "g": xent(d_fake, 1.0)}

  with tf.Graph().as_default() as graph:
    train_ops, _ = towers.minimize(
        gan, {"d": opt(), "g": tf.train.GradientDescentOptimizer(0.1)}, 2,
        inputs=inputs(), devices=DEVICES,
        var_list={"d": "discriminator/", "g": "generator/"},
        global_step=tf.train.get_or_create_global_step())
    run_steps(graph, [train_ops["d"], train_ops["g"]])


def by_hand(variable_device):
  """build_towers, average_gradients, a clip, opt.apply_gradients; and the
  same through accumulate_gradients."""
  with tf.Graph().as_default() as graph:
    global_step = tf.train.get_or_create_global_step()
    optimizer = tf.train.AdamOptimizer(1e-3)
    t = towers.build_towers(model_fn(), optimizer, 2, inputs=inputs(),
                            devices=DEVICES, variable_device=variable_device)
    grads, variables = zip(*towers.average_gradients(t.tower_grads,
                                                     t.weights))
    grads, _ = tf.clip_by_global_norm(grads, 1.0)
    with tf.control_dependencies(t.update_ops):
      train_op = optimizer.apply_gradients(list(zip(grads, variables)),
                                           global_step=global_step)

    def apply_fn(tower_grads, weights):
      return optimizer.apply_gradients(
          towers.average_gradients(tower_grads, weights))

    accumulated, _ = towers.accumulate_gradients(t, apply_fn, 2)
    run_steps(graph, [train_op, accumulated], 2)


def infer(variable_device):
  with tf.Graph().as_default() as graph:
    x, ids, _ = inputs()

    def forward(scope, x, ids):
      del scope
      w = tf.get_variable("w", [6, 8])
      emb = tf.get_variable("emb", [10, 8])
      hidden = tf.matmul(x, w) + tf.gather(emb, ids)
      return towers.batch_normalization(hidden, training=False)

    outputs = towers.infer(forward, 2, inputs=(x, ids), devices=DEVICES,
                           variable_device=variable_device)
    run_steps(graph, [outputs])


def staged():
  with tf.Graph().as_default():
    dataset = tf.data.Dataset.from_tensor_slices(batch()).batch(4).repeat()
    train_op, _ = towers.minimize(
        model_fn(), opt(), 2,
        inputs=tf.data.make_one_shot_iterator(dataset).get_next(),
        devices=DEVICES, global_step=tf.train.get_or_create_global_step(),
        stage_inputs=True)
    with tf.train.MonitoredTrainingSession(config=config()) as sess:
      sess.run(train_op)


def sync_replicas():
  """A SyncReplicasOptimizer of one replica, with its hook."""
  with tf.Graph().as_default():
    optimizer = tf.train.SyncReplicasOptimizer(opt(), 1)
    train_op, _ = towers.minimize(
        model_fn(), optimizer, 2, inputs=inputs(), devices=DEVICES,
        global_step=tf.train.get_or_create_global_step())
    # Its queue runner waits for tokens at the end: not the default 2 min.
    with tf.train.MonitoredTrainingSession(
        config=config(), hooks=[optimizer.make_session_run_hook(True)],
        stop_grace_period_secs=1) as sess:
      sess.run(train_op)


def layers_model(scope, x, ids, y):
  """tf.compat.v1.layers, weight decay and per-tower batch norm included."""
  del scope, ids
  decay = lambda w: 1e-3 * tf.nn.l2_loss(w)  # noqa: E731
  hidden = tf.layers.dense(x, 8, tf.nn.relu, kernel_regularizer=decay)
  hidden = tf.layers.batch_normalization(hidden, training=True)
  logits = tf.layers.dense(hidden, 3)
  return (tf.losses.sparse_softmax_cross_entropy(y, logits) +
          tf.losses.get_regularization_loss())


def keras(variable_device):
  """A Keras model built once, called in every tower."""
  layers = tf.keras.layers
  with tf.Graph().as_default():
    model = tf.keras.Sequential([
        layers.Dense(8, activation="relu",
                     kernel_regularizer=tf.keras.regularizers.l2(1e-3)),
        layers.BatchNormalization(), layers.Dense(3)])

    def fn(scope, x, ids, y):
      del scope, ids
      logits = model(x, training=True)
      return tf.losses.sparse_softmax_cross_entropy(y, logits) + tf.add_n(
          model.losses)

    minimize(model=fn, variable_device=variable_device)


def xla():
  def compiled(scope, x, ids, y):
    del scope, ids
    with tf.xla.experimental.jit_scope():
      w = tf.get_variable("w", [6, 3])
      return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
          labels=y, logits=tf.matmul(x, w)))

  minimize(model=compiled)


def training_loop():
  """training.train: the guard, the hooks, the summaries, a checkpoint."""
  with tf.Graph().as_default(), tempfile.TemporaryDirectory() as train_dir:
    train_op, t = towers.minimize(
        model_fn(), opt(), 2, inputs=inputs(), devices=DEVICES,
        global_step=tf.train.get_or_create_global_step())
    training.train(train_op, t, train_dir=train_dir, max_steps=2,
                   examples_per_step=BATCH, config=config(),
                   summary_op=training.training_summaries(t),
                   log_every_n_steps=1, save_summaries_steps=1)


def workers():
  """Two workers of two towers, as two servers and sessions of this
  process; each graph is one worker's, as its own process would build."""
  cluster = tf.train.ClusterSpec(
      {"worker": ["127.0.0.1:%d" % p for p in training.free_ports(2)]})
  proto = config()
  proto.experimental.collective_group_leader = "/job:worker/replica:0/task:0"
  runs = []
  for k in range(2):
    server = tf.train.Server(cluster, job_name="worker", task_index=k,
                             config=proto)
    task = "/job:worker/task:%d" % k
    with tf.Graph().as_default() as graph:
      with tf.device(task + "/cpu:0"):
        global_step = tf.train.get_or_create_global_step()
      train_op, _ = towers.minimize(
          model_fn(), opt(), 2, inputs=inputs(),
          devices=towers.tower_devices(2, task=task),
          variable_device="replicated", num_workers=2,
          global_step=global_step)
      with tf.control_dependencies(
          [tf.train.Scaffold.default_local_init_op()]):
        sync = towers.broadcast_variables()
      init = tf.global_variables_initializer()
    session_config = tf.ConfigProto()
    session_config.CopyFrom(proto)
    session_config.device_filters[:] = [task]
    runs.append((graph, server.target, session_config, [init, sync,
                                                        train_op]))
  errors = []

  def run(graph, target, session_config, fetches):
    try:
      with tf.Session(target, graph=graph, config=session_config) as sess:
        for fetch in fetches:
          sess.run(fetch)
    except Exception:  # pylint: disable=broad-except
      errors.append(traceback.format_exc())

  # Side by side: each step is a collective of both workers' towers.
  threads = [threading.Thread(target=run, args=r) for r in runs]
  for thread in threads:
    thread.start()
  for thread in threads:
    thread.join()
  if errors:
    raise RuntimeError("\n".join(errors))


def testing_call():
  """towers.testing: one device's program and the towers' in every mode."""
  from towers import testing  # pylint: disable=g-import-not-at-top
  testing.assert_matches_one_device(
      model_fn(), lambda: tf.train.MomentumOptimizer(0.1, 0.9), batch())


def features():
  """{name: a function that builds the feature and runs it}, in order."""
  found = {}
  packs = {"": {}, " pack_bytes=0": {"pack_bytes": 0}}
  for mode in ("cpu", "gpu", "balanced"):
    for pack, kwargs in packs.items():
      found["minimize %s%s" % (mode, pack)] = (
          lambda mode=mode, kwargs=kwargs: minimize(variable_device=mode,
                                                    **kwargs))
  for reduce in ("add_n", "ring", "collective"):
    for pack, kwargs in packs.items():
      found["minimize replicated %s%s" % (reduce, pack)] = (
          lambda reduce=reduce, kwargs=kwargs: minimize(
              variable_device="replicated", all_reduce=reduce, **kwargs))
  found.update({
      "average_device, a fixed loss scale": lambda: minimize(
          average_device="/cpu:2", loss_scale=128),
      "batch norm with a training tensor": lambda: minimize(
          model=model_fn(training_tensor=True)),
      "a tower context's sum": lambda: minimize(model=centered),
      "float16": lambda: minimize(model=model_fn(tf.float16),
                                  compute_dtype="float16"),
      "bfloat16": lambda: minimize(model=model_fn(tf.bfloat16),
                                   compute_dtype="bfloat16"),
      "float16 replicated collective": lambda: minimize(
          model=model_fn(tf.float16), compute_dtype="float16",
          variable_device="replicated", all_reduce="collective"),
      "accumulate_steps=2": lambda: minimize(steps=2, accumulate_steps=2),
      "accumulate_steps=2 replicated float16": lambda: minimize(
          steps=2, accumulate_steps=2, variable_device="replicated",
          model=model_fn(tf.float16), compute_dtype="float16"),
      "several losses": several_losses,
      "by hand": lambda: by_hand("cpu"),
      "by hand replicated": lambda: by_hand("replicated"),
      "infer": lambda: infer("cpu"),
      "infer replicated": lambda: infer("replicated"),
      "stage_inputs": staged,
      "SyncReplicasOptimizer": sync_replicas,
      "xla": xla,
      "training.train": training_loop,
      "testing.assert_matches_one_device": testing_call,
  })
  if _has_legacy_layers():
    found.update({
        "tf.layers": lambda: minimize(model=layers_model),
        "tf.layers replicated": lambda: minimize(
            model=layers_model, variable_device="replicated"),
        "a Keras model": lambda: keras("cpu"),
        "a Keras model replicated": lambda: keras("replicated"),
    })
  if hasattr(tf.raw_ops, "CollectiveReduceV2"):
    # TensorFlow 1.15 refuses num_workers > 1: its collectives cannot time
    # out.
    found["num_workers=2"] = workers
  return found


def _has_legacy_layers():
  """Whether tf.compat.v1.layers and Keras 2 are here: TensorFlow 2.16 or
  later needs tf_keras for them, under TF_USE_LEGACY_KERAS=1 (which the
  test sets)."""
  try:
    return tf.layers.Dense is not None and tf.keras.layers.Dense is not None
  except (AttributeError, ImportError):
    return False


class _Records(logging.Handler):
  """Every record of TensorFlow's logger and of the root logger, with, for a
  deprecation, its caller: the first frame out of `WRAPPERS`."""

  def __init__(self):
    super().__init__(logging.DEBUG)
    self.records = []
    self._last = None

  def emit(self, record):
    # Once, though both loggers may pass it on.
    if record is self._last:
      return
    self._last = record
    caller = None
    if "deprecated" in record.getMessage():
      for frame in reversed(traceback.extract_stack()[:-1]):
        if not frame.filename.endswith(WRAPPERS):
          caller = "%s:%d" % (frame.filename, frame.lineno)
          break
    self.records.append({"logger": record.name, "level": record.levelname,
                         "message": record.getMessage(), "caller": caller})


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("canary")
  parser.add_argument("--ref-variables", action="store_true")
  args = parser.parse_args()
  models.use_variables(args.ref_variables)
  handler = _Records()
  logger = tf.get_logger()
  # Deprecations are warnings, whatever the environment asks.
  logger.setLevel(logging.INFO)
  for each in (logger, logging.getLogger()):
    each.addHandler(handler)
  spec = importlib.util.spec_from_file_location("canary", args.canary)
  canary = importlib.util.module_from_spec(spec)
  errors, seconds = {}, {}
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    spec.loader.exec_module(canary)
    canary.run()
    for name, build in features().items():
      start = time.time()
      try:
        build()
      except Exception:  # pylint: disable=broad-except
        errors[name] = traceback.format_exc()
      seconds[name] = round(time.time() - start, 2)
  print(json.dumps({
      "towers_dir": TOWERS_DIR, "records": handler.records,
      "warnings": [{"file": w.filename, "line": w.lineno,
                    "category": w.category.__name__,
                    "message": str(w.message)} for w in caught],
      "errors": errors, "seconds": seconds}))
  sys.stdout.flush()


# The test's side.


@pytest.fixture(scope="module")
def result(pytestconfig, tmp_path_factory):
  """The canary's directory, and what the script captured."""
  canary = tmp_path_factory.mktemp("canary") / "canary_module.py"
  canary.write_text(CANARY)
  args = [sys.executable, os.path.realpath(__file__), str(canary)]
  if pytestconfig.getoption("--ref-variables"):
    args.append("--ref-variables")
  # The towers this run tests; C++ logs, which name no Python file, off;
  # Keras 2 where TensorFlow has Keras 3 (if tf_keras is there).
  path = [ROOT] + [p for p in [os.environ.get("PYTHONPATH")] if p]
  env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2",
             PYTHONPATH=os.pathsep.join(path), TF_USE_LEGACY_KERAS="1")
  done = subprocess.run(args, cwd=ROOT, env=env, capture_output=True,
                        text=True, timeout=TIMEOUT_SECS, check=False)
  assert done.returncode == 0, done.stderr[-3000:]
  return str(canary.parent), json.loads(done.stdout.strip().splitlines()[-1])


def _in(directory, path):
  path = os.path.realpath(os.path.join(ROOT, path))
  return path.startswith(os.path.realpath(directory) + os.sep)


def _pointing_into(directory, captured):
  """The lines of `captured` that point into `directory`: records naming a
  file of it (or, for a deprecation, called from one), warnings raised from
  one or naming one."""
  lines = []
  for record in captured["records"]:
    caller = record["caller"] and record["caller"].rsplit(":", 1)[0]
    if any(_in(directory, p) for p in LOCATION.findall(record["message"])) \
        or (caller and _in(directory, caller)):
      lines.append("%s %s: %s (called from %s)" % (
          record["logger"], record["level"], record["message"],
          record["caller"]))
  for warning in captured["warnings"]:
    if _in(directory, warning["file"]) or any(
        _in(directory, p) for p in LOCATION.findall(warning["message"])):
      lines.append("%s:%d: %s: %s" % (warning["file"], warning["line"],
                                      warning["category"],
                                      warning["message"]))
  return lines


def test_the_capture_sees_the_deprecations_and_the_warning_of_a_file(
    result):
  directory, captured = result
  found = "\n".join(_pointing_into(directory, captured))
  for what in ("extract_sub_graph", "to_float", "the canary's warning"):
    assert what in found, "the canary's %s was not captured; captured:\n%s" % (
        what, json.dumps(captured, indent=1)[:5000])


def test_every_feature_builds_and_runs(result):
  _, captured = result
  assert not captured["errors"], "\n".join(
      "%s:\n%s" % pair for pair in captured["errors"].items())


def test_no_deprecation_or_warning_points_into_towers(result):
  _, captured = result
  assert captured["towers_dir"] == TOWERS_DIR
  found = _pointing_into(TOWERS_DIR, captured)
  assert not found, "%d pointing into %s:\n%s" % (
      len(found), TOWERS_DIR, "\n".join(found))


if __name__ == "__main__":
  main()
