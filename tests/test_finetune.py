"""A single-device checkpoint fine-tuned on towers, in every variable mode.

The recipe of docs/porting.md: a model pretrained on one device and saved
with ``tf.train.Saver`` is restored into towers built with
``towers.minimize`` (with ``tf.train.init_from_checkpoint`` as Google's BERT
calls it, or a ``tf.train.Saver`` of a subset), beside a new head the
checkpoint does not have. Every restored variable, and every replicated copy
of it, must hold the checkpoint's value, and the steps that follow must be
the steps one device takes from the same start. The reference is a plain
``opt.minimize`` on the global batch whose variables are loaded by hand from
the values the checkpoint reader returns, so no restore mechanism is shared
between what is tested and what it is compared with.
"""

import numpy as np
import pytest
import tensorflow.compat.v1 as tf

import towers
from models import state_variables

IN, HIDDEN, PRETRAIN_CLASSES, CLASSES = 6, 5, 4, 3
NUM_TOWERS, BATCH, STEPS = 2, 8, 3
DEVICES = ["/cpu:%d" % i for i in range(NUM_TOWERS)]
MODES = {
    "cpu": {"variable_device": "cpu"},
    "gpu": {"variable_device": "gpu"},
    "balanced": {"variable_device": "balanced"},
    "replicated_add_n": {"variable_device": "replicated",
                         "all_reduce": "add_n"},
    "replicated_ring": {"variable_device": "replicated",
                        "all_reduce": "ring"},
    "replicated_collective": {"variable_device": "replicated",
                              "all_reduce": "collective"},
}
# The pretrained pooler is fine-tuned under another scope, so each map also
# renames one.
SCOPE_MAP = {"bert/": "bert/", "old/": "new/"}
# The fine-tuning graph's variables the checkpoint has (under old/ for the
# pooler).
PRETRAINED = ["bert/encoder/kernel", "bert/encoder/bias", "new/pooler/kernel",
              "new/pooler/bias"]
# The new head's start, the same in every graph (the pretrained variables'
# own initializers are random on purpose: a variable the restore missed
# then differs from the reference).
HEAD = {
    "head/kernel": np.random.RandomState(3).normal(
        0, 0.5, (HIDDEN, CLASSES)).astype(np.float32),
    "head/bias": np.zeros(CLASSES, np.float32),
}

mode = pytest.mark.parametrize("kwargs", MODES.values(), ids=MODES)


def _config(num):
  config = towers.virtual_cpu_config(num)
  # A collective waiting for a peer that never comes fails the test in
  # seconds instead of hanging it.
  config.operation_timeout_in_ms = 30000
  return config


def _optimizer():
  return tf.train.MomentumOptimizer(0.1, 0.9)


def _data(classes, seed):
  rng = np.random.RandomState(seed)
  return (rng.normal(0, 1, (BATCH, IN)).astype(np.float32),
          rng.randint(0, classes, BATCH).astype(np.int32))


def _dense(name, inputs, units, activation=None):
  with tf.variable_scope(name):
    if name + "/kernel" in HEAD:
      kernel = tf.get_variable("kernel", initializer=HEAD[name + "/kernel"])
      bias = tf.get_variable("bias", initializer=HEAD[name + "/bias"])
    else:
      kernel = tf.get_variable(
          "kernel", [inputs.shape[-1], units],
          initializer=tf.random_normal_initializer(0, 0.5))
      bias = tf.get_variable("bias", [units],
                             initializer=tf.random_normal_initializer(0, 0.1))
    outputs = tf.matmul(inputs, kernel) + bias
    return outputs if activation is None else activation(outputs)


def _loss(x, y, *, pooler, head, classes):
  """A BERT-shaped MLP: an encoder, a pooler, a task head."""
  with tf.variable_scope("bert"):
    hidden = _dense("encoder", x, HIDDEN, tf.tanh)
  with tf.variable_scope(pooler):
    hidden = _dense("pooler", hidden, HIDDEN, tf.tanh)
  logits = _dense(head, hidden, classes)
  return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
      labels=y, logits=logits))


