"""Bad input gets a clear error naming the culprit and the fix."""

import numpy as np
import pytest
import tensorflow.compat.v1 as tf

import towers
from models import batch, devices, model_fn, session


def _sgd():
  return tf.train.GradientDescentOptimizer(0.1)


def _var(name="v"):
  return tf.get_variable(name, [2], initializer=tf.ones_initializer())


@pytest.mark.parametrize("num_gpus,error", [
    (0, ValueError), (-1, ValueError), (2.0, TypeError), ("2", TypeError),
    (True, TypeError), (None, TypeError)])
def test_num_gpus_must_be_a_positive_int(num_gpus, error):
  with tf.Graph().as_default():
    with pytest.raises(error, match="num_gpus to be a positive int"):
      towers.build_towers(model_fn(), _sgd(), num_gpus)


def test_devices_must_match_num_gpus():
  with tf.Graph().as_default():
    with pytest.raises(ValueError, match=r"num_gpus=3 but devices has 2"):
      towers.build_towers(model_fn(), _sgd(), 3, devices=devices(2))


@pytest.mark.parametrize("bad,error,words", [
    ("/cpu:0", TypeError, "list of 1 device strings"),
    ([0], TypeError, "device strings such as"),
    (["/nonsense:0:x"], ValueError, "not a device string"),
])
def test_devices_must_be_device_strings(bad, error, words):
  with tf.Graph().as_default():
    with pytest.raises(error, match=words):
      towers.build_towers(model_fn(), _sgd(), 1, devices=bad)


def test_variable_device_must_be_known():
  with tf.Graph().as_default():
    with pytest.raises(ValueError, match="'cpu', 'gpu', 'balanced'"):
      towers.build_towers(model_fn(), _sgd(), 1, devices=devices(1),
                          variable_device="/bogus:zero")
    with pytest.raises(TypeError, match="variable_device"):
      towers.build_towers(model_fn(), _sgd(), 1, devices=devices(1),
                          variable_device=3)


def test_model_fn_and_opt_are_checked():
  with tf.Graph().as_default():
    with pytest.raises(TypeError, match="model_fn to be callable"):
      towers.build_towers("model", _sgd(), 1)
    with pytest.raises(TypeError, match="tf.compat.v1.train.Optimizer"):
      towers.build_towers(model_fn(), object(), 1)


def test_non_scalar_loss_names_the_tower():
  with tf.Graph().as_default():
    with pytest.raises(ValueError, match=r"scalar loss, got shape \[2\] in "
                       r"tower_0; did you forget tf.reduce_mean"):
      towers.build_towers(lambda scope: _var() * 2.0, _sgd(), 2,
                          devices=devices(2))


def test_non_scalar_loss_in_a_later_tower_names_that_tower():
  with tf.Graph().as_default():

    def model(scope, x):
      return tf.reduce_sum(x * _var(), axis=1)  # [shard] instead of []

    with pytest.raises(ValueError, match="got shape .* in tower_0"):
      towers.build_towers(model, _sgd(), 2, inputs=tf.ones([4, 2]),
                          devices=devices(2))


def test_missing_loss_is_a_value_error():
  with tf.Graph().as_default():
    with pytest.raises(ValueError, match=r"no loss \(None\) in tower_0"):
      towers.build_towers(lambda scope: None, _sgd(), 1, devices=devices(1))


def test_integer_loss_is_a_type_error():
  with tf.Graph().as_default():
    with pytest.raises(TypeError, match="float loss, got int32 in tower_0"):
      towers.build_towers(
          lambda scope: tf.cast(tf.reduce_sum(_var()), tf.int32), _sgd(), 1,
          devices=devices(1))


def test_python_number_loss_is_a_type_error():
  with tf.Graph().as_default():
    with pytest.raises(TypeError, match="tf.Tensor in tower_0, got float"):
      towers.build_towers(lambda scope: 1.5, _sgd(), 1, devices=devices(1))


def test_wrong_tuple_is_a_value_error():
  with tf.Graph().as_default():
    with pytest.raises(ValueError, match=r"tuple of 3 items in tower_0"):
      towers.build_towers(lambda scope: (tf.reduce_sum(_var()), 1, 2),
                          _sgd(), 1, devices=devices(1))


def test_unknown_rank_loss_is_checked_at_run_time():
  with tf.Graph().as_default() as g:
    shape_free = tf.placeholder(tf.float32, None)
    t = towers.build_towers(
        lambda scope: tf.reduce_sum(_var()) * shape_free, _sgd(), 1,
        devices=devices(1))
    with tf.Session(graph=g) as sess:
      sess.run(tf.global_variables_initializer())
      assert sess.run(t.loss, {shape_free: 2.0}) == 4.0
      with pytest.raises(tf.errors.InvalidArgumentError):
        sess.run(t.loss, {shape_free: [1.0, 2.0]})


def test_tf_variable_in_every_tower_is_caught_in_tower_1():
  with tf.Graph().as_default():

    def model(scope):
      v = tf.Variable(np.ones(2, np.float32), name="not_shared")
      return tf.reduce_sum(v)

    with pytest.raises(ValueError, match=r"tower_1 created the trainable "
                       r"variable tower_1/not_shared.*tf.get_variable"):
      towers.build_towers(model, _sgd(), 2, devices=devices(2))


def test_module_built_anew_per_tower_is_caught():
  with tf.Graph().as_default():
    built = []

    def model(scope):
      # A module object built anew in each tower names its own scope
      # uniquely (as Sonnet modules do): get_variable alone would happily
      # create a second set of weights.
      built.append(len(built))
      with tf.variable_scope("dense_%d" % built[-1], reuse=tf.AUTO_REUSE):
        w = tf.get_variable("w", [2], initializer=tf.ones_initializer())
      return tf.reduce_sum(w)

    with pytest.raises(ValueError, match="tower_1 created the trainable "
                       "variable dense_1/w"):
      towers.build_towers(model, _sgd(), 2, devices=devices(2))


