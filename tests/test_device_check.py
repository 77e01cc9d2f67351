"""Towers never share a device silently, and no cross-tower op ever hangs.

Every mode is built with the default devices, with duplicated devices and
with tower devices the session lacks (too few virtual CPUs, GPU names on a
machine without GPUs), and run under an operation timeout: each ends in the
correct result or a clear error, never in a hang (a DeadlineExceededError).
"""

import collections
import re

import numpy as np
import pytest
import tensorflow.compat.v1 as tf

import towers
from towers import _tf_versions
from models import batch, model_fn, reference_training

# A collective waiting for a member that never comes fails instead of
# hanging; the checks below must end long before it.
TIMEOUT_MS = 30000
SHARED = r"towers shared a device: tower \d \(.+\) with tower \d .*" \
    r"The session lacks some of the tower devices .*virtual_cpu_config\(4\)"


def _bn_model(scope, x, y):
  del scope
  w = tf.get_variable("w", [6, 4], initializer=tf.ones_initializer())
  h = tf.matmul(x, w)
  h = towers.batch_normalization(h, training=True, name="bn")
  return tf.reduce_mean(tf.square(h[:, 0] - tf.cast(y, tf.float32)))


def _sum_model(scope, x, y):
  del scope, y
  w = tf.get_variable("w", [6], initializer=tf.ones_initializer())
  total = towers.tower_context().all_sum(tf.reduce_sum(x * w))
  return tf.square(total) / 100.0


# name -> (model_fn, minimize's keywords, whether duplicated devices are
# refused when built: a collective has one member per device).
MODES = {
    "one copy": (model_fn(), {}, False),
    "sync batch norm": (_bn_model, {}, True),
    "tower_context sum": (_sum_model, {}, True),
    "replicated add_n": (model_fn(), {"variable_device": "replicated",
                                      "all_reduce": "add_n"}, False),
    "replicated ring": (model_fn(), {"variable_device": "replicated",
                                     "all_reduce": "ring"}, False),
    "replicated collective": (model_fn(), {"variable_device": "replicated",
                                           "all_reduce": "collective"}, True),
}


def _config(num_cpus, **kwargs):
  return towers.virtual_cpu_config(num_cpus, operation_timeout_in_ms=TIMEOUT_MS,
                                   **kwargs)


def _train(mode, devices, config, steps=3):
  """The loss after `steps` steps of `mode` on 4 towers, in `config`."""
  fn, kwargs, _ = MODES[mode]
  x, y = batch(8)
  with tf.Graph().as_default() as g:
    train_op, t = towers.minimize(
        fn, tf.train.GradientDescentOptimizer(0.1), 4,
        inputs=(tf.constant(x), tf.constant(y)), devices=devices, **kwargs)
    with tf.Session(graph=g, config=config) as sess:
      sess.run(tf.global_variables_initializer())
      sess.run(tf.local_variables_initializer())
      for _ in range(steps):
        sess.run(train_op)
      return sess.run(t.loss)


def test_default_devices_are_the_visible_ones(monkeypatch):
  # No GPU here: virtual CPUs, which virtual_cpu_config(n) creates.
  assert towers.tower_devices(3) == ["/cpu:0", "/cpu:1", "/cpu:2"]
  with tf.Graph().as_default():
    t = towers.build_towers(model_fn(), tf.train.GradientDescentOptimizer(0.1),
                            2, inputs=tuple(map(tf.constant, batch(4))))
    assert t.devices == ["/cpu:0", "/cpu:1"]
  gpus = [collections.namedtuple("Device", "name device_type")(
      "/physical_device:GPU:%d" % i, "GPU") for i in range(2)]
  monkeypatch.setattr(_tf_versions, "physical_gpus", lambda: gpus)
  assert towers.tower_devices(2) == ["/gpu:0", "/gpu:1"]
  assert towers.tower_devices(1, task="/job:worker/task:1") == [
      "/job:worker/task:1/gpu:0"]
  # Some GPUs, but fewer than towers: a hidden GPU, not a wish for CPUs.
  with pytest.raises(ValueError, match=r"4 towers but 2 GPU\(s\) visible "
                     r"\(/physical_device:GPU:0, /physical_device:GPU:1\).*"
                     r"Build 2 towers.*CUDA_VISIBLE_DEVICES"):
    towers.tower_devices(4)
  with tf.Graph().as_default():
    with pytest.raises(ValueError, match="4 towers but 2 GPU"):
      towers.build_towers(model_fn(), tf.train.GradientDescentOptimizer(0.1),
                          4, inputs=tuple(map(tf.constant, batch(8))))


@pytest.mark.parametrize("mode", sorted(MODES))
def test_default_devices_train_in_a_virtual_cpu_session(mode):
  # The README's way on a machine without GPUs: no devices=, and a session
  # with a virtual CPU device per tower.
  got = _train(mode, None, _config(4))
  want = _train(mode, ["/cpu:%d" % i for i in range(4)], _config(4))
  assert np.isfinite(got)
  assert got == want


@pytest.mark.parametrize("mode", sorted(MODES))
@pytest.mark.parametrize("devices,num_cpus", [
    (None, 2),                                   # too few virtual CPUs
    (None, 1),                                   # the session's one CPU
    (["/gpu:%d" % i for i in range(4)], 4),      # GPUs this machine lacks
    (["/cpu:0", "/cpu:1", "/cpu:2", "/job:localhost/replica:0/task:0/cpu:1"],
     4),                                         # one device, spelled twice
])
def test_towers_the_session_puts_on_one_device_fail_clearly(mode, devices,
                                                            num_cpus):
  # Soft placement (virtual_cpu_config turns it on) moves the towers the
  # session has no device for onto ones it has: the first step fails with
  # the devices and the fix, before any collective could wait forever.
  with pytest.raises(tf.errors.InvalidArgumentError, match=SHARED):
    _train(mode, devices, _config(num_cpus), steps=1)


