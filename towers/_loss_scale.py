"""Loss scaling: each tower's loss scaled up, the averaged gradients down once.

Small float16 gradients underflow to zero. Multiplying each tower's loss by
the loss scale before its gradients scales every intermediate gradient too;
after the towers' gradients are averaged, they are divided by the scale
once, on the device that holds them (each copy's on its own), and checked
finite there. Only one boolean per device crosses to the step: a step whose
gradients are not all finite applies nothing (no variable, copy, slot or
``global_step`` changes). The dynamic scale halves after such a step and
doubles after `GROWTH_STEPS` finite ones in a row (the defaults of
TensorFlow's ``DynamicLossScale``); it is a saved variable, so a resumed run
goes on with the scale it had.

TensorFlow's ``MixedPrecisionLossScaleOptimizer`` does the same inside the
optimizer, but it unscales in every tower and checks every replicated copy's
gradients wherever its ops land, which moves each copy's gradients across
devices; here the check stays where the gradients are.
"""

from typing import Callable, Dict, List, Optional, Tuple, Union

import tensorflow.compat.v1 as tf

from towers import _gradients
from towers import _tf_versions

LossScaleSpec = Union[None, str, float]

DYNAMIC = "dynamic"
INITIAL_SCALE = 2.0 ** 15
GROWTH_STEPS = 2000


def is_loss_scale_optimizer(opt: object) -> bool:
  return isinstance(opt, _tf_versions.loss_scale_optimizers())


def check(loss_scale: LossScaleSpec, opt: object,
          compute_dtype: Optional[tf.DType]) -> LossScaleSpec:
  """Returns what `minimize` scales by: ``'dynamic'``, a number or None.

  The default (None) is ``'dynamic'`` for float16 towers whose optimizer
  does not scale already, and no scaling otherwise (bfloat16 has float32's
  range).

  Raises:
    ValueError: for an unknown or non-positive scale, a scale on top of a
      loss-scale optimizer, or a scale with ``SyncReplicasOptimizer``.
  """
  if loss_scale is None:
    if compute_dtype != tf.float16 or is_loss_scale_optimizer(opt):
      return None
    loss_scale = DYNAMIC
  elif loss_scale != DYNAMIC and (
      isinstance(loss_scale, bool) or
      not isinstance(loss_scale, (int, float)) or not loss_scale > 0):
    raise ValueError(
        "expected loss_scale to be 'dynamic', a positive number or None, "
        "got %r" % (loss_scale,))
  elif is_loss_scale_optimizer(opt):
    raise ValueError(
        "opt is a MixedPrecisionLossScaleOptimizer, which scales the loss "
        "already, and loss_scale=%r would scale it twice: pass the inner "
        "optimizer with loss_scale, or drop loss_scale" % (loss_scale,))
  if isinstance(opt, tf.train.SyncReplicasOptimizer):
    raise ValueError(
        "loss_scale=%r skips the steps whose gradients overflow, but "
        "SyncReplicasOptimizer needs every worker's gradients in every step; "
        "drop loss_scale (or use compute_dtype='bfloat16', which needs no "
        "scaling)" % (loss_scale,))
  return loss_scale


class ScaledGradients:
  """`opt`, with ``compute_gradients`` taking the scaled loss's gradients.

  What `minimize` hands `build_towers`, so that each tower differentiates
  its loss times the scale; everything else is `opt`'s.
  """

  def __init__(self, opt: tf.train.Optimizer, scale: "LossScale"):
    self._opt = opt
    self._scale = scale

  def compute_gradients(self, loss, *args, **kwargs):
    return self._opt.compute_gradients(self._scale.scale_loss(loss), *args,
                                       **kwargs)

  def __getattr__(self, name):
    return getattr(self._opt, name)


