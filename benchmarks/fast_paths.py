"""The fast paths: staged inputs, mixed precision and XLA, timed.

Two comparisons, each timed in interleaved rounds of its own, on the MNIST
and CIFAR-10 CNNs (`benchmarks.workloads`), trained with `towers.minimize`
(variables on ``/cpu:0``, the library's defaults otherwise):

- **Staging**: ``stage_inputs=True`` against the same step without it, both
  reading the same synthetic batch through the same ``tf.data`` pipeline
  (the batch held in memory, sliced, repeated, batched per tower and
  prefetched), each tower calling the iterator's ``get_next``. The staged
  step's reader is the graph's queue runner, started with the session
  (`graphs.GraphStep`). The target (`report.STAGED_RATIO`): staging costs
  at most 5% on CPU, where there is nothing to gain.
- **Precision**: the towers computing in float32 (the baseline, the
  suite's "towers" row), bfloat16, and float16 with the default dynamic
  loss scaling (``compute_dtype``; the model asks for its weights in that
  dtype and casts its images, the loss stays float32:
  `workloads.computing_in`), and float32 with the model's body compiled by
  XLA (``tf.xla.experimental.jit_scope``). Reported as ratios to float32;
  the first step (XLA compiles then) apart. No target.

On virtual CPU devices these rows show overhead only: the devices share
host memory (staging copies nothing that would not be free), float16 has
no fast CPU kernels, bfloat16 is fast only where oneDNN has bf16
instructions to use, and XLA compiles for the CPU. With enough GPUs the
same rows run on them (`towers.tower_devices`) and show the effect.

A variant whose step cannot run on these devices (no kernel of an op for
its dtype: TensorFlow's CPUs have no bfloat16 local response normalization,
which the CIFAR-10 CNN computes in float32 for that reason) is reported as
not run, with the reason, not timed: one row, not the whole run, is lost.
"""

import re
from typing import Dict, List, Optional, Sequence, Tuple

from absl import logging
import tensorflow.compat.v1 as tf

import towers
from benchmarks import graphs
from benchmarks import report
from benchmarks import workloads

STAGED = "staged"
UNSTAGED = "unstaged"
FLOAT32 = "float32"
BFLOAT16 = "bfloat16"
FLOAT16 = "float16"
XLA = "xla"
PRECISIONS = (FLOAT32, BFLOAT16, FLOAT16, XLA)
TITLES = {
    FLOAT32: "float32",
    BFLOAT16: "bfloat16 (compute_dtype)",
    FLOAT16: "float16 (compute_dtype, dynamic loss scaling)",
    XLA: "float32, XLA (jit_scope)",
}
WORKLOADS = ("mnist", "cifar10")

StepKey = Tuple[str, int, str]


def compiled(workload: workloads.Workload) -> workloads.Workload:
  """Returns `workload` with its model built in an XLA ``jit_scope``.

  The scope is entered around the body of the tower's model, so its ops and
  their gradients are compiled (by cluster, on each tower's device).
  """

  def loss_fn(images: tf.Tensor, labels: tf.Tensor) -> tf.Tensor:
    with tf.xla.experimental.jit_scope():
      return workload.loss_fn(images, labels)

  return workloads.Workload(workload.name, workload.title + ", XLA",
                            workload.image_shape, loss_fn)


def precision_step(workload: workloads.Workload, variant: str
                  ) -> Tuple[workloads.Workload, Dict[str, object]]:
  """Returns a precision variant's model and `towers.minimize` arguments."""
  if variant == XLA:
    return compiled(workload), {}
  if variant == FLOAT32:
    return workload, {}
  return (workloads.computing_in(workload, variant),
          {"compute_dtype": variant})


def _check_workloads(names: Sequence[str]) -> None:
  for name in names:
    if name not in WORKLOADS:
      raise ValueError("expected fast-path workloads among %s, got %r"
                       % (", ".join(WORKLOADS), name))


def build_staging(*, workload_names: Sequence[str],
                  tower_counts: Sequence[int], global_batch: int,
                  num_devices: int) -> Dict[StepKey, graphs.GraphStep]:
  """Builds the staged and the unstaged step of each workload and count.

  Returns:
    ``(workload, towers, STAGED or UNSTAGED)`` -> its step, ready to time.
  """
  _check_workloads(workload_names)
  steps = {}
  for name in workload_names:
    workload = workloads.WORKLOADS[name]
    images, labels = workloads.synthetic_batch(workload, global_batch)
    for n in tower_counts:
      for variant in (STAGED, UNSTAGED):
        steps[(name, n, variant)] = graphs.GraphStep(
            workload, graphs.TOWERS, n, images, labels, num_devices,
            minimize_kwargs={"stage_inputs": variant == STAGED},
            dataset=True)
  return steps


