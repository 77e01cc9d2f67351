"""Several losses and optimizers on one set of towers: a GAN, exactly.

A generator with synchronized batch norm and a discriminator called on real
and fake data, D trained with Momentum and G with SGD, D step then G step:
every global variable and both losses against one device running
``opt_k.minimize(loss_k, var_list=vars_k)`` under the update ops on the
global batch.
"""

import functools

import numpy as np
import pytest
import tensorflow.compat.v1 as tf

import towers
from models import config, devices

Z_DIM, X_DIM, HIDDEN = 3, 5, 8
ITERATIONS = 3


def _initial(name, shape):
  seed = sum(map(ord, name))
  return tf.constant_initializer(
      np.random.RandomState(seed).randn(*shape).astype(np.float32) * 0.5)


def _dense(x, units, name):
  with tf.variable_scope(name):
    w = tf.get_variable("w", [x.shape[-1], units],
                        initializer=_initial(name + "/w", [int(x.shape[-1]),
                                                           units]))
    b = tf.get_variable("b", [units], initializer=_initial(name + "/b",
                                                           [units]))
  return tf.matmul(x, w) + b


def _generator(z):
  with tf.variable_scope("generator"):
    h = towers.batch_normalization(_dense(z, HIDDEN, "fc1"), training=True,
                                   momentum=0.9, name="bn")
    return tf.tanh(_dense(tf.nn.relu(h), X_DIM, "fc2"))


def _discriminator(x):
  with tf.variable_scope("discriminator", reuse=tf.AUTO_REUSE):
    h = tf.nn.leaky_relu(_dense(x, HIDDEN, "fc1"))
    return _dense(h, 1, "fc2")


def _xent(labels, logits):
  return tf.reduce_mean(
      tf.nn.sigmoid_cross_entropy_with_logits(labels=labels, logits=logits))


def gan_fn(scope, real, z):
  """The tower's two losses from one forward pass."""
  del scope
  fake = _generator(z)
  d_real, d_fake = _discriminator(real), _discriminator(fake)
  d_loss = _xent(tf.ones_like(d_real), d_real) + _xent(
      tf.zeros_like(d_fake), d_fake)
  return {"d": d_loss, "g": _xent(tf.ones_like(d_fake), d_fake)}


def _optimizers():
  return {"d": tf.train.MomentumOptimizer(0.1, 0.9),
          "g": tf.train.GradientDescentOptimizer(0.2)}


def _data(size):
  rng = np.random.RandomState(size)
  return (rng.randn(size, X_DIM).astype(np.float32),
          rng.randn(size, Z_DIM).astype(np.float32))


VAR_LIST = {"d": "discriminator/", "g": "generator/"}


def _train(graph, ops, losses, steps=ITERATIONS, num_devices=4):
  """Runs D step then G step; returns the losses seen and the variables."""
  seen = []
  with tf.Session(graph=graph, config=config(num_devices)) as sess:
    sess.run(tf.global_variables_initializer())
    sess.run(tf.local_variables_initializer())
    for _ in range(steps):
      for key in ops:
        _, values = sess.run([ops[key], losses])
        seen.append(values)
    return seen, {v.op.name: sess.run(v) for v in tf.global_variables()}


@functools.lru_cache(maxsize=None)
def _reference(size, steps=ITERATIONS):
  """One device on the global batch, as DCGAN trains it (once per size)."""
  real_np, z_np = _data(size)
  with tf.Graph().as_default() as graph:
    losses = gan_fn("", tf.constant(real_np), tf.constant(z_np))
    opts = _optimizers()
    ops = {}
    with tf.control_dependencies(tf.get_collection(tf.GraphKeys.UPDATE_OPS)):
      for key, prefix in VAR_LIST.items():
        ops[key] = opts[key].minimize(losses[key], var_list=[
            v for v in tf.trainable_variables()
            if v.op.name.startswith(prefix)])
    return _train(graph, ops, losses, steps)


def _assert_same(got, want, atol=1e-5):
  got_losses, got_vars = got
  want_losses, want_vars = want
  assert sorted(got_vars) == sorted(want_vars)
  for name, value in want_vars.items():
    np.testing.assert_allclose(got_vars[name], value, atol=atol, rtol=0,
                               err_msg=name)
  for got_step, want_step in zip(got_losses, want_losses):
    for key in want_step:
      np.testing.assert_allclose(got_step[key], want_step[key], atol=atol,
                                 rtol=0, err_msg=key)


