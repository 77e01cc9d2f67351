"""XLA: each tower compiled through ``jit_scope`` in its model function gives
the uncompiled gradients (within rounding), and really is compiled."""

import contextlib

import numpy as np
import pytest
import tensorflow.compat.v1 as tf

import towers

from tests import models

BATCH = 12


def model_fn(xla):
  def fn(scope, x, y):
    del scope
    scope = tf.xla.experimental.jit_scope() if xla \
        else contextlib.nullcontext()
    with scope:
      return models.loss_fn(x, y, regularize=True)
  return fn


def averaged_gradients(xla, num_towers):
  """The averaged gradients, and the XLA ops the step ran."""
  with tf.Graph().as_default() as g:
    x, y = models.batch(BATCH)
    t = towers.build_towers(model_fn(xla),
                            tf.train.GradientDescentOptimizer(0.1),
                            num_towers, inputs=(tf.constant(x),
                                                tf.constant(y)),
                            devices=models.devices(num_towers))
    grads = [grad for grad, _ in towers.average_gradients(t.tower_grads,
                                                          t.weights)]
    with models.session(g) as sess:
      sess.run(tf.global_variables_initializer())
      metadata = tf.RunMetadata()
      values = sess.run(grads, options=tf.RunOptions(
          output_partition_graphs=True), run_metadata=metadata)
  ops = {node.op for graph in metadata.partition_graphs
         for node in graph.node}
  return values, {op for op in ops if op.startswith("_Xla")}


@pytest.mark.parametrize("num_towers", [1, 2, 3])
def test_compiled_towers_give_the_uncompiled_gradients(num_towers):
  plain, plain_ops = averaged_gradients(False, num_towers)
  compiled, compiled_ops = averaged_gradients(True, num_towers)
  assert not plain_ops
  assert {"_XlaCompile", "_XlaRun"} <= compiled_ops
  for a, b in zip(plain, compiled):
    np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-6)


def test_compiled_replicated_towers_train_as_uncompiled():
  trained = []
  for xla in (False, True):
    with tf.Graph().as_default() as g:
      x, y = models.batch(BATCH)
      train_op, _ = towers.minimize(
          model_fn(xla), tf.train.MomentumOptimizer(0.1, 0.9), 2,
          inputs=(tf.constant(x), tf.constant(y)), devices=models.devices(2),
          variable_device="replicated")
      with models.session(g) as sess:
        sess.run(tf.global_variables_initializer())
        sess.run(tf.local_variables_initializer())
        for _ in range(3):
          sess.run(train_op)
        trained.append(sess.run(tf.global_variables()))
  for a, b in zip(*trained):
    np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("variable_device", ["/cpu:0", "replicated"])
def test_variables_made_under_the_models_jit_scope_start_in_a_monitored_session(
    variable_device):
  # TensorFlow 1.15 compiles a resource variable made in the scope, and
  # MonitoredTrainingSession then finds every variable uninitialized.
  x, y = models.batch(BATCH)
  with tf.Graph().as_default() as graph:
    train_op, t = towers.minimize(
        model_fn(True), tf.train.GradientDescentOptimizer(0.5), 2,
        inputs=(tf.constant(x), tf.constant(y)), devices=models.devices(2),
        variable_device=variable_device,
        global_step=tf.train.get_or_create_global_step())
    variables = [op for op in graph.get_operations()
                 if op.type in ("VarHandleOp", "VariableV2")]
    assert variables and not any(
        op.get_attr("_XlaCompile") for op in variables
        if "_XlaCompile" in op.node_def.attr)
    with tf.train.MonitoredTrainingSession(config=models.config(2)) as sess:
      losses = [sess.run([train_op, t.loss])[1] for _ in range(3)]
  assert losses[-1] < losses[0]
