"""One variable's reduction: the weighted mean of its towers' gradients.

A dense gradient is reduced where its variable is (or on the caller's
device), or, for copies, by an all-reduce that leaves the mean next to each
copy. Sparse gradients (``tf.IndexedSlices``) stay sparse: the towers'
slices are concatenated on one device, since their lengths differ, which a
ring's chunks and a collective's group cannot take. With uniform weights the
towers' gradients are summed first and divided once; otherwise each is
scaled on its own device first. Across workers each worker's mean is
all-reduced (or, sparse, gathered) with the other workers', and the workers
count equally.
"""

import numbers
from typing import Callable, List, Optional, Sequence, Union

import tensorflow.compat.v1 as tf

from towers import _allreduce
from towers import _collectives

Gradient = Union[tf.Tensor, tf.IndexedSlices]
Weight = Union[float, tf.Tensor]


class VariableGrads:
  """One variable's gradients in every tower, and where they are reduced.

  Attributes:
    grads: ``[num_towers]`` gradients.
    variables: ``[num_towers]`` variables: one shared, or its copies.
    shared: whether every tower has the same variable.
    where: the devices the reduction leaves its result on: one for a shared
      variable (its own, or `device`), else each copy's (copy 0's replaced
      by `device`).
    algorithm: ``"add_n"`` for a shared variable, else the all-reduce.
  """

  def __init__(self, pairs, device: Optional[str], algorithm: str):
    self.grads = [g for g, _ in pairs]
    self.variables = [v for _, v in pairs]
    self.shared = all(v is self.variables[0] for v in self.variables)
    if self.shared:
      self.where = [self.variables[0].device if device is None else device]
      self.algorithm = "add_n"
    else:
      self.where = [v.device for v in self.variables]
      if device is not None:
        self.where[0] = device
      self.algorithm = algorithm


def mean(grads: Sequence[Optional[Gradient]], weights: List[Weight],
         uniform: bool, waits: List[List[tf.Operation]],
         devices: List[str], algorithm: str,
         order: _collectives.LaunchOrder,
         chunks: Optional[List[int]] = None) -> List[Optional[Gradient]]:
  """Returns the weighted mean of one variable's gradients on `devices`.

  One device (a shared variable) gets one result; copies get the result on
  each copy's device (the same tensor for all with ``"add_n"``). `grads`
  are all None (the result is None) or none is. `waits` holds what the
  reduction waits for: one list, or one per device. `chunks` are a pack's
  ring chunks (`_allreduce.all_sum`).
  """
  present: List[Gradient] = [g for g in grads if g is not None]
  if not present:
    return [None] * len(devices)
  sparse = [isinstance(g, tf.IndexedSlices) for g in present]
  if any(sparse) and not all(sparse):
    # Dense in some towers and sparse in others: only possible when the
    # towers' models differ. Converting all to dense is exact.
    present = [tf.convert_to_tensor(g) for g in present]
  if isinstance(present[0], tf.IndexedSlices):
    return _sparse_mean(present, weights, uniform, _union(waits), devices,
                        order)
  return _dense_mean(present, weights, uniform, waits, devices, algorithm,
                     order, chunks)


def _dense_mean(present: List[tf.Tensor], weights: List[Weight],
                uniform: bool, waits: List[List[tf.Operation]],
                devices: List[str], algorithm: str,
                order: _collectives.LaunchOrder,
                chunks: Optional[List[int]]) -> List[tf.Tensor]:
  workers = order.workers
  barrier = _union(waits)
  if not uniform:
    present = [scaled(g, w) for g, w in zip(present, weights)]
  if len(devices) == 1 or algorithm == "add_n":
    with tf.device(devices[0]), tf.control_dependencies(barrier):
      local, = _allreduce.all_sum(present, devices[:1], "add_n", order,
                                  divisor=len(present) if uniform else 1)
    if workers.num_workers == 1:
      return [local] * len(devices)
    # The worker's mean, all-reduced with the other workers' from this
    # worker's first tower device, and their mean read by every copy.
    mean, = _allreduce.all_sum([local], [workers.home], "collective", order,
                               divisor=workers.num_workers)
    return [mean] * len(devices)
  inputs = []
  for g, d, wait in zip(present, devices, waits):
    with tf.device(d), tf.control_dependencies(wait):
      inputs.append(tf.identity(g))
  # Across workers the group holds every worker's towers: each worker's
  # weights sum to 1, and the workers count equally.
  return _allreduce.all_sum(inputs, devices, algorithm, order, chunks,
                            divisor=workers.num_workers * (
                                len(inputs) if uniform else 1))


def _union(waits: List[List[tf.Operation]]) -> List[tf.Operation]:
  """Every op of `waits`, once: what a reduction on one device waits for."""
  return list({id(op): op for wait in waits for op in wait}.values())


def _sparse_mean(present: List[tf.IndexedSlices], weights: List[Weight],
                 uniform: bool, barrier: List[tf.Operation],
                 devices: List[str], order: _collectives.LaunchOrder
                ) -> List[tf.IndexedSlices]:
  values = [g.values for g in present]
  indices = [g.indices for g in present]
  if len({i.dtype for i in indices}) > 1:
    indices = [tf.cast(i, tf.int64) for i in indices]
  if not uniform:
    values = [scaled(v, w) for v, w in zip(values, weights)]
  # One device for every copy: the towers' slices differ in length.
  with tf.device(devices[0]), tf.control_dependencies(barrier):
    values = combine(values, lambda t: tf.concat(t, 0), uniform)
    indices = combine(indices, lambda t: tf.concat(t, 0), False)
  workers = order.workers
  if workers.num_workers > 1:
    # Every worker's slices, worker after worker (the order one worker's
    # towers would have), then the workers' mean.
    values, indices = _allreduce.all_gather([values, indices], workers.home,
                                            order)
    with tf.device(workers.home):
      values = values * tf.constant(1.0 / workers.num_workers, values.dtype)
  return [tf.IndexedSlices(values, indices, present[0].dense_shape)
         ] * len(devices)


def tensors(grad: Optional[Gradient]) -> List[tf.Tensor]:
  """The tensors a gradient is made of (none for None)."""
  if grad is None:
    return []
  if isinstance(grad, tf.IndexedSlices):
    return [grad.values, grad.indices]
  return [grad]


def is_uniform(weights: Sequence[Weight]) -> bool:
  """Whether `weights` are Python numbers, all equal."""
  return all(isinstance(w, numbers.Real) for w in weights) and (
      max(weights) - min(weights) <= 1e-12)


def scaled(tensor: tf.Tensor, weight: Weight) -> tf.Tensor:
  """`tensor` times `weight`, on the tensor's own device."""
  # The towers scale in parallel; only the reduction runs next to the
  # variable.
  with tf.device(tensor.device):
    if isinstance(weight, numbers.Real):
      return tensor * tf.constant(weight, tensor.dtype)
    return tensor * tf.cast(weight, tensor.dtype)


def combine(tensors: List[tf.Tensor],
            how: Callable[[List[tf.Tensor]], tf.Tensor],
            divide: bool) -> tf.Tensor:
  """Combines the towers' tensors, then divides by their number if asked."""
  if len(tensors) == 1:
    # An identity, not the tensor itself: the result must wait for the
    # barrier.
    return tf.identity(tensors[0])
  total = how(tensors)
  if not divide:
    return total
  return total * tf.constant(1.0 / len(tensors), total.dtype)
