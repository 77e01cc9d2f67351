"""The two programs a comparison runs: one device's, and the towers'.

Each is built in a graph of its own from a `model_fn` made for it (a Keras
model or a template belongs to the graph it was first called in), fed
through placeholders of the batch's static shape, on virtual CPU devices.

One device's is the program a port starts from: `model_fn` called once on
the whole batch, then each loss's ``compute_gradients`` and
``apply_gradients`` (the last loss's counting the global step), clipped by
global norm when asked, after the update ops that loss goes through
(`_loss_paths`; for one loss every ``UPDATE_OPS``, as the usual
``control_dependencies``). The towers' is `towers.minimize` with the same
optimizers and options. Both start from one device's initial values (the
towers' variables take them by name before the first step, which then sets
replicated copies from copy 0, as after a restore) and run the same update
steps, each loss's train op in the optimizers' order, each fetching its
loss. With ``accumulate_steps=k`` the towers take the batch as k consecutive
micro-batches, one device whole.
"""

from typing import (Any, Callable, Dict, List, NamedTuple, Optional, Sequence,
                    Tuple)

import numpy as np
import tensorflow.compat.v1 as tf

import towers
from towers import _copies
from towers import _graph
from towers import _inputs
from towers import _loss_paths
from towers import _losses
from towers import _tf_internals
from towers import _updates
from towers.testing import _compare
from towers.testing import _traps

# compute_gradients' arguments, which one device's program takes too.
COMPUTE_GRADIENTS = ("gate_gradients", "aggregation_method",
                     "colocate_gradients_with_ops")
# A collective waiting for a peer fails the run after this, never hangs it.
OPERATION_TIMEOUT_MS = 120000

Batch = object  # a NumPy array, or a nested structure of them


class Spec(NamedTuple):
  """What both programs are made of.

  make_model_fn: returns the model function, called in each program's graph.
  make_optimizer: returns new optimizers, ``{key: optimizer}``.
  steps: the update steps to run.
  options: `towers.minimize`'s keyword arguments, but devices, inputs and
    the global step, which the programs set.
  """
  make_model_fn: Callable[[], Callable[..., object]]
  make_optimizer: Callable[[], Dict[_losses.Key, tf.train.Optimizer]]
  steps: int
  options: Dict[str, Any]

  @property
  def accumulate_steps(self) -> int:
    return int(self.options.get("accumulate_steps", 1))  # type: ignore


class Towers(NamedTuple):
  """What the towers' run gave beyond `_compare.Values`.

  values: the `_compare.Values`.
  added: the towers' losses of the first update added, by key.
  sizes: ``[num_towers]`` examples of each tower's shard (of a micro-batch).
  batch_norm: tower 0's batch norms (`_traps.batch_norm_ops`).
  """
  values: _compare.Values
  added: Dict[_losses.Key, float]
  sizes: List[int]
  batch_norm: Tuple[List[str], List[str]]


class OneDevice(NamedTuple):
  """What one device's runs gave.

  initial: the initial values of the global variables, by name.
  runs: `_compare.Values` per order of the rows, the batch's first.
  eps: the machine epsilon of the narrowest float dtype the losses are
    computed in (``tf.losses`` computes even a float64 loss in float32).
  """
  initial: Dict[str, np.ndarray]
  runs: List[_compare.Values]
  eps: float


class TowersFailed(Exception):
  """The towers' program failed once `model_fn` had been called in it: the
  model does not train on towers, which is no bad argument of the caller's.
  The error is the cause."""


