"""A BERT-base-sized transformer, to time how a large model's graph builds.

Written here from the architecture (Devlin et al., 2018), not copied: token,
segment and position embeddings, 12 encoder layers (self-attention of 12
heads over 768 features, a feed-forward layer of 3072 with GELU, residuals,
layer norm and dropout after each), a tanh pooler on the first token and a
2-way classifier: 109.5M parameters in 201 variables, every one made with
``tf.get_variable``, as ``tf.compat.v1.layers`` would make them. The word
embedding is read with ``tf.gather``, so its gradient is sparse
(``tf.IndexedSlices``), as in BERT's GPU code.

`build_variants` builds the whole training step (Adam, gradients clipped to
a global norm of 1, a global step) on a placeholder batch in a fresh graph,
for `benchmarks.build_time`: on one device (``opt.minimize``'s parts), with
`towers.minimize` and one copy of the variables on ``/cpu:0``, and
replicated with the ring all-reduce. No session is made.
"""

import collections
import math
from typing import Dict

import tensorflow.compat.v1 as tf

import towers
from benchmarks import build_time

Config = collections.namedtuple("Config", [
    "layers", "hidden", "heads", "intermediate", "seq_length", "vocab",
    "max_positions", "per_tower_batch"])

BERT_BASE = Config(layers=12, hidden=768, heads=12, intermediate=3072,
                   seq_length=128, vocab=30522, max_positions=512,
                   per_tower_batch=4)
# A quick run's: the same graph, small enough to build in a second.
TINY = Config(layers=2, hidden=32, heads=2, intermediate=64, seq_length=8,
              vocab=100, max_positions=16, per_tower_batch=2)

TITLE = ("BERT-base-sized transformer (%d layers, hidden %d, %d heads, "
         "seq %d), Adam, clipped to global norm 1")
DROPOUT = 0.1
LEARNING_RATE = 1e-4
CLIP_NORM = 1.0

PLAIN = "one_device"
ONE_COPY = "one_copy"
RING = "replicated_ring"
VARIANTS = (PLAIN, ONE_COPY, RING)



def title(config: Config) -> str:
  return TITLE % (config.layers, config.hidden, config.heads,
                  config.seq_length)


def _initializer():
  return tf.truncated_normal_initializer(stddev=0.02)


def _dense(x: tf.Tensor, units: int, name: str) -> tf.Tensor:
  with tf.variable_scope(name):
    kernel = tf.get_variable("kernel", [x.shape[-1], units],
                             initializer=_initializer())
    bias = tf.get_variable("bias", [units], initializer=tf.zeros_initializer())
  return tf.nn.bias_add(tf.matmul(x, kernel), bias)


def _layer_norm(x: tf.Tensor, name: str) -> tf.Tensor:
  with tf.variable_scope(name):
    gamma = tf.get_variable("gamma", [x.shape[-1]],
                            initializer=tf.ones_initializer())
    beta = tf.get_variable("beta", [x.shape[-1]],
                           initializer=tf.zeros_initializer())
  mean, variance = tf.nn.moments(x, [-1], keepdims=True)
  return (x - mean) * tf.math.rsqrt(variance + 1e-12) * gamma + beta


def _gelu(x: tf.Tensor) -> tf.Tensor:
  return 0.5 * x * (1.0 + tf.tanh(
      math.sqrt(2.0 / math.pi) * (x + 0.044715 * tf.pow(x, 3))))


def _attention(h: tf.Tensor, config: Config, batch: int) -> tf.Tensor:
  """Self-attention of `h` (``[batch * seq, hidden]``), its output layer
  not included."""
  size = config.hidden // config.heads

  def heads(name):
    t = tf.reshape(_dense(h, config.hidden, name),
                   [batch, config.seq_length, config.heads, size])
    return tf.transpose(t, [0, 2, 1, 3])

  query, key, value = heads("query"), heads("key"), heads("value")
  scores = tf.matmul(query, key, transpose_b=True) / math.sqrt(size)
  probs = tf.nn.dropout(tf.nn.softmax(scores), rate=DROPOUT)
  context = tf.transpose(tf.matmul(probs, value), [0, 2, 1, 3])
  return tf.reshape(context, [batch * config.seq_length, config.hidden])


def loss(token_ids: tf.Tensor, labels: tf.Tensor, config: Config) -> tf.Tensor:
  """The classifier's mean cross-entropy on a ``[batch, seq]`` batch."""
  batch = token_ids.shape[0]
  with tf.variable_scope("embeddings"):
    words = tf.get_variable("word_embeddings", [config.vocab, config.hidden],
                            initializer=_initializer())
    segments = tf.get_variable("token_type_embeddings", [2, config.hidden],
                               initializer=_initializer())
    positions = tf.get_variable("position_embeddings",
                                [config.max_positions, config.hidden],
                                initializer=_initializer())
    h = tf.gather(words, token_ids) + segments[0] + positions[
        :config.seq_length]
    h = tf.nn.dropout(_layer_norm(h, "LayerNorm"), rate=DROPOUT)
  h = tf.reshape(h, [batch * config.seq_length, config.hidden])
  for layer in range(config.layers):
    with tf.variable_scope("encoder/layer_%d" % layer):
      with tf.variable_scope("attention"):
        attended = _dense(_attention(h, config, batch), config.hidden,
                          "output")
        h = _layer_norm(tf.nn.dropout(attended, rate=DROPOUT) + h,
                        "output/LayerNorm")
      inner = _gelu(_dense(h, config.intermediate, "intermediate"))
      out = tf.nn.dropout(_dense(inner, config.hidden, "output"),
                          rate=DROPOUT)
      h = _layer_norm(out + h, "output/LayerNorm")
  first = tf.reshape(h, [batch, config.seq_length, config.hidden])[:, 0]
  pooled = tf.tanh(_dense(first, config.hidden, "pooler/dense"))
  logits = _dense(pooled, 2, "classifier")
  return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
      labels=labels, logits=logits))


def _batch(config: Config, num_towers: int):
  batch = config.per_tower_batch * num_towers
  return (tf.placeholder(tf.int32, [batch, config.seq_length]),
          tf.placeholder(tf.int32, [batch]))


def build_variants(config: Config) -> Dict[str, build_time.Build]:
  """Returns each variant's `Build` of the training step of `config`."""

  def one_device(num_towers, mark):
    token_ids, labels = _batch(config, num_towers)
    global_step = tf.train.get_or_create_global_step()
    mark()
    total = loss(token_ids, labels, config)
    variables = tf.trainable_variables()
    grads, _ = tf.clip_by_global_norm(tf.gradients(total, variables),
                                      CLIP_NORM)
    tf.train.AdamOptimizer(LEARNING_RATE).apply_gradients(
        zip(grads, variables), global_step=global_step)

  def on_towers(**kwargs):
    def build(num_towers, mark):
      token_ids, labels = _batch(config, num_towers)

      def model_fn(scope, token_ids, labels):
        del scope  # No summaries are kept.
        mark()
        return loss(token_ids, labels, config)

      towers.minimize(model_fn, tf.train.AdamOptimizer(LEARNING_RATE),
                      num_towers, inputs=(token_ids, labels),
                      devices=["/cpu:%d" % i for i in range(num_towers)],
                      global_step=tf.train.get_or_create_global_step(),
                      clip_norm=CLIP_NORM, **kwargs)
    return build

  return {PLAIN: one_device, ONE_COPY: on_towers(),
          RING: on_towers(variable_device="replicated", all_reduce="ring")}
