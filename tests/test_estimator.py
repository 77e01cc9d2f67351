"""Towers inside a tf.estimator model_fn train like the single-device model.

The recipe: in TRAIN mode the model_fn calls `towers.minimize` on the
input_fn's features and labels and returns the towers' loss and train op;
EVAL and PREDICT build the plain model with the same variables, and the
RunConfig's session config has a device per tower. tf.estimator exists up to
TensorFlow 2.15 only, so this module skips on newer versions.
"""

import collections

import numpy as np
import pytest
import tensorflow.compat.v1 as tf

import towers
from models import DECAY, batch, initial_values

if not hasattr(tf, "estimator"):
  pytest.skip("tf.estimator was removed in TensorFlow 2.16 (this is %s): "
              "train towers with tf.train.MonitoredTrainingSession there"
              % tf.__version__, allow_module_level=True)

TRAIN = tf.estimator.ModeKeys.TRAIN
PREDICT = tf.estimator.ModeKeys.PREDICT
DEVICES = ["/cpu:0", "/cpu:1"]
STEPS = 5
# 21 examples in global batches of 7: three different batches, each split 4
# and 3 over the two towers, so the towers' uneven weights are exercised.
EXAMPLES, BATCH = 21, 7
MODES = {
    "one_copy": {"variable_device": "cpu"},
    "replicated_add_n": {"variable_device": "replicated",
                         "all_reduce": "add_n"},
    "replicated_collective": {"variable_device": "replicated",
                              "all_reduce": "collective"},
}

# One Estimator's training: its model_dir and towers options, each step's
# loss, its graph's op types, every variable's final value (replicated copies
# included) and what its last checkpoint holds.
Run = collections.namedtuple(
    "Run", "model_dir params losses op_types values checkpoint")


def _dense(name, inputs):
  values = initial_values()
  with tf.variable_scope(name):
    w = tf.get_variable("w", initializer=values[name + "/w"],
                        regularizer=lambda w: DECAY * tf.nn.l2_loss(w))
    b = tf.get_variable("b", initializer=values[name + "/b"])
  return tf.matmul(inputs, w) + b


def _logits(features):
  return _dense("logits", tf.tanh(_dense("hidden", features["x"])))


def _loss(logits, labels):
  cross_entropy = tf.reduce_mean(
      tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels,
                                                     logits=logits))
  # The regularizers run where tower 0 creates the variables, outside every
  # tower's scope: the unscoped collection is what reaches each tower's loss.
  return cross_entropy + tf.losses.get_regularization_loss()


def _optimizer():
  return tf.train.MomentumOptimizer(0.1, 0.9)


def single_device_model_fn(features, labels, mode, params):
  """The plain model: every mode on one device, trained by opt.minimize."""
  del params  # Only the towers take options.
  logits = _logits(features)
  if mode == PREDICT:
    return tf.estimator.EstimatorSpec(
        mode, predictions={"probabilities": tf.nn.softmax(logits)})
  loss = _loss(logits, labels)
  train_op = None
  if mode == TRAIN:
    # With ref variables the in-place update could otherwise race the weight
    # decay term of the loss fetched in the same run; towers.minimize orders
    # its own loss before the update the same way.
    with tf.control_dependencies([loss]):
      train_op = _optimizer().minimize(
          loss, global_step=tf.train.get_or_create_global_step())
  return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)


def towers_model_fn(features, labels, mode, params):
  """Trains on two towers; evaluates and predicts with the plain model."""
  if mode != TRAIN:
    return single_device_model_fn(features, labels, mode, params)
  train_op, t = towers.minimize(
      lambda scope, features, labels: _loss(_logits(features), labels),
      _optimizer(), len(DEVICES), inputs=(features, labels), devices=DEVICES,
      global_step=tf.train.get_or_create_global_step(), **params)
  return tf.estimator.EstimatorSpec(mode, loss=t.loss, train_op=train_op)


class _Recorder(tf.train.SessionRunHook):
  """Records each step's loss, the graph's op types and the final values."""

  def __init__(self, loss, record):
    self._loss = loss
    self._record = record

  def begin(self):
    self._record.op_types.update(
        op.type for op in tf.get_default_graph().get_operations())

  def before_run(self, run_context):
    return tf.train.SessionRunArgs(self._loss)

  def after_run(self, run_context, run_values):
    self._record.losses.append(run_values.results)

  def end(self, session):
    # The replicated copies are local variables: not in the checkpoint, so
    # read here while the session is alive.
    variables = tf.global_variables() + tf.local_variables()
    self._record.values.update(
        zip([v.op.name for v in variables], session.run(variables)))


def _recording(model_fn, record):
  # Estimator deep-copies its params, so the record the hook fills reaches
  # the model_fn through this closure instead.
  def recorded(features, labels, mode, params):
    spec = model_fn(features, labels, mode, params)
    if mode == TRAIN:
      spec = spec._replace(training_hooks=[_Recorder(spec.loss, record)])
    return spec
  return recorded


def _data():
  x, y = batch(EXAMPLES)
  return tf.data.Dataset.from_tensor_slices(({"x": x}, y))


def _train_input_fn():
  # In order and unshuffled, so both Estimators see the same batches.
  return _data().repeat().batch(BATCH)


