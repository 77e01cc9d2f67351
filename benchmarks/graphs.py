"""The graph-mode variants: one device, `towers`, and the original averaging.

Every variant gets its own ``tf.Graph`` and ``tf.Session`` with the same
``towers.virtual_cpu_config(num_devices)``, so all of them see the same
devices and share the process's thread pools; the same synthetic global batch
sits in non-trainable variables on ``/cpu:0``, so no input pipeline is timed.
Each variant also counts, in one untimed step, the bytes and tensors that
cross between its devices (`benchmarks.traffic`).
"""

import time
from typing import List

import numpy as np
import tensorflow.compat.v1 as tf

import towers
from benchmarks import original
from benchmarks import traffic
from benchmarks import workloads

PLAIN = "plain"
TOWERS = "towers"
BALANCED = "towers_balanced"
REPLICATED_ADD_N = "replicated_add_n"
REPLICATED_RING = "replicated_ring"
REPLICATED_COLLECTIVE = "replicated_collective"
INDEPENDENT = "independent"
ORIGINAL = "original"
MIRRORED = "mirrored"
# In the order tables and charts list them.
VARIANTS = (PLAIN, TOWERS, BALANCED, REPLICATED_ADD_N, REPLICATED_RING,
            REPLICATED_COLLECTIVE, INDEPENDENT, ORIGINAL, MIRRORED)
REPLICATED = {REPLICATED_ADD_N: "add_n", REPLICATED_RING: "ring",
              REPLICATED_COLLECTIVE: "collective"}
TITLES = {
    PLAIN: "plain (one device, opt.minimize)",
    TOWERS: "towers (variables on /cpu:0)",
    BALANCED: "towers (variable_device='balanced')",
    REPLICATED_ADD_N: "towers (replicated, all_reduce='add_n')",
    REPLICATED_RING: "towers (replicated, all_reduce='ring')",
    REPLICATED_COLLECTIVE: "towers (replicated, all_reduce='collective')",
    INDEPENDENT: "independent (a copy per tower, nothing exchanged)",
    ORIGINAL: "original average_gradients",
    MIRRORED: "MirroredStrategy (TF2, tf.function)",
}
# How each graph variant's parameters should cross devices
# (`traffic.expected`): through the device each variable lives on (its one
# copy, or copy 0 where the add_n sum runs), around a ring, or not at all.
PATTERNS = {
    PLAIN: traffic.STAR, TOWERS: traffic.STAR, BALANCED: traffic.STAR,
    ORIGINAL: traffic.STAR, REPLICATED_ADD_N: traffic.STAR,
    REPLICATED_RING: traffic.RING, REPLICATED_COLLECTIVE: traffic.RING,
    INDEPENDENT: traffic.NONE,
}
# A collective waiting for a member that never comes would hang the run:
# every graph session fails a step that takes longer than this instead (a
# step takes under a second here; a first step on GPUs, autotuning, longer).
STEP_TIMEOUT_MS = 120 * 1000

# The examples' optimizer. The rate is small so that random labels never
# drive the loss to NaN, whose slow paths would distort the timing.
LEARNING_RATE = 0.01
MOMENTUM = 0.9


class GraphStep:
  """One graph variant, built, initialized and ready to time.

  Attributes:
    num_ops: the operations in the variant's graph.
    traffic: what crosses between devices in one step, measured and
      expected (`traffic.summarize`).
  """

  def __init__(self, workload: workloads.Workload, variant: str,
               num_towers: int, batch: np.ndarray, labels: np.ndarray,
               num_devices: int):
    """Builds the variant's training step in a graph of its own.

    Initializes the global variables, then the local ones (the replicated
    copies, set from copy 0), and runs one untimed step that counts the
    traffic.

    Args:
      workload: the model.
      variant: a graph variant (any of `VARIANTS` but `MIRRORED`).
      num_towers: the number of towers (1 for `PLAIN`).
      batch: the global batch of images, ``[batch_size, ...]``.
      labels: the global batch's labels, ``[batch_size]``.
      num_devices: the virtual CPU devices of the session (the largest
        number of towers of the run, so that every variant sees the same).

    Raises:
      ValueError: if `variant` is not a graph variant.
    """
    self._graph = tf.Graph()
    devices = towers.tower_devices(num_towers)
    with self._graph.as_default():
      tf.set_random_seed(0)
      data = _data_on_cpu(batch, labels)
      train_op = _build(workload, variant, devices, *data)
      init = tf.global_variables_initializer()
      self.num_ops = len(self._graph.get_operations())
      local_init = tf.local_variables_initializer()
      trainable = tf.trainable_variables()
      # The copies (and their slots) are local variables.
      parameters = trainable + tf.local_variables()
    self._graph.finalize()
    self._train_op = train_op
    self._session = tf.Session(graph=self._graph,
                               config=session_config(num_devices))
    self._session.run(init)
    # Apart: the copies' initializers read copy 0, which must be set first.
    self._session.run(local_init)
    measured = traffic.measure(self._session, train_op, self._graph,
                               parameters, data)
    expectation = traffic.expected(
        PATTERNS[variant], [(v.device, _bytes(v)) for v in trainable],
        devices)
    self.traffic = traffic.summarize(
        measured, expectation,
        parameter_bytes=sum(_bytes(v) for v in trainable))

  def run(self, steps: int) -> List[float]:
    """Runs `steps` training steps; returns each one's wall time (s)."""
    times = []
    for _ in range(steps):
      start = time.perf_counter()
      self._session.run(self._train_op)
      times.append(time.perf_counter() - start)
    return times

  def close(self) -> None:
    self._session.close()


