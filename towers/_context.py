"""The tower context: what code inside a tower knows of the other towers.

While `build_towers` (or `infer`) builds tower ``i``, `tower_context()`
returns a `TowerContext`: the tower's index, the number of towers, their
devices and a key unique to this set of towers. Its `TowerContext.all_sum`
is a cross-tower sum built one tower at a time, the piece layers such as
synchronized batch norm are made of. A sum is a collective (NCCL) where the
towers' gradients would be all-reduced by one (distinct GPUs, several
workers, ``all_reduce='collective'``); elsewhere it is the ``add_n``
algorithm, the towers' sum in tower order on the first tower's device, read
by every tower: a few hundred bytes, for which a collective's launch
(about 0.5 ms on CPU devices) costs more than the bytes. It guarantees:

- Never a hang. A collective returns only once every tower's member has
  run, so each tower's result waits for every member (control edges added to
  the earlier towers' results as the later towers are built): fetching one
  tower's result runs the whole group. A sum on one device is read by every
  tower, and cannot hang. Towers that build different sums are an error
  when the towers are built, not a hang when they run.
- One launch order. On each device the collective sums launch in the order
  they were built, the same in every tower (NCCL deadlocks when two devices
  launch two collectives in opposite orders); the gradients' own all-reduce
  launches after them.
- The global batch's gradient. Tower ``i``'s gradient of the sum is the sum
  over towers of ``w_j * dy_j``, divided by ``w_i`` (``w`` the towers'
  shares of the global batch, as `average_gradients` weights them): after
  averaging, the gradient of the global batch's loss, uneven shards
  included.
"""

import contextlib
import functools
import numbers
from typing import Dict, Iterator, List, Optional, Sequence, Tuple, Union

import tensorflow.compat.v1 as tf

from towers import _allreduce
from towers import _collectives
from towers import _devices
from towers import _plan
from towers import _state
from towers import _tf_internals
from towers import _workers

Share = Union[float, tf.Tensor]


class TowerContext:
  """The tower being built, as code inside `model_fn` sees it.

  Attributes:
    index: this tower's index, ``0 <= index < num_towers``.
    num_towers: the number of towers.
    devices: ``[num_towers]`` device strings the towers are built on.
    key: an int unique to this set of towers in the graph (for names of
      your own that must be the same in every tower and differ between two
      `build_towers` calls).
    scope: this tower's name scope, such as ``'tower_1/'``.
    num_workers: the worker tasks whose towers the cross-tower sums span
      (1: these towers alone).
  """

  __slots__ = ("_set", "_index")

  def __init__(self, tower_set: "TowerSet", index: int):
    self._set = tower_set
    self._index = index

  @property
  def index(self) -> int:
    return self._index

  @property
  def num_towers(self) -> int:
    return len(self._set.devices)

  @property
  def devices(self) -> Tuple[str, ...]:
    return tuple(self._set.devices)

  @property
  def key(self) -> int:
    return self._set.key

  @property
  def scope(self) -> str:
    return self._set.scopes[self._index]

  @property
  def num_workers(self) -> int:
    return self._set.order.workers.num_workers

  @property
  def _alone(self) -> bool:
    # One tower of one worker: a cross-tower sum is an identity.
    return self.num_towers == 1 and self.num_workers == 1

  def __repr__(self) -> str:
    return "TowerContext(index=%d, num_towers=%d, key=%d)" % (
        self.index, self.num_towers, self.key)

  def all_sum(self, tensor, name: Optional[str] = None) -> tf.Tensor:
    """Returns the sum of `tensor` over all towers, in this tower.

    Every tower must call it, in the same order, with tensors of one dtype
    and shape: the k-th call of each tower is one sum, a collective on GPUs
    (``CollectiveReduceV2``, NCCL) and across workers, else the towers' sum
    on the first tower's device (the module's docstring says which). With
    one tower it is an identity. In towers built with ``num_workers > 1``
    the sum is over every tower of every worker. Its gradient is a
    cross-tower sum too, weighted by the towers' shares of the global batch
    so that the averaged gradients are the global batch's; build it inside
    the tower (as `build_towers` does with ``opt.compute_gradients``).

    Args:
      tensor: a dense tensor (or what converts to one).
      name: the name scope of the ops (default ``'all_sum'``).

    Returns:
      The sum, a tensor of `tensor`'s dtype and shape on this tower's
      device; every tower gets the same values.

    Raises:
      ValueError: if this tower's call does not match the other towers'
        (dtype or shape), the towers share a device (a collective has one
        member per device), or it is called inside ``tf.cond``,
        ``tf.while_loop`` or a ``tf.function`` body (its members could not be
        tied to each other there).
    """
    with tf.name_scope(name, "all_sum"):
      tensor = tf.convert_to_tensor(tensor)
      if self._alone:
        return tf.identity(tensor)
      return self._set.all_sum(self._index, tensor)

  def gradient_sum(self, dy, name: Optional[str] = None) -> tf.Tensor:
    """Returns what the gradient of `all_sum` returns for `dy`, in this tower.

    For layers that write their own gradient (``tf.custom_gradient``, as
    `batch_normalization` does) around a cross-tower sum: the towers' `dy`
    summed, weighted by their shares of the global batch, over this
    tower's share, as one more cross-tower sum (with one tower, an
    identity). Build it in the gradient, inside the tower.

    Args:
      dy: a dense tensor (or what converts to one).
      name: the name scope of the ops (default ``'all_sum_grad'``).

    Returns:
      A tensor of `dy`'s dtype and shape on this tower's device.

    Raises:
      ValueError: as for `all_sum`, or if built outside this tower.
    """
    with tf.name_scope(name, "all_sum_grad"):
      dy = tf.convert_to_tensor(dy)
      if self._alone:
        return tf.identity(dy)
      return self._set.gradient_sum(self._index, dy)


