"""Mixed precision: half-precision towers on float32 master weights, loss
scaling with overflow steps skipped, checkpoints that restore in float32."""

import os

import numpy as np
import pytest
import tensorflow.compat.v1 as tf

import towers
from towers import _loss_scale
from towers import _tf_versions

from tests import models

BATCH = 16


def half_model_fn(dtype, boost=None):
  """The shared two-layer net, asking for its weights in `dtype`.

  The loss is float32; `boost` (a scalar tensor) multiplies the logits, so
  a large one overflows float16 in the gradient.
  """
  values = models.initial_values()

  def layer(name, inputs):
    with tf.variable_scope(name):
      w = tf.get_variable("w", initializer=values[name + "/w"].astype(
          dtype.as_numpy_dtype), dtype=dtype)
      b = tf.get_variable("b", initializer=values[name + "/b"].astype(
          dtype.as_numpy_dtype), dtype=dtype)
      return tf.matmul(inputs, w) + b

  def model_fn(scope, x, y):
    del scope
    hidden = tf.tanh(layer("hidden", tf.cast(x, dtype)))
    logits = layer("logits", hidden)
    if boost is not None:
      logits *= tf.cast(boost, dtype)
    return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
        labels=y, logits=tf.cast(logits, tf.float32)))

  return model_fn


def build(dtype, *, variable_device="cpu", loss_scale=None, opt=None,
          num_towers=2, boost=None):
  x, y = models.batch(BATCH)
  global_step = tf.train.get_or_create_global_step()
  opt = opt or tf.train.MomentumOptimizer(0.1, 0.9)
  train_op, t = towers.minimize(
      half_model_fn(tf.as_dtype(dtype) if dtype else tf.float32, boost),
      opt, num_towers, inputs=(tf.constant(x), tf.constant(y)),
      devices=models.devices(num_towers), variable_device=variable_device,
      compute_dtype=dtype, loss_scale=loss_scale, global_step=global_step)
  return train_op, t, global_step


def initialize(sess):
  sess.run(tf.global_variables_initializer())
  sess.run(tf.local_variables_initializer())




@pytest.mark.parametrize("variable_device", ["cpu", "replicated"])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_towers_train_on_float32_master_weights(dtype, variable_device):
  with tf.Graph().as_default() as g:
    train_op, t, global_step = build(dtype, variable_device=variable_device)
    trainable = tf.trainable_variables()
    assert sorted(v.op.name for v in trainable) == [
        "hidden/b", "hidden/w", "logits/b", "logits/w"]
    assert {v.dtype.base_dtype for v in models.state_variables()
            if v is not global_step} == {tf.float32}
    # The towers compute in the half dtype: every matmul is a half one.
    matmuls = [op for op in g.get_operations() if op.type == "MatMul"
               and op.name.startswith("tower_")]
    assert matmuls and all(op.outputs[0].dtype == tf.as_dtype(dtype)
                           for op in matmuls)
    # float16 is loss-scaled by default, bfloat16 not.
    assert (t.loss_scale is not None) == (dtype == "float16")
    with models.session(g) as sess:
      initialize(sess)
      first = sess.run(t.loss)
      for _ in range(50):
        sess.run(train_op)
      last, step = sess.run([t.loss, global_step])
  assert last < 0.5 * first, (first, last)
  assert step >= 45


@pytest.mark.parametrize("variable_device", ["cpu", "replicated"])
def test_overflow_step_changes_nothing_and_halves_the_scale(variable_device):
  with tf.Graph().as_default() as g:
    boost = tf.placeholder_with_default(1.0, [])
    train_op, t, global_step = build("float16",
                                     variable_device=variable_device,
                                     boost=boost)
    state = models.state_variables()
    scale_var = [v for v in state if v.op.name == "loss_scale"]
    assert len(scale_var) == 1
    if variable_device == "replicated":
      assert any(v.op.name.startswith("replica_1/") for v in state)
    with models.session(g) as sess:
      initialize(sess)
      sess.run(train_op)  # slots and copies away from their initial values
      before = sess.run(state)
      scale = sess.run(t.loss_scale)
      sess.run(train_op, {boost: 1e4})  # float16 gradients overflow
      after = sess.run(state)
      names = [v.op.name for v in state]
      for name, b, a in zip(names, before, after):
        if name == "loss_scale":
          assert a == b / 2, (b, a)
        elif name != "loss_scale_good_steps":
          np.testing.assert_array_equal(a, b, err_msg=name)
      assert sess.run(global_step) == 1
      sess.run(train_op)  # a finite step applies again
      assert sess.run(global_step) == 2
      assert sess.run(t.loss_scale) == scale / 2
      assert not np.array_equal(sess.run(tf.trainable_variables()[0]),
                                before[names.index("hidden/w")])


