"""TensorFlow's collective ops as towers builds them: keys, members, order.

A collective (``CollectiveReduceV2`` and its kin) has one member per device
of its group, and each member returns only once every member has run. Three
rules keep them from hanging:

- Keys. A group's key names its members, not the order groups were made
  in, so every worker of a cluster derives the same key for the same
  devices, and a group of one worker's devices never takes another's key.
  Instance keys are unique in the graph.
- Members. In a worker's graph (`_workers`) a group over some devices has a
  member on that device of every worker; each worker builds its own.
- Launch order. On each device the collectives of one set of towers launch
  in the order they were built (a control edge from the previous one): NCCL
  deadlocks when two devices launch two collectives in opposite orders.
"""

import zlib
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import tensorflow.compat.v1 as tf

from towers import _devices
from towers import _state
from towers import _tf_versions
from towers import _workers


def instance_key() -> int:
  """A new collective instance key, unique in the default graph."""
  state = _state.of()
  state.last_instance += 1
  return state.last_instance


def group_of(devices: Sequence[str]) -> Tuple[int, int]:
  """``(group_size, group_key)`` of a collective over `devices`: theirs,
  or, in a worker's graph, theirs on every worker."""
  workers = _workers.count()
  everyone = [_devices.canonical(d) for d in devices] if workers == 1 else [
      p for d in devices for p in _peers(d, workers)]
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
  all-reduce (which `continued` starts from where the sums left off).
  """

  def __init__(self, last: Optional[Dict[str, tf.Operation]] = None):
    self._last: Dict[str, tf.Operation] = dict(last or {})

  def __bool__(self) -> bool:
    return bool(self._last)

  def continued(self) -> "LaunchOrder":
    """A new order whose first collectives wait for this one's last."""
    return LaunchOrder(self._last)

  def launch(self, device: str, build: Callable[[], tf.Tensor],
             after: Sequence[tf.Operation] = ()) -> tf.Tensor:
    """Builds ``build()`` on `device` after the device's last collective
    (and `after`), and makes it the device's last."""
    spelled = _devices.canonical(device)
    previous = self._last.get(spelled)
    waits = ([previous] if previous is not None else []) + list(after)
    with tf.device(device), tf.control_dependencies(waits):
      output = build()
    self._last[spelled] = output.op
    return output
