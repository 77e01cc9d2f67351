"""tf.compat.v1.layers models (dense, conv2d, batch norm) work on towers.

TensorFlow >= 2.16 ships Keras 3, which has no tf.compat.v1.layers; there
they come from the tf_keras package under TF_USE_LEGACY_KERAS=1. Older
TensorFlow has them built in.
"""

import pytest


@pytest.fixture(scope="module")
def result(legacy_keras_run):
  return legacy_keras_run("legacy_layers_run.py", timeout=300)


def test_layers_model_gives_the_single_device_gradient(result):
  assert result["gradient_gap"] < 1e-5


def test_batch_norm_model_trains_and_runs_the_first_towers_updates(result):
  assert result["last_loss"] < result["first_loss"]
  assert result["moving_mean_moved"]
  assert result["update_ops"]
  assert all(name.startswith("tower_0/") for name in result["update_ops"])


def test_variable_kind_follows_the_run(result, variable_op_type):
  assert variable_op_type in result["variable_ops"]


def test_keras_layer_built_per_tower_is_refused(result):
  assert result["keras_error"] is not None
  assert "tf.get_variable" in result["keras_error"]


def test_replicated_layers_with_batch_norm_equal_the_one_copy_mode(result):
  # Bitwise (add_n on CPUs); gamma and beta copied, moving statistics not.
  assert result["replicated_gap"] == 0
  assert result["copies_gap"] == 0
  copied = {n.split("/", 1)[1] for n in result["replicated_copies"]}
  assert {"bn/gamma", "bn/beta", "conv/kernel", "dense/kernel"} <= copied
  assert not [n for n in copied if "moving" in n]


def test_synchronized_batch_norm_is_a_drop_in_for_tf_layers(result):
  """Same variables (names, shapes, order, trainable), updates, outputs,
  gradients and moving averages as tf.layers on one device, fused kernel
  (moving variance unbiased) or not."""
  assert len(result["layer_cases"]) == 6
  for case in result["layer_cases"]:
    assert case["same_variables"], case
    assert case["gap"] < 1e-5, case


def test_checkpoints_interchange_with_tf_layers_models(result):
  checkpoints = result["checkpoints"]
  assert checkpoints["same_names"]
  assert checkpoints["restored_gap"] == 0
  assert checkpoints["back_gap"] == 0
  # 2 synchronized towers restored from tf.layers: its loss, to rounding.
  assert checkpoints["loss_gap"] < 1e-5


def test_per_tower_tf_layers_differs_and_synchronized_does_not(result):
  gaps = result["per_tower_gaps"]
  assert gaps["tf_layers"] > 1e-2
  assert gaps["synchronized"] < 1e-5