MODES = [dict(), dict(variable_device="replicated", all_reduce="add_n"),
         dict(variable_device="replicated", all_reduce="ring")]
IDS = ["one-copy", "add_n", "ring"]


@pytest.mark.parametrize("num,size", [(2, 12), (3, 10)],
                         ids=["2towers-12", "3towers-10-uneven"])
@pytest.mark.parametrize("mode", MODES, ids=IDS)
def test_a_gan_trains_d_then_g_as_on_one_device(num, size, mode):
  real_np, z_np = _data(size)
  with tf.Graph().as_default() as graph:
    ops, t = towers.minimize(
        gan_fn, _optimizers(), num, inputs=(tf.constant(real_np),
                                            tf.constant(z_np)),
        devices=devices(num), var_list=VAR_LIST, **mode)
    assert sorted(ops) == ["d", "g"] and sorted(t.loss) == ["d", "g"]
    assert [v.op.name for _, v in t.grads_and_vars["g"]] == [
        "generator/fc1/w", "generator/fc1/b", "generator/bn/gamma",
        "generator/bn/beta", "generator/fc2/w", "generator/fc2/b"]
    got = _train(graph, ops, t.loss)
  _assert_same(got, _reference(size))


@pytest.mark.parametrize("mode", MODES, ids=IDS)
def test_the_by_hand_flow_per_loss_is_the_same(mode):
  num, size = 3, 10
  real_np, z_np = _data(size)
  with tf.Graph().as_default() as graph:
    opts = _optimizers()
    t = towers.build_towers(
        gan_fn, opts, num, inputs=(tf.constant(real_np), tf.constant(z_np)),
        devices=devices(num), var_list=VAR_LIST, **mode)
    ops = {}
    with tf.control_dependencies(t.update_ops):
      for key in ("d", "g"):
        # The seed's line, per loss: no weights, the towers' own shares.
        grads = towers.average_gradients(t.tower_grads[key])
        ops[key] = opts[key].apply_gradients(grads)
    got = _train(graph, ops, t.loss)
  _assert_same(got, _reference(size))


def test_a_callable_var_list_is_resolved_after_tower_0_made_the_variables():
  real_np, z_np = _data(10)
  with tf.Graph().as_default() as graph:
    made = []

    def discriminator_variables():
      made.append(len(tf.trainable_variables()))
      return [v for v in tf.trainable_variables() if "discriminator" in v.name]

    ops, t = towers.minimize(
        gan_fn, _optimizers(), 3, inputs=(tf.constant(real_np),
                                          tf.constant(z_np)),
        devices=devices(3), var_list={"d": discriminator_variables,
                                      "g": "generator/"})
    assert made == [10]  # Called once, with every variable made.
    got = _train(graph, ops, t.loss)
  _assert_same(got, _reference(10))


def test_each_step_moves_its_own_network_only():
  real_np, z_np = _data(12)
  with tf.Graph().as_default() as graph:
    ops, _ = towers.minimize(
        gan_fn, _optimizers(), 2, inputs=(tf.constant(real_np),
                                          tf.constant(z_np)),
        devices=devices(2), var_list=VAR_LIST,
        variable_device="replicated", all_reduce="ring")
    weights = {key: [v for v in tf.trainable_variables()
                     if v.op.name.startswith(prefix)]
               for key, prefix in VAR_LIST.items()}
    with tf.Session(graph=graph, config=config()) as sess:
      sess.run(tf.global_variables_initializer())
      sess.run(tf.local_variables_initializer())
      for key, other in (("d", "g"), ("g", "d")):
        before = sess.run(weights)
        sess.run(ops[key])
        after = sess.run(weights)
        assert all(np.array_equal(a, b)
                   for a, b in zip(before[other], after[other])), other
        # All but fc1's bias, whose gradient batch norm cancels.
        assert sum(not np.array_equal(a, b)
                   for a, b in zip(before[key], after[key])) >= 3, key


