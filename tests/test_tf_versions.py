"""One probe per function of `towers._tf_versions`, on the TensorFlow of the
run, and a check that no other module of towers asks which TensorFlow it
runs on."""

import glob
import os
import re

import numpy as np
import pytest
import tensorflow.compat.v1 as tf

import towers
from towers import _tf_versions

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")


def _session(graph, num_cpus=2):
  return tf.Session(graph=graph, config=towers.virtual_cpu_config(
      num_cpus, operation_timeout_in_ms=30000))


def test_physical_gpus_are_the_runtimes():
  gpus = _tf_versions.physical_gpus()
  assert isinstance(gpus, list)
  assert all(g.device_type == "GPU" for g in gpus)


def test_name_scope_is_empty_at_the_root_inside_get_variable():
  seen = []

  def creator(next_creator, **kwargs):
    seen.append(_tf_versions.name_scope(tf.get_default_graph()))
    return next_creator(**kwargs)

  with tf.Graph().as_default() as graph:
    with tf.variable_creator_scope(creator):
      tf.get_variable("root", [1])
    assert _tf_versions.name_scope(graph) == ""
    with tf.name_scope("outer"):
      assert _tf_versions.name_scope(graph) == "outer"
  assert seen == [""]


def test_loss_scale_optimizers_include_tensorflows_wrapper():
  classes = _tf_versions.loss_scale_optimizers()
  assert classes
  with tf.Graph().as_default():
    opt = classes[0](tf.train.GradientDescentOptimizer(0.1), "dynamic")
  assert isinstance(opt, classes)


@pytest.mark.parametrize("dtype", [tf.float32, tf.float64, tf.float16])
def test_collectives_reduce_gather_and_broadcast(dtype):
  values = [np.array([1.5, -2.0, 4.0]), np.array([0.25, 3.0, -1.0])]
  devices = ["/cpu:0", "/cpu:1"]
  with tf.Graph().as_default() as graph:
    sums, means, gathered, broadcast = [], [], [], []
    for i, (value, device) in enumerate(zip(values, devices)):
      with tf.device(device):
        tensor = tf.constant(value, dtype)
        sums.append(_tf_versions.collective_reduce(tensor, 2, 1, 1, False,
                                                   "auto"))
        means.append(_tf_versions.collective_reduce(tensor, 2, 1, 2, True,
                                                    "auto"))
        gathered.append(_tf_versions.collective_gather(tensor, 2, 1, 3))
        broadcast.append(
            _tf_versions.broadcast_send(tensor, 2, 1, 4) if i == 0 else
            _tf_versions.broadcast_recv(dtype, [3], 2, 1, 4))
    with _session(graph) as sess:
      sums, means, gathered, broadcast = sess.run(
          [sums, means, gathered, broadcast])
  for got in sums + means + gathered + broadcast:
    assert got.dtype == dtype.as_numpy_dtype
  for got in sums:
    np.testing.assert_array_equal(got, values[0] + values[1])
  for got in means:
    np.testing.assert_array_equal(got, (values[0] + values[1]) / 2)
  for got in gathered:
    np.testing.assert_array_equal(got, np.concatenate(values))
  for got in broadcast:
    np.testing.assert_array_equal(got, values[0])


def test_variables_outside_xla_leaves_the_other_ops_compiled():
  with tf.Graph().as_default() as graph:
    with tf.xla.experimental.jit_scope():
      with _tf_versions.variables_outside_xla():
        v = tf.get_variable("v", [2])
      doubled = v * 2.0
  compiled = {op.name: op.get_attr("_XlaCompile")
              for op in graph.get_operations()
              if "_XlaCompile" in op.node_def.attr}
  assert compiled[doubled.op.name] is True
  assert not any(compiled[op.name] for op in graph.get_operations()
                 if op.name.startswith("v") and op.name in compiled)
  assert any(op.name.startswith("v") for op in graph.get_operations())


def test_collectives_time_out_where_they_are_version_2():
  assert _tf_versions.collectives_time_out() == hasattr(
      tf.raw_ops, "CollectiveReduceV2")


def test_describe_names_the_version():
  assert _tf_versions.describe() == "TensorFlow " + tf.__version__


def test_no_other_module_asks_which_tensorflow_it_runs_on():
  asks = re.compile(r"__version__|hasattr\(tf\b|getattr\(tf\b")
  found = {}
  for path in glob.glob(os.path.join(ROOT, "towers", "**", "*.py"),
                        recursive=True):
    name = os.path.relpath(path, ROOT)
    if name in (os.path.join("towers", "_tf_versions.py"),
                os.path.join("towers", "__init__.py")):
      continue
    with open(path) as f:
      lines = [n for n, line in enumerate(f, 1) if asks.search(line)]
    if lines:
      found[name] = lines
  assert found == {}
