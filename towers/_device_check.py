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
Without soft placement a session refuses the graph instead, naming the first
op it meets on a device it lacks: the check is built before the towers, and
each tower's write is named for the fix.
"""

import uuid
from typing import List, Optional, Sequence

import tensorflow.compat.v1 as tf

from towers import _devices
from towers import _placement
from towers import _tf_internals


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
    for i, (device, number) in enumerate(zip(devices, expected)):
      # The value is an ordinary op of the tower, placed as the tower's ops
      # are (the caller's device scopes included); the variable goes there.
      with _placement.tower_placement(device, placer):
        value = tf.constant(float(number))
      with tf.device(None), tf.device(value.device):
        handle = tf.raw_ops.VarHandleOp(dtype=tf.float32, shape=[],
                                        shared_name=shared_name)
        writes.append(tf.raw_ops.AssignVariableOp(
            resource=handle, value=value,
            name=_write_name(i, value.device, len(devices))))
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
      check = tf.debugging.Assert(
          apart, [_shared_message(devices, expected, found)], summarize=1)
  # The towers' ops take it as a control input (`gate`), which TensorFlow's
  # "never used" warning at garbage collection does not see.
  check.mark_used()
  return check


def _write_name(index: int, device: str, num_towers: int) -> str:
  """The name of tower `index`'s write: its fix, for a session without it.

  Without soft placement a session refuses a graph with an op on a device it
  lacks, naming the first such op it meets: this write, the first op of each
  tower that is no constant, and the first the towers build.
  """
  spec = tf.DeviceSpec.from_string(device or "")
  kind = (spec.device_type or "").upper()
  if kind == "CPU":
    fix = "make_the_session_with_towers.virtual_cpu_config_%d" % num_towers
  else:
    fix = "give_the_session_every_tower_device_or_build_fewer_towers"
  needs = "%s_%d" % (kind, spec.device_index or 0) if kind else "its_device"
  return "tower_%d_needs_%s.%s" % (index, needs, fix)


def _shared_message(devices: Sequence[str], expected: Sequence[int],
                    found: tf.Tensor) -> tf.Tensor:
  """The check's error: which towers shared a device, and the fix."""
  n = len(devices)
  # pairs[i][j]: what tower i reading tower j's number says, "" for its own.
  pairs = [["" if j == expected[i] else "tower %d (%s) with tower %d (%s); "
            % (i, devices[i], j, devices[j]) for j in range(n)]
           for i in range(n)]
  said = tf.gather_nd(tf.constant(pairs),
                      tf.stack([tf.range(n), found], axis=1))
  shared = tf.strings.regex_replace(tf.strings.reduce_join(said), "; $", "")
  return tf.strings.join([
      "towers shared a device: ", shared, ". The session lacks some of "
      "the tower devices (%s) and soft placement moved those towers onto "
      "devices it has, where a cross-tower collective would wait forever: "
      "give the session every tower device (virtual CPU devices: "
      "config=towers.virtual_cpu_config(%d)), or build as many towers as it "
      "has devices" % (", ".join(devices), n)])


def gate(tensor: tf.Tensor, check: Optional[tf.Operation]) -> tf.Tensor:
  """`tensor`, computed only once `check` has passed.

  A control input of its own op, not an identity after it: the graph's
  arithmetic, and so what Grappler makes of it, stays the model's.
  """
  if check is not None:
    _tf_internals.add_control_input(tensor.op, check)
  return tensor
