"""What build_towers builds: names, placement, inputs, collections, scope."""

import numpy as np
import pytest
import tensorflow.compat.v1 as tf

import towers
from models import (assert_gradients_close, averaged_gradient_values, batch,
                    devices, loss_fn, model_fn, reference_gradients, session)


def _build(num=2, **kwargs):
  x, y = batch(8)
  kwargs.setdefault("inputs", (tf.constant(x), tf.constant(y)))
  kwargs.setdefault("devices", devices(num))
  return towers.build_towers(model_fn(regularize=True),
                             tf.train.GradientDescentOptimizer(0.1), num,
                             **kwargs)


def _variable_ops(graph):
  # The device check's scalars are resources of the towers, not variables.
  return [op for op in graph.get_operations()
          if op.type in ("VariableV2", "VarHandleOp")
          and "tower_device_check/" not in op.name]


def test_variables_keep_single_device_names_and_ops_carry_the_tower(
    variable_op_type):
  with tf.Graph().as_default() as g:
    t = _build(3)
    assert sorted(v.op.name for v in tf.trainable_variables()) == [
        "hidden/b", "hidden/w", "logits/b", "logits/w"]
    assert {op.type for op in _variable_ops(g)} == {variable_op_type}
    assert t.scopes == ["tower_0/", "tower_1/", "tower_2/"]
    for i in range(3):
      tower_ops = [op for op in g.get_operations()
                   if op.name.startswith("tower_%d/" % i)]
      assert any(op.type == "MatMul" for op in tower_ops)
    for tower, scope in zip(t.tower_grads, t.scopes):
      assert all(grad.name.startswith(scope) for grad, _ in tower)


@pytest.mark.parametrize("variable_device,want", [
    ("cpu", ["/device:CPU:0"] * 4),
    ("gpu", ["/device:CPU:1"] * 4),
    ("/cpu:3", ["/device:CPU:3"] * 4),
    (lambda op: "/cpu:2", ["/device:CPU:2"] * 4),
])
def test_variables_go_to_the_chosen_device(variable_device, want):
  with tf.Graph().as_default() as g:
    _build(2, devices=["/cpu:1", "/cpu:2"], variable_device=variable_device)
    got = [op.device for op in sorted(_variable_ops(g), key=lambda o: o.name)]
    assert got == want


def test_balanced_placement_spreads_variables_by_bytes():
  with tf.Graph().as_default() as g:

    def model(scope):
      sizes = [100, 60, 50, 10]
      total = 0.
      for i, n in enumerate(sizes):
        total += tf.reduce_sum(tf.get_variable("v%d" % i, [n]))
      return total

    towers.build_towers(model, tf.train.GradientDescentOptimizer(0.1), 2,
                        devices=["/cpu:0", "/cpu:1"],
                        variable_device="balanced")
    placed = {op.name: op.device for op in _variable_ops(g)}
    # Greedy: 100 -> cpu0, 60 -> cpu1, 50 -> cpu1 (60 < 100), 10 -> cpu0.
    assert placed == {"v0": "/device:CPU:0", "v1": "/device:CPU:1",
                      "v2": "/device:CPU:1", "v3": "/device:CPU:0"}


def test_every_tower_op_runs_on_its_tower_device():
  with tf.Graph().as_default() as g:
    t = _build(3, devices=["/cpu:1", "/cpu:2", "/cpu:3"])
    moved = 0
    for scope, device in zip(t.scopes, t.devices):
      want = tf.DeviceSpec.from_string(device).to_string()
      for op in g.get_operations():
        if not op.name.startswith(scope):
          continue
        if op.type == "ReadVariableOp":
          # TensorFlow 2 clears the device of resource reads on purpose, and
          # its placer puts them next to the variable, as ref reads are;
          # 1.15 gives them the variable's device.
          assert op.device in ("", "/device:CPU:0"), op.name
        elif "regularization_loss" in op.name or "Regularizer" in op.name:
          # Weight decay, computed from the variables alone, runs next to
          # them (on /cpu:0), and so does its gradient.
          assert op.device == "/device:CPU:0", op.name
          moved += 1
        else:
          assert op.device == want, op.name
    assert moved >= 3 * 2


def test_an_explicit_device_in_model_code_wins():
  with tf.Graph().as_default():

    def model(scope):
      with tf.device("/cpu:3"):
        pinned = tf.constant(2.0, name="pinned")
      v = tf.get_variable("v", [], initializer=tf.ones_initializer())
      return pinned * v

    t = towers.build_towers(model, tf.train.GradientDescentOptimizer(0.1), 2,
                            devices=["/cpu:0", "/cpu:1"])
    assert tf.get_default_graph().get_operation_by_name(
        "tower_1/pinned").device == "/device:CPU:3"
    assert t.losses[1].device == "/device:CPU:1"


