"""Replicated mode: a copy of the variables per tower, kept identical."""

import os
import re

import numpy as np
import pytest
import tensorflow.compat.v1 as tf

import towers
from towers import _allreduce
from towers import _collectives
from tests import models
from models import (batch, config as _config, devices, initial_values,
                    loss_fn, model_fn, reference_gradients,
                    reference_training)

ALGORITHMS = ["add_n", "ring", "collective"]
OPTIMIZERS = {
    "momentum": lambda: tf.train.MomentumOptimizer(0.1, 0.9),
    "adam": lambda: tf.train.AdamOptimizer(0.01),
    "rmsprop": lambda: tf.train.RMSPropOptimizer(0.01),
}


def _init(sess):
  # Copy 0 first, then the copies, which read it (the order
  # MonitoredTrainingSession follows: init op or restore, then local init).
  sess.run(tf.global_variables_initializer())
  sess.run(tf.local_variables_initializer())


def _values(sess):
  return {v.op.name: sess.run(v)
          for v in tf.global_variables() + tf.local_variables()}


def _assert_copies_identical(values, num):
  copies = [name for name in values if name.startswith("replica_")]
  assert copies, "no copies were made"
  for name in copies:
    index, primary = name[len("replica_"):].split("/", 1)
    assert 0 < int(index) < num
    np.testing.assert_array_equal(values[name], values[primary],
                                  err_msg=name)


def _train(variable_device, make_opt, steps, *, num=4, size=8,
           all_reduce="auto", grappler=True, regularize=True):
  x, y = batch(size)
  with tf.Graph().as_default():
    kwargs = {"all_reduce": all_reduce} if all_reduce != "auto" else {}
    train_op, t = towers.minimize(
        model_fn(regularize), make_opt(), num,
        inputs=(tf.constant(x), tf.constant(y)), devices=devices(num),
        variable_device=variable_device, **kwargs)
    with tf.Session(config=_config(num, grappler)) as sess:
      _init(sess)
      losses = []
      for _ in range(steps):
        losses.append(sess.run([train_op, t.loss])[1])
      return losses, _values(sess), t


@pytest.mark.parametrize("make_opt", OPTIMIZERS.values(), ids=OPTIMIZERS)
@pytest.mark.parametrize("all_reduce", ALGORITHMS)
def test_copies_stay_identical_and_match_the_one_copy_mode(all_reduce,
                                                           make_opt):
  want_losses, want, _ = _train("cpu", make_opt, 30)
  losses, got, t = _train("replicated", make_opt, 30, all_reduce=all_reduce)
  assert t.all_reduce == all_reduce
  _assert_copies_identical(got, 4)
  assert set(want) <= set(got)
  for name, value in want.items():
    if all_reduce == "add_n":
      # The same tf.add_n on the same device: bitwise the one-copy mode.
      np.testing.assert_array_equal(got[name], value, err_msg=name)
    else:
      np.testing.assert_allclose(got[name], value, rtol=0, atol=1e-6,
                                 err_msg=name)
  if all_reduce == "add_n":
    assert losses == want_losses


@pytest.mark.parametrize("all_reduce", ALGORITHMS)
def test_copies_stay_identical_without_grappler(all_reduce):
  make_opt = OPTIMIZERS["momentum"]
  _, want, _ = _train("cpu", make_opt, 30, grappler=False)
  _, got, _ = _train("replicated", make_opt, 30, all_reduce=all_reduce,
                     grappler=False)
  _assert_copies_identical(got, 4)
  for name, value in want.items():
    np.testing.assert_allclose(got[name], value, rtol=0,
                               atol=0 if all_reduce == "add_n" else 1e-6,
                               err_msg=name)


