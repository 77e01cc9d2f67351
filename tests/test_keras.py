"""Keras models built once and called in every tower, and tf.layers with
default names, train on towers as on one device.

The models (a small CNN with batch norm, dropout and a kernel regularizer,
as Sequential, functional and subclassed; MobileNetV2 at 32x32) run in
keras_run.py, a separate process: TensorFlow >= 2.16 needs tf_keras under
TF_USE_LEGACY_KERAS=1 for them, set before TensorFlow is imported.
"""

import pytest

MODELS = ("sequential", "functional", "subclassed", "mobilenet")
MODES = ("cpu", "replicated")


@pytest.fixture(scope="module")
def result(legacy_keras_run):
  return legacy_keras_run("keras_run.py", timeout=600)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("kind", MODELS)
def test_keras_model_has_the_single_device_names(result, kind, mode):
  assert result[kind]["names_" + mode]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("kind", MODELS)
def test_keras_model_gives_the_single_device_gradient(result, kind, mode):
  """On the global batch, the kernel regularizer (model.losses) counted
  once; batch norm and dropout in inference mode."""
  assert result[kind]["gap_" + mode] < 1e-5


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("kind", MODELS)
def test_keras_training_steps_run_tower_0s_batch_norm_updates(result, kind,
                                                              mode):
  """Training mode: every variable, moving statistics included, equals one
  device that normalizes each tower's shard on its own and runs the first
  shard's updates once per step; the steps moved both."""
  case = result[kind]
  assert case["steps_gap_" + mode] < 1e-5
  assert case["moving_moved_" + mode] > 1e-4
  assert case["weights_moved_" + mode] > 1e-3


@pytest.mark.parametrize("kind", MODELS)
def test_replicated_keras_model_has_a_copy_of_every_weight(result, kind):
  case = result[kind]
  assert case["copied"] == case["trainable"]
  assert case["copies_gap"] == 0


def test_checkpoints_interchange_with_the_single_device_keras_model(result):
  checkpoints = result["checkpoints"]
  assert checkpoints["to_one_device"] == 0
  assert checkpoints["back_to_towers"] == 0
  assert checkpoints["copies"] == 0


def test_keras_model_built_inside_model_fn_is_refused(result):
  assert "build it once, outside model_fn" in result["inside_error"]
  assert "tower_1" in result["inside_error"]


@pytest.mark.parametrize("mode", MODES)
def test_tf_layers_without_names_line_up_in_every_tower(result, mode):
  layers = result["layers"]
  assert "bert/dense_1/kernel" in layers["variables"]
  assert layers["names_" + mode]
  assert layers["gap_" + mode] < 1e-5
  assert layers["ops_" + mode] == [
      "tower_%d/bert/dense%s/MatMul" % (i, suffix)
      for i in range(2) for suffix in ("", "_1")]


def test_model_losses_in_tower_0_only_is_a_clear_error(result):
  error = result["regularization"]["tower_0_only"]
  assert "include different regularization losses" in error
  assert "tower_0's includes sequential/conv2d/kernel" in error


def test_every_calls_activity_regularization_is_a_clear_error(result):
  regularization = result["regularization"]
  assert "tower_1's loss reads tower_0's data" in regularization["all"]
  assert "model.get_losses_for(None)" in regularization["all"]
  assert regularization["own"] is None
