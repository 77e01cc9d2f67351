"""`towers.testing.assert_matches_one_device`: a port's unit test in one call.

It passes for the library's reference models (a CNN with synchronized batch
norm, a GAN with Adam, a template, a model with sparse gradients and
outputs, accumulated micro-batches; Keras and tf.layers models in
`testing_run.py`) in every mode, and fails on planted bugs, each failure's
message naming the culprit and its pitfall.
"""

import inspect
import unittest

import numpy as np
import pytest
import tensorflow.compat.v1 as tf

import towers
from towers import testing
from towers.testing import _compare
from towers.testing import _matches
from towers.testing import _programs
import models

CLASSES = 3
IMAGES, LABELS = (np.random.RandomState(0).normal(size=(12, 5, 5, 2))
                  .astype(np.float32),
                  np.random.RandomState(1).randint(0, CLASSES, 12))
Z_DIM = 3


def _dense(x, units, name, decay=0.0, dtype=tf.float32):
  with tf.variable_scope(name):
    w = tf.get_variable("w", [int(x.shape[-1]), units], dtype, regularizer=(
        (lambda v: decay * tf.nn.l2_loss(v)) if decay else None))
    b = tf.get_variable("b", [units], dtype,
                        initializer=tf.zeros_initializer())
  return tf.matmul(x, w) + b


def _logits(images):
  kernel = tf.get_variable("conv/kernel", [3, 3, 2, 4])
  net = tf.nn.conv2d(images, kernel, [1, 1, 1, 1], "VALID")
  net = tf.nn.relu(towers.batch_normalization(net, training=True,
                                              momentum=0.9, name="bn"))
  return _dense(tf.reshape(net, [-1, 3 * 3 * 4]), CLASSES, "logits", 0.01)


def cnn(scope, images, labels):
  """The tutorial's shape of model: conv, synchronized batch norm, weight
  decay (a tf.get_variable regularizer)."""
  del scope
  loss = tf.losses.sparse_softmax_cross_entropy(labels, _logits(images))
  return loss + tf.losses.get_regularization_loss()


def gan(scope, images, z):
  """A generator with synchronized batch norm, a discriminator on the real
  and the generated images; D's loss and G's."""
  del scope
  with tf.variable_scope("generator"):
    h = towers.batch_normalization(_dense(z, 8, "fc1"), training=True,
                                   momentum=0.9, name="bn")
    fake = tf.tanh(_dense(tf.nn.relu(h), 4, "fc2"))

  def discriminator(x):
    with tf.variable_scope("discriminator", reuse=tf.AUTO_REUSE):
      return _dense(tf.nn.leaky_relu(_dense(x, 8, "fc1")), 1, "fc2")

  real, faked = discriminator(images), discriminator(fake)
  xent = tf.nn.sigmoid_cross_entropy_with_logits
  d_loss = tf.reduce_mean(xent(labels=tf.ones_like(real), logits=real) +
                          xent(labels=tf.zeros_like(faked), logits=faked))
  g_loss = tf.reduce_mean(xent(labels=tf.ones_like(faked), logits=faked))
  return {"d": d_loss, "g": g_loss}


def gan_batch(rows=12):
  rng = np.random.RandomState(2)
  return (rng.normal(size=(rows, 4)).astype(np.float32),
          rng.normal(size=(rows, Z_DIM)).astype(np.float32))


def adam_pair():
  return {"d": tf.train.AdamOptimizer(0.01, beta1=0.5),
          "g": tf.train.AdamOptimizer(0.01, beta1=0.5)}


def make_template_model():
  """A template is bound to the graph it first ran in: made per program."""
  net = tf.make_template("net", lambda x: _dense(
      tf.tanh(_dense(x, 5, "hidden")), CLASSES, "out"))

  def model_fn(scope, x, y):
    del scope
    return tf.losses.sparse_softmax_cross_entropy(y, net(x))
  return model_fn


def embedding_model(scope, ids, labels):
  """Sparse gradients (a gather of an embedding), with outputs."""
  del scope
  table = tf.get_variable("embedding", [10, 4])
  logits = _dense(tf.reduce_mean(tf.nn.embedding_lookup(table, ids), 1),
                  CLASSES, "logits")
  loss = tf.losses.sparse_softmax_cross_entropy(labels, logits)
  return loss, {"logits": logits}


