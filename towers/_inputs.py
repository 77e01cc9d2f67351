"""Feeding the towers: split one global batch, or let each tower dequeue."""

from typing import Callable, Dict, List, Optional, Sequence, Tuple, Union

import tensorflow.compat.v1 as tf

# A tensor, a nested structure of tensors, a callable returning one, or None.
Inputs = Union[None, tf.Tensor, Sequence[object], Dict[str, object],
               Callable[[], object]]
Weight = Union[float, tf.Tensor]


def as_args(batch) -> List[object]:
  """Returns the positional arguments `model_fn` gets after its scope.

  A tuple or list is spread into arguments; anything else (a tensor, a dict)
  is one argument, passed as it came.
  """
  if batch is None:
    return []
  if isinstance(batch, (tuple, list)):
    return list(batch)
  return [batch]


def split_inputs(inputs, num_shards: int, *, allow_empty: bool = False
                ) -> Tuple[List[object], List[Weight]]:
  """Splits every tensor of `inputs` along axis 0 into `num_shards` shards.

  Shard sizes differ by at most one, the larger ones first. The split runs
  next to each input (on the input pipeline's device), so each tower copies
  only its own shard.

  Args:
    inputs: a tensor, or a nested structure of tensors (tuples, lists,
      dicts, namedtuples: what a ``tf.data`` pipeline of features yields),
      all sharing the batch size on axis 0 (which may be unknown until run
      time).
    num_shards: the number of towers.
    allow_empty: whether a batch smaller than `num_shards` may leave some
      shards empty (inference); training needs an example in every tower.

  Returns:
    ``[num_shards]`` shards, each the structure of `inputs` holding that
    shard's tensors, and ``[num_shards]`` shares of the global batch: Python
    floats when the batch size is static, else scalar float32 tensors.

  Raises:
    TypeError: if an input is not a tensor.
    ValueError: if the inputs are empty, have no batch axis, disagree on a
      static batch size, or (unless `allow_empty`) have a static batch
      smaller than `num_shards`. A dynamic batch too small, or one that
      differs from a static one, fails at run time with
      ``tf.errors.InvalidArgumentError``. One static batch size gives every
      shard a static size, whatever the order of the inputs.
  """
  tensors = tf.nest.flatten(inputs)
  if not tensors:
    raise ValueError("expected inputs to hold at least one tensor, got an "
                     "empty %s" % type(inputs).__name__)
  for i, t in enumerate(tensors):
    if not isinstance(t, tf.Tensor):
      raise TypeError(
          "expected inputs to be a tensor, a nested structure (tuple, list, "
          "dict) of tensors with the global batch on axis 0, or a callable; "
          "got %r at position %d; wrap NumPy data with tf.constant or feed a "
          "tf.placeholder" % (t, i))
    if t.shape.rank == 0:
      raise ValueError("input %d (%s) is a scalar; inputs need the global "
                       "batch on axis 0" % (i, t.name))
  static = [tf.compat.dimension_value(t.shape[0]) if t.shape.rank else None
            for t in tensors]
  with tf.name_scope("split_inputs"):
    if any(s is not None for s in static):
      # One input's static size is the batch's: the others are checked
      # against it at run time, and every shard keeps a static size.
      sizes, weights = _static_sizes(tensors, static, num_shards, allow_empty)
      known = tensors[[s is not None for s in static].index(True)]
      tensors = [t if s is not None else _checked_size(t, sum(sizes), known)
                 for t, s in zip(tensors, static)]
    else:
      sizes, weights = _dynamic_sizes(tensors, num_shards, allow_empty)
    shards = []
    for t in tensors:
      with tf.device(t.device):
        shards.append(tf.split(t, sizes, num=num_shards, axis=0))
  return [tf.nest.pack_sequence_as(inputs, list(s)) for s in zip(*shards)], \
      weights


def _static_sizes(tensors, static, num_shards, allow_empty):
  known = [(t, s) for t, s in zip(tensors, static) if s is not None]
  if len({s for _, s in known}) > 1:
    raise ValueError(
        "inputs disagree on the global batch size (axis 0): %s; every input "
        "must hold the same examples"
        % ", ".join("%s has %d" % (t.name, s) for t, s in known))
  batch = known[0][1]
  if batch < num_shards and not allow_empty:
    raise ValueError(
        "the global batch of %d examples is smaller than num_gpus=%d: every "
        "tower needs at least one example; raise the batch size or use fewer "
        "towers" % (batch, num_shards))
  base, extra = divmod(batch, num_shards)
  sizes = [base + (1 if i < extra else 0) for i in range(num_shards)]
  return sizes, [s / batch if batch else 0.0 for s in sizes]


