"""Test configuration: which kind of variables the whole run uses.

``pytest`` runs under TensorFlow 2 defaults (resource variables, graphs built
explicitly); ``pytest --ref-variables`` runs under
``tf.disable_v2_behavior()`` (ref variables, the original recipe's world).
The switch is global in TensorFlow, so it is made once per process here.

Every run uses TensorFlow's own CPU kernels, not oneDNN's. TensorFlow turns
oneDNN's on by itself on some CPUs (those with AVX512_VNNI, AVX512_BF16 or
AMX, by its release notes) and not on others; where they are on, two of
their bugs fail tests that pass elsewhere, and the benchmark's byte counts
differ (docs/pitfalls.md, P36). So that every machine runs the same kernels,
``TF_ENABLE_ONEDNN_OPTS`` is 0 unless already set, before TensorFlow is
imported; the scripts the tests start inherit it.
"""

import importlib.util
import json
import logging
import os
import subprocess
import sys

import pytest

os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")

import tensorflow.compat.v1 as tf  # pylint: disable=wrong-import-position


def pytest_addoption(parser):
  parser.addoption(
      "--ref-variables", action="store_true",
      help="run under tf.disable_v2_behavior(), so tf.get_variable makes "
      "ref variables")


def pytest_configure(config):
  if config.getoption("--ref-variables"):
    tf.disable_v2_behavior()
  else:
    # TensorFlow 2's default; TensorFlow 1.15 makes ref variables unless
    # asked.
    tf.enable_resource_variables()


def pytest_report_header(config):
  kind = "ref" if config.getoption("--ref-variables") else "resource"
  return "towers: TensorFlow %s, %s variables" % (tf.__version__, kind)


@pytest.fixture(scope="session")
def variable_op_type(pytestconfig):
  """The op type every tf.get_variable of this run must create."""
  return "VariableV2" if pytestconfig.getoption("--ref-variables") \
      else "VarHandleOp"


@pytest.fixture(scope="session")
def mnist_dir():
  """The real MNIST files, or a skip saying where they were looked for."""
  path = os.environ.get("TOWERS_MNIST_DIR",
                        os.path.join(os.path.dirname(__file__), "..", "..",
                                     "shared", "data", "mnist"))
  names = ["train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz",
           "t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz"]
  if not all(os.path.exists(os.path.join(path, n)) for n in names):
    pytest.skip("the real MNIST files are not in %s (set TOWERS_MNIST_DIR)"
                % os.path.abspath(path))
  return os.path.abspath(path)


@pytest.fixture(scope="session")
def legacy_keras_env():
  """The environment of a process of tests/ that uses tf.compat.v1.layers
  or tf-slim: TF_USE_LEGACY_KERAS=1, which must be set before TensorFlow is
  imported; skips where TensorFlow has Keras 3 and tf_keras is missing."""
  version = tf.__version__.split(".")[:2]
  if tuple(map(int, version)) >= (2, 16) and importlib.util.find_spec(
      "tf_keras") is None:
    pytest.skip("TensorFlow %s has Keras 3 and tf_keras is not installed: "
                "pip install tf_keras==%s.*" % (tf.__version__,
                                                ".".join(version)))
  return dict(os.environ, TF_USE_LEGACY_KERAS="1", TF_CPP_MIN_LOG_LEVEL="2")


@pytest.fixture(scope="session")
def legacy_keras_run(pytestconfig, legacy_keras_env):
  """Runs a script of tests/ in a process of its own under
  `legacy_keras_env`, with this run's kind of variables, and returns its
  last line's JSON."""

  def run(script, timeout, *flags):
    args = [sys.executable, os.path.join(os.path.dirname(__file__), script),
            *flags]
    if pytestconfig.getoption("--ref-variables"):
      args.append("--ref-variables")
    done = subprocess.run(args, env=legacy_keras_env, capture_output=True,
                          text=True, timeout=timeout, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])

  return run


# The loggers of the library (TensorFlow's) and of the examples (absl's).
LOGGERS = ("absl", "tensorflow")


@pytest.fixture
def logs(caplog):
  """The messages `LOGGERS` logged at INFO and above, so far."""
  for name in LOGGERS:
    caplog.set_level(logging.INFO, logger=name)
  return lambda: [r.getMessage() for r in caplog.records
                  if r.name in LOGGERS]
