"""Workers: towers on several machines that all-reduce as one group.

With ``build_towers(..., num_workers=W)`` every worker task (a process with
its own ``tf.train.Server``, between-graph replication) builds the same
graph over its own devices, ``/job:<job>/task:<k>/...``. Its tower devices
are registered here, per graph, with the number of workers; a collective
over them (the gradients' all-reduce, a synchronized batch norm's sums) then
has one member per tower device of *every* worker: the same device on tasks
``0..W-1`` of the job. Each worker builds only its own members; TensorFlow's
runtime joins them through the group leader (task 0, named in
``ConfigProto.experimental.collective_group_leader``).

The group key names the group's members, not the order groups were made
in: every worker computes the same key for the cross-worker group, and a
group of one worker's devices only (which the leader also resolves) never
takes another worker's key.
"""

import numbers
import weakref
import zlib
from typing import Dict, List, Sequence, Tuple

import tensorflow.compat.v1 as tf

from towers import _devices

# Per graph: (the number of workers, this worker's tower devices).
_REGISTRY: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
# Per graph: group key -> its members (to keep keys distinct).
_KEYS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def check(num_workers: object, devices: Sequence[str],
          replicated: bool, all_reduce: str) -> int:
  """Returns `num_workers` after checking it fits the towers.

  Raises:
    TypeError: if `num_workers` is not an int.
    ValueError: if it is below 1; or, above 1, if the towers are not
      replicated, reduce with another all-reduce than ``"collective"``, or
      their devices do not all name the same job and task.
  """
  if isinstance(num_workers, bool) or not isinstance(num_workers,
                                                     numbers.Integral):
    raise TypeError("expected num_workers to be an int, got %r"
                    % (num_workers,))
  num_workers = int(num_workers)
  if num_workers < 1:
    raise ValueError("expected num_workers >= 1 (the worker tasks that "
                     "all-reduce together), got %d" % num_workers)
  if num_workers == 1:
    return 1
  if not replicated:
    raise ValueError(
        "num_workers=%d all-reduces the gradients across workers, which "
        "needs each worker to keep its own copies: pass "
        "variable_device='replicated' (or, for variables on parameter "
        "servers, num_workers=1 with tf.train.replica_device_setter)"
        % num_workers)
  if all_reduce not in ("auto", "collective"):
    raise ValueError(
        "num_workers=%d reduces with TensorFlow's collective ops across "
        "workers, but all_reduce=%r; pass all_reduce='collective' or "
        "'auto'" % (num_workers, all_reduce))
  tasks = {_task(d) for d in devices}
  if len(tasks) != 1 or None in tasks:
    raise ValueError(
        "num_workers=%d needs every tower on this worker's own task, named "
        "in full, e.g. devices=towers.tower_devices(n, "
        "task='/job:worker/task:%%d' %% index); got %s"
        % (num_workers, ", ".join(devices)))
  task = tasks.pop()
  if task[1] >= num_workers:
    raise ValueError(
        "the towers are on task %d of job %r, but num_workers=%d names "
        "tasks 0-%d; pass the number of worker tasks in the cluster"
        % (task[1], task[0], num_workers, num_workers - 1))
  return num_workers


def _task(device: str):
  spec = tf.DeviceSpec.from_string(device)
  if spec.job is None or spec.task is None:
    return None
  return (spec.job, spec.task)


def register(devices: Sequence[str], num_workers: int) -> None:
  """Makes the default graph one of `num_workers` workers, whose towers
  are on `devices` (a no-op for one worker).

  Raises:
    ValueError: if the graph already belongs to another cluster shape.
  """
  if num_workers == 1:
    return
  graph = tf.get_default_graph()
  mine = (num_workers, tuple(_devices.canonical(d) for d in devices))
  registered = _REGISTRY.setdefault(graph, mine)
  if registered != mine:
    raise ValueError(
        "this graph's towers were already built as one of %d workers on "
        "%s; one graph is one worker: build every tower of it with the "
        "same num_workers and devices (got num_workers=%d on %s)"
        % (registered[0], ", ".join(registered[1]), num_workers,
           ", ".join(mine[1])))


def count() -> int:
  """The number of workers the default graph's collectives span (1 unless
  `register` made it one of several)."""
  return _REGISTRY.get(tf.get_default_graph(), (1, ()))[0]


def home() -> str:
  """This worker's first tower device (where a gradient shared by its
  towers is all-reduced with the other workers); only with workers."""
  return _REGISTRY[tf.get_default_graph()][1][0]


def _peers(device: str, num_workers: int) -> List[str]:
  """`device` on each of the `num_workers` tasks of its job, task 0 first."""
  spec = tf.DeviceSpec.from_string(_devices.canonical(device))
  return [spec.replace(task=k).to_string() for k in range(num_workers)]


def group(devices: Sequence[str]) -> Tuple[int, int]:
  """``(group_size, group_key)`` of a collective over `devices`: theirs,
  or, in a worker's graph, theirs on every worker."""
  workers = count()
  everyone = [_devices.canonical(d) for d in devices] if workers == 1 else [
      p for d in devices for p in _peers(d, workers)]
  return len(everyone), _group_key(everyone)


def _group_key(devices: Sequence[str]) -> int:
  """The collective group key of exactly `devices`: derived from their
  names, whatever their order, so every worker derives the same one; kept
  distinct from the other groups of the default graph."""
  names = tuple(sorted(_devices.canonical(d) for d in devices))
  keys: Dict[int, Tuple[str, ...]] = _KEYS.setdefault(
      tf.get_default_graph(), {})
  key = zlib.crc32(",".join(names).encode()) & 0x3FFFFFFF
  while keys.setdefault(key + 1, names) != names:
    key += 1
  return key + 1
