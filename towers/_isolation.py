"""Each tower's loss reads its own batch, and the towers regularize alike.

Three mistakes make the averaged gradient silently wrong, and all three are
found in the graph once the towers are built:

- A tower's loss that reads another tower's data. ``model_fn`` returning
  ``tf.losses.get_total_loss()`` (or the unscoped ``'losses'`` collection)
  sums every loss added so far, so tower 1's loss includes tower 0's. A
  tower's data is everything
  computed from its batch, or from a source of data (placeholder, input
  pipeline, random numbers: a stateful op other than a variable) built in
  its name scope. Ops computed from variables and constants alone, such as
  a regularization loss tower 0 created with the variables, are shared by
  design and allowed.
- Towers whose losses include different regularization losses. A
  regularizer runs once, when tower 0 creates the variable, so a loss that
  sums its own scope's collection counts it in tower 0 only. A Keras
  model's weight regularizers (``model.losses``) are built
  anew wherever they are read, so they are compared by the weight.
- A regularization loss the towers created that no tower's loss reads:
  ``tf.get_variable(..., regularizer=...)`` makes it beside the variable,
  outside every tower's name scope, so the tutorial's
  ``tf.losses.get_total_loss(scope=scope)`` misses it in every tower and
  the weight decay is silently dropped.

The walks do not cross resource or reference tensors: a variable handle or a
queue is shared state, not a tower's data.
"""

import collections
import re
from typing import Dict, List, Sequence, Set

import tensorflow.compat.v1 as tf

from towers import _placement

# Stateful ops that read a variable: computed from the variable, not data.
_VARIABLE_READS = frozenset([
    "ReadVariableOp", "ResourceGather", "ResourceGatherNd", "VariableShape",
    "VarIsInitializedOp", "IsVariableInitialized"])

_REGULARIZER = "/Regularizer/"
# A Keras weight regularizer's ops, ``<weight>/Regularizer[_k]/...``, made
# anew wherever ``model.losses`` is read: known by the weight they are of.
_WEIGHT_REGULARIZER = re.compile(r"/Regularizer(_\d+)?/")

_FIX = ("Build each tower's loss from its own tensors: "
        "tf.losses.get_total_loss(add_regularization_losses=False, "
        "scope=scope) + tf.losses.get_regularization_loss(), or "
        "tf.add_n(tf.get_collection('losses', scope)) + "
        "tf.losses.get_regularization_loss()")


