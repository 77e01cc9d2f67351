"""The plan: where the towers run and how they reduce, resolved once.

`build_towers` and `infer` take many arguments that only make sense
together (devices, where variables live, the all-reduce, workers, the
compute dtype, staging). `resolve` checks them all before the first op is
built and turns them into one immutable `Plan`, which the tower loop and
what follows it take as an argument instead of checking or resolving them
again. Once the towers are built, the plan also holds each tower's share of
the global batch (`with_shares`).
"""

import dataclasses
from typing import Iterable, List, Optional, Sequence, Tuple

import tensorflow.compat.v1 as tf

from towers import _allreduce
from towers import _devices
from towers import _placement
from towers import _precision
from towers import _reduction
from towers import _workers


@dataclasses.dataclass(frozen=True, eq=False)
class Plan:
  """The towers' resolved arguments, one value for every phase.

  Attributes:
    devices: one device string per tower.
    variable_device: where the variables live, as given (``"cpu"``,
      ``"gpu"``, ``"balanced"``, ``"replicated"``, a device string or a
      device function).
    tower_name: the towers' name-scope prefix.
    all_reduce: replicated towers' algorithm (``"add_n"``, ``"ring"`` or
      ``"collective"``); None when the towers share one copy.
    sums: how cross-tower sums are built: ``"collective"`` (one member per
      tower) or ``"add_n"`` (one sum on the first tower's device).
    num_workers: the worker tasks whose towers all-reduce together.
    compute_dtype: the towers' half compute dtype, or None for float32.
    stage_inputs: whether each tower's next batch is staged on its device.
    shares: once built, each tower's share of the global batch (Python
      floats, or float64 tensors known at run time); empty before.
  """
  devices: Tuple[str, ...]
  variable_device: _placement.VariableDevice
  tower_name: str
  all_reduce: Optional[str]
  sums: str
  num_workers: int
  compute_dtype: Optional[tf.DType]
  stage_inputs: bool
  shares: Tuple[_reduction.Weight, ...] = ()

  @property
  def num_towers(self) -> int:
    return len(self.devices)

  @property
  def replicated(self) -> bool:
    return self.variable_device == _placement.REPLICATED

  @property
  def workers(self) -> _workers.Workers:
    """The workers the towers' collectives span."""
    return _workers.of(self.num_workers, self.devices)

  def placer(self) -> _placement.DeviceFn:
    """A new variable placer for one build (``"balanced"`` counts the bytes
    placed so far)."""
    return _placement.variable_placer(self.variable_device, self.devices)

  def with_shares(self, shares: Sequence[_reduction.Weight]) -> "Plan":
    """This plan with each tower's share of the global batch."""
    return dataclasses.replace(self, shares=tuple(shares))


def resolve(num_towers: int, *,
            devices: Optional[Sequence[str]] = None,
            variable_device: _placement.VariableDevice = "cpu",
            tower_name: str = "tower",
            all_reduce: str = "auto",
            num_workers: int = 1,
            compute_dtype: _precision.ComputeDtype = None,
            stage_inputs: bool = False) -> Plan:
  """Checks the towers' arguments and resolves them into a `Plan`.

  Every argument is checked here (what `build_towers` takes beside them, in
  `check_training`), before any op exists, so refused arguments build
  nothing; the graph is left as it was.

  Raises:
    RuntimeError: under eager execution.
    TypeError: for arguments of the wrong type.
    ValueError: for bad values, or ones that do not fit together.
  """
  if tf.executing_eagerly():
    raise RuntimeError(
        "towers builds graphs, but eager execution is on (the TensorFlow 2 "
        "default): call tf.compat.v1.disable_eager_execution() (or "
        "tf.compat.v1.disable_v2_behavior()) at the start of your program, "
        "or build inside `with tf.Graph().as_default():`")
  count = _devices.check_count("num_gpus", num_towers)
  _allreduce.check_name(all_reduce)
  workers = _workers.check_count(num_workers)
  replicated = variable_device == _placement.REPLICATED
  _check_fit(variable_device, all_reduce, workers)
  resolved = _check_devices(devices, count)
  _placement.check_variable_device(variable_device)
  dtype = _precision.check_compute_dtype(compute_dtype)
  _workers.check_tasks(workers, resolved)
  algorithm = _allreduce.resolve(all_reduce if replicated else "auto",
                                 resolved, workers)
  return Plan(devices=tuple(resolved), variable_device=variable_device,
              tower_name=tower_name,
              all_reduce=algorithm if replicated else None,
              sums="collective" if algorithm == "collective" else "add_n",
              num_workers=workers, compute_dtype=dtype,
              stage_inputs=bool(stage_inputs))


