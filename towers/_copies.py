"""Replicated variables: a copy of every trainable variable on every tower.

Copy 0 is the variable tower 0 creates, with its single-device name, on tower
0's device: the only copy saved, so checkpoints are the single-device ones.
Tower ``i > 0`` reads copy ``i``, named ``replica_<i>/<name>``, on its own
device: a local variable (``LOCAL_VARIABLES`` only, so not saved, not
trainable), initialized from copy 0 where it is set (else zeros), and set
from copy 0 again at the first step after the local init op (`_startup`),
whatever the order of the initializers and a restore; so are the copies'
optimizer slots, made local the same way when the step is applied.

Only trainable variables are copied. Batch-norm moving statistics and other
non-trainable variables keep one copy (tower 0's, updated by tower 0's update
ops), as in the one-copy modes.

The copies are made by a custom getter in towers ``1..N-1``: ``tf.get_variable``
(and ``tf.compat.v1.layers``, which call it) return copy ``i`` where tower 0
got copy 0. A trainable variable a tower reads without ``tf.get_variable``
(a Keras model's, held by the model object; one created before the towers)
gets its copy after the tower is built: the tower's ops that read copy 0
are made to read copy ``i`` instead (`read_copies`).
"""

import contextlib
import functools
from typing import Dict, Iterable, Iterator, List, Optional, Tuple, Union

import tensorflow.compat.v1 as tf

from towers import _state
from towers import _tf_internals

PREFIX = "replica_%d/"

Gradient = Union[tf.Tensor, tf.IndexedSlices]


def sources() -> List[Tuple[tf.Variable, tf.Variable]]:
  """Every copy and copy's slot of the default graph, each with the
  variable of copy 0 it is set from (its primary, or the primary's slot)."""
  return list(_state.of().sources)


def primary_of(var) -> Optional[Tuple[tf.Variable, int]]:
  """Returns ``(copy 0, index)`` if `var` is a copy, else None."""
  op = getattr(var, "op", None)
  if op is None:
    return None
  return _state.of(op.graph).primary_of.get(op.name)


def copy_of(var: tf.Variable, index: int) -> Optional[tf.Variable]:
  """Returns copy `index` of `var` (copy 0), or None if it has none."""
  return _state.of(var.graph).copy_of.get((var.op.name, index))


@contextlib.contextmanager
def tower_copies(index: int, device: str) -> Iterator[None]:
  """Makes ``tf.get_variable`` return tower `index`'s copies on `device`.

  Tower 0 creates the variables (copy 0) as usual. In a later tower, a
  request for a trainable variable tower 0 created returns copy `index`,
  made on first use.
  """
  if index == 0:
    yield
    return
  primaries = {v.op.name: v for v in tf.trainable_variables()}

  # TensorFlow passes the next getter as `getter`, by keyword.
  def copy_getter(getter, name, *args, **kwargs):
    primary = primaries.get(name)
    if primary is None:
      return getter(name, *args, **kwargs)
    return _copy(getter, primary, index, device)

  with tf.variable_scope(tf.get_variable_scope(), custom_getter=copy_getter,
                         auxiliary_name_scope=False):
    yield


def _copy(next_getter, primary: tf.Variable, index: int,
          device: str) -> tf.Variable:
  existing = copy_of(primary, index)
  if existing is not None:
    return existing

  with tf.device(device):
    copy = next_getter(
        PREFIX % index + primary.op.name, shape=primary.shape,
        dtype=primary.dtype.base_dtype,
        initializer=lambda *_, **__: _value_or_zeros(primary),
        regularizer=None, trainable=False, reuse=tf.AUTO_REUSE,
        collections=[tf.GraphKeys.LOCAL_VARIABLES], partitioner=None,
        caching_device=None, validate_shape=True,
        use_resource=primary.op.type == "VarHandleOp")
  state = _state.of(copy.graph)
  state.primary_of[copy.op.name] = (primary, index)
  state.copy_of[(primary.op.name, index)] = copy
  state.sources.append((copy, primary))
  return copy


