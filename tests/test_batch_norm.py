"""Synchronized batch norm: N towers equal one device on the whole batch."""

import numpy as np
import pytest
import tensorflow.compat.v1 as tf

import towers
from tests import models

TOLERANCE = 1e-5


def devices(n):
  return ["/cpu:%d" % i for i in range(n)]


def config(n):
  result = towers.virtual_cpu_config(max(n, 1))
  # A collective that waits for a member that never comes fails, not hangs.
  result.operation_timeout_in_ms = 60000
  return result


def data(batch):
  rng = np.random.RandomState(batch)
  x = (rng.normal(size=(batch, 3, 3, 2)) * 2 + 1).astype(np.float32)
  y = rng.normal(size=(batch, 4)).astype(np.float32)
  return x, y


def per_tower_batch_norm(h, name):
  """Batch norm over the tower's own shard (``tf.layers``' arithmetic)."""
  gamma, beta = scale_and_offset(name, h.shape[-1])
  mean, variance = tf.nn.moments(h, list(range(h.shape.rank - 1)))
  return tf.nn.batch_normalization(h, mean, variance, beta, gamma, 1e-3)


def scale_and_offset(name, channels):
  """``tf.layers``' gamma and beta, initialized to 1 and 0."""
  with tf.variable_scope(name):
    return (tf.get_variable("gamma", [channels],
                            initializer=tf.ones_initializer()),
            tf.get_variable("beta", [channels],
                            initializer=tf.zeros_initializer()))


def model(scope, x, y, batch_norm=towers.batch_normalization):
  """Two layers, each followed by batch norm: 4-D (statistics over batch,
  height, width) and 2-D, one named and one by default."""
  del scope
  w = tf.get_variable("w", [2, 5],
                      initializer=tf.random_normal_initializer(seed=1))
  h = tf.tensordot(x, w, 1)
  if batch_norm is towers.batch_normalization:
    h = towers.batch_normalization(h, training=True, name="bn1")
    h = tf.reshape(tf.nn.relu(h), [-1, 45])
    w2 = tf.get_variable("w2", [45, 4],
                         initializer=tf.random_normal_initializer(seed=2))
    h = towers.batch_normalization(tf.matmul(h, w2), training=True,
                                   scale=False)
  else:
    h = batch_norm(h, "bn1")
    h = tf.reshape(tf.nn.relu(h), [-1, 45])
    w2 = tf.get_variable("w2", [45, 4],
                         initializer=tf.random_normal_initializer(seed=2))
    h = batch_norm(tf.matmul(h, w2), "batch_normalization")
  return tf.reduce_mean(tf.square(h - y)), h


def one_device(x, y, steps=0, batch_norm=towers.batch_normalization):
  """Outputs, gradients (by variable name) and variables after `steps`
  steps, and after one more update of the moving averages."""
  with tf.Graph().as_default():
    loss, out = model(None, tf.constant(x), tf.constant(y), batch_norm)
    variables = tf.trainable_variables()
    grads = tf.gradients(loss, variables)
    updates = tf.get_collection(tf.GraphKeys.UPDATE_OPS)
    # Every gradient first: a ref variable's update would change the
    # buffer the other gradients still read.
    with tf.control_dependencies(updates + grads):
      step = tf.train.GradientDescentOptimizer(0.1).apply_gradients(
          list(zip(grads, variables)))
    with tf.Session(config=config(1)) as sess:
      sess.run(tf.global_variables_initializer())
      for _ in range(steps):
        sess.run(step)
      got = sess.run({"out": out, "grads": grads, "updates": updates})
      return {"out": got["out"],
              "grads": dict(zip([v.op.name for v in variables],
                                got["grads"])),
              "values": _values(sess)}


def on_towers(n, x, y, steps=0, batch_norm=towers.batch_normalization,
              **kwargs):
  with tf.Graph().as_default():
    train_op, t = towers.minimize(
        lambda scope, a, b: model(scope, a, b, batch_norm),
        tf.train.GradientDescentOptimizer(0.1), n,
        inputs=(tf.constant(x), tf.constant(y)), devices=devices(n), **kwargs)
    # The averaged gradients wait for tower 0's update ops: fetching them
    # updates the moving averages once, as the one-device run does.
    grads = [g for g, _ in t.grads_and_vars]
    with tf.Session(config=config(n)) as sess:
      sess.run(tf.global_variables_initializer())
      sess.run(tf.local_variables_initializer())
      for _ in range(steps):
        sess.run(train_op)
      got = sess.run({"out": t.outputs, "grads": grads})
      return {"out": np.concatenate(got["out"]),
              "grads": dict(zip([v.op.name for _, v in t.grads_and_vars],
                                got["grads"])),
              "values": {k: v for k, v in _values(sess).items()}}


