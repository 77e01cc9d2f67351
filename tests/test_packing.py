"""Packing: small gradients reduced as one tensor, bitwise the unpacked."""

import numpy as np
import pytest
import tensorflow.compat.v1 as tf

import towers
from benchmarks import traffic
from models import batch, devices, model_fn

DTYPES = [tf.float16, tf.bfloat16, tf.float32, tf.float64]
WEIGHTS = {
    "uniform": None,
    "uneven": [0.1, 0.2, 0.3, 0.4],
    "tensors": "tensors",
}
OFF = 0


def _config(num=4):
  config = towers.virtual_cpu_config(num)
  # A collective waiting for a peer that never comes fails in seconds.
  config.operation_timeout_in_ms = 30000
  return config


def _values(rng, shape, dtype):
  # Magnitudes spread over six decades: a sum taken in another order or
  # another precision shows in the last bits.
  value = rng.standard_normal(shape) * 10.0 ** rng.uniform(-3, 3, shape)
  return tf.constant(value.astype(np.float64), tf.float64)


def _tower_grads(num, *, unknown_shape=False):
  """``[num][vars]`` of ``(grad, var)`` of every kind, on the towers'
  devices: small gradients in each dtype, a large one, a sparse one, a None
  one and, if asked, one whose static shape is unknown."""
  rng = np.random.RandomState(7)
  specs = [("small_%s_%d" % (d.name, i), [3, i + 2], d)
           for d in DTYPES for i in range(3)]
  specs += [("large", [40, 30], tf.float32), ("lone_half", [5], tf.float16),
            ("scalar", [], tf.float32)]
  variables = {name: tf.get_variable(name, shape, dtype,
                                     initializer=tf.zeros_initializer())
               for name, shape, dtype in specs}
  sparse_var = tf.get_variable("table", [10, 4])
  none_var = tf.get_variable("unused", [3])
  unknown_var = tf.get_variable("unknown", [2, 3])
  tower_grads = []
  for i, device in enumerate(devices(num)):
    with tf.device(device):
      pairs = []
      for name, shape, dtype in specs:
        pairs.append((tf.cast(_values(rng, shape, dtype), dtype),
                      variables[name]))
      pairs.insert(2, (tf.IndexedSlices(
          tf.cast(_values(rng, [2, 4], tf.float32), tf.float32),
          tf.constant([i, 9 - i]), tf.constant([10, 4])), sparse_var))
      pairs.insert(5, (None, none_var))
      if unknown_shape:
        pairs.append((tf.placeholder_with_default(
            tf.cast(_values(rng, [2, 3], tf.float32), tf.float32),
            [None, 3]), unknown_var))
      tower_grads.append(pairs)
  return tower_grads


def _weights(kind, num):
  if WEIGHTS[kind] is None:
    return None
  shares = np.arange(1, num + 1, dtype=np.float64)
  shares /= shares.sum()
  if kind == "tensors":
    return [tf.constant(s, tf.float32) for s in shares]
  return list(shares)


def _averaged(num, weights, pack_bytes, **kwargs):
  """The averaged gradients' values, and the packs' concat ops."""
  with tf.Graph().as_default() as graph:
    averaged = towers.average_gradients(
        _tower_grads(num, **kwargs), _weights(weights, num),
        pack_bytes=pack_bytes)
    fetches = [g for g, _ in averaged]
    with tf.Session(config=_config()) as sess:
      values = sess.run([g for g in fetches if g is not None])
    concats = [op for op in graph.get_operations()
               if op.type == "ConcatV2" and "/pack" in op.name]
  return values, concats


def _assert_bitwise(got, want):
  assert len(got) == len(want)
  for g, w in zip(got, want):
    if hasattr(w, "indices"):
      g, w = [g.values, g.indices], [w.values, w.indices]
    else:
      g, w = [g], [w]
    for a, b in zip(g, w):
      assert a.dtype == b.dtype and a.shape == b.shape
      assert a.tobytes() == b.tobytes()


