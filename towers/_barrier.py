"""The barrier: no variable's update starts before every tower has read it.

With resource variables that is exactly the reads: an update copies a buffer
an earlier read still holds, so the reads' values stay the step's
(TensorFlow's copy-on-write). Each variable's reduction then waits for its
own reads in every tower (and for the losses and update ops the caller
names), and its update overlaps the rest of backprop. A ref variable's read
is the buffer itself, which an in-place update changes under every op still
to use it, so with ref variables (or a handle passed on into a v1
control-flow loop, whose reads cannot be waited for from outside it) every
reduction waits for every gradient of every tower: the ``GATE_GRAPH``
guarantee across towers.
"""

from typing import Callable, Dict, List, Optional, Sequence

import tensorflow.compat.v1 as tf

from towers import _graph

Waits = Callable[[Sequence[tf.Variable]], List[tf.Operation]]


def barrier(flat: List[object], control_inputs: List[object],
            variables: Sequence[tf.Variable]) -> Waits:
  """Returns what the reduction of some variables' gradients waits for.

  `flat` holds every tensor the reductions read (the towers' gradients) and
  `control_inputs`; the result maps a list of `variables` to the ops their
  reduction must wait for.
  """
  if not flat:
    return lambda _: []
  reads = _reads(flat, variables)
  if reads is None:
    # One NoOp per device, then one root: tf.group keeps the cross-device
    # control edges to one per device instead of one per gradient.
    everything = [tf.group(*flat, name="all_towers_done")]
    return lambda _: everything
  common = [tf.group(*control_inputs, name="losses_and_updates_done")
           ] if control_inputs else []

  def waits(of: Sequence[tf.Variable]) -> List[tf.Operation]:
    ops = list(common)
    for var in {id(v): v for v in of}.values():
      ops.extend(reads[id(var)])
    return ops

  return waits


def _reads(flat: List[object], variables: Sequence[tf.Variable]
          ) -> Optional[Dict[int, List[tf.Operation]]]:
  """The ops reading each resource variable that the step runs, or None.

  None when a variable is not a resource variable, or its handle is passed
  on (an ``Enter`` or ``Identity`` of it) by an op the step runs.
  """
  if any(getattr(v, "op", None) is None or v.op.type != "VarHandleOp"
         for v in variables):
    return None
  # Tensors, ops, or what tf.group also takes (an assign's unread variable).
  runs = _graph.upstream(flat)
  reads = {}
  for var in variables:
    ops = [c for c in var.op.outputs[0].consumers() if c in runs]
    if any(t.dtype == tf.resource for c in ops for t in c.outputs):
      return None
    reads[id(var)] = ops
  return reads
