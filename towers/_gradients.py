"""Averaging the towers' gradients: the synchronization point."""

import numbers
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

import tensorflow.compat.v1 as tf

from towers import _allreduce
from towers import _context
from towers import _packing
from towers import _regularization
from towers import _replicas
from towers import _workers

Gradient = Union[tf.Tensor, tf.IndexedSlices]
GradsAndVars = List[Tuple[Optional[Gradient], tf.Variable]]
Weight = Union[float, tf.Tensor]


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
    weights: ``[num_towers]`` shares of the global batch, or None (equal).
    device: where to reduce; None: next to each variable.
    control_inputs: ops every averaged gradient also waits for.
    all_reduce: for replicated towers; None: ``Towers.all_reduce``'s.
    pack_bytes: the largest gradient packed with others; 0: no packing.

  Returns:
    ``[num_vars]`` of ``(grad, var)``, the first tower's (copy 0's) pairs.

  Raises:
    ValueError: if the towers' lists, weights, `all_reduce`, `device` or
      `pack_bytes` do not fit.
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
      primary = _replicas.primary_of(copy)
      grad0 = first.get(id(primary[0])) if primary else None
      # Sparse gradients and add_n's are one tensor for every copy.
      if isinstance(grad, tf.Tensor) and grad is not grad0 and \
          isinstance(grad0, tf.Tensor):
        recorded.append((grad0, index, grad))
  _replicas.record_averaged(recorded)


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
  check_tower_grads(tower_grads)
  weights = _check_weights(weights, len(tower_grads))
  pack_bytes = _packing.check_pack_bytes(pack_bytes)
  replicated = [pairs for pairs in zip(*tower_grads)
                if any(p[1] is not pairs[0][1] for p in pairs)]
  algorithm = _algorithm(replicated, all_reduce, device, len(tower_grads))
  tower_grads, decay = _without_weight_decay(tower_grads, device)
  flat = [t for tower in tower_grads for g, _ in tower for t in tensors(g)]
  flat += [t for parts in decay.values() for part in parts for t in part]
  flat += list(control_inputs)
  positions = [_Position(pairs, device, algorithm)
               for pairs in zip(*tower_grads)]
  # One tower reduces nothing: a pack would only add copies.
  keys = [p.pack_key(pack_bytes) if len(tower_grads) > 1 else None
          for p in positions]
  averaged: Dict[int, List[Optional[Gradient]]] = {}
  with tf.name_scope("average_gradients"):
    barrier = _barrier(flat, list(control_inputs), list({
        id(v): v for tower in tower_grads for _, v in tower}.values()))
    uniform = is_uniform(weights)
    # A collective all-reduce launches after the towers' own cross-tower
    # sums on each device (one launch order per device: see _context).
    launched = _context.launched_before(flat) \
        if algorithm == "collective" or _workers.count() > 1 else {}
    for unit in _packing.group(keys):
      members = [positions[i] for i in unit]
      first = members[0]
      if first.shared or first.algorithm == "add_n":
        waits = [barrier([v for m in members for v in m.variables])]
      else:
        waits = [barrier([m.variables[j] for m in members])
                 for j in range(len(first.where))]
      if len(unit) == 1:
        averaged[unit[0]] = _average(
            first.grads, first.variables[0], weights, uniform, waits,
            first.where, first.algorithm, launched)
        continue
      with tf.name_scope("pack"):
        for index, results in zip(unit, _average_pack(
            members, weights, uniform, waits, launched)):
          averaged[index] = results
    for i, parts in decay.items():
      averaged[i] = _add_weight_decay(averaged[i], parts, positions[i],
                                      weights, uniform)
  groups: List[GradsAndVars] = [[] for _ in tower_grads]
  for i, position in enumerate(positions):
    copies = position.variables[:1] if position.shared else position.variables
    for j, var in enumerate(copies):
      groups[j].append((averaged[i][j], var))
  return [group for group in groups if group]


