"""Gradient accumulation: k micro-batches per tower, one reduction, one update.

Every result is checked against one device training on the micro-batches
together (the global batch of all towers and micro-batches), as a single
device would: one ``opt.minimize`` step per update.
"""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import tensorflow.compat.v1 as tf

import towers
from tests import models

HERE = os.path.dirname(os.path.abspath(__file__))

OPTIMIZERS = {
    "sgd": lambda: tf.train.GradientDescentOptimizer(0.5),
    "momentum": lambda: tf.train.MomentumOptimizer(0.3, 0.9),
    "adam": lambda: tf.train.AdamOptimizer(0.05),
}


def make_batches(sizes, seed=1):
  """Micro-batches of the given sizes, of one stream of examples."""
  x, y = models.batch(sum(sizes), seed=seed)
  cuts = np.cumsum([0] + list(sizes))
  return [(x[a:b], y[a:b]) for a, b in zip(cuts[:-1], cuts[1:])]


def one_device(micro_batches, steps, make_opt, regularize=True,
               learning_rate=None, clip_norm=None):
  """Variables (and optimizer variables) after one-device updates, each on
  `steps` micro-batches together (its gradients clipped to `clip_norm`)."""
  with tf.Graph().as_default() as g:
    x = tf.placeholder(tf.float32, [None, models.IN])
    y = tf.placeholder(tf.int32, [None])
    global_step = tf.train.get_or_create_global_step()
    loss = models.loss_fn(x, y, regularize)
    opt = make_opt() if learning_rate is None else make_opt(
        learning_rate(global_step))
    pairs = opt.compute_gradients(
        loss, gate_gradients=tf.train.Optimizer.GATE_GRAPH)
    if clip_norm is not None:
      grads, _ = tf.clip_by_global_norm([g for g, _ in pairs], clip_norm)
      pairs = [(c, v) for c, (_, v) in zip(grads, pairs)]
    train_op = opt.apply_gradients(pairs, global_step=global_step)
    with models.session(g, 1) as sess:
      sess.run(tf.global_variables_initializer())
      for start in range(0, len(micro_batches), steps):
        group = micro_batches[start:start + steps]
        sess.run(train_op, {x: np.concatenate([b[0] for b in group]),
                            y: np.concatenate([b[1] for b in group])})
      return {v.op.name: sess.run(v) for v in tf.global_variables()}


def _train(micro_batches, num_towers, steps, make_opt, *, dynamic=False,
           regularize=True, learning_rate=None, fetch=None, **kwargs):
  """Runs `towers.minimize(..., accumulate_steps=steps)` once per micro-batch.

  Returns the global variables (copy 0's) after the last run, each run's
  (applies, global step after it), and the largest gap between a copy and
  copy 0.
  """
  size = None if dynamic else len(micro_batches[0][0])
  with tf.Graph().as_default():
    x = tf.placeholder(tf.float32, [size, models.IN])
    y = tf.placeholder(tf.int32, [size])
    global_step = tf.train.get_or_create_global_step()
    opt = make_opt() if learning_rate is None else make_opt(
        learning_rate(global_step))
    train_op, t = towers.minimize(
        models.model_fn(regularize), opt, num_towers, inputs=(x, y),
        devices=models.devices(num_towers), global_step=global_step,
        accumulate_steps=steps, **kwargs)
    runs = []
    with tf.Session(config=models.config()) as sess:
      sess.run(tf.global_variables_initializer())
      sess.run(tf.local_variables_initializer())
      for bx, by in micro_batches:
        applies, _ = sess.run([t.applies, train_op], {x: bx, y: by})
        runs.append((bool(applies), int(sess.run(global_step))))
      values = {v.op.name: sess.run(v) for v in tf.global_variables()}
      gap = models.copies_gap(sess, values)
      extra = sess.run(fetch(t)) if fetch else None
  return values, runs, gap, extra


def _assert_close(got, want, atol=1e-5):
  assert sorted(got) == sorted(want)
  for name in want:
    np.testing.assert_allclose(got[name], want[name], rtol=1e-5, atol=atol,
                               err_msg=name)


