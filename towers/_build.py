"""Building the towers: one model replica per device, variables shared."""

import collections
import functools
from typing import Callable, Dict, List, Optional, Sequence

import tensorflow.compat.v1 as tf

from towers import _apply
from towers import _device_check
from towers import _inputs
from towers import _isolation
from towers import _loss_paths
from towers import _losses
from towers import _modes
from towers import _placement
from towers import _plan
from towers import _precision
from towers import _regularization
from towers import _shares
from towers import _tf_internals
from towers import _tower_loop
from towers import _updates
from towers import _workers

Towers = collections.namedtuple("Towers", [
    "losses", "loss", "tower_grads", "weights", "scopes", "devices",
    "summaries", "update_ops", "outputs", "grads_and_vars", "all_reduce",
    "loss_scale", "batch_size", "applies", "plan"])
Towers.__doc__ = """What `build_towers` built.

Fields (with a dict of losses, those of losses, gradients, summaries and
updates are dicts by loss: ``tower_grads["d"]``, ``update_ops["g"]``):
  losses: ``[num_towers]`` scalar loss tensors, one per tower.
  loss: the towers' losses averaged with `weights`: the global batch's.
  tower_grads: ``[num_towers][num_vars]`` of ``(grad, var)``, each tower's
    ``opt.compute_gradients`` result.
  weights: ``[num_towers]`` shares of the global batch, Python floats or
    scalar float64 tensors (cast to each gradient's dtype), summing to 1.
  scopes: ``[num_towers]`` name scopes, such as ``'tower_0/'``.
  devices: ``[num_towers]`` device strings the towers were built on.
  summaries: the final tower's ``SUMMARIES`` (as the original keeps); by
    loss, each under the first key whose step computes what it reads.
  update_ops: the first tower's ``UPDATE_OPS`` (batch-norm statistics, as
    tf-slim runs them); by loss, those whose statistics feed the loss.
  outputs: ``[num_towers]`` of what `model_fn` returned beside its loss
    (None where it returned the loss alone).
  grads_and_vars: from `minimize`, the averaged (and clipped) ``(grad, var)``
    list it applied (copy 0's, when replicated); else None.
  all_reduce: replicated towers' all-reduce (``"auto"`` resolved to
    ``"add_n"``, ``"ring"`` or ``"collective"``); None when shared.
  loss_scale: from `minimize` with loss scaling, the scale (a scalar float32
    tensor, to log); else None.
  batch_size: the global batch's number of examples (this worker's): a
    Python float when static, a scalar float32 tensor when known only at
    run time, None when `model_fn` reads its own inputs.
  applies: from `minimize`, a scalar bool tensor: whether the next run of
    the train op applies an update (every k-th with `accumulate_steps=k`;
    fetched with the train op, whether that run does); else None.
  plan: the arguments the towers were built with, checked and resolved
    (devices, variable placement, all-reduce, workers, the shares of the
    batch): read-only.
"""


