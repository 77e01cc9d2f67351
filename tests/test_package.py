"""The public surface, import hygiene and the device helpers."""

import gc
import inspect
import os
import subprocess
import sys
import textwrap
import weakref

import pytest
import tensorflow.compat.v1 as tf

import towers
from towers import _tf_versions


def test_public_surface_is_pinned():
  assert sorted(towers.__all__) == [
      "GradsAndVars", "TowerContext", "Towers", "accumulate_gradients",
      "apply_gradients",
      "average_gradients", "batch_normalization", "broadcast_variables",
      "build_towers", "infer", "minimize", "tower_context", "tower_devices",
      "virtual_cpu_config"]
  # towers.training is a subpackage: an attribute once anything imports it.
  public = {name for name, value in vars(towers).items()
            if not name.startswith("_") and not inspect.ismodule(value)}
  assert public == set(towers.__all__)
  assert isinstance(towers.__version__, str)


def test_training_surface_is_pinned():
  from towers import training  # pylint: disable=g-import-not-at-top
  assert sorted(training.__all__) == [
      "COLLECTIVE_LEADER", "ClusterError", "Interrupted", "LocalCluster",
      "PEER_ERRORS", "PeerLost", "StepLoggerHook", "StopOnSignalHook",
      "Task", "TrainDir", "TrainDirError", "VariablesDigestHook",
      "Watchdog", "describe_exit", "device_setter", "exit_status",
      "free_ports", "run_local_cluster", "start_task", "sync_replicas_hook",
      "train", "training_summaries", "wait_for_model", "watchdog_for_task"]
  public = {name for name, value in vars(training).items()
            if not name.startswith("_") and not inspect.ismodule(value)}
  assert public == set(training.__all__)


def test_testing_surface_is_pinned():
  from towers import testing  # pylint: disable=g-import-not-at-top
  assert testing.__all__ == ["assert_matches_one_device"]
  public = {name for name, value in vars(testing).items()
            if not name.startswith("_") and not inspect.ismodule(value)}
  assert public == set(testing.__all__)


def test_towers_fields():
  assert towers.Towers._fields == (
      "losses", "loss", "tower_grads", "weights", "scopes", "devices",
      "summaries", "update_ops", "outputs", "grads_and_vars", "all_reduce",
      "loss_scale", "batch_size", "applies", "plan")


def test_import_has_no_side_effects_and_leaves_out_the_runner():
  probe = textwrap.dedent("""
      import logging
      import tensorflow as tf
      from absl import flags
      def state():
        return (tf.executing_eagerly(),
                tf.compat.v1.resource_variables_enabled(),
                tf.compat.v1.control_flow_v2_enabled(),
                sorted(flags.FLAGS), list(logging.getLogger().handlers),
                logging.getLogger().level, tf.get_logger().level,
                tf.compat.v1.get_default_graph().get_operations())
      import sys
      before = state()
      import towers
      assert state() == before, (state(), before)
      assert not [m for m in sys.modules if m.startswith(("towers.training",
                                                          "towers.testing"))]
      import towers.training
      import towers.testing
      assert state() == before, (state(), before)
      print("clean")
      """)
  env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
  done = subprocess.run([sys.executable, "-c", probe], capture_output=True,
                        text=True, timeout=120, env=env, check=False)
  assert done.stdout.strip() == "clean", done.stderr[-2000:]


def test_virtual_cpu_config_makes_that_many_devices():
  config = towers.virtual_cpu_config(3, log_device_placement=True)
  assert config.device_count["CPU"] == 3
  assert config.allow_soft_placement and config.log_device_placement
  assert not towers.virtual_cpu_config(
      2, allow_soft_placement=False).allow_soft_placement
  with tf.Graph().as_default(), tf.Session(config=config) as sess:
    names = [d.name for d in sess.list_devices() if d.device_type == "CPU"]
  assert [n.split("/")[-1] for n in names] == [
      "device:CPU:0", "device:CPU:1", "device:CPU:2"]


def test_tower_devices_fall_back_to_virtual_cpus_without_gpus():
  gpus = len(_tf_versions.physical_gpus())
  want = "gpu" if gpus >= 3 else "cpu"
  assert towers.tower_devices(3) == ["/%s:%d" % (want, i) for i in range(3)]
  assert towers.tower_devices(gpus + 1)[0] == "/cpu:0"


def test_tower_devices_take_a_task_prefix():
  devices = towers.tower_devices(2, task="/job:worker/task:3/")
  gpus = len(_tf_versions.physical_gpus())
  kind = "gpu" if gpus >= 2 else "cpu"
  assert devices == ["/job:worker/task:3/%s:0" % kind,
                     "/job:worker/task:3/%s:1" % kind]


def test_the_library_keeps_no_registry_of_graphs():
  # What towers remembers about a graph is one object the graph holds
  # (towers._state); no module keeps a table of its own.
  registries = []
  for name, module in sorted(sys.modules.items()):
    if name.startswith("towers.") and not name.startswith("towers.training"):
      registries += ["%s.%s" % (name, attr) for attr, value in
                     vars(module).items()
                     if isinstance(value, (weakref.WeakKeyDictionary, dict))
                     and not attr.startswith("__")]
  assert not registries


@pytest.mark.parametrize("mode", ["cpu", "replicated"])
def test_a_graph_with_towers_is_freed_with_its_last_reference(mode):
  def model_fn(scope, x):
    del scope
    return tf.reduce_mean(tf.matmul(x, tf.get_variable("w", [4, 1])))

  graph = tf.Graph()
  with graph.as_default():
    towers.minimize(model_fn, tf.train.GradientDescentOptimizer(0.1), 2,
                    inputs=(tf.ones([4, 4]),), devices=["/cpu:0", "/cpu:1"],
                    variable_device=mode)
  ref = weakref.ref(graph)
  del graph
  gc.collect()
  assert ref() is None