@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
@pytest.mark.parametrize("num_towers,micro_batch,mode", [
    (1, 4, "cpu"), (2, 4, "cpu"), (3, 7, "cpu"), (2, 4, "replicated"),
    (3, 7, "replicated")])
def test_micro_batches_give_the_one_device_update_on_all_of_them(
    optimizer, num_towers, micro_batch, mode):
  # 2 updates of 3 micro-batches; 7 examples over 3 towers are 3, 2, 2.
  batches = make_batches([micro_batch] * 6)
  got, runs, gap, _ = _train(batches, num_towers, 3, OPTIMIZERS[optimizer],
                             variable_device=mode)
  want = one_device(batches, 3, OPTIMIZERS[optimizer])
  _assert_close(got, want)
  assert runs == [(False, 0), (False, 0), (True, 1),
                  (False, 1), (False, 1), (True, 2)]
  assert gap == 0.0


@pytest.mark.parametrize("mode", ["cpu", "replicated"])
def test_the_clip_is_of_the_whole_updates_gradient(mode):
  batches = make_batches([4] * 4)
  got, _, gap, _ = _train(batches, 2, 2, OPTIMIZERS["momentum"],
                          variable_device=mode, clip_norm=0.05)
  _assert_close(got, one_device(batches, 2, OPTIMIZERS["momentum"],
                                clip_norm=0.05))
  # The clip did act: unclipped, the update differs.
  unclipped = one_device(batches, 2, OPTIMIZERS["momentum"])
  assert max(float(np.max(np.abs(got[k] - unclipped[k]))) for k in got) > 1e-3
  assert gap == 0.0


def test_adams_beta_powers_advance_once_per_update():
  batches = make_batches([4] * 8)
  got, _, _, _ = _train(batches, 2, 4, OPTIMIZERS["adam"])
  assert got["beta1_power"] == pytest.approx(0.9 ** 3)
  assert got["beta2_power"] == pytest.approx(0.999 ** 3)
  _assert_close(got, one_device(batches, 4, OPTIMIZERS["adam"]))


@pytest.mark.parametrize("all_reduce", ["add_n", "ring", "collective"])
@pytest.mark.parametrize("pack_bytes", [0, 16 * 1024])
def test_replicated_all_reduces_and_packing_give_the_one_device_update(
    all_reduce, pack_bytes):
  batches = make_batches([6] * 4)
  got, _, gap, _ = _train(batches, 3, 2, OPTIMIZERS["momentum"],
                          variable_device="replicated",
                          all_reduce=all_reduce, pack_bytes=pack_bytes)
  _assert_close(got, one_device(batches, 2, OPTIMIZERS["momentum"]))
  assert gap == 0.0


def test_micro_batches_of_different_sizes_count_by_their_examples():
  # A final partial micro-batch: 8, 8 and 3 examples are one update of 19.
  batches = make_batches([8, 8, 3, 8, 5, 8])
  for mode in ["cpu", "replicated"]:
    got, _, _, _ = _train(batches, 2, 3, OPTIMIZERS["sgd"], dynamic=True,
                          variable_device=mode)
    _assert_close(got, one_device(batches, 3, OPTIMIZERS["sgd"]))


def test_the_global_step_and_a_schedule_count_applied_updates():
  def schedule(step):
    return tf.train.exponential_decay(1.0, step, 1, 0.5, staircase=True)

  def make_opt(rate):
    return tf.train.GradientDescentOptimizer(rate)

  batches = make_batches([4] * 6)
  got, runs, _, rate = _train(batches, 2, 2, make_opt,
                              learning_rate=schedule,
                              fetch=lambda t: tf.get_default_graph()
                              .get_tensor_by_name("ExponentialDecay:0"))
  assert [step for _, step in runs] == [0, 1, 1, 2, 2, 3]
  assert rate == pytest.approx(0.5 ** 3)
  _assert_close(got, one_device(batches, 2, make_opt,
                                learning_rate=schedule))