def test_callable_inputs_give_each_tower_its_own_batch():
  with tf.Graph().as_default() as g:
    data = tf.data.Dataset.from_tensor_slices(
        np.arange(40, dtype=np.float32).reshape(20, 2)).batch(5)
    iterator = tf.data.make_one_shot_iterator(data)

    def model(scope, x):
      v = tf.get_variable("v", [2], initializer=tf.ones_initializer())
      return tf.reduce_mean(x * v), x

    t = towers.build_towers(model, tf.train.GradientDescentOptimizer(0.1), 2,
                            inputs=iterator.get_next, devices=devices(2))
    assert t.weights == [0.5, 0.5] or all(
        isinstance(w, tf.Tensor) for w in t.weights)
    with session(g, 2) as sess:
      sess.run(tf.global_variables_initializer())
      a, b, weights = sess.run(t.outputs + [t.weights])
    assert sorted([a[0, 0], b[0, 0]]) == [0., 10.]
    np.testing.assert_allclose(weights, [0.5, 0.5])


def test_callable_inputs_with_a_partial_batch_weigh_by_size():
  with tf.Graph().as_default() as g:
    data = tf.data.Dataset.from_tensor_slices(
        np.ones((7, 2), np.float32)).batch(4)
    iterator = tf.data.make_one_shot_iterator(data)

    def model(scope, x):
      v = tf.get_variable("v", [2], initializer=tf.ones_initializer())
      return tf.reduce_mean(x * v)

    t = towers.build_towers(model, tf.train.GradientDescentOptimizer(0.1), 2,
                            inputs=iterator.get_next, devices=devices(2))
    with session(g, 2) as sess:
      # Which tower dequeues first is up to the runtime.
      np.testing.assert_allclose(sorted(sess.run(t.weights)), [3 / 7, 4 / 7])


def test_model_builds_its_own_input_without_inputs():
  with tf.Graph().as_default() as g:
    calls = []

    def model(scope):
      calls.append(scope)
      v = tf.get_variable("v", [], initializer=tf.ones_initializer())
      return v * 2.0

    t = towers.build_towers(model, tf.train.GradientDescentOptimizer(0.1), 3,
                            devices=devices(3))
    assert calls == ["tower_0/", "tower_1/", "tower_2/"]
    assert t.weights == [1 / 3] * 3
    with session(g, 3) as sess:
      sess.run(tf.global_variables_initializer())
      assert sess.run(t.loss) == pytest.approx(2.0)


def test_single_tensor_input_is_one_argument():
  with tf.Graph().as_default():
    seen = []

    def model(scope, *args):
      seen.append(len(args))
      v = tf.get_variable("v", [3], initializer=tf.ones_initializer())
      return tf.reduce_sum(args[0] * v)

    towers.build_towers(model, tf.train.GradientDescentOptimizer(0.1), 2,
                        inputs=tf.ones([4, 3]), devices=devices(2))
    assert seen == [1, 1]


def test_shards_differ_by_at_most_one_example():
  with tf.Graph().as_default():
    sizes = []

    def model(scope, x):
      sizes.append(x.shape[0])
      return tf.reduce_sum(x * tf.get_variable("v", [], dtype=tf.float32))

    t = towers.build_towers(model, tf.train.GradientDescentOptimizer(0.1), 4,
                            inputs=tf.ones([10]), devices=devices(4))
    assert sizes == [3, 3, 2, 2]
    assert t.weights == [0.3, 0.3, 0.2, 0.2]


def test_a_dynamic_batch_smaller_than_the_towers_fails_at_run_time():
  with tf.Graph().as_default() as g:
    x = tf.placeholder(tf.float32, [None, 2])
    t = towers.build_towers(
        lambda scope, x: tf.reduce_mean(x * tf.get_variable("v", [2])),
        tf.train.GradientDescentOptimizer(0.1), 3, inputs=x,
        devices=devices(3))
    with session(g, 3) as sess:
      sess.run(tf.global_variables_initializer())
      with pytest.raises(tf.errors.InvalidArgumentError,
                         match="global batch is smaller than num_gpus=3"):
        sess.run(t.loss, {x: np.ones((2, 2))})


def test_update_ops_are_the_first_towers_and_summaries_the_last_towers():
  with tf.Graph().as_default():

    def model(scope):
      v = tf.get_variable("v", [], initializer=tf.ones_initializer())
      counter = tf.get_variable("counter", [], trainable=False,
                                initializer=tf.zeros_initializer())
      tf.add_to_collection(tf.GraphKeys.UPDATE_OPS,
                           tf.assign_add(counter, 1.0))
      loss = v * 3.0
      tf.summary.scalar("loss", loss)
      return loss

    t = towers.build_towers(model, tf.train.GradientDescentOptimizer(0.1), 3,
                            devices=devices(3))
    assert len(t.update_ops) == 1
    assert t.update_ops[0].name.startswith("tower_0/")
    assert len(t.summaries) == 1
    assert t.summaries[0].name.startswith("tower_2/")


