"""The whole step: build the towers, average, clip, apply once."""

from typing import Callable, Dict, List, Optional, Sequence, Tuple

import tensorflow.compat.v1 as tf

from towers import _accumulate
from towers import _apply
from towers import _gradients
from towers import _losses
from towers import _loss_scale
from towers import _packing
from towers import _precision
from towers import _build


def minimize(model_fn: Callable[..., object],
             opt: tf.train.Optimizer,
             num_gpus: int,
             *,
             global_step: Optional[tf.Variable] = None,
             clip_norm: Optional[float] = None,
             average_device: Optional[str] = None,
             pack_bytes: int = _packing.DEFAULT_PACK_BYTES,
             loss_scale: _loss_scale.LossScaleSpec = None,
             accumulate_steps: int = 1,
             **build_towers_kwargs) -> Tuple[tf.Operation, _build.Towers]:
  """Builds the towers and one synchronous training step over all of them.

  The tutorial's step in one call: `build_towers`, `average_gradients` with
  the towers' weights (also waiting for the update ops and the losses), an
  optional clip by global norm, then `apply_gradients`; with
  `accumulate_steps`, through `accumulate_gradients`. With a dict of losses
  and of optimizers, one such step per loss. See docs/api.md.

  Args:
    model_fn: as for `build_towers`.
    opt: a ``tf.compat.v1.train.Optimizer``, or a dict of them by loss.
    num_gpus: the number of towers.
    global_step: incremented by one per applied update (the last loss's).
    clip_norm: if set, the global norm the averaged gradients are clipped to.
    average_device: `average_gradients`' `device`.
    pack_bytes: `average_gradients`' `pack_bytes`.
    loss_scale: ``'dynamic'``, a positive number, or None (dynamic for
      float16 towers): steps whose gradients are not finite apply nothing.
    accumulate_steps: micro-batches per update: each run of the train op
      runs one, every k-th also applies the update of all k together.
    **build_towers_kwargs: passed to `build_towers`.

  Returns:
    ``(train_op, towers)`` (a dict of train ops by loss), with
    ``towers.grads_and_vars`` the pairs applied and ``towers.applies``.

  Raises:
    ValueError: for a bad `clip_norm`, `loss_scale` or `accumulate_steps`,
      no gradient at all, or as `build_towers` and `average_gradients` do.
    TypeError: as `build_towers` and `average_gradients` do.
  """
  if clip_norm is not None and not clip_norm > 0:
    raise ValueError("expected clip_norm to be a positive number or None, got "
                     "%r" % (clip_norm,))
  opts = _losses.optimizers(opt)
  keys = list(opts)
  steps = _accumulate.check_steps(accumulate_steps)
  if steps > 1 and len(keys) > 1:
    raise ValueError(
        "accumulate_steps=%d with several losses (%s) is not supported: each "
        "loss's train op would accumulate its own runs; train with "
        "accumulate_steps=1, or one loss" % (steps, ", ".join(map(repr, keys))))
  scales = _loss_scales(opts, loss_scale, steps,
                        build_towers_kwargs.get("compute_dtype"))
  scaled: Dict[_losses.Key, object] = {}
  for key, each in opts.items():
    scale = scales[key]
    scaled[key] = each if scale is None else _loss_scale.ScaledGradients(
        each, scale)
  towers = _build.build_towers(model_fn, _losses.unwrap(scaled), num_gpus,
                               **build_towers_kwargs)
  tower_grads = _losses.keyed(towers.tower_grads, keys)
  _check_gradients(tower_grads)
  losses = _losses.keyed(towers.losses, keys)
  update_ops = _losses.keyed(towers.update_ops, keys)
  applied: Dict[_losses.Key, _gradients.GradsAndVars] = {}
  train_ops: Dict[_losses.Key, tf.Operation] = {}
  applies = tf.constant(True, name="applies")
  for key in keys:
    # The last loss's step counts the global step: a step of all the
    # losses runs their train ops in the dict's order.
    step = _Step(opts[key], scales[key], clip_norm, average_device,
                 pack_bytes, towers.all_reduce,
                 global_step if key == keys[-1] else None)
    if steps == 1:
      # The update ops and the losses join the averaging barrier rather
      # than wrapping apply_gradients in control_dependencies: optimizers
      # such as SyncReplicasOptimizer build queues inside apply_gradients,
      # and a queue that depended on the towers would pull an input batch
      # whenever its queue runner touched it. Each loss's step runs what
      # its loss goes through and nothing else, as one device's minimize.
      train_ops[key] = step(tower_grads[key], towers.weights,
                            list(update_ops[key]) + losses[key])
    else:
      train_ops[key], applies = _accumulate.accumulate_gradients(
          towers, step, steps)
    applied[key] = step.applied
  loss_scales = {key: scale.value for key, scale in scales.items()
                 if scale is not None}
  return _losses.unwrap(train_ops), towers._replace(
      grads_and_vars=_losses.unwrap(applied), applies=applies,
      loss_scale=_losses.unwrap(loss_scales) if loss_scales else None)


