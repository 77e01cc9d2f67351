"""Several losses and optimizers on one set of towers: a GAN, step by step.

A generator and a discriminator, each with synchronized batch norm, D
trained with Momentum and G with SGD (or both with Adam), D step then G
step: every global variable and both losses against one device running
``opt_k.minimize(loss_k, var_list=vars_k)`` with its statistics updated in
place (tf-slim's ``updates_collections=None``). The discriminator tracks the
real images' statistics only: two updates of one average in one step would
race, on one device too. Each key's step runs only what its loss goes
through: the G step needs only ``z`` and leaves D's statistics alone.
"""

import functools

import numpy as np
import pytest
import tensorflow.compat.v1 as tf

import towers
from towers import _graph
import models
from models import config, devices

Z_DIM, X_DIM, HIDDEN = 3, 5, 8
ITERATIONS = 3
VAR_LIST = {"d": "discriminator/", "g": "generator/"}
D_STATISTICS = ["discriminator/bn/moving_mean",
                "discriminator/bn/moving_variance"]
G_STATISTICS = ["generator/bn/moving_mean", "generator/bn/moving_variance"]


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


def _bn(x, track, in_place):
  """Batch norm over the global batch; with `track`, its moving statistics
  are updated: in place (one device, tf-slim's way) or from UPDATE_OPS."""
  updates = tf.get_collection_ref(tf.GraphKeys.UPDATE_OPS)
  before = len(updates)
  y = towers.batch_normalization(x, training=True, momentum=0.9, name="bn")
  made = updates[before:]
  del updates[before:]
  if not track:
    # Kept aside, not run (in no collection, towers would take them for a
    # Keras layer's updates, which nothing runs, and run them).
    for op in made:
      tf.add_to_collection("untracked_statistics", op)
  elif in_place:
    with tf.control_dependencies(made):
      return tf.identity(y)
  else:
    updates.extend(made)
  return y


def _generator(z, in_place):
  with tf.variable_scope("generator"):
    h = _bn(_dense(z, HIDDEN, "fc1"), True, in_place)
    return tf.tanh(_dense(tf.nn.relu(h), X_DIM, "fc2"))


def _discriminator(x, track, in_place):
  with tf.variable_scope("discriminator", reuse=tf.AUTO_REUSE):
    h = _bn(_dense(x, HIDDEN, "fc1"), track, in_place)
    return _dense(tf.nn.leaky_relu(h), 1, "fc2")


def _xent(label, logits):
  return tf.reduce_mean(tf.nn.sigmoid_cross_entropy_with_logits(
      labels=tf.fill(tf.shape(logits), label), logits=logits))


def gan(real, z, in_place=False):
  """Both losses from one forward pass; the real branch and the generator's
  own loss term under name scopes of their own, to find their ops."""
  fake = _generator(z, in_place)
  with tf.name_scope("real_branch"):
    d_real = _discriminator(real, True, in_place)
  d_fake = _discriminator(fake, False, in_place)
  d_loss = _xent(1.0, d_real) + _xent(0.0, d_fake)
  with tf.name_scope("g_only"):
    g_loss = _xent(1.0, d_fake)
  return {"d": d_loss, "g": g_loss}


def gan_fn(scope, real, z):
  del scope
  return gan(real, z)


def _optimizers(adam=False):
  if adam:
    return {"d": tf.train.AdamOptimizer(0.01, beta1=0.5),
            "g": tf.train.AdamOptimizer(0.02, beta1=0.9)}
  return {"d": tf.train.MomentumOptimizer(0.1, 0.9),
          "g": tf.train.GradientDescentOptimizer(0.2)}


def _data(size):
  rng = np.random.RandomState(size)
  return (rng.randn(size, X_DIM).astype(np.float32),
          rng.randn(size, Z_DIM).astype(np.float32))


def _train(graph, ops, losses, steps=ITERATIONS, num_devices=4):
  """Runs D step then G step, each fetching its own loss; returns the
  losses seen and the global variables."""
  seen = []
  with tf.Session(graph=graph, config=config(num_devices)) as sess:
    sess.run(tf.global_variables_initializer())
    sess.run(tf.local_variables_initializer())
    for _ in range(steps):
      for key in ops:
        seen.append(sess.run([ops[key], losses[key]])[1])
    return seen, {v.op.name: sess.run(v) for v in tf.global_variables()}


def _one_device_ops(losses, opts):
  return {key: opts[key].minimize(losses[key], var_list=[
      v for v in tf.trainable_variables() if v.op.name.startswith(prefix)])
          for key, prefix in VAR_LIST.items()}


