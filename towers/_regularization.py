"""Weight decay next to its variable: a tower's gradient split in two parts.

A tower's loss often adds a term computed from variables alone: the
regularization losses ``tf.get_variable(..., regularizer=...)`` makes beside
each variable, or the CIFAR-10 tutorial's ``wd * tf.nn.l2_loss(weights)``
inside the model. Computed in every tower, under the tower's device, it and
its gradient read each of its variables a second time on the tower (under
resource variables each read is a tensor of its own): one more copy of every
regularized variable per tower and step than the design's one.

So, once a tower's loss is built, the ops of such a term that nothing else
of the tower uses move to the device of the variable they read (`place`),
and once its gradients are built, so do their gradients; a variable's
gradient that TensorFlow summed from both parts (the ``AddN`` at the
variable) is recorded with its parts (`split`). `average_gradients` then
moves that sum next to the variable too, where it reduces the towers'
gradients (the same sum, so the same result), or, reducing on another
device (a parameter-server worker's), averages the data parts there and
adds the weight decay next to the variable. Replicated towers keep their
weight decay where the model puts it: each copy is on its tower already.
"""

import re
from typing import Dict, List, Optional, Sequence, Tuple

import tensorflow.compat.v1 as tf

from towers import _allreduce
from towers import _isolation
from towers import _reduction
from towers import _state
from towers import _tf_internals

_SUMS = frozenset(["AddN", "AddV2", "Add"])
# A gradient op's name: <scope>/gradients[_k]/<forward op>_grad[_k]/...
_GRADIENT_OF = re.compile(r"(?:^|/)gradients(?:_\d+)?/(.+?)_grad(?:_\d+)?/")

Parts = Tuple[tf.Tensor, List[tf.Tensor]]


def place(losses: Sequence[tf.Tensor], batch: object,
          scope: str) -> Dict[str, str]:
  """Moves the variables-only terms of a tower's losses next to their
  variables.

  A term is a scalar computed from variables and constants alone that an op
  computed from data reads (``loss = xent + decay``). An op of it moves if
  the term is all that reads it (a weight cast the model also reads stays on
  the tower), to the device of the variables it reads.

  Returns:
    {forward op name: device} of the term ops, moved or already there (the
    variables' reads among them).
  """
  graph = tf.get_default_graph()
  starts = [t for t in tf.nest.flatten(batch) if isinstance(t, tf.Tensor)]
  # The tower's own sources of data, and placeholders wherever they are.
  starts += [t for op in graph.get_operations()
             if _isolation.is_source(op) and (
                 op.name.startswith(scope) or op.type.startswith(
                     "Placeholder")) for t in op.outputs]
  data = _isolation.descendants(starts) | {loss.op for loss in losses}
  reached = {op for loss in losses for op in _isolation.ancestors(loss.op)}
  free = sorted((op for op in reached if op not in data),
                key=_tf_internals.creation_index)
  names = {op.name for op in free}
  # Consumers first: an op is part of a term if data reads it as a scalar,
  # or if it feeds only ops of terms.
  term = set()
  for op in reversed(free):
    consumers = [c for t in op.outputs for c in t.consumers()]
    if not op.inputs or _tf_internals.in_control_flow(op) or not consumers:
      continue
    if all(c.name in term for c in consumers) or (
        all(t.shape.rank == 0 for t in op.outputs) and
        any(c.name not in names for c in consumers)):
      term.add(op.name)
  devices: Dict[str, str] = {}

  def home(op: tf.Operation) -> str:
    """Where a term's input is: a read is next to its variable."""
    if op.name in devices:
      return devices[op.name]
    return next((t.op.device for t in op.inputs
                 if _isolation.is_variable(t)), "")

  # Inputs first: an op goes where its inputs' variables are.
  for op in free:
    if op.name not in term:
      continue
    if any(_isolation.is_variable(t) for t in op.inputs):
      # A read: TensorFlow places it with its variable.
      devices[op.name] = home(op)
      continue
    device = next((d for d in (home(t.op) for t in op.inputs) if d), "")
    if device:
      devices[op.name] = device
      _tf_internals.set_device(op, device)
  return devices