def ids_batch():
  rng = np.random.RandomState(3)
  return rng.randint(0, 10, (12, 3)), rng.randint(0, CLASSES, 12)


def momentum():
  return tf.train.MomentumOptimizer(0.1, 0.9)


def adam():
  return tf.train.AdamOptimizer(0.01)


def _failure(*args, **kwargs):
  with pytest.raises(AssertionError) as raised:
    testing.assert_matches_one_device(*args, **kwargs)
  return str(raised.value)


# It passes on the reference models.

def test_a_cnn_with_synchronized_batch_norm_matches_in_every_mode():
  testing.assert_matches_one_device(cnn, momentum, (IMAGES, LABELS))


@pytest.mark.parametrize("all_reduce", ["add_n", "ring"])
def test_the_other_all_reduce_algorithms_match(all_reduce):
  testing.assert_matches_one_device(cnn, momentum, (IMAGES, LABELS),
                                    num_towers=3, all_reduce=all_reduce)


def test_a_gan_with_adam_matches_step_by_step():
  testing.assert_matches_one_device(
      gan, adam_pair, gan_batch(), var_list={"d": "discriminator/",
                                             "g": "generator/"})


def test_a_template_made_per_program_matches():
  x, y = models.batch(12)
  testing.assert_matches_one_device(make_template_model, adam, (x, y))


def test_sparse_gradients_and_outputs_match():
  testing.assert_matches_one_device(embedding_model, momentum, ids_batch(),
                                    clip_norm=1.0)


def float64_model(scope, x, y):
  """float64 weights and batch norm; tf.losses rounds the loss to float32."""
  del scope
  h = _dense(x, 5, "hidden", dtype=tf.float64)
  h = tf.tanh(towers.batch_normalization(h, training=True, name="bn"))
  return tf.losses.sparse_softmax_cross_entropy(
      y, _dense(h, CLASSES, "out", dtype=tf.float64))


def test_a_float64_model_is_held_to_the_float32_its_loss_is_rounded_to():
  rng = np.random.RandomState(4)
  testing.assert_matches_one_device(float64_model, adam,
                                    (rng.normal(size=(4, 6)),
                                     rng.randint(0, CLASSES, 4)))


def test_accumulated_micro_batches_match_one_device_on_all_of_them():
  x, y = models.batch(16)
  testing.assert_matches_one_device(models.model_fn(regularize=True), adam,
                                    (x, y), accumulate_steps=2)


@pytest.fixture(scope="module")
def layers_and_keras(legacy_keras_run):
  return legacy_keras_run("testing_run.py", timeout=600)


def test_a_keras_model_made_per_program_matches(layers_and_keras):
  assert layers_and_keras["keras"] is None


def test_tf_layers_with_synchronized_batch_norm_match(layers_and_keras):
  assert layers_and_keras["layers_synchronized_batch_norm"] is None


# It fails on planted bugs, naming the culprit.

def summed(scope, x, y):
  """A loss summed over the batch, where towers average."""
  del scope
  return tf.reduce_sum(tf.nn.sparse_softmax_cross_entropy_with_logits(
      labels=y, logits=_dense(x, CLASSES, "logits")))


def collects_every_towers_loss(scope, x, y):
  del scope
  tf.losses.sparse_softmax_cross_entropy(y, _dense(x, CLASSES, "logits"))
  return tf.losses.get_total_loss()


def per_tower_batch_norm(scope, x, y):
  """Normalizes with the statistics of its own input: per tower, a shard."""
  del scope
  h = _dense(x, 5, "hidden")
  mean, variance = tf.nn.moments(h, [0])
  h = tf.nn.relu((h - mean) * tf.rsqrt(variance + 1e-3))
  return tf.losses.sparse_softmax_cross_entropy(y, _dense(h, CLASSES, "out"))


def decays_in_an_update_op(scope, x, y):
  """Shrinks a trainable weight in an update op: tower 0's update ops run
  once, on copy 0 alone."""
  del scope
  loss = tf.losses.sparse_softmax_cross_entropy(
      y, _dense(x, CLASSES, "logits"))
  with tf.variable_scope("logits", reuse=True):
    w = tf.get_variable("w")
  # After the forward pass, which reads the weight (ref variables would
  # race); the step's update waits for it.
  with tf.control_dependencies([loss]):
    tf.add_to_collection(tf.GraphKeys.UPDATE_OPS, w.assign(w * 0.9))
  return loss