@functools.lru_cache(maxsize=None)
def _reference(size, adam=False, order=None):
  """One device on the global batch (rows in `order`), as DCGAN trains."""
  real_np, z_np = _data(size)
  if order is not None:
    real_np, z_np = real_np[list(order)], z_np[list(order)]
  with tf.Graph().as_default() as graph:
    losses = gan(tf.constant(real_np), tf.constant(z_np), in_place=True)
    assert not tf.get_collection(tf.GraphKeys.UPDATE_OPS)
    return _train(graph, _one_device_ops(losses, _optimizers(adam)), losses)


def _gaps(got, want):
  """The largest difference of each variable, and of the losses."""
  got_losses, got_vars = got
  want_losses, want_vars = want
  assert sorted(got_vars) == sorted(want_vars)
  gaps = {name: float(np.abs(got_vars[name] - value).max())
          for name, value in want_vars.items()}
  gaps["losses"] = max(float(np.abs(np.subtract(
      *[tf.nest.flatten(losses) for losses in (got_losses, want_losses)]
  )).max()), 0.0)
  return gaps


def _assert_same(got, want, atol=1e-5):
  gaps = _gaps(got, want)
  assert max(gaps.values()) <= atol, gaps


MODES = [dict(), dict(variable_device="replicated", all_reduce="add_n"),
         dict(variable_device="replicated", all_reduce="ring"),
         dict(variable_device="replicated", all_reduce="collective")]
IDS = ["one-copy", "add_n", "ring", "collective"]


def _towers(num, size, opts=None, **kwargs):
  real_np, z_np = _data(size)
  kwargs.setdefault("devices", devices(num))
  return towers.minimize(
      gan_fn, opts or _optimizers(), num,
      inputs=(tf.constant(real_np), tf.constant(z_np)), var_list=VAR_LIST,
      **kwargs)


@pytest.mark.parametrize("num,size", [(2, 12), (3, 10)],
                         ids=["2towers-12", "3towers-10-uneven"])
@pytest.mark.parametrize("mode", MODES, ids=IDS)
def test_a_gan_trains_d_then_g_as_on_one_device(num, size, mode):
  with tf.Graph().as_default() as graph:
    ops, t = _towers(num, size, **mode)
    assert sorted(ops) == ["d", "g"] and sorted(t.loss) == ["d", "g"]
    assert [v.op.name for _, v in t.grads_and_vars["g"]] == [
        "generator/fc1/w", "generator/fc1/b", "generator/bn/gamma",
        "generator/bn/beta", "generator/fc2/w", "generator/fc2/b"]
    got = _train(graph, ops, t.loss)
  _assert_same(got, _reference(size))


