"""Averaging the towers' gradients: the synchronization point.

`average_gradients` checks everything it is given before it builds an op,
then builds, per variable (or per pack of small ones), the barrier's wait
(`_barrier`), the weighted mean (`_reduction`, all-reducing copies with
`_allreduce`) and the weight decay added next to its variable
(`_regularization`).
"""

import numbers
from typing import Dict, List, Optional, Sequence, Tuple

import tensorflow.compat.v1 as tf

from towers import _allreduce
from towers import _barrier
from towers import _context
from towers import _copies
from towers import _packing
from towers import _reduction
from towers import _regularization
from towers import _shares
from towers import _workers

Gradient = _reduction.Gradient
GradsAndVars = List[Tuple[Optional[Gradient], tf.Variable]]
Weight = _reduction.Weight


def average_gradients(tower_grads: Sequence[GradsAndVars],
                      weights: Optional[Sequence[Weight]] = None,
                      *,
                      device: Optional[str] = None,
                      control_inputs: Sequence[object] = (),
                      all_reduce: Optional[str] = None,
                      pack_bytes: int = _packing.DEFAULT_PACK_BYTES
                     ) -> GradsAndVars:
  """Averages each variable's gradient over the towers.

  The synchronization point. Per variable, ``sum_i weights[i] * grad_i``
  next to the variable (or on `device`), in tower order; sparse gradients
  stay sparse, small dense ones are reduced in packs (bitwise the same),
  and no average is ready before every tower has read its variable, so
  applying it with ``gate_gradients=0`` is the single-device update.
  Replicated towers' gradients are all-reduced, each copy's left on its
  device for `apply_gradients`. It does not clip: clip its result. See
  docs/api.md for the long form.

  Args:
    tower_grads: ``[num_towers][num_vars]`` of ``(grad, var)``.
    weights: ``[num_towers]`` shares of the global batch, or None: the
      towers' own (`Towers.weights`) for their lists, else equal.
    device: where to reduce; None: next to each variable.
    control_inputs: ops every averaged gradient also waits for.
    all_reduce: for replicated towers; None: the one they were built with.
    pack_bytes: the largest gradient packed with others; 0: no packing.

  Returns:
    ``[num_vars]`` of ``(grad, var)``, the first tower's (copy 0's) pairs.

  Raises:
    ValueError: if the towers' lists, weights, `all_reduce`, `device` or
      `pack_bytes` do not fit, or no weights are given for lists of uneven
      towers that are not their own.
    TypeError: if an entry is not a ``(grad, var)`` pair of a tensor,
      ``tf.IndexedSlices`` or None.
  """
  groups = _average_per_copy(tower_grads, weights, device=device,
                             control_inputs=control_inputs,
                             all_reduce=all_reduce, pack_bytes=pack_bytes)
  _record_copies(groups)
  return groups[0]


def _record_copies(groups: List[GradsAndVars]) -> None:
  """Records each other copy's averaged gradients for `apply_gradients`."""
  if len(groups) == 1:
    return
  first = {id(v): g for g, v in groups[0]}
  recorded = []
  for index, group in enumerate(groups[1:], 1):
    for grad, copy in group:
      primary = _copies.primary_of(copy)
      grad0 = first.get(id(primary[0])) if primary else None
      # Sparse gradients and add_n's are one tensor for every copy.
      if isinstance(grad, tf.Tensor) and grad is not grad0 and \
          isinstance(grad0, tf.Tensor):
        recorded.append((grad0, index, grad))
  _copies.record_averaged(recorded)


