"""Synchronized batch norm against per-tower batch norm: the price of exactness.

`towers.batch_normalization` normalizes with the global batch's statistics:
each layer sums a vector of ``1 + 2C`` floats (the shard's count, its sum and
its sum of squares over C channels) across the towers, and one of ``2C`` in
the gradient (the sums of ``dy`` and ``dy * xhat``): between GPUs one
collective per tower each time (NCCL), between CPU devices a sum on the
first tower's device that every tower reads. Per-tower batch norm
(``tf.compat.v1.layers.batch_normalization``) normalizes each shard alone and
moves nothing. This times the same model both ways, trained with
`towers.minimize` (variables on ``/cpu:0``, the library's defaults
otherwise), in interleaved rounds: the ratio of their step times is what
exactness costs.

The model (`model`) is a CIFAR-sized ResNet-ish CNN, 32x32x3 inputs: a 3x3
convolution of 16 filters, a residual block of two 16-filter convolutions, a
strided 32-filter convolution, a residual block of two 32-filter
convolutions, global average pooling and a dense softmax layer. Each
convolution (no bias) is followed by batch norm (``training=True``), so 6
batch-norm layers of 16, 16, 16, 32, 32 and 32 channels (`BN_CHANNELS`).

On TensorFlow >= 2.16, ``tf.compat.v1.layers`` comes from tf_keras under
``TF_USE_LEGACY_KERAS=1``, which `benchmarks.run` sets when tf_keras is
installed. Where the layers are still unavailable, the per-tower rows use
`fused_batch_norm`, what ``tf.layers`` runs for 4-D inputs, and the report
says so (`per_tower_layer`).

What the sums move is predicted from the layer shapes alone (`expected`)
and measured from the partition graphs of one step (`benchmarks.traffic`),
as what the synchronized step moves between devices beyond the per-tower
one (`sum_bytes`). The targets are in `benchmarks.report`.
"""

from typing import Callable, Dict, Optional, Sequence, Tuple

import tensorflow.compat.v1 as tf

import towers
from benchmarks import graphs
from benchmarks import report
from benchmarks import traffic
from benchmarks import workloads

SYNC = "sync"
PER_TOWER = "per_tower"
VARIANTS = (SYNC, PER_TOWER)
# The per-tower layer: tf.layers', or the fallback where it is unavailable.
LAYERS = "tf.compat.v1.layers.batch_normalization"
FUSED = "tf.nn.fused_batch_norm"

IMAGE_SHAPE = [32, 32, 3]
TITLE = ("ResNet-ish CIFAR CNN (32x32x3, 6 convolutions and a dense layer, "
         "6 batch-norm layers)")
# Each 3x3 convolution's (filters, stride), in order (`model`); a batch norm
# follows each one.
CONVOLUTIONS = ((16, 1), (16, 1), (16, 1), (32, 2), (32, 1), (32, 1))
BN_CHANNELS = tuple(filters for filters, _ in CONVOLUTIONS)
# tf.layers' defaults, which the fallback follows.
MOMENTUM = 0.99
EPSILON = 1e-3
FLOAT_BYTES = 4

BatchNorm = Callable[[tf.Tensor, str], tf.Tensor]


def sync_batch_norm(x: tf.Tensor, name: str) -> tf.Tensor:
  """The synchronized layer: the global batch's statistics in towers."""
  return towers.batch_normalization(x, training=True, name=name)


def fused_batch_norm(x: tf.Tensor, name: str) -> tf.Tensor:
  """Per-tower batch norm of a 4-D NHWC tensor, as ``tf.layers`` computes it.

  The fallback where ``tf.compat.v1.layers`` is unavailable: the same
  variables (``gamma``, ``beta``, ``moving_mean``, ``moving_variance``), the
  fused kernel over the shard alone, and the moving averages' updates
  (``moving -= (moving - batch) * (1 - momentum)``, with the kernel's
  unbiased variance) in ``tf.GraphKeys.UPDATE_OPS``.
  """
  channels = x.shape[-1]
  with tf.variable_scope(name):
    gamma = tf.get_variable("gamma", [channels],
                            initializer=tf.ones_initializer())
    beta = tf.get_variable("beta", [channels],
                           initializer=tf.zeros_initializer())
    moving_mean = tf.get_variable("moving_mean", [channels],
                                  initializer=tf.zeros_initializer(),
                                  trainable=False)
    moving_variance = tf.get_variable("moving_variance", [channels],
                                      initializer=tf.ones_initializer(),
                                      trainable=False)
    y, mean, variance = tf.nn.fused_batch_norm(x, gamma, beta,
                                               epsilon=EPSILON,
                                               is_training=True)
    for var, value in ((moving_mean, mean), (moving_variance, variance)):
      with tf.name_scope("AssignMovingAvg"):
        delta = (tf.convert_to_tensor(var) - value) * (1.0 - MOMENTUM)
        tf.add_to_collection(tf.GraphKeys.UPDATE_OPS,
                             tf.assign_sub(var, delta))
  return y