def _values(sess):
  return {v.op.name: sess.run(v) for v in tf.global_variables()}


def assert_close(got, want, atol=TOLERANCE):
  np.testing.assert_allclose(got["out"], want["out"], rtol=0, atol=atol)
  assert sorted(got["grads"]) == sorted(want["grads"])
  for name, grad in want["grads"].items():
    np.testing.assert_allclose(got["grads"][name], grad, rtol=0, atol=atol,
                               err_msg=name)
  for name, value in want["values"].items():
    np.testing.assert_allclose(got["values"][name], value, rtol=0,
                               atol=atol, err_msg=name)


@pytest.mark.parametrize("batch", [8, 10])
@pytest.mark.parametrize("num_towers", [1, 2, 3, 4])
def test_towers_equal_one_device_on_the_whole_batch(num_towers, batch):
  x, y = data(batch)
  want = one_device(x, y)
  got = on_towers(num_towers, x, y)
  assert_close(got, want)
  # The moving averages did move (one update), the same on both.
  assert np.abs(want["values"]["bn1/moving_mean"]).max() > 1e-3


def test_per_tower_batch_norm_differs_from_one_device():
  x, y = data(10)
  want = one_device(x, y, batch_norm=per_tower_batch_norm)
  got = on_towers(4, x, y, batch_norm=per_tower_batch_norm)
  gap = max(np.abs(got["grads"][k] - want["grads"][k]).max()
            for k in want["grads"])
  assert gap > 1e-2
  synchronized = on_towers(4, x, y)
  assert_close(synchronized, one_device(x, y))


@pytest.mark.parametrize("all_reduce", ["add_n", "ring", "collective"])
def test_replicated_towers_equal_one_device_over_steps(all_reduce):
  x, y = data(10)
  want = one_device(x, y, steps=3)
  got = on_towers(3, x, y, steps=3, variable_device="replicated",
                  all_reduce=all_reduce)
  assert_close(got, want, atol=2e-5)


@pytest.mark.parametrize("variable_device", [
    "gpu", "balanced", "/cpu:3", lambda op: "/cpu:2"], ids=[
        "gpu", "balanced", "string", "function"])
def test_one_copy_modes_equal_one_device_over_steps(variable_device):
  x, y = data(10)
  assert_close(on_towers(4, x, y, steps=3, variable_device=variable_device),
               one_device(x, y, steps=3), atol=2e-5)


def test_gradients_colocated_with_their_ops_are_exact():
  x, y = data(10)
  assert_close(on_towers(3, x, y, colocate_gradients_with_ops=True),
               one_device(x, y))


def test_a_callable_input_of_uneven_dynamic_batches_is_exact():
  x, y = data(10)
  sizes = [4, 3, 2, 1]
  starts = np.cumsum([0] + sizes)
  with tf.Graph().as_default():
    dataset = tf.data.Dataset.range(4).map(
        lambda i: (tf.gather(tf.constant(x), tf.range(
            tf.gather(starts, i), tf.gather(starts, i + 1))),
                   tf.gather(tf.constant(y), tf.range(
                       tf.gather(starts, i), tf.gather(starts, i + 1)))))
    iterator = tf.data.make_one_shot_iterator(dataset)
    t = towers.build_towers(model, tf.train.GradientDescentOptimizer(0.1), 4,
                            inputs=iterator.get_next, devices=devices(4))
    averaged = towers.average_gradients(t.tower_grads, t.weights)
    with tf.Session(config=config(4)) as sess:
      sess.run(tf.global_variables_initializer())
      out, grads = sess.run([t.outputs, [g for g, _ in averaged]])
  want = one_device(x, y)
  # The towers dequeue in whatever order they run: compare the rows sorted.
  np.testing.assert_allclose(_sorted_rows(np.concatenate(out)),
                             _sorted_rows(want["out"]), rtol=0,
                             atol=TOLERANCE)
  for (_, var), grad in zip(averaged, grads):
    np.testing.assert_allclose(grad, want["grads"][var.op.name], rtol=0,
                               atol=TOLERANCE, err_msg=var.op.name)