def one_device(spec: Spec, batch: Batch,
               orders: Sequence[Optional[np.ndarray]]) -> OneDevice:
  """Runs one device's program from the same initial values once per order
  of the batch's rows (None: as it is).

  Raises:
    As `model_fn` does; ValueError for random ops its loss reads.
  """
  graph = tf.Graph()
  with graph.as_default():
    feeds = _placeholders(batch)
    global_step = tf.train.get_or_create_global_step()
    opts = spec.make_optimizer()
    keys = list(opts)
    start = _tf_internals.last_op_id()
    result = spec.make_model_fn()("", *_inputs.as_args(feeds))
    losses, outputs = _losses.check_result(result, "one device's program",
                                           keys)
    made = _tf_internals.made_after(start)
    computed = _graph.upstream(list(losses.values()), within=set(made))
    _traps.check_repeatable(computed)
    eps = max(_compare.eps(t.dtype.as_numpy_dtype) for op in computed
              for t in op.outputs if t.dtype.is_floating)
    # A Keras layer's updates, which one device's program runs (as
    # model.updates) like tf.layers'.
    _updates.collect(made, "", list(losses.values()), outputs)
    updates = _loss_paths.by_key(
        tf.get_collection(tf.GraphKeys.UPDATE_OPS), losses, made)
    var_lists = _losses.resolve(
        _losses.check_var_list(spec.options.get("var_list"), keys))
    kwargs = {k: spec.options[k] for k in COMPUTE_GRADIENTS
              if k in spec.options}
    clip_norm = spec.options.get("clip_norm")
    train_ops, grads = {}, {}
    for key in keys:
      with tf.control_dependencies(list(updates[key]) + [losses[key]]):
        pairs = [(g, v) for g, v in opts[key].compute_gradients(
            losses[key], var_list=var_lists[key], **kwargs) if g is not None]
        if clip_norm is not None:
          clipped, _ = tf.clip_by_global_norm([g for g, _ in pairs],
                                              clip_norm)
          pairs = list(zip(clipped, [v for _, v in pairs]))
        train_ops[key] = opts[key].apply_gradients(
            pairs, global_step=global_step if key == keys[-1] else None)
      grads[key] = pairs
    init = tf.group(tf.global_variables_initializer(),
                    tf.local_variables_initializer())
    variables = tf.global_variables()
    loader = _Loader(variables)
  with tf.Session(graph=graph, config=towers.virtual_cpu_config(
      1, operation_timeout_in_ms=OPERATION_TIMEOUT_MS)) as sess:
    sess.run(init)
    initial = sess.run({v.op.name: v for v in variables})
    runs = []
    for order in orders:
      sess.run(init)
      loader.load(sess, initial)
      rows = batch if order is None else tf.nest.map_structure(
          lambda a, o=order: a[o], batch)
      runs.append(_run(sess, spec, feeds, [rows], train_ops, losses, grads,
                       variables)[0])
  return OneDevice(initial, runs, eps)


def on_towers(spec: Spec, batch: Batch, num_towers: int,
              initial: Dict[str, np.ndarray]) -> Towers:
  """Runs `towers.minimize`'s program on `num_towers` virtual CPU devices,
  from `initial` (by variable name).

  Raises:
    TowersFailed: if it fails once `model_fn` has been called.
    As `towers.minimize` does for bad options, before that.
  """
  micro = _micro_batches(batch, spec.accumulate_steps)
  called = []
  graph = tf.Graph()
  try:
    with graph.as_default():
      model_fn = spec.make_model_fn()

      def counted(*args):
        called.append(True)
        return model_fn(*args)

      feeds = _placeholders(micro[0])
      opts = spec.make_optimizer()
      keys = list(opts)
      train_ops, t = towers.minimize(
          counted, _losses.unwrap(opts), num_towers, inputs=feeds,
          devices=["/cpu:%d" % i for i in range(num_towers)],
          global_step=tf.train.get_or_create_global_step(), **spec.options)
      train_ops = _losses.keyed(train_ops, keys)
      grads = {key: [(g, v) for g, v in pairs if g is not None] for key, pairs
               in _losses.keyed(t.grads_and_vars, keys).items()}
      init = tf.group(tf.global_variables_initializer(),
                      tf.local_variables_initializer())
      variables = tf.global_variables()
      loader = _Loader([v for v in variables if v.op.name in initial and
                        v.shape.as_list() == list(initial[v.op.name].shape)])
      copies = _copies.sources()
      batch_norm = _traps.batch_norm_ops(t.scopes[0])
      every = _losses.keyed(t.losses, keys)
      sizes = [int(round(w * _rows(micro[0]))) for w in t.weights]
    with tf.Session(graph=graph, config=towers.virtual_cpu_config(
        num_towers, operation_timeout_in_ms=OPERATION_TIMEOUT_MS)) as sess:
      sess.run(init)
      loader.load(sess, initial)
      values, added = _run(sess, spec, feeds, micro, train_ops,
                           _losses.keyed(t.loss, keys), grads, variables,
                           every)
      copy_values = sess.run({copy.op.name: copy for copy, _ in copies})
  except (ValueError, TypeError, tf.errors.OpError) as e:
    if called:
      raise TowersFailed(str(e)) from e
    raise
  return Towers(
      values._replace(copies={
          copy.op.name: (primary.op.name, copy_values[copy.op.name])
          for copy, primary in copies}),
      added or {}, sizes, batch_norm)