def _checked_size(tensor: tf.Tensor, batch: int,
                  known: tf.Tensor) -> tf.Tensor:
  """`tensor`, whose batch size is known only at run time, checked there
  against `known`'s static `batch`."""
  with tf.device(tensor.device):
    check = tf.debugging.assert_equal(
        tf.shape(tensor, out_type=tf.int32)[0], batch,
        message="inputs disagree on the global batch size (axis 0): %s has "
        "%d examples and %s another number" % (known.name, batch,
                                               tensor.name))
    with tf.control_dependencies([check]):
      return tf.identity(tensor)


def _dynamic_sizes(tensors, num_shards, allow_empty):
  batch = tf.shape(tensors[0], out_type=tf.int32)[0]
  checks = []
  if not allow_empty:
    checks.append(tf.debugging.assert_greater_equal(
        batch, num_shards,
        message="the global batch is smaller than num_gpus=%d: every tower "
        "needs at least one example; raise the batch size or use fewer "
        "towers" % num_shards))
  for t in tensors[1:]:
    checks.append(tf.debugging.assert_equal(
        tf.shape(t, out_type=tf.int32)[0], batch,
        message="inputs disagree on the global batch size (axis 0): %s and "
        "%s" % (tensors[0].name, t.name)))
  with tf.control_dependencies(checks):
    batch = tf.identity(batch)
  base = batch // num_shards
  extra = batch % num_shards
  sizes = base + tf.cast(tf.range(num_shards) < extra, tf.int32)
  return sizes, _ratios([sizes[i] for i in range(num_shards)], batch)


def size_weights(sizes: List[Optional[Weight]]) -> List[Weight]:
  """Returns each tower's share of the examples its callable input produced.

  `sizes` are the towers' `batch_size`s. Equal static sizes give equal float
  shares; unknown sizes (a final partial batch, say) give scalar tensors, so
  the mean stays exact; a batch without a size gives equal shares.
  """
  num = len(sizes)
  if any(s is None for s in sizes):
    return [1.0 / num] * num
  static = [s for s in sizes if isinstance(s, float)]
  if len(static) == num:
    total = sum(static)
    if total == 0:
      return [1.0 / num] * num
    return [s / total for s in static]
  return _ratios(sizes)


def _ratios(counts: Sequence[object],
            total: Optional[tf.Tensor] = None) -> List[tf.Tensor]:
  """Each of `counts` (scalar tensors) over `total` (default their sum), in
  float64: cast to a gradient's dtype, a share is that dtype's nearest to
  the exact ratio, float64 gradients' included."""
  counts = [tf.cast(c, tf.float64) for c in counts]
  total = tf.add_n(counts) if total is None else tf.cast(total, tf.float64)
  return [c / total for c in counts]


def total_size(inputs: Inputs,
               sizes: Sequence[Optional[Weight]]) -> Optional[Weight]:
  """The global batch's number of examples: a float when static, else a
  scalar float32 tensor; None when a tower's batch has no size.

  `sizes` are the towers' `batch_size`s, or Nones where `inputs` (a global
  batch, or None) were split.
  """
  if inputs is not None and not callable(inputs) and None in sizes:
    return batch_size(as_args(inputs))
  if any(s is None for s in sizes):
    return None
  static = [s for s in sizes if isinstance(s, float)]
  if len(static) == len(sizes):
    return float(sum(static))
  return tf.add_n([tf.cast(s, tf.float32) for s in sizes])


def batch_size(batch: List[object]) -> Optional[Weight]:
  """Axis 0 of the tensors of rank >= 1 in `batch`: a float when one's is
  static, else a scalar float32 tensor (the first's); None if it holds no
  such tensor."""
  tensors = [t for t in tf.nest.flatten(batch)
             if isinstance(t, tf.Tensor) and t.shape.rank != 0]
  if not tensors:
    return None
  for t in tensors:
    static = tf.compat.dimension_value(t.shape[0]) if t.shape.rank else None
    if static is not None:
      return float(static)
  return tf.cast(tf.shape(tensors[0])[0], tf.float32)


def tower_batch(inputs: Inputs, shards: Optional[List[object]],
                index: int) -> List[object]:
  """Returns tower `index`'s arguments (call inside its scope and device)."""
  if shards is not None:
    return as_args(shards[index])
  if callable(inputs):
    return as_args(inputs())
  return []