def _sorted_rows(a):
  return a[np.lexsort(a.T[::-1])]


def through_all_sum(h, name):
  """Synchronized batch norm as TensorFlow differentiates it: the count,
  sum and sum of squares through TowerContext.all_sum, then
  tf.nn.batch_normalization (what the layer's written gradient replaces)."""
  context = towers.tower_context()
  axes = list(range(h.shape.rank - 1))
  channels = h.shape[-1]
  gamma, beta = scale_and_offset(name, channels)
  count = tf.cast(tf.reduce_prod(tf.gather(tf.shape(h), axes)), h.dtype)
  stats = context.all_sum(tf.concat([[count], tf.reduce_sum(h, axes),
                                     tf.reduce_sum(tf.square(h), axes)], 0))
  mean = stats[1:1 + channels] / stats[0]
  variance = stats[1 + channels:] / stats[0] - tf.square(mean)
  return tf.nn.batch_normalization(h, mean, variance, beta, gamma, 1e-3)


def assert_trained_alike(got, want, atol):
  np.testing.assert_allclose(got["out"], want["out"], rtol=0, atol=atol)
  for name, grad in want["grads"].items():
    np.testing.assert_allclose(got["grads"][name], grad, rtol=0, atol=atol,
                               err_msg=name)
    np.testing.assert_allclose(got["values"][name], want["values"][name],
                               rtol=0, atol=atol, err_msg=name)


@pytest.mark.parametrize("num_towers,batch,kwargs", [
    (2, 8, {}), (3, 10, {}), (4, 10, {}),
    (3, 10, {"variable_device": "replicated", "all_reduce": "collective"})],
                         ids=["2x8", "3x10", "4x10", "replicated"])
@pytest.mark.parametrize("training", ["true", "tensor"])
def test_the_written_gradient_is_the_one_through_the_sum(num_towers, batch,
                                                         kwargs, training):
  x, y = data(batch)

  def layer(h, name):
    flag = True if training == "true" else tf.placeholder_with_default(
        True, [])
    return towers.batch_normalization(h, training=flag, name=name)

  want = on_towers(num_towers, x, y, steps=2, batch_norm=through_all_sum,
                   **kwargs)
  got = on_towers(num_towers, x, y, steps=2, batch_norm=layer, **kwargs)
  assert sorted(got["grads"]) == sorted(want["grads"])
  assert_trained_alike(got, want, atol=2e-5)


def test_a_false_training_tensor_gives_the_inference_gradient():
  x, y = data(10)

  def layer(tensor):
    return lambda h, name: towers.batch_normalization(
        h, training=tf.placeholder_with_default(False, []) if tensor
        else False, name=name)

  # No step: with the moving averages' initial values, steps diverge.
  want = on_towers(3, x, y, batch_norm=layer(False))
  got = on_towers(3, x, y, batch_norm=layer(True))
  assert_trained_alike(got, want, atol=1e-6)


@pytest.mark.parametrize("sums", ["on_one_device", "collective"])
@pytest.mark.parametrize("fetch", ["tower_1_output", "loss", "tower_0_grads",
                                   "tower_2_grads"])
def test_any_single_fetch_runs_the_whole_group(fetch, sums):
  x, y = data(8)
  kwargs = {} if sums == "on_one_device" else dict(
      variable_device="replicated", all_reduce="collective")
  with tf.Graph().as_default():
    t = towers.build_towers(model, tf.train.GradientDescentOptimizer(0.1), 3,
                            inputs=(tf.constant(x), tf.constant(y)),
                            devices=devices(3), **kwargs)
    target = {"tower_1_output": t.outputs[1], "loss": t.loss,
              "tower_0_grads": [g for g, _ in t.tower_grads[0]],
              "tower_2_grads": [g for g, _ in t.tower_grads[2]]}[fetch]
    with tf.Session(config=config(3)) as sess:
      sess.run(tf.global_variables_initializer())
      sess.run(tf.local_variables_initializer())
      sess.run(target)  # would wait for ever (here: 60 s, then fail)


def _collectives(graph):
  return [op for op in graph.get_operations()
          if models.is_collective_reduce(op)]