def test_replicated_training_matches_one_device():
  x, y = batch(8)
  want_losses, want = reference_training(
      x, y, OPTIMIZERS["momentum"], 10, regularize=True)
  losses, got, _ = _train("replicated", OPTIMIZERS["momentum"], 10,
                          all_reduce="collective")
  np.testing.assert_allclose(losses, want_losses, rtol=1e-5)
  for name, value in want.items():
    np.testing.assert_allclose(got[name], value, rtol=1e-5, atol=1e-6,
                               err_msg=name)


@pytest.mark.parametrize("all_reduce", ALGORITHMS + ["auto"])
def test_one_replicated_tower_is_the_one_copy_mode(all_reduce):
  _, want, _ = _train("cpu", OPTIMIZERS["momentum"], 5, num=1)
  _, got, t = _train("replicated", OPTIMIZERS["momentum"], 5, num=1,
                     all_reduce=all_reduce)
  assert t.all_reduce == ("add_n" if all_reduce == "auto" else all_reduce)
  assert sorted(got) == sorted(want)
  for name, value in want.items():
    np.testing.assert_array_equal(got[name], value, err_msg=name)


def test_adam_beta_powers_advance_once_per_step():
  steps = 7
  _, got, _ = _train("replicated", OPTIMIZERS["adam"], steps)
  np.testing.assert_allclose(got["beta1_power"], 0.9 ** (steps + 1),
                             rtol=1e-6)
  np.testing.assert_allclose(got["beta2_power"], 0.999 ** (steps + 1),
                             rtol=1e-6)
  assert not [name for name in got if "power" in name and
              name not in ("beta1_power", "beta2_power")]


@pytest.mark.parametrize("all_reduce", ALGORITHMS)
@pytest.mark.parametrize("size,num", [(7, 3), (10, 4), (9, 2)])
def test_uneven_shards_give_the_single_device_gradient(size, num, all_reduce):
  x, y = batch(size)
  _, want = reference_gradients(x, y, regularize=True)
  with tf.Graph().as_default():
    opt = tf.train.GradientDescentOptimizer(0.1)
    t = towers.build_towers(
        model_fn(True), opt, num, inputs=(tf.constant(x), tf.constant(y)),
        devices=devices(num), variable_device="replicated",
        all_reduce=all_reduce)
    averaged = towers.average_gradients(t.tower_grads, t.weights,
                                        all_reduce=t.all_reduce)
    # Copy 0's pairs: the single-device view.
    assert sorted(v.op.name for _, v in averaged) == sorted(want)
    step = opt.apply_gradients(averaged)
    with tf.Session(config=_config(num)) as sess:
      _init(sess)
      values = dict(zip([v.op.name for _, v in averaged],
                        sess.run([g for g, _ in averaged])))
      sess.run(step)
      after = _values(sess)
  for name, value in values.items():
    np.testing.assert_allclose(value, want[name], rtol=1e-5, atol=1e-6,
                               err_msg=name)
  # Every copy took copy 0's update, bitwise.
  _assert_copies_identical(after, num)


def test_copies_live_on_their_towers_and_keep_out_of_checkpoints():
  with tf.Graph().as_default():
    _, t = towers.minimize(
        model_fn(True), OPTIMIZERS["momentum"](), 3,
        inputs=tuple(tf.constant(a) for a in batch(6)), devices=devices(3),
        variable_device="replicated")
    saved = sorted(v.op.name for v in tf.global_variables())
    assert saved == sorted(
        [n for n in initial_values()] + [n + "/Momentum"
                                         for n in initial_values()])
    assert sorted(v.op.name for v in tf.trainable_variables()) == sorted(
        initial_values())
    copies = [v for v in tf.local_variables()
              if v.op.name.startswith("replica_")]
    assert len(copies) == 2 * 2 * len(initial_values())  # values and slots
    # The rest say whether the copies have been set from copy 0: the towers'
    # and the update's.
    flags = [v for v in tf.local_variables() if v not in copies]
    assert [(v.dtype.base_dtype, v.device) for v in flags] == [
        (tf.bool, "/device:CPU:0")] * 2
    for var in copies:
      index = int(var.op.name.split("/")[0][len("replica_"):])
      assert var.device == "/device:CPU:%d" % index, var.op.name
    for var in tf.global_variables():
      assert var.device == "/device:CPU:0", var.op.name
    assert [v.op.name for _, v in t.grads_and_vars] == [
        v.op.name for v in tf.trainable_variables()]


