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
- Towers whose losses count the regularization losses differently. A
  regularizer runs once, when tower 0 creates the variable, so a loss that
  sums its own scope's collection counts it in tower 0 only; one that also
  sums what an earlier tower added counts it twice. The losses are compared
  by a name that is the same in every tower (`_Entries`); a Keras model's
  weight regularizers (``model.losses``), built anew wherever they are
  read, by the weight.
- A regularization loss the towers created that no tower's loss reads:
  ``tf.get_variable(..., regularizer=...)`` makes it beside the variable,
  outside every tower's name scope, so the tutorial's
  ``tf.losses.get_total_loss(scope=scope)`` misses it in every tower and
  the weight decay is silently dropped.

The walks do not cross resource or reference tensors: a variable handle or a
queue is shared state, not a tower's data; nor a cross-tower sum's result,
which every tower reads by design (`_context`).
"""

import collections
import re
from typing import Counter as CountsOf
from typing import Dict, Iterable, List, Mapping, Optional, Sequence, Set, Tuple

import tensorflow.compat.v1 as tf

from towers import _context
from towers import _placement
from towers import _regularization_view

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


def check_losses(losses: Mapping[object, Sequence[tf.Tensor]],
                 scopes: Sequence[str], batches: Sequence[object],
                 added: Sequence[Sequence[object]]) -> None:
  """Raises if a tower's loss reads another tower's data, if the towers'
  losses count the regularization losses differently, or if one tower 0
  added reaches no tower's loss.

  Args:
    losses: {key: ``[num_towers]`` scalar losses} (`_losses`).
    scopes: ``[num_towers]`` name scopes (``'tower_0/'``, ...).
    batches: ``[num_towers]`` of what each tower's model function was given
      (nested structures of tensors; empty where it built its own input).
    added: ``[num_towers]`` lists of the regularization losses each tower
      added (`_regularization_view`).

  Raises:
    ValueError: naming the tower, the loss, the foreign op or
      regularization loss, and the fix.
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
  entries = _Entries(tf.get_collection(tf.GraphKeys.REGULARIZATION_LOSSES),
                     added, scopes)
  read_by_any: CountsOf = collections.Counter()
  for key, key_losses in losses.items():
    reads = _check_towers(key_losses, scopes, owners, entries,
                          "" if key is None else "the loss %r: " % (key,))
    read_by_any.update(reads[0])
  dropped = sorted(entries.names[k] for k in entries.keys_of(added[0])
                   if not read_by_any[k])
  if dropped:
    raise ValueError(
        "no tower's loss reads the regularization losses %s, so training "
        "would silently drop that weight decay: a regularizer's loss is "
        "created beside its variable, outside every tower's name scope, "
        "where tf.losses.get_total_loss(scope=scope) and the scope's "
        "collection do not look. %s. To train without them on purpose, take "
        "them out of the collection in model_fn: del tf.get_collection_ref("
        "tf.GraphKeys.REGULARIZATION_LOSSES)[:]" % (", ".join(dropped), _FIX))


