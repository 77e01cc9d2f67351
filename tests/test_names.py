"""Names in every tower: default names line up, variables keep the names they
have on one device, and a name that cannot line up is a clear error."""

import itertools

import numpy as np
import pytest
import tensorflow.compat.v1 as tf

import towers
from models import (assert_gradients_close, batch, devices, loss_fn,
                    reference_gradients, session)


def default_named(scope, x, y):
  """The model inside a scope named as BERT's BertModel names its own."""
  del scope
  with tf.variable_scope(None, default_name="bert"):
    return loss_fn(x, y)


@pytest.mark.parametrize("mode", ["cpu", "replicated"])
def test_default_named_variable_scope_lines_up_in_every_tower(mode):
  x, y = batch(12)
  with tf.Graph().as_default() as graph:
    t = towers.build_towers(default_named, tf.train.GradientDescentOptimizer(
        0.1), 3, inputs=(tf.constant(x), tf.constant(y)), devices=devices(3),
                            variable_device=mode)
    names = sorted(v.op.name for v in tf.global_variables())
    assert names == ["bert/hidden/b", "bert/hidden/w", "bert/logits/b",
                     "bert/logits/w"]
    # Op names stay each tower's own.
    assert [s for s in t.scopes] == ["tower_0/", "tower_1/", "tower_2/"]
    assert graph.get_operation_by_name("tower_2/bert/hidden/MatMul")
    averaged = towers.average_gradients(t.tower_grads)
    with session(graph) as sess:
      sess.run(tf.global_variables_initializer())
      sess.run(tf.local_variables_initializer())
      got = sess.run({v.op.name: g for g, v in averaged})
  _, want = reference_gradients(x, y)
  assert_gradients_close(got, {"bert/" + k: v for k, v in want.items()})


def test_default_names_restart_inside_the_callers_scope():
  x, y = batch(8)
  with tf.Graph().as_default():
    with tf.variable_scope("model"):
      towers.build_towers(default_named, tf.train.GradientDescentOptimizer(
          0.1), 2, inputs=(tf.constant(x), tf.constant(y)),
                          devices=devices(2))
    assert sorted(v.op.name for v in tf.trainable_variables())[0] == \
        "model/bert/hidden/b"


def test_a_name_that_counts_on_across_calls_is_a_clear_error():
  x, y = batch(8)
  counter = itertools.count()

  def model(scope, x, y):
    del scope
    with tf.variable_scope("block%d" % next(counter)):
      return loss_fn(x, y)

  with tf.Graph().as_default():
    with pytest.raises(ValueError) as e:
      towers.build_towers(model, tf.train.GradientDescentOptimizer(0.1), 2,
                          inputs=(tf.constant(x), tf.constant(y)),
                          devices=devices(2))
  message = str(e.value)
  assert "tower_1 asks for the variable block1/hidden/w" in message
  assert "did you mean block0/hidden/w?" in message
  assert "same name in every call" in message


def test_tower_0s_global_variables_have_single_device_names():
  """Made without tf.get_variable: tower 0's global ones are named as on
  one device; tf.metrics' local ones stay each tower's."""
  x, y = batch(8)

  def model(scope, x, y):
    del scope
    tf.Variable(0.0, trainable=False, name="calls")
    loss = loss_fn(x, y)
    tf.metrics.mean(loss)
    return loss

  with tf.Graph().as_default():
    towers.build_towers(model, tf.train.GradientDescentOptimizer(0.1), 2,
                        inputs=(tf.constant(x), tf.constant(y)),
                        devices=devices(2))
    names = {v.op.name for v in tf.global_variables()}
    assert "calls" in names and "tower_0/calls" not in names
    local = [v.op.name.split("/", 1) for v in tf.local_variables()]
    assert sorted(tower for tower, _ in local) == ["tower_0"] * 2 + [
        "tower_1"] * 2


@pytest.mark.parametrize("mode", ["cpu", "replicated"])
def test_an_update_nothing_refers_to_runs_once_per_step_from_tower_0(mode):
  """A write a model keeps only in Python, as a Keras layer keeps its
  updates, joins UPDATE_OPS; minimize runs tower 0's."""
  x, y = batch(8)

  def model(scope, x, y):
    del scope
    seen = tf.get_variable("seen", [], trainable=False,
                           initializer=tf.zeros_initializer())
    seen.assign_add(tf.cast(tf.shape(x)[0], tf.float32))
    return loss_fn(x, y)

  with tf.Graph().as_default() as graph:
    train_op, t = towers.minimize(
        model, tf.train.GradientDescentOptimizer(0.1), 2,
        inputs=(tf.constant(x), tf.constant(y)), devices=devices(2),
        variable_device=mode)
    assert [op.name.split("/")[0] for op in t.update_ops] == ["tower_0"]
    with session(graph) as sess:
      sess.run(tf.global_variables_initializer())
      sess.run(tf.local_variables_initializer())
      for _ in range(3):
        sess.run(train_op)
      seen = sess.run(tf.global_variables("seen")[0])
  np.testing.assert_equal(seen, 3 * 4)