def test_dynamic_scale_doubles_after_a_run_of_finite_steps(monkeypatch):
  monkeypatch.setattr(_loss_scale, "GROWTH_STEPS", 3)
  with tf.Graph().as_default() as g:
    train_op, t, _ = build("float16")
    good = [v for v in tf.global_variables()
            if v.op.name == "loss_scale_good_steps"][0]
    with models.session(g) as sess:
      initialize(sess)
      scales = []
      for _ in range(7):
        sess.run(train_op)
        scales.append(sess.run([t.loss_scale, good]))
  s = _loss_scale.INITIAL_SCALE
  assert [list(map(float, v)) for v in scales] == [
      [s, 1], [s, 2], [2 * s, 0], [2 * s, 1], [2 * s, 2], [4 * s, 0],
      [4 * s, 1]]


@pytest.mark.parametrize("variable_device", ["cpu", "replicated"])
def test_power_of_two_loss_scale_gives_the_unscaled_step_bitwise(
    variable_device):
  results = []
  for loss_scale in (None, 1024.0):
    with tf.Graph().as_default() as g:
      train_op, _, _ = build(None, variable_device=variable_device,
                             loss_scale=loss_scale)
      with models.session(g) as sess:
        initialize(sess)
        for _ in range(3):
          sess.run(train_op)
        results.append(sess.run(tf.trainable_variables()))
  for a, b in zip(*results):
    np.testing.assert_array_equal(a, b)


def test_half_checkpoint_restores_into_a_float32_single_device_graph(
    tmp_path):
  path = os.path.join(str(tmp_path), "model.ckpt")
  with tf.Graph().as_default() as g:
    train_op, _, _ = build("float16", variable_device="replicated")
    with models.session(g) as sess:
      initialize(sess)
      for _ in range(5):
        sess.run(train_op)
      trained = {v.op.name: sess.run(v) for v in tf.trainable_variables()}
      tf.train.Saver().save(sess, path)
  stored = dict(tf.train.list_variables(path))
  assert "replica_1/hidden/w" not in stored
  with tf.Graph().as_default() as g:
    x, y = models.batch(BATCH)
    loss = half_model_fn(tf.float32)(None, tf.constant(x), tf.constant(y))
    with models.session(g, 1) as sess:
      tf.train.Saver().restore(sess, path)
      for v in tf.trainable_variables():
        assert v.dtype.base_dtype == tf.float32
        np.testing.assert_array_equal(sess.run(v), trained[v.op.name])
      assert np.isfinite(sess.run(loss))


def test_loss_scale_optimizer_of_tensorflow_composes_with_minimize():
  with tf.Graph().as_default() as g:
    opt = _tf_versions.loss_scale_optimizers()[0](
        tf.train.MomentumOptimizer(0.1, 0.9), "dynamic")
    boost = tf.placeholder_with_default(1.0, [])
    train_op, t, global_step = build("float16", opt=opt, boost=boost)
    assert t.loss_scale is None  # the optimizer scales; minimize does not
    with models.session(g) as sess:
      initialize(sess)
      first = sess.run(t.loss)
      sess.run(train_op, {boost: 1e4})
      assert sess.run(global_step) == 0
      for _ in range(30):
        sess.run(train_op)
      assert sess.run(t.loss) < first


@pytest.mark.parametrize("compute_dtype", ["int8", "float64", "half16", 3])
def test_unknown_compute_dtype_is_refused(compute_dtype):
  x, y = models.batch(BATCH)
  with tf.Graph().as_default():
    with pytest.raises(ValueError, match="compute_dtype.*bfloat16"):
      towers.minimize(half_model_fn(tf.float32), tf.train.AdamOptimizer(), 2,
                      inputs=(tf.constant(x), tf.constant(y)),
                      devices=models.devices(2), compute_dtype=compute_dtype)


