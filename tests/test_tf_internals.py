"""One probe per TensorFlow internal towers relies on, on a tiny graph.

Each test checks the behaviour `towers._tf_internals` says a function relies
on, so that a TensorFlow that changes it fails here, by name, before any
equivalence test. The file also checks that no other module of towers
reaches into TensorFlow's private names. The run's kind of variables (see
conftest.py) is the probes' too.
"""

import ast
import glob
import os
import threading

import numpy as np
import pytest
import tensorflow.compat.v1 as tf

import towers
from towers import _tf_internals

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
TIMEOUT_MS = 30000
# Python's public methods of a namedtuple, whose names start with "_".
NAMEDTUPLE = frozenset(["_replace", "_asdict", "_fields", "_make"])


def _variable(name, value):
  return tf.get_variable(name, initializer=tf.constant(value, tf.float32))


def _session(graph, num_cpus=2, grappler=True):
  config = towers.virtual_cpu_config(num_cpus,
                                     operation_timeout_in_ms=TIMEOUT_MS)
  if not grappler:
    config.graph_options.rewrite_options.disable_meta_optimizer = True
  return tf.Session(graph=graph, config=config)


def _run_placed(sess, fetches):
  """Runs `fetches`; returns their values and {node name: device} as the
  session's partition graphs placed them."""
  metadata = tf.RunMetadata()
  values = sess.run(fetches, options=tf.RunOptions(
      output_partition_graphs=True), run_metadata=metadata)
  placed = {node.name: node.device for graph in metadata.partition_graphs
            for node in graph.node}
  return values, placed


def _group(op):
  """`op`'s own colocation group. (Names are read from the ops: some
  TensorFlows name an op's converted constant input after the op.)"""
  return b"loc:@" + op.name.encode()


def test_update_input_makes_the_op_read_the_new_tensor(variable_op_type):
  with tf.Graph().as_default() as graph:
    v = _variable("v", 3.0)
    w = _variable("w", 5.0)
    assert v.op.type == variable_op_type
    y = tf.multiply(tf.convert_to_tensor(v), 2.0)
    read_w = tf.convert_to_tensor(w)
    _tf_internals.update_input(y.op, 0, read_w)
    assert y.op.inputs[0] is read_w
    with _session(graph) as sess:
      sess.run(tf.global_variables_initializer())
      assert sess.run(y) == 10.0


def test_add_control_input_runs_the_control_first():
  with tf.Graph().as_default() as graph:
    count = _variable("count", 0.0)
    # The read itself: a ReadVariableOp, or a ref variable's Identity.
    read = count.value()
    bump = count.assign_add(1.0)
    _tf_internals.add_control_input(read.op, bump.op)
    assert bump.op in read.op.control_inputs
    with _session(graph) as sess:
      sess.run(tf.global_variables_initializer())
      assert [sess.run(read), sess.run(read)] == [1.0, 2.0]


def _assert_six_on_cpu1(graph, y):
  with _session(graph) as sess:
    sess.run(tf.global_variables_initializer())
    value, placed = _run_placed(sess, y)
  assert value == 6.0
  assert placed[y.op.name].endswith("/device:CPU:1"), placed


def test_set_device_moves_the_op_in_the_partition_graphs():
  with tf.Graph().as_default() as graph:
    with tf.device("/cpu:0"):
      x = _variable("x", 2.0)
      y = tf.multiply(tf.convert_to_tensor(x), 3.0, name="y")
    _tf_internals.set_device(y.op, "/cpu:1")
    assert y.op.device == "/cpu:1"
  _assert_six_on_cpu1(graph, y)


def test_clear_colocation_frees_the_op_to_go_to_its_own_device():
  with tf.Graph().as_default() as graph:
    with tf.device("/cpu:0"):
      x = _variable("x", 2.0)
      read = tf.identity(x, name="read")
    with tf.colocate_with(read.op):
      y = tf.multiply(read, 3.0, name="y")
    assert y.op.colocation_groups() == [_group(read.op)]
    _tf_internals.clear_colocation(y.op)
    _tf_internals.clear_colocation(y.op)  # Without colocation: a no-op.
    assert y.op.colocation_groups() == [_group(y.op)]
    _tf_internals.set_device(y.op, "/cpu:1")
  _assert_six_on_cpu1(graph, y)