def split(grads_and_vars: Sequence[Tuple[object, tf.Variable]], after: int,
          terms: Dict[str, str]) -> None:
  """Moves the gradients of `terms` (`place`) next to their variables and
  records each gradient summed from both parts.

  Args:
    grads_and_vars: the tower's pairs, built by ops made after op `after`.
    after: the id of the last op made before the tower's gradients.
    terms: {forward op name: device}, as `place` returns it.
  """
  if not terms:
    return
  moved = set()
  for op in _tf_internals.made_after(after):
    found = _GRADIENT_OF.search(op.name)
    device = terms.get(found.group(1)) if found else None
    if device:
      moved.add(op.name)
      _tf_internals.set_device(op, device)
  for grad, _ in grads_and_vars:
    if not isinstance(grad, tf.Tensor) or grad.op.type not in _SUMS or \
        grad.op.name in moved:
      continue
    data = [t for t in grad.op.inputs if t.op.name not in moved]
    decay = [t for t in grad.op.inputs if t.op.name in moved]
    if data and decay:
      record(grad, data, decay)
      # TensorFlow colocates the sum with its first input, which the
      # placer then holds the moved part to, wherever it was put.
      _tf_internals.clear_colocation(grad.op)


def record(grad: tf.Tensor, data: List[tf.Tensor],
           decay: List[tf.Tensor]) -> None:
  """Records that `grad` is the sum of `data` and `decay` (for `parts`)."""
  if len(data) > 1:
    with tf.device(grad.device):
      data_part = tf.add_n(data)
  else:
    data_part = data[0]
  _state.of(grad.graph).weight_decay[grad.name] = (data_part, decay)


def parts(grad) -> Optional[Parts]:
  """``(data part, weight-decay parts)`` of a recorded gradient, or None."""
  if not isinstance(grad, tf.Tensor):
    return None
  return _state.of(grad.graph).weight_decay.get(grad.name)


def without_weight_decay(tower_grads: Sequence[Sequence[Tuple[object, object]]],
                         device: Optional[str]):
  """Places weight decay's share of the towers' gradients for their
  reduction next to its variables.

  Where a shared variable's gradient is, in every tower, a data part plus
  weight decay computed next to the variable: reduced there, each tower's
  sum moves there too (the data part crosses as the whole did, the same
  sum); reduced on `device`, the data parts are, and the weight decay is
  added next to the variable afterwards (`add_weight_decay`).

  Returns:
    The pairs to reduce, and {position: [num_towers] weight-decay parts}
    to add after the reduction.
  """
  decay: Dict[int, List[List[tf.Tensor]]] = {}
  data: Dict[Tuple[int, int], tf.Tensor] = {}
  for i, pairs in enumerate(zip(*tower_grads)):
    home = pairs[0][1].device
    if any(v is not pairs[0][1] for _, v in pairs):
      continue  # Copies: each tower's weight decay is its own copy's.
    split_parts = [parts(g) for g, _ in pairs]
    if not all(p is not None and all(t.device == home for t in p[1])
               for p in split_parts):
      continue
    if device is None:
      for grad, _ in pairs:
        _tf_internals.set_device(grad.op, home)
      continue
    decay[i] = [p[1] for p in split_parts if p is not None]
    data.update(((j, i), p[0]) for j, p in enumerate(split_parts)
                if p is not None)
  if not decay:
    return tower_grads, decay
  return [[(data.get((j, i), g), v) for i, (g, v) in enumerate(tower)]
          for j, tower in enumerate(tower_grads)], decay


def add_weight_decay(results: List[Optional[_reduction.Gradient]],
                     decay: List[List[tf.Tensor]],
                     position: _reduction.VariableGrads,
                     weights: List[_reduction.Weight], uniform: bool
                    ) -> List[Optional[_reduction.Gradient]]:
  """Adds the towers' weight-decay parts, averaged next to the variable, to
  each averaged data part, there (next to each copy, when replicated)."""
  with tf.device(position.variables[0].device), tf.name_scope("weight_decay"):
    per_tower = [_allreduce.sum_in_order(p) for p in decay]
    if not uniform:
      per_tower = [_reduction.scaled(t, w) for t, w in zip(per_tower, weights)]
    total = _tf_internals.apart_from_sums(_reduction.combine(
        per_tower, _allreduce.sum_in_order, uniform))
  homes = position.variables[:1] if position.shared else position.variables
  done: Dict[int, _reduction.Gradient] = {}
  for result, var in zip(results, homes):
    if id(result) not in done:
      with tf.device(var.device):
        done[id(result)] = tf.add(
            _tf_internals.apart_from_sums(tf.convert_to_tensor(result)), total)
  return [done[id(result)] for result in results]