def _check_devices(devices: Optional[Sequence[str]],
                   num_towers: int) -> List[str]:
  """Returns the towers' devices: `devices` checked, or the defaults."""
  if devices is None:
    return _devices.tower_devices(num_towers)
  if isinstance(devices, str) or not isinstance(devices, (list, tuple)):
    raise TypeError("expected devices to be a list of %d device strings, got "
                    "%r" % (num_towers, devices))
  if len(devices) != num_towers:
    raise ValueError(
        "expected one device per tower: num_gpus=%d but devices has %d "
        "entries (%s); pass num_gpus=len(devices)"
        % (num_towers, len(devices), ", ".join(map(repr, devices))))
  for d in devices:
    if not isinstance(d, str):
      raise TypeError("expected device strings such as '/gpu:0', got %r in "
                      "devices" % (d,))
    try:
      tf.DeviceSpec.from_string(d)
    except ValueError as e:
      raise ValueError("devices holds %r, which is not a device string such "
                       "as '/gpu:0': %s" % (d, e)) from None
  return list(devices)


def check_training(variable_device: _placement.VariableDevice,
                   stage_inputs: bool, inputs: object,
                   optimizers: Iterable[tf.train.Optimizer]) -> None:
  """Raises if `build_towers`' optimizers or inputs do not fit the mode."""
  if stage_inputs and inputs is None:
    raise ValueError("stage_inputs=True stages the towers' inputs, but "
                     "inputs is None (model_fn reads its own); pass inputs "
                     "(a batch or a callable such as iterator.get_next)")
  if variable_device == _placement.REPLICATED and any(
      isinstance(opt, tf.train.SyncReplicasOptimizer) for opt in optimizers):
    raise ValueError(
        "variable_device='replicated' keeps a copy of the variables on every "
        "tower, but SyncReplicasOptimizer aggregates into variables on "
        "parameter servers; with parameter servers use variable_device="
        "tf.train.replica_device_setter(...) (one copy)")


def _check_fit(variable_device: _placement.VariableDevice, all_reduce: str,
               num_workers: int) -> None:
  """Raises if `all_reduce` or the workers do not fit `variable_device`."""
  replicated = variable_device == _placement.REPLICATED
  if num_workers > 1 and not replicated:
    raise ValueError(
        "num_workers=%d all-reduces the gradients across workers, which "
        "needs each worker to keep its own copies: pass "
        "variable_device='replicated' (or, for variables on parameter "
        "servers, num_workers=1 with tf.train.replica_device_setter)"
        % num_workers)
  if num_workers > 1 and all_reduce not in ("auto", "collective"):
    raise ValueError(
        "num_workers=%d reduces with TensorFlow's collective ops across "
        "workers, but all_reduce=%r; pass all_reduce='collective' or "
        "'auto'" % (num_workers, all_reduce))
  if not replicated and all_reduce != "auto":
    raise ValueError(
        "all_reduce=%r applies to variable_device='replicated' (a copy of the "
        "variables on every tower); with variable_device=%r the towers share "
        "one copy, averaged next to it: pass variable_device='replicated' or "
        "drop all_reduce" % (all_reduce, variable_device))