def _value_or_zeros(source: tf.Variable) -> tf.Tensor:
  """`source`'s value if it is set, else zeros: a copy's initial value.

  The local init op usually runs after the global one, and the copies then
  start equal to copy 0; run in one ``sess.run``, it may come first, and
  the first step sets the copies anyway (`_startup`).
  """
  # With `source`, not with the copy the initializer is made for: an op
  # that reads one variable but is colocated with another would tie the
  # two's colocation groups, and every op colocated with the copy would go
  # to copy 0's device.
  with tf.get_default_graph().colocate_with(source.op,
                                            ignore_existing=True):
    return _tf_internals.cond_v1(
        tf.is_variable_initialized(source), source.read_value,
        lambda: tf.zeros(source.shape, source.dtype.base_dtype),
        name="value_or_zeros")


def read_copies(index: int, device: str, scope: str,
                made: List[tf.Operation]) -> None:
  """Makes those of `made` (the ops tower `index`'s model function made) in
  `scope` read copy `index` (on `device`) of each trainable variable they
  read copy 0 of."""
  primaries: Dict[str, Tuple[tf.Variable, bool]] = {}
  for var in tf.trainable_variables():
    primaries[var.op.outputs[0].name] = (var, False)
    if var.op.type != "VarHandleOp":
      primaries[var.value().name] = (var, True)
  colocated = {_group(v.op): v for v in tf.trainable_variables()}

  def copy_of_primary(primary: tf.Variable) -> tf.Variable:
    copy = copy_of(primary, index)
    return _copy(_get_variable, primary, index, device) if copy is None \
        else copy

  for op in made:
    if not op.name.startswith(scope):
      continue
    for k, tensor in enumerate(op.inputs):
      found = primaries.get(tensor.name)
      if found is None:
        continue
      primary, snapshot = found
      copy = copy_of_primary(primary)
      _tf_internals.update_input(
          op, k, copy.value() if snapshot else copy.op.outputs[0])
    # An op colocated with copy 0 (an embedding lookup's gather, a
    # colocate_with in the model) goes with this tower's copy instead.
    groups = _tf_internals.colocation(op)
    if any(group in colocated for group in groups if group != _group(op)):
      copies = [copy_of_primary(colocated[group])
                if group in colocated and group != _group(op) else None
                for group in groups]
      _tf_internals.set_colocation(op, [
          group if copy is None else _group(copy.op)
          for group, copy in zip(groups, copies)])
      _tf_internals.set_device(op, next(c for c in copies
                                          if c is not None).device)


def _group(op: tf.Operation) -> bytes:
  """The colocation group of `op`: ``b"loc:@<name>"``."""
  return ("loc:@" + op.name).encode()


def _get_variable(name: str, reuse=None, **kwargs) -> tf.Variable:
  """``tf.get_variable`` at the root variable scope, outside any tower."""
  del reuse
  with tf.variable_scope(tf.VariableScope(tf.AUTO_REUSE),
                         auxiliary_name_scope=False):
    return tf.get_variable(name, **kwargs)


def of_towers(indices: Iterable[int]) -> List[Tuple[tf.Variable, tf.Variable]]:
  """Every copy ``(copy, copy 0)`` of a variable that towers `indices` have,
  in the order they were made."""
  wanted = set(indices)
  state = _state.of()
  return [(copy, state.primary_of[copy.op.name][0])
          for (_, index), copy in state.copy_of.items() if index in wanted]


def copies_of(var: tf.Variable) -> List[tf.Variable]:
  """Returns copies ``1..N-1`` of `var` (copy 0), or ``[]`` if it has none."""
  copies: List[tf.Variable] = []
  while True:
    copy = copy_of(var, len(copies) + 1)
    if copy is None:
      return copies
    copies.append(copy)


def record_averaged(pairs: List[Tuple[tf.Tensor, int, tf.Tensor]]) -> None:
  """Records averaged gradients: ``(copy 0's, index, copy index's)`` for
  each copy's that is a tensor of its own, on the copy's device."""
  state = _state.of()
  if state.averaged_at is None:
    state.averaged_at = _tf_internals.last_op_id()
  for grad, index, copy_grad in pairs:
    state.averaged.setdefault(index, {})[grad.name] = copy_grad


def averaged_at() -> int:
  """The id of the last op that existed when gradients were first averaged
  (their transformation comes after it); without an average, the last op's."""
  return _state.of().averaged_at or _tf_internals.last_op_id()


def stand_ins(index: int) -> Dict[str, tf.Tensor]:
  """What copy `index` uses where copy 0 uses a tensor: tensor name -> the
  copy's tensor, for the averaged gradients and the variables' own tensors
  (a resource handle; a ref variable and its snapshot)."""
  state = _state.of()
  result = dict(state.averaged.get(index, {}))
  for (_, i), copy in state.copy_of.items():
    if i != index:
      continue
    primary = state.primary_of[copy.op.name][0]
    result[primary.op.outputs[0].name] = copy.op.outputs[0]
    if primary.op.type != "VarHandleOp":
      result[primary.value().name] = copy.value()
  return result