class LossScale:
  """The loss scale of one training step: its value, unscaling, the apply."""

  def __init__(self, spec: Union[str, float]):
    if spec == DYNAMIC:
      # Created outside any tower: saved, and placed by the caller's device
      # scope (a replica_device_setter puts them on a ps task).
      self._scale = tf.Variable(INITIAL_SCALE, trainable=False,
                                name="loss_scale", dtype=tf.float32)
      self._good_steps = tf.Variable(0.0, trainable=False,
                                     name="loss_scale_good_steps",
                                     dtype=tf.float32)
      # Read once: the towers, the unscaling and the update all see the
      # value the step started with.
      self.value = self._scale.read_value()
    else:
      self._scale = None
      self.value = tf.constant(float(spec), tf.float32, name="loss_scale")

  def scale_loss(self, loss: tf.Tensor) -> tf.Tensor:
    """`loss` times the scale, in float32 (float64 for a float64 loss).

    A float16 loss is widened first: times 2**15 it would overflow above 2.
    """
    wide = tf.float64 if loss.dtype.base_dtype == tf.float64 else tf.float32
    return tf.cast(loss, wide) * tf.cast(self.value, wide)

  def unscale(self, grads_and_vars: _gradients.GradsAndVars
              ) -> Tuple[_gradients.GradsAndVars, tf.Tensor]:
    """Divides the averaged gradients by the scale; checks them finite.

    Each gradient is unscaled and checked next to itself, the checks of one
    device are reduced there, and the devices' booleans are combined. Copy
    0's pairs stand for every copy: `apply_gradients` unscales the others
    on their own devices, and their gradients are bitwise copy 0's.

    Returns:
      ``(grads_and_vars, finite)``: the unscaled pairs, and a scalar bool,
      whether all of them are finite.
    """
    checks: Dict[str, List[tf.Tensor]] = {}
    inverse = 1.0 / self.value
    result = [(None if grad is None else _unscale(grad, inverse, checks), var)
              for grad, var in grads_and_vars]
    flags = []
    for device, device_checks in checks.items():
      with tf.device(device):
        flags.append(tf.reduce_all(tf.stack(device_checks)))
    with tf.name_scope("loss_scale"):
      finite = tf.reduce_all(tf.stack(flags)) if flags else tf.constant(True)
    return result, finite

  def apply(self, finite: tf.Tensor,
            apply_fn: Callable[[], tf.Operation]) -> tf.Operation:
    """Runs `apply_fn`'s op only if `finite`; then updates a dynamic scale."""
    with tf.name_scope("loss_scale"):

      def apply_step():
        with tf.control_dependencies([apply_fn()]):
          return tf.constant(True)

      applied = tf.cond(finite, apply_step, lambda: tf.constant(False))
      if self._scale is None:
        return applied.op
      with tf.control_dependencies([applied]):
        return tf.group(*self._update(finite), name="update")

  def _update(self, finite: tf.Tensor) -> List[tf.Operation]:
    good = tf.where(finite, self._good_steps.read_value() + 1.0, 0.0)
    grow = tf.logical_and(finite, good >= GROWTH_STEPS)
    scale = tf.where(grow, self.value * 2.0, tf.where(
        finite, self.value, tf.maximum(self.value * 0.5, 1.0)))
    good = tf.where(grow, 0.0, good)
    return [self._scale.assign(scale).op, self._good_steps.assign(good).op]


def _unscale(grad: _gradients.Gradient, inverse: tf.Tensor,
             checks: Dict[str, List[tf.Tensor]]) -> _gradients.Gradient:
  values = grad.values if isinstance(grad, tf.IndexedSlices) else grad
  with tf.device(values.device), tf.name_scope("unscale"):
    values = values * tf.cast(inverse, values.dtype)
    checks.setdefault(values.device, []).append(
        tf.reduce_all(tf.is_finite(values)))
  if isinstance(grad, tf.IndexedSlices):
    return tf.IndexedSlices(values, grad.indices, grad.dense_shape)
  return values