def test_one_op_of_g_then_d_is_tensorpacks_step():
  """Both gradients from one forward pass, G applied, then D."""
  real_np, z_np = _data(10)

  def build(losses, update_ops, grads_of, apply):
    with tf.control_dependencies(update_ops):
      g_op = apply("g", grads_of("g"))
      with tf.control_dependencies([g_op]):
        return {"gd": apply("d", grads_of("d"))}, losses

  with tf.Graph().as_default() as graph:
    opts = _optimizers()
    losses = gan_fn("", tf.constant(real_np), tf.constant(z_np))
    variables = {key: [v for v in tf.trainable_variables()
                       if v.op.name.startswith(prefix)]
                 for key, prefix in VAR_LIST.items()}
    want = _train(graph, *build(
        losses, tf.get_collection(tf.GraphKeys.UPDATE_OPS),
        lambda key: opts[key].compute_gradients(losses[key],
                                                var_list=variables[key]),
        lambda key, grads: opts[key].apply_gradients(grads)))
  with tf.Graph().as_default() as graph:
    opts = _optimizers()
    t = towers.build_towers(
        gan_fn, opts, 3, inputs=(tf.constant(real_np), tf.constant(z_np)),
        devices=devices(3), var_list=VAR_LIST,
        variable_device="replicated", all_reduce="ring")
    # Tower 0's update ops: the collection holds every tower's.
    got = _train(graph, *build(
        t.loss, t.update_ops,
        lambda key: towers.average_gradients(t.tower_grads[key], t.weights),
        lambda key, grads: opts[key].apply_gradients(grads)))
  _assert_same(got, want)


def test_the_last_loss_counts_the_global_step_and_scaling_is_exact():
  real_np, z_np = _data(12)
  results = []
  for scale in (None, 2.0 ** 10):
    with tf.Graph().as_default() as graph:
      step = tf.train.get_or_create_global_step()
      ops, t = towers.minimize(
          gan_fn, _optimizers(), 2, inputs=(tf.constant(real_np),
                                            tf.constant(z_np)),
          devices=devices(2), var_list=VAR_LIST, global_step=step,
          loss_scale=scale)
      assert (t.loss_scale is None) == (scale is None)
      if scale is not None:
        assert sorted(t.loss_scale) == ["d", "g"]
      results.append(_train(graph, ops, t.loss))
  for got in results:
    assert got[1]["global_step"] == ITERATIONS
  for name, value in results[0][1].items():
    np.testing.assert_array_equal(results[1][1][name], value, err_msg=name)


def _build(model_fn=gan_fn, opts=None, **kwargs):
  real_np, z_np = _data(4)
  kwargs.setdefault("var_list", VAR_LIST)
  with tf.Graph().as_default():
    return towers.minimize(model_fn, opts or _optimizers(), 2,
                           inputs=(tf.constant(real_np), tf.constant(z_np)),
                           devices=devices(2), **kwargs)


def _with_extra_loss(scope, real, z):
  losses = gan_fn(scope, real, z)
  losses["extra"] = losses["g"] * 2.0
  return losses


@pytest.mark.parametrize("kwargs,error,match", [
    (dict(model_fn=_with_extra_loss), ValueError,
     r"loss 'extra' in tower_0, which opt has no optimizer for"),
    (dict(opts=dict(_optimizers(), e=tf.train.GradientDescentOptimizer(1.0)),
          var_list=dict(VAR_LIST, e="generator/fc2")), ValueError,
     r"optimizer for 'e', but model_fn returned no loss 'e'"),
    (dict(var_list={"d": "disc/", "g": "generator/"}), ValueError,
     r"var_list\['d'\] is the prefix 'disc/', which no trainable"),
    (dict(var_list={"d": "", "g": "generator/"}), ValueError,
     r"generator/fc1/w:0 is in both var_list\['d'\] and var_list\['g'\]"),
    (dict(var_list=None), ValueError, r"several losses \('d', 'g'\) need "
     r"var_list.*the generator in the discriminator's step"),
    (dict(var_list={"d": "discriminator/"}), ValueError,
     r"var_list has no entry for 'g'"),
    (dict(opts=tf.train.GradientDescentOptimizer(1.0), var_list=None),
     ValueError, r"returned the losses 'd', 'g' in tower_0, but opt is one "
     r"optimizer: pass opt as a dict"),
    (dict(accumulate_steps=2), ValueError,
     r"accumulate_steps=2 with several losses"),
])
def test_mistakes_are_refused_naming_the_key(kwargs, error, match):
  with pytest.raises(error, match=match):
    _build(**kwargs)