def per_tower_layer() -> Tuple[str, BatchNorm, Optional[str]]:
  """Returns the per-tower layer: ``(name, layer, why not tf.layers)``.

  ``tf.compat.v1.layers.batch_normalization`` where it is available (the
  reason is then None); else `fused_batch_norm`, with the reason.
  """
  try:
    layer = tf.layers.batch_normalization
  except (AttributeError, ImportError) as e:
    why = (str(e).splitlines() or [type(e).__name__])[0]
    reason = ("%s is unavailable in this process (%s); on TensorFlow >= "
              "2.16 it needs tf_keras and TF_USE_LEGACY_KERAS=1 set before "
              "TensorFlow is imported" % (LAYERS, why))
    return FUSED, fused_batch_norm, reason

  def batch_norm(x: tf.Tensor, name: str) -> tf.Tensor:
    return layer(x, training=True, name=name)

  return LAYERS, batch_norm, None


def _conv(x: tf.Tensor, filters: int, stride: int, name: str) -> tf.Tensor:
  with tf.variable_scope(name):
    kernel = tf.get_variable(
        "kernel", [3, 3, x.shape[-1], filters],
        initializer=tf.variance_scaling_initializer(2.0))
  return tf.nn.conv2d(x, kernel, [1, stride, stride, 1], padding="SAME")


def model(batch_norm: BatchNorm, name: str, title: str) -> workloads.Workload:
  """Returns the benchmarked CNN with `batch_norm` after each convolution.

  Args:
    batch_norm: ``batch_norm(x, name) -> tensor``, a training-mode layer.
    name: the workload's key in results.
    title: its title.
  """

  def conv_bn(h: tf.Tensor, k: int) -> tf.Tensor:
    filters, stride = CONVOLUTIONS[k]
    return batch_norm(_conv(h, filters, stride, "conv_%d" % k), "bn_%d" % k)

  def loss_fn(images: tf.Tensor, labels: tf.Tensor) -> tf.Tensor:
    h = tf.nn.relu(conv_bn(images, 0))
    # Two residual blocks, the second after a strided convolution.
    h = tf.nn.relu(h + conv_bn(tf.nn.relu(conv_bn(h, 1)), 2))
    h = tf.nn.relu(conv_bn(h, 3))
    h = tf.nn.relu(h + conv_bn(tf.nn.relu(conv_bn(h, 4)), 5))
    pooled = tf.reduce_mean(h, [1, 2])
    with tf.variable_scope("logits"):
      weights = tf.get_variable(
          "weights", [pooled.shape[-1], workloads.NUM_CLASSES],
          initializer=tf.glorot_uniform_initializer())
      biases = tf.get_variable("biases", [workloads.NUM_CLASSES],
                               initializer=tf.zeros_initializer())
    logits = tf.matmul(pooled, weights) + biases
    return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
        labels=labels, logits=logits), name="total_loss")

  return workloads.Workload(name, title, list(IMAGE_SHAPE), loss_fn)


def expected(num_towers: int, channels: Sequence[int] = BN_CHANNELS,
             collective: bool = False) -> Dict[str, float]:
  """Returns what the synchronized layers' sums move per step.

  Each layer of C channels sums ``1 + 2C`` floats across the towers forward
  and ``2C`` in the gradient. With `collective` (GPUs), one collective op
  per tower each time, a ring: each device sends and receives ``2(N-1)/N``
  of a summed vector. Else the towers' vectors go to the first tower's
  device and the sum comes back: ``2(N-1)`` vectors through that device,
  2 through each other. With one tower nothing is summed.

  Args:
    num_towers: N.
    channels: each batch-norm layer's channels.
    collective: whether the towers' devices are GPUs (the library's rule).

  Returns:
    ``sums_per_device`` (sums each tower takes part in per step),
    ``collectives`` (collective ops per step, all devices),
    ``summed_bytes_per_device`` (the vectors each device contributes) and
    ``busiest_bytes`` (sent plus received by the busiest device).
  """
  if num_towers < 2:
    return {"sums_per_device": 0, "collectives": 0,
            "summed_bytes_per_device": 0, "busiest_bytes": 0.0}
  summed = sum(1 + 4 * c for c in channels) * FLOAT_BYTES
  busiest = (4.0 * (num_towers - 1) / num_towers if collective
             else 2.0 * (num_towers - 1)) * summed
  return {"sums_per_device": 2 * len(channels),
          "collectives": 2 * len(channels) * num_towers if collective else 0,
          "summed_bytes_per_device": summed, "busiest_bytes": busiest}


