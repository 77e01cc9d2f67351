"""Replaying a subgraph on other inputs: copy 0's transformation, per copy.

Replicated towers leave each copy's averaged gradients on its own device,
bitwise equal to copy 0's. What a user does to copy 0's averaged pairs before
applying them (clipping by global norm, scaling, filtering) is a subgraph
from those tensors to the ones applied. Built again from copy ``i``'s
averaged gradients, on copy ``i``'s device, it gives copy ``i`` the same
update without moving a gradient between devices.

Only the ops between the replaced tensors and the targets are built again.
Every other input (a learning rate, a constant, a global step) is shared, and
so are ops that read only a replaced tensor's shape: the copies' shapes are
copy 0's, and a random op fed by a shape then draws once for every copy.
"""

from typing import Dict, List, Sequence, Set

import tensorflow.compat.v1 as tf

from towers import _tf_internals

# Ops whose output depends on their input's shape, not its values.
SHAPE_OPS = frozenset(["Shape", "ShapeN", "Size", "Rank"])
# Stateful ops that are safe to run once per copy: they only read or check.
READ_ONLY = frozenset(
    ["ReadVariableOp", "Assert", "Print", "PrintV2", "CheckNumerics"])
LOOP_OPS = frozenset(["Enter", "RefEnter", "Exit", "RefExit", "NextIteration",
                      "RefNextIteration", "LoopCond"])


def replay(targets: Sequence[tf.Tensor], replaced: Dict[str, tf.Tensor],
           device: str, prefix: str, after: int = 0) -> List[tf.Tensor]:
  """Returns `targets` computed again with some tensors replaced.

  An op with side effects (a ``tf.numpy_function``, an assign) or of a
  ``tf.while_loop`` cannot be built again: it would run once more, or join
  the loop's frame. A target computed through one is returned as it is
  (computed once, and read from its device).

  Args:
    targets: the tensors to compute again.
    replaced: tensor name -> the tensor standing in for it.
    device: where the ops built again run.
    prefix: the name scope they are built under, such as ``'replica_1/'``.
    after: the id of the last op that is never built again (the model and
      the averaging: only the transformation after it is).

  Returns:
    One tensor per target: the target itself where it does not depend on a
    replaced tensor, or depends on one through an op that cannot be built
    again.
  """
  order = _ops_between(targets, replaced, after)
  blocked: Set[str] = set()
  for op in order:
    if not _replayable(op) or any(t.op.name in blocked for t in op.inputs):
      blocked.add(op.name)
  graph = tf.get_default_graph()
  context = _tf_internals.control_flow_context(graph)
  built: Dict[str, tf.Tensor] = dict(replaced)
  ops: Dict[str, tf.Operation] = {}
  for op in order:
    if op.name in blocked:
      continue
    inputs = [built.get(t.name, t) for t in op.inputs]
    controls = [ops.get(c.name, c) for c in op.control_inputs]
    # No outer control dependency: the op waits for what the original waited
    # for, no more. It stays in the caller's condition, if any (an
    # accumulated step's apply).
    with tf.control_dependencies(None), _tf_internals.entered(
        graph, context), tf.control_dependencies(controls), \
        tf.device(device), tf.name_scope(None):
      new = _tf_internals.copy_op(op, inputs, prefix + op.name)
    ops[op.name] = new
    built.update((old.name, t) for old, t in zip(op.outputs, new.outputs))
  return [t if t.op.name in blocked else built.get(t.name, t)
          for t in targets]


def _ops_between(targets: Sequence[tf.Tensor], replaced: Dict[str, tf.Tensor],
                 after: int) -> List[tf.Operation]:
  """The ops made after op `after` that some target depends on through a
  replaced tensor, inputs first: an iterative depth-first walk from the
  targets over data inputs."""
  depends: Dict[str, bool] = {}
  order: List[tf.Operation] = []
  on_path: Set[str] = set()
  for target in targets:
    if target.name in replaced:
      continue
    stack = [(target.op, False)]
    while stack:
      op, expanded = stack.pop()
      if op.name in depends:
        continue
      old = _tf_internals.creation_index(op) <= after
      inputs = [] if op.type in SHAPE_OPS or old else list(op.inputs)
      if not expanded:
        on_path.add(op.name)
        stack.append((op, True))
        stack.extend((t.op, False) for t in inputs
                     if t.name not in replaced and t.op.name not in depends
                     and t.op.name not in on_path)
        continue
      on_path.discard(op.name)
      depends[op.name] = any(
          t.name in replaced or depends.get(t.op.name, False) for t in inputs)
      if depends[op.name]:
        order.append(op)
  return order


def _replayable(op: tf.Operation) -> bool:
  return op.type not in LOOP_OPS and (
      not op.op_def.is_stateful or op.type in READ_ONLY)
