"""Ways of writing a model that towers take as they are, as on one device.

Each model is trained on two towers and on one device on the same global
batch of 7 rows (an uneven split), in float64: the averaged gradients of the
first step and the variables after three Momentum steps must be one device's,
under the single-device names, and replicated towers must read their copies.
"""

import numpy as np
import pytest
import tensorflow.compat.v1 as tf

import towers
from models import devices, session

MODES = ["cpu", "replicated"]
SIZE, IN, HIDDEN = 7, 4, 5
STEPS = 3
# float64 sums per tower instead of over the global batch: a few ulps of
# values of order 1, where a wrong or missing term is of order 1e-3 or more.
TOLERANCE = 1e-12


def _initial():
  rng = np.random.RandomState(0)
  return {"hidden/w": rng.normal(0, 0.5, (IN, HIDDEN)),
          "hidden/b": rng.normal(0, 0.1, (HIDDEN,)),
          "out/w": rng.normal(0, 0.5, (HIDDEN, 1)),
          "out/b": rng.normal(0, 0.1, (1,))}


def _dense(name, x, values):
  with tf.variable_scope(name):
    w = tf.get_variable("w", dtype=tf.float64, initializer=values[name + "/w"])
    if name + "/b" not in values:
      return tf.matmul(x, w)
    b = tf.get_variable("b", dtype=tf.float64, initializer=values[name + "/b"])
    return tf.matmul(x, w) + b


def _mlp(x, values):
  return _dense("out", tf.tanh(_dense("hidden", x, values)), values)


def _regression_batch():
  rng = np.random.RandomState(1)
  return [rng.normal(0, 1, (SIZE, IN)), rng.normal(0, 1, (SIZE, 1))]


def _squared_error(prediction, y):
  return tf.reduce_mean(tf.square(prediction - y))


def _one_device(make_model_fn, arrays):
  """Gradients, then variables after `STEPS` steps, on one device."""
  with tf.Graph().as_default() as g:
    loss = make_model_fn()("", *[tf.constant(a) for a in arrays])
    variables = tf.trainable_variables()
    grads = tf.gradients(loss, variables)
    train_op = tf.train.MomentumOptimizer(0.1, 0.9).minimize(loss)
    with session(g, 1) as sess:
      sess.run(tf.global_variables_initializer())
      # Separate runs: a ref variable's update could race a fetch.
      first = sess.run(grads)
      for _ in range(STEPS):
        sess.run(train_op)
      after = sess.run(variables)
  names = [v.op.name for v in variables]
  return dict(zip(names, first)), dict(zip(names, after))


def _towers(make_model_fn, arrays, variable_device):
  """As `_one_device` on two towers, with the copies and the graph."""
  with tf.Graph().as_default() as g:
    train_op, t = towers.minimize(
        make_model_fn(), tf.train.MomentumOptimizer(0.1, 0.9), 2,
        inputs=tuple(tf.constant(a) for a in arrays), devices=devices(2),
        variable_device=variable_device)
    variables = tf.trainable_variables()
    copies = [v for v in tf.local_variables()
              if v.op.name.startswith("replica_")]
    with session(g, 2) as sess:
      sess.run(tf.global_variables_initializer())
      sess.run(tf.local_variables_initializer())
      first = sess.run({v.op.name: grad for grad, v in t.grads_and_vars})
      for _ in range(STEPS):
        sess.run(train_op)
      after = sess.run({v.op.name: v for v in variables + copies})
  return first, after, g


def _assert_trains_as_on_one_device(make_model_fn, arrays, variable_device):
  """Returns the names of the variables, checked to be one device's."""
  want_grads, want = _one_device(make_model_fn, arrays)
  grads, got, graph = _towers(make_model_fn, arrays, variable_device)
  assert sorted(grads) == sorted(want_grads)
  for name, value in want_grads.items():
    assert np.max(np.abs(value)) > 1e-3, name  # Every variable trains.
    np.testing.assert_allclose(grads[name], value, rtol=0, atol=TOLERANCE,
                               err_msg=name)
  for name, value in want.items():
    np.testing.assert_allclose(got[name], value, rtol=0, atol=TOLERANCE,
                               err_msg=name)
  if variable_device == "replicated":
    with graph.as_default():
      _assert_tower_1_reads_its_copies(sorted(want))
    for name in want:
      np.testing.assert_array_equal(got["replica_1/" + name], got[name],
                                    err_msg=name)
  else:
    assert sorted(got) == sorted(want)
  return sorted(want)


