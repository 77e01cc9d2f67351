"""The original tutorial's gradient averaging, as the baseline to beat.

Written here from the recipe's description (docs/design.md, "Synchronization"
and the shared reference): per variable, each tower's gradient gets a leading
axis of 1 (``expand_dims``), the towers' are concatenated on that axis into
one ``[num_towers, ...]`` buffer, and ``reduce_mean`` over axis 0 gives the
average, paired with the first tower's variable. The original builds it, like
everything outside the towers, under ``tf.device('/cpu:0')``.

Benchmark code only: it crashes on None gradients and densifies sparse ones,
which is why `towers.average_gradients` exists. The benchmarked models have
neither.
"""

from typing import Sequence

import tensorflow.compat.v1 as tf

import towers
from towers import GradsAndVars


def average_gradients(tower_grads: Sequence[GradsAndVars]) -> GradsAndVars:
  """Averages each variable's gradient over the towers, the original way.

  Args:
    tower_grads: ``[num_towers][num_vars]`` of ``(grad, var)``, dense
      gradients only, every tower's list in the same variable order.

  Returns:
    ``[num_vars]`` of ``(mean gradient, first tower's variable)``.
  """
  averaged = []
  for pairs in zip(*tower_grads):
    stacked = tf.concat([tf.expand_dims(grad, 0) for grad, _ in pairs], 0)
    averaged.append((tf.reduce_mean(stacked, 0), pairs[0][1]))
  return averaged


def minimize(model_fn, opt: tf.train.Optimizer, num_towers: int, *,
             inputs, devices: Sequence[str],
             global_step: tf.Variable) -> tf.Operation:
  """Returns the original's training step on the same towers as `towers`.

  The towers are `towers.build_towers`' (same placement, same input split,
  same ``compute_gradients`` arguments), so only the averaging differs: the
  original's, on ``/cpu:0``, with no barrier, then one ``apply_gradients``.
  """
  built = towers.build_towers(model_fn, opt, num_towers, inputs=inputs,
                              devices=list(devices), variable_device="cpu")
  with tf.device("/cpu:0"):
    grads_and_vars = average_gradients(built.tower_grads)
    return opt.apply_gradients(grads_and_vars, global_step=global_step)
