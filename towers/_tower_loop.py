"""The tower loop: the recipe's loop over devices, shared by every builder.

Tower ``i`` is built under its device function and ``tf.name_scope('tower_i')``
inside the caller's variable scope, reusing tower 0's variables (or, by its
mode's builder, `_modes`, its own copies), with its share of the batch, as
the current tower of the tower context. `build_towers` and `infer` each say
what a tower builds.
"""

import collections
import contextlib
from typing import Callable, List, Optional

import tensorflow.compat.v1 as tf

from towers import _context
from towers import _device_check
from towers import _inputs
from towers import _modes
from towers import _names
from towers import _plan
from towers import _placement
from towers import _precision
from towers import _reduction
from towers import _regularization_view
from towers import _staging
from towers import _tf_internals
from towers import _tf_versions


BuiltTowers = collections.namedtuple("BuiltTowers", [
    "results", "scopes", "devices", "batches", "weights", "device_check",
    "batch_size", "regularization_losses"])


def build_each_tower(tower_fn: Callable[[int, str, List[object],
                                          Optional[tf.Operation]], object],
                     builder: _modes.OneCopy, *, inputs: _inputs.Inputs,
                     allow_empty: bool = False,
                     steps: Optional[Callable[[List[object]],
                                              List[List[object]]]] = None
                    ) -> BuiltTowers:
  """Calls ``tower_fn(index, scope, batch, check)`` once in each tower.

  The recipe's loop, shared by `build_towers` and `infer`: tower ``i`` is
  built on the device the plan of `builder` (its mode's, `_modes`) gives it,
  under ``tf.name_scope('tower_i')`` inside the caller's variable scope,
  reusing tower 0's variables, on its own view of the regularization
  losses (`_regularization_view`); `batch` is the list of arguments its
  model function takes after the scope; `check` is the towers'
  `_device_check` (None where none is needed), which what the tower
  computes must wait for. The caller's name scope is kept as it is
  (``model/tower_0/``, not ``model/model/``).

  With the plan's `compute_dtype`, `tower_fn` runs under
  `_precision.master_weights`; with `stage_inputs`, every tower's batch is
  read first, tower after tower, and the towers are built on the staged
  batches (`_staging.stage`). `steps`, given the results, returns the roots
  of each step that will run part of them (several losses), for the order
  the cross-tower sums launch in.

  Returns:
    A `BuiltTowers`: ``[num_towers]`` results of `tower_fn`, the scopes, the
    devices, each tower's share of the global batch, the device check, the
    global batch's size and ``[num_towers]`` lists of the regularization
    losses each tower added.

  Raises:
    TypeError, ValueError: for bad inputs, or a tower after the first that
      creates a trainable variable.
  """
  # Tower 0's random ops are seeded as if the ops built here before its
  # model were not (TensorFlow 1.15 counts them).
  first_op = _tf_internals.last_op_id()
  plan = builder.plan
  placer = plan.placer()
  # First, so that a session lacking a tower device names the check's fix.
  check = _device_check.build(plan.devices, placer,
                              "%s_device_check" % plan.tower_name)
  batches = _Batches(inputs, plan, placer, allow_empty)
  tower_set = _context.TowerSet(plan, uniform=batches.uniform,
                                device_check=check)
  start = _tf_internals.last_op_id()
  loop = _Loop(tower_fn, builder, placer, check, first_op)
  for i in range(plan.num_towers):
    loop.build(i, batches, tower_set)
  tower_set.finish(start, steps(loop.results) if steps else None)
  builder.finish()
  return BuiltTowers(results=loop.results, scopes=loop.scopes,
                     devices=list(plan.devices), batches=loop.batches,
                     weights=batches.weights(loop.sizes), device_check=check,
                     batch_size=_inputs.total_size(inputs, loop.sizes),
                     regularization_losses=loop.added)


