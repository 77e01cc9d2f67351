"""Workers: towers on several machines that all-reduce as one group.

With ``build_towers(..., num_workers=W)`` every worker task (a process with
its own ``tf.train.Server``, between-graph replication) builds the same
graph over its own devices, ``/job:<job>/task:<k>/...``. Its tower devices
are recorded in the graph's state with the number of workers; a collective
over them (the gradients' all-reduce, a synchronized batch norm's sums) then
has one member per tower device of *every* worker (`_collectives`). Each
worker builds only its own members; TensorFlow's runtime joins them through
the group leader (task 0, named in
``ConfigProto.experimental.collective_group_leader``).
"""

import numbers
from typing import Sequence

import tensorflow.compat.v1 as tf

from towers import _devices
from towers import _tf_versions
from towers import _state


def check_count(num_workers: object) -> int:
  """Returns `num_workers` if it is an int of at least 1.

  Raises:
    TypeError: if `num_workers` is not an int.
    ValueError: if it is below 1.
  """
  if isinstance(num_workers, bool) or not isinstance(num_workers,
                                                     numbers.Integral):
    raise TypeError("expected num_workers to be an int, got %r"
                    % (num_workers,))
  num_workers = int(num_workers)
  if num_workers < 1:
    raise ValueError("expected num_workers >= 1 (the worker tasks that "
                     "all-reduce together), got %d" % num_workers)
  return num_workers


def check_tasks(num_workers: int, devices: Sequence[str]) -> None:
  """Raises unless towers on `devices` can be one of `num_workers` workers.

  Raises:
    ValueError: above 1 worker, if the devices do not all name the same job
      and task, or a task outside the workers; or if this TensorFlow's
      collectives would wait forever for a worker that never comes.
  """
  if num_workers == 1:
    return
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
  if not _tf_versions.collectives_time_out():
    raise ValueError(
        "num_workers=%d all-reduces across workers with TensorFlow's "
        "collective ops, which on %s wait forever for a worker that never "
        "comes (they ignore operation_timeout_in_ms): use TensorFlow 2.12 or "
        "later, or parameter servers (num_workers=1 with "
        "tf.train.replica_device_setter)"
        % (num_workers, _tf_versions.describe()))


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
  state = _state.of()
  mine = (num_workers, tuple(_devices.canonical(d) for d in devices))
  if state.num_workers == 1:
    state.num_workers, state.worker_devices = mine
  registered = (state.num_workers, state.worker_devices)
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
  return _state.of().num_workers


def home() -> str:
  """This worker's first tower device (where a gradient shared by its
  towers is all-reduced with the other workers); only with workers."""
  return _state.of().worker_devices[0]