def test_averaging_the_dict_of_gradients_says_to_average_each_loss():
  real_np, z_np = _data(4)
  with tf.Graph().as_default():
    t = towers.build_towers(gan_fn, _optimizers(), 2,
                            inputs=(tf.constant(real_np), tf.constant(z_np)),
                            devices=devices(2), var_list=VAR_LIST)
    assert sorted(t.tower_grads) == ["d", "g"]
    assert len(t.tower_grads["d"]) == 2 and len(t.losses["g"]) == 2
    with pytest.raises(TypeError, match=r"average_gradients\(t.tower_grads"
                       r"\['d'\], t.weights\)"):
      towers.average_gradients(t.tower_grads)


def _square_fn(scope, x):
  del scope
  w = tf.get_variable("w", [4, 3], initializer=_initial("w", [4, 3]))
  return tf.reduce_mean(tf.square(tf.matmul(x, w)))


@pytest.mark.parametrize("size,dynamic", [(11, False), (12, False),
                                          (11, True)],
                         ids=["11", "12", "11-run-time"])
def test_the_seeds_average_gradients_without_weights_is_exact(size, dynamic):
  x_np = np.random.RandomState(3).randn(size, 4).astype(np.float32)
  with tf.Graph().as_default() as graph:
    x = tf.constant(x_np)
    if dynamic:  # A batch size known only at run time.
      x = tf.placeholder_with_default(x, [None, 4])
    t = towers.build_towers(_square_fn, tf.train.GradientDescentOptimizer(
        0.1), 2, inputs=x, devices=devices(2))
    seed, = [g for g, _ in towers.average_gradients(t.tower_grads)]
    plain, = [g for g, _ in towers.average_gradients(t.tower_grads,
                                                     [0.5, 0.5])]
    with tf.variable_scope("", reuse=True):
      want, = tf.gradients(_square_fn("", x), [tf.get_variable("w")])
    with tf.Session(graph=graph, config=config()) as sess:
      sess.run(tf.global_variables_initializer())
      seed, plain, want = sess.run([seed, plain, want])
  np.testing.assert_allclose(seed, want, rtol=1e-6, atol=1e-6)
  # Explicit weights keep their meaning: the plain mean, off when uneven.
  gap = np.abs(plain - want).max() / np.abs(want).max()
  assert (gap > 0.01) == (size == 11), gap


def test_lists_not_the_uneven_towers_own_are_refused_without_weights():
  x_np = np.random.RandomState(3).randn(11, 4).astype(np.float32)
  with tf.Graph().as_default():
    t = towers.build_towers(_square_fn, tf.train.GradientDescentOptimizer(
        0.1), 2, inputs=tf.constant(x_np), devices=devices(2))
    clipped = [[(tf.clip_by_value(g, -1.0, 1.0), v) for g, v in tower]
               for tower in t.tower_grads]
    with pytest.raises(ValueError, match=r"0.5455, 0.4545.*pass "
                       r"weights=t.weights"):
      towers.average_gradients(clipped)
    towers.average_gradients(clipped, t.weights)
    towers.average_gradients(clipped, [0.5, 0.5])
    with pytest.raises(ValueError, match=r"weights=t.weights"):
      towers.average_gradients(t.tower_grads[:1])


def test_a_dynamic_input_first_keeps_the_others_static_shard_shapes():
  real_np, _ = _data(12)
  shapes = []

  def model_fn(scope, z, real):
    shapes.append((z.shape.as_list(), real.shape.as_list()))
    return gan_fn(scope, real, z)

  with tf.Graph().as_default() as graph:
    z = tf.placeholder(tf.float32, [None, Z_DIM])
    ops, t = towers.minimize(model_fn, _optimizers(), 3,
                             inputs=(z, tf.constant(real_np)),
                             devices=devices(3), var_list=VAR_LIST)
    assert t.weights == [1 / 3] * 3 and t.batch_size == 12.0
    assert shapes == [([4, Z_DIM], [4, X_DIM])] * 3
    with tf.Session(graph=graph, config=config()) as sess:
      sess.run(tf.global_variables_initializer())
      sess.run(ops["d"], {z: np.zeros([12, Z_DIM], np.float32)})
      with pytest.raises(tf.errors.InvalidArgumentError,
                         match=r"disagree on the global batch size"):
        sess.run(ops["d"], {z: np.zeros([11, Z_DIM], np.float32)})