def test_set_colocation_moves_the_op_to_the_new_group():
  with tf.Graph().as_default() as graph:
    with tf.device("/cpu:0"):
      x = _variable("x", 2.0)
    with tf.device("/cpu:1"):
      z = _variable("z", 0.0)
    with tf.colocate_with(x.op):
      y = tf.multiply(tf.convert_to_tensor(x), 3.0, name="y")
    assert _tf_internals.colocation(y.op) == [_group(x.op)]
    assert _tf_internals.colocation(tf.constant(1.0).op) == []
    _tf_internals.set_colocation(y.op, [_group(z.op)])
    assert _tf_internals.colocation(y.op) == [_group(z.op)]
    _tf_internals.set_device(y.op, z.op.device)
  _assert_six_on_cpu1(graph, y)


def test_creation_index_follows_the_order_ops_were_made():
  with tf.Graph().as_default() as graph:
    assert _tf_internals.last_op_id() == 0
    first = tf.constant(1.0, name="first")
    start = _tf_internals.last_op_id()
    assert start == _tf_internals.creation_index(first.op)
    second = tf.identity(first, name="second")
    third = tf.add(second, first, name="third")
    assert _tf_internals.made_after(start) == [second.op, third.op]
    indices = [_tf_internals.creation_index(op)
               for op in graph.get_operations()]
    assert indices == sorted(indices) and len(set(indices)) == len(indices)
    assert _tf_internals.made_after(_tf_internals.last_op_id()) == []


def test_control_flow_context_is_entered_again_and_restored():
  with tf.Graph().as_default() as graph:
    count = _variable("count", 0.0)
    pred = tf.placeholder(tf.bool, [])
    outside = tf.identity(pred)
    seen = {}

    def taken():
      context = _tf_internals.control_flow_context(graph)
      seen["context"] = context
      with tf.control_dependencies(None):
        seen["left"] = _tf_internals.control_flow_context(graph)
        with _tf_internals.entered(graph, context):
          bump = count.assign_add(1.0)
        seen["bump"] = bump.op
        with pytest.raises(RuntimeError):
          with _tf_internals.entered(graph, context):
            raise RuntimeError("inside")
        seen["after"] = _tf_internals.control_flow_context(graph)
      with tf.control_dependencies([bump]):
        return tf.constant(True)

    done = _tf_internals.cond_v1(pred, taken, lambda: tf.constant(False),
                                 "probe")
    assert seen["context"] is not None and seen["left"] is None
    assert seen["after"] is None
    assert _tf_internals.in_control_flow(seen["bump"])
    assert not _tf_internals.in_control_flow(outside.op)
    assert _tf_internals.control_flow_context(graph) is None
    with _session(graph) as sess:
      sess.run(tf.global_variables_initializer())
      # The op built in the context again runs only when the branch does.
      assert not sess.run(done, {pred: False})
      assert sess.run(count.read_value()) == 0.0
      assert sess.run(done, {pred: True})
      assert sess.run(count.read_value()) == 1.0


def test_copy_op_builds_the_op_again_on_other_inputs():
  with tf.Graph().as_default() as graph:
    with tf.device("/cpu:0"):
      x = _variable("x", 2.5)
      y = _variable("y", 7.5)
      count = _variable("count", 0.0)
      read = tf.identity(x, name="read")
    with tf.colocate_with(read.op):
      cast = tf.cast(read, tf.int32, name="cast")
    bump = count.assign_add(1.0)
    read_y = tf.convert_to_tensor(y)
    with tf.device("/cpu:1"), tf.control_dependencies([bump]):
      copy = _tf_internals.copy_op(cast.op, [read_y], "copy")
    assert copy.name == "copy" and copy.type == "Cast"
    assert copy.get_attr("DstT") == tf.int32
    assert copy.colocation_groups() == [_group(copy)]
    assert bump.op in copy.control_inputs
    assert copy.outputs[0].shape == cast.shape
    with _session(graph) as sess:
      sess.run(tf.global_variables_initializer())
      value, placed = _run_placed(sess, copy.outputs[0])
      # Read after the run: in the same run the read need not wait for it.
      counted = sess.run(count)
  assert value == 7 and counted == 1.0
  assert placed[copy.name].endswith("/device:CPU:1"), placed


