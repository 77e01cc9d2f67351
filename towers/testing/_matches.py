"""`assert_matches_one_device`: a port's unit test in one call.

The cases, their programs and the verdict: the arguments are checked here,
the programs built and run by `_programs`, the values held to one device's
noise by `_compare`, the causes named by `_traps`.
"""

import inspect
from typing import Callable, Dict, List

import numpy as np
import tensorflow.compat.v1 as tf

from towers import _devices
from towers import _losses
from towers.testing import _compare
from towers.testing import _programs
from towers.testing import _traps

API = "docs/api.md#towers-testing"
# towers.minimize's keyword arguments a test may pass on.
OPTIONS = frozenset([
    "accumulate_steps", "clip_norm", "average_device", "pack_bytes",
    "loss_scale", "all_reduce", "tower_name", "var_list", "gate_gradients",
    "aggregation_method", "colocate_gradients_with_ops"])
# Those the test sets itself, and those no comparison could pass.
SET_HERE = frozenset(["devices", "inputs", "global_step", "num_gpus"])
REFUSED = (
    ("compute_dtype", "float16 or bfloat16 towers compute another model than "
                      "one device's float32 one; test the float32 model"),
    ("stage_inputs", "staged towers train each run on the previous run's "
                     "batch; test without staging"),
    ("num_workers", "the test runs in one process; test one worker's towers"),
)
DEFAULT_MODES = ("cpu", "balanced", "replicated")


def assert_matches_one_device(model_fn: Callable[..., object],
                              make_optimizer: Callable[[], object],
                              inputs: object,
                              num_towers: int = 2,
                              *,
                              steps: int = 3,
                              variable_device: object = None,
                              uneven: bool = True,
                              permutations: int = _compare.PERMUTATIONS,
                              **options) -> None:
  """Asserts that `model_fn` trains on towers as on one device.

  Builds one device's program and `towers.minimize`'s from `model_fn` in
  graphs of their own, starts both from the same values, feeds both the
  batch `inputs` for `steps` updates on virtual CPUs, and compares every loss
  at every step, the first update's gradients and every global variable
  after the last; replicated copies must be bitwise copy 0. Each value is
  held to one device's own noise on permuted rows (docs/api.md).

  Args:
    model_fn: as for `towers.build_towers`, or a zero-argument callable
      returning one, called per program (a Keras model built outside it).
    make_optimizer: a zero-argument callable returning a new optimizer, or a
      dict of them by loss.
    inputs: the global batch, a NumPy array or a nested structure of them.
    num_towers: the number of towers.
    steps: the updates to run.
    variable_device: the mode to check; default ``'cpu'``, ``'balanced'``
      and ``'replicated'`` (all_reduce ``'collective'`` unless given).
    uneven: whether to check an uneven split too (a row less per micro-batch).
    permutations: one device's runs on permuted rows that measure its noise.
    **options: `towers.minimize`'s (``accumulate_steps``, ``clip_norm``, ...).

  Raises:
    AssertionError: if the towers train otherwise, with a table and causes.
    TypeError, ValueError: for bad arguments, or a model one device's runs
      cannot repeat (random ops, rows that are not interchangeable).
  """
  make_model_fn = _model_fn_maker(model_fn)
  num_towers = _devices.check_count("num_towers", num_towers)
  steps = _devices.check_count("steps", steps)
  permutations = _devices.check_count("permutations", permutations)
  _check_options(options)
  spec = _programs.Spec(make_model_fn, _optimizer_maker(make_optimizer),
                        steps, options)
  modes = _modes(variable_device, options, num_towers)
  failed: List[_compare.Row] = []
  causes: Dict[str, str] = {}
  compared = 0
  cases: List[str] = []
  for i, batch in enumerate(_batches(_as_batch(inputs), spec.accumulate_steps,
                                     num_towers, uneven)):
    one = _programs.one_device(
        spec, batch, _compare.orders(_rows(batch), permutations, i))
    _check_interchangeable(one.runs)
    # The uneven split in the first mode only: the modes split alike.
    for mode in modes if i == 0 else modes[:1]:
      case = "%s, %d rows" % (", ".join(map(_label, mode.values())),
                              _rows(batch))
      try:
        got = _programs.on_towers(spec._replace(options=dict(options, **mode)),
                                  batch, num_towers, one.initial)
      except _programs.TowersFailed as e:
        raise AssertionError(_refused(case, num_towers, e)) from e.__cause__
      case += " (%s)" % "+".join(map(str, got.sizes))
      cases.append(case)
      rows = _compare.compare(case, one.runs[0], one.runs[1:], got.values,
                              one.eps)
      compared += len(rows)
      mine = [row for row in rows if row.failed]
      failed += mine
      for trap, cause in _traps.hints([row.what for row in mine],
                                      one.runs[0].losses[0], got.added,
                                      got.batch_norm,
                                      spec.accumulate_steps).items():
        causes.setdefault(trap, cause)
  if failed:
    raise AssertionError(_message(num_towers, failed, compared, cases,
                                  list(causes.values())))


