"""Synchronized batch norm: every tower normalizes with the global batch's
statistics, so N towers train the model one device trains.

Per-tower batch norm normalizes each shard with the shard's own mean and
variance: with N towers that is a different model from one device's. Here
the count, sum and sum of squares of each tower's shard go through one
cross-tower sum (`TowerContext.all_sum`, whose gradient is a cross-tower sum
too), so outputs, gradients and moving averages are those of one device on
the whole batch, uneven shards included.

Outside towers, with one tower, or with ``training=False``, it is the
ordinary layer, with no collective. The variables are those of
``tf.compat.v1.layers.batch_normalization`` (names, shapes, collections,
initial values, the moving averages' update), so checkpoints interchange with
``tf.layers`` models.
"""

from typing import List, NamedTuple, Optional, Sequence, Union

import numpy as np
import tensorflow.compat.v1 as tf

from towers import _context

_DEFAULT_NAME = "batch_normalization"
# The name scope of the global batch's moments (`towers.testing` finds the
# layer by it).
MOMENTS_SCOPE = "global_moments"


def batch_normalization(inputs,
                        axis: Union[int, Sequence[int]] = -1,
                        momentum: float = 0.99,
                        epsilon: float = 1e-3,
                        center: bool = True,
                        scale: bool = True,
                        beta_initializer=tf.zeros_initializer(),
                        gamma_initializer=tf.ones_initializer(),
                        moving_mean_initializer=tf.zeros_initializer(),
                        moving_variance_initializer=tf.ones_initializer(),
                        beta_regularizer=None,
                        gamma_regularizer=None,
                        beta_constraint=None,
                        gamma_constraint=None,
                        training=False,
                        trainable: bool = True,
                        name: Optional[str] = None,
                        reuse=None,
                        renorm: bool = False,
                        renorm_clipping=None,
                        renorm_momentum: float = 0.99,
                        fused: Optional[bool] = None,
                        virtual_batch_size: Optional[int] = None,
                        adjustment=None) -> tf.Tensor:
  """Batch norm over the global batch of all towers (``tf.layers``' drop-in).

  Inside `build_towers` with ``training`` not False, each tower's count, sum
  and sum of squares are summed across the towers, and so is the gradient:
  outputs, gradients and moving averages equal one device's on the whole
  batch. Elsewhere it normalizes alone. Variables, default names, updates
  and checkpoints are ``tf.compat.v1.layers.batch_normalization``'s. The
  long form (the variance tracked, float16, one pass) is in docs/api.md.

  Args:
    inputs: a tensor of known rank.
    axis, momentum, epsilon, center, scale: as for ``tf.layers``.
    beta_initializer, gamma_initializer, moving_mean_initializer,
      moving_variance_initializer, beta_regularizer, gamma_regularizer,
      beta_constraint, gamma_constraint: as for ``tf.layers``.
    training: a Python bool or a scalar boolean tensor.
    trainable, name, reuse: as for ``tf.layers``.
    fused: decides only which variance the moving variance tracks.
    renorm, renorm_clipping, renorm_momentum, virtual_batch_size,
      adjustment: not supported; leave them at their defaults.

  Returns:
    The normalized tensor, of the dtype and shape of `inputs`.

  Raises:
    ValueError: for an input of unknown rank or feature size, an axis out
      of range, an unsupported option, or a cross-tower sum that cannot be
      built (see `TowerContext.all_sum`).
  """
  _check_supported(renorm, renorm_clipping, renorm_momentum,
                   virtual_batch_size, adjustment)
  inputs = tf.convert_to_tensor(inputs)
  layout = _layout(inputs, axis)
  compute_dtype = tf.float32 if inputs.dtype.base_dtype in (
      tf.float16, tf.bfloat16) else inputs.dtype.base_dtype
  context = _context.tower_context()
  with tf.variable_scope(name, default_name=_DEFAULT_NAME, reuse=reuse):
    gamma = tf.get_variable(
        "gamma", layout.shape, compute_dtype, initializer=gamma_initializer,
        regularizer=gamma_regularizer, constraint=gamma_constraint,
        trainable=trainable) if scale else None
    beta = tf.get_variable(
        "beta", layout.shape, compute_dtype, initializer=beta_initializer,
        regularizer=beta_regularizer, constraint=beta_constraint,
        trainable=trainable) if center else None
    moving_mean = tf.get_variable(
        "moving_mean", layout.shape, compute_dtype,
        initializer=moving_mean_initializer, trainable=False)
    moving_variance = tf.get_variable(
        "moving_variance", layout.shape, compute_dtype,
        initializer=moving_variance_initializer, trainable=False)
    x = tf.cast(inputs, compute_dtype)
    learning = tf.get_static_value(training) if isinstance(
        training, (tf.Tensor, tf.Variable)) else bool(training)
    if learning is not None and not learning:
      stats = (moving_mean, moving_variance, None)
    else:
      stats = _statistics(
          x, layout, context, (moving_mean, moving_variance), momentum,
          None if learning else training,
          fused is not False and _fusable(layout.axes, layout.rank,
                                          compute_dtype))
    if context is not None and _synchronized_in(context) and (
        learning is None or learning):
      outputs = _synchronized(
          x, stats, (gamma, beta), layout, context,
          None if learning else training, epsilon,
          _kernels_take(layout.axes, layout.rank, compute_dtype, epsilon))
    else:
      against_x = layout.against_x
      outputs = tf.nn.batch_normalization(
          x, against_x(stats[0]), against_x(stats[1]), against_x(beta),
          against_x(gamma), epsilon)
    return tf.cast(outputs, inputs.dtype)