def test_one_step_applies_every_run_as_before():
  batches = make_batches([4] * 3)
  got, runs, _, _ = _train(batches, 2, 1, OPTIMIZERS["momentum"])
  assert runs == [(True, 1), (True, 2), (True, 3)]
  _assert_close(got, one_device(batches, 1, OPTIMIZERS["momentum"]))
  with tf.Graph().as_default() as g:
    x, y = models.batch(4)
    towers.minimize(models.model_fn(), OPTIMIZERS["sgd"](), 2,
                    inputs=(tf.constant(x), tf.constant(y)),
                    devices=models.devices(2))
    assert not [op for op in g.get_operations()
                if op.name.startswith("accumulate_gradients")]


def test_the_accumulators_are_local_and_checkpoints_keep_one_device_names(
    tmp_path):
  with tf.Graph().as_default():
    x, y = models.batch(4)
    towers.minimize(models.model_fn(True), OPTIMIZERS["adam"](), 2,
                    inputs=(tf.constant(x), tf.constant(y)),
                    devices=models.devices(2), accumulate_steps=3,
                    global_step=tf.train.get_or_create_global_step())
    saved = {v.op.name for v in tf.global_variables()}
    accumulators = [v.op.name for v in tf.local_variables()
                    if v.op.name.startswith("accumulate_gradients/")]
    with tf.Session(config=models.config()) as sess:
      sess.run(tf.global_variables_initializer())
      path = tf.train.Saver().save(sess, str(tmp_path / "model.ckpt"))
  single = {v.op.name for v in _single_device_variables()}
  assert saved == single
  assert {name for name, _ in tf.train.list_variables(path)} == single
  # One per tower and variable (weight decay's part apart), and the count.
  assert "accumulate_gradients/count" in accumulators
  assert "accumulate_gradients/tower_1/hidden/w/part_1" in accumulators


def _single_device_variables():
  with tf.Graph().as_default():
    x, y = models.batch(4)
    tf.train.AdamOptimizer(0.05).minimize(
        models.loss_fn(tf.constant(x), tf.constant(y), True),
        global_step=tf.train.get_or_create_global_step())
    return tf.global_variables()


def test_a_restore_mid_accumulation_starts_a_fresh_one(tmp_path):
  batches = make_batches([4] * 8)
  make_opt = OPTIMIZERS["momentum"]

  def build():
    x = tf.placeholder(tf.float32, [4, models.IN])
    y = tf.placeholder(tf.int32, [4])
    train_op, t = towers.minimize(
        models.model_fn(True), make_opt(), 2, inputs=(x, y),
        devices=models.devices(2), accumulate_steps=3,
        global_step=tf.train.get_or_create_global_step())
    return x, y, train_op, t

  with tf.Graph().as_default():
    x, y, train_op, _ = build()
    saver = tf.train.Saver()
    with tf.Session(config=models.config()) as sess:
      sess.run(tf.global_variables_initializer())
      sess.run(tf.local_variables_initializer())
      # One update, then 2 micro-batches of the next: saved in between.
      for bx, by in batches[:5]:
        sess.run(train_op, {x: bx, y: by})
      path = saver.save(sess, str(tmp_path / "model.ckpt"))
  with tf.Graph().as_default():
    x, y, train_op, t = build()
    with tf.train.MonitoredTrainingSession(
        checkpoint_dir=str(tmp_path), config=models.config(),
        save_checkpoint_secs=None, save_summaries_steps=None) as sess:
      assert sess.run(tf.train.get_global_step()) == 1
      assert not sess.run(t.applies)
      for bx, by in batches[5:]:
        sess.run(train_op, {x: bx, y: by})
      got = {v.op.name: sess.run(v) for v in tf.global_variables()}
  assert path
  # The restored run applied micro-batches 5-7 only: 3, 4 were dropped.
  _assert_close(got, one_device(batches[:3] + batches[5:], 3, make_opt))


