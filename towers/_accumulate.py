"""Gradient accumulation: k micro-batches summed on each tower, reduced once.

Each run of the train op runs one micro-batch on every tower and adds each
tower's gradients to accumulators on the devices that computed them, so no
gradient crosses a device. Every k-th run also reduces the accumulated
gradients (`average_gradients`, once), applies them and clears the
accumulators, inside a ``tf.cond``: the reduction, the update and the
optimizer's state (a global step, Adam's beta powers, a loss scale) run
only then. The accumulators and the counter are local variables: never
saved, and set to zero whenever a session initializes or restores, so a
restored run starts a fresh accumulation.

Exactness: the k micro-batches together are one global batch. With a
static batch size every micro-batch has the same size, so the accumulated
sums divided by k, averaged with the towers' weights, are the mean over all
examples. A batch size known only at run time (a final partial batch) makes
each gradient count by its tower's examples: the towers accumulate
``examples_i * grad_i``, the counter the micro-batches' examples, and the
average divides by that count.

A gradient that `_regularization` split into a data part and weight decay
computed next to its variable is accumulated as its two parts, each where
it is computed, so weight decay does not cross to the towers either; but
nothing is accumulated on a parameter server, which every worker shares. A
``tf.IndexedSlices`` gradient stays sparse: each micro-batch's slices are
appended to the tower's, so it holds what the tower's k micro-batches
touched, never the variable's full shape.
"""

import numbers
from typing import Callable, List, Optional, Sequence, Tuple

import tensorflow.compat.v1 as tf

from towers import _devices
from towers import _gradients
from towers import _regularization
from towers import _shares
from towers import _tf_internals
from towers import _tf_versions

ApplyFn = Callable[[List[_gradients.GradsAndVars],
                    List[_gradients.Weight]], tf.Operation]


def accumulate_gradients(towers, apply_fn: ApplyFn,
                         accumulate_steps: int) -> Tuple[tf.Operation,
                                                         tf.Tensor]:
  """Builds a train op that applies once every `accumulate_steps` runs.

  Each run of the returned op runs one micro-batch on every tower (with its
  losses and update ops) and adds the towers' gradients to accumulators on
  their devices; every `accumulate_steps`-th run also runs what
  ``apply_fn(tower_grads, weights)`` built, then clears them. `apply_fn` is
  called once, while building, inside a ``tf.cond``: it gets the
  accumulated ``[num_towers][num_vars]`` pairs and their weights, and
  averages and applies them as for one batch (`average_gradients`, then
  `apply_gradients`). The result is the single-device update on the
  micro-batches together, and whatever `apply_fn` builds (a global step, an
  optimizer's state) advances once per applied update. See docs/api.md.

  Args:
    towers: a `Towers`, as `build_towers` returns it.
    apply_fn: ``(tower_grads, weights) -> op``.
    accumulate_steps: the micro-batches per update, an int >= 1.

  Returns:
    ``(train_op, applies)``: `applies` is a scalar bool tensor, whether the
    next run of `train_op` applies (fetched with it, whether that run does).

  Raises:
    TypeError: if `towers` is not a `Towers`, `apply_fn` is not callable
      or returns no op, or `accumulate_steps` is not an int.
    ValueError: for `accumulate_steps` < 1, or towers' gradients that
      `average_gradients` would refuse.
  """
  steps = check_steps(accumulate_steps)
  tower_grads = getattr(towers, "tower_grads", None)
  if tower_grads is None or not hasattr(towers, "weights"):
    raise TypeError("expected towers to be the Towers build_towers returns, "
                    "got %r" % (towers,))
  if not callable(apply_fn):
    raise TypeError("expected apply_fn to be callable as apply_fn("
                    "tower_grads, weights) -> op, got %r" % (apply_fn,))
  _gradients.check_tower_grads(tower_grads)
  outer = _tf_versions.name_scope(tf.get_default_graph())
  with tf.name_scope("accumulate_gradients"):
    run = _Accumulation(towers, steps)
    ready = run.add()
    # A v1 condition even under control flow v2, whose branches would be
    # graphs of their own, where the graph's state of the reduction (the
    # workers' group, the instance keys, the copies) is not found.
    applied = _tf_internals.cond_v1(
        ready, lambda: run.apply(apply_fn, outer), run.count,
        name="apply_or_accumulate")
  return applied.op, run.applies


