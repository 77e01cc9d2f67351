"""Towers kept apart: a check, with every step, that no two share a device.

A session may run an op elsewhere than its device says: soft placement moves
an op whose device the session lacks (a GPU hidden by
``CUDA_VISIBLE_DEVICES``, a CPU beyond the config's ``device_count``) to one
it has, usually another tower's. The towers would then silently share a
device, and a cross-tower collective, one member per device, would wait
forever. Which device an op got is known only once it runs, so the check
runs with the step, before anything that crosses towers:

- each tower writes a number to a scalar resource variable on its device,
  all of them under one shared name, so towers on one device write to one
  variable (towers declared on one device write the same number);
- after every write, each tower reads its variable back: a number that is
  not its own means its device is another tower's, and an assertion fails
  with the devices and the fix.

The towers' losses and cross-tower sums wait for the check, so a step whose
towers share a device ends in that error before any collective launches.
"""

import uuid
from typing import List, Optional, Sequence

import tensorflow.compat.v1 as tf

from towers import _devices
from towers import _placement


def build(devices: Sequence[str], placer: _placement.DeviceFn,
          name: str) -> Optional[tf.Operation]:
  """Returns the check for towers on `devices`, or None if none is needed.

  Args:
    devices: ``[num_towers]`` tower devices, as the towers are placed.
    placer: the towers' variable placer (for `_placement.tower_placement`).
    name: the name scope of the check's ops.
  """
  spelled = [_devices.canonical(d) for d in devices]
  # Towers declared on one device share it by intent: each writes the index
  # of the first tower declared there.
  expected = [spelled.index(s) for s in spelled]
  if len(set(expected)) < 2:
    return None
  # Unique per build, so that two graphs in one server never share it.
  shared_name = "towers_device_check_%s" % uuid.uuid4().hex
  handles: List[tf.Tensor] = []
  writes: List[tf.Operation] = []
  with tf.name_scope(name):
    for device, number in zip(devices, expected):
      # The value is an ordinary op of the tower, placed as the tower's ops
      # are (the caller's device scopes included); the variable goes there.
      with _placement.tower_placement(device, placer):
        value = tf.constant(float(number))
      with tf.device(None), tf.device(value.device):
        handle = tf.raw_ops.VarHandleOp(dtype=tf.float32, shape=[],
                                        shared_name=shared_name)
        writes.append(tf.raw_ops.AssignVariableOp(resource=handle,
                                                  value=value))
      handles.append(handle)
    reads = []
    for handle in handles:
      with tf.device(None), tf.device(handle.device), \
          tf.control_dependencies(writes):
        reads.append(tf.raw_ops.ReadVariableOp(resource=handle,
                                               dtype=tf.float32))
    host = tf.DeviceSpec.from_string(handles[0].device).replace(
        device_type="CPU", device_index=0).to_string()
    with tf.device(None), tf.device(host):
      found = tf.cast(tf.stack(reads), tf.int32)
      apart = tf.reduce_all(tf.equal(found, expected))
      check = tf.debugging.Assert(apart, [
          "two towers ran on one device: the session does not have every "
          "tower device (%s), and soft placement moved the towers it lacks "
          "onto devices it has, where they would share one and a "
          "cross-tower collective would wait forever. For each tower, the "
          "tower whose device it ran on (its own index when apart):"
          % ", ".join(devices), found,
          "Give the session every tower device (for virtual CPU devices, "
          "tf.Session(config=towers.virtual_cpu_config(%d))), or build as "
          "many towers as there are devices (towers.tower_devices(n) lists "
          "the visible ones)" % len(devices)], summarize=len(devices))
  # The towers' ops take it as a control input (`gate`), which TensorFlow's
  # "never used" warning at garbage collection does not see.
  check.mark_used()
  return check


def gate(tensor: tf.Tensor, check: Optional[tf.Operation]) -> tf.Tensor:
  """`tensor`, computed only once `check` has passed.

  A control input of its own op, not an identity after it: the graph's
  arithmetic, and so what Grappler makes of it, stays the model's.
  """
  if check is not None:
    tensor.op._add_control_input(check)  # pylint: disable=protected-access
  return tensor