def _read_tensors(var):
  """The tensors through which ops read `var`: its handle or ref, and a ref
  variable's snapshot."""
  tensors = {var.op.outputs[0].name}
  if var.op.type != "VarHandleOp":
    tensors.add(var.value().name)
  return tensors


def _assert_tower_1_reads_its_copies(names):
  """No op of tower 1 reads copy 0 of a variable; each copy 1 is read."""
  by_name = {v.op.name: v
             for v in tf.trainable_variables() + tf.local_variables()}
  ops = [op for op in tf.get_default_graph().get_operations()
         if op.name.startswith("tower_1/")]
  inputs = {tensor.name for op in ops for tensor in op.inputs}
  for name in names:
    assert not _read_tensors(by_name[name]) & inputs, name
    assert _read_tensors(by_name["replica_1/" + name]) & inputs, name


def _critic_loss(real, fake, epsilon, values):
  """WGAN-GP's critic loss, whose gradient penalty is a gradient."""

  def critic(x, reuse):
    with tf.variable_scope("critic", reuse=reuse):
      return _mlp(x, values)

  critic_real, critic_fake = critic(real, None), critic(fake, True)
  interpolates = real + epsilon * (fake - real)
  slopes_of = tf.gradients(critic(interpolates, True), [interpolates])[0]
  slopes = tf.sqrt(tf.reduce_sum(tf.square(slopes_of), axis=1))
  penalty = 10.0 * tf.reduce_mean(tf.square(slopes - 1.0))
  return tf.reduce_mean(critic_fake) - tf.reduce_mean(critic_real) + penalty


@pytest.mark.parametrize("variable_device", MODES)
def test_a_gradient_penalty_in_model_fn_trains_as_on_one_device(
    variable_device):
  """The penalty's gradient is a second-order gradient through every
  tower's critic, which must reach the variables as on one device."""
  rng = np.random.RandomState(2)
  arrays = [rng.normal(1, 1, (SIZE, IN)), rng.normal(-1, 1, (SIZE, IN)),
            rng.uniform(0, 1, (SIZE, 1))]  # real, fake, epsilon
  values = _initial()
  del values["out/b"]  # It cancels out of the critic's loss: no gradient.

  def make_model_fn():
    return lambda scope, real, fake, epsilon: _critic_loss(
        real, fake, epsilon, values)

  _assert_trains_as_on_one_device(make_model_fn, arrays, variable_device)


@pytest.mark.parametrize("variable_device", MODES)
@pytest.mark.parametrize("where", ["outside", "inside"])
def test_a_template_trains_as_on_one_device(where, variable_device):
  """A template made outside model_fn enters its own variable scope, not
  the tower's, so replicated towers must still be made to read their
  copies; one made inside must get tower 0's names in every tower."""
  values = _initial()

  def make_model_fn():
    if where == "outside":
      net = tf.make_template("net", _mlp, values=values)
      return lambda scope, x, y: _squared_error(net(x), y)

    def model_fn(scope, x, y):
      del scope
      net = tf.make_template("net", _mlp, values=values)
      return _squared_error(net(x), y)

    return model_fn

  names = _assert_trains_as_on_one_device(make_model_fn, _regression_batch(),
                                          variable_device)
  assert names == ["net/" + name for name in sorted(values)]


# improved_wgan_training's tflib: parameters made by tf.Variable, shared by
# name through a module-level dict.
_PARAMS = {}


def _param(name, initial_value):
  if name not in _PARAMS:
    _PARAMS[name] = tf.Variable(initial_value, name=name)
  return _PARAMS[name]


def _registry_loss(x, y, values):
  hidden = tf.tanh(tf.matmul(x, _param("Hidden.W", values["hidden/w"])) +
                   _param("Hidden.b", values["hidden/b"]))
  prediction = (tf.matmul(hidden, _param("Out.W", values["out/w"])) +
                _param("Out.b", values["out/b"]))
  return _squared_error(prediction, y)


@pytest.mark.parametrize("variable_device", MODES)
def test_a_registry_of_tf_variables_shared_by_name_trains_as_on_one_device(
    variable_device):
  """Tower 0 creates the variables with tf.Variable; later towers get the
  same objects back from the registry, so no tower makes its own."""
  values = _initial()

  def make_model_fn():
    _PARAMS.clear()  # The registry holds one graph's variables.
    return lambda scope, x, y: _registry_loss(x, y, values)

  names = _assert_trains_as_on_one_device(make_model_fn, _regression_batch(),
                                          variable_device)
  assert names == ["Hidden.W", "Hidden.b", "Out.W", "Out.b"]
  # The towers' graph's registry: tower 0's variables, no tower's own.
  assert sorted(v.op.name for v in _PARAMS.values()) == names