def _eval_input_fn():
  return _data().batch(BATCH)


def _estimator(model_fn, model_dir, params=None, warm_start_from=None):
  session_config = towers.virtual_cpu_config(len(DEVICES))
  # A collective waiting for a peer that never comes fails the step in
  # seconds instead of hanging the test.
  session_config.operation_timeout_in_ms = 30000
  run_config = tf.estimator.RunConfig(
      model_dir=str(model_dir), session_config=session_config,
      save_summary_steps=None, log_step_count_steps=None)
  return tf.estimator.Estimator(model_fn, config=run_config, params=params,
                                warm_start_from=warm_start_from)


def _train(model_fn, model_dir, params=None, steps=(STEPS,)):
  """Trains in one `train` call per entry of `steps`; returns a Run."""
  run = Run(str(model_dir), params, [], set(), {}, {})
  estimator = _estimator(_recording(model_fn, run), model_dir, params)
  for count in steps:
    estimator.train(_train_input_fn, steps=count)
  reader = tf.train.load_checkpoint(run.model_dir)
  run.checkpoint.update((name, reader.get_tensor(name))
                        for name in reader.get_variable_to_shape_map())
  return run


def _evaluate(model_dir):
  return _estimator(single_device_model_fn, model_dir).evaluate(
      _eval_input_fn)


@pytest.fixture(scope="module")
def single_device(tmp_path_factory):
  """The reference: the same Estimator trained on one device."""
  return _train(single_device_model_fn,
                tmp_path_factory.mktemp("single_device"))


@pytest.fixture(scope="module", params=sorted(MODES))
def on_towers(request, tmp_path_factory):
  """The Estimator trained on two towers, in each variable mode."""
  return _train(towers_model_fn, tmp_path_factory.mktemp(request.param),
                MODES[request.param])


def test_towers_estimator_trains_like_the_single_device_estimator(
    on_towers, single_device, variable_op_type):
  # The Estimator builds its own graph: check it made this run's variables.
  assert variable_op_type in on_towers.op_types
  assert len(on_towers.losses) == STEPS
  np.testing.assert_allclose(on_towers.losses, single_device.losses, rtol=0,
                             atol=1e-5)
  assert on_towers.losses[-1] < on_towers.losses[0]
  assert on_towers.checkpoint["global_step"] == STEPS
  for name, value in single_device.checkpoint.items():
    np.testing.assert_allclose(on_towers.checkpoint[name], value, rtol=0,
                               atol=1e-5, err_msg=name)


def test_towers_checkpoint_holds_exactly_the_single_device_keys(
    on_towers, single_device):
  assert sorted(on_towers.checkpoint) == sorted(single_device.checkpoint)
  assert not [name for name in on_towers.checkpoint if "replica_" in name]


def test_replicated_copies_were_trained_identical_and_left_unsaved(
    on_towers):
  copies = [name for name in on_towers.values if name.startswith("replica_")]
  if on_towers.params["variable_device"] != "replicated":
    assert not copies
    return
  # Tower 1's copy of each variable and of its Momentum slot.
  assert len(copies) == 2 * len(initial_values())
  for name in copies:
    primary = name.split("/", 1)[1]
    np.testing.assert_array_equal(on_towers.values[name],
                                  on_towers.values[primary], err_msg=name)
  collective = bool({"CollectiveReduceV2", "CollectiveReduce"}
                    & set(on_towers.op_types))
  assert collective == (on_towers.params["all_reduce"] == "collective")


@pytest.mark.parametrize("mode", sorted(MODES))
def test_towers_training_resumed_from_its_checkpoint_continues_alike(
    mode, single_device, tmp_path):
  # The second train call restores the step-3 checkpoint (the local init op
  # sets replicated copies from it) and restarts the input; the input cycles
  # through three batches, so steps 4 and 5 see the batches they would have
  # seen in one call.
  resumed = _train(towers_model_fn, tmp_path / mode, MODES[mode],
                   steps=(3, STEPS - 3))
  np.testing.assert_allclose(resumed.losses, single_device.losses, rtol=0,
                             atol=1e-5)
  for name, value in single_device.checkpoint.items():
    np.testing.assert_allclose(resumed.checkpoint[name], value, rtol=0,
                               atol=1e-5, err_msg=name)


def test_single_device_estimator_evaluates_the_towers_checkpoint(
    on_towers, single_device):
  want = _evaluate(single_device.model_dir)
  got = _evaluate(on_towers.model_dir)
  assert got["global_step"] == want["global_step"] == STEPS
  np.testing.assert_allclose(got["loss"], want["loss"], rtol=0, atol=1e-5)


def test_single_device_estimator_warm_started_from_towers_predicts_alike(
    on_towers, single_device, tmp_path):
  # A fresh model_dir: the weights can only come from the warm start.
  warm = _estimator(single_device_model_fn, tmp_path / "warm",
                    warm_start_from=on_towers.model_dir)
  got = [p["probabilities"] for p in warm.predict(_eval_input_fn)]
  want = [p["probabilities"] for p in _estimator(
      single_device_model_fn, single_device.model_dir).predict(
          _eval_input_fn)]
  assert len(got) == EXAMPLES
  np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)