def test_inputs_must_be_tensors_with_a_batch_axis():
  with tf.Graph().as_default():
    with pytest.raises(TypeError, match="wrap NumPy data with tf.constant"):
      towers.build_towers(model_fn(), _sgd(), 2, devices=devices(2),
                          inputs=(np.ones([4, 6]), np.ones([4])))
    with pytest.raises(ValueError, match="is a scalar"):
      towers.build_towers(model_fn(), _sgd(), 2, devices=devices(2),
                          inputs=tf.constant(1.0))
    with pytest.raises(ValueError, match="disagree on the global batch size"):
      towers.build_towers(model_fn(), _sgd(), 2, devices=devices(2),
                          inputs=(tf.ones([4, 6]), tf.ones([5], tf.int32)))


def test_a_static_batch_smaller_than_the_towers_is_a_value_error():
  with tf.Graph().as_default():
    x, y = batch(3)
    with pytest.raises(ValueError, match="3 examples is smaller than "
                       "num_gpus=4"):
      towers.build_towers(model_fn(), _sgd(), 4, devices=devices(4),
                          inputs=(tf.constant(x), tf.constant(y)))


def test_average_gradients_checks_its_input():
  with tf.Graph().as_default():
    a, b = _var("a"), _var("b")
    g = tf.ones([2])
    with pytest.raises(ValueError, match="at least one tower"):
      towers.average_gradients([])
    with pytest.raises(TypeError, match="list over towers"):
      towers.average_gradients(None)
    with pytest.raises(TypeError, match=r"\(grad, var\) pairs in tower 0"):
      towers.average_gradients([[g]])
    with pytest.raises(TypeError, match="tf.Tensor, tf.IndexedSlices or None"):
      towers.average_gradients([[(np.ones(2), a)]])
    with pytest.raises(ValueError, match="tower 1 has 1 .* tower 0 has 2"):
      towers.average_gradients([[(g, a), (g, b)], [(g, a)]])
    with pytest.raises(ValueError, match="differ at position 0: tower 1 has "
                       "b:0 where tower 0 has a:0"):
      towers.average_gradients([[(g, a)], [(g, b)]])
    with pytest.raises(ValueError, match="one weight per tower"):
      towers.average_gradients([[(g, a)], [(g, a)]], weights=[1.0])
    with pytest.raises(ValueError, match="sum to 1"):
      towers.average_gradients([[(g, a)], [(g, a)]], weights=[1.0, 1.0])
    with pytest.raises(ValueError, match="non-negative"):
      towers.average_gradients([[(g, a)], [(g, a)]], weights=[1.5, -0.5])


def test_minimize_checks_clip_norm_and_missing_gradients():
  with tf.Graph().as_default():
    with pytest.raises(ValueError, match="clip_norm"):
      towers.minimize(model_fn(), _sgd(), 1, devices=devices(1), clip_norm=0)
  with tf.Graph().as_default():
    unused = []

    def model(scope):
      unused.append(_var("unused"))
      return tf.constant(1.0)

    with pytest.raises(ValueError, match="no variable has a gradient.*unused"):
      towers.minimize(model, _sgd(), 2, devices=devices(2))


@pytest.mark.parametrize("helper", [towers.virtual_cpu_config,
                                    towers.tower_devices])
def test_device_helpers_check_their_count(helper):
  with pytest.raises(ValueError, match="positive int"):
    helper(0)
  with pytest.raises(TypeError, match="positive int"):
    helper(1.5)


@pytest.mark.parametrize("num_gpus", [np.int64(2), np.int32(2), np.uint8(2)])
def test_numpy_integer_tower_counts_are_accepted(num_gpus):
  with tf.Graph().as_default():
    t = towers.build_towers(model_fn(), _sgd(), num_gpus,
                            inputs=_constant_batch(), devices=devices(2))
    assert len(t.losses) == 2
    assert len(towers.tower_devices(num_gpus)) == 2


def test_numpy_bools_and_floats_are_refused_as_tower_counts():
  with tf.Graph().as_default():
    for bad in (np.bool_(True), np.float64(2.0)):
      with pytest.raises(TypeError, match="num_gpus to be a positive int"):
        towers.build_towers(model_fn(), _sgd(), bad)


def test_eager_execution_names_the_call_that_turns_it_off():
  if not tf.executing_eagerly():
    pytest.skip("eager execution is off in this run (--ref-variables, or "
                "TensorFlow 1.x)")
  with pytest.raises(RuntimeError, match=r"eager execution is on.*"
                     r"tf.compat.v1.disable_eager_execution\(\)"):
    towers.build_towers(lambda scope: tf.constant(1.0), _sgd(), 1,
                        devices=devices(1))


def test_a_loss_of_unknown_rank_that_is_not_a_scalar_gets_the_hint():
  with tf.Graph().as_default() as g:
    values = tf.placeholder(tf.float32, shape=None)

    def model(scope):
      return tf.reduce_sum(_var()) * values

    t = towers.build_towers(model, _sgd(), 2, devices=devices(2))
    with session(g, 2) as sess:
      sess.run(tf.global_variables_initializer())
      assert sess.run(t.loss, {values: 2.0}) == pytest.approx(4.0)
      with pytest.raises(tf.errors.InvalidArgumentError,
                         match=r"scalar loss in tower_\d; did you forget "
                         r"tf.reduce_mean"):
        sess.run(t.loss, {values: [1.0, 2.0, 3.0]})


def _constant_batch():
  x, y = batch(8)
  return tf.constant(x), tf.constant(y)
