"""TensorFlow's collective ops as towers builds them: keys, members, order.

A collective (``CollectiveReduceV2`` and its kin) has one member per device
of its group, and each member returns only once every member has run. Three
rules keep them from hanging:

- Keys. A group's key names its members, not the order groups were made
  in, so every worker of a cluster derives the same key for the same
  devices, and a group of one worker's devices never takes another's key.
  Instance keys are unique in the graph.
- Members. For towers of several workers (`_workers`) a group over some
  devices has a member on that device of every worker; each worker builds
  its own.
- Launch order. On each device the collectives of one set of towers launch
  in the order they were built (a control edge from the previous one): NCCL
  deadlocks when two devices launch two collectives in opposite orders.
"""

import zlib
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import tensorflow.compat.v1 as tf

from towers import _devices
from towers import _graph
from towers import _state
from towers import _tf_internals
from towers import _tf_versions
from towers import _workers


def instance_key() -> int:
  """A new collective instance key, unique in the default graph."""
  state = _state.of()
  state.last_instance += 1
  return state.last_instance


def group_of(devices: Sequence[str], num_workers: int) -> Tuple[int, int]:
  """``(group_size, group_key)`` of a collective over `devices`: theirs,
  or, for towers of several workers, theirs on every worker."""
  everyone = [_devices.canonical(d) for d in devices] if num_workers == 1 \
      else [p for d in devices for p in _peers(d, num_workers)]
  return len(everyone), _group_key(everyone)


def _peers(device: str, num_workers: int) -> List[str]:
  """`device` on each of the `num_workers` tasks of its job, task 0 first."""
  spec = tf.DeviceSpec.from_string(_devices.canonical(device))
  return [spec.replace(task=k).to_string() for k in range(num_workers)]


def _group_key(devices: Sequence[str]) -> int:
  """The group key of exactly `devices`, whatever their order; kept
  distinct from the other groups of the default graph."""
  names = tuple(sorted(_devices.canonical(d) for d in devices))
  keys = _state.of().group_keys
  key = zlib.crc32(",".join(names).encode()) & 0x3FFFFFFF
  while keys.setdefault(key + 1, names) != names:
    key += 1
  return key + 1


def member(tensor: tf.Tensor, group_size: int, group: int,
           instance: int, mean: bool = False) -> tf.Tensor:
  """One device's ``CollectiveReduceV2`` (the sum, or with `mean` the sum
  divided by `group_size`) of a group, with the NCCL hint; build it under
  that device. It returns only once every member of the group has run: tie
  what reads it to all of them."""
  return _tf_versions.collective_reduce(tensor, group_size, group, instance,
                                       mean, "nccl")


class LaunchOrder:
  """The last collective launched on each device, for the next to wait for.

  One per set of towers: their cross-tower sums, then their gradients'
  all-reduce (which `continued` starts from where the sums left off). A
  set of towers defers the order of its sums (`deferred`) until `seal`
  knows which step runs each: with several losses, a step must not wait
  for a sum only another loss's step runs (and for that loss's inputs).
  Its `workers` are those the set's collectives span.
  """

  def __init__(self, last: Optional[Dict[str, tf.Operation]] = None,
               deferred: bool = False,
               workers: _workers.Workers = _workers.ONE):
    self.workers = workers
    self._last: Dict[str, tf.Operation] = dict(last or {})
    # Deferred: each device's members, in the order made; sealed: each
    # member's place in its device's order.
    self._made: Optional[Dict[str, List[tf.Operation]]] = (
        {} if deferred else None)
    self._rank: Dict[tf.Operation, int] = {}

  def __bool__(self) -> bool:
    return bool(self._last)

  def continued(self, tensors: Sequence[object] = ()) -> "LaunchOrder":
    """A new order whose first collectives wait for this one's last: of
    those running `tensors` runs, when steps run different ones."""
    if not self._rank:
      return LaunchOrder(self._last, workers=self.workers)
    ran = _graph.upstream(tensors)
    last = {}
    for device, ops in (self._made or {}).items():
      mine = [op for op in ops if op in ran]
      if mine:
        last[device] = max(mine, key=self._rank.__getitem__)
    return LaunchOrder(last, workers=self.workers)

  def launch(self, device: str, build: Callable[[], tf.Tensor],
             after: Sequence[tf.Operation] = ()) -> tf.Tensor:
    """Builds ``build()`` on `device` after the device's last collective
    (and `after`), and makes it the device's last."""
    spelled = _devices.canonical(device)
    previous = self._last.get(spelled) if self._made is None else None
    waits = ([previous] if previous is not None else []) + list(after)
    with tf.device(device), tf.control_dependencies(waits):
      output = build()
    self._last[spelled] = output.op
    if self._made is not None:
      self._made.setdefault(spelled, []).append(output.op)
    return output

  def seal(self, steps: Optional[Sequence[Sequence[object]]] = None) -> None:
    """Orders the deferred members on each device, so that every step
    launches those it runs in one order and waits for no other.

    `steps` are the roots of each step (a loss's losses, gradients and
    update ops); None is one step running them all, in the order made. A
    member that more steps run comes first (what it reads, those steps run
    too); each waits for the last before it of every step that runs it.
    """
    runs = [_graph.upstream(roots) for roots in steps] if steps else []
    for device, ops in (self._made or {}).items():
      made = {op: i for i, op in enumerate(ops)}
      # A member no step runs gets a step of its own, last.
      keys = {op: tuple(i for i, ran in enumerate(runs) if op in ran) or (
          len(runs),) for op in ops}
      ordered = sorted(ops, key=lambda op: (-len(keys[op]), keys[op],
                                            made[op]))
      last: Dict[int, tf.Operation] = {}
      for rank, op in enumerate(ordered):
        if len(runs) > 1:
          self._rank[op] = rank
        for previous in {last[k] for k in keys[op] if k in last}:
          _tf_internals.add_control_input(op, previous)
        last.update((k, op) for k in keys[op])
      self._last[device] = ordered[-1]