def _check_towers(losses: Sequence[tf.Tensor], scopes: Sequence[str],
                  owners: Dict[tf.Operation, List[int]], entries: "_Entries",
                  which: str) -> List[CountsOf]:
  """The first two checks for one loss of every tower; returns the
  regularization losses each tower's reads."""
  reads: List[CountsOf] = []
  for i, (loss, scope) in enumerate(zip(losses, scopes)):
    reached = ancestors(loss.op)
    foreign = [(op, j) for op in reached for j in owners.get(op, ())
               if j != i]
    if foreign:
      # Name the nearest op of the other tower's own, if there is one.
      op, owner = next(((op, j) for op, j in foreign
                        if not op.name.startswith(scope)), foreign[0])
      raise ValueError(
          "%s%s's loss reads %s's data through %s: each tower's loss must "
          "depend on its own batch only, else the averaged gradient is "
          "wrong. Did model_fn return tf.losses.get_total_loss() or the "
          "'losses' collection, which hold the losses of the towers built "
          "before it, or a Keras model's model.losses, which holds every "
          "call's activity regularization? %s; for the Keras model, "
          "tf.add_n(model.get_losses_for(None) + model.get_losses_for("
          "inputs))" % (which, _tower(scope), _tower(scopes[owner]), op.name,
                        _FIX))
    reads.append(entries.read_by(reached, scope))
  for i in range(1, len(losses)):
    has, lacks = 0, i
    extra = reads[0] - reads[i]
    if not extra:
      has, lacks = i, 0
      extra = reads[i] - reads[0]
    if extra:
      names = ", ".join(sorted(entries.names.get(k, str(k)) for k in extra))
      if any(reads[lacks][k] for k in extra):
        counted = "%s more often than %s's" % (names, _tower(scopes[lacks]))
      else:
        counted = "%s, %s's does not" % (names, _tower(scopes[lacks]))
      raise ValueError(
          "%sthe towers' losses include different regularization losses: "
          "%s's includes %s. A regularizer runs once, when tower 0 creates "
          "the variable, so a loss that sums its own scope's collection "
          "counts it in tower 0 only; a Keras model's model.losses belongs "
          "in every tower's loss. %s"
          % (which, _tower(scopes[has]), counted, _FIX))
  return reads


class _Entries:
  """The regularization losses, each known by a key that is the same in
  every tower: a loss tensor by its op's name within its tower's scope
  (``fc/kernel/Regularizer/mul``, as `_regularization_view` lines them
  up), ``tf.get_variable``'s lazy one by its scope ``<var>/Regularizer/``
  (it builds its op anew, there, wherever it is used).

  Attributes:
    names: {key: the name to show}, tower 0's where it has one.
  """

  def __init__(self, collected: Sequence[object],
               added: Sequence[Sequence[object]],
               scopes: Sequence[str]) -> None:
    self._scopes = scopes
    self._ops: Dict[tf.Operation, str] = {}
    self._lazy: Set[object] = set()
    self.names: Dict[object, str] = {}
    for loss in list(collected) + [loss for tower in added for loss in tower]:
      found = self._key(loss)
      if found is not None:
        self.names.setdefault(*found)
    # The losses' own ops; the rest of a weight's regularizer ops are
    # Keras's (model.losses).
    self._in_losses = {a for op in self._ops for a in ancestors(op)}

  def keys_of(self, losses: Iterable[object]) -> List[object]:
    """The keys of `losses` (entries of the collection)."""
    return [found[0] for found in map(self._key, losses) if found is not None]

  def _key(self, loss: object) -> Optional[Tuple[object, str]]:
    """`loss`'s key and the name to show for it; None if it has no op."""
    op = getattr(loss, "op", None)
    if not isinstance(op, tf.Operation):
      return None
    if isinstance(loss, tf.Tensor):
      within = (_regularization_view.name_within(loss, s)
                for s in self._scopes)
      return self._ops.setdefault(op, next(
          (n for n in within if n is not None), op.name)), op.name
    key = _regularization_key(op)
    self._lazy.add(key)
    return key, key.rstrip("/") if isinstance(key, str) else op.name

  def read_by(self, reached: Sequence[tf.Operation], scope: str) -> CountsOf:
    """How often a tower's loss, computed from `reached`, counts each
    regularization loss (a Keras weight's by the weight, once)."""
    counts: CountsOf = collections.Counter(
        self._ops[op] for op in reached if op in self._ops)
    counts.update({_regularization_key(op) for op in reached} & self._lazy)
    counts.update(_regularized_weights(
        [op for op in reached if op not in self._in_losses and
         _regularization_key(op) not in self._lazy], scope))
    return counts


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


def is_variable(tensor: tf.Tensor) -> bool:
  """Whether `tensor` is a variable itself: a handle or a reference (a
  reference's dtype differs from its base dtype)."""
  return tensor.dtype == tf.resource or tensor.dtype != tensor.dtype.base_dtype


def _crosses(tensor: tf.Tensor) -> bool:
  """Whether the walk follows this edge: data, not a handle or reference,
  nor a cross-tower sum (whose every tower's part is its data)."""
  return not is_variable(tensor) and not _context.is_sum_op(tensor.op)


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
