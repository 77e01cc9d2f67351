"""The tutorial's by-hand step: average, transform, apply_gradients, any mode.

Each test compares N towers with the same model trained on one device (or,
for placement, with the devices the session ran each op on).
"""

import re

import numpy as np
import pytest
import tensorflow.compat.v1 as tf

import towers
from models import batch, config as _config, devices, loss_fn
from models import state_variables

MODES = {
    "cpu": {"variable_device": "cpu"},
    "gpu": {"variable_device": "gpu"},
    "add_n": {"variable_device": "replicated", "all_reduce": "add_n"},
    "ring": {"variable_device": "replicated", "all_reduce": "ring"},
    "collective": {"variable_device": "replicated",
                   "all_reduce": "collective"},
}
CLIP = 0.2
STEPS = 5


class AdamWeightDecay(tf.train.Optimizer):
  """Google BERT's optimizer, as its optimization.py writes it: Adam in
  plain ops, its state made with tf.get_variable inside apply_gradients,
  decoupled weight decay, the global step left to the caller."""

  def __init__(self, learning_rate, weight_decay_rate=0.01, beta_1=0.9,
               beta_2=0.999, epsilon=1e-6):
    super().__init__(False, "AdamWeightDecay")
    self.learning_rate = learning_rate
    self.weight_decay_rate = weight_decay_rate
    self.beta_1 = beta_1
    self.beta_2 = beta_2
    self.epsilon = epsilon

  def apply_gradients(self, grads_and_vars, global_step=None, name=None):
    assignments = []
    for grad, param in grads_and_vars:
      if grad is None or param is None:
        continue
      param_name = re.match("^(.*):\\d+$", param.name).group(1)
      m = tf.get_variable(name=param_name + "/adam_m",
                          shape=param.shape.as_list(), dtype=tf.float32,
                          trainable=False, initializer=tf.zeros_initializer())
      v = tf.get_variable(name=param_name + "/adam_v",
                          shape=param.shape.as_list(), dtype=tf.float32,
                          trainable=False, initializer=tf.zeros_initializer())
      # A name scope only to find the update's ops in the test; BERT has
      # none, and placement does not read names of ops like these.
      with tf.name_scope("update_" + param_name.replace("/", "_")):
        next_m = (tf.multiply(self.beta_1, m) +
                  tf.multiply(1.0 - self.beta_1, grad))
        next_v = (tf.multiply(self.beta_2, v) +
                  tf.multiply(1.0 - self.beta_2, tf.square(grad)))
        update = next_m / (tf.sqrt(next_v) + self.epsilon)
        if not param_name.endswith("/b"):
          update += self.weight_decay_rate * param
        next_param = param - self.learning_rate * update
      assignments.extend([param.assign(next_param), m.assign(next_m),
                          v.assign(next_v)])
    return tf.group(*assignments, name=name)


OPTIMIZERS = {
    "adam": lambda: tf.train.AdamOptimizer(0.05),
    "bert": lambda: AdamWeightDecay(0.05),
}


def _clipped(grads_and_vars):
  """What a single-device trainer does between its gradients and the apply."""
  grads, variables = zip(*grads_and_vars)
  grads, norm = tf.clip_by_global_norm(grads, CLIP)
  return list(zip(grads, variables)), norm


def _step(sess, train_op, loss, norm):
  """[loss, norm] of one step. The loss in a run of its own: with ref
  variables the in-place update could race the weight decay term of a loss
  fetched in the same run. The norm is an input of the update."""
  loss_value = sess.run(loss)
  return [loss_value, sess.run([train_op, norm])[1]]


def _one_device(make_opt, x, y, restore=None):
  """Losses, norms and variables of STEPS single-device steps."""
  with tf.Graph().as_default():
    loss = loss_fn(tf.constant(x), tf.constant(y), regularize=True)
    opt = make_opt()
    pairs, norm = _clipped(opt.compute_gradients(loss))
    step = tf.train.get_or_create_global_step()
    train_op = opt.apply_gradients(pairs, global_step=step)
    if isinstance(opt, AdamWeightDecay):
      train_op = tf.group(train_op, step.assign_add(1))
    saver = tf.train.Saver()
    with tf.Session(config=_config(1)) as sess:
      sess.run(tf.global_variables_initializer())
      if restore:
        saver.restore(sess, restore)
      history = [_step(sess, train_op, loss, norm) for _ in range(STEPS)]
      return history, {v.op.name: sess.run(v) for v in tf.global_variables()}