def test_apart_from_sums_keeps_the_order_of_additions():
  # In float32, (1e8 - 1e8) + 1 is 1, but 1 + 1e8 - 1e8 (the leaves in the
  # order of their names, as Grappler's AddN takes them) is 0: without the
  # Snapshot, Grappler 2.12-2.21 rewrites this graph and it gives 0.
  with tf.Graph().as_default() as graph:
    small, big, neg = [
        tf.convert_to_tensor(tf.get_variable(
            name, initializer=tf.constant([value, value])))
        for name, value in [("a_small", 1.0), ("b_big", 1e8),
                            ("c_neg", -1e8)]]
    kept = _tf_internals.apart_from_sums(tf.add(big, neg))
    assert kept.op.type == "Snapshot"
    # Consumed: Grappler leaves a fetched addition itself alone.
    result = tf.identity(tf.add(kept, small) * 1.0)
    constant = tf.constant(1.0)
    assert _tf_internals.apart_from_sums(constant) is constant
    with _session(graph) as sess:
      sess.run(tf.global_variables_initializer())
      assert sess.run(result).tolist() == [1.0, 1.0]


def test_cond_v1_builds_switch_and_merge_and_runs_one_branch():
  with tf.Graph().as_default() as graph:
    count = _variable("count", 0.0)
    pred = tf.placeholder(tf.bool, [])

    def branch(amount, value):
      def fn():
        with tf.control_dependencies([count.assign_add(amount)]):
          return tf.constant(value)
      return fn

    before = tf.control_flow_v2_enabled()
    out = _tf_internals.cond_v1(pred, branch(1.0, True), branch(10.0, False),
                                "step")
    assert tf.control_flow_v2_enabled() == before
    types = {op.type for op in graph.get_operations()}
    assert {"Switch", "Merge"} <= types
    assert not types & {"If", "StatelessIf"}
    assert len(graph.get_collection(tf.GraphKeys.COND_CONTEXT)) == 2
    # The Merge reads each branch's own scalar result, made in its branch.
    assert out.op.type == "Merge" and out.shape == []
    assert [t.shape for t in out.op.inputs] == [[], []]
    assert all(_tf_internals.in_control_flow(t.op) for t in out.op.inputs)
    with _session(graph) as sess:
      sess.run(tf.global_variables_initializer())
      assert sess.run(out, {pred: True})
      assert sess.run(count.read_value()) == 1.0
      assert not sess.run(out, {pred: False})
      assert sess.run(count.read_value()) == 11.0


def test_cond_v1_leaves_no_context_behind_a_failing_branch():
  with tf.Graph().as_default() as graph:
    before = tf.control_flow_v2_enabled()

    def fails():
      raise ValueError("a branch that fails")

    with pytest.raises(ValueError, match="a branch that fails"):
      _tf_internals.cond_v1(tf.constant(True), fails,
                            lambda: tf.constant(False), "failing")
    assert _tf_internals.control_flow_context(graph) is None
    assert tf.control_flow_v2_enabled() == before
    # The graph builds on as before.
    assert tf.cond(tf.constant(True), lambda: 1.0, lambda: 2.0) is not None


def _cond_types(graph):
  with graph.as_default():
    tf.cond(tf.placeholder(tf.bool, []), lambda: tf.constant(1.0),
            lambda: tf.constant(2.0))
  return {op.type for op in graph.get_operations()} & {
      "Switch", "Merge", "If", "StatelessIf"}


def test_an_accumulated_step_leaves_other_threads_control_flow_alone():
  # Another thread builds a tf.cond while this one is inside the
  # accumulated step's condition: it gets what the process-wide switch says.
  expected = _cond_types(tf.Graph())
  built = {}
  inside = threading.Event()

  def other_thread():
    inside.wait(60)
    built["types"] = _cond_types(tf.Graph())

  thread = threading.Thread(target=other_thread)
  thread.start()
  with tf.Graph().as_default() as graph:
    opt = tf.train.GradientDescentOptimizer(0.1)

    def model_fn(scope, x):
      del scope
      w = tf.get_variable("w", [3], initializer=tf.ones_initializer())
      return tf.reduce_sum(tf.square(x * w))

    def apply_fn(tower_grads, weights):
      inside.set()
      thread.join(60)
      return towers.apply_gradients(
          opt, towers.average_gradients(tower_grads, weights=weights))

    t = towers.build_towers(model_fn, opt, 2, devices=["/cpu:0", "/cpu:1"],
                            inputs=tf.constant(np.ones([4, 3], np.float32)))
    train_op, applies = towers.accumulate_gradients(t, apply_fn, 2)
    with _session(graph) as sess:
      sess.run([tf.global_variables_initializer(),
                tf.local_variables_initializer()])
      assert [sess.run([train_op, applies])[1] for _ in range(2)] == [
          False, True]
  assert not thread.is_alive()
  assert built["types"] == expected, built