def _save_replicated(path, num, steps, all_reduce="add_n"):
  x, y = batch(8)
  with tf.Graph().as_default():
    step = tf.train.get_or_create_global_step()
    train_op, _ = towers.minimize(
        model_fn(True), OPTIMIZERS["momentum"](), num,
        inputs=(tf.constant(x), tf.constant(y)), devices=devices(num),
        variable_device="replicated", all_reduce=all_reduce,
        global_step=step)
    with tf.Session(config=_config(num)) as sess:
      _init(sess)
      for _ in range(steps):
        sess.run(train_op)
      tf.train.Saver().save(sess, path, global_step=step)
      return _values(sess)


def _continue(path, variable_device, num, steps):
  """Restores with MonitoredTrainingSession and trains `steps` more."""
  x, y = batch(8)
  with tf.Graph().as_default():
    step = tf.train.get_or_create_global_step()
    if variable_device is None:
      loss = loss_fn(tf.constant(x), tf.constant(y), regularize=True)
      train_op = OPTIMIZERS["momentum"]().minimize(loss, global_step=step)
    else:
      train_op, _ = towers.minimize(
          model_fn(True), OPTIMIZERS["momentum"](), num,
          inputs=(tf.constant(x), tf.constant(y)), devices=devices(num),
          variable_device=variable_device, global_step=step)
    scaffold = tf.train.Scaffold(saver=tf.train.Saver())
    with tf.train.MonitoredTrainingSession(
        checkpoint_dir=os.path.dirname(path), scaffold=scaffold,
        config=_config(max(num, 1)), save_checkpoint_secs=None,
        save_checkpoint_steps=None, save_summaries_steps=None,
        save_summaries_secs=None, log_step_count_steps=None) as sess:
      restored = sess.run(step)
      for _ in range(steps):
        sess.run(train_op)
      values = {v.op.name: sess.run(v)
                for v in tf.global_variables() + tf.local_variables()}
  return restored, values


@pytest.mark.parametrize("into,num", [(None, 1), ("cpu", 2),
                                      ("replicated", 2), ("replicated", 4)],
                         ids=["single_device", "cpu_2", "replicated_2",
                              "replicated_4"])
def test_replicated_checkpoint_restores_anywhere(tmp_path, into, num):
  _, want, _ = _train("cpu", OPTIMIZERS["momentum"], 5)
  _save_replicated(str(tmp_path / "model.ckpt"), 4, 3)
  restored, got = _continue(str(tmp_path / "model.ckpt"), into, num, 2)
  assert restored == 3
  if into == "replicated":
    # The local init op set the copies (and their slots) from the restored
    # copy 0, or they would have trained apart.
    _assert_copies_identical(got, num)
  for name, value in want.items():
    np.testing.assert_allclose(got[name], value, rtol=1e-5, atol=1e-6,
                               err_msg=name)


def test_one_copy_checkpoint_restores_into_replicated(tmp_path):
  _, want, _ = _train("cpu", OPTIMIZERS["momentum"], 5)
  x, y = batch(8)
  path = str(tmp_path / "model.ckpt")
  with tf.Graph().as_default():
    step = tf.train.get_or_create_global_step()
    train_op, _ = towers.minimize(
        model_fn(True), OPTIMIZERS["momentum"](), 4,
        inputs=(tf.constant(x), tf.constant(y)), devices=devices(4),
        global_step=step)
    with tf.Session(config=_config(4)) as sess:
      sess.run(tf.global_variables_initializer())
      for _ in range(3):
        sess.run(train_op)
      tf.train.Saver().save(sess, path, global_step=step)
  restored, got = _continue(path, "replicated", 4, 2)
  assert restored == 3
  _assert_copies_identical(got, 4)
  for name, value in want.items():
    # add_n (auto on CPUs) after a restore: still bitwise.
    np.testing.assert_array_equal(got[name], value, err_msg=name)