def tower_context() -> Optional[TowerContext]:
  """Returns the tower being built, or None outside `build_towers`.

  Inside `model_fn` (and the gradients `build_towers` computes in each
  tower), the `TowerContext` of the tower being built: layers that need the
  other towers (`batch_normalization`) read it. None outside the towers,
  such as in a single-device graph.
  """
  graph = tf.get_default_graph()
  while graph is not None:
    context = _state.of(graph).building
    if context is not None:
      return context
    # A tf.cond/tf.while_loop (v2) or tf.function body inside a tower.
    graph = getattr(graph, "outer_graph", None)
  return None


class TowerSet:
  """The towers of one `build_towers` call and their cross-tower sums."""

  def __init__(self, plan: _plan.Plan, uniform: bool,
               device_check: Optional[tf.Operation] = None):
    self.graph = tf.get_default_graph()
    state = _state.of(self.graph)
    state.tower_sets += 1
    self.key = state.tower_sets
    self.devices = list(plan.devices)
    self.scopes: List[str] = [""] * plan.num_towers
    # Each tower's share of the global batch (or a number proportional to
    # it, the same factor in every tower); equal shares need no scaling.
    self.shares: List[Share] = [1.0] * plan.num_towers
    self.uniform = uniform
    # Collectives where the gradients' all-reduce is one; elsewhere the sum
    # on one device, whose few bytes cost less than a collective's launch
    # (`_plan.Plan.sums`).
    self.algorithm = plan.sums
    # No member launches before the towers are known to be apart
    # (`_device_check`): on a shared device it would wait forever.
    self._device_check = device_check
    # The k-th sum of every tower: its instance key, dtype and shape, and
    # each tower's member (a collective's op, or the tensor summed) and
    # result.
    self._instances: List[int] = []
    self._specs: List[Tuple[tf.DType, tf.TensorShape]] = []
    self._members: List[Dict[int, Union[tf.Operation, tf.Tensor]]] = []
    self._results: List[Dict[int, tf.Operation]] = []
    self._calls = [0] * plan.num_towers
    self.order = _collectives.LaunchOrder(deferred=True,
                                          workers=plan.workers)

  @contextlib.contextmanager
  def tower(self, index: int, scope: str, share: Share) -> Iterator[None]:
    """Makes tower `index` the current tower while it is built."""
    self.scopes[index] = scope
    self.shares[index] = share
    state = _state.of(self.graph)
    state.building = TowerContext(self, index)
    try:
      yield
    finally:
      state.building = None

  def finish(self, start: int,
             steps: Optional[Sequence[Sequence[object]]] = None) -> None:
    """Ends the set, whose towers made the ops after op `start`: orders its
    sums for `steps` (`LaunchOrder.seal`); their gradients' all-reduce
    will continue that order (`launch_order_of`).

    Raises:
      ValueError: if the towers built different numbers of cross-tower sums.
    """
    if len(set(self._calls)) > 1:
      most = max(range(len(self._calls)), key=self._calls.__getitem__)
      fewest = min(range(len(self._calls)), key=self._calls.__getitem__)
      raise ValueError(
          "%s built %d cross-tower sums (a synchronized batch norm makes "
          "one, and one more in the gradient) but %s built %d: every "
          "tower must build the same layers, since a "
          "cross-tower sum waits for every tower and one left out would "
          "hang the others. Build the same model in every tower (not under "
          "`if context.index == 0`)" % (
              _tower(self.scopes[most], most), self._calls[most],
              _tower(self.scopes[fewest], fewest), self._calls[fewest]))
    self.order.seal(steps)
    if self.order:
      orders = _state.of(self.graph).launch_orders
      orders.update((op, self.order) for op in _tf_internals.made_after(start))

  def all_sum(self, index: int, tensor: tf.Tensor) -> tf.Tensor:
    """Tower `index`'s member of its next cross-tower sum, differentiable."""
    self._check_buildable(index)

    k = self._calls[index]

    @tf.custom_gradient
    def summed(x):
      def grad(dy):
        return self.gradient_sum(index, dy)
      return self._part(index, x), grad

    result = summed(tensor)
    # After the custom gradient is built: it looks for the variables its
    # outputs depend on, which the other towers' parts would add.
    self._complete(k)
    return result

  def gradient_sum(self, index: int, dy: tf.Tensor) -> tf.Tensor:
    """Tower `index`'s gradient of its next cross-tower sum, given `dy`:
    the towers' `dy` summed, weighted by their shares, over its own."""
    current = tower_context()
    if current is None or current.key != self.key or current.index != index:
      raise ValueError(
          "the gradient of %s's cross-tower sum (a synchronized batch norm, "
          "say) is being built outside that tower: its gradient is a "
          "cross-tower sum too, which every tower must build inside its own "
          "tower. Compute gradients with build_towers or minimize (they call "
          "opt.compute_gradients in each tower), or inside model_fn, not "
          "with tf.gradients on the towers' results afterwards"
          % _tower(self.scopes[index], index))
    self._check_buildable(index)
    if self.uniform:
      return self._sum(index, dy)
    share = self.shares[index]
    with tf.device(self.devices[index]):
      weight = tf.constant(share, dy.dtype) if isinstance(
          share, numbers.Real) else tf.cast(share, dy.dtype)
      return tf.math.divide_no_nan(self._sum(index, dy * weight), weight)

  def _check_buildable(self, index: int) -> None:
    if tf.get_default_graph() is not self.graph or (
        _tf_internals.control_flow_context(self.graph) is not None):
      raise ValueError(
          "a cross-tower sum (a synchronized batch norm, say) was built in "
          "%s inside tf.cond, tf.while_loop or a tf.function: its members "
          "in the towers must be tied to each other, which only works in "
          "the towers' graph itself. Build the layer outside the loop or "
          "condition (pass a boolean tensor as `training` rather than "
          "calling it under tf.cond)" % _tower(self.scopes[index], index))
    spelled = [_devices.canonical(d) for d in self.devices]
    if len(set(spelled)) < len(spelled):
      raise ValueError(
          "cross-tower sums (synchronized batch norm) need a distinct device "
          "per tower, since a collective has one member per device, but the "
          "towers' devices are %s; give each tower its own device"
          % ", ".join(self.devices))

  def _sum(self, index: int, tensor: tf.Tensor) -> tf.Tensor:
    """Builds tower `index`'s part of its next sum, tied to the group."""
    k = self._calls[index]
    result = self._part(index, tensor)
    self._complete(k)
    return result

  def _part(self, index: int, tensor: tf.Tensor) -> tf.Tensor:
    """Tower `index`'s part of its next sum, and its result: a collective's,
    or a stand-in until the sum is `_complete`."""
    k = self._calls[index]
    self._calls[index] += 1
    spec = (tensor.dtype.base_dtype, tensor.shape)
    if k == len(self._instances):
      self._instances.append(_collectives.instance_key()
                             if self.algorithm == "collective" else 0)
      self._specs.append(spec)
      self._members.append({})
      self._results.append({})
    elif spec[0] != self._specs[k][0] or not spec[1].is_compatible_with(
        self._specs[k][1]):
      raise ValueError(
          "cross-tower sum %d of %s has dtype %s and shape %s, but the other "
          "towers' have %s and %s: every tower must build the same layers "
          "on inputs of the same shape" % (
              k, _tower(self.scopes[index], index), spec[0].name, spec[1],
              self._specs[k][0].name, self._specs[k][1]))
    if self.algorithm == "collective":
      return self._collective(index, k, tensor)
    # An identity of its own part, rewired to read the sum once the last
    # tower's part is built (the later towers do not exist yet).
    self._members[k][index] = tensor
    with tf.device(self.devices[index]):
      result = tf.stop_gradient(tensor)
    self._results[k][index] = result.op
    return result

  def _complete(self, k: int) -> None:
    """Builds sum `k` on the first tower's device once every tower's part
    is there, and makes every tower's result read it."""
    parts = self._members[k]
    if self.algorithm == "collective" or len(parts) < len(self.devices):
      return
    # Outside the last tower's colocation and control dependencies: the sum
    # belongs to no tower.
    start = _tf_internals.last_op_id()
    with self.graph.colocate_with(None, ignore_existing=True), \
        tf.control_dependencies(None):
      total, = _allreduce.all_sum([parts[i] for i in range(len(parts))],
                                  self.devices[:1], "add_n", self.order)
    _state.of(self.graph).sum_ops.update(_tf_internals.made_after(start))
    for op in self._results[k].values():
      _tf_internals.update_input(op, 0, total)

  def _collective(self, index: int, k: int, tensor: tf.Tensor) -> tf.Tensor:
    device = self.devices[index]
    members = self._members[k]
    output = self.order.launch(device, functools.partial(
        _collectives.member, tensor,
        *_collectives.group_of(self.devices, self.order.workers.num_workers),
        self._instances[k]),
        after=() if self._device_check is None else [self._device_check])
    members[index] = output.op
    with tf.device(device):
      with tf.control_dependencies(list(members.values())):
        result = tf.identity(output)
    # The towers built before this one: their results wait for this member
    # too (a control edge added to an op already built, as TensorFlow's own
    # control flow does: there is no other way to reach a later tower).
    for other in self._results[k].values():
      _tf_internals.add_control_input(other, output.op)
    self._results[k][index] = result.op
    return result


def launch_order_of(tensors: Sequence[object],
                    workers: _workers.Workers) -> _collectives.LaunchOrder:
  """The launch order the all-reduce of `tensors` (gradients, losses) starts
  from: where the cross-tower sums of the towers that made them left off,
  or a new one over `workers` for tensors made outside such towers."""
  orders = _state.of().launch_orders
  for tensor in tensors:
    op = tensor if isinstance(tensor, tf.Operation) else getattr(
        tensor, "op", None)
    if op in orders:
      return orders[op].continued(tensors)
  return _collectives.LaunchOrder(workers=workers)


def is_sum_op(op: tf.Operation) -> bool:
  """Whether `op` is part of a cross-tower sum built on one device: it reads
  every tower's part by design, so the walks that keep each tower to its
  own data stop there."""
  return op in _state.of(op.graph).sum_ops


def _tower(scope: str, index: int) -> str:
  return scope.rstrip("/") or "tower %d" % index