class _Accumulation:
  """The accumulators of every tower, the run counter, and the two branches:
  count a run, or apply the sums and clear them."""

  def __init__(self, towers, steps: int):
    self._towers = towers
    self._steps = steps
    self._weights = list(towers.weights)
    # Weights known only at run time: micro-batches may differ in size.
    self._sized = towers.batch_size is not None and not all(
        isinstance(w, numbers.Real) for w in self._weights)
    self._home = _devices.host(towers.devices[0])
    with tf.device(self._home):
      self._count = _local_variable("count", [], tf.float32)
      self._examples = _local_variable("examples", [], tf.float32) \
          if self._sized else None
      self.applies = tf.greater_equal(_read(self._count), float(steps - 1),
                                      name="applies")
    # Each named after tower 0's variable (copy 0's, when replicated).
    self._accumulators = [
        [_Accumulator(grad, var, "%s/%s" % (scope.rstrip("/"), first.op.name),
                      device)
         for (grad, var), (_, first) in zip(pairs, towers.tower_grads[0])]
        for pairs, scope, device in zip(towers.tower_grads, towers.scopes,
                                        towers.devices)]

  def add(self) -> tf.Tensor:
    """Adds this run's gradients; returns whether this run applies."""
    towers = self._towers
    adds = []
    with tf.control_dependencies(list(towers.update_ops) +
                                 list(towers.losses)):
      for i, tower in enumerate(self._accumulators):
        with tf.device(towers.devices[i]):
          # The tower's examples, a whole number: float64 weights times
          # the batch, rounded, whatever the gradients' dtype.
          factor = tf.round(tf.cast(self._weights[i], tf.float64) * tf.cast(
              towers.batch_size, tf.float64)) if self._sized else None
        for accumulator in tower:
          adds.extend(accumulator.add(factor))
      if self._examples is not None:
        with tf.device(self._home):
          adds.append(self._examples.assign_add(towers.batch_size).op)
    with tf.control_dependencies(adds):
      return tf.identity(self.applies)

  def apply(self, apply_fn: ApplyFn, outer: str) -> tf.Tensor:
    """The applying branch: `apply_fn` on the sums, then clear them."""
    if self._examples is not None:
      with tf.device(self._home):
        share = 1.0 / tf.cast(_read(self._examples), tf.float64)
      scale, weights = None, [share] * len(self._weights)
    else:
      scale, weights = 1.0 / self._steps, self._weights
    grads = [[(a.value(scale), a.var) for a in tower]
             for tower in self._accumulators]
    # The tutorial's average_gradients(tower_grads), without weights, takes
    # these.
    _shares.record(grads, self._towers.plan.with_shares(weights))
    # In the caller's name scope, as without accumulation: an optimizer's
    # own variables (Adam's beta powers) keep their single-device names.
    with tf.name_scope(outer + "/" if outer else ""):
      op = apply_fn(grads, weights)
    if not isinstance(op, (tf.Operation, tf.Tensor)):
      raise TypeError("expected apply_fn to return the op that applies "
                      "the gradients (what apply_gradients returns), got "
                      "%r" % (op,))
    with tf.control_dependencies([op]):
      clears = [c for tower in self._accumulators for a in tower
                for c in a.clear()]
      with tf.device(self._home):
        clears.append(self._count.assign(0.0).op)
        if self._examples is not None:
          clears.append(self._examples.assign(0.0).op)
    with tf.control_dependencies(clears):
      return tf.constant(True)

  def count(self) -> tf.Tensor:
    """The counting branch: one more micro-batch."""
    with tf.device(self._home), tf.control_dependencies([
        self._count.assign_add(1.0).op]):
      return tf.constant(False)


def check_steps(accumulate_steps: object) -> int:
  """Returns `accumulate_steps` if it is an int >= 1."""
  if isinstance(accumulate_steps, bool) or not isinstance(
      accumulate_steps, numbers.Integral):
    raise TypeError("expected accumulate_steps to be an int (the "
                    "micro-batches per update), got %r" % (accumulate_steps,))
  if accumulate_steps < 1:
    raise ValueError("expected accumulate_steps >= 1 (the micro-batches per "
                     "update; 1 applies every run), got %d" % accumulate_steps)
  return int(accumulate_steps)