@pytest.mark.parametrize("steps", [0, 3])
def test_sums_on_one_device_equal_the_collective_sums(steps):
  # Between CPU devices the sums are the add_n algorithm's; with the
  # gradients' collective all-reduce they are collectives: the same
  # training within a rounding.
  x, y = data(10)
  on_one_device = on_towers(3, x, y, steps=steps,
                            variable_device="replicated", all_reduce="add_n")
  collective = on_towers(3, x, y, steps=steps, variable_device="replicated",
                         all_reduce="collective")
  assert_close(on_one_device, collective, atol=1e-6)


def test_between_cpu_devices_each_sum_is_one_tensor_every_tower_reads():
  x, y = data(8)
  with tf.Graph().as_default() as graph:
    sums = []

    def summing(scope, a, b):
      sums.append(towers.tower_context().all_sum(tf.reduce_sum(a, [0, 1, 2])))
      return model(scope, a + sums[-1], b)

    t = towers.build_towers(summing, tf.train.GradientDescentOptimizer(0.1),
                            3, inputs=(tf.constant(x), tf.constant(y)),
                            devices=devices(3))
    assert not _collectives(graph)
    # Each tower's result is on its own device and reads one total, made
    # on tower 0's device.
    read = {s.op.inputs[0].op.inputs[0] for s in sums}
    assert len(read) == 1 and read.pop().device == "/device:CPU:0"
    assert [s.device for s in sums] == [
        "/device:CPU:%d" % i for i in range(3)]
    with tf.Session(config=config(3)) as sess:
      sess.run(tf.global_variables_initializer())
      got, _ = sess.run([sums, t.tower_grads])
  assert all(np.array_equal(g, got[0]) for g in got)
  np.testing.assert_allclose(got[0], x.sum((0, 1, 2)), rtol=1e-6)


@pytest.mark.parametrize("flow", ["minimize", "by_hand"])
def test_collectives_launch_in_one_order_on_each_device(flow):
  x, y = data(8)
  with tf.Graph().as_default() as graph:
    opt = tf.train.GradientDescentOptimizer(0.1)
    kwargs = dict(inputs=(tf.constant(x), tf.constant(y)), devices=devices(2),
                  variable_device="replicated", all_reduce="collective")
    if flow == "minimize":
      towers.minimize(model, opt, 2, pack_bytes=0, **kwargs)
    else:
      t = towers.build_towers(model, opt, 2, **kwargs)
      towers.average_gradients(t.tower_grads, pack_bytes=0)
    ops = _collectives(graph)
    for device in ["CPU:0", "CPU:1"]:
      mine = [op for op in ops if op.device.endswith(device)]
      # 2 layers, forward and gradient, then one per trainable variable.
      assert len(mine) == 4 + 5
      for before, after in zip(mine, mine[1:]):
        assert before in _ancestors(after), (before.name, after.name)


def _ancestors(op):
  """The ops `op` waits for, through data or control edges."""
  seen, stack = set(), list(op.control_inputs) + [t.op for t in op.inputs]
  while stack:
    current = stack.pop()
    if current not in seen:
      seen.add(current)
      stack.extend(current.control_inputs)
      stack.extend(t.op for t in current.inputs)
  return seen


def test_training_false_and_outside_towers_build_no_collective():
  x, _ = data(8)
  with tf.Graph().as_default() as graph:
    out = towers.batch_normalization(tf.constant(x), training=True)
    assert not _collectives(graph)
    assert len(tf.get_collection(tf.GraphKeys.UPDATE_OPS)) == 2
    with tf.Session() as sess:
      sess.run(tf.global_variables_initializer())
      got = sess.run(out)
  mean, var = x.mean((0, 1, 2)), x.var((0, 1, 2))
  np.testing.assert_allclose(got, (x - mean) / np.sqrt(var + 1e-3),
                             rtol=0, atol=TOLERANCE)

  def evaluate(scope, images):
    del scope
    return towers.batch_normalization(images, training=False)

  with tf.Graph().as_default() as graph:
    towers.infer(evaluate, 2, inputs=tf.constant(x), devices=devices(2))
    assert not _collectives(graph)
    assert not tf.get_collection(tf.GraphKeys.UPDATE_OPS)


