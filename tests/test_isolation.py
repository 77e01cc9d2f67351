"""Each tower's loss reads its own batch; the towers regularize alike."""

import numpy as np
import pytest
import tensorflow.compat.v1 as tf

import towers
from models import (DECAY, assert_gradients_close, averaged_gradient_values,
                    batch, devices, loss_fn, reference_gradients, session)


def _sgd():
  return tf.train.GradientDescentOptimizer(0.1)


def _split(size):
  """The batch, and it as constants of the default graph."""
  x, y = batch(size)
  return x, y, (tf.constant(x), tf.constant(y))


@pytest.mark.parametrize("num", [2, 4])
def test_a_loss_collecting_every_towers_losses_names_the_tower_and_the_fix(
    num):
  # tf.losses.get_total_loss() without the scope sums the losses of the
  # towers built so far: measured 85% (2 towers) and 269% (4) off.
  def model(scope, x, y):
    tf.losses.add_loss(loss_fn(x, y))
    return tf.losses.get_total_loss()

  with tf.Graph().as_default():
    with pytest.raises(ValueError, match=r"tower_1's loss reads tower_0's "
                       r"data through tower_0/.*scope=scope"):
      towers.build_towers(model, _sgd(), num, inputs=_split(8)[2],
                          devices=devices(num))


def test_the_unscoped_losses_collection_is_refused_too():
  def model(scope, x, y):
    tf.add_to_collection("losses", loss_fn(x, y))
    return tf.add_n(tf.get_collection("losses"))

  with tf.Graph().as_default():
    with pytest.raises(ValueError, match="tower_1's loss reads tower_0's"):
      towers.build_towers(model, _sgd(), 2, inputs=_split(8)[2],
                          devices=devices(2))


def test_the_scoped_collection_gives_the_single_device_gradient():
  def model(scope, x, y):
    tf.losses.add_loss(loss_fn(x, y))
    return tf.losses.get_total_loss(scope=scope)

  _, want = reference_gradients(*batch(8))
  with tf.Graph().as_default() as g:
    _, _, inputs = _split(8)
    t = towers.build_towers(model, _sgd(), 2, inputs=inputs,
                            devices=devices(2))
    got = averaged_gradient_values(g, t)
  assert_gradients_close(got, want)


def _hand_regularized_model(total_loss):
  """A model whose regularizer runs where tower 0 creates the variable, in
  tower 0's name scope, as tf.layers' kernel_regularizer does."""

  def model(scope, x, y):
    with tf.variable_scope("dense"):
      w = tf.get_variable("w", initializer=np.ones((6, 3), np.float32))
      if not tf.get_variable_scope().reuse:
        tf.add_to_collection(tf.GraphKeys.REGULARIZATION_LOSSES,
                             DECAY * tf.nn.l2_loss(w))
    logits = tf.matmul(x, w)
    tf.losses.sparse_softmax_cross_entropy(y, logits)
    return total_loss(scope)

  return model


def _assert_one_device_gradient(model, decay):
  """Checks the towers' averaged gradient of `model`'s one weight against
  one device's, with `decay` times its L2 loss."""
  with tf.Graph().as_default() as g:
    x, y, inputs = _split(8)
    w = tf.constant(np.ones((6, 3), np.float32))
    want = tf.gradients(
        tf.losses.sparse_softmax_cross_entropy(y, tf.matmul(x, w)) +
        decay * tf.nn.l2_loss(w), w)[0]
    t = towers.build_towers(model, _sgd(), 2, inputs=inputs,
                            devices=devices(2))
    [(grad, _)] = towers.average_gradients(t.tower_grads, t.weights)
    with session(g) as sess:
      sess.run(tf.global_variables_initializer())
      got, want = sess.run([grad, want])
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7)


def test_towers_that_count_a_regularization_loss_unequally_are_refused():
  # Tower 0's scope holds the regularization loss, so summing the scope's
  # losses counts it in tower 0 only: measured 7% off.
  model = _hand_regularized_model(
      lambda scope: tf.losses.get_total_loss(scope=scope))
  with tf.Graph().as_default():
    with pytest.raises(ValueError, match=r"different regularization losses: "
                       r"tower_0.s includes tower_0/dense/mul.*tower_1's "
                       r"does not.*get_regularization_loss\(\)"):
      towers.build_towers(model, _sgd(), 2, inputs=_split(8)[2],
                          devices=devices(2))


def test_the_documented_regularization_is_shared_by_every_tower():
  # The regularization loss lives in tower 0's scope but reads only the
  # variable: every tower may add it.
  model = _hand_regularized_model(
      lambda scope: tf.losses.get_total_loss(
          add_regularization_losses=False, scope=scope) +
      tf.losses.get_regularization_loss())
  _assert_one_device_gradient(model, DECAY)