@pytest.mark.parametrize("loss_scale", ["auto", 0, -2.0, True])
def test_bad_loss_scale_is_refused(loss_scale):
  with tf.Graph().as_default():
    with pytest.raises(ValueError, match="loss_scale"):
      build("float16", loss_scale=loss_scale)


def test_loss_scale_on_a_loss_scale_optimizer_is_refused():
  with tf.Graph().as_default():
    opt = _tf_versions.loss_scale_optimizers()[0](
        tf.train.GradientDescentOptimizer(0.1), "dynamic")
    with pytest.raises(ValueError, match="scale it twice"):
      build("float16", opt=opt, loss_scale="dynamic")


def test_loss_scale_with_sync_replicas_is_refused():
  with tf.Graph().as_default():
    opt = tf.train.SyncReplicasOptimizer(
        tf.train.GradientDescentOptimizer(0.1), replicas_to_aggregate=2)
    with pytest.raises(ValueError, match="SyncReplicasOptimizer.*bfloat16"):
      build("float16", opt=opt)


def test_float32_variables_requested_by_a_half_model_stay_as_asked():
  with tf.Graph().as_default():

    def model_fn(scope, x):
      del scope
      w = tf.get_variable("w", [models.IN, 1], dtype=tf.float16)
      gamma = tf.get_variable("gamma", [1], dtype=tf.float32)
      count = tf.get_variable("count", [], dtype=tf.float16,
                              trainable=False)
      # A cast is a tensor; the variables returned as they are are not.
      assert not isinstance(gamma, tf.Tensor)
      assert not isinstance(count, tf.Tensor)
      assert isinstance(w, tf.Tensor) and w.dtype == tf.float16
      out = tf.cast(tf.matmul(tf.cast(x, tf.float16), w) + count,
                    tf.float32) * gamma
      return tf.reduce_mean(out)

    x, _ = models.batch(4)
    towers.build_towers(model_fn, tf.train.GradientDescentOptimizer(0.1), 2,
                        inputs=tf.constant(x), devices=models.devices(2),
                        compute_dtype=tf.float16)
    dtypes = {v.op.name: v.dtype.base_dtype for v in tf.global_variables()}
    assert dtypes == {"w": tf.float32, "gamma": tf.float32,
                      "count": tf.float16}


@pytest.mark.parametrize("variable_device", ["cpu", "replicated"])
def test_sparse_and_none_gradients_pass_through_loss_scaling(
    variable_device):
  ids = np.array([[0, 3], [3, 5], [1, 1], [7, 2]], np.int32)
  with tf.Graph().as_default() as g:

    def model_fn(scope, batch):
      del scope
      table = tf.get_variable("table", [8, 4], dtype=tf.float16,
                              initializer=tf.ones_initializer())
      tf.get_variable("unused", [3], dtype=tf.float16)
      rows = tf.nn.embedding_lookup(table, batch)
      return tf.reduce_mean(tf.square(tf.cast(rows, tf.float32)))

    train_op, t = towers.minimize(
        model_fn, tf.train.GradientDescentOptimizer(1.0), 2,
        inputs=tf.constant(ids), devices=models.devices(2),
        variable_device=variable_device, compute_dtype="float16",
        loss_scale=256.0)
    grads = dict((v.op.name, grad) for grad, v in t.grads_and_vars)
    assert isinstance(grads["table"], tf.IndexedSlices)
    assert grads["unused"] is None
    table = [v for v in tf.global_variables() if v.op.name == "table"][0]
    with models.session(g) as sess:
      initialize(sess)
      sess.run(train_op)
      values = sess.run(table)
  # d/d(row) of mean(row**2) over 4 x 2 x 4 entries is row / 16 per use.
  counts = np.bincount(ids.ravel(), minlength=8)
  expected = 1.0 - counts[:, None] * np.ones((8, 4)) / 16.0
  np.testing.assert_allclose(values, expected, rtol=1e-6)