class _Accumulator:
  """One tower's accumulated gradient of one variable, on its devices."""

  def __init__(self, grad: Optional[_gradients.Gradient], var: tf.Variable,
               name: str, device: str):
    self.var = var
    self._grad = grad
    self._parts: List[tf.Tensor] = []
    self._sums: List[tf.Variable] = []
    self._empty: List[List[int]] = []
    self._sparse = isinstance(grad, tf.IndexedSlices)
    if grad is None:
      return
    resource = _is_resource(var)
    if self._sparse:
      values = grad.values
      rows = values.shape[1:]
      if not rows.is_fully_defined():
        raise ValueError(
            "the sparse gradient of variable %s has rows of unknown shape %s"
            "; accumulate_steps needs each row's shape while building"
            % (var.op.name, rows))
      self._empty = [[0] + rows.as_list(), [0]]
      with tf.device(_own_device(values.device, device)):
        self._sums = [
            _local_variable(name + "/values", self._empty[0], values.dtype,
                            resource, dynamic=True),
            _local_variable(name + "/indices", self._empty[1],
                            grad.indices.dtype, resource, dynamic=True)]
      self._parts = [values, grad.indices]
      return
    split = _regularization.parts(grad)
    self._parts = [grad] if split is None else [split[0]] + list(split[1])
    shape = grad.shape if grad.shape.is_fully_defined() else var.shape
    if not shape.is_fully_defined():
      raise ValueError(
          "the gradient of variable %s has the unknown shape %s; "
          "accumulate_steps needs its shape while building"
          % (var.op.name, shape))
    for j, part in enumerate(self._parts):
      with tf.device(_own_device(part.device, device)):
        self._sums.append(_local_variable(
            "%s/part_%d" % (name, j) if split else name, shape.as_list(),
            part.dtype, resource))

  def add(self, factor: Optional[tf.Tensor]) -> List[tf.Operation]:
    """This micro-batch's gradient (times `factor`) added, on its devices."""
    ops = []
    for j, (part, total) in enumerate(zip(self._parts, self._sums)):
      with tf.device(total.device):
        if factor is not None and not (self._sparse and j == 1):
          part = part * tf.cast(factor, part.dtype)
        if self._sparse:
          ops.append(_assign(total, tf.concat([_read(total), part], 0)))
        else:
          ops.append(total.assign_add(part).op)
    return ops

  def value(self, scale: Optional[float]) -> Optional[_gradients.Gradient]:
    """The accumulated gradient (times `scale`), read on its devices."""
    if self._grad is None:
      return None
    reads = []
    for j, total in enumerate(self._sums):
      with tf.device(total.device):
        read = _read(total)
        if scale is not None and not (self._sparse and j == 1):
          read = read * tf.constant(scale, read.dtype)
        reads.append(read)
    if self._sparse:
      return tf.IndexedSlices(reads[0], reads[1], self._grad.dense_shape)
    if len(reads) == 1:
      return reads[0]
    # Recorded as its parts, so the average treats it as the towers' own.
    with tf.device(self._grad.device):
      total = tf.add_n(reads)
    _regularization.record(total, reads[:1], reads[1:])
    return total

  def clear(self) -> List[tf.Operation]:
    """Sets the accumulators back to zero (or no slices)."""
    ops = []
    for j, total in enumerate(self._sums):
      with tf.device(total.device):
        if self._sparse:
          ops.append(_assign(total, tf.zeros(self._empty[j], total.dtype)))
        else:
          ops.append(total.assign(tf.zeros_like(_read(total))).op)
    return ops


def _local_variable(name: str, shape: Sequence[int], dtype: tf.DType,
                    resource: Optional[bool] = None,
                    dynamic: bool = False) -> tf.Variable:
  """A local variable (not saved, not trained) of zeros; with `dynamic`,
  its first dimension may change (appended slices)."""
  kwargs = {}
  if dynamic:
    if resource:
      kwargs["shape"] = tf.TensorShape([None] + list(shape[1:]))
    else:
      kwargs["validate_shape"] = False
  return tf.Variable(lambda: tf.zeros(shape, dtype), trainable=False,
                     name=name, collections=[tf.GraphKeys.LOCAL_VARIABLES],
                     use_resource=resource, **kwargs)


def _read(var: tf.Variable) -> tf.Tensor:
  return var.read_value()


def _assign(var: tf.Variable, value: tf.Tensor) -> tf.Operation:
  if _is_resource(var):
    return var.assign(value).op
  return tf.assign(var, value, validate_shape=False).op


def _is_resource(var) -> bool:
  return getattr(getattr(var, "op", None), "type", None) == "VarHandleOp"


def _own_device(device: str, tower_device: str) -> str:
  """Where a part computed on `device` is accumulated: there, if it is on
  the tower's task; else (a parameter server, which every worker shares) on
  the tower's device."""
  spec = tf.DeviceSpec.from_string(device or "")
  tower = tf.DeviceSpec.from_string(tower_device)
  if not device or (spec.job, spec.replica, spec.task) != (
      tower.job, tower.replica, tower.task):
    return tower_device
  return device