def _get_variable_regularized_model(total_loss, drop=False):
  """The tutorial's loss on a tf.get_variable regularizer, whose loss is
  created beside the variable (``w/Regularizer/``), in no tower's scope."""

  def model(scope, x, y):
    w = tf.get_variable("w", initializer=np.ones((6, 3), np.float32),
                        regularizer=lambda w: DECAY * tf.nn.l2_loss(w))
    if drop:
      del tf.get_collection_ref(tf.GraphKeys.REGULARIZATION_LOSSES)[:]
    tf.losses.sparse_softmax_cross_entropy(y, tf.matmul(x, w))
    return total_loss(scope)

  return model


def test_weight_decay_no_tower_reads_is_refused_naming_the_fix():
  model = _get_variable_regularized_model(
      lambda scope: tf.losses.get_total_loss(scope=scope))
  with tf.Graph().as_default():
    with pytest.raises(ValueError, match=r"no tower's loss reads the "
                       r"regularization losses w/Regularizer(/mul)?, so "
                       r"training would silently drop that weight decay.*"
                       r"scope=scope\) \+ tf.losses.get_regularization_loss"
                       r"\(\).*on purpose.*REGULARIZATION_LOSSES\)\[:\]"):
      towers.build_towers(model, _sgd(), 2, inputs=_split(8)[2],
                          devices=devices(2))


def test_weight_decay_with_the_fix_gives_the_single_device_gradient():
  model = _get_variable_regularized_model(
      lambda scope: tf.losses.get_total_loss(
          add_regularization_losses=False, scope=scope) +
      tf.losses.get_regularization_loss())
  _assert_one_device_gradient(model, DECAY)


def test_weight_decay_taken_out_of_the_collection_is_left_out_on_purpose():
  # The documented way to train without a model's regularizers.
  model = _get_variable_regularized_model(
      lambda scope: tf.losses.get_total_loss(scope=scope), drop=True)
  _assert_one_device_gradient(model, 0.0)


def _per_call_model(activity, held=None):
  """A model whose every call adds a regularization loss of its own, as an
  activity regularizer or a replicated tf.layers layer does: the weight's
  L2 loss, or an activity regularizer of the tower's logits. With `held`,
  its loss also sums what earlier calls added there."""

  def model(scope, x, y):
    del scope
    w = tf.get_variable("w", initializer=np.ones((6, 3), np.float32))
    logits = tf.matmul(x, w)
    decay = 0.1 * tf.reduce_mean(tf.square(logits)) if activity else \
        DECAY * tf.nn.l2_loss(w)
    tf.add_to_collection(tf.GraphKeys.REGULARIZATION_LOSSES, decay)
    ce = tf.losses.sparse_softmax_cross_entropy(y, logits)
    if held is None:
      return ce + tf.losses.get_regularization_loss()
    held.append(decay)
    return ce + tf.add_n(held)

  return model


@pytest.mark.parametrize("variable_device", ["cpu", "replicated"])
@pytest.mark.parametrize("activity", [False, True],
                         ids=["weight", "activity"])
def test_a_regularization_loss_every_call_adds_counts_once_in_each_tower(
    activity, variable_device):
  # Each tower's own stands in for tower 0's in that tower's collection,
  # and the collection is one device's once the towers are built.
  model = _per_call_model(activity)
  x, y = batch(8)
  with tf.Graph().as_default() as g:
    loss = model(None, tf.constant(x), tf.constant(y))
    [want] = tf.gradients(loss, tf.trainable_variables())
    with session(g) as sess:
      sess.run(tf.global_variables_initializer())
      want = sess.run(want)
  with tf.Graph().as_default() as g:
    t = towers.build_towers(model, _sgd(), 2, inputs=_split(8)[2],
                            devices=devices(2),
                            variable_device=variable_device)
    [(grad, _)] = towers.average_gradients(t.tower_grads, t.weights)
    [kept] = tf.get_collection(tf.GraphKeys.REGULARIZATION_LOSSES)
    assert kept.op.name.startswith("tower_0/")
    with session(g) as sess:
      sess.run(tf.global_variables_initializer())
      sess.run(tf.local_variables_initializer())
      got = sess.run(grad)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7)


def test_a_tower_that_counts_tower_0s_regularization_again_is_refused():
  # Tower 1's loss sums tower 0's weight decay and its own.
  model = _per_call_model(activity=False, held=[])
  with tf.Graph().as_default():
    with pytest.raises(ValueError, match=r"different regularization losses: "
                       r"tower_1's includes tower_0/mul more often than "
                       r"tower_0's"):
      towers.build_towers(model, _sgd(), 2, inputs=_split(8)[2],
                          devices=devices(2))


def test_an_input_pipeline_built_inside_the_first_tower_may_be_shared():
  # The iterator is tower 0's op, but later towers read only its handle.
  x, y = batch(8)
  pipeline = []

  def model(scope):
    if not pipeline:
      dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(4).repeat()
      pipeline.append(tf.data.make_one_shot_iterator(dataset))
    images, labels = pipeline[0].get_next()
    return loss_fn(images, labels)

  with tf.Graph().as_default():
    t = towers.build_towers(model, _sgd(), 2, devices=devices(2))
  assert len(t.losses) == 2