def _without_weight_decay(tower_grads: Sequence[GradsAndVars],
                          device: Optional[str]):
  """Places weight decay's share of the towers' gradients next to its
  variables (`_regularization`).

  Where a shared variable's gradient is, in every tower, a data part plus
  weight decay computed next to the variable: reduced there, each tower's
  sum moves there too (the data part crosses as the whole did, the same
  sum); reduced on `device`, the data parts are, and the weight decay is
  added next to the variable afterwards (it stays where it is).

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
    split = [_regularization.parts(g) for g, _ in pairs]
    if not all(parts is not None and all(t.device == home for t in parts[1])
               for parts in split):
      continue
    if device is None:
      for grad, _ in pairs:
        grad.op._set_device(home)  # pylint: disable=protected-access
      continue
    decay[i] = [parts[1] for parts in split if parts is not None]
    data.update(((j, i), parts[0]) for j, parts in enumerate(split)
                if parts is not None)
  if not decay:
    return tower_grads, decay
  return [[(data.get((j, i), g), v) for i, (g, v) in enumerate(tower)]
          for j, tower in enumerate(tower_grads)], decay


def _add_weight_decay(results: List[Optional[Gradient]],
                      parts: List[List[tf.Tensor]], position: "_Position",
                      weights: List[Weight], uniform: bool
                     ) -> List[Optional[Gradient]]:
  """Adds the towers' weight-decay parts, averaged next to the variable, to
  each averaged data part, there (next to each copy, when replicated)."""
  with tf.device(position.variables[0].device), tf.name_scope("weight_decay"):
    per_tower = [_sum_in_order(p) for p in parts]
    if not uniform:
      per_tower = [_scaled(t, w) for t, w in zip(per_tower, weights)]
    total = _opaque(_combine(per_tower, _sum_in_order, uniform))
  homes = position.variables[:1] if position.shared else position.variables
  done: Dict[int, Gradient] = {}
  for result, var in zip(results, homes):
    if id(result) not in done:
      with tf.device(var.device):
        done[id(result)] = tf.add(_opaque(tf.convert_to_tensor(result)),
                                  total)
  return [done[id(result)] for result in results]


def _opaque(tensor: tf.Tensor) -> tf.Tensor:
  """`tensor`, as an input of an addition that Grappler leaves alone.

  Grappler's arithmetic optimizer rewrites a tree of additions as one
  ``AddN``, its inputs sorted by name: an addition whose input is itself a
  sum (of weighted gradients) would join that sum's tree, and the order of
  its additions would follow op names, differently for a pack's sum and an
  unpacked one. A ``Snapshot`` between them keeps the trees apart.
  """
  if tensor.op.type in ("Add", "AddV2", "AddN"):
    return tf.raw_ops.Snapshot(input=tensor)
  return tensor


class _Position:
  """One variable's gradients in every tower, and where they are reduced.

  Attributes:
    grads: ``[num_towers]`` gradients.
    variables: ``[num_towers]`` variables: one shared, or its copies.
    shared: whether every tower has the same variable.
    where: the devices the reduction leaves its result on: one for a shared
      variable (its own, or `device`), else each copy's (copy 0's replaced
      by `device`).
    algorithm: ``"add_n"`` for a shared variable, else the all-reduce.
  """

  def __init__(self, pairs, device: Optional[str], algorithm: str):
    self.grads = [g for g, _ in pairs]
    self.variables = [v for _, v in pairs]
    self.shared = all(v is self.variables[0] for v in self.variables)
    if self.shared:
      self.where = [self.variables[0].device if device is None else device]
      self.algorithm = "add_n"
    else:
      self.where = [v.device for v in self.variables]
      if device is not None:
        self.where[0] = device
      self.algorithm = algorithm

  def pack_key(self, pack_bytes: int) -> Optional[Tuple[object, ...]]:
    """What a position packed with this one shares, or None if unpackable:
    its dtype, the devices its towers' gradients are on, and where and how
    it is reduced."""
    if not all(_packing.packable(g, pack_bytes) for g in self.grads):
      return None
    dtypes = {g.dtype.base_dtype for g in self.grads}
    if len(dtypes) > 1:
      return None
    return (dtypes.pop(), tuple(g.device for g in self.grads),
            tuple(self.where), self.shared, self.algorithm)


def _average_pack(members: List[_Position], weights: List[Weight],
                  uniform: bool, waits: List[List[tf.Operation]],
                  launched: Dict[str, tf.Operation]
                 ) -> List[List[Optional[Gradient]]]:
  """Returns `_average` of each member, from one reduction of a pack.

  Each tower's gradients are packed on that tower's device, and the result
  unpacked on each device it is left on (next to each copy, or to the
  variable), so one tensor crosses where one per gradient would.
  """
  first = members[0]
  chunks = len(first.where) if first.algorithm == "ring" else 1
  packs, sizes = [], None
  for i in range(len(first.grads)):
    with tf.device(first.grads[i].device):
      packed, sizes = _packing.pack([m.grads[i] for m in members], chunks)
      packs.append(packed)
  results = _average(packs, first.variables[0], weights, uniform, waits,
                     first.where, first.algorithm, launched, sizes)
  shapes = [m.grads[0].shape for m in members]
  unpacked = []
  for result, where in zip(results, first.where):
    with tf.device(where):
      unpacked.append(_packing.unpack(result, shapes, chunks))
  # [num_devices][num_members] -> [num_members][num_devices]
  return [list(per_member) for per_member in zip(*unpacked)]


def _barrier(flat: List[object], control_inputs: List[object],
             variables) -> Callable[[Sequence[tf.Variable]],
                                    List[tf.Operation]]:
  """Returns what the reduction of some variables' gradients waits for.

  The update of a variable must not start before every tower has read it.
  With resource variables that is exactly the reads: an update copies a
  buffer an earlier read still holds, so the reads' values stay the step's
  (TensorFlow's copy-on-write). Each variable's reduction then waits for its
  own reads in every tower (and for the losses and update ops in
  `control_inputs`), and its update overlaps the rest of backprop. A ref
  variable's read is the buffer itself, which an in-place update changes
  under every op still to use it, so with ref variables (or a handle passed
  on into a v1 control-flow loop, whose reads cannot be waited for from
  outside it) every reduction waits for every gradient of every tower: the
  ``GATE_GRAPH`` guarantee across towers.
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


def _reads(flat: List[Any],
           variables) -> Optional[Dict[int, List[tf.Operation]]]:
  """The ops reading each resource variable that the step runs, or None.

  None when a variable is not a resource variable, or its handle is passed
  on (an ``Enter`` or ``Identity`` of it) by an op the step runs.
  """
  if any(getattr(v, "op", None) is None or v.op.type != "VarHandleOp"
         for v in variables):
    return None
  seen = set()
  # Tensors, ops, or what tf.group also takes (an assign's unread variable).
  stack = [x if isinstance(x, tf.Operation) else x.op for x in flat]
  while stack:
    op = stack.pop()
    if op in seen:
      continue
    seen.add(op)
    stack.extend(t.op for t in op.inputs)
    stack.extend(op.control_inputs)
  reads = {}
  for var in variables:
    ops = [c for c in var.op.outputs[0].consumers() if c in seen]
    if any(t.dtype == tf.resource for c in ops for t in c.outputs):
      return None
    reads[id(var)] = ops
  return reads


def _algorithm(replicated, all_reduce: Optional[str], device: Optional[str],
               num_towers: int) -> str:
  if not replicated:
    if all_reduce is not None:
      _allreduce.check_name(all_reduce)
      # One tower is one copy in every mode, replicated ones included.
      if all_reduce != "auto" and num_towers > 1:
        raise ValueError(
            "all_reduce=%r applies to towers built with variable_device="
            "'replicated', but these towers share one copy of each variable "
            "(averaged next to it); drop all_reduce or build the towers "
            "replicated" % (all_reduce,))
    return "add_n"
  algorithm = _allreduce.resolve(all_reduce or "auto",
                                 [v.device for _, v in replicated[0]])
  if device is not None and algorithm != "add_n":
    raise ValueError(
        "device=%r (average_device in minimize) names one device to reduce "
        "on, but the %r all-reduce reduces on every tower's device; use "
        "all_reduce='add_n' to reduce on one device, or drop it"
        % (device, algorithm))
  return algorithm


def tensors(grad: Optional[Gradient]) -> List[tf.Tensor]:
  if grad is None:
    return []
  if isinstance(grad, tf.IndexedSlices):
    return [grad.values, grad.indices]
  return [grad]


def _var_name(var) -> str:
  return getattr(var, "name", repr(var))


def check_tower_grads(tower_grads) -> None:
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
      if var is not var0 and _replicas.primary_of(var) != (var0, i):
        raise ValueError(
            "towers' variables differ at position %d: tower %d has %s where "
            "tower 0 has %s; every tower must compute gradients for the same "
            "variables (or, replicated, its own copies of them) in the same "
            "order (same var_list, variables shared through "
            "tf.get_variable)"
            % (position, i, _var_name(var), _var_name(var0)))


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


def is_uniform(weights: Sequence[Weight]) -> bool:
  """Whether `weights` are Python numbers, all equal."""
  return all(isinstance(w, numbers.Real) for w in weights) and (
      max(weights) - min(weights) <= 1e-12)


def _scaled(tensor: tf.Tensor, weight: Weight) -> tf.Tensor:
  # Scaling runs on the gradient's own device, so the towers do it in
  # parallel and only the reduction runs next to the variable.
  with tf.device(tensor.device):
    if isinstance(weight, numbers.Real):
      return tensor * tf.constant(weight, tensor.dtype)
    return tensor * tf.cast(weight, tensor.dtype)


def _average(grads: List[Optional[Gradient]], var, weights: List[Weight],
             uniform: bool, waits: List[List[tf.Operation]],
             devices: List[str], algorithm: str,
             launched: Dict[str, tf.Operation],
             chunks: Optional[List[int]] = None
            ) -> List[Optional[Gradient]]:
  """Returns the weighted mean of one variable's gradients on `devices`.

  With `uniform` weights the towers' gradients are combined first and
  divided once; otherwise each is scaled on its own device first. One
  device (a shared variable) gets one result; for copies, the result on
  each copy's device (the same tensor for all with ``"add_n"``). `waits`
  holds what the reduction waits for: one list, or one per device. `chunks`
  are a pack's ring chunks (`_allreduce.all_sum`).
  """
  barrier = list({id(op): op for wait in waits for op in wait}.values())
  missing = [i for i, g in enumerate(grads) if g is None]
  if len(missing) == len(grads):
    return [None] * len(devices)
  if missing:
    raise ValueError(
        "the gradient of variable %s is None in tower(s) %s but not in the "
        "others; the towers must build the same model (a variable that does "
        "not reach one tower's loss reaches none)"
        % (_var_name(var), ", ".join(map(str, missing))))
  present: List[Gradient] = [g for g in grads if g is not None]
  sparse = [isinstance(g, tf.IndexedSlices) for g in present]
  workers = _workers.count()
  if any(sparse) and not all(sparse):
    # Dense in some towers and sparse in others: only possible when the
    # towers' models differ. Converting all to dense is exact.
    present = [tf.convert_to_tensor(g) for g in present]
  if isinstance(present[0], tf.IndexedSlices):
    values = [g.values for g in present]
    indices = [g.indices for g in present]
    if len({i.dtype for i in indices}) > 1:
      indices = [tf.cast(i, tf.int64) for i in indices]
    if not uniform:
      values = [_scaled(v, w) for v, w in zip(values, weights)]
    # Gathered on one device for every copy: the towers' slices differ in
    # length, which a ring's chunks and a collective's group cannot take.
    with tf.device(devices[0]), tf.control_dependencies(barrier):
      values = _combine(values, lambda t: tf.concat(t, 0), uniform)
      indices = _combine(indices, lambda t: tf.concat(t, 0), False)
    if workers > 1:
      # Every worker's slices, worker after worker (the order one worker's
      # towers would have), then the workers' mean.
      home = _workers.home()
      values, indices = _allreduce.all_gather([values, indices], home,
                                              launched)
      with tf.device(home):
        values = values * tf.constant(1.0 / workers, values.dtype)
    return [tf.IndexedSlices(values, indices, present[0].dense_shape)
           ] * len(devices)
  if not uniform:
    present = [_scaled(g, w) for g, w in zip(present, weights)]
  if len(devices) == 1 or algorithm == "add_n":
    with tf.device(devices[0]), tf.control_dependencies(barrier):
      local = _combine(present, _sum_in_order, uniform)
    if workers == 1:
      return [local] * len(devices)
    # The worker's average, all-reduced with the other workers' from this
    # worker's first tower device, and their mean read by every copy.
    home = _workers.home()
    total, = _allreduce.all_sum([local], [home], "collective", launched)
    with tf.device(home):
      return [total * tf.constant(1.0 / workers, total.dtype)] * len(devices)
  inputs = []
  for g, d, wait in zip(present, devices, waits):
    with tf.device(d), tf.control_dependencies(wait):
      inputs.append(tf.identity(g))
  # Across workers the group holds every worker's towers: each worker's
  # weights sum to 1, and the workers count equally.
  sums = _allreduce.all_sum(inputs, devices, algorithm, launched, chunks)
  divisor = workers * (len(sums) if uniform else 1)
  if divisor == 1:
    return sums
  averaged = []
  for total, d in zip(sums, devices):
    with tf.device(d):
      averaged.append(total * tf.constant(1.0 / divisor, total.dtype))
  return averaged


def _sum_in_order(tensors: List[tf.Tensor]) -> tf.Tensor:
  """Returns ``((t0 + t1) + t2) + ...``: the towers' sum in tower order.

  A chain of additions, not ``tf.add_n``: Grappler's arithmetic optimizer
  sorts an ``AddN``'s inputs by their names when they are products (a
  tower's weight times its gradient, or a regularizer's gradient), so its
  order of additions, and the sum's last bits, would follow op names, and a
  pack's sum would differ from the gradients' own. A binary addition gives
  the same bits either way round, so the chain's order holds; each addition
  can reuse its left input's buffer.
  """
  total = tensors[0]
  for tensor in tensors[1:]:
    total = tf.add(total, tensor)
  return total


def _combine(tensors: List[tf.Tensor], combine, divide: bool) -> tf.Tensor:
  """Combines the towers' tensors, then divides by their number if asked."""
  if len(tensors) == 1:
    # An identity, not the tensor itself: the result must wait for the
    # barrier.
    return tf.identity(tensors[0])
  total = combine(tensors)
  if not divide:
    return total
  return total * tf.constant(1.0 / len(tensors), total.dtype)
