"""Devices for machines with fewer GPUs than towers: virtual CPU devices."""

import operator
from typing import List, Optional

import numpy as np
import tensorflow.compat.v1 as tf

from towers import _tf_versions


def check_count(name: str, value: int) -> int:
  """Returns `value` as an int if it is a positive integer (NumPy's too).

  Bools and floats are refused even where they equal an integer: ``True``
  towers or ``2.0`` towers is a mistake, not a count.
  """
  if isinstance(value, (bool, np.bool_)):
    raise TypeError("expected %s to be a positive int, got %r" % (name, value))
  try:
    count = operator.index(value)
  except TypeError:
    raise TypeError("expected %s to be a positive int, got %r"
                    % (name, value)) from None
  if count < 1:
    raise ValueError("expected %s to be a positive int, got %d" % (name, count))
  return count


def canonical(device: str) -> str:
  """`device` with its type in capitals: one spelling per device."""
  spec = tf.DeviceSpec.from_string(device)
  return spec.replace(device_type=(spec.device_type or "").upper()).to_string()


def host(device: str) -> str:
  """The CPU of `device`'s task."""
  spec = tf.DeviceSpec.from_string(device)
  return spec.replace(device_type="CPU", device_index=0).to_string()


def virtual_cpu_config(num_cpus: int, **config_kwargs) -> tf.ConfigProto:
  """Returns a session config with `num_cpus` virtual CPU devices.

  The devices are ``/cpu:0`` to ``/cpu:{num_cpus - 1}``; they share the
  machine's cores and one thread pool, so they show placement and correctness,
  not speed. Soft placement is on, so ops pinned to a GPU fall back to a CPU
  on a machine without one.

  Args:
    num_cpus: how many CPU devices the session sees.
    **config_kwargs: further ``tf.ConfigProto`` fields (for example
      ``log_device_placement=True``); they win over the defaults above.

  Returns:
    A ``tf.ConfigProto`` for ``tf.Session`` or ``MonitoredTrainingSession``.

  Raises:
    TypeError, ValueError: if `num_cpus` is not a positive int.
  """
  num_cpus = check_count("num_cpus", num_cpus)
  config_kwargs.setdefault("allow_soft_placement", True)
  return tf.ConfigProto(device_count={"CPU": num_cpus}, **config_kwargs)


def tower_devices(num_towers: int, *, task: Optional[str] = None
                 ) -> List[str]:
  """Lists one device per tower: GPUs when that many are visible, else CPUs.

  With at least `num_towers` visible GPUs the result is ``['/gpu:0', ...]``;
  with none, ``['/cpu:0', ..., '/cpu:{num_towers - 1}']``, which exist only
  in a session made with ``virtual_cpu_config(num_towers)``. It asks the
  runtime for this machine's physical devices and does nothing else. The
  default devices of `build_towers` and `infer`.

  Args:
    num_towers: the number of towers.
    task: a task prefix for between-graph replication, such as
      ``'/job:worker/task:1'``; the devices are then that task's.

  Returns:
    A list of `num_towers` device strings.

  Raises:
    TypeError: if `num_towers` is not an int.
    ValueError: if it is not positive, or some GPUs are visible but fewer
      than `num_towers` (a tower per GPU is what was meant).
  """
  num_towers = check_count("num_towers", num_towers)
  gpus = _tf_versions.physical_gpus()
  if 0 < len(gpus) < num_towers:
    raise ValueError(
        "%d towers but %d GPU(s) visible (%s): the towers would not each "
        "have a GPU. Build %d towers, make the other GPUs visible "
        "(CUDA_VISIBLE_DEVICES), or pass devices= yourself"
        % (num_towers, len(gpus), ", ".join(g.name for g in gpus),
           len(gpus)))
  kind = "gpu" if gpus else "cpu"
  prefix = (task or "").rstrip("/")
  return ["%s/%s:%d" % (prefix, kind, i) for i in range(num_towers)]