@pytest.mark.parametrize("mode", ["cpu", "replicated"])
def test_an_overflow_in_any_micro_batch_skips_the_whole_update(mode):
  batches = make_batches([4] * 6)
  with tf.Graph().as_default():
    x = tf.placeholder(tf.float32, [4, models.IN])
    y = tf.placeholder(tf.int32, [4])
    blow_up = tf.placeholder_with_default(1.0, [])
    global_step = tf.train.get_or_create_global_step()
    train_op, t = towers.minimize(
        lambda scope, x, y: models.loss_fn(x, y) * blow_up,
        OPTIMIZERS["sgd"](), 2, inputs=(x, y), devices=models.devices(2),
        accumulate_steps=3, loss_scale="dynamic", global_step=global_step,
        variable_device=mode)
    with tf.Session(config=models.config()) as sess:
      sess.run(tf.global_variables_initializer())
      sess.run(tf.local_variables_initializer())
      before = {v.op.name: sess.run(v) for v in tf.trainable_variables()}
      scale = sess.run(t.loss_scale)
      for i, (bx, by) in enumerate(batches[:3]):
        sess.run(train_op, {x: bx, y: by, blow_up: 1e38 if i == 1 else 1.0})
      skipped = {v.op.name: sess.run(v) for v in tf.trainable_variables()}
      assert sess.run(global_step) == 0
      assert sess.run(t.loss_scale) == scale / 2
      # The accumulators were cleared: the next update is its own.
      for bx, by in batches[3:]:
        sess.run(train_op, {x: bx, y: by})
      got = {v.op.name: sess.run(v) for v in tf.trainable_variables()}
      assert sess.run(global_step) == 1
      copies = {v.op.name.split("/", 1)[1]: sess.run(v)
                for v in tf.local_variables()
                if v.op.name.startswith("replica_1/")}
  assert sorted(copies) == (sorted(got) if mode == "replicated" else [])
  _assert_close(copies, {k: got[k] for k in copies}, atol=0)
  _assert_close(skipped, before, atol=0)
  want = one_device(batches[3:], 3, OPTIMIZERS["sgd"], regularize=False)
  _assert_close(got, {k: want[k] for k in got})


def _embedding_model(scope, ids, y):
  del scope
  table = tf.get_variable("table", initializer=np.random.RandomState(0)
                          .normal(0, 1, (10, 4)).astype(np.float32))
  w = tf.get_variable("w", initializer=np.random.RandomState(1)
                      .normal(0, 1, (4, 3)).astype(np.float32))
  logits = tf.matmul(tf.gather(table, ids), w)
  return tf.losses.sparse_softmax_cross_entropy(y, logits)


@pytest.mark.parametrize("mode", ["cpu", "replicated"])
def test_sparse_gradients_are_accumulated_as_slices(mode):
  rng = np.random.RandomState(2)
  batches = [(rng.randint(0, 10, 6).astype(np.int32),
              rng.randint(0, 3, 6).astype(np.int32)) for _ in range(4)]

  def run(num_towers, steps, feeds):
    with tf.Graph().as_default():
      ids = tf.placeholder(tf.int32, [None])
      y = tf.placeholder(tf.int32, [None])
      train_op, t = towers.minimize(
          _embedding_model, tf.train.GradientDescentOptimizer(0.5),
          num_towers, inputs=(ids, y), devices=models.devices(num_towers),
          accumulate_steps=steps,
          variable_device=mode if num_towers > 1 else "cpu")
      sparse = [isinstance(g, tf.IndexedSlices) for g, _ in t.grads_and_vars]
      shapes = {v.op.name.rsplit("/", 1)[-1]: v.shape
                for v in tf.local_variables()
                if v.op.name.startswith("accumulate_gradients/tower_1/table")}
      with tf.Session(config=models.config()) as sess:
        sess.run(tf.global_variables_initializer())
        sess.run(tf.local_variables_initializer())
        for bx, by in feeds:
          sess.run(train_op, {ids: bx, y: by})
        return ({v.op.name: sess.run(v) for v in tf.trainable_variables()},
                sparse, shapes)

  got, sparse, shapes = run(2, 2, batches)
  whole = [(np.concatenate([a[0], b[0]]), np.concatenate([a[1], b[1]]))
           for a, b in zip(batches[::2], batches[1::2])]
  want, _, _ = run(1, 1, whole)
  _assert_close(got, want)
  assert sparse == [True, False]
  # The slices the micro-batches touched, never the table's full shape.
  assert sorted(shapes) == ["indices", "values"]
  assert not shapes["values"].is_fully_defined()


