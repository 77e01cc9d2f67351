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
  devices = list(plan.devices)
  num_towers = len(devices)
  placer = plan.placer()
  # First, so that a session lacking a tower device names the check's fix.
  check = _device_check.build(devices, placer,
                              "%s_device_check" % plan.tower_name)
  shards, weights = None, None
  if inputs is not None and not callable(inputs):
    shards, weights = _inputs.split_inputs(inputs, num_towers,
                                           allow_empty=allow_empty)
  # A staged batch is sized from what was staged, as a callable's is.
  sized = callable(inputs) or plan.stage_inputs
  # The towers' name scopes; staging opens them first, to read the batches,
  # and the towers re-enter them.
  names = ["%s_%d" % (plan.tower_name, i) for i in range(num_towers)]
  staged = None
  if plan.stage_inputs:
    names, staged = _read_staged(inputs, shards, devices, placer, names)
    weights = None
  trainable = tf.get_collection_ref(tf.GraphKeys.TRAINABLE_VARIABLES)
  tower_set = _context.TowerSet(devices, uniform=not sized and (
      weights is None or _reduction.is_uniform(weights)), device_check=check,
                                sums=plan.sums)
  start = _tf_internals.last_op_id()
  results, batches, sizes = [], [], []
  scopes: List[str] = []
  # The regularization losses each tower added.
  added: List[List[object]] = []
  outer = tf.get_variable_scope()
  requested: List[str] = []
  for i, device in enumerate(devices):
    known = len(trainable)
    with _names.tower_variable_scope(
        outer, i, names[i].rstrip("/"), requested), \
        _placement.tower_placement(device, placer), \
        builder.tower(i, device), \
        tf.name_scope(names[i]) as scope, \
        _names.single_device_names(scope, i), \
        _tf_versions.variables_outside_xla():
      batch = staged[i] if staged else _inputs.tower_batch(inputs, shards, i)
      size = _inputs.batch_size(batch) if sized else None
      sizes.append(size)
      # The tower's share of the global batch, for the gradient of its
      # cross-tower sums: its weight, or for a callable input its batch
      # size (the weight times the same factor in every tower).
      share = weights[i] if weights is not None else (
          1.0 if size is None else size)
      first = (scopes[0], added[0]) if i > 0 else ()
      seeds = _tf_internals.op_seeds_as_if_alone(first_op) if i == 0 \
          else contextlib.nullcontext()
      with tower_set.tower(i, scope, share), \
          _precision.master_weights(plan.compute_dtype), \
          _regularization_view.tower(scope, *first) as kept, seeds, \
          builder.gated(i):
        results.append(tower_fn(i, scope, batch, check))
      added.append(kept)
      if i > 0 and len(trainable) > known:
        raise _unshared_variable_error(trainable[known], scope)
    scopes.append(scope)
    batches.append(batch)
  tower_set.finish(start, steps(results) if steps else None)
  builder.finish()
  if weights is None:
    weights = _inputs.size_weights(sizes) if sized else [
        1.0 / num_towers] * num_towers
  return BuiltTowers(results=results, scopes=scopes, devices=devices,
                     batches=batches, weights=weights, device_check=check,
                     batch_size=_inputs.total_size(inputs, sizes),
                     regularization_losses=added)


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