def _collective_towers(num=3):
  x, y = batch(6)
  train_op, t = towers.minimize(
      model_fn(True), OPTIMIZERS["momentum"](), num,
      inputs=(tf.constant(x), tf.constant(y)), devices=devices(num),
      variable_device="replicated", all_reduce="collective")
  return train_op, t


@pytest.mark.parametrize("fetch", ["train_op", "loss", "tower_loss",
                                   "averaged_gradient", "last_copy"])
def test_partial_fetches_return(fetch):
  with tf.Graph().as_default():
    train_op, t = _collective_towers()
    fetches = {
        "train_op": train_op, "loss": t.loss, "tower_loss": t.losses[1],
        # One device's output of a collective: it must pull the whole
        # group, or it would wait for peers that never run.
        "averaged_gradient": t.grads_and_vars[0][0],
        "last_copy": [v for v in tf.local_variables()
                      if v.op.name.startswith("replica_")][-1],
    }[fetch]
    with tf.Session(config=_config(3)) as sess:
      _init(sess)
      for _ in range(3):
        sess.run(fetches)


def _embedding_model(scope, ids, y):
  del scope
  table = tf.get_variable(
      "table", initializer=np.random.RandomState(0).normal(
          0, 1, (10, 3)).astype(np.float32))
  w = tf.get_variable("w", initializer=np.ones((3, 2), np.float32))
  logits = tf.matmul(tf.gather(table, ids), w)
  return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
      labels=y, logits=logits))


@pytest.mark.parametrize("all_reduce", ALGORITHMS)
def test_sparse_gradients_stay_sparse_and_exact(all_reduce):
  ids = np.array([1, 3, 3, 7, 0, 9, 1], np.int32)
  y = np.array([0, 1, 1, 0, 1, 0, 0], np.int32)
  results = {}
  for mode in ["cpu", "replicated"]:
    with tf.Graph().as_default():
      kwargs = {"all_reduce": all_reduce} if mode == "replicated" else {}
      t = towers.build_towers(
          _embedding_model, tf.train.GradientDescentOptimizer(0.5), 3,
          inputs=(tf.constant(ids), tf.constant(y)), devices=devices(3),
          variable_device=mode, **kwargs)
      averaged = towers.average_gradients(t.tower_grads, t.weights,
                                          all_reduce=t.all_reduce)
      assert isinstance(averaged[0][0], tf.IndexedSlices)
      apply = towers.apply_gradients(tf.train.GradientDescentOptimizer(0.5),
                                     averaged)
      with tf.Session(config=_config(3)) as sess:
        _init(sess)
        for _ in range(5):
          sess.run(apply)
        results[mode] = _values(sess)
  _assert_copies_identical(results["replicated"], 3)
  for name, value in results["cpu"].items():
    np.testing.assert_allclose(results["replicated"][name], value, rtol=0,
                               atol=0 if all_reduce == "add_n" else 1e-6,
                               err_msg=name)