class _Batches:
  """Each tower's batch and share of the global batch, and its name scope
  (staging opens the scopes first, to read the batches; the towers re-enter
  them)."""

  def __init__(self, inputs: _inputs.Inputs, plan: _plan.Plan,
               placer: _placement.DeviceFn, allow_empty: bool):
    self._inputs = inputs
    num_towers = plan.num_towers
    self._shards, self._weights = None, None
    if inputs is not None and not callable(inputs):
      self._shards, self._weights = _inputs.split_inputs(
          inputs, num_towers, allow_empty=allow_empty)
    # A staged batch is sized from what was staged, as a callable's is.
    self.sized = callable(inputs) or plan.stage_inputs
    self.names = ["%s_%d" % (plan.tower_name, i) for i in range(num_towers)]
    self._staged = None
    if plan.stage_inputs:
      self.names, self._staged = _read_staged(
          inputs, self._shards, list(plan.devices), placer, self.names)
      self._weights = None
    self.uniform = not self.sized and (
        self._weights is None or _reduction.is_uniform(self._weights))

  def batch(self, index: int) -> List[object]:
    if self._staged:
      return self._staged[index]
    return _inputs.tower_batch(self._inputs, self._shards, index)

  def share(self, index: int, size: Optional[object]) -> object:
    """The tower's share of the global batch, for the gradient of its
    cross-tower sums: its weight, or for a callable input its batch size
    (the weight times the same factor in every tower)."""
    if self._weights is not None:
      return self._weights[index]
    return 1.0 if size is None else size

  def weights(self, sizes: List[Optional[object]]) -> List[object]:
    """Every tower's share of the global batch, once each is built."""
    if self._weights is not None:
      return list(self._weights)
    if self.sized:
      return _inputs.size_weights(sizes)
    return [1.0 / len(sizes)] * len(sizes)


class _Loop:
  """The towers built so far: one `build` call per tower, in order."""

  def __init__(self, tower_fn: Callable[..., object],
               builder: _modes.OneCopy, placer: _placement.DeviceFn,
               check: Optional[tf.Operation], first_op: int):
    self._tower_fn = tower_fn
    self._builder = builder
    self._placer = placer
    self._check = check
    self._first_op = first_op
    self._trainable = tf.get_collection_ref(tf.GraphKeys.TRAINABLE_VARIABLES)
    self._outer = tf.get_variable_scope()
    self._requested: List[str] = []
    self.results: List[object] = []
    self.batches: List[List[object]] = []
    self.sizes: List[Optional[object]] = []
    self.scopes: List[str] = []
    # The regularization losses each tower added.
    self.added: List[List[object]] = []

  def build(self, i: int, batches: _Batches,
            tower_set: _context.TowerSet) -> None:
    """Builds tower `i` in its scopes, as the tower context's tower."""
    known = len(self._trainable)
    device = self._builder.plan.devices[i]
    with _names.tower_variable_scope(
        self._outer, i, batches.names[i].rstrip("/"), self._requested), \
        _placement.tower_placement(device, self._placer), \
        self._builder.tower(i, device), \
        tf.name_scope(batches.names[i]) as scope, \
        _names.single_device_names(scope, i), \
        _tf_versions.variables_outside_xla():
      batch = batches.batch(i)
      size = _inputs.batch_size(batch) if batches.sized else None
      self.sizes.append(size)
      first = (self.scopes[0], self.added[0]) if i > 0 else ()
      seeds = _tf_internals.op_seeds_as_if_alone(self._first_op) if i == 0 \
          else contextlib.nullcontext()
      with tower_set.tower(i, scope, batches.share(i, size)), \
          _precision.master_weights(self._builder.plan.compute_dtype), \
          _regularization_view.tower(scope, *first) as kept, seeds, \
          self._builder.gated(i):
        self.results.append(self._tower_fn(i, scope, batch, self._check))
      self.added.append(kept)
      if i > 0 and len(self._trainable) > known:
        raise _unshared_variable_error(self._trainable[known], scope)
    self.scopes.append(scope)
    self.batches.append(batch)


def _read_staged(inputs: _inputs.Inputs, shards: Optional[List[object]],
                 devices: List[str], placer: _placement.DeviceFn,
                 names: List[str]):
  """Reads every tower's batch in its scope, in tower order, and stages it.

  Returns the towers' name scopes (the towers are built in them afterwards)
  and their staged batches.
  """
  scopes: List[str] = []
  batches: List[List[object]] = []
  previous: List[tf.Tensor] = []
  for i, (device, name) in enumerate(zip(devices, names)):
    # A callable is read tower after tower, so tower i gets the i-th batch.
    with _placement.tower_placement(device, placer), \
        tf.name_scope(name) as scope, \
        tf.control_dependencies(previous):
      batch = _inputs.tower_batch(inputs, shards, i)
    previous = [t for t in tf.nest.flatten(batch) if isinstance(t, tf.Tensor)]
    scopes.append(scope)
    batches.append(batch)
  return scopes, _staging.stage(batches, devices, scopes)


def _unshared_variable_error(var: tf.Variable, scope: str) -> ValueError:
  return ValueError(
      "%s created the trainable variable %s, which tower 0 did not create: "
      "the towers would not share it and only one tower would train it. "
      "Create variables with tf.get_variable (or tf.compat.v1.layers) so "
      "that variable_scope reuse shares them, not with tf.Variable or a "
      "module built anew in every tower; a Keras layer or model makes new "
      "weights on each call of model_fn that builds it: build it once, "
      "outside model_fn, and call it in model_fn"
      % (scope.rstrip("/"), var.name))