def _model_fn_maker(model_fn: object) -> Callable[[], Callable[..., object]]:
  """A maker of the model function: `model_fn` itself, or the zero-argument
  callable it is."""
  if not callable(model_fn):
    raise TypeError("expected model_fn to be callable as model_fn(scope, "
                    "*batch), or a zero-argument callable returning one, got "
                    "%r" % (model_fn,))
  try:
    parameters = inspect.signature(model_fn).parameters.values()
  except (TypeError, ValueError):
    return lambda: model_fn  # a builtin: a model function
  takes = [p for p in parameters if p.kind == p.VAR_POSITIONAL or (
      p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) and
      p.default is p.empty)]
  if takes:
    return lambda: model_fn

  def make() -> Callable[..., object]:
    made = model_fn()
    if not callable(made):
      raise TypeError(
          "model_fn takes no arguments, so it was called as a maker of the "
          "model function, but it returned %r; pass model_fn(scope, *batch) "
          "itself, or a callable returning one" % (made,))
    return made
  return make


def _optimizer_maker(make_optimizer: object
                     ) -> Callable[[], Dict[_losses.Key, tf.train.Optimizer]]:
  """A maker of new optimizers by key; refuses one returned twice."""
  if not callable(make_optimizer) or hasattr(make_optimizer,
                                             "compute_gradients"):
    raise TypeError(
        "expected make_optimizer to be a zero-argument callable returning a "
        "new optimizer (or a dict of them by loss), such as lambda: "
        "tf.train.AdamOptimizer(1e-3), got %r: each program needs its own"
        % (make_optimizer,))
  made: List[object] = []

  def make() -> Dict[_losses.Key, tf.train.Optimizer]:
    opts = _losses.optimizers(make_optimizer())
    for opt in opts.values():
      if any(opt is seen for seen in made):
        raise ValueError(
            "make_optimizer returned the optimizer %r a second time; return "
            "a new one on each call (lambda: tf.train.AdamOptimizer(1e-3)): "
            "an optimizer belongs to the graph it first applied in" % (opt,))
      made.append(opt)
    return opts
  return make


def _check_options(options: Dict[str, object]) -> None:
  for name, value in options.items():
    if name in SET_HERE:
      raise TypeError("%s is set by assert_matches_one_device itself; drop "
                      "it" % name)
    for refused, why in REFUSED:
      if name == refused:
        raise ValueError("%s=%r cannot be compared with one device: %s"
                         % (name, value, why))
    if name not in OPTIONS:
      raise TypeError(
          "assert_matches_one_device got an unexpected option %r; the options "
          "are towers.minimize's: %s" % (name, ", ".join(sorted(OPTIONS))))
  var_list = options.get("var_list")
  entries = var_list.values() if isinstance(var_list, dict) else [var_list]
  for entry in entries:
    if entry is not None and not isinstance(entry, str) and not callable(
        entry):
      raise TypeError(
          "expected var_list (or each of its entries) to be a name prefix or "
          "a callable returning the variables, got %r: variables belong to "
          "one graph, and each program has its own" % (entry,))