def test_outputs_are_handed_back_per_tower():
  with tf.Graph().as_default():

    def model(scope):
      v = tf.get_variable("v", [], initializer=tf.ones_initializer())
      return v * 2.0, {"scope": scope}

    t = towers.build_towers(model, tf.train.GradientDescentOptimizer(0.1), 2,
                            devices=devices(2))
    assert t.outputs == [{"scope": "tower_0/"}, {"scope": "tower_1/"}]


def test_the_callers_scope_is_not_left_reusing():
  with tf.Graph().as_default():
    with tf.variable_scope("model"):
      _build(2)
      assert not tf.get_variable_scope().reuse
      tf.get_variable("created_after", [1])
    assert not tf.get_variable_scope().reuse


def test_the_default_gate_is_none():
  with tf.Graph().as_default():
    seen = {}

    class Recording(tf.train.GradientDescentOptimizer):

      def compute_gradients(self, loss, **kwargs):
        seen.update(kwargs)
        return super().compute_gradients(loss, **kwargs)

    towers.build_towers(model_fn(), Recording(0.1), 2,
                        inputs=tuple(map(tf.constant, batch(4))),
                        devices=devices(2))
    assert seen == {"gate_gradients": tf.train.Optimizer.GATE_NONE}


def test_the_global_batch_is_split_where_it_lives():
  # Pitfall P5: the split runs on the input's device (the CPU pipeline), so
  # each tower copies only its shard.
  with tf.Graph().as_default() as g:
    with tf.device("/cpu:3"):
      x = tf.ones([8, 2], name="global_batch")
    towers.build_towers(
        lambda scope, x: tf.reduce_sum(x * tf.get_variable("v", [2])),
        tf.train.GradientDescentOptimizer(0.1), 2, inputs=x,
        devices=devices(2))
    splits = [op for op in g.get_operations() if op.type.startswith("Split")]
    assert splits and all(op.device == "/device:CPU:3" for op in splits)


def test_op_scopes_inside_a_callers_variable_scope_are_not_doubled():
  with tf.Graph().as_default() as g:
    with tf.variable_scope("model"):
      t = _build(2)
    assert t.scopes == ["model/tower_0/", "model/tower_1/"]
    assert sorted(v.op.name for v in tf.trainable_variables()) == [
        "model/hidden/b", "model/hidden/w", "model/logits/b", "model/logits/w"]
    assert not [op.name for op in g.get_operations()
                if op.name.startswith("model/model/")]


def test_tower_local_variables_stay_on_their_tower_device():
  with tf.Graph().as_default():
    counters = []

    def model(scope, x):
      v = tf.get_variable("v", [3], initializer=tf.ones_initializer())
      seen = tf.Variable(tf.zeros([], tf.int64), trainable=False,
                         collections=[tf.GraphKeys.LOCAL_VARIABLES],
                         name="seen")
      mean, _ = tf.metrics.mean(x)
      counters.append((seen, mean))
      return tf.reduce_sum(x * v)

    towers.build_towers(model, tf.train.GradientDescentOptimizer(0.1), 2,
                        inputs=tf.ones([4, 3]), devices=["/cpu:1", "/cpu:2"])
    assert tf.trainable_variables()[0].op.device == "/device:CPU:0"
    for i, (seen, _) in enumerate(counters):
      assert seen.op.name == "tower_%d/seen" % i
      assert seen.op.device == "/device:CPU:%d" % (i + 1)
    metric_devices = sorted(v.op.device for v in tf.local_variables()
                            if "mean/" in v.op.name)
    assert metric_devices == ["/device:CPU:1"] * 2 + ["/device:CPU:2"] * 2


@pytest.mark.parametrize("num", [1, 2, 3])
def test_dict_and_nested_inputs_are_split_and_passed_as_they_came(num):
  x, y = batch(9)
  _, want = reference_gradients(x, y)
  with tf.Graph().as_default() as g:
    seen = []

    def model(scope, features, extra):
      seen.append((sorted(features), type(extra).__name__))
      return loss_fn(features["x"], extra[0]["labels"])

    inputs = ({"x": tf.constant(x), "unused": tf.zeros([9, 2])},
              [{"labels": tf.constant(y)}])
    t = towers.build_towers(model, tf.train.GradientDescentOptimizer(0.1),
                            num, inputs=inputs, devices=devices(num))
    assert seen == [(["unused", "x"], "list")] * num
    got = averaged_gradient_values(g, t)
  assert_gradients_close(got, want)


def test_a_dict_input_is_one_argument():
  with tf.Graph().as_default():
    seen = []

    def model(scope, *args):
      seen.append([sorted(a) for a in args])
      v = tf.get_variable("v", [3], initializer=tf.ones_initializer())
      return tf.reduce_sum(args[0]["x"] * v)

    towers.build_towers(model, tf.train.GradientDescentOptimizer(0.1), 2,
                        inputs={"x": tf.ones([4, 3])}, devices=devices(2))
    assert seen == [[["x"]], [["x"]]]
