"""Which of several losses an op serves: what each key's step runs.

One device's ``opt_k.minimize(loss_k)`` runs what ``loss_k`` depends on: a
batch-norm update made in place (tf-slim's ``updates_collections=None``)
runs with the losses whose forward pass it sits in. A ``tf.layers`` update
kept in ``UPDATE_OPS`` belongs, the same way, to the losses its batch
statistics feed. A tower's update op (or summary) is traced back through the
tower's ops to the first tensors a loss also reads (the layer's moments, its
fused kernel, the tower's input batch): the losses that read them are the
op's. A discriminator's update on the real images is its loss's alone; one on
the generated images serves both losses, since the generator's goes through
it too; the generator's updates serve both, since the discriminator's loss
reads the generated images.

Only float tensors carry batch statistics: a training flag, a shape or a
counter every branch reads links nothing, nor does a variable, its read or a
constant.
"""

from typing import Dict, Iterable, List, Mapping, Sequence, Set

import tensorflow.compat.v1 as tf

from towers import _losses

# Ops whose outputs are no batch's: values fixed, fed or held by a variable.
_SOURCES = frozenset(["Const", "Placeholder", "PlaceholderWithDefault",
                      "VariableV2", "VarHandleOp", "ReadVariableOp",
                      "VarIsInitializedOp", "IsVariableInitialized"])
# Ops that read only their input's shape, not its values.
_SHAPES = frozenset(["Shape", "ShapeN", "Size", "Rank"])


def by_key(ops: Sequence[object], losses: Mapping[_losses.Key, tf.Tensor],
           made: Iterable[tf.Operation],
           first: bool = False) -> Dict[_losses.Key, List]:
  """Each key's of `ops`, in order: those its loss goes through.

  An op no loss goes through (an average of the weights, a counter) goes to
  every key, as under ``control_dependencies(UPDATE_OPS)`` around each
  ``minimize``; with `first`, each op goes to the first of its keys only.

  Args:
    ops: update ops or summaries of one tower (ops or tensors).
    losses: that tower's ``{key: loss}``, in the optimizers' order.
    made: the ops the tower's model function made.
    first: whether an op goes to one key only (a summary, written once).

  Returns:
    ``{key: [op, ...]}`` for every key of `losses`.
  """
  keys = list(losses)
  if len(keys) == 1:
    return {keys[0]: list(ops)}
  paths = _Paths(losses, made)
  result: Dict[_losses.Key, List] = {key: [] for key in keys}
  for item in ops:
    op = item if isinstance(item, tf.Operation) else getattr(item, "op")
    found = paths.keys_of(op)
    mine = [key for key in keys if key in found] or keys
    for key in mine[:1] if first else mine:
      result[key].append(item)
  return result


class _Paths:
  """The ops and tensors each loss depends on, within one tower."""

  def __init__(self, losses: Mapping[_losses.Key, tf.Tensor],
               made: Iterable[tf.Operation]):
    self._within = set(made)
    self._ops: Dict[tf.Operation, Set[_losses.Key]] = {}
    self._tensors: Dict[tf.Tensor, Set[_losses.Key]] = {}
    for key, loss in losses.items():
      self._tensors.setdefault(loss, set()).add(key)
      self._walk(key, loss.op)

  def _walk(self, key: _losses.Key, root: tf.Operation) -> None:
    seen: Set[tf.Operation] = set()
    stack = [root]
    while stack:
      op = stack.pop()
      if op in seen:
        continue
      seen.add(op)
      self._ops.setdefault(op, set()).add(key)
      for tensor in _value_inputs(op):
        self._tensors.setdefault(tensor, set()).add(key)
        if tensor.op in self._within and tensor.op.type not in _SOURCES:
          stack.append(tensor.op)
      stack.extend(c for c in op.control_inputs if c in self._within)

  def keys_of(self, root: tf.Operation) -> Set[_losses.Key]:
    """The keys whose loss reads what `root` first shares with a loss."""
    found = set(self._ops.get(root, ()))
    seen: Set[tf.Operation] = set()
    stack = [] if found else [root]
    while stack:
      op = stack.pop()
      if op in seen:
        continue
      seen.add(op)
      for tensor in _value_inputs(op):
        keys = self._keys_of_tensor(tensor) if _carries_statistics(
            tensor) else None
        if keys:
          found |= keys
        elif tensor.op in self._within:
          stack.append(tensor.op)
      for control in op.control_inputs:
        keys = self._ops.get(control)
        if keys:
          found |= keys
        elif control in self._within:
          stack.append(control)
    return found

  def _keys_of_tensor(self, tensor: tf.Tensor) -> Set[_losses.Key]:
    keys = self._tensors.get(tensor, set())
    op = tensor.op
    # A fused batch norm's statistics are outputs beside the one a loss
    # reads: the kernel, with a float input, is the shared computation.
    if op in self._within and any(t.dtype.is_floating for t in op.inputs):
      keys = keys | self._ops.get(op, set())
    return keys


def _value_inputs(op: tf.Operation) -> List[tf.Tensor]:
  return [] if op.type in _SHAPES else list(op.inputs)


def _carries_statistics(tensor: tf.Tensor) -> bool:
  """Whether `tensor` may hold a batch's values: a float that is not a
  variable's, a constant or a fed value."""
  if not tensor.dtype.is_floating or tensor.dtype != tensor.dtype.base_dtype:
    return False
  op = tensor.op
  if op.type in _SOURCES:
    return False
  # A ref variable's snapshot (``<var>/read``).
  return not (op.type == "Identity" and op.inputs and
              op.inputs[0].dtype != op.inputs[0].dtype.base_dtype)