def _batch_norm_model(scope, x, y):
  """A two-layer net with a hand-made batch norm (tf-slim's recipe)."""
  del scope
  values = initial_values()
  with tf.variable_scope("hidden"):
    w = tf.get_variable("w", initializer=values["hidden/w"])
    h = tf.matmul(x, w)
  with tf.variable_scope("bn"):
    gamma = tf.get_variable("gamma", initializer=tf.ones([5]))
    beta = tf.get_variable("beta", initializer=tf.zeros([5]))
    moving_mean = tf.get_variable("moving_mean", initializer=tf.zeros([5]),
                                  trainable=False)
    mean, variance = tf.nn.moments(h, [0])
    tf.add_to_collection(tf.GraphKeys.UPDATE_OPS, tf.assign(
        moving_mean, 0.9 * moving_mean + 0.1 * mean))
    h = gamma * (h - mean) / tf.sqrt(variance + 1e-3) + beta
  with tf.variable_scope("logits"):
    w = tf.get_variable("w", initializer=values["logits/w"])
    logits = tf.matmul(tf.tanh(h), w)
  return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
      labels=y, logits=logits))


def test_batch_norm_statistics_keep_one_copy_updated_by_tower_0():
  x, y = batch(8)
  results = {}
  for mode in ["gpu", "replicated"]:
    with tf.Graph().as_default():
      train_op, t = towers.minimize(
          _batch_norm_model, OPTIMIZERS["momentum"](), 2,
          inputs=(tf.constant(x), tf.constant(y)), devices=devices(2),
          variable_device=mode)
      assert [op.name.split("/")[:2] for op in t.update_ops] == [
          ["tower_0", "bn"]]
      names = sorted(v.op.name for v in tf.global_variables())
      with tf.Session(config=_config(2)) as sess:
        _init(sess)
        for _ in range(4):
          sess.run(train_op)
        results[mode] = (names, _values(sess))
  names, got = results["replicated"]
  assert names == results["gpu"][0]
  # Statistics are not copied: one copy, tower 0's, saved and updated.
  assert "bn/moving_mean" in names
  assert not [n for n in got if n.startswith("replica_") and "moving" in n]
  assert "replica_1/bn/gamma" in got
  assert np.any(got["bn/moving_mean"] != 0)
  _assert_copies_identical(got, 2)
  for name, value in results["gpu"][1].items():
    np.testing.assert_array_equal(got[name], value, err_msg=name)


def test_a_variable_made_before_the_towers_is_copied_where_read():
  """Read by object, as a Keras model reads its weights: tower 1's ops are
  made to read its copy."""
  x, y = batch(8)

  def model(scope, x, y):
    del scope
    scale = tf.get_collection("scale")[0]
    return loss_fn(x * scale, y)

  with tf.Graph().as_default():
    scale = tf.Variable(1.5, name="scale")
    tf.add_to_collection("scale", scale)
    train_op, t = towers.minimize(
        model, OPTIMIZERS["momentum"](), 2,
        inputs=(tf.constant(x), tf.constant(y)), devices=devices(2),
        variable_device="replicated", all_reduce="ring")
    assert [v.op.name for _, v in t.tower_grads[1]][0] == "replica_1/scale"
    with tf.Session(config=_config(2)) as sess:
      _init(sess)
      for _ in range(3):
        sess.run(train_op)
      _assert_copies_identical(_values(sess), 2)
      assert sess.run(scale) != 1.5


def _colocating_model(registry):
  """Ops colocated with variables: an embedding lookup (its gather goes
  with the table) and the model's own colocate_with; the variables from
  tf.get_variable, or from a registry of plain tf.Variables."""

  def variable(name, value):
    if registry is None:
      return tf.get_variable(name, initializer=value)
    if name not in registry:  # Tower 0 makes it; later towers reuse it.
      registry[name] = tf.Variable(value, name=name)
    return registry[name]

  def model(scope, ids, y):
    del scope
    rng = np.random.RandomState(0)
    table = variable("table", rng.normal(0, 1, (10, 3)).astype(np.float32))
    w = variable("w", rng.normal(0, 1, (3, 2)).astype(np.float32))
    with tf.get_default_graph().colocate_with(w):
      w2 = tf.square(w, name="colocated_square")
    logits = tf.matmul(tf.nn.embedding_lookup(table, ids), w2)
    return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
        labels=y, logits=logits))

  return model