def _by_hand(make_opt, mode, x, y, save=None, restore=None, num=2):
  """The tutorial's flow on towers: build, average, clip, apply_gradients."""
  with tf.Graph().as_default():
    opt = make_opt()
    t = towers.build_towers(
        lambda scope, xs, ys: loss_fn(xs, ys, regularize=True), opt, num,
        inputs=(tf.constant(x), tf.constant(y)), devices=devices(num),
        **MODES[mode])
    pairs, norm = _clipped(towers.average_gradients(t.tower_grads, t.weights))
    step = tf.train.get_or_create_global_step()
    train_op = opt.apply_gradients(pairs, global_step=step)
    if isinstance(opt, AdamWeightDecay):
      train_op = tf.group(train_op, step.assign_add(1))
    saver = tf.train.Saver()
    with tf.Session(config=_config(num)) as sess:
      sess.run(tf.global_variables_initializer())
      if restore:
        saver.restore(sess, restore)
      # After the restore: the copies (and their state) start from copy 0.
      sess.run(tf.local_variables_initializer())
      history = [_step(sess, train_op, t.loss, norm) for _ in range(STEPS)]
      if save:
        saver.save(sess, save)
      values = {v.op.name: sess.run(v)
                for v in state_variables()}
      return history, values


def _assert_copies_equal_copy_0(values):
  for name, value in values.items():
    if name.startswith("replica_"):
      np.testing.assert_array_equal(value, values[name.split("/", 1)[1]],
                                    err_msg=name)


@pytest.mark.parametrize("make_opt", OPTIMIZERS.values(), ids=OPTIMIZERS)
@pytest.mark.parametrize("mode", MODES)
def test_the_by_hand_flow_with_clipping_is_the_one_device_step(mode,
                                                               make_opt):
  x, y = batch(8)
  want_history, want = _one_device(make_opt, x, y)
  history, got = _by_hand(make_opt, mode, x, y)
  # The global norm clipped is the single-device one, not sqrt(N) larger.
  np.testing.assert_allclose(history, want_history, rtol=1e-5, atol=1e-6)
  for name, value in want.items():
    np.testing.assert_allclose(got[name], value, rtol=1e-5, atol=1e-6,
                               err_msg=name)
  assert set(got) - set(want) == {n for n in got if n.startswith("replica_")}
  _assert_copies_equal_copy_0(got)


@pytest.mark.parametrize("mode", ["cpu", "ring"])
@pytest.mark.parametrize("make_opt", OPTIMIZERS.values(), ids=OPTIMIZERS)
def test_checkpoints_are_single_device_ones_both_ways(tmp_path, make_opt,
                                                      mode):
  x, y = batch(8)
  first = str(tmp_path / "one_device" / "model")
  # A single-device checkpoint...
  with tf.Graph().as_default():
    loss = loss_fn(tf.constant(x), tf.constant(y), regularize=True)
    opt = make_opt()
    opt.apply_gradients(_clipped(opt.compute_gradients(loss))[0],
                        global_step=tf.train.get_or_create_global_step())
    saver = tf.train.Saver()
    with tf.Session(config=_config(1)) as sess:
      sess.run(tf.global_variables_initializer())
      saver.save(sess, first)
  keys = sorted(name for name, _ in tf.train.list_variables(first))
  # ...restores into the towers' graph, whose checkpoint has its keys only.
  second = str(tmp_path / "towers" / "model")
  history, got = _by_hand(make_opt, mode, x, y, save=second, restore=first)
  assert sorted(name for name, _ in tf.train.list_variables(second)) == keys
  want_history, want = _one_device(make_opt, x, y, restore=first)
  np.testing.assert_allclose(history, want_history, rtol=1e-5, atol=1e-6)
  for name, value in want.items():
    np.testing.assert_allclose(got[name], value, rtol=1e-5, atol=1e-6,
                               err_msg=name)


def _partitions(fetch, config):
  """{op name: the device the session ran it on}."""
  options = tf.RunOptions(output_partition_graphs=True)
  metadata = tf.RunMetadata()
  with tf.Session(config=config) as sess:
    sess.run(tf.global_variables_initializer())
    sess.run(tf.local_variables_initializer())
    sess.run(fetch, options=options, run_metadata=metadata)
  return {node.name: tf.DeviceSpec.from_string(node.device).device_index
          for graph in metadata.partition_graphs for node in graph.node}


