"""Inference on towers: outputs come back in the batch's order."""

import numpy as np
import pytest
import tensorflow.compat.v1 as tf

import towers
from models import IN, batch, devices, initial_values, session


def _logits(x):
  values = initial_values()
  with tf.variable_scope("hidden"):
    w = tf.get_variable("w", initializer=values["hidden/w"])
    b = tf.get_variable("b", initializer=values["hidden/b"])
  return tf.tanh(tf.matmul(x, w) + b)


def _reference(x):
  with tf.Graph().as_default() as g:
    out = _logits(tf.constant(x))
    with session(g, 1) as sess:
      sess.run(tf.global_variables_initializer())
      return sess.run(out)


@pytest.mark.parametrize("size,num", [(8, 1), (8, 2), (9, 3), (10, 4),
                                      (3, 4)])
def test_outputs_come_back_in_batch_order(size, num):
  x, _ = batch(size)
  with tf.Graph().as_default() as g:
    images = tf.placeholder(tf.float32, [None, IN])
    out = towers.infer(lambda scope, x: _logits(x), num, inputs=images,
                       devices=devices(num))
    assert sorted(v.op.name for v in tf.global_variables()) == [
        "hidden/b", "hidden/w"]
    with session(g) as sess:
      sess.run(tf.global_variables_initializer())
      got = sess.run(out, {images: x})
  np.testing.assert_allclose(got, _reference(x), rtol=1e-6, atol=1e-6)


def test_nested_inputs_and_outputs_keep_their_structure():
  x, y = batch(10)
  with tf.Graph().as_default() as g:
    features = {"x": tf.constant(x), "y": tf.constant(y)}

    def model(scope, features):
      return {"logits": _logits(features["x"]),
              "labels": features["y"]}, features["y"] * 2

    out = towers.infer(model, 3, inputs=features, devices=devices(3))
    with session(g, 3) as sess:
      sess.run(tf.global_variables_initializer())
      got = sess.run(out)
  np.testing.assert_allclose(got[0]["logits"], _reference(x), rtol=1e-6,
                             atol=1e-6)
  np.testing.assert_array_equal(got[0]["labels"], y)
  np.testing.assert_array_equal(got[1], y * 2)


def test_each_tower_runs_on_its_device_and_reads_shared_variables():
  with tf.Graph().as_default() as g:
    towers.infer(lambda scope, x: _logits(x), 2,
                 inputs=tf.ones([4, IN]), devices=["/cpu:1", "/cpu:2"])
    matmuls = sorted((op.name, op.device) for op in g.get_operations()
                     if op.type == "MatMul")
    assert matmuls == [("tower_0/MatMul", "/device:CPU:1"),
                       ("tower_1/MatMul", "/device:CPU:2")]
    assert tf.global_variables()[0].op.device == "/device:CPU:0"


def test_a_single_device_checkpoint_restores_into_towers(tmp_path):
  x, _ = batch(6)
  path = str(tmp_path / "model.ckpt")
  with tf.Graph().as_default() as g:
    _logits(tf.constant(x))
    with session(g, 1) as sess:
      sess.run(tf.global_variables_initializer())
      tf.train.Saver().save(sess, path)
  with tf.Graph().as_default() as g:
    out = towers.infer(lambda scope, x: _logits(x), 2,
                       inputs=tf.constant(x), devices=devices(2))
    with session(g, 2) as sess:
      tf.train.Saver().restore(sess, path)
      np.testing.assert_allclose(sess.run(out), _reference(x), rtol=1e-6,
                                 atol=1e-6)


def test_infer_refuses_what_it_cannot_put_back_in_order():
  with tf.Graph().as_default():
    with pytest.raises(TypeError, match="infer needs inputs holding the "
                       "global batch"):
      towers.infer(lambda scope, x: x, 2, inputs=lambda: tf.ones([2, 1]),
                   devices=devices(2))
    with pytest.raises(ValueError, match=r"scalar .* in tower_0"):
      towers.infer(lambda scope, x: tf.reduce_sum(x), 2,
                   inputs=tf.ones([4, 1]), devices=devices(2))
    with pytest.raises(TypeError, match="expected model_fn to return "
                       "tensors in tower_0"):
      towers.infer(lambda scope, x: 3.0, 2, inputs=tf.ones([4, 1]),
                   devices=devices(2))
