"""Broadcast from the chief: every worker starts from worker 0's values."""

import collections
import functools
from typing import Dict, List, Optional, Sequence

import tensorflow.compat.v1 as tf

from towers import _collectives
from towers import _copies
from towers import _shares
from towers import _tf_versions


def broadcast_variables(var_list: Optional[Sequence[tf.Variable]] = None
                       ) -> tf.Operation:
  """Returns an op that gives every worker the chief's variables.

  For towers built with ``num_workers > 1``: run by every worker together
  (a collective), worker 0 (the chief) sends each variable of `var_list`,
  one tensor per dtype, and the others assign it; then every worker sets
  its replicated copies and their slots from copy 0 again. Run it after
  initialization or the chief's restore and after the local init op, as a
  ``tf.train.Scaffold``'s local init op (docs/api.md has the long form)::

    with tf.control_dependencies([tf.train.Scaffold.default_local_init_op()]):
      sync = towers.broadcast_variables()
    scaffold = tf.train.Scaffold(local_init_op=sync)

  Build it once the graph holds every variable (after `minimize`, the global
  step, moving averages), in the same order on every worker.

  Args:
    var_list: the variables to send; default ``tf.global_variables()``.

  Returns:
    The op; on a graph of one worker, a no-op.

  Raises:
    ValueError: if `var_list` names a variable whose shape is not fully
      defined.
    TypeError: if `var_list` holds something other than variables.
  """
  workers = _shares.graph_workers()
  if var_list is None:
    var_list = tf.global_variables()
  var_list = list(var_list)
  for var in var_list:
    if getattr(var, "op", None) is None or not hasattr(var, "assign"):
      raise TypeError("expected var_list to hold variables, got %r" % (var,))
    if not var.shape.is_fully_defined():
      raise ValueError(
          "broadcast_variables sends %s, whose shape %s is not fully "
          "defined; leave it out of var_list or give it a static shape"
          % (var.op.name, var.shape))
  with tf.name_scope("broadcast_variables"):
    if workers.num_workers == 1:
      return tf.no_op(name="one_worker")
    home = workers.home
    chief = tf.DeviceSpec.from_string(home).task == 0
    by_dtype: Dict[tf.DType, List[tf.Variable]] = collections.defaultdict(
        list)
    for var in sorted(var_list, key=lambda v: v.op.name):
      by_dtype[var.dtype.base_dtype].append(var)
    size, group = _collectives.group_of([home], workers.num_workers)
    order = _collectives.LaunchOrder(workers=workers)
    assigns: List[tf.Operation] = []
    previous: List[tf.Operation] = []
    for dtype in sorted(by_dtype, key=lambda d: d.name):
      variables = by_dtype[dtype]
      sizes = [v.shape.num_elements() for v in variables]
      instance = _collectives.instance_key()
      if chief:
        with tf.device(home):
          values = tf.concat([tf.reshape(v.read_value(), [-1])
                              for v in variables], 0)
        sent = order.launch(home, functools.partial(
            _tf_versions.broadcast_send, values, size, group, instance))
        previous = [sent.op]
        continue
      received = order.launch(home, functools.partial(
          _tf_versions.broadcast_recv, dtype, [sum(sizes)], size, group,
          instance))
      previous = [received.op]
      with tf.device(home):
        parts = tf.split(received, sizes)
      for var, part in zip(variables, parts):
        with tf.device(var.device):
          assigns.append(var.assign(tf.reshape(part, var.shape)).op)
    # The copies (and their slots) read copy 0 after it has its new value.
    with tf.control_dependencies(assigns + previous):
      copies = [copy.assign(source.read_value()).op
                for copy, source in _copies.sources()]
    return tf.group(assigns + previous + copies, name="broadcast")
