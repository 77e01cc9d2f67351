"""Workers: towers on several machines that all-reduce as one group.

With ``build_towers(..., num_workers=W)`` every worker task (a process with
its own ``tf.train.Server``, between-graph replication) builds the same
graph over its own devices, ``/job:<job>/task:<k>/...``. The plan holds the
number of workers (`Workers`), and the collectives of its towers take it: a
collective over some devices (the gradients' all-reduce, a synchronized
batch norm's sums) then has one member per device of *every* worker
(`_collectives`). Each worker builds only its own members; TensorFlow's
runtime joins them through the group leader (task 0, named in
``ConfigProto.experimental.collective_group_leader``).
"""

import numbers
from typing import NamedTuple, Sequence, Tuple

import tensorflow.compat.v1 as tf

from towers import _devices
from towers import _tf_versions


class Workers(NamedTuple):
  """The worker tasks one set of towers' collectives span.

  Attributes:
    num_workers: the number of workers (1: this worker's towers alone).
    devices: with workers, this worker's tower devices, in full; else
      empty.
  """
  num_workers: int = 1
  devices: Tuple[str, ...] = ()

  @property
  def home(self) -> str:
    """This worker's first tower device, where what its towers share is
    all-reduced with the other workers."""
    return self.devices[0]


ONE = Workers()


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


def of(num_workers: int, devices: Sequence[str]) -> Workers:
  """The workers of towers on `devices` (this worker's), one of
  `num_workers`."""
  if num_workers == 1:
    return ONE
  return Workers(num_workers, tuple(_devices.canonical(d) for d in devices))


def check_one_cluster(mine: Workers, built: Workers) -> None:
  """Raises unless towers of workers `mine` fit a graph whose towers were
  `built` of workers: one graph is one worker.

  Raises:
    ValueError: if both are of several workers, and differ.
  """
  if mine.num_workers > 1 and built.num_workers > 1 and mine != built:
    raise ValueError(
        "this graph's towers were already built as one of %d workers on "
        "%s; one graph is one worker: build every tower of it with the "
        "same num_workers and devices (got num_workers=%d on %s)"
        % (built.num_workers, ", ".join(built.devices), mine.num_workers,
           ", ".join(mine.devices)))