def test_a_summed_loss_fails_naming_the_sum():
  message = _failure(summed, momentum, models.batch(12))
  assert "model_fn trains otherwise on 2 towers than on one device" in message
  assert "gradient of logits/w" in message
  assert "cpu, 11 rows (6+5)" in message  # the uneven split is checked too
  assert "the loss is a sum over the batch, not a mean" in message
  assert "tf.reduce_mean" in message
  assert "pitfall P54 in docs/pitfalls.md" in message


def test_a_summed_loss_fails_with_adam_too():
  # Adam's step hardly changes with the gradient's scale; the losses and
  # the first gradients still show it.
  message = _failure(summed, adam, models.batch(12), variable_device="cpu")
  assert "the loss is a sum over the batch" in message


def test_a_loss_collecting_every_towers_losses_fails_naming_the_trap():
  message = _failure(collects_every_towers_loss, momentum, models.batch(12))
  assert "model_fn does not train on 2 towers (cpu, 12 rows)" in message
  assert "tower_1's loss reads tower_0's data" in message
  assert "tf.losses.get_total_loss() without a scope" in message
  assert "pitfall P16 in docs/pitfalls.md" in message


@pytest.mark.parametrize("make_optimizer", [momentum, adam])
def test_per_tower_batch_norm_fails_naming_the_op(make_optimizer):
  message = _failure(per_tower_batch_norm, make_optimizer, models.batch(12),
                     variable_device="cpu")
  assert "tower_0/moments/mean normalizes each tower's shard" in message
  assert "towers.batch_normalization" in message
  assert "pitfall P27 in docs/pitfalls.md" in message


def test_tf_layers_batch_norm_per_tower_fails_naming_the_op(layers_and_keras):
  message = layers_and_keras["layers_per_tower_batch_norm"]
  assert "gradient of conv2d/kernel" in message
  assert ("tower_0/batch_normalization/FusedBatchNormV3 normalizes each "
          "tower's shard") in message
  assert "towers.batch_normalization" in message


def test_keras_batch_norm_fails_naming_the_op(layers_and_keras):
  message = layers_and_keras["keras_batch_norm"]
  assert ("tower_0/sequential/batch_normalization/FusedBatchNormV3 "
          "normalizes each tower's shard") in message


def test_a_copy_written_apart_fails_naming_the_copy():
  message = _failure(decays_in_an_update_op, momentum, models.batch(12),
                     variable_device="replicated")
  assert "copy replica_1/logits/w" in message
  assert "a replicated copy is apart from copy 0" in message
  assert "pitfalls P19 and P23 in docs/pitfalls.md" in message


def test_with_accumulation_per_tower_batch_norm_names_the_micro_batches():
  message = _failure(per_tower_batch_norm, momentum, models.batch(12),
                     variable_device="cpu", accumulate_steps=2)
  assert "each tower's shard of each micro-batch" in message


def test_with_accumulation_synchronized_batch_norm_fails_saying_why():
  """By design: each micro-batch is normalized alone, as one device taking
  the micro-batches in turn would."""
  message = _failure(bias_before_batch_norm, momentum, models.batch(12),
                     variable_device="cpu", accumulate_steps=2)
  assert ("tower_0/bn normalizes each of the 2 micro-batches with its own "
          "statistics") in message
  assert "test the model with accumulate_steps=1" in message


def test_a_unittest_case_reports_a_failure_not_an_error():

  class Port(unittest.TestCase):

    def test_mean(self):
      testing.assert_matches_one_device(models.model_fn(), momentum,
                                        models.batch(12), variable_device="cpu")

    def test_sum(self):
      testing.assert_matches_one_device(summed, momentum, models.batch(12),
                                        variable_device="cpu")

  result = unittest.TestResult()
  unittest.defaultTestLoader.loadTestsFromTestCase(Port).run(result)
  assert result.testsRun == 2 and not result.errors
  assert [case.id().rsplit(".", 1)[-1] for case, _ in result.failures] == [
      "test_sum"]


# It refuses what it could not compare, before running anything.

def dropout_model(scope, x, y):
  del scope
  return tf.losses.sparse_softmax_cross_entropy(
      y, _dense(tf.nn.dropout(x, rate=0.5), CLASSES, "logits"))