def tower_gradients(opt: tf.train.Optimizer, loss: tf.Tensor,
                    var_list: List[tf.Variable], index: int,
                    **kwargs) -> List[Tuple[Optional[Gradient], tf.Variable]]:
  """Tower `index`'s ``(grad, var)`` for copy `index` of each of `var_list`.

  A variable with no copy (never requested through ``tf.get_variable`` in
  this tower) is its own entry. A copy's gradient also takes the loss's
  gradient through copy 0, which the tower reads where the loss does not
  come from its own ``tf.get_variable`` calls (a regularization loss tower
  0 created): the sum is the gradient of the loss as a function of the one
  variable, as in the one-copy modes.
  """
  copies = [_own(v, index) for v in var_list]
  through_primary = [v for v, c in zip(var_list, copies) if c is not v]
  pairs = opt.compute_gradients(loss, var_list=copies + through_primary,
                                **kwargs)
  own = pairs[:len(copies)]
  extra = dict(zip([id(v) for v in through_primary],
                   [g for g, _ in pairs[len(copies):]]))
  result = []
  for (grad, var), primary in zip(own, var_list):
    other = extra.get(id(primary)) if var is not primary else None
    result.append((_add(grad, other), var))
  return result


def _add(grad: Optional[Gradient],
         other: Optional[Gradient]) -> Optional[Gradient]:
  if grad is None or other is None:
    return other if grad is None else grad
  if isinstance(grad, tf.IndexedSlices) and isinstance(other,
                                                       tf.IndexedSlices):
    return tf.IndexedSlices(
        tf.concat([grad.values, other.values], 0),
        tf.concat([grad.indices, tf.cast(other.indices, grad.indices.dtype)],
                  0), grad.dense_shape)
  return tf.convert_to_tensor(grad) + tf.convert_to_tensor(other)


def _own(var: tf.Variable, index: int) -> tf.Variable:
  copy = copy_of(var, index)
  return var if copy is None else copy


@contextlib.contextmanager
def local_slots() -> Iterator[None]:
  """Makes the copies' optimizer slots local, set from copy 0's slots.

  Around ``opt.apply_gradients``: a slot of copy ``i`` (``replica_i/<var>/
  <slot>``) joins ``LOCAL_VARIABLES`` only and is set from copy 0's slot
  ``<var>/<slot>`` (created first because copy 0's pairs come first) as a
  copy is (`_value_or_zeros`, `_startup`).
  """
  graph = tf.get_default_graph()
  state = _state.of(graph)
  copies = state.primary_of
  # Global variables by name, refreshed on a miss: copy 0's slots are made
  # inside the same apply_gradients call, just before the copies'.
  by_name: Dict[str, tf.Variable] = {}

  def global_variable(name: str) -> Optional[tf.Variable]:
    if name not in by_name:
      by_name.update((v.op.name, v) for v in
                     graph.get_collection(tf.GraphKeys.GLOBAL_VARIABLES))
    return by_name.get(name)

  def creator(next_creator, **kwargs):
    # Slots are named "<var>/<slot>/", the trailing slash making the name
    # absolute.
    name = (kwargs.get("name") or "").rstrip("/")
    parts = name.split("/")
    for end in range(len(parts) - 1, 0, -1):
      found = copies.get("/".join(parts[:end]))
      if found is None:
        continue
      primary = found[0]
      slot_name = "/".join([primary.op.name] + parts[end:])
      slot = global_variable(slot_name)
      if slot is None:
        raise ValueError(
            "replicated mode: the optimizer created %s for a copy but copy "
            "0 has no %s; apply copy 0's pairs (average_gradients' result) "
            "with opt.apply_gradients or towers.apply_gradients, once per "
            "step" % (name, slot_name))
      kwargs["initial_value"] = functools.partial(_value_or_zeros, slot)
      kwargs["collections"] = [tf.GraphKeys.LOCAL_VARIABLES]
      kwargs["trainable"] = False
      made = next_creator(**kwargs)
      state.sources.append((made, slot))
      return made
    return next_creator(**kwargs)

  with tf.variable_creator_scope(creator):
    yield