def _bn_model(normalize):
  def model_fn(scope, x, y):
    del scope
    w = tf.get_variable("w",
                        initializer=models.initial_values()["hidden/w"])
    hidden = normalize(tf.matmul(x, w))
    logits = tf.matmul(tf.tanh(hidden), tf.get_variable(
        "v", initializer=models.initial_values()["logits/w"][:5]))
    return tf.losses.sparse_softmax_cross_entropy(y, logits)
  return model_fn


def _bn_layer(x):
  """Batch norm over the tower's batch, with its moving mean an update op."""
  mean, variance = tf.nn.moments(x, [0])
  moving = tf.get_variable("bn/moving_mean", initializer=tf.zeros_initializer(),
                           shape=x.shape[1:], trainable=False)
  tf.add_to_collection(tf.GraphKeys.UPDATE_OPS, tf.assign(
      moving, 0.5 * moving + 0.5 * mean))
  return (x - mean) * tf.rsqrt(variance + 1e-3)


def _sync_bn_layer(x):
  return towers.batch_normalization(x, training=True, momentum=0.5,
                                    name="bn")


def _run_bn(normalize, num_towers, steps, feeds):
  with tf.Graph().as_default():
    x = tf.placeholder(tf.float32, [None, models.IN])
    y = tf.placeholder(tf.int32, [None])
    train_op, _ = towers.minimize(
        _bn_model(normalize), tf.train.GradientDescentOptimizer(0.5),
        num_towers, inputs=(x, y), devices=models.devices(num_towers),
        accumulate_steps=steps)
    with tf.Session(config=models.config()) as sess:
      sess.run(tf.global_variables_initializer())
      sess.run(tf.local_variables_initializer())
      for bx, by in feeds:
        sess.run(train_op, {x: bx, y: by})
      return {v.op.name: sess.run(v) for v in tf.global_variables()}


def test_update_ops_run_once_per_micro_batch():
  batches = make_batches([4] * 4)
  got = _run_bn(_bn_layer, 2, 4, batches)
  # The update comes after the 4th micro-batch's statistics: all 4 were
  # taken with the initial weights. Tower 0's updates stand for all, as
  # without accumulation: one device moving the statistics over tower 0's
  # half of each micro-batch, one after another, gives the same.
  with tf.Graph().as_default():
    x = tf.placeholder(tf.float32, [None, models.IN])
    w = tf.constant(models.initial_values()["hidden/w"])
    _bn_layer(tf.matmul(x, w))
    update = tf.get_collection(tf.GraphKeys.UPDATE_OPS)
    with models.session(tf.get_default_graph(), 1) as sess:
      sess.run(tf.global_variables_initializer())
      for bx, _ in batches:
        sess.run(update, {x: bx[:2]})
      want = {v.op.name: sess.run(v) for v in tf.global_variables()
              if "moving" in v.op.name}
  assert sorted(want) == ["bn/moving_mean"]
  np.testing.assert_allclose(got["bn/moving_mean"], want["bn/moving_mean"],
                             rtol=1e-5, atol=1e-6)
  assert float(np.max(np.abs(want["bn/moving_mean"]))) > 1e-2


def test_synchronized_batch_norm_normalizes_over_one_micro_batch():
  # What holds: N towers x k micro-batches of b are one device taking the
  # same k micro-batches of N*b (the towers' batch-norm statistics are
  # each micro-batch's, not the whole update's).
  batches = make_batches([6] * 4)
  got = _run_bn(_sync_bn_layer, 3, 2, batches)
  want = _run_bn(_sync_bn_layer, 1, 2, batches)
  _assert_close(got, want)
  once = _run_bn(_sync_bn_layer, 1, 1, [
      (np.concatenate([a[0], b[0]]), np.concatenate([a[1], b[1]]))
      for a, b in zip(batches[::2], batches[1::2])])
  assert float(np.max(np.abs(once["w"] - got["w"]))) > 1e-4


