"""Placement: one device function per tower, with variables routed elsewhere.

The original recipe wraps every variable in ``tf.device('/cpu:0')`` inside the
model (``_variable_on_cpu``). Here the rule lives in one place: a device
function pushed around each tower sends variable ops to the variable device
and every other op to the tower's device, so model code needs no placement of
its own.

Tower-local variables, those created inside a tower in ``LOCAL_VARIABLES``
and not in ``GLOBAL_VARIABLES`` (``tf.metrics`` accumulators, a per-tower
input counter), are the tower's own state, read and updated only by that
tower: they stay on the tower's device, where their reads cost nothing.
"""

import contextlib
from typing import Callable, Dict, Iterator, List, Sequence, Union

import numpy as np
import tensorflow.compat.v1 as tf

DeviceFn = Callable[[tf.Operation], str]
VariableDevice = Union[str, DeviceFn]

REPLICATED = "replicated"
# The modes variable_device names, beside a device string or function.
MODES = ("cpu", "gpu", "balanced", REPLICATED)

# Ops that own variable storage: ref variables (VariableV2 and its ancestors)
# and resource variables (VarHandleOp). Reads, assigns and initializers of a
# resource variable are pinned to its handle's device by TensorFlow itself, and
# a ref variable's initializer is colocated with it, so routing these is enough.
VARIABLE_OPS = frozenset(
    ["Variable", "VariableV2", "AutoReloadVariable", "VarHandleOp"])


def _merge(target: str, op: tf.Operation) -> str:
  """Returns `target` with any device fields the op already has kept.

  An explicit ``tf.device`` in model code (or an op pinned to its resource
  variable's handle) wins over the tower's choice, as with nested
  ``tf.device`` scopes.
  """
  spec = tf.DeviceSpec.from_string(target)
  current = tf.DeviceSpec.from_string(op.device or "")
  return spec.make_merged_spec(current).to_string()


class _Balanced:
  """Greedy least-loaded placement of variables by size in bytes.

  The same greedy rule as tf_cnn_benchmarks' and tensorpack's load balancers:
  each new variable goes to the device holding the fewest bytes so far (ties
  go to the earliest device). Shared by all towers, so each variable is placed
  once, when tower 0 creates it.
  """

  def __init__(self, devices: Sequence[str]):
    self._loads: Dict[str, int] = {d: 0 for d in devices}
    self._order: List[str] = list(devices)

  def __call__(self, op: tf.Operation) -> str:
    device = min(self._order, key=lambda d: self._loads[d])
    self._loads[device] += _variable_bytes(op)
    return device


def _variable_bytes(op: tf.Operation) -> int:
  shape = tf.TensorShape(op.get_attr("shape"))
  dtype = tf.as_dtype(op.get_attr("dtype")).base_dtype
  # An unknown dimension counts as 1: the variable still costs something.
  dims = [d if d is not None else 1 for d in (shape.as_list() or [])]
  return int(np.prod(dims, dtype=np.int64)) * dtype.size


def check_variable_device(variable_device: object) -> None:
  """Raises unless `variable_device` is one `variable_placer` takes.

  Raises:
    TypeError: if it is neither a string nor callable.
    ValueError: if the string is not a mode or a valid device.
  """
  if callable(variable_device) or (isinstance(variable_device, str) and
                                   variable_device in MODES):
    return
  if not isinstance(variable_device, str):
    raise TypeError(
        "expected variable_device to be 'cpu', 'gpu', 'balanced', "
        "'replicated', a device string or a device function, got %r"
        % (variable_device,))
  try:
    tf.DeviceSpec.from_string(variable_device)
  except ValueError as e:
    raise ValueError(
        "variable_device %r is not 'cpu', 'gpu', 'balanced', 'replicated' or "
        "a valid device string such as '/cpu:0': %s"
        % (variable_device, e)) from None


def variable_placer(variable_device: VariableDevice,
                    devices: Sequence[str]) -> DeviceFn:
  """Returns a function mapping a variable op to its device string.

  Args:
    variable_device: ``"cpu"``, ``"gpu"``, ``"balanced"``, ``"replicated"``
      (copy 0 on the first tower's device), a device string or a device
      function (such as ``tf.train.replica_device_setter(...)``), checked
      by `check_variable_device`.
    devices: the tower devices, ``[num_towers]``.
  """
  if callable(variable_device):
    return variable_device
  if variable_device == "cpu":
    return lambda op: "/device:CPU:0"
  if variable_device in ("gpu", REPLICATED):
    # Replicated: copy 0 and the variables that are not copied live on the
    # first tower's device; the other copies are made on their towers.
    first = devices[0]
    return lambda op: first
  if variable_device == "balanced":
    return _Balanced(devices)
  return lambda op: variable_device


@contextlib.contextmanager
def tower_placement(device: str, placer: DeviceFn) -> Iterator[None]:
  """Places one tower's ops while it is built.

  Variable ops go where `placer` says, except tower-local variables, which
  stay on `device` with every other op. Device fields an op already carries
  (from an inner ``tf.device``) are kept.
  """
  # A variable creator sees the collections a variable joins before its op
  # exists; the device function, which sees only the op, cannot.
  local: List[bool] = []

  def device_fn(op: tf.Operation) -> str:
    if op.type in VARIABLE_OPS and not local:
      return _merge(placer(op), op)
    return _merge(device, op)

  def creator(next_creator, **kwargs):
    collections = kwargs.get("collections") or [tf.GraphKeys.GLOBAL_VARIABLES]
    if (tf.GraphKeys.LOCAL_VARIABLES in collections and
        tf.GraphKeys.GLOBAL_VARIABLES not in collections):
      local.append(True)
      try:
        return next_creator(**kwargs)
      finally:
        local.pop()
    return next_creator(**kwargs)

  with tf.device(device_fn), tf.variable_creator_scope(creator):
    yield