@pytest.mark.parametrize("mode", ["ring", "add_n"])
def test_a_get_variable_optimizer_keeps_copy_state_and_update_on_its_device(
    mode):
  x, y = batch(8)
  with tf.Graph().as_default() as graph:
    opt = AdamWeightDecay(0.05)
    t = towers.build_towers(
        lambda scope, xs, ys: loss_fn(xs, ys), opt, 3,
        inputs=(tf.constant(x), tf.constant(y)), devices=devices(3),
        **MODES[mode])
    pairs, _ = _clipped(towers.average_gradients(t.tower_grads, t.weights))
    train_op = opt.apply_gradients(pairs)
    ran_on = _partitions(train_op, _config(3, grappler=False))
    state = [v for v in tf.local_variables() if "/adam_" in v.op.name]
    assert len(state) == 2 * 4 * 2  # m and v, 4 variables, copies 1 and 2
    assert all("/adam_" not in v.op.name for v in tf.local_variables()
               if not v.op.name.startswith("replica_"))
    checked = 0
    for op in graph.get_operations():
      found = re.match(r"update_(replica_(\d+)_)?", op.name)
      # Constants are where the session puts them: they compute nothing.
      if found is None or op.name not in ran_on or op.type == "Const":
        continue
      assert ran_on[op.name] == int(found.group(2) or 0), op.name
      checked += 1
    assert checked > 3 * 4 * 8
    for var in state:
      assert ran_on[var.op.name] == int(var.op.name[len("replica_")])


def test_a_get_variable_optimizer_updates_next_to_the_variables_in_one_copy():
  x, y = batch(8)
  with tf.Graph().as_default() as graph:
    opt = AdamWeightDecay(0.05)
    # Towers on /cpu:1 and /cpu:2, the variables on /cpu:0.
    t = towers.build_towers(
        lambda scope, xs, ys: loss_fn(xs, ys), opt, 2,
        inputs=(tf.constant(x), tf.constant(y)),
        devices=["/cpu:1", "/cpu:2"], variable_device="/cpu:0")
    pairs, _ = _clipped(towers.average_gradients(t.tower_grads, t.weights))
    train_op = opt.apply_gradients(pairs)
    ran_on = _partitions(train_op, _config(3, grappler=False))
    update = [op.name for op in graph.get_operations()
              if op.name.startswith("update_") and op.name in ran_on and
              op.type != "Const"]
    assert len(update) > 4 * 8
    assert {ran_on[name] for name in update} == {0}
    assert {ran_on[v.op.name] for v in tf.global_variables()} == {0}


def _towers(mode, num=2, opt=None):
  x, y = batch(8)
  opt = opt or tf.train.GradientDescentOptimizer(0.1)
  t = towers.build_towers(
      lambda scope, xs, ys: loss_fn(xs, ys), opt, num,
      inputs=(tf.constant(x), tf.constant(y)), devices=devices(num),
      **MODES[mode])
  return opt, t, towers.average_gradients(t.tower_grads, t.weights)


def _steps(train_op, steps, num):
  """Runs `steps` steps from initialization; returns every variable's value,
  copies included."""
  with tf.Session(config=_config(num)) as sess:
    sess.run(tf.global_variables_initializer())
    sess.run(tf.local_variables_initializer())
    for _ in range(steps):
      sess.run(train_op)
    return {v.op.name: sess.run(v)
            for v in state_variables()}


def test_a_side_effect_on_the_gradients_runs_once_and_every_copy_reads_it():
  calls = []

  def copy(value):
    calls.append(1)
    return np.copy(value)

  with tf.Graph().as_default():
    opt, _, pairs = _towers("ring", num=3)
    through = [(tf.reshape(tf.numpy_function(copy, [g], tf.float32),
                           g.shape), v) for g, v in pairs]
    values = _steps(opt.apply_gradients(through), 1, 3)
  assert len(calls) == len(pairs)
  _assert_copies_equal_copy_0(values)


def test_noise_drawn_for_the_averaged_gradients_is_the_same_on_every_copy():
  with tf.Graph().as_default():
    opt, _, pairs = _towers("ring", num=3)
    noisy = [(g + tf.random.normal(tf.shape(g), stddev=0.1), v)
             for g, v in pairs]
    values = _steps(opt.apply_gradients(noisy), 1, 3)
  _assert_copies_equal_copy_0(values)


def test_another_optimizer_applies_to_every_copy_through_towers():
  with tf.Graph().as_default():
    _, _, pairs = _towers("ring")
    train_op = towers.apply_gradients(tf.train.MomentumOptimizer(0.1, 0.9),
                                      pairs)
    assert not any(v.op.name.startswith("replica_")
                   for v in tf.global_variables())
    values = _steps(train_op, 3, 2)
  _assert_copies_equal_copy_0(values)


def test_a_copys_pairs_are_refused_with_the_fix():
  with tf.Graph().as_default():
    opt, t, _ = _towers("ring")
    with pytest.raises(ValueError, match="replica_1/.*copy 0's pairs"):
      opt.apply_gradients(t.tower_grads[1])
    with pytest.raises(TypeError, match="pairs"):
      towers.apply_gradients(opt, [1.0])