def _finetune_loss(x, y):
  return _loss(x, y, pooler="new", head="head", classes=CLASSES)


@pytest.fixture(scope="module", name="pretrained")
def _pretrained(tmp_path_factory):
  """The single-device checkpoint: a few Momentum steps, slots saved too."""
  x, y = _data(PRETRAIN_CLASSES, seed=2)
  with tf.Graph().as_default():
    loss = _loss(tf.constant(x), tf.constant(y), pooler="old", head="cls",
                 classes=PRETRAIN_CLASSES)
    train_op = _optimizer().minimize(loss)
    with tf.Session(config=_config(1)) as sess:
      sess.run(tf.global_variables_initializer())
      for _ in range(3):
        sess.run(train_op)
      return tf.train.Saver().save(
          sess, str(tmp_path_factory.mktemp("pretrained") / "model.ckpt"))


def _source(name):
  """The checkpoint name a fine-tuning variable is restored from."""
  return "old/" + name[len("new/"):] if name.startswith("new/") else name


def _primary(name):
  """The name of copy 0 of a variable, given any copy's."""
  if name.startswith("replica_"):
    return name.split("/", 1)[1]
  return name


def _model_variables():
  """{name: variable} of the default graph's variables in PRETRAINED."""
  found = {v.op.name: v for v in tf.trainable_variables()
           if v.op.name in PRETRAINED}
  assert sorted(found) == sorted(PRETRAINED)
  return found


def _assignment_map(kind, ckpt):
  if kind == "scopes":
    return SCOPE_MAP
  # BERT's get_assignment_map_from_checkpoint: the graph's trainable
  # variables the checkpoint has, by name (here with the pooler renamed).
  saved = {name for name, _ in tf.train.list_variables(ckpt)}
  return {_source(v.op.name): v.op.name for v in tf.trainable_variables()
          if _source(v.op.name) in saved}


def _start(ckpt, restored):
  """{name: value} every global variable starts from, after the restore.

  `restored` names the variables the restore sets (from `ckpt`, read here
  with the checkpoint reader); the head takes its initializer's value and
  every other slot and counter starts at zero.
  """
  reader = tf.train.load_checkpoint(ckpt)
  start = {name: np.zeros(shape, np.float32)
           for name, shape in _fine_tuning_shapes().items()}
  start.update(HEAD)
  start["global_step"] = np.int64(0)
  for name in restored:
    start[name] = reader.get_tensor(_source(name))
  return start


def _fine_tuning_shapes():
  with tf.Graph().as_default():
    _build_one_device()
    return {v.op.name: v.shape.as_list() for v in tf.global_variables()}


def _build_one_device():
  x, y = _data(CLASSES, seed=1)
  step = tf.train.get_or_create_global_step()
  loss = _finetune_loss(tf.constant(x), tf.constant(y))
  return loss, _optimizer().minimize(loss, global_step=step)


def _one_device(start, steps, save_to=None):
  """Losses and variables of `steps` single-device steps from `start`."""
  with tf.Graph().as_default():
    loss, train_op = _build_one_device()
    assert sorted(v.op.name for v in tf.global_variables()) == sorted(start)
    with tf.Session(config=_config(1)) as sess:
      sess.run(tf.global_variables_initializer())
      sess.run([v.assign(start[v.op.name]) for v in tf.global_variables()])
      losses = []
      for _ in range(steps):
        # Separate runs: with ref variables an in-place update could race a
        # loss fetched in the same run.
        losses.append(sess.run(loss))
        sess.run(train_op)
      values = {v.op.name: sess.run(v) for v in tf.global_variables()}
      if save_to:
        tf.train.Saver().save(sess, save_to)
  return losses, values


def _towers(kwargs):
  """The fine-tuning towers, with a global step: ``(train_op, Towers)``."""
  x, y = _data(CLASSES, seed=1)
  step = tf.train.get_or_create_global_step()
  train_op, t = towers.minimize(
      lambda scope, x, y: _finetune_loss(x, y), _optimizer(), NUM_TOWERS,
      inputs=(tf.constant(x), tf.constant(y)), devices=DEVICES,
      global_step=step, **kwargs)
  return train_op, t