@pytest.mark.parametrize("registry", [False, True],
                         ids=["get_variable", "registry"])
def test_ops_colocated_with_a_variable_follow_the_towers_copy(registry):
  ids = np.array([1, 3, 3, 7, 0, 9, 1, 4], np.int32)
  y = np.array([0, 1, 1, 0, 1, 0, 0, 1], np.int32)
  results = {}
  for mode in ["cpu", "replicated"]:
    with tf.Graph().as_default() as graph:
      train_op, t = towers.minimize(
          _colocating_model({} if registry else None),
          tf.train.GradientDescentOptimizer(0.5), 2,
          inputs=(tf.constant(ids), tf.constant(y)), devices=devices(2),
          variable_device=mode)
      with tf.Session(config=_config(2)) as sess:
        _init(sess)
        metadata = tf.RunMetadata()
        for _ in range(3):
          sess.run(train_op, options=tf.RunOptions(
              output_partition_graphs=True), run_metadata=metadata)
        results[mode] = _values(sess)
    if mode == "replicated":
      placed = [(int(match.group(1)), models.device_index(node.device),
                 node.name)
                for partition in metadata.partition_graphs
                for node in partition.node if "Send" not in node.op and
                "Recv" not in node.op  # Transfers: the reduction's.
                for match in [re.match(r"tower_(\d+)/", node.name)] if match]
      assert [n for n in placed if n[0] == 1]
      strays = [n for n in placed if n[0] != n[1]]
      assert not strays, strays
  _assert_copies_identical(results["replicated"], 2)
  for name, value in results["cpu"].items():
    np.testing.assert_allclose(results["replicated"][name], value,
                               rtol=1e-6, atol=1e-6, err_msg=name)
  assert graph.get_operation_by_name("tower_1/colocated_square")


def test_infer_after_training_towers_reuses_the_copies():
  x, y = batch(8)
  with tf.Graph().as_default():
    towers.minimize(model_fn(), OPTIMIZERS["momentum"](), 2,
                    inputs=(tf.constant(x), tf.constant(y)),
                    devices=devices(2), variable_device="replicated")

    def copies():
      return [v for v in tf.local_variables()
              if v.op.name.startswith("replica_")]

    before = copies()
    outputs = towers.infer(lambda scope, x: tf.reduce_sum(x, 1), 2,
                           inputs=tf.constant(x), devices=devices(2),
                           variable_device="replicated")
    assert copies() == before
    with tf.Session(config=_config(2)) as sess:
      _init(sess)
      np.testing.assert_allclose(sess.run(outputs), x.sum(1), rtol=1e-6)


@pytest.mark.parametrize("kwargs,words", [
    ({"variable_device": "cpu", "all_reduce": "ring"},
     ["all_reduce='ring'", "variable_device='replicated'"]),
    ({"variable_device": "replicated", "all_reduce": "nccl"},
     ["expected all_reduce", "'collective'"]),
    ({"variable_device": "replicated", "all_reduce": "collective",
      "devices": ["/cpu:0", "/cpu:0"]},
     ["distinct device per tower", "'ring'"]),
])
def test_combinations_that_cannot_work_are_refused(kwargs, words):
  kwargs.setdefault("devices", devices(2))
  with tf.Graph().as_default():
    with pytest.raises(ValueError) as error:
      towers.build_towers(model_fn(), tf.train.GradientDescentOptimizer(0.1),
                          2, inputs=tuple(tf.constant(a) for a in batch(4)),
                          **kwargs)
  for word in words:
    assert word in str(error.value)


def test_sync_replicas_optimizer_is_refused():
  with tf.Graph().as_default():
    opt = tf.train.SyncReplicasOptimizer(
        tf.train.GradientDescentOptimizer(0.1), replicas_to_aggregate=1)
    with pytest.raises(ValueError, match="SyncReplicasOptimizer"):
      towers.build_towers(model_fn(), opt, 2,
                          inputs=tuple(tf.constant(a) for a in batch(4)),
                          devices=devices(2), variable_device="replicated")