def session_config(num_devices: int) -> tf.ConfigProto:
  """Returns every variant's session config: the same devices for all.

  On GPUs, memory grows as needed, since several variants' sessions (and
  the MirroredStrategy workers) share the GPUs. A step that takes longer
  than `STEP_TIMEOUT_MS` fails (DeadlineExceeded) rather than hanging.
  """
  return towers.virtual_cpu_config(
      num_devices, gpu_options=tf.GPUOptions(allow_growth=True),
      operation_timeout_in_ms=STEP_TIMEOUT_MS)


def _bytes(var: tf.Variable) -> int:
  return var.shape.num_elements() * var.dtype.base_dtype.size


def _data_on_cpu(images: np.ndarray, labels: np.ndarray):
  """Returns the global batch as reads of non-trainable CPU variables."""
  # Variables, not constants fed each step: the batch is copied into the
  # graph's memory once, at initialization, and each step only reads it.
  with tf.device("/cpu:0"), tf.variable_scope("synthetic_data"):
    image_var = tf.get_variable("images", initializer=tf.constant(images),
                                trainable=False)
    label_var = tf.get_variable("labels", initializer=tf.constant(labels),
                                trainable=False)
    return image_var.value(), label_var.value()


def _build(workload: workloads.Workload, variant: str, devices: List[str],
           images: tf.Tensor, labels: tf.Tensor) -> tf.Operation:
  global_step = tf.train.get_or_create_global_step()
  opt = tf.train.MomentumOptimizer(LEARNING_RATE, MOMENTUM)
  num_towers = len(devices)

  def model_fn(scope, images, labels):
    del scope  # No summaries are kept.
    return workload.loss_fn(images, labels)

  if variant == PLAIN:
    # What a single-device user writes: the model on one device, with its
    # variables, and opt.minimize.
    with tf.device(devices[0]):
      return opt.minimize(workload.loss_fn(images, labels),
                          global_step=global_step)
  if variant in (TOWERS, BALANCED):
    train_op, _ = towers.minimize(
        model_fn, opt, num_towers, inputs=(images, labels), devices=devices,
        variable_device="balanced" if variant == BALANCED else "cpu",
        global_step=global_step)
    return train_op
  if variant in REPLICATED:
    train_op, _ = towers.minimize(
        model_fn, opt, num_towers, inputs=(images, labels), devices=devices,
        variable_device="replicated", all_reduce=REPLICATED[variant],
        global_step=global_step)
    return train_op
  if variant == INDEPENDENT:
    # tf_cnn_benchmarks' upper bound for split compute: each tower's own
    # gradient, unreduced, updates its own copy; nothing is exchanged.
    built = towers.build_towers(model_fn, opt, num_towers,
                                inputs=(images, labels), devices=devices,
                                variable_device="replicated")
    return opt.apply_gradients(
        [pair for tower in built.tower_grads for pair in tower],
        global_step=global_step)
  if variant == ORIGINAL:
    return original.minimize(model_fn, opt, num_towers,
                             inputs=(images, labels), devices=devices,
                             global_step=global_step)
  raise ValueError("expected a graph variant (%s), got %r"
                   % (", ".join(v for v in VARIANTS if v != MIRRORED),
                      variant))
