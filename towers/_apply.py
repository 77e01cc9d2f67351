"""Applying the averaged gradients once: to the variables and every copy.

The CIFAR-10 tutorial's step ends with ``opt.apply_gradients`` on the
averaged pairs, which are copy 0's (single-device) pairs in every mode. With
replicated towers the other copies must take the same update, each on its
own device: whatever the pairs went through after `average_gradients`
(clipping by global norm, scaling, filtering) is built again from that
copy's averaged gradients (`_replay`), and one ``apply_gradients`` call
updates every copy, so that an optimizer's own state (Adam's beta powers,
the global step) advances once.

An optimizer that makes its update itself (Google BERT's
``AdamWeightDecayOptimizer`` computes Adam with plain ops and makes its ``m``
and ``v`` with ``tf.get_variable``) would leave that arithmetic and state
wherever the session puts unplaced ops, GPU 0 for every copy. Here an op the
optimizer makes without a device goes next to the variable it serves: a
variable to the variable its name extends (``<var>/adam_m``), another op to
the device of an input that belongs to a variable's update.
"""

import contextlib
import functools
from typing import (Callable, ContextManager, Dict, Iterator, List,
                    Optional)

import tensorflow.compat.v1 as tf

from towers import _copies
from towers import _devices
from towers import _gradients
from towers import _placement
from towers import _reduction
from towers import _replay
from towers import _shares
from towers import _startup

# Where a routed apply_gradients keeps the optimizer's own.
_ORIGINAL = "_towers_original_apply_gradients"


def apply_gradients(opt: tf.train.Optimizer,
                    grads_and_vars: _gradients.GradsAndVars,
                    global_step: Optional[tf.Variable] = None,
                    name: Optional[str] = None) -> tf.Operation:
  """Applies averaged gradients once, to the variables and all their copies.

  ``opt.apply_gradients`` for towers, and what it is after `build_towers`
  (which routes its `opt`'s own method here). `grads_and_vars` are copy 0's
  pairs, as `average_gradients` returns them, after any change a single
  device would make (clipping, scaling, filtering). For replicated towers
  every other copy gets the same update on its own device: what the pairs
  went through since `average_gradients` is built again there from that
  copy's averaged gradients (with ``'add_n'`` every copy reads copy 0's).
  The copies' optimizer variables (slots, or variables named
  ``<copy>/...``) are local variables set from copy 0's, so checkpoints keep
  the single-device keys; ops the optimizer leaves unplaced run next to the
  variable they update.

  Args:
    opt: a ``tf.compat.v1.train.Optimizer``.
    grads_and_vars: ``[num_vars]`` of ``(grad, var)`` over copy 0's variables.
    global_step: passed to ``opt.apply_gradients``.
    name: passed to ``opt.apply_gradients``.

  Returns:
    The op ``opt.apply_gradients`` returns.

  Raises:
    TypeError: if `opt` cannot apply gradients or an entry is not a pair.
    ValueError: if a pair names a copy other than copy 0.
  """
  if not callable(getattr(opt, "apply_gradients", None)):
    raise TypeError("expected opt to be a tf.compat.v1.train.Optimizer, got "
                    "%r" % (opt,))
  return _apply(original_apply(opt), grads_and_vars, global_step, name)


def route(opt: tf.train.Optimizer) -> None:
  """Makes ``opt.apply_gradients``, on this instance, `apply_gradients`."""
  if getattr(opt.apply_gradients, _ORIGINAL, None) is not None:
    return
  original = opt.apply_gradients

  @functools.wraps(original)
  def routed(grads_and_vars, global_step=None, name=None):
    return _apply(original, grads_and_vars, global_step, name)

  setattr(routed, _ORIGINAL, original)
  opt.apply_gradients = routed


@contextlib.contextmanager
def updating(grads_and_vars: _gradients.GradsAndVars
            ) -> Iterator[Callable[[Callable[..., tf.Operation],
                                    Optional[tf.Variable], Optional[str]],
                                   tf.Operation]]:
  """Around the update of copy 0's averaged pairs: yields ``update(original,
  global_step, name)``, which calls `original` (an ``apply_gradients``) once.

  Towers that share their variables update them alone. For replicated
  towers (found by the copies of the pairs' variables) every copy's pairs
  are computed on its device on entry, `update` applies them all in that
  one call, and what it builds waits, at the first step, for the copies to
  be set from copy 0 (`_copies_set`).

  Raises:
    TypeError: if an entry is not a pair.
    ValueError: if a pair names a copy other than copy 0.
  """
  pairs = _checked(grads_and_vars)  # Once: it may be an iterator.
  if _shares.copied_plan([v for _, v in pairs]) is None:
    yield functools.partial(_update, [pairs], contextlib.nullcontext)
    return
  _check_copy_zero(pairs)
  with _copies_set(pairs):
    yield functools.partial(_update, _per_copy(pairs), _copies.local_slots)