def _check_supported(renorm, renorm_clipping, renorm_momentum,
                     virtual_batch_size, adjustment) -> None:
  """Raises for the options `tf.layers`' layer has and this one does not."""
  unsupported = [(n, v) for n, v, default in [
      ("renorm", renorm, False), ("renorm_clipping", renorm_clipping, None),
      ("virtual_batch_size", virtual_batch_size, None),
      ("adjustment", adjustment, None)] if v != default]
  if renorm_momentum != 0.99:
    unsupported.append(("renorm_momentum", renorm_momentum))
  if unsupported:
    raise ValueError(
        "towers.batch_normalization does not support %s: batch "
        "renormalization, virtual batches and adjustments change the "
        "statistics that synchronization makes global; leave them at their "
        "defaults, or use tf.compat.v1.layers.batch_normalization (per "
        "tower)" % ", ".join("%s=%r" % pair for pair in unsupported))


class _Layout(NamedTuple):
  """Where an input's features are: its rank, the feature axes, the axes
  reduced over, the variables' shape and that shape against the input."""
  rank: int
  axes: List[int]
  reduced: List[int]
  shape: List[int]
  broadcast: List[int]

  def against_x(self, t):
    """A per-feature value (of the variables' shape) against the input: as
    it is where it broadcasts, reshaped where the feature axis is not the
    last."""
    if t is None or len(self.axes) > 1 or self.axes[0] == self.rank - 1:
      return t
    return tf.reshape(t, self.broadcast)


def _layout(inputs: tf.Tensor, axis) -> _Layout:
  rank = inputs.shape.rank
  if rank is None:
    raise ValueError("expected inputs of known rank for batch normalization, "
                     "got %s of unknown shape; set its shape" % inputs.name)
  axes = _axes(axis, rank, inputs)
  dims = [tf.compat.dimension_value(d) for d in inputs.shape]
  shape = [dims[i] for i in axes] if len(axes) == 1 else [
      dims[i] if i in axes else 1 for i in range(rank)]
  # Broadcast against the input: one value per feature along `axes`.
  broadcast = [dims[i] if i in axes else 1 for i in range(rank)]
  return _Layout(rank, axes, [i for i in range(rank) if i not in axes],
                 shape, broadcast)


def _statistics(x: tf.Tensor, layout: _Layout,
                context: Optional[_context.TowerContext], moving,
                momentum: float, training, unbiased: bool):
  """The batch's ``(mean, variance, count)`` (the global batch's inside
  towers), with the moving averages' updates; with a `training` tensor,
  the moving averages where it is false."""
  moving_mean, moving_variance = moving
  mean, variance, count = _moments(x, layout.reduced, layout.shape, context)
  _add_updates(moving_mean, moving_variance, mean, variance, count,
               momentum, unbiased, training)
  if training is None:
    return mean, variance, count
  batch_mean, batch_variance = mean, variance
  mean = tf.cond(training, lambda: batch_mean,
                 lambda: tf.convert_to_tensor(moving_mean))
  variance = tf.cond(training, lambda: batch_variance,
                     lambda: tf.convert_to_tensor(moving_variance))
  return mean, variance, count