def _values(sess):
  return {v.op.name: sess.run(v)
          for v in state_variables()}


def _assert_holds(values, want, names, kwargs):
  """Each of `names`, and every copy of one, holds its value in `want`."""
  assert set(PRETRAINED) <= set(names)
  replicated = kwargs["variable_device"] == "replicated"
  for name in names:
    copies = [n for n in values if _primary(n) == name]
    # Replicated: a copy per tower of each variable and slot, but not of
    # the global step (not trainable).
    assert len(copies) == (
        NUM_TOWERS if replicated and name != "global_step" else 1), copies
    for copy in copies:
      np.testing.assert_array_equal(values[copy], want[name], err_msg=copy)


def _train(sess, train_op, t, steps):
  return [sess.run([train_op, t.loss])[1] for _ in range(steps)]


def _assert_trains_like(losses, values, want_losses, want):
  np.testing.assert_allclose(losses, want_losses, rtol=1e-5, atol=1e-5)
  for name, value in want.items():
    np.testing.assert_allclose(values[name], value, rtol=1e-5, atol=1e-5,
                               err_msg=name)
  for name, value in values.items():
    if name.startswith("replica_"):
      # The copies applied the same updates as copy 0.
      np.testing.assert_array_equal(value, values[_primary(name)],
                                    err_msg=name)


@mode
@pytest.mark.parametrize("kind", ["names", "scopes"])
def test_init_from_checkpoint_restores_every_copy_then_trains_like_one_device(
    pretrained, kwargs, kind):
  with tf.Graph().as_default():
    train_op, t = _towers(kwargs)
    # After minimize, as the recipe says: the init op made below runs the
    # checkpoint initializers this installs.
    assignment_map = _assignment_map(kind, pretrained)
    tf.train.init_from_checkpoint(pretrained, assignment_map)
    restored = PRETRAINED
    if kind == "names":
      assert sorted(assignment_map.values()) == sorted(PRETRAINED)
    else:
      # A scope map called after minimize also matches the optimizer's
      # slots under the scope, which this checkpoint has.
      restored = PRETRAINED + [name + "/Momentum" for name in PRETRAINED]
    start = _start(pretrained, restored)
    with tf.Session(config=_config(NUM_TOWERS)) as sess:
      sess.run(tf.global_variables_initializer())
      sess.run(tf.local_variables_initializer())
      _assert_holds(_values(sess), start, restored, kwargs)
      losses = _train(sess, train_op, t, STEPS)
      values = _values(sess)
  _assert_trains_like(losses, values, *_one_device(start, STEPS))


def _subset_saver():
  # Checkpoint names to the graph's variables: the head is not in the
  # checkpoint, and the pooler is saved under its old scope.
  return tf.train.Saver(var_list={_source(name): var for name, var
                                  in _model_variables().items()})


@mode
def test_saver_restore_then_local_init_trains_like_one_device(pretrained,
                                                              kwargs):
  with tf.Graph().as_default():
    train_op, t = _towers(kwargs)
    saver = _subset_saver()
    start = _start(pretrained, PRETRAINED)
    with tf.Session(config=_config(NUM_TOWERS)) as sess:
      sess.run(tf.global_variables_initializer())
      saver.restore(sess, pretrained)
      # After the restore: the copies are set from copy 0 as it is now.
      sess.run(tf.local_variables_initializer())
      _assert_holds(_values(sess), start, PRETRAINED, kwargs)
      losses = _train(sess, train_op, t, STEPS)
      values = _values(sess)
  _assert_trains_like(losses, values, *_one_device(start, STEPS))


def _monitored(checkpoint_dir, scaffold):
  # Saves only as the session starts and ends: no timed saves or summaries
  # to race the test.
  return tf.train.MonitoredTrainingSession(
      checkpoint_dir=checkpoint_dir, scaffold=scaffold,
      config=_config(NUM_TOWERS), save_checkpoint_secs=None,
      save_checkpoint_steps=10 ** 6, save_summaries_steps=None,
      save_summaries_secs=None, log_step_count_steps=None)