def sum_bytes(sync: graphs.GraphStep,
              alone: graphs.GraphStep) -> Dict[str, float]:
  """Returns device -> the bytes the sums move through it per step: what
  the synchronized step sends and receives beyond the per-tower one (the
  same model, variables and devices otherwise)."""
  moved = {}
  for device, fields in sync.traffic["devices"].items():
    other = alone.traffic["devices"].get(device)
    moved[device] = traffic.through(fields) - (
        traffic.through(other) if other else 0)
  return moved


def on_gpus(num_towers: int) -> bool:
  """Whether the towers run on GPUs, where the sums are collectives."""
  return all(tf.DeviceSpec.from_string(d).device_type == "GPU"
             for d in towers.tower_devices(num_towers))


def build(*, tower_counts: Sequence[int], global_batch: int, num_devices: int,
          per_tower: Optional[Tuple[str, BatchNorm, Optional[str]]] = None
         ) -> Dict[Tuple[int, str], graphs.GraphStep]:
  """Builds the synchronized and the per-tower step at every tower count.

  Args:
    tower_counts: the towers of each pair.
    global_batch: the global batch, split over the towers.
    num_devices: the session's virtual CPU devices (`graphs.GraphStep`).
    per_tower: `per_tower_layer`'s result; None asks it.

  Returns:
    ``(towers, SYNC or PER_TOWER)`` -> its step, ready to time.
  """
  name, layer, _ = per_tower or per_tower_layer()
  variants = {SYNC: model(sync_batch_norm, "bn_sync",
                          TITLE + ", towers.batch_normalization"),
              PER_TOWER: model(layer, "bn_per_tower", TITLE + ", " + name)}
  images, labels = workloads.synthetic_batch(variants[SYNC], global_batch)
  return {(n, variant): graphs.GraphStep(variants[variant], graphs.TOWERS, n,
                                         images, labels, num_devices)
          for n in tower_counts for variant in VARIANTS}


def _side(step: graphs.GraphStep, seconds: Sequence[float],
          global_batch: int) -> Dict[str, object]:
  return {**report.timed_graph(seconds, global_batch, step.num_ops),
          "collectives": step.traffic["collectives"]}


def result(steps: Dict[Tuple[int, str], graphs.GraphStep],
           times: Dict[Tuple[int, str], Sequence[float]], *,
           global_batch: int, per_tower: str, per_tower_reason: Optional[str],
           rounds_info: Dict[str, object]) -> Dict[str, object]:
  """Returns the comparison's rows: per tower count, both steps and ratio.

  The ratio is the synchronized median step time over the per-tower one
  (above 1: synchronization costs), with its 95% bootstrap interval
  (`report.ratio_interval`).
  """
  rows = []
  for n in sorted({n for n, _ in steps}):
    sync = _side(steps[(n, SYNC)], times[(n, SYNC)], global_batch)
    alone = _side(steps[(n, PER_TOWER)], times[(n, PER_TOWER)], global_batch)
    rows.append({
        "num_towers": n, SYNC: sync, PER_TOWER: alone,
        "step_time_ratio": sync["median_step_sec"] / alone["median_step_sec"],
        # The per-tower speed over the synchronized one: the step-time ratio.
        "ratio_interval": list(report.ratio_interval(alone, sync)),
        "sum_bytes": sum_bytes(steps[(n, SYNC)], steps[(n, PER_TOWER)]),
        "expected": expected(n, collective=on_gpus(n))})
  return {"title": TITLE, "global_batch": global_batch,
          "bn_channels": list(BN_CHANNELS), "per_tower": per_tower,
          "per_tower_reason": per_tower_reason, "variable_device": "cpu",
          "rows": rows, "rounds": rounds_info}