def _axes(axis, rank: int, inputs: tf.Tensor) -> List[int]:
  listed = list(axis) if isinstance(axis, (list, tuple)) else [axis]
  if not listed or not all(isinstance(a, int) for a in listed):
    raise ValueError("expected axis to be an int or a list of ints, got %r"
                     % (axis,))
  axes = sorted({a % rank for a in listed if -rank <= a < rank})
  if len(axes) != len(listed):
    raise ValueError("axis %r is out of range (or repeated) for %s of rank "
                     "%d" % (axis, inputs.name, rank))
  missing = [a for a in axes
             if tf.compat.dimension_value(inputs.shape[a]) is None]
  if missing:
    raise ValueError("expected %s to have a known size on axis %s (the "
                     "features), got shape %s"
                     % (inputs.name, missing, inputs.shape))
  return axes


def _fusable(axes: List[int], rank: int, dtype: tf.DType) -> bool:
  """Whether ``tf.layers`` would use its fused kernel (whose moving variance
  tracks the unbiased batch variance)."""
  return rank in (4, 5) and len(axes) == 1 and axes[0] in (
      1, rank - 1) and dtype in (tf.float16, tf.bfloat16, tf.float32)


def _synchronized_in(context: _context.TowerContext) -> bool:
  """Whether the statistics are summed across towers (or workers)."""
  return context.num_towers > 1 or context.num_workers > 1


def _kernels_take(axes: List[int], rank: int, dtype: tf.DType,
                  epsilon: float) -> bool:
  """Whether TensorFlow's fused kernels take `x`: 4-D, channels last,
  float32, and an epsilon cuDNN accepts."""
  return rank == 4 and axes == [3] and dtype == tf.float32 and (
      epsilon >= 1.001e-5)


def _moments(x: tf.Tensor, reduced: List[int], shape: List[int],
             context: Optional[_context.TowerContext]):
  """The batch mean and (biased) variance over `reduced`, of the variables'
  `shape`, and the count (a scalar, or a vector of one): the global
  batch's inside towers."""
  count = _count(x, reduced)
  keepdims = len(shape) > 1
  if context is None or not _synchronized_in(context):
    mean, variance = tf.nn.moments(x, reduced, keepdims=keepdims)
    return mean, variance, count
  with tf.name_scope(MOMENTS_SCOPE):
    total = tf.reduce_sum(x, reduced, keepdims=keepdims)
    # The norm reads x once, with no squared copy of it: faster than
    # summing tf.square(x), within a rounding.
    squares = tf.square(tf.math.reduce_euclidean_norm(x, reduced,
                                                      keepdims=keepdims))
    size = int(np.prod(shape))
    # One cross-tower sum of all three; the layer's own gradient
    # (`_synchronized`) never differentiates it.
    count, total, squares = tf.split(context.all_sum(tf.concat(
        [count, _flat(total), _flat(squares)], 0)),
                                     [1, size, size])
    mean = _shaped(total, shape) / count
    # Rounding can leave a variance of a constant feature slightly below 0.
    variance = tf.maximum(_shaped(squares, shape) / count - tf.square(mean),
                          0.0)
  return mean, variance, count


def _count(x: tf.Tensor, reduced: List[int]) -> tf.Tensor:
  """The number of values each feature has in `x`, a vector of one: a
  constant where the reduced axes' sizes are known."""
  sizes = [tf.compat.dimension_value(x.shape[i]) for i in reduced]
  if all(s is not None for s in sizes):
    return tf.constant([float(np.prod(sizes))], x.dtype)
  return tf.cast(tf.reduce_prod(tf.gather(tf.shape(x), reduced),
                                keepdims=True), x.dtype)


def _flat(t: tf.Tensor) -> tf.Tensor:
  return t if t.shape.rank == 1 else tf.reshape(t, [-1])


def _shaped(t: tf.Tensor, shape: List[int]) -> tf.Tensor:
  return t if t.shape.as_list() == list(shape) else tf.reshape(t, shape)