def test_a_training_tensor_selects_the_statistics_and_the_updates():
  x, y = data(8)
  with tf.Graph().as_default():
    training = tf.placeholder_with_default(True, [])

    def tower(scope, a, b):
      del scope
      h = towers.batch_normalization(a, training=training, name="bn")
      return tf.reduce_mean(tf.square(h[..., :1] - b[:, None, None, :1])), h

    train_op, t = towers.minimize(tower, tf.train.GradientDescentOptimizer(
        0.1), 2, inputs=(tf.constant(x), tf.constant(y)), devices=devices(2))
    moving = [v for v in tf.global_variables() if "moving" in v.name]
    with tf.Session(config=config(2)) as sess:
      sess.run(tf.global_variables_initializer())
      before = sess.run(moving)
      inference = sess.run(t.outputs, {training: False})
      sess.run(train_op, {training: False})
      assert all(np.array_equal(a, b) for a, b in
                 zip(before, sess.run(moving)))
      sess.run(train_op)
      after = sess.run(moving)
  # Moving mean 0, variance 1: inference divides by sqrt(1 + epsilon).
  np.testing.assert_allclose(np.concatenate(inference), x / np.sqrt(1.001),
                             rtol=0, atol=TOLERANCE)
  np.testing.assert_allclose(after[0], 0.01 * x.mean((0, 1, 2)), rtol=0,
                             atol=TOLERANCE)


def test_float16_inputs_are_normalized_in_float32():
  x, _ = data(8)
  with tf.Graph().as_default():
    t = towers.build_towers(
        lambda scope, a: tf.reduce_mean(tf.cast(towers.batch_normalization(
            a, training=True), tf.float32)),
        tf.train.GradientDescentOptimizer(0.1), 2,
        inputs=tf.constant(x.astype(np.float16)), devices=devices(2))
    assert {v.dtype.base_dtype for v in tf.global_variables()} == {tf.float32}
    with tf.Session(config=config(2)) as sess:
      sess.run(tf.global_variables_initializer())
      sess.run(t.loss)


def test_default_names_are_tower_0s_in_every_tower():
  x, y = data(8)
  with tf.Graph().as_default():

    def tower(scope, a, b):
      del scope
      h = towers.batch_normalization(a, training=True)
      h = towers.batch_normalization(h, training=True)
      return tf.reduce_mean(tf.square(h[..., 0] - b[:, None, None, 0]))

    with tf.variable_scope("net"):
      towers.build_towers(tower, tf.train.GradientDescentOptimizer(0.1), 3,
                          inputs=(tf.constant(x), tf.constant(y)),
                          devices=devices(3))
    assert sorted(v.op.name for v in tf.trainable_variables()) == [
        "net/batch_normalization/beta", "net/batch_normalization/gamma",
        "net/batch_normalization_1/beta", "net/batch_normalization_1/gamma"]


def test_towers_building_different_layers_are_refused():
  x, y = data(8)
  with tf.Graph().as_default():

    def tower(scope, a, b):
      del scope
      h = a
      if towers.tower_context().index == 0:
        h = towers.batch_normalization(h, training=True, name="bn")
      return tf.reduce_mean(tf.square(h[..., 0] - b[:, None, None, 0]))

    with pytest.raises(ValueError, match="tower_0 built 2 cross-tower sums"
                       ".* but tower_1 built 0"):
      towers.build_towers(tower, tf.train.GradientDescentOptimizer(0.1), 2,
                          inputs=(tf.constant(x), tf.constant(y)),
                          devices=devices(2))


def test_towers_on_one_device_are_refused():
  x, y = data(8)
  with tf.Graph().as_default():
    with pytest.raises(ValueError, match="distinct device per tower"):
      towers.build_towers(model, tf.train.GradientDescentOptimizer(0.1), 2,
                          inputs=(tf.constant(x), tf.constant(y)),
                          devices=["/cpu:0", "/cpu:0"])


@pytest.mark.parametrize("option", [{"renorm": True},
                                    {"virtual_batch_size": 2}])
def test_unsupported_options_are_refused(option):
  with tf.Graph().as_default():
    with pytest.raises(ValueError, match="does not support " + list(option)[0]):
      towers.batch_normalization(tf.zeros([4, 3]), **option)


def test_bad_inputs_are_refused():
  with tf.Graph().as_default():
    with pytest.raises(ValueError, match="known rank"):
      towers.batch_normalization(tf.placeholder(tf.float32))
    with pytest.raises(ValueError, match="out of range"):
      towers.batch_normalization(tf.zeros([4, 3]), axis=2)
    with pytest.raises(ValueError, match="known size on axis"):
      towers.batch_normalization(tf.placeholder(tf.float32, [4, None]))