def test_install_collection_makes_the_list_the_collection():
  appended = []

  class Recording(list):

    def append(self, item):
      appended.append(item)
      super().append(item)

  with tf.Graph().as_default() as graph:
    items = Recording()
    _tf_internals.install_collection(graph, "probe", items)
    x = tf.constant(1.0)
    tf.add_to_collection("probe", x)
    assert appended == [x]
    assert graph.get_collection("probe") == [x]
    assert graph.get_collection("probe") is not items
    assert graph.get_collection_ref("probe") is items
    graph.clear_collection("probe")
    assert graph.get_collection("probe") == []


def test_op_seeds_as_if_alone_leave_out_the_ops_made_since():
  def seed_of_a_random_op(extra_ops):
    with tf.Graph().as_default() as graph:
      tf.set_random_seed(3)
      tf.constant(0.0)
      first = _tf_internals.last_op_id()
      for _ in range(extra_ops):
        tf.constant(1.0)
      with _tf_internals.op_seeds_as_if_alone(first):
        tf.random_uniform([2], name="uniform")
      # Outside, TensorFlow's seeds again: the same op seed as alone on 2.x,
      # the op count on 1.15.
      tf.random_uniform([2], name="after")
      return [graph.get_operation_by_name(name + "/RandomUniform").get_attr(
          "seed2") for name in ("uniform", "after")]

  alone, _ = seed_of_a_random_op(0)
  inside, after = seed_of_a_random_op(5)
  assert inside == alone
  assert after != inside


def _private_uses(path):
  """Lines of `path` that reach into a private name of another object, or
  import TensorFlow's modules other than its public API."""
  with open(path) as f:
    source = f.read()
  found = []
  for node in ast.walk(ast.parse(source)):
    if isinstance(node, ast.Attribute) and node.attr.startswith("_") and (
        not node.attr.startswith("__")):
      owner = node.value.id if isinstance(node.value, ast.Name) else None
      if owner not in ("self", "cls") and (owner, node.attr) != (
          "os", "_exit") and node.attr not in NAMEDTUPLE:
        found.append((node.lineno, "." + node.attr))
    elif isinstance(node, (ast.Import, ast.ImportFrom)):
      names = [node.module or ""] if isinstance(node, ast.ImportFrom) else [
          a.name for a in node.names]
      found.extend((node.lineno, name) for name in names
                   if name.startswith("tensorflow.") and
                   name != "tensorflow.compat.v1")
    elif isinstance(node, ast.Constant) and isinstance(node.value, str) and (
        node.value in ("_class", "_id", "_collections")):
      found.append((node.lineno, repr(node.value)))
  for number, line in enumerate(source.splitlines(), 1):
    if "protected-access" in line and "os._exit(" not in line:
      found.append((number, line.strip()))
  return found


def test_queue_runner_makes_a_runner_that_fills_its_queue():
  with tf.Graph().as_default():
    queue = tf.FIFOQueue(4, [tf.int32], shapes=[[]])
    runner = _tf_internals.queue_runner(queue, [queue.enqueue(7)])
    assert isinstance(runner, tf.train.QueueRunner)
    assert runner.queue is queue and len(runner.enqueue_ops) == 1
    with pytest.raises(ValueError, match="enqueue_ops"):
      _tf_internals.queue_runner(queue, [])
    with tf.Session() as sess:
      coordinator = tf.train.Coordinator()
      threads = runner.create_threads(sess, coord=coordinator, start=True)
      assert sess.run(queue.dequeue()) == 7
      coordinator.request_stop()
      sess.run(queue.close(cancel_pending_enqueues=True))
      coordinator.join(threads)


def test_no_other_module_reaches_into_tensorflow_internals():
  paths = sorted(glob.glob(os.path.join(ROOT, "towers", "**", "*.py"),
                           recursive=True))
  assert len(paths) > 30
  uses = {os.path.relpath(p, ROOT): _private_uses(p) for p in paths
          if os.path.basename(p) != "_tf_internals.py"}
  assert {p: u for p, u in uses.items() if u} == {}
  # The scan sees what it must refuse.
  assert _private_uses(os.path.join(ROOT, "towers", "_tf_internals.py"))