def test_bad_accumulate_steps_are_clear_errors():
  x, y = models.batch(4)
  for steps, error, words in [(0, ValueError, "accumulate_steps >= 1"),
                              (2.0, TypeError, "an int"),
                              (True, TypeError, "an int")]:
    with tf.Graph().as_default():
      with pytest.raises(error, match=words):
        towers.minimize(models.model_fn(), OPTIMIZERS["sgd"](), 2,
                        inputs=(tf.constant(x), tf.constant(y)),
                        devices=models.devices(2), accumulate_steps=steps)
  with tf.Graph().as_default():
    opt = tf.train.SyncReplicasOptimizer(OPTIMIZERS["sgd"](), 2)
    with pytest.raises(ValueError, match="replicas_to_aggregate"):
      towers.minimize(models.model_fn(), opt, 2,
                      inputs=(tf.constant(x), tf.constant(y)),
                      devices=models.devices(2), accumulate_steps=2)


def test_accumulate_gradients_checks_its_arguments():
  x, y = models.batch(4)
  with tf.Graph().as_default():
    t = towers.build_towers(models.model_fn(), OPTIMIZERS["sgd"](), 2,
                            inputs=(tf.constant(x), tf.constant(y)),
                            devices=models.devices(2))
    with pytest.raises(TypeError, match="Towers build_towers returns"):
      towers.accumulate_gradients(t.tower_grads, lambda g, w: None, 2)
    with pytest.raises(TypeError, match="apply_fn to be callable"):
      towers.accumulate_gradients(t, None, 2)
    with pytest.raises(TypeError, match="apply_fn to return the op"):
      towers.accumulate_gradients(t, lambda g, w: None, 2)


def test_the_by_hand_flow_accumulates_with_accumulate_gradients():
  batches = make_batches([4] * 4)
  make_opt = OPTIMIZERS["momentum"]
  with tf.Graph().as_default():
    x = tf.placeholder(tf.float32, [4, models.IN])
    y = tf.placeholder(tf.int32, [4])
    opt = make_opt()
    t = towers.build_towers(models.model_fn(True), opt, 2, inputs=(x, y),
                            devices=models.devices(2))
    global_step = tf.train.get_or_create_global_step()

    def apply_fn(tower_grads, weights):
      grads = towers.average_gradients(tower_grads, weights)
      return opt.apply_gradients(grads, global_step=global_step)

    with tf.control_dependencies(t.update_ops):
      train_op, applies = towers.accumulate_gradients(t, apply_fn, 2)
    with tf.Session(config=models.config()) as sess:
      sess.run(tf.global_variables_initializer())
      sess.run(tf.local_variables_initializer())
      flags = []
      for bx, by in batches:
        flags.append(sess.run([applies, train_op], {x: bx, y: by})[0])
      got = {v.op.name: sess.run(v) for v in tf.global_variables()}
  assert flags == [False, True, False, True]
  _assert_close(got, one_device(batches, 2, make_opt))


def test_with_parameter_servers_nothing_is_accumulated_on_them(pytestconfig):
  # Every worker shares a parameter server's variables: an accumulator
  # there would sum every worker's micro-batches. Its servers run in a
  # process of their own, which ends with them.
  done = subprocess.run(
      [sys.executable, os.path.join(HERE, "accumulate_ps_run.py")] + (
          ["--ref-variables"] if pytestconfig.getoption("--ref-variables")
          else []),
      capture_output=True, text=True, timeout=300, check=False,
      env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2"))
  assert done.returncode == 0, done.stderr[-3000:]
  result = json.loads(done.stdout.strip().splitlines()[-1])
  assert result["accumulators"] > 0
  assert result["on_parameter_servers"] == []
  assert result["largest_gap"] <= 1e-5
  assert result["global_step"] == 2