def _check_gradients(
    tower_grads: Dict[_losses.Key, List[_gradients.GradsAndVars]]) -> None:
  """Raises if a loss reaches none of its variables."""
  for key, grads in tower_grads.items():
    if all(g is None for g, _ in grads[0]):
      raise ValueError(
          "no variable has a gradient%s: none of %s reaches the towers' loss%s"
          % (_losses.named(key), ", ".join(v.name for _, v in grads[0]),
             _losses.named(key)))


def _loss_scales(opts: Dict[_losses.Key, tf.train.Optimizer],
                 loss_scale: _loss_scale.LossScaleSpec, steps: int,
                 compute_dtype: _precision.ComputeDtype
                ) -> Dict[_losses.Key, Optional[_loss_scale.LossScale]]:
  """Each loss's loss scale (None: not scaled), checked with its optimizer."""
  compute_dtype = _precision.check_compute_dtype(compute_dtype)
  scales: Dict[_losses.Key, Optional[_loss_scale.LossScale]] = {}
  for key, each in opts.items():
    if steps > 1 and isinstance(each, tf.train.SyncReplicasOptimizer):
      raise ValueError(
          "accumulate_steps=%d sums micro-batches before one update, but "
          "SyncReplicasOptimizer updates from queues it fills on every run; "
          "aggregate more gradients per update with its replicas_to_aggregate "
          "instead, or drop accumulate_steps" % steps)
    spec = _loss_scale.check(loss_scale, each, compute_dtype)
    scales[key] = None if spec is None else _loss_scale.LossScale(spec)
  return scales


class _Step:
  """One loss's step: average, unscale, clip, apply once (`apply_fn` for
  `accumulate_gradients`); keeps the pairs it applied."""

  def __init__(self, opt: tf.train.Optimizer,
               scale: Optional[_loss_scale.LossScale],
               clip_norm: Optional[float], average_device: Optional[str],
               pack_bytes: int, all_reduce: Optional[str],
               global_step: Optional[tf.Variable]):
    self._opt = opt
    self._scale = scale
    self._clip_norm = clip_norm
    self._average_device = average_device
    self._pack_bytes = pack_bytes
    self._all_reduce = all_reduce
    self._global_step = global_step
    self.applied: _gradients.GradsAndVars = []

  def __call__(self, tower_grads: List[_gradients.GradsAndVars],
               weights: List[_gradients.Weight],
               control_inputs: Sequence[object] = ()) -> tf.Operation:
    grads = _gradients.average_gradients(
        tower_grads, weights, device=self._average_device,
        control_inputs=control_inputs, all_reduce=self._all_reduce,
        pack_bytes=self._pack_bytes)
    if self._scale is not None:
      grads, finite = self._scale.unscale(grads)
    if self._clip_norm is not None:
      grads = _clip_by_global_norm(grads, self._clip_norm)
    self.applied = grads
    # What apply_gradients does, with every copy's gradients built before a
    # loss scale's condition, so that only the update is conditional.
    with _apply.updating(grads) as update:

      def apply() -> tf.Operation:
        return update(_apply.original_apply(self._opt), self._global_step,
                      None)

      return apply() if self._scale is None else self._scale.apply(finite,
                                                                   apply)


def _clip_by_global_norm(grads_and_vars: _gradients.GradsAndVars,
                         clip_norm: float) -> _gradients.GradsAndVars:
  """``tf.clip_by_global_norm`` for gradients of any mix of float dtypes.

  TensorFlow's stacks the gradients' norms, so float16 and float32
  gradients together fail. Here the global norm is computed in float32 (or
  float64 when a gradient is), and each gradient is scaled in its own dtype.
  With one dtype this is TensorFlow's function itself.
  """
  grads, variables = zip(*grads_and_vars)
  present = [g for g in grads if g is not None]
  dtypes = {g.dtype.base_dtype for g in present}
  if len(dtypes) <= 1:
    grads, _ = tf.clip_by_global_norm(grads, clip_norm)
    return list(zip(grads, variables))
  wide = tf.float64 if tf.float64 in dtypes else tf.float32
  with tf.name_scope("clip_by_global_norm"):
    norm = tf.linalg.global_norm([tf.cast(g, wide) for g in present])
    # TensorFlow's formula: no clipping below clip_norm, NaN for NaN norms.
    scale = clip_norm * tf.minimum(1.0 / norm, tf.constant(1.0, wide) /
                                   clip_norm) + (norm - norm)
    clipped = [None if g is None else _scale(g, tf.cast(scale, g.dtype))
               for g in grads]
  return list(zip(clipped, variables))


def _scale(grad, scale: tf.Tensor):
  if isinstance(grad, tf.IndexedSlices):
    return tf.IndexedSlices(grad.values * scale, grad.indices,
                            grad.dense_shape)
  return grad * scale