def _fine_tune_monitored(pretrained, kwargs, checkpoint_dir, steps):
  """Fine-tunes with MonitoredTrainingSession, restoring in init_fn.

  Returns:
    The values right after the session was made, the losses, the values
    after training.
  """
  with tf.Graph().as_default():
    train_op, t = _towers(kwargs)
    saver = _subset_saver()
    scaffold = tf.train.Scaffold(
        init_fn=lambda scaffold, sess: saver.restore(sess, pretrained))
    with _monitored(checkpoint_dir, scaffold) as sess:
      before = _values(sess)
      losses = _train(sess, train_op, t, steps)
      after = _values(sess)
  return before, losses, after


@mode
def test_monitored_session_init_fn_restore_trains_like_one_device(pretrained,
                                                                  kwargs):
  before, losses, values = _fine_tune_monitored(pretrained, kwargs, None,
                                                STEPS)
  start = _start(pretrained, PRETRAINED)
  # The session ran the local init op after init_fn's restore.
  _assert_holds(before, start, PRETRAINED, kwargs)
  _assert_trains_like(losses, values, *_one_device(start, STEPS))


@mode
def test_towers_checkpoint_has_the_single_device_keys_only(
    pretrained, kwargs, tmp_path):
  _fine_tune_monitored(pretrained, kwargs, str(tmp_path / "towers"), 1)
  _one_device(_start(pretrained, PRETRAINED), 1,
              save_to=str(tmp_path / "one_device" / "model.ckpt"))
  keys = [name for name, _ in tf.train.list_variables(
      str(tmp_path / "towers"))]
  assert not [name for name in keys if "replica_" in name]
  assert keys == [name for name, _ in tf.train.list_variables(
      str(tmp_path / "one_device"))]


@mode
def test_monitored_session_resumes_a_towers_checkpoint_like_one_device(
    pretrained, kwargs, tmp_path):
  checkpoint_dir = str(tmp_path / "train")
  _fine_tune_monitored(pretrained, kwargs, checkpoint_dir, STEPS)
  saved = tf.train.load_checkpoint(checkpoint_dir)
  with tf.Graph().as_default():
    train_op, t = _towers(kwargs)
    # The directory's checkpoint is restored; init_fn is not called then.
    scaffold = tf.train.Scaffold(init_fn=lambda scaffold, sess: pytest.fail(
        "init_fn ran though checkpoint_dir has a checkpoint"))
    with _monitored(checkpoint_dir, scaffold) as sess:
      before = _values(sess)
      losses = _train(sess, train_op, t, STEPS)
      values = _values(sess)
  assert before["global_step"] == STEPS
  everything = {_primary(name) for name in before}
  _assert_holds(before, {name: saved.get_tensor(name) for name in everything},
                everything, kwargs)
  want_losses, want = _one_device(_start(pretrained, PRETRAINED), 2 * STEPS)
  _assert_trains_like(losses, values, want_losses[STEPS:], want)


@mode
def test_a_scope_map_after_minimize_wants_the_slots_in_the_checkpoint(
    pretrained, kwargs, tmp_path):
  # A checkpoint of the weights only, without the optimizer's slots (as
  # pretrained models are often published).
  weights_only = str(tmp_path / "weights.ckpt")
  with tf.Graph().as_default():
    saver = tf.train.Saver(var_list=[
        tf.get_variable(name, shape) for name, shape
        in tf.train.list_variables(pretrained) if "Momentum" not in name])
    with tf.Session() as sess:
      saver.restore(sess, pretrained)
      saver.save(sess, weights_only)
  with tf.Graph().as_default():
    _towers(kwargs)
    with pytest.raises(ValueError, match="Momentum.* is not found"):
      tf.train.init_from_checkpoint(weights_only, SCOPE_MAP)
    # A map of the trainable variables by name (BERT's) names no slot.
    tf.train.init_from_checkpoint(
        weights_only, _assignment_map("names", weights_only))