def test_average_device_with_a_ring_is_refused():
  with tf.Graph().as_default():
    with pytest.raises(ValueError, match="all_reduce='add_n'"):
      towers.minimize(model_fn(), tf.train.GradientDescentOptimizer(0.1), 2,
                      inputs=tuple(tf.constant(a) for a in batch(4)),
                      devices=devices(2), variable_device="replicated",
                      all_reduce="ring", average_device="/cpu:0")


def test_auto_is_collective_on_gpus_and_add_n_on_cpus():
  # Devices are only named here: nothing runs, so no GPU is needed.
  with tf.Graph().as_default():
    t = towers.build_towers(
        model_fn(), tf.train.GradientDescentOptimizer(0.1), 2,
        inputs=tuple(tf.constant(a) for a in batch(4)),
        devices=["/gpu:0", "/gpu:1"], variable_device="replicated")
    assert t.all_reduce == "collective"
    ops = tf.get_default_graph().get_operations()
    # Built by average_gradients.
    assert not any(map(models.is_collective_reduce, ops))
    # Unpacked: one collective per variable and device.
    averaged = towers.average_gradients(t.tower_grads, t.weights,
                                        pack_bytes=0)
    reduce_ops = [op for op in tf.get_default_graph().get_operations()
                  if models.is_collective_reduce(op)]
    assert len(reduce_ops) == 2 * 4
    assert {op.get_attr("communication_hint") for op in reduce_ops} == {
        b"nccl"}
    assert len(averaged) == 4
  with tf.Graph().as_default():
    t = towers.build_towers(
        model_fn(), tf.train.GradientDescentOptimizer(0.1), 2,
        inputs=tuple(tf.constant(a) for a in batch(4)), devices=devices(2),
        variable_device="replicated")
    assert t.all_reduce == "add_n"


def _sums(algorithm, num, divisor, fetch_last_only=False):
  """`_allreduce.all_sum` of `num` towers' tensors, divided by `divisor`
  where each sum is finished; and, the path it replaces, the sums divided
  by it on every device afterwards."""
  rng = np.random.RandomState(num)
  values = [rng.normal(size=(37, 5)).astype(np.float32) for _ in range(num)]
  with tf.Graph().as_default():
    tensors = []
    for value, device in zip(values, devices(num)):
      with tf.device(device):
        tensors.append(tf.constant(value))
    order = _collectives.LaunchOrder()
    means = _allreduce.all_sum(tensors, devices(num), algorithm, order,
                               divisor=divisor)
    replaced = []
    for total, device in zip(_allreduce.all_sum(
        tensors, devices(num), algorithm, order), devices(num)):
      with tf.device(device):
        replaced.append(total * tf.constant(1.0 / divisor, tf.float32))
    with tf.Session(config=_config(num)) as sess:
      if fetch_last_only:
        # One device's mean runs its whole group (else: the timeout).
        return sess.run(means[-1])
      return sess.run([means, replaced])


@pytest.mark.parametrize("num", [2, 3, 4])
@pytest.mark.parametrize("algorithm", ["ring", "collective"])
def test_a_mean_divided_where_summed_is_the_sum_divided_on_each_device(
    algorithm, num):
  got, want = _sums(algorithm, num, divisor=num)
  for mean in got[1:]:
    assert mean.tobytes() == got[0].tobytes()
  if algorithm == "ring" or num in (2, 4):
    # The same multiplication (or a division by a power of two, exact).
    for mean, before in zip(got, want):
      assert mean.tobytes() == before.tobytes()
  else:
    # The collective divides by 3, the replaced path multiplies by 1/3.
    np.testing.assert_allclose(got, want, rtol=2.5e-7, atol=0)
  assert _sums(algorithm, num, divisor=num, fetch_last_only=True).shape == (
      37, 5)
