"""The graph-mode variants: one device, `towers`, and the original averaging.

Every variant gets its own ``tf.Graph`` and ``tf.Session`` with the same
``towers.virtual_cpu_config(num_devices)``, so all of them see the same
devices and share the process's thread pools; the same synthetic global batch
sits in non-trainable variables on ``/cpu:0``, so no input pipeline is timed.
"""

import time
from typing import List

import numpy as np
import tensorflow.compat.v1 as tf

import towers
from benchmarks import original
from benchmarks import workloads

PLAIN = "plain"
TOWERS = "towers"
BALANCED = "towers_balanced"
ORIGINAL = "original"
MIRRORED = "mirrored"
# In the order tables and charts list them.
VARIANTS = (PLAIN, TOWERS, BALANCED, ORIGINAL, MIRRORED)
TITLES = {
    PLAIN: "plain (one device, opt.minimize)",
    TOWERS: "towers (variables on /cpu:0)",
    BALANCED: "towers (variable_device='balanced')",
    ORIGINAL: "original average_gradients",
    MIRRORED: "MirroredStrategy (TF2, tf.function)",
}

# The examples' optimizer. The rate is small so that random labels never
# drive the loss to NaN, whose slow paths would distort the timing.
LEARNING_RATE = 0.01
MOMENTUM = 0.9


class GraphStep:
  """One graph variant, built, initialized and ready to time.

  Attributes:
    num_ops: the operations in the variant's graph.
  """

  def __init__(self, workload: workloads.Workload, variant: str,
               num_towers: int, batch: np.ndarray, labels: np.ndarray,
               num_devices: int):
    """Builds the variant's training step in a graph of its own.

    Args:
      workload: the model.
      variant: `PLAIN`, `TOWERS`, `BALANCED` or `ORIGINAL`.
      num_towers: the number of towers (1 for `PLAIN`).
      batch: the global batch of images, ``[batch_size, ...]``.
      labels: the global batch's labels, ``[batch_size]``.
      num_devices: the virtual CPU devices of the session (the largest
        number of towers of the run, so that every variant sees the same).

    Raises:
      ValueError: if `variant` is not a graph variant.
    """
    self._graph = tf.Graph()
    with self._graph.as_default():
      tf.set_random_seed(0)
      train_op = _build(workload, variant, num_towers, batch, labels)
      init = tf.global_variables_initializer()
      self.num_ops = len(self._graph.get_operations())
    self._graph.finalize()
    self._train_op = train_op
    self._session = tf.Session(graph=self._graph,
                               config=session_config(num_devices))
    self._session.run(init)

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
  the MirroredStrategy workers) share the GPUs.
  """
  return towers.virtual_cpu_config(
      num_devices, gpu_options=tf.GPUOptions(allow_growth=True))


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


def _build(workload: workloads.Workload, variant: str, num_towers: int,
           batch: np.ndarray, labels: np.ndarray) -> tf.Operation:
  images, labels = _data_on_cpu(batch, labels)
  global_step = tf.train.get_or_create_global_step()
  opt = tf.train.MomentumOptimizer(LEARNING_RATE, MOMENTUM)
  devices = towers.tower_devices(num_towers)

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
  if variant == ORIGINAL:
    return original.minimize(model_fn, opt, num_towers,
                             inputs=(images, labels), devices=devices,
                             global_step=global_step)
  raise ValueError("expected a graph variant (%s), got %r"
                   % (", ".join((PLAIN, TOWERS, BALANCED, ORIGINAL)), variant))
