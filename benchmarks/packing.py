"""The pack_bytes sweep: packing against not, by the size of a gradient.

Packing saves a reduction's fixed cost per tensor (ops to schedule, a
transfer per tower) and pays for it in copies: each tower concatenates its
gradients into the pack, and the result is split back. Which wins depends on
the size of a tensor, so the sweep times the same kind of model, layers of a
scale and an offset of S bytes each (`workloads.small_variables`), at
several sizes S with about the same parameter bytes in all, on `towers` with
the variables on ``/cpu:0``: packed (``pack_bytes=S``, every gradient in one
pack) against unpacked (``pack_bytes=0``). The library's default
``pack_bytes`` rests on this measurement (docs/performance.md). It gives
ratios, no verdicts: there is no target.
"""

from typing import Dict, Sequence, Tuple

from benchmarks import graphs
from benchmarks import report
from benchmarks import workloads

PACKED = "packed"
UNPACKED = "unpacked"
KIB = 1024
SIZES = (1 * KIB, 4 * KIB, 16 * KIB, 64 * KIB, 256 * KIB)
# About this many parameter bytes at every size, within the bounds on the
# number of variables: enough tensors for their fixed cost to show at the
# small sizes, a graph that builds in seconds at the large ones.
TOTAL_BYTES = 4 << 20
MIN_VARIABLES = 8
MAX_VARIABLES = 200
FLOAT_BYTES = 4


def num_variables(size: int, *, total_bytes: int = TOTAL_BYTES,
                  low: int = MIN_VARIABLES, high: int = MAX_VARIABLES) -> int:
  """Returns how many variables of `size` bytes the sweep's model has.

  ``total_bytes / size`` within ``[low, high]``, rounded down to an even
  number (a scale and an offset per layer), and at least 2.
  """
  count = min(max(total_bytes // size, low), high)
  return max(2, count - count % 2)


def build(*, sizes: Sequence[int], num_towers: int, global_batch: int,
          num_devices: int, max_variables: int = MAX_VARIABLES
         ) -> Dict[Tuple[int, str], graphs.GraphStep]:
  """Builds the packed and the unpacked step of every size.

  Args:
    sizes: the variables' sizes in bytes, multiples of 4 (float32).
    num_towers: the towers (variables on ``/cpu:0``).
    global_batch: the global batch of every model.
    num_devices: the session's virtual CPU devices (`graphs.GraphStep`).
    max_variables: the most variables of a model (`num_variables`).

  Returns:
    ``(size, PACKED or UNPACKED)`` -> its step, ready to time.

  Raises:
    ValueError: if a size is not a positive multiple of 4 bytes.
  """
  steps = {}
  for size in sizes:
    if size <= 0 or size % FLOAT_BYTES:
      raise ValueError("expected tensor sizes in bytes that are positive "
                       "multiples of %d (float32), got %d"
                       % (FLOAT_BYTES, size))
    count = num_variables(size, high=max_variables)
    workload = workloads.small_variables(size // FLOAT_BYTES, count,
                                         name="small_%d" % size)
    images, labels = workloads.synthetic_batch(workload, global_batch)
    steps[(size, PACKED)] = graphs.GraphStep(
        workload, graphs.TOWERS, num_towers, images, labels, num_devices,
        pack_bytes=size)
    steps[(size, UNPACKED)] = graphs.GraphStep(
        workload, graphs.TOWERS_UNPACKED, num_towers, images, labels,
        num_devices)
  return steps


def _side(step: graphs.GraphStep, seconds: Sequence[float],
          global_batch: int) -> Dict[str, object]:
  moved = step.traffic
  return {**report.timed_graph(seconds, global_batch, step.num_ops),
          "pack_bytes": step.pack_bytes, "tensors": moved["tensors"],
          "expected_tensors": moved["expected_tensors"],
          "busiest_tensors": moved["busiest_tensors"],
          "expected_busiest_tensors": moved["expected_busiest_tensors"]}


def result(steps: Dict[Tuple[int, str], graphs.GraphStep],
           times: Dict[Tuple[int, str], Sequence[float]], *,
           num_towers: int, global_batch: int,
           rounds_info: Dict[str, object]) -> Dict[str, object]:
  """Returns the sweep's rows: per size, both steps and their ratio.

  The ratio is packed examples/sec over unpacked, with its 95% bootstrap
  interval (`report.ratio_interval`).
  """
  rows = []
  for size in sorted({size for size, _ in steps}):
    packed = _side(steps[(size, PACKED)], times[(size, PACKED)],
                   global_batch)
    unpacked = _side(steps[(size, UNPACKED)], times[(size, UNPACKED)],
                     global_batch)
    parameter_bytes = steps[(size, PACKED)].traffic["parameter_bytes"]
    rows.append({
        "size_bytes": size, "num_variables": parameter_bytes // size,
        "parameter_bytes": parameter_bytes, PACKED: packed,
        UNPACKED: unpacked,
        "ratio": packed["examples_per_sec"] / unpacked["examples_per_sec"],
        "ratio_interval": list(report.ratio_interval(packed, unpacked))})
  return {"num_towers": num_towers, "global_batch": global_batch,
          "variable_device": "cpu", "rows": rows, "rounds": rounds_info}
