"""The tower context: what a tower knows of the others, and its
cross-tower sum."""

import numpy as np
import pytest
import tensorflow.compat.v1 as tf

import towers


def devices(n):
  return ["/cpu:%d" % i for i in range(n)]


def config(n):
  result = towers.virtual_cpu_config(n)
  result.operation_timeout_in_ms = 60000
  return result


def test_there_is_no_context_outside_the_towers():
  with tf.Graph().as_default():
    assert towers.tower_context() is None
    seen = []

    def model(scope, x):
      seen.append(towers.tower_context())
      return tf.reduce_sum(x * tf.get_variable(
          "w", [], initializer=tf.ones_initializer()))

    towers.build_towers(model, tf.train.GradientDescentOptimizer(0.1), 3,
                        inputs=tf.ones([6]), devices=devices(3))
    assert towers.tower_context() is None
  assert [c.index for c in seen] == [0, 1, 2]
  assert {c.num_towers for c in seen} == {3}
  assert {c.num_workers for c in seen} == {1}
  assert {c.devices for c in seen} == {tuple(devices(3))}
  assert [c.scope for c in seen] == ["tower_0/", "tower_1/", "tower_2/"]
  assert len({c.key for c in seen}) == 1


def test_each_set_of_towers_has_its_own_key():
  keys = []
  with tf.Graph().as_default():
    for name in ["a", "b"]:
      with tf.variable_scope(name):
        towers.infer(lambda scope, x: keys.append(
            towers.tower_context().key) or x, 2, inputs=tf.ones([4]),
                     devices=devices(2))
  assert keys[0] == keys[1] and keys[2] == keys[3] and keys[0] != keys[2]


def _weighted_model(scope, x):
  """A loss whose gradient crosses towers: each example's distance to the
  global batch's mean of x * w."""
  del scope
  w = tf.get_variable("w", [3], initializer=tf.constant_initializer(
      [0.5, -1.0, 2.0]))
  h = x * w
  context = towers.tower_context()
  if context is None:
    total, count = tf.reduce_sum(h, 0), tf.cast(tf.shape(h)[0], tf.float32)
  else:
    both = context.all_sum(tf.concat(
        [tf.reduce_sum(h, 0), [tf.cast(tf.shape(h)[0], tf.float32)]], 0))
    total, count = both[:3], both[3]
  return tf.reduce_mean(tf.square(h - total / count) * w)


@pytest.mark.parametrize("num_towers", [1, 2, 3, 4])
def test_all_sum_gives_the_global_batchs_value_and_gradient(num_towers):
  x = np.random.RandomState(3).normal(size=(10, 3)).astype(np.float32)
  with tf.Graph().as_default():
    loss = _weighted_model(None, tf.constant(x))
    want = tf.gradients(loss, tf.trainable_variables())
    with tf.Session() as sess:
      sess.run(tf.global_variables_initializer())
      want_loss, want = sess.run([loss, want])
  with tf.Graph().as_default():
    t = towers.build_towers(_weighted_model,
                            tf.train.GradientDescentOptimizer(0.1),
                            num_towers, inputs=tf.constant(x),
                            devices=devices(num_towers))
    averaged = towers.average_gradients(t.tower_grads, t.weights)
    with tf.Session(config=config(num_towers)) as sess:
      sess.run(tf.global_variables_initializer())
      got_loss, got = sess.run([t.loss, [g for g, _ in averaged]])
  np.testing.assert_allclose(got_loss, want_loss, rtol=0, atol=1e-5)
  np.testing.assert_allclose(got[0], want[0], rtol=0, atol=1e-5)


def test_all_sum_values_are_the_same_in_every_tower():
  with tf.Graph().as_default():
    sums = []

    def model(scope, x):
      del scope
      sums.append(towers.tower_context().all_sum(tf.reduce_sum(x, 0)))
      return x

    towers.infer(model, 3, inputs=tf.constant([[1.0], [2.0], [4.0]]),
                 devices=devices(3))
    with tf.Session(config=config(3)) as sess:
      got = sess.run(sums)
  assert [s.device for s in sums] == ["/device:CPU:%d" % i for i in range(3)]
  assert [g.tolist() for g in got] == [[7.0]] * 3


def test_a_mismatched_sum_is_refused_when_built():
  with tf.Graph().as_default():

    def model(scope, x):
      del scope
      context = towers.tower_context()
      return x + tf.reduce_sum(context.all_sum(tf.ones([context.index + 1])))

    with pytest.raises(ValueError, match="cross-tower sum 0 of tower_1 has "
                       "dtype float32 and shape .2."):
      towers.infer(model, 2, inputs=tf.ones([4]), devices=devices(2))


def test_a_gradient_built_outside_the_tower_is_refused():
  with tf.Graph().as_default():
    w = tf.get_variable("w", [], initializer=tf.ones_initializer())

    def model(scope, x):
      del scope
      return towers.tower_context().all_sum(x * w)

    outputs = towers.infer(model, 2, inputs=tf.ones([4]), devices=devices(2))
    with pytest.raises(ValueError, match="outside that tower"):
      tf.gradients(tf.reduce_sum(outputs), [w])


def test_a_sum_inside_a_v1_cond_is_refused():
  with tf.Graph().as_default():

    def model(scope, x):
      del scope
      return tf.cond(tf.constant(True),
                     lambda: towers.tower_context().all_sum(x),
                     lambda: x)

    with pytest.raises(ValueError, match="inside tf.cond"):
      towers.infer(model, 2, inputs=tf.ones([4]), devices=devices(2))