def _per_copy(pairs: _gradients.GradsAndVars
            ) -> List[_gradients.GradsAndVars]:
  """Returns ``[num_copies]`` pair lists: copy 0's `pairs`, then each other
  copy's pairs (its copied variables only), computed on its device."""
  copies = [_copies.copies_of(v) for _, v in pairs]
  groups = [pairs]
  targets = [t for (g, _), c in zip(pairs, copies) if c
             for t in _reduction.tensors(g)]
  for index in range(1, max(map(len, copies), default=0) + 1):
    device = next(c[index - 1].device for c in copies if len(c) >= index)
    prefix = _copies.PREFIX % index
    replayed = dict(zip([t.name for t in targets], _replay.replay(
        targets, _copies.stand_ins(index), device, prefix,
        _copies.averaged_at())))
    with tf.name_scope(prefix.rstrip("/")):
      groups.append([(_on_copy(g, replayed, c[index - 1]), c[index - 1])
                     for (g, _), c in zip(pairs, copies) if len(c) >= index])
  return groups


def _update(groups: List[_gradients.GradsAndVars],
            slots: Callable[[], ContextManager[None]],
            original: Callable[..., tf.Operation],
            global_step: Optional[tf.Variable],
            name: Optional[str]) -> tf.Operation:
  """Calls `original` once on every copy's pairs, under `slots` (where
  the copies' optimizer slots are made)."""
  flat = [pair for group in groups for pair in group]
  kwargs = {} if name is None else {"name": name}
  with slots(), _next_to_variables(flat):
    return original(flat, global_step=global_step, **kwargs)


def original_apply(opt: tf.train.Optimizer) -> Callable[..., tf.Operation]:
  """`opt`'s own ``apply_gradients``, routed or not."""
  return getattr(opt.apply_gradients, _ORIGINAL, opt.apply_gradients)


@contextlib.contextmanager
def _copies_set(pairs: _gradients.GradsAndVars) -> Iterator[None]:
  """Around the update of the variables of `pairs` (copy 0's ``(grad,
  var)``, a list) and their copies: at the first step, what it builds waits
  for their copies and the slots it makes to be set from copy 0 (a restore
  may have changed copy 0 since)."""
  copies = [(c, v) for _, v in pairs for c in _copies.copies_of(v)]
  if not copies:  # One tower: copy 0 has no others.
    yield
    return
  start = _startup.Start()
  with start.gated():
    yield
  start.finish(_devices.host(pairs[0][1].device), copies + start.made())


def _apply(original, grads_and_vars, global_step, name) -> tf.Operation:
  with updating(grads_and_vars) as update:
    return update(original, global_step, name)


def _checked(grads_and_vars) -> _gradients.GradsAndVars:
  pairs = list(grads_and_vars)
  for pair in pairs:
    if not isinstance(pair, (list, tuple)) or len(pair) != 2:
      raise TypeError("expected (grad, var) pairs, as average_gradients "
                      "returns them, got %r" % (pair,))
  return [tuple(p) for p in pairs]


def _check_copy_zero(pairs: _gradients.GradsAndVars) -> None:
  """Raises if a pair names a copy other than copy 0."""
  for _, var in pairs:
    primary = _copies.primary_of(var)
    if primary is not None:
      raise ValueError(
          "the pairs name %s, copy %d of %s; apply copy 0's pairs (what "
          "average_gradients returns): every copy takes the same update"
          % (var.op.name, primary[1], primary[0].op.name))


def _on_copy(grad, replayed: Dict[str, tf.Tensor], copy: tf.Variable):
  """Copy `copy`'s gradient: the replayed one, or copy 0's read on the
  copy's device (so the ops of its update follow it there)."""
  if grad is None:
    return None
  if isinstance(grad, tf.IndexedSlices):
    return tf.IndexedSlices(replayed[grad.values.name],
                            replayed[grad.indices.name], grad.dense_shape)
  mine = replayed[grad.name]
  if mine is grad:
    with tf.device(copy.device):
      mine = tf.identity(grad)
  return mine


@contextlib.contextmanager
def _next_to_variables(pairs: _gradients.GradsAndVars) -> Iterator[None]:
  """Places the ops an ``apply_gradients`` call leaves unplaced next to the
  variable they serve."""
  variables: Dict[str, str] = {}
  # Op name -> the device of the variable whose update it is part of.
  owned: Dict[str, str] = {}
  for grad, var in pairs:
    variables.setdefault(var.op.name, var.device)
    for t in _reduction.tensors(grad):
      owned.setdefault(t.op.name, var.device)
  known = set(variables.values()) - {""}

  def owner(op: tf.Operation) -> str:
    if op.type in _placement.VARIABLE_OPS:
      # The longest variable name the new variable's name extends.
      parts = op.name.split("/")
      for end in range(len(parts) - 1, 0, -1):
        device = variables.get("/".join(parts[:end]))
        if device is not None:
          return device
      return ""
    for t in op.inputs:
      # A variable's read is made with no device at all; it runs on the
      # variable's.
      source = t.op.inputs[0].op if t.op.type == "ReadVariableOp" else t.op
      device = owned.get(source.name) or (
          source.device if source.device in known else "")
      if device:
        return device
    return ""

  def device_fn(op: tf.Operation) -> str:
    device = owner(op)
    if device:
      owned[op.name] = op.device or device
    return op.device or device

  with tf.device(device_fn):
    yield
