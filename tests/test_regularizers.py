"""Every weight-regularizer style trains on towers as on one device.

tf.get_variable's ``regularizer=``, tf.layers' ``kernel_regularizer`` and
``bias_regularizer`` (a function or a Keras regularizer), tf-slim's
``weights_regularizer``, a Keras model's regularizers and the CIFAR-10
tutorial's weight decay, each with the loss composed three ways, in every
mode on one machine, 3 updates against one device on the same batches. The
models run in regularizers_run.py, a separate process: tf.layers and
tf-slim need TF_USE_LEGACY_KERAS=1 on Keras 3, set before TensorFlow is
imported. Across workers: test_workers.py.
"""

import concurrent.futures
import importlib.util
import re

import pytest

STYLES = ("get_variable", "layers_function", "layers_keras", "slim",
          "keras_model", "cifar10")
COMPOSITIONS = ("get_regularization_loss", "add_n", "get_total_loss")
MODES = ("one_copy", "add_n", "ring", "collective", "accumulate",
         "accumulate_replicated")
REPORTED = ("reported_function", "reported_keras")


@pytest.fixture(scope="module")
def result(legacy_keras_run):
  # Two processes side by side, half of the styles each: one per core.
  with concurrent.futures.ThreadPoolExecutor(2) as pool:
    first, second = pool.map(
        lambda k: legacy_keras_run("regularizers_run.py", 900, "--shard",
                                   "%d/2" % k), range(2))
  first["cases"].update(second["cases"])
  first["sends"].update(second["sends"])
  return first


def _styles_run(result):
  return [s for s in STYLES if s != "slim" or result["slim"]]


def _check(result, name):
  if name.startswith("slim ") and not result["slim"]:
    pytest.skip("tf_slim does not import here")
  found = result["cases"][name]
  assert "error" not in found, found.get("error")
  assert found["missing"] == []
  assert found["gap"] <= 1e-5, found
  assert found["copies_gap"] == 0.0, found
  # The weights moved: a gap of 1e-5 means something.
  assert found["moved"] > 1e-2, found


def test_the_run_covers_the_whole_matrix(result):
  expected = {" ".join([s, c, m]) for s in _styles_run(result)
              for c in COMPOSITIONS for m in MODES}
  expected |= {" ".join([s, "reported", m]) for s in REPORTED for m in MODES}
  expected |= {s + " scoped_total_loss add_n"
               for s in ("layers_function", "slim") if s in _styles_run(result)}
  assert set(result["cases"]) == expected


def test_tf_slim_imports_where_tensorflow_has_keras_2_built_in(result):
  if importlib.util.find_spec("tf_slim") is None:
    pytest.skip("tf_slim is not installed")
  assert result["slim"]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("composition", COMPOSITIONS)
@pytest.mark.parametrize("style", STYLES)
def test_every_regularizer_style_trains_as_on_one_device(result, style,
                                                          composition, mode):
  _check(result, " ".join([style, composition, mode]))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("regularizer", ["function", "keras"])
def test_tf_layers_dense_with_ce_plus_get_regularization_loss_trains(
    result, regularizer, mode):
  # The reported model: tf.layers.dense(x, 3, kernel_regularizer=...) and
  # ce + tf.losses.get_regularization_loss(), once refused in every mode.
  _check(result, "reported_%s reported %s" % (regularizer, mode))


@pytest.mark.parametrize("style", ["layers_function", "slim"])
def test_the_tutorials_scoped_loss_counts_each_copys_decay_when_replicated(
    result, style):
  # A replicated tower's layers regularize its own copy in its own scope,
  # so get_total_loss(scope=scope) holds each tower's weight decay once.
  _check(result, style + " scoped_total_loss add_n")


def test_weight_decay_no_tower_reads_is_still_refused(result):
  message = result["errors"]["dropped"]
  # Named after their ops: TensorFlow 1.15's end in the regularizer's mul.
  assert re.match(r"no tower's loss reads the regularization losses "
                  r"fc1/kernel/Regularizer(/mul)?, fc2/bias/Regularizer"
                  r"(/mul)?, fc2/kernel/Regularizer(/mul)?, so training "
                  r"would silently drop", message), message


def test_a_layers_regularizer_only_tower_0_counts_is_still_refused(result):
  message = result["errors"]["unequal"]
  assert message.startswith(
      "the towers' losses include different regularization losses: "
      "tower_0's includes tower_0/fc1/kernel/Regularizer/")
  assert "tower_1's does not" in message


@pytest.mark.parametrize("style", [s for s in STYLES if s != "cifar10"])
def test_weight_decay_runs_next_to_its_variable_in_every_style(result, style):
  # One step of the one-copy mode: each kernel's device sends it once to
  # each of the two towers (CPUs 1 and 2), the weight decay read included.
  if style not in result["sends"]:
    pytest.skip("tf_slim does not import here")
  sends = result["sends"][style]
  assert len(sends) == 2
  assert all(count == {"1": 1, "2": 1} for count in sends.values()), sends