# The global batch's rows in other orders: one device's own rounding.
PERMUTATIONS = [(3, 9, 0, 5, 1, 8, 2, 7, 4, 6), (9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                (1, 0, 3, 2, 5, 4, 7, 6, 9, 8)]


@pytest.mark.parametrize("mode", [MODES[0], MODES[-1]], ids=[IDS[0], IDS[-1]])
def test_with_adam_the_gap_is_within_one_devices_own_rounding(mode):
  """Adam divides by the root of a second moment that is near zero where
  batch norm cancels a gradient (the biases before it): there one device
  on the same rows in other orders differs by up to 5e-3. Each variable is
  held to twice the largest such difference, or 1e-5."""
  with tf.Graph().as_default() as graph:
    ops, t = _towers(3, 10, opts=_optimizers(adam=True), **mode)
    got = _train(graph, ops, t.loss)
  want = _reference(10, adam=True)
  noise = {}
  for order in PERMUTATIONS:
    for name, gap in _gaps(_reference(10, adam=True, order=order),
                           want).items():
      noise[name] = max(noise.get(name, 0.0), gap)
  for name, gap in _gaps(got, want).items():
    assert gap <= max(2 * noise[name], 1e-5), (name, gap, noise[name])


@pytest.mark.parametrize("mode", [MODES[0], MODES[-1]], ids=[IDS[0], IDS[-1]])
def test_the_by_hand_flow_per_loss_is_the_same(mode):
  num, size = 3, 10
  real_np, z_np = _data(size)
  with tf.Graph().as_default() as graph:
    opts = _optimizers()
    t = towers.build_towers(
        gan_fn, opts, num, inputs=(tf.constant(real_np), tf.constant(z_np)),
        devices=devices(num), var_list=VAR_LIST, **mode)
    ops = {}
    for key in ("d", "g"):
      # The tutorial's lines, per loss: no weights, the towers' own shares.
      with tf.control_dependencies(t.update_ops[key]):
        grads = towers.average_gradients(t.tower_grads[key])
        ops[key] = opts[key].apply_gradients(grads)
    got = _train(graph, ops, t.loss)
  _assert_same(got, _reference(size))


def test_each_key_runs_the_updates_its_loss_goes_through():
  with tf.Graph().as_default():
    _, t = _towers(2, 12)
    layers = {key: sorted(op.name.rsplit("/", 2)[0] for op in ops)
              for key, ops in t.update_ops.items()}
  # The generator's statistics feed both losses; the real images' only D's.
  assert layers == {"d": ["tower_0/generator/bn"] * 2 + [
      "tower_0/real_branch/discriminator/bn"] * 2,
                    "g": ["tower_0/generator/bn"] * 2}


def test_an_update_no_loss_goes_through_runs_with_every_step():
  counters = []

  def model_fn(scope, real, z):
    losses = gan_fn(scope, real, z)
    counters.append(tf.get_variable("counter", [], tf.float32,
                                    trainable=False,
                                    initializer=tf.zeros_initializer()))
    tf.add_to_collection(tf.GraphKeys.UPDATE_OPS,
                         counters[-1].assign_add(1.0))
    return losses

  real_np, z_np = _data(12)
  with tf.Graph().as_default() as graph:
    ops, t = towers.minimize(
        model_fn, _optimizers(), 2, inputs=(tf.constant(real_np),
                                            tf.constant(z_np)),
        devices=devices(2), var_list=VAR_LIST)
    assert len(t.update_ops["d"]) == 5 and len(t.update_ops["g"]) == 3
    with tf.Session(graph=graph, config=config()) as sess:
      sess.run(tf.global_variables_initializer())
      sess.run(ops["d"])
      sess.run(ops["g"])
      assert sess.run(counters[0]) == 2.0


def _placeholders(size):
  real = tf.placeholder(tf.float32, [size, X_DIM], name="real")
  z = tf.placeholder(tf.float32, [None, Z_DIM], name="z")
  return real, z


@pytest.mark.parametrize("mode", MODES, ids=IDS)
def test_the_g_step_runs_fed_only_z_and_leaves_d_statistics_alone(mode):
  real_np, z_np = _data(12)
  with tf.Graph().as_default() as graph:
    real, z = _placeholders(12)
    ops, _ = towers.minimize(
        gan_fn, _optimizers(), 2, inputs=(real, z), devices=devices(2),
        var_list=VAR_LIST, **mode)
    variables = {v.op.name: v for v in tf.global_variables()}
    with tf.Session(graph=graph, config=config()) as sess:
      sess.run(tf.global_variables_initializer())
      sess.run(tf.local_variables_initializer())
      sess.run(ops["d"], {real: real_np, z: z_np})
      before = sess.run(variables)
      for _ in range(2):
        sess.run(ops["g"], {z: z_np})
      after = sess.run(variables)
  for name in D_STATISTICS:
    np.testing.assert_array_equal(after[name], before[name], err_msg=name)
  for name in G_STATISTICS:
    assert not np.array_equal(after[name], before[name]), name


def test_each_step_launches_its_collectives_in_one_order_on_each_device():
  """A step waits for no collective another step alone runs, and launches
  its own one after another on each device (two launched in opposite
  orders on two GPUs would hang NCCL)."""
  with tf.Graph().as_default():
    real, z = _placeholders(12)
    ops, _ = towers.minimize(
        gan_fn, _optimizers(), 2, inputs=(real, z), devices=devices(2),
        var_list=VAR_LIST, variable_device="replicated",
        all_reduce="collective")
    runs = {key: _graph.upstream([op]) for key, op in ops.items()}
    for key, ran in runs.items():
      assert (real.op in ran) == (key == "d"), key
      members = [op for op in ran if models.is_collective_reduce(op)]
      assert len(members) >= 8, key
      for device in devices(2):
        mine = [op for op in members if op.device == device]
        before = {op: _graph.upstream([op]) for op in mine}
        for a in mine:
          for b in mine:
            assert a is b or a in before[b] or b in before[a], (key, a, b)


def test_a_loss_fetched_with_the_other_keys_step_is_the_one_before_it():
  def run(ops, losses):
    with tf.Session(config=config()) as sess:
      sess.run(tf.global_variables_initializer())
      sess.run(tf.local_variables_initializer())
      sess.run(ops["d"])
      return [sess.run([ops["g"], losses])[1] for _ in range(2)]

  real_np, z_np = _data(12)
  with tf.Graph().as_default():
    losses = gan(tf.constant(real_np), tf.constant(z_np), in_place=True)
    want = run(_one_device_ops(losses, _optimizers()), losses)
  with tf.Graph().as_default():
    ops, t = _towers(2, 12)
    got = run(ops, t.loss)
  for got_step, want_step in zip(got, want):
    for key in ("d", "g"):
      np.testing.assert_allclose(got_step[key], want_step[key], atol=1e-5,
                                 rtol=0, err_msg=key)


def _executed(sess, fetch, feed=None):
  """The names of the nodes one run of `fetch` executed."""
  metadata = tf.RunMetadata()
  sess.run(fetch, feed, options=tf.RunOptions(
      trace_level=tf.RunOptions.FULL_TRACE), run_metadata=metadata)
  return [node.node_name for dev in metadata.step_stats.dev_stats
          for node in dev.node_stats if not node.node_name.startswith("_")]


def _counts(graph, ops, feeds):
  with tf.Session(graph=graph, config=config(grappler=False)) as sess:
    sess.run(tf.global_variables_initializer())
    sess.run(tf.local_variables_initializer())
    return {key: _executed(sess, ops[key], feeds[key]) for key in ops}


def test_each_step_runs_its_own_loss_only_and_no_more_than_one_device():
  real_np, z_np = _data(12)
  with tf.Graph().as_default() as graph:
    real, z = _placeholders(12)
    losses = gan(real, z, in_place=True)
    feeds = {"d": {real: real_np, z: z_np}, "g": {z: z_np}}
    alone = _counts(graph, _one_device_ops(losses, _optimizers()), feeds)
  with tf.Graph().as_default() as graph:
    real, z = _placeholders(12)
    ops, _ = towers.minimize(gan_fn, _optimizers(), 2, inputs=(real, z),
                             devices=devices(2), var_list=VAR_LIST)
    feeds = {"d": {real: real_np, z: z_np}, "g": {z: z_np}}
    ran = _counts(graph, ops, feeds)
  for key, unwanted in (("d", "/g_only/"), ("g", "/real_branch/")):
    assert not [n for n in ran[key] if unwanted in n], key
    assert not [n for n in alone[key] if unwanted in n], key
    # Each tower does one device's forward and backward pass, or less.
    for tower in ("tower_0/", "tower_1/"):
      mine = [n for n in ran[key] if n.startswith(tower)]
      assert len(mine) <= len(alone[key]), (key, tower, len(mine),
                                            len(alone[key]))


@pytest.mark.parametrize("order", [("d", "g"), ("g", "d")], ids=["dg", "gd"])
def test_optimizer_variables_are_named_in_the_order_of_the_keys(order):
  """The keys' order is the order the optimizers make their variables:
  each Adam's beta powers get the names one device gives them when it
  calls minimize in that order."""
  def trained(graph, ops):
    with tf.Session(graph=graph, config=config()) as sess:
      sess.run(tf.global_variables_initializer())
      sess.run(tf.local_variables_initializer())
      for _ in range(2):
        for key in ops:
          sess.run(ops[key])
      return {v.op.name: sess.run(v) for v in tf.global_variables()
              if "power" in v.op.name}

  real_np, z_np = _data(12)
  with tf.Graph().as_default() as graph:
    losses = gan(tf.constant(real_np), tf.constant(z_np), in_place=True)
    opts = _optimizers(adam=True)
    ops = {}
    for key in order:
      ops[key] = opts[key].minimize(losses[key], var_list=[
          v for v in tf.trainable_variables()
          if v.op.name.startswith(VAR_LIST[key])])
    want = trained(graph, ops)
  with tf.Graph().as_default() as graph:
    adam = _optimizers(adam=True)
    ops, _ = _towers(2, 12, opts={key: adam[key] for key in order})
    got = trained(graph, ops)
  assert sorted(got) == sorted(want) == [
      "beta1_power", "beta1_power_1", "beta2_power", "beta2_power_1"]
  # beta1 is 0.5 for D and 0.9 for G: each name holds the same Adam's.
  for name, value in want.items():
    np.testing.assert_allclose(got[name], value, rtol=1e-6, err_msg=name)
  assert got["beta1_power"] == pytest.approx(
      {"d": 0.5, "g": 0.9}[order[0]] ** 3)


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
    assert made == [12]  # Called once, with every variable made.
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
        return {"gd": apply("d", grads_of("d"))}, {"gd": losses}

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
    # Tower 0's update ops D's loss goes through: all of them here (the
    # collection holds every tower's).
    got = _train(graph, *build(
        t.loss, t.update_ops["d"],
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