def build_precision(*, workload_names: Sequence[str],
                    tower_counts: Sequence[int], global_batch: int,
                    num_devices: int
                   ) -> Tuple[Dict[StepKey, graphs.GraphStep],
                              Dict[StepKey, str]]:
  """Builds each precision variant of each workload and count.

  Returns:
    ``(steps, not_run)``: ``(workload, towers, variant)`` -> its step,
    ready to time; and -> why it could not run, for the variants whose
    first step found no kernel for an op in their dtype.
  """
  _check_workloads(workload_names)
  steps, not_run = {}, {}
  for name in workload_names:
    images, labels = workloads.synthetic_batch(workloads.WORKLOADS[name],
                                               global_batch)
    for n in tower_counts:
      for variant in PRECISIONS:
        model, kwargs = precision_step(workloads.WORKLOADS[name], variant)
        try:
          steps[(name, n, variant)] = graphs.GraphStep(
              model, graphs.TOWERS, n, images, labels, num_devices,
              minimize_kwargs=kwargs)
        except tf.errors.InvalidArgumentError as e:
          reason = missing_kernel(e)
          if reason is None:
            raise
          logging.warning("%s %s at %d towers not run: %s", name, variant,
                          n, reason)
          not_run[(name, n, variant)] = reason
  return steps, not_run


def missing_kernel(error: tf.errors.OpError) -> Optional[str]:
  """Returns what a missing kernel error says, or None for another error.

  ``"no DT_BFLOAT16 kernel for LRN on these devices (node
  tower_0/norm1)"``, from TensorFlow's ``No OpKernel was registered to
  support Op 'LRN' used by {{node tower_0/norm1}} with these attrs: [...,
  T=DT_BFLOAT16, ...]``.
  """
  message = error.message
  found = re.search(r"No OpKernel was registered to support Op '(\w+)' "
                    r"used by \{\{node ([^}]+)\}\}", message)
  if not found:
    return None
  dtype = re.search(r"\bT=(DT_\w+)", message)
  return "no %s kernel for %s on these devices (node %s)" % (
      dtype.group(1) if dtype else "such", found.group(1), found.group(2))


def _side(step: graphs.GraphStep, seconds: Sequence[float],
          global_batch: int) -> Dict[str, object]:
  moved = step.traffic
  return {**report.timed_graph(seconds, global_batch, step.num_ops),
          "first_step_sec": step.first_step_sec,
          "busiest_device": moved["busiest_device"],
          "busiest_bytes": moved["busiest_bytes"],
          "expected_busiest_bytes": moved["expected_busiest_bytes"],
          "input_bytes": moved["input_bytes"],
          "input_tensors": moved["input_tensors"],
          "unsized": moved["unsized"]}


def _devices(tower_counts: Sequence[int]) -> Dict[str, List[str]]:
  return {str(n): towers.tower_devices(n) for n in tower_counts}


def staging_result(steps: Dict[StepKey, graphs.GraphStep],
                   times: Dict[StepKey, Sequence[float]], *,
                   global_batch: int,
                   rounds_info: Dict[str, object]) -> Dict[str, object]:
  """Returns the staging rows: per workload and count, both steps and ratio.

  The ratio is staged examples/sec over unstaged (below 1: what staging
  costs), with its 95% bootstrap interval (`report.ratio_interval`).
  """
  rows = []
  for name, n in sorted({(name, n) for name, n, _ in steps},
                        key=lambda k: (WORKLOADS.index(k[0]), k[1])):
    staged = _side(steps[(name, n, STAGED)], times[(name, n, STAGED)],
                   global_batch)
    unstaged = _side(steps[(name, n, UNSTAGED)], times[(name, n, UNSTAGED)],
                     global_batch)
    rows.append({
        "workload": name, "num_towers": n, STAGED: staged,
        UNSTAGED: unstaged,
        "ratio": staged["examples_per_sec"] / unstaged["examples_per_sec"],
        "ratio_interval": list(report.ratio_interval(staged, unstaged))})
  return {"global_batch": global_batch, "rows": rows,
          "devices": _devices(sorted({n for _, n, _ in steps})),
          "rounds": rounds_info}


def precision_result(steps: Dict[StepKey, graphs.GraphStep],
                     not_run: Dict[StepKey, str],
                     times: Dict[StepKey, Sequence[float]], *,
                     global_batch: int,
                     rounds_info: Dict[str, object]) -> Dict[str, object]:
  """Returns the precision rows, each against float32 at its count.

  Each timed row has its examples/sec over float32's with its 95%
  bootstrap interval, and its first step's time over float32's; a row not
  run has its reason instead.
  """
  rows = []
  keys = sorted(set(steps) | set(not_run), key=lambda k: (
      WORKLOADS.index(k[0]), k[1], PRECISIONS.index(k[2])))
  for key in keys:
    name, n, variant = key
    row = {"workload": name, "num_towers": n, "variant": variant,
           "title": TITLES[variant],
           "loss_scale": "dynamic" if variant == FLOAT16 else None}
    if key in not_run:
      row["not_run"] = not_run[key]
    else:
      row.update(_side(steps[key], times[key], global_batch))
    rows.append(row)
  by_key = {(r["workload"], r["num_towers"], r["variant"]): r for r in rows}
  for row in rows:
    base = by_key.get((row["workload"], row["num_towers"], FLOAT32))
    if "not_run" in row or base is None or "not_run" in base:
      continue
    row["ratio_to_float32"] = (row["examples_per_sec"]
                               / base["examples_per_sec"])
    row["ratio_interval"] = list(report.ratio_interval(row, base))
    row["first_step_ratio"] = row["first_step_sec"] / base["first_step_sec"]
  return {"global_batch": global_batch, "rows": rows,
          "devices": _devices(sorted({k[1] for k in keys})),
          "rounds": rounds_info}