@pytest.mark.parametrize("weights", WEIGHTS)
@pytest.mark.parametrize("num", [2, 3, 4])
def test_packed_average_is_bitwise_the_unpacked_one(num, weights):
  want, none = _averaged(num, weights, OFF, unknown_shape=True)
  got, concats = _averaged(num, weights, 16 * 1024, unknown_shape=True)
  assert not none
  # One pack per dtype and tower: float16 (with the lone float16), bfloat16,
  # float32 (with the scalar), float64.
  assert len(concats) == 4 * num
  _assert_bitwise(got, want)


def _packed_sources(concats):
  """The gradients each pack holds (the tensors its pieces were cut from)."""
  return [{piece.op.inputs[0].name for piece in op.inputs[:-1]}
          for op in concats]


def test_the_threshold_and_the_kinds_decide_what_is_packed():
  with tf.Graph().as_default() as graph:
    tower_grads = _tower_grads(2, unknown_shape=True)
    # The largest small float32 gradient: 3 x 4 floats, 48 bytes.
    towers.average_gradients(tower_grads, pack_bytes=48)
    concats = [op for op in graph.get_operations()
               if op.type == "ConcatV2" and "/pack" in op.name]
  by_var = {v.op.name: g for g, v in tower_grads[0]}
  packed = [s for s in _packed_sources(concats)
            if by_var["scalar"].name in s]
  assert len(packed) == 1
  names = {v.op.name for g, v in tower_grads[0]
           if g is not None and getattr(g, "name", None) in packed[0]}
  # At most 48 bytes and float32: packed; the 40 x 30 one, the sparse one
  # and the one of unknown shape: not.
  assert names == {"small_float32_0", "small_float32_1", "small_float32_2",
                   "scalar"}
  with tf.Graph().as_default() as graph:
    towers.average_gradients(_tower_grads(2), pack_bytes=44)
    concats = [op for op in graph.get_operations()
               if op.type == "ConcatV2" and "/pack" in op.name]
  assert all(len(op.inputs) - 1 == 3 for op in concats
             if op.inputs[0].dtype == tf.float32)


def test_one_tower_and_pack_bytes_zero_pack_nothing():
  for num, pack_bytes in [(1, 1 << 20), (3, 0)]:
    _, concats = _averaged(num, "uniform", pack_bytes)
    assert not concats


def _train(variable_device, pack_bytes, *, num=3, size=10, steps=5,
           all_reduce="auto", make_opt=None, clip_norm=None):
  x, y = batch(size)
  make_opt = make_opt or (lambda: tf.train.MomentumOptimizer(0.1, 0.9))
  with tf.Graph().as_default():
    kwargs = {"all_reduce": all_reduce} if all_reduce != "auto" else {}
    train_op, t = towers.minimize(
        model_fn(regularize=True), make_opt(), num,
        inputs=(tf.constant(x), tf.constant(y)), devices=devices(num),
        variable_device=variable_device, pack_bytes=pack_bytes,
        clip_norm=clip_norm, global_step=tf.train.get_or_create_global_step(),
        **kwargs)
    with tf.Session(config=_config(num)) as sess:
      sess.run(tf.global_variables_initializer())
      sess.run(tf.local_variables_initializer())
      losses = [sess.run([train_op, t.loss])[1] for _ in range(steps)]
      values = {v.op.name: sess.run(v)
                for v in tf.global_variables() + tf.local_variables()}
  return losses, values


MODES = [("cpu", "auto"), ("balanced", "auto"), ("replicated", "add_n"),
         ("replicated", "ring"), ("replicated", "collective")]


@pytest.mark.parametrize("num", [2, 3, 4])
@pytest.mark.parametrize("variable_device,all_reduce", MODES)
def test_training_packed_is_bitwise_training_unpacked(variable_device,
                                                      all_reduce, num):
  # 10 examples over 3 towers: uneven shares.
  want_losses, want = _train(variable_device, OFF, num=num,
                             all_reduce=all_reduce)
  losses, got = _train(variable_device, 1024, num=num, all_reduce=all_reduce)
  assert set(got) == set(want)
  if all_reduce == "collective" and num > 2:
    # The collective cuts a pack its own way: the order of additions moves.
    for name, value in want.items():
      np.testing.assert_allclose(got[name], value, rtol=0, atol=1e-6,
                                 err_msg=name)
    return
  assert losses == want_losses
  for name, value in want.items():
    np.testing.assert_array_equal(got[name], value, err_msg=name)