def _as_batch(inputs: object) -> object:
  """`inputs` with NumPy arrays for leaves, checked."""
  if inputs is None or not tf.nest.flatten(inputs):
    raise ValueError("expected inputs to be the global batch, a NumPy array "
                     "or a nested structure of them, got %r" % (inputs,))

  def array(leaf: object) -> np.ndarray:
    if isinstance(leaf, (tf.Tensor, tf.Variable, tf.Operation)) or callable(
        leaf):
      raise TypeError(
          "expected inputs to hold NumPy arrays, got %r: the test feeds the "
          "same values to both programs; pass the batch's values" % (leaf,))
    value = np.asarray(leaf)
    if value.dtype == object or value.ndim == 0:
      raise TypeError("expected every input to be an array with the batch "
                      "on axis 0, got %r" % (leaf,))
    return value
  batch = tf.nest.map_structure(array, inputs)
  sizes = {a.shape[0] for a in tf.nest.flatten(batch)}
  if len(sizes) > 1:
    raise ValueError("the inputs' batch sizes (axis 0) differ: %s"
                     % sorted(sizes))
  return batch


def _batches(batch: object, accumulate_steps: int, num_towers: int,
             uneven: bool) -> List[object]:
  """`batch`, and with `uneven` the batch a row less per micro-batch when
  `batch`'s micro-batches split evenly over the towers."""
  rows = _rows(batch)
  micro = rows // accumulate_steps
  if rows % accumulate_steps or micro < num_towers:
    raise ValueError(
        "inputs hold %d rows; with accumulate_steps=%d and %d towers they "
        "must split into %d equal micro-batches of at least %d rows each"
        % (rows, accumulate_steps, num_towers, accumulate_steps, num_towers))
  if not uneven or num_towers == 1 or micro % num_towers or (
      micro - 1 < num_towers):
    return [batch]
  keep = [i for i in range(rows) if i % micro != micro - 1]
  return [batch, tf.nest.map_structure(lambda a: a[keep], batch)]


def _check_interchangeable(runs: List[_compare.Values]) -> None:
  """Raises if one device's first loss changes with the order of the rows
  by more than rounding: noise measured that way would mean nothing."""
  for run in runs[1:]:
    for key, want in runs[0].losses[0].items():
      got = run.losses[0][key]
      # Loose: tf.losses rounds even a float64 loss to float32.
      rounding = max(1e-3, np.sqrt(_compare.eps(np.asarray(want).dtype)))
      if not abs(got - want) <= rounding * max(1.0, abs(want)):
        raise ValueError(
            "one device's first loss%s is %.6g on the batch and %.6g on its "
            "rows in another order, more than rounding apart: it depends on "
            "the order of the rows, which towers split (a per-row index, a "
            "sequence model's batch-major state), or on the order its ops "
            "run in (an assign racing the forward pass); the test needs "
            "neither" % (_losses.named(key), want, got))


def _modes(variable_device: object, options: Dict[str, object],
           num_towers: int) -> List[Dict[str, object]]:
  """The cases' modes: `minimize`'s ``variable_device`` (and
  ``all_reduce``)."""
  if variable_device is not None:
    devices = [variable_device]
  elif "all_reduce" in options:
    devices = ["replicated"]
  else:
    devices = list(DEFAULT_MODES)
  modes: List[Dict[str, object]] = []
  for each in devices:
    modes.append({"variable_device": each})
    if each == "replicated" and num_towers > 1 and "all_reduce" not in options:
      # What distinct GPUs run ("auto" on CPUs is "add_n", the one-copy sum).
      modes[-1]["all_reduce"] = "collective"
  return modes


def _label(value: object) -> str:
  return value if isinstance(value, str) else getattr(
      value, "__name__", "a device function")


def _rows(batch: object) -> int:
  return int(tf.nest.flatten(batch)[0].shape[0])


def _refused(case: str, num_towers: int, error: Exception) -> str:
  cause = error.__cause__ or error
  lines = ["model_fn does not train on %d towers (%s): %s: %s"
           % (num_towers, case, type(cause).__name__, cause)]
  lines += ["Likely cause: " + c for c in _traps.refused(str(cause))]
  return "\n".join(lines)


def _message(num_towers: int, failed: List[_compare.Row], compared: int,
             cases: List[str], causes: List[str]) -> str:
  lines = [
      "model_fn trains otherwise on %d towers than on one device: %d of %d "
      "values differ by more than max(%g x noise, %d x eps x magnitude), "
      "noise being one device's own difference with the batch's rows "
      "permuted (%s). Cases: %s."
      % (num_towers, len(failed), compared, _compare.NOISE_FACTOR,
         _compare.ROUNDING, API, "; ".join(cases)),
      _compare.table(failed)]
  lines += ["Likely cause: " + c for c in causes]
  return "\n".join(lines)