def _synchronized(x, stats, params, layout: _Layout,
                  context: _context.TowerContext, training, epsilon: float,
                  fused: bool) -> tf.Tensor:
  """Normalizes `x` with the global batch's ``stats``, ``(mean, variance,
  count)`` (of the variables' shape), and ``params``, ``(gamma, beta)``
  (either None), with the gradient of the global batch's loss.

  The gradient is written out rather than differentiated through the
  statistics: each tower's sums of ``dy`` and of ``dy * xhat`` go through
  one cross-tower sum (`TowerContext.gradient_sum`), and ``dx = scale *
  (dy - (S1 + xhat * S2) / count)``, ``S`` those sums. `training`, a
  tensor or None (true), keeps the statistics' part only when true. If
  `fused`, TensorFlow's fused kernels (in inference mode, given the
  statistics) do the work on `x`: one op forward, two and a subtraction
  backward.
  """
  mean, variance, count = stats
  gamma, beta = params
  reduced, against_x = layout.reduced, layout.against_x
  shape = mean.shape.as_list()
  keepdims = len(shape) > 1

  def kernel(x, scale, offset):
    return tf.raw_ops.FusedBatchNormV3(
        x=x, scale=scale, offset=offset, mean=mean, variance=variance,
        epsilon=epsilon, data_format="NHWC", is_training=False)

  @tf.custom_gradient
  def normalized(x, *params):
    inv = tf.math.rsqrt(variance + epsilon)
    scale = inv if gamma is None else inv * params[0]
    if fused:
      gamma_t = tf.ones_like(mean) if gamma is None else params[0]
      forward = kernel(x, gamma_t, tf.zeros_like(mean) if beta is None
                       else params[-1])
      y = forward.y
    else:
      shift = -mean * scale if beta is None else params[-1] - mean * scale
      y = x * against_x(scale) + against_x(shift)

    def grad(dy):
      with tf.name_scope("synchronized_grad"):
        if fused:
          # dy * scale, and this tower's sums of dy * xhat and of dy.
          dx, sum_dy_xhat, sum_dy, _, _ = tf.raw_ops.FusedBatchNormGradV3(
              y_backprop=dy, x=x, scale=gamma_t, reserve_space_1=mean,
              reserve_space_2=variance,
              reserve_space_3=forward.reserve_space_3, epsilon=epsilon,
              data_format="NHWC", is_training=False)
        else:
          dx = dy * against_x(scale)
          sum_dy = tf.reduce_sum(dy, reduced, keepdims=keepdims)
          sum_dy_xhat = (tf.reduce_sum(dy * x, reduced, keepdims=keepdims)
                         - mean * sum_dy) * inv
        total_dy, total_dy_xhat = [_shaped(t, shape) for t in tf.split(
            context.gradient_sum(tf.concat(
                [_flat(sum_dy), _flat(sum_dy_xhat)], 0)), 2)]
        # The statistics' part of dx: xhat * a + b.
        k = scale / count
        a, b = k * total_dy_xhat, k * total_dy
        if training is not None:
          on = tf.cast(training, x.dtype)
          a, b = a * on, b * on
        if fused:
          dx -= kernel(x, a, b).y
        else:
          a *= inv
          dx -= x * against_x(a) + against_x(b - mean * a)
        return [dx] + [sum_dy_xhat] * (gamma is not None) + [sum_dy] * (
            beta is not None)

    return y, grad

  return normalized(x, *[tf.convert_to_tensor(p) for p in (gamma, beta)
                         if p is not None])


def _add_updates(moving_mean, moving_variance, mean, variance, count,
                 momentum: float, unbiased: bool, training) -> None:
  """Adds the moving averages' updates to ``UPDATE_OPS``: ``moving -=
  (moving - batch) * (1 - momentum)``, as ``tf.layers`` updates them; with a
  training tensor, only when it is true."""
  if unbiased:
    # The fused kernel's batch variance: n / (n - 1) times the biased one.
    variance = variance * (count / tf.maximum(count - 1.0, 1.0))
  for var, value in ((moving_mean, mean), (moving_variance, variance)):
    value = _shaped(value, var.shape.as_list())

    def assign(var=var, value=value):
      # Next to the variable, as tf.layers' update is (the graph's
      # colocate_with: tf.colocate_with, which wraps it, is deprecated).
      with tf.name_scope("AssignMovingAvg"), \
          tf.get_default_graph().colocate_with(var):
        decay = tf.constant(1.0 - momentum, var.dtype.base_dtype)
        delta = (tf.convert_to_tensor(var) - value) * decay
        return tf.identity(tf.assign_sub(var, delta))

    update = assign() if training is None else tf.cond(
        training, assign, lambda var=var: tf.identity(var))
    tf.add_to_collection(tf.GraphKeys.UPDATE_OPS, update)