def _run(sess: tf.Session, spec: Spec, feeds: object, micro: List[Batch],
         train_ops: Dict[_losses.Key, tf.Operation],
         losses: Dict[_losses.Key, tf.Tensor],
         grads: Dict[_losses.Key, list], variables: List[tf.Variable],
         every: Optional[Dict[_losses.Key, List[tf.Tensor]]] = None
         ) -> Tuple[_compare.Values, Optional[Dict[_losses.Key, float]]]:
  """Runs `spec.steps` updates, each of the `micro` batches in turn (each
  loss's train op in order); returns the losses, the first gradients and
  the `variables` after, and, with `every` (each tower's losses), the first
  update's added."""
  total = sum(_rows(m) for m in micro)
  sums: List[Dict[_losses.Key, float]] = []
  first: Dict[_losses.Key, Dict[str, np.ndarray]] = {}
  added = None if every is None else {key: 0.0 for key in every}
  dtypes = {key: losses[key].dtype.as_numpy_dtype for key in losses}
  for step in range(spec.steps):
    sums.append({key: 0.0 for key in train_ops})
    for m, rows in enumerate(micro):
      feed = dict(zip(tf.nest.flatten(feeds), tf.nest.flatten(rows)))
      for key, train_op in train_ops.items():
        fetches = {"train": train_op, "loss": losses[key]}
        # With accumulate_steps the applied gradients exist inside the
        # update's condition only: the variables after it stand for them.
        if step == 0 and spec.accumulate_steps == 1:
          fetches["grads"] = [g for g, _ in grads[key]]
        if step == 0 and every is not None:
          fetches["every"] = every[key]
        out = sess.run(fetches, feed)
        sums[-1][key] += float(out["loss"]) * _rows(rows) / total
        if "grads" in out:
          first[key] = {v.op.name: _dense(g) for g, (_, v)
                        in zip(out["grads"], grads[key])}
        if "every" in out and added is not None:
          added[key] += float(sum(out["every"]))
  seen = [{key: np.asarray(value, dtypes[key]) for key, value in each.items()}
          for each in sums]
  after = sess.run({v.op.name: v for v in variables})
  return _compare.Values(seen, first, after, {}), added


class _Loader:
  """Sets variables to given values in one run."""

  def __init__(self, variables: Sequence[tf.Variable]) -> None:
    self._fed = {}
    assigns = []
    for var in variables:
      value = tf.placeholder(var.dtype.base_dtype, var.shape)
      self._fed[var.op.name] = value
      assigns.append(var.assign(value, read_value=False))
    self._op = tf.group(*assigns)

  def load(self, sess: tf.Session, values: Dict[str, np.ndarray]) -> None:
    sess.run(self._op, {p: values[name] for name, p in self._fed.items()})


def _placeholders(batch: Batch) -> object:
  return tf.nest.map_structure(
      lambda a: tf.placeholder(tf.as_dtype(a.dtype), a.shape), batch)


def _micro_batches(batch: Batch, k: int) -> List[Batch]:
  """`batch` as `k` consecutive micro-batches of equal size."""
  size = _rows(batch) // k
  return [tf.nest.map_structure(lambda a, i=i: a[i * size:(i + 1) * size],
                                batch) for i in range(k)]


def _rows(batch: Batch) -> int:
  return int(tf.nest.flatten(batch)[0].shape[0])


def _dense(grad: Any) -> np.ndarray:
  """A fetched gradient as an array (an ``IndexedSlicesValue`` summed into
  its dense shape)."""
  if hasattr(grad, "indices"):
    dense = np.zeros(grad.dense_shape, grad.values.dtype)
    np.add.at(dense, grad.indices, grad.values)
    return dense
  return np.asarray(grad)