def ordered_model(scope, x, y):
  """Weighs each row by its place in the batch."""
  del scope
  place = tf.cast(tf.range(tf.shape(x)[0]), tf.float32)
  return tf.losses.sparse_softmax_cross_entropy(
      y, _dense(x, CLASSES, "logits"), weights=place)


@pytest.mark.parametrize("kwargs, error, words", [
    (dict(make_optimizer=momentum()), TypeError,
     "zero-argument callable returning a new optimizer"),
    (dict(make_optimizer=lambda: "sgd"), TypeError,
     "tf.compat.v1.train.Optimizer"),
    (dict(inputs=(tf.zeros([12, 6]), np.zeros(12, np.int32))), TypeError,
     "expected inputs to hold NumPy arrays"),
    (dict(inputs=(np.zeros((12, 6), np.float32), np.zeros(11, np.int32))),
     ValueError, "batch sizes (axis 0) differ: [11, 12]"),
    (dict(learning_rate=0.1), TypeError, "unexpected option 'learning_rate'"),
    (dict(devices=["/cpu:0", "/cpu:1"]), TypeError,
     "devices is set by assert_matches_one_device"),
    (dict(compute_dtype="float16"), ValueError,
     "compute_dtype='float16' cannot be compared with one device"),
    (dict(var_list=[tf.Variable(1.0)]), TypeError,
     "a name prefix or a callable"),
    (dict(accumulate_steps=5), ValueError, "5 equal micro-batches"),
    (dict(num_towers=0), ValueError, "num_towers"),
    (dict(model_fn=lambda: "net"), TypeError,
     "called as a maker of the model function"),
    (dict(model_fn=dropout_model), ValueError,
     "model_fn's loss reads random numbers (dropout/random_uniform"),
    (dict(model_fn=ordered_model), ValueError,
     "depends on the order of the rows"),
])
def test_what_cannot_be_compared_is_refused_naming_it(kwargs, error, words):
  x, y = models.batch(12)
  arguments = dict(model_fn=models.model_fn(), make_optimizer=momentum,
                   inputs=(x, y))
  arguments.update(kwargs)
  with pytest.raises(error) as raised:
    testing.assert_matches_one_device(**arguments)
  assert words in str(raised.value)


def test_one_optimizer_for_both_programs_is_refused():
  opt = tf.train.GradientDescentOptimizer(0.1)
  with pytest.raises(ValueError, match="returned the optimizer .* a second "
                     "time; return a new one on each call"):
    testing.assert_matches_one_device(models.model_fn(), lambda: opt,
                                      models.batch(12))


def test_every_option_of_minimize_is_passed_on_set_or_refused():
  names = {"var_list"} | {
      p.name for fn in (towers.minimize, towers.build_towers)
      for p in inspect.signature(fn).parameters.values()
      if p.kind == p.KEYWORD_ONLY and p.name != "variable_device"}
  names |= set(inspect.signature(
      tf.train.Optimizer.compute_gradients).parameters) - {
          "self", "loss", "grad_loss"}
  known = _matches.OPTIONS | _matches.SET_HERE | {
      name for name, _ in _matches.REFUSED}
  assert names <= known, names - known


def bias_before_batch_norm(scope, x, y):
  """A bias whose gradient batch norm cancels: zero up to rounding, which
  Adam turns into steps of up to its learning rate, either way."""
  del scope
  h = towers.batch_normalization(_dense(x, 5, "hidden"), training=True,
                                 name="bn")
  return tf.losses.sparse_softmax_cross_entropy(
      y, _dense(tf.nn.relu(h), CLASSES, "out"))


def test_adam_is_held_to_its_own_noise_not_to_a_fixed_tolerance():
  """A correct Adam port differs from one device by more than the 1e-5 a
  by-hand test would pick, as one device does from itself on permuted rows;
  the rule passes it."""
  spec = _programs.Spec(lambda: bias_before_batch_norm,
                        lambda: {None: adam()}, 3, {"variable_device": "cpu"})
  batch = models.batch(12)
  one = _programs.one_device(
      spec, batch, _compare.orders(12, _compare.PERMUTATIONS, 0))
  got = _programs.on_towers(spec, batch, 2, one.initial)
  rows = _compare.compare("cpu", one.runs[0], one.runs[1:], got.values,
                          one.eps)
  assert max(row.difference for row in rows) > 1e-5
  assert max(row.noise for row in rows) > 1e-5
  assert not [row for row in rows if row.failed]