def build_towers(model_fn: Callable[..., object],
                 opt: tf.train.Optimizer,
                 num_gpus: int,
                 *,
                 inputs: _inputs.Inputs = None,
                 devices: Optional[Sequence[str]] = None,
                 variable_device: _placement.VariableDevice = "cpu",
                 tower_name: str = "tower",
                 all_reduce: str = "auto",
                 compute_dtype: _precision.ComputeDtype = None,
                 stage_inputs: bool = False,
                 num_workers: int = 1,
                 **compute_gradients_kwargs) -> Towers:
  """Builds one model replica per device and computes each one's gradients.

  Tower ``i`` is built under ``devices[i]`` and ``tf.name_scope('tower_i')``
  reusing tower 0's variables and runs ``opt.compute_gradients``; the losses
  are checked, ``opt.apply_gradients`` is routed to `apply_gradients`.

  Args:
    model_fn: ``model_fn(scope, *batch)`` -> loss, or a dict of losses (each
      with its `opt` and ``var_list``), alone or with outputs as a pair.
    opt: a ``tf.compat.v1.train.Optimizer``, or a dict of them by loss.
    num_gpus: the number of towers, a positive int (long forms: docs/api.md).
    inputs: None, a global batch (split on axis 0), or a callable.
    devices: ``[num_gpus]`` devices; default ``tower_devices(num_gpus)``.
    variable_device: ``'cpu'``, ``'gpu'``, ``'balanced'``, ``'replicated'``,
      a device string or function.
    tower_name: the towers' name-scope prefix.
    all_reduce: replicated: ``'add_n'``, ``'ring'``, ``'collective'``.
    compute_dtype: ``'float16'``/``'bfloat16'``: float32 master weights.
    stage_inputs: whether to stage each tower's next batch on its device.
    num_workers: worker tasks training together (collective, replicated).
    **compute_gradients_kwargs: for ``opt.compute_gradients`` (0 gating;
      ``var_list``: variables, a name prefix or a callable, or a dict).

  Returns:
    A `Towers` namedtuple.

  Raises:
    RuntimeError: under eager execution.
    TypeError: for arguments or losses of the wrong type.
    ValueError: for bad values, or towers that would train silently wrong.
  """
  if not callable(model_fn):
    raise TypeError("expected model_fn to be callable as model_fn(scope, "
                    "*batch), got %r" % (model_fn,))
  opts = _losses.optimizers(opt)
  keys = list(opts)
  _plan.check_training(variable_device, stage_inputs, inputs, opts.values())
  plan = _plan.resolve(
      num_gpus, devices=devices, variable_device=variable_device,
      tower_name=tower_name, all_reduce=all_reduce, num_workers=num_workers,
      compute_dtype=compute_dtype, stage_inputs=stage_inputs)
  _workers.check_one_cluster(plan.workers, _shares.graph_workers())
  entries = _losses.check_var_list(
      compute_gradients_kwargs.pop("var_list", None), keys)
  compute_gradients_kwargs.setdefault("gate_gradients",
                                      tf.train.Optimizer.GATE_NONE)
  for each in opts.values():
    # The tutorial's own opt.apply_gradients(...) then updates every copy.
    _apply.route(each)
  tower = _Tower(model_fn, opts, entries, compute_gradients_kwargs,
                 _modes.builder(plan))
  built = _tower_loop.build_each_tower(
      tower, tower.builder, inputs=inputs,
      steps=functools.partial(_step_roots, keys) if len(keys) > 1 else None)
  losses, outputs, tower_grads, update_ops, summaries = zip(*built.results)
  by_key = {key: [each[key] for each in losses] for key in keys}
  grads_by_key = {key: [each[key] for each in tower_grads] for key in keys}
  _isolation.check_losses(by_key, built.scopes, built.batches,
                          added=built.regularization_losses)
  plan = plan.with_shares(built.weights)
  means = {}
  for key in keys:
    _shares.record(grads_by_key[key], plan)
    with tf.name_scope("%s_loss" % tower_name):
      means[key] = tf.add_n([loss * tf.cast(w, loss.dtype)
                             for loss, w in zip(by_key[key], built.weights)])
  return Towers(losses=_losses.unwrap(by_key), loss=_losses.unwrap(means),
                tower_grads=_losses.unwrap(grads_by_key),
                weights=built.weights, scopes=built.scopes,
                devices=built.devices,
                summaries=_losses.unwrap(summaries[-1]),
                update_ops=_losses.unwrap(update_ops[0]),
                outputs=list(outputs),
                grads_and_vars=None,
                all_reduce=plan.all_reduce, loss_scale=None,
                batch_size=built.batch_size, applies=None,
                plan=plan)


class _Tower:
  """What `build_towers` builds in each tower: the model, its checks, each
  loss's gradients (by the mode's builder), its update ops and summaries."""

  def __init__(self, model_fn: Callable[..., object],
               opts: Dict[_losses.Key, tf.train.Optimizer],
               entries: Dict[_losses.Key, object],
               kwargs: Dict[str, object],
               builder: _modes.OneCopy):
    self._model_fn = model_fn
    self._opts = opts
    self._entries = entries
    self._kwargs = kwargs
    self.builder = builder
    # Each loss's variables: resolved in tower 0, once it has made them.
    self._var_lists: Dict[_losses.Key, Optional[List[tf.Variable]]] = {}

  def __call__(self, index: int, scope: str, batch: List[object],
               check: Optional[tf.Operation]):
    start = _tf_internals.last_op_id()
    losses, output = _losses.check_result(self._model_fn(scope, *batch),
                                          scope, list(self._opts))
    made_by_model = _tf_internals.made_after(start)
    # A Keras layer's updates (batch norm's), which nothing would run.
    _updates.collect(made_by_model, scope, list(losses.values()), output)
    terms = self.builder.after_model(index, scope, batch,
                                     list(losses.values()), made_by_model)
    # The gradients, and so every reduction of them, wait for the check.
    for loss in losses.values():
      _device_check.gate(loss, check)
    # Tower 0's batch-norm updates stand for all (tf-slim's choice): running
    # every tower's would apply N updates per step. Each loss's step runs
    # those its loss goes through, as one device's would.
    update_ops = _loss_paths.by_key(
        tf.get_collection(tf.GraphKeys.UPDATE_OPS, scope) if index == 0
        else [], losses, made_by_model)
    # Only the final tower's summaries are kept: the towers' would share
    # tags once the tower prefix is stripped. Each goes with the first loss
    # whose step computes what it reads.
    last = index == self.builder.plan.num_towers - 1
    summaries = _loss_paths.by_key(
        tf.get_collection(tf.GraphKeys.SUMMARIES, scope) if last else [],
        losses, made_by_model, first=True)
    if index == 0:
      self._var_lists.update(_losses.resolve(self._entries))
    grads = {}
    for key, loss in losses.items():
      made = _tf_internals.last_op_id()
      grads[key] = self.builder.gradients(
          index, key, self._opts[key], loss, self._var_lists[key],
          self._kwargs)
      _regularization.split(grads[key], made, terms)
    return losses, output, grads, update_ops, summaries


def _step_roots(keys: List[_losses.Key],
                results: List[tuple]) -> List[List[object]]:
  """What each loss's step runs: its losses, gradients and update ops."""
  found = []
  for key in keys:
    roots: List[object] = []
    for losses, _, grads, updates, _ in results:
      roots += [losses[key]] + list(updates[key]) + [
          g for g, _ in grads[key] if g is not None]
    found.append(roots)
  return found