def check_losses(losses: Sequence[tf.Tensor], scopes: Sequence[str],
                 batches: Sequence[object],
                 created: Sequence[object] = ()) -> None:
  """Raises if a tower's loss reads another tower's data, if the towers'
  losses include different regularization losses, or if one of `created`
  reaches no tower's loss.

  Args:
    losses: ``[num_towers]`` scalar losses.
    scopes: ``[num_towers]`` name scopes (``'tower_0/'``, ...).
    batches: ``[num_towers]`` of what each tower's model function was given
      (nested structures of tensors; empty where it built its own input).
    created: the regularization losses added while the towers were built.

  Raises:
    ValueError: naming the tower, the foreign op or regularization loss, and
      the fix.
  """
  # Each walk covers one tower's part of the graph, so checking N towers
  # costs about one pass over the graph, not N.
  sources = [op for op in tf.get_default_graph().get_operations()
             if is_source(op)]
  owners: Dict[tf.Operation, List[int]] = collections.defaultdict(list)
  for j, (scope, batch) in enumerate(zip(scopes, batches)):
    starts = [t for t in tf.nest.flatten(batch) if isinstance(t, tf.Tensor)]
    starts += [t for op in sources if op.name.startswith(scope)
               for t in op.outputs]
    for op in descendants(starts):
      owners[op].append(j)
  collected = tf.get_collection(tf.GraphKeys.REGULARIZATION_LOSSES)
  regularization = _regularization_keys(collected)
  # The collection's own ops; the rest of a weight's regularizer ops are
  # Keras's (model.losses).
  in_collection = {op for loss in collected if isinstance(loss, tf.Tensor)
                   for op in ancestors(loss.op)}
  reached_regularization: List[Set[object]] = []
  for i, (loss, scope) in enumerate(zip(losses, scopes)):
    reached = ancestors(loss.op)
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
          "before it, or a Keras model's model.losses, which holds every "
          "call's activity regularization? %s; for the Keras model, "
          "tf.add_n(model.get_losses_for(None) + model.get_losses_for("
          "inputs))" % (_tower(scope), _tower(scopes[owner]), op.name, _FIX))
    reached_regularization.append(
        ({_regularization_key(op) for op in reached} & set(regularization)) |
        _regularized_weights(
            [op for op in reached if op not in in_collection and
             _regularization_key(op) not in regularization], scope))
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
          "collection counts it in tower 0 only; a Keras model's "
          "model.losses belongs in every tower's loss. %s"
          % (_tower(scopes[has]),
             ", ".join(sorted(regularization.get(k, str(k)) for k in extra)),
             _tower(scopes[lacks]), _FIX))
  made = _regularization_keys(created)
  dropped = sorted(name for k, name in made.items()
                   if k not in reached_regularization[0])
  if dropped:
    raise ValueError(
        "no tower's loss reads the regularization losses %s, so training "
        "would silently drop that weight decay: a regularizer's loss is "
        "created beside its variable, outside every tower's name scope, "
        "where tf.losses.get_total_loss(scope=scope) and the scope's "
        "collection do not look. %s. To train without them on purpose, take "
        "them out of the collection in model_fn: del tf.get_collection_ref("
        "tf.GraphKeys.REGULARIZATION_LOSSES)[:]" % (", ".join(dropped), _FIX))


def _regularization_keys(losses: Sequence[object]) -> Dict[object, str]:
  """{key: name} of regularization losses, keyed as `_regularization_key`.

  ``tf.get_variable`` keeps a resource variable's regularization loss as a
  lazy tensor that builds its op anew, in the scope ``<var>/Regularizer/``,
  wherever it is used: that one is known by its scope, the others by op.
  """
  keys: Dict[object, str] = {}
  for loss in losses:
    op = getattr(loss, "op", None)
    if not isinstance(op, tf.Operation):
      continue
    if isinstance(loss, tf.Tensor):
      keys[op] = op.name
    else:
      key = _regularization_key(op)
      keys[key] = key.rstrip("/") if isinstance(key, str) else op.name
  return keys


def _regularized_weights(reached: Sequence[tf.Operation],
                         scope: str) -> Set[str]:
  """The weights whose Keras-style regularizer ops are among `reached`,
  named without the tower's scope."""
  weights = set()
  for op in reached:
    match = _WEIGHT_REGULARIZER.search(op.name)
    if match:
      name = op.name[:match.start()]
      weights.add(name[len(scope):] if name.startswith(scope) else name)
  return weights


def _regularization_key(op: tf.Operation) -> object:
  """The scope ``<var>/Regularizer/`` holding `op`, else `op` itself."""
  at = op.name.find(_REGULARIZER)
  return op if at < 0 else op.name[:at + len(_REGULARIZER)]


def _tower(scope: str) -> str:
  return scope.rstrip("/")


def _crosses(tensor: tf.Tensor) -> bool:
  """Whether the walk follows this edge: data, not a handle or reference."""
  dtype = tensor.dtype
  return not (dtype == tf.resource or dtype._is_ref_dtype)  # pylint: disable=protected-access


def ancestors(start: tf.Operation) -> List[tf.Operation]:
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


def is_source(op: tf.Operation) -> bool:
  """Whether `op` brings data in: a placeholder or a stateful op that does
  not just read a variable (an iterator, a queue, a random number)."""
  if op.type in ("Placeholder", "PlaceholderV2", "PlaceholderWithDefault"):
    return True
  if op.type in _placement.VARIABLE_OPS or op.type in _VARIABLE_READS:
    return False
  return bool(op.op_def is not None and op.op_def.is_stateful)


def descendants(tensors: List[tf.Tensor]) -> Set[tf.Operation]:
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