@pytest.mark.parametrize("mode", sorted(MODES))
def test_duplicated_devices_train_or_are_refused_when_built(mode):
  # Towers declared on one device share it by intent (tf-slim's clones on
  # the CPU): the modes without collectives train as on distinct devices;
  # a collective needs a member per device, so those are refused up front.
  refused = MODES[mode][2]
  if refused:
    with pytest.raises(ValueError, match="distinct device per tower"):
      _train(mode, ["/cpu:0", "/cpu:1"] * 2, _config(2))
    return
  got = _train(mode, ["/cpu:0", "/cpu:1"] * 2, _config(2))
  want = _train(mode, ["/cpu:%d" % i for i in range(4)], _config(4))
  np.testing.assert_allclose(got, want, rtol=1e-6)


@pytest.mark.parametrize("stage_inputs", [False, True])
def test_without_soft_placement_the_first_error_names_the_fix(stage_inputs):
  # A plain session refuses to place a tower on a device it lacks, at once,
  # naming the first op it meets there: the check's, whose name is the fix.
  x, y = batch(8)
  with tf.Graph().as_default() as g:
    train_op, _ = towers.minimize(
        model_fn(), tf.train.GradientDescentOptimizer(0.1), 4,
        inputs=(tf.constant(x), tf.constant(y)), stage_inputs=stage_inputs)
    with tf.Session(graph=g, config=tf.ConfigProto(
        operation_timeout_in_ms=TIMEOUT_MS)) as sess:
      with pytest.raises(tf.errors.InvalidArgumentError) as raised:
        sess.run(tf.global_variables_initializer())
        sess.run(train_op)
  first = [line for line in raised.value.message.splitlines()
           if line.startswith("Cannot assign a device")][0]
  assert first.startswith(
      "Cannot assign a device for operation tower_device_check/tower_1_needs_"
      "CPU_1.make_the_session_with_towers.virtual_cpu_config_4: "), first
  assert "explicitly assigned to /device:CPU:1" in first


def test_too_few_devices_name_each_towers_device():
  # 4 towers on 2 virtual CPUs: soft placement puts towers 2 and 3 on CPU 0,
  # with tower 0; which write lands last there varies from run to run.
  with pytest.raises(tf.errors.InvalidArgumentError) as raised:
    _train("one copy", None, _config(2), steps=1)
  message = raised.value.message
  said = re.search(r"towers shared a device: ([^.]*)\.", message)[1]
  pairs = re.findall(r"tower (\d) \(/cpu:(\d)\) with tower (\d) "
                     r"\(/cpu:(\d)\)", said)
  assert all(i == d and j == e for i, d, j, e in pairs), pairs
  shared = {int(k) for i, _, j, _ in pairs for k in (i, j)}
  assert shared == {0, 2, 3} and len(pairs) == 2, message
  assert (". The session lacks some of the tower devices (/cpu:0, /cpu:1, "
          "/cpu:2, /cpu:3)" in message)


def test_infer_on_one_device_fails_clearly_and_apart_runs():
  x, _ = batch(8)
  w = np.ones((6, 2), np.float32)

  def forward(scope, images):
    del scope
    return tf.matmul(images, tf.constant(w))

  with tf.Graph().as_default() as g:
    logits = towers.infer(forward, 4, inputs=tf.constant(x))
    with tf.Session(graph=g, config=_config(4)) as sess:
      np.testing.assert_allclose(sess.run(logits), x @ w, rtol=1e-6)
    with tf.Session(graph=g, config=_config(2)) as sess:
      with pytest.raises(tf.errors.InvalidArgumentError, match=SHARED):
        sess.run(logits)


def test_one_tower_needs_no_check():
  with tf.Graph().as_default() as g:
    towers.build_towers(model_fn(), tf.train.GradientDescentOptimizer(0.1),
                        1, inputs=tuple(map(tf.constant, batch(4))))
    assert not [op for op in g.get_operations() if "device_check" in op.name]


def test_the_check_adds_no_variable_and_the_step_stays_exact():
  # The check's scalars are no variables: nothing to initialize or save.
  x, y = batch(8)
  with tf.Graph().as_default() as g:
    train_op, _ = towers.minimize(
        model_fn(regularize=True), tf.train.GradientDescentOptimizer(0.1), 4,
        inputs=(tf.constant(x), tf.constant(y)),
        devices=["/cpu:%d" % i for i in range(4)])
    assert sorted(v.op.name for v in tf.global_variables()) == [
        "hidden/b", "hidden/w", "logits/b", "logits/w"]
    with tf.Session(graph=g, config=_config(4)) as sess:
      sess.run(tf.global_variables_initializer())
      assert sess.run(tf.report_uninitialized_variables()).size == 0
      for _ in range(3):
        sess.run(train_op)
      got = {v.op.name: sess.run(v) for v in tf.trainable_variables()}
  _, want = reference_training(
      x, y, lambda: tf.train.GradientDescentOptimizer(0.1), 3,
      regularize=True)
  for name, value in want.items():
    np.testing.assert_allclose(got[name], value, rtol=1e-5, atol=1e-6,
                               err_msg=name)