def _average_per_copy(tower_grads: Sequence[GradsAndVars],
                      weights: Optional[Sequence[Weight]] = None,
                      *,
                      device: Optional[str] = None,
                      control_inputs: Sequence[object] = (),
                      all_reduce: Optional[str] = None,
                      pack_bytes: int = _packing.DEFAULT_PACK_BYTES
                     ) -> List[GradsAndVars]:
  """`average_gradients`, with each copy's pairs in a list of its own.

  Returns ``[num_copies]`` lists: copy 0's ``[num_vars]`` pairs, then, for
  replicated towers, each other copy's pairs (its replicated variables
  only). One copy: a list of one list.
  """
  # Every check first: refused input builds nothing.
  check_tower_grads(tower_grads)
  _check_present_alike(tower_grads)
  if weights is None:
    weights = _shares.weights_of(tower_grads)
  weights = _check_weights(weights, len(tower_grads))
  pack_bytes = _packing.check_pack_bytes(pack_bytes)
  plan = _shares.plan_of(tower_grads)
  # Lists tied to no towers: those of the graph's (one graph is one worker).
  workers = plan.workers if plan else _shares.graph_workers()
  algorithm = _algorithm(tower_grads, all_reduce, device,
                         plan.all_reduce if plan else None, workers)
  tower_grads, decay = _regularization.without_weight_decay(tower_grads,
                                                            device)
  flat = [t for tower in tower_grads for g, _ in tower
          for t in _reduction.tensors(g)]
  flat += [t for parts in decay.values() for part in parts for t in part]
  flat += list(control_inputs)
  positions = [_reduction.VariableGrads(pairs, device, algorithm)
               for pairs in zip(*tower_grads)]
  # One tower reduces nothing: a pack would only add copies.
  keys = [_packing.key(p, pack_bytes) if len(tower_grads) > 1 else None
          for p in positions]
  averaged: Dict[int, List[Optional[Gradient]]] = {}
  with tf.name_scope("average_gradients"):
    waits_for = _barrier.barrier(flat, list(control_inputs), list({
        id(v): v for tower in tower_grads for _, v in tower}.values()))
    uniform = _reduction.is_uniform(weights)
    # A collective all-reduce launches after the towers' own cross-tower
    # sums on each device.
    order = _context.launch_order_of(flat, workers)
    for unit in _packing.units(keys):
      members = [positions[i] for i in unit]
      first = members[0]
      if first.shared or first.algorithm == "add_n":
        waits = [waits_for([v for m in members for v in m.variables])]
      else:
        waits = [waits_for([m.variables[j] for m in members])
                 for j in range(len(first.where))]
      if len(unit) == 1:
        averaged[unit[0]] = _reduction.mean(
            first.grads, weights, uniform, waits, first.where,
            first.algorithm, order)
        continue
      with tf.name_scope("pack"):
        for index, results in zip(unit, _packing.mean_of_pack(
            members, weights, uniform, waits, order)):
          averaged[index] = results
    for i, parts in decay.items():
      averaged[i] = _regularization.add_weight_decay(
          averaged[i], parts, positions[i], weights, uniform)
  return _per_copy(positions, averaged, len(tower_grads))


def _per_copy(positions: List[_reduction.VariableGrads],
              averaged: Dict[int, List[Optional[Gradient]]],
              num_towers: int) -> List[GradsAndVars]:
  """Each copy's averaged pairs, copy 0's first: a shared variable has one
  result, in copy 0's list."""
  groups: List[GradsAndVars] = [[] for _ in range(num_towers)]
  for i, position in enumerate(positions):
    copies = position.variables[:1] if position.shared else position.variables
    for j, var in enumerate(copies):
      groups[j].append((averaged[i][j], var))
  return [group for group in groups if group]


def _var_name(var) -> str:
  return getattr(var, "name", repr(var))