@pytest.mark.parametrize("all_reduce", ["add_n", "ring"])
def test_clipped_adam_training_packed_is_bitwise_unpacked(all_reduce):
  def make_opt():
    return tf.train.AdamOptimizer(0.01)
  _, want = _train("replicated", OFF, num=4, make_opt=make_opt, clip_norm=0.5,
                   all_reduce=all_reduce)
  _, got = _train("replicated", 1024, num=4, make_opt=make_opt,
                  clip_norm=0.5, all_reduce=all_reduce)
  for name, value in want.items():
    np.testing.assert_array_equal(got[name], value, err_msg=name)


def _sent(variable_device, pack_bytes, num, all_reduce="auto"):
  """Per device, the parameter tensors it sends in one step."""
  x, y = batch(4 * num)
  with tf.Graph().as_default() as graph:
    inputs = (tf.constant(x), tf.constant(y))
    kwargs = {"all_reduce": all_reduce} if all_reduce != "auto" else {}
    train_op, _ = towers.minimize(
        model_fn(), tf.train.GradientDescentOptimizer(0.1), num,
        inputs=inputs, devices=devices(num), variable_device=variable_device,
        pack_bytes=pack_bytes, **kwargs)
    parameters = tf.trainable_variables() + tf.local_variables()
    with tf.Session(config=_config(num)) as sess:
      sess.run(tf.global_variables_initializer())
      sess.run(tf.local_variables_initializer())
      counted = traffic.measure(sess, train_op, graph, parameters, inputs)
  return {d: f["sent_tensors"] for d, f in counted["devices"].items()}


@pytest.mark.parametrize("num", [2, 4])
def test_each_tower_sends_one_pack_where_it_sent_a_gradient_per_variable(
    num):
  # Four variables, all small, on the first tower's device ('gpu' mode):
  # each other tower reads the four and sends four gradients, packed one.
  unpacked = _sent("gpu", OFF, num)
  packed = _sent("gpu", 1024, num)
  for i in range(1, num):
    device = "cpu:%d" % i
    assert unpacked[device] == 4
    assert packed[device] == 1
  # The first tower's device sends the four variables' values to each.
  assert packed["cpu:0"] == unpacked["cpu:0"] == 4 * (num - 1)


def test_replicated_copies_exchange_one_pack_each_way():
  num = 4
  unpacked = _sent("replicated", OFF, num, "add_n")
  packed = _sent("replicated", 1024, num, "add_n")
  # add_n: each copy sends its gradients to copy 0, which sends back the
  # sum: one tensor per variable each way, one per pack when packed.
  assert unpacked["cpu:0"] == 4 * (num - 1)
  assert packed["cpu:0"] == num - 1
  for i in range(1, num):
    assert unpacked["cpu:%d" % i] == 4
    assert packed["cpu:%d" % i] == 1


@pytest.mark.parametrize("pack_bytes,error,words", [
    (-1, ValueError, "pack_bytes >= 0"),
    (1.5, TypeError, "expected pack_bytes to be an int"),
    ("16k", TypeError, "expected pack_bytes to be an int"),
    (True, TypeError, "expected pack_bytes to be an int"),
])
def test_bad_pack_bytes_are_refused(pack_bytes, error, words):
  with tf.Graph().as_default():
    with pytest.raises(error, match=words):
      towers.average_gradients(_tower_grads(2), pack_bytes=pack_bytes)
    x, y = batch(4)
    with pytest.raises(error, match=words):
      towers.minimize(model_fn(), tf.train.GradientDescentOptimizer(0.1), 2,
                      inputs=(tf.constant(x), tf.constant(y)),
                      devices=devices(2), pack_bytes=pack_bytes)
