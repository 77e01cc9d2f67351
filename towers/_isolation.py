"""Each tower's loss reads its own batch, and the towers regularize alike.

Two mistakes make the averaged gradient silently wrong, and both are found
in the graph once the towers are built:

- A tower's loss that reads another tower's data. ``model_fn`` returning
  ``tf.losses.get_total_loss()`` (or the unscoped ``'losses'`` collection)
  sums every loss added so far, so tower 1's loss includes tower 0's: with 2
  towers the average was measured 85% off. A tower's data is everything
  computed from its batch, or from a source of data (placeholder, input
  pipeline, random numbers: a stateful op other than a variable) built in
  its name scope. Ops computed from variables and constants alone, such as
  a regularization loss tower 0 created with the variables, are shared by
  design and allowed.
- Towers whose losses include different regularization losses. A
  regularizer runs once, when tower 0 creates the variable, so a loss that
  sums its own scope's collection counts it in tower 0 only (measured 7%
  off).

Neither walk crosses resource or reference tensors: a variable handle or a
queue is shared state, not a tower's data.
"""

import collections
from typing import Dict, List, Sequence, Set

import tensorflow.compat.v1 as tf

from towers import _placement

# Stateful ops that read a variable: computed from the variable, not data.
_VARIABLE_READS = frozenset([
    "ReadVariableOp", "ResourceGather", "ResourceGatherNd", "VariableShape",
    "VarIsInitializedOp", "IsVariableInitialized"])

_FIX = ("Build each tower's loss from its own tensors: "
        "tf.losses.get_total_loss(add_regularization_losses=False, "
        "scope=scope) + tf.losses.get_regularization_loss(), or "
        "tf.add_n(tf.get_collection('losses', scope)) + "
        "tf.losses.get_regularization_loss()")


def check_losses(losses: Sequence[tf.Tensor], scopes: Sequence[str],
                 batches: Sequence[object]) -> None:
  """Raises if a tower's loss reads another tower's data, or if the towers'
  losses include different regularization losses.

  Args:
    losses: ``[num_towers]`` scalar losses.
    scopes: ``[num_towers]`` name scopes (``'tower_0/'``, ...).
    batches: ``[num_towers]`` of what each tower's model function was given
      (nested structures of tensors; empty where it built its own input).

  Raises:
    ValueError: naming the tower, the foreign op or regularization loss, and
      the fix.
  """
  # Each walk covers one tower's part of the graph, so checking N towers
  # costs about one pass over the graph, not N.
  sources = [op for op in tf.get_default_graph().get_operations()
             if _is_source(op)]
  owners: Dict[tf.Operation, List[int]] = collections.defaultdict(list)
  for j, (scope, batch) in enumerate(zip(scopes, batches)):
    starts = [t for t in tf.nest.flatten(batch) if isinstance(t, tf.Tensor)]
    starts += [t for op in sources if op.name.startswith(scope)
               for t in op.outputs]
    for op in _descendants(starts):
      owners[op].append(j)
  regularization = {t.op for t in tf.get_collection(
      tf.GraphKeys.REGULARIZATION_LOSSES) if isinstance(t, tf.Tensor)}
  reached_regularization: List[Set[tf.Operation]] = []
  for i, (loss, scope) in enumerate(zip(losses, scopes)):
    reached = _ancestors(loss.op)
    foreign = [(op, j) for op in reached for j in owners.get(op, ())
               if j != i]
    if foreign:
      # Name the nearest op of the other tower's own, if there is one.
      op, owner = next(((op, j) for op, j in foreign
                        if not op.name.startswith(scope)), foreign[0])
      raise ValueError(
          "%s's loss reads %s's data through %s: each tower's loss must "
          "depend on its own batch only, else the averaged gradient is "
          "wrong. Did model_fn return tf.losses.get_total_loss() or the "
          "'losses' collection, which hold the losses of the towers built "
          "before it? %s" % (_tower(scope), _tower(scopes[owner]), op.name,
                             _FIX))
    reached_regularization.append(set(reached) & regularization)
  for i in range(1, len(losses)):
    has, lacks = 0, i
    extra = reached_regularization[0] - reached_regularization[i]
    if not extra:
      has, lacks = i, 0
      extra = reached_regularization[i] - reached_regularization[0]
    if extra:
      raise ValueError(
          "the towers' losses include different regularization losses: "
          "%s's includes %s, %s's does not. A regularizer runs once, when "
          "tower 0 creates the variable, so a loss that sums its own scope's "
          "collection counts it in tower 0 only. %s"
          % (_tower(scopes[has]), ", ".join(sorted(op.name for op in extra)),
             _tower(scopes[lacks]), _FIX))


def _tower(scope: str) -> str:
  return scope.rstrip("/")


def _crosses(tensor: tf.Tensor) -> bool:
  """Whether the walk follows this edge: data, not a handle or reference."""
  dtype = tensor.dtype
  return not (dtype == tf.resource or dtype._is_ref_dtype)  # pylint: disable=protected-access


def _ancestors(start: tf.Operation) -> List[tf.Operation]:
  """Ops whose values `start` is computed from, nearest first (BFS)."""
  seen = {start}
  order = [start]
  queue = collections.deque([start])
  while queue:
    op = queue.popleft()
    for t in op.inputs:
      if _crosses(t) and t.op not in seen:
        seen.add(t.op)
        order.append(t.op)
        queue.append(t.op)
  return order


def _is_source(op: tf.Operation) -> bool:
  """Whether `op` brings data in: a placeholder or a stateful op that does
  not just read a variable (an iterator, a queue, a random number)."""
  if op.type in ("Placeholder", "PlaceholderV2", "PlaceholderWithDefault"):
    return True
  if op.type in _placement.VARIABLE_OPS or op.type in _VARIABLE_READS:
    return False
  return bool(op.op_def is not None and op.op_def.is_stateful)


def _descendants(tensors: List[tf.Tensor]) -> Set[tf.Operation]:
  """Ops computed from `tensors`."""
  seen: Set[tf.Operation] = set()
  queue = collections.deque(t for t in tensors if _crosses(t))
  while queue:
    tensor = queue.popleft()
    for op in tensor.consumers():
      if op not in seen:
        seen.add(op)
        queue.extend(t for t in op.outputs if _crosses(t))
  return seen