def check_tower_grads(tower_grads) -> None:
  if isinstance(tower_grads, dict):
    raise TypeError(
        "tower_grads is a dict of several losses' gradients (%s): average "
        "each loss's own, average_gradients(t.tower_grads[%r], t.weights), "
        "and apply it with that loss's optimizer"
        % (", ".join(map(repr, tower_grads)), next(iter(tower_grads), "d")))
  if not isinstance(tower_grads, (list, tuple)):
    raise TypeError("expected tower_grads to be a list over towers of "
                    "(grad, var) lists, got %r" % (tower_grads,))
  if not tower_grads:
    raise ValueError("average_gradients needs the gradients of at least one "
                     "tower, got an empty tower_grads")
  first = tower_grads[0]
  for i, tower in enumerate(tower_grads):
    if not isinstance(tower, (list, tuple)):
      raise TypeError("expected tower %d's gradients to be a list of "
                      "(grad, var) pairs, got %r" % (i, tower))
    for pair in tower:
      if not isinstance(pair, (list, tuple)) or len(pair) != 2:
        raise TypeError("expected (grad, var) pairs in tower %d, got %r; pass "
                        "what opt.compute_gradients returns" % (i, pair))
      grad = pair[0]
      if grad is not None and not isinstance(grad,
                                             (tf.Tensor, tf.IndexedSlices)):
        raise TypeError(
            "expected the gradient of variable %s in tower %d to be a "
            "tf.Tensor, tf.IndexedSlices or None, got %r"
            % (_var_name(pair[1]), i, grad))
    if len(tower) != len(first):
      raise ValueError(
          "tower %d has %d (grad, var) pairs but tower 0 has %d; every tower "
          "must compute gradients for the same variables in the same order "
          "(same var_list, variables shared through tf.get_variable)"
          % (i, len(tower), len(first)))
    for position, ((_, var), (_, var0)) in enumerate(zip(tower, first)):
      if var is not var0 and _copies.primary_of(var) != (var0, i):
        raise ValueError(
            "towers' variables differ at position %d: tower %d has %s where "
            "tower 0 has %s; every tower must compute gradients for the same "
            "variables (or, replicated, its own copies of them) in the same "
            "order (same var_list, variables shared through "
            "tf.get_variable)"
            % (position, i, _var_name(var), _var_name(var0)))


def _check_present_alike(tower_grads: Sequence[GradsAndVars]) -> None:
  """Raises if a variable's gradient is None in some towers only."""
  for pairs in zip(*tower_grads):
    missing = [i for i, (g, _) in enumerate(pairs) if g is None]
    if missing and len(missing) < len(pairs):
      raise ValueError(
          "the gradient of variable %s is None in tower(s) %s but not in the "
          "others; the towers must build the same model (a variable that "
          "does not reach one tower's loss reaches none)"
          % (_var_name(pairs[0][1]), ", ".join(map(str, missing))))


def _check_weights(weights, num_towers: int) -> List[Weight]:
  if weights is None:
    return [1.0 / num_towers] * num_towers
  weights = list(weights)
  if len(weights) != num_towers:
    raise ValueError("expected one weight per tower (%d), got %d weights"
                     % (num_towers, len(weights)))
  numbers_only = [w for w in weights if isinstance(w, numbers.Real)]
  if any(w < 0 for w in numbers_only):
    raise ValueError("expected non-negative weights (each tower's share of "
                     "the global batch), got %r" % (weights,))
  if len(numbers_only) == num_towers and abs(sum(weights) - 1.0) > 1e-6:
    raise ValueError(
        "expected weights that sum to 1 (each tower's share of the global "
        "batch), got %r summing to %g; to sum gradients instead of averaging "
        "them, scale the loss" % (weights, sum(weights)))
  return weights


def _algorithm(tower_grads: Sequence[GradsAndVars], all_reduce: Optional[str],
               device: Optional[str], built: Optional[str],
               workers: _workers.Workers) -> str:
  """The all-reduce of the towers' copies, checked against the arguments
  (`built`: the towers' own); ``"add_n"`` when they share every
  variable."""
  replicated = [pairs for pairs in zip(*tower_grads)
                if any(p[1] is not pairs[0][1] for p in pairs)]
  if not replicated:
    if all_reduce is not None:
      _allreduce.check_name(all_reduce)
      # One tower is one copy in every mode, replicated ones included.
      if all_reduce != "auto" and len(tower_grads) > 1:
        raise ValueError(
            "all_reduce=%r applies to towers built with variable_device="
            "'replicated', but these towers share one copy of each variable "
            "(averaged next to it); drop all_reduce or build the towers "
            "replicated" % (all_reduce,))
    return "add_n"
  # None: the all-reduce the towers were built with.
  algorithm = _allreduce.resolve(all_reduce or built or "auto",
                                 [v.device for _, v in replicated[0]],
                                 workers.num_workers)
  if device is not None and algorithm != "add_n":
    raise ValueError(
        "device=%r (average_device in minimize) names one device to reduce "
        "on, but the %r all-reduce reduces on every tower's device; use "
        "all_reduce='add_n' to reduce on one device, or drop it"
        % (device, algorithm))
  return algorithm
