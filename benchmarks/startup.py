"""The replicated copies' start-up check, per step: gated against ungated.

With ``variable_device="replicated"``, the first step after the local init op
sets every copy from copy 0 (``towers/_startup.py``): each tower but the first
and the update of every copy wait for a gate, a no-op named
``wait_for_copies``, which waits for a v1 cond (``set_copies``) on the host
that reads a local flag. Every later step still reads the flag, switches every
tensor the setting branch would read, takes the empty branch and merges, then
runs the gates and their control edges. This times what that costs: the step
as the library builds it (`GATED`) against its ungated twin (`UNGATED`), the
same graph with the gates' control inputs removed (`ungate`), so that the
gates are plain no-ops and the cond never runs; the copies are set by the
local init op alone, as nothing restores copy 0 here. Both are timed in
interleaved rounds, replicated with each all-reduce, at each tower count.

Beside the times, each step's cost in kind: the nodes it runs (from the
``step_stats`` of a fully traced step after the first; `nodes_per_step`),
how many of them are the start-up cond's, and what it moves between devices
per step (`benchmarks.traffic`, which counts a step as every step after the
first runs it): the parameters' bytes alike, the gated step's flag sent to the
copies' devices (a bool per cond and device) and its control edges. The
target is in `benchmarks.report`.
"""

from typing import Dict, Sequence, Tuple

import tensorflow.compat.v1 as tf

from benchmarks import graphs
from benchmarks import report
from benchmarks import traffic
from benchmarks import workloads

GATED = "gated"
UNGATED = "ungated"
VARIANTS = (GATED, UNGATED)
WORKLOAD = "mnist"
# The gates' name, as towers/_startup.py makes them.
GATE = "wait_for_copies"
# Each all-reduce's graph variant.
REPLICATED = {algorithm: variant
              for variant, algorithm in graphs.REPLICATED.items()}

# (all_reduce, num_towers, GATED or UNGATED).
Key = Tuple[str, int, str]


def ungate(graph: tf.Graph) -> None:
  """Removes the start-up cond's control inputs from every gate of `graph`.

  The gates stay, as no-ops that run at once, and so does every control edge
  from a gate to the ops it holds back: only the cond is cut off, and with
  nothing else reading it, no step runs it.

  Raises:
    ValueError: if `graph` has no gate, or a gate waits for something else
      than a start-up cond: the library builds its start-up otherwise now,
      and this twin would not be the gated graph less the check.
  """
  gates = [op for op in graph.get_operations()
           if op.name.rsplit("/", 1)[-1] == GATE]
  if not gates:
    raise ValueError("expected the replicated step's start-up gates (no-ops "
                     "named .../%s, towers/_startup.py), found none; has the "
                     "library renamed them?" % GATE)
  for gate in gates:
    others = [op.name for op in gate.control_inputs
              if not traffic.STARTUP_COND.search(op.name + "/")]
    if others:
      raise ValueError("expected %s to wait for a start-up cond (set_copies) "
                       "only, got %s; the ungated twin would drop more than "
                       "the check" % (gate.name, ", ".join(others)))
    # No public call removes a control input once an op is built; the
    # GraphDef route would lose the collections GraphStep reads (the
    # variables, their initializers).
    gate._remove_all_control_inputs()  # pylint: disable=protected-access


def nodes_per_step(step: graphs.GraphStep) -> Dict[str, int]:
  """Runs one traced step; returns the nodes it ran (sends and receives
  included) and, of those, the start-up cond's (``set_copies`` ops)."""
  stats = step.traced_step().step_stats
  names = [node.node_name for device in stats.dev_stats
           for node in device.node_stats]
  return {"nodes_per_step": len(names),
          "startup_nodes": sum(1 for name in names
                               if traffic.STARTUP_COND.search(name))}


def build(*, tower_counts: Sequence[int], all_reduces: Sequence[str],
          global_batch: int, num_devices: int
         ) -> Dict[Key, graphs.GraphStep]:
  """Builds the gated and the ungated step of each all-reduce at each count.

  Args:
    tower_counts: the towers of each pair (2 or more: one tower has no
      copies to set).
    all_reduces: ``towers.minimize``'s ``all_reduce`` of each pair.
    global_batch: the MNIST CNN's global batch, split over the towers.
    num_devices: the session's virtual CPU devices (`graphs.GraphStep`).

  Returns:
    ``(all_reduce, towers, GATED or UNGATED)`` -> its step, its first step
    run (the one that sets the copies).

  Raises:
    ValueError: for an unknown all-reduce or fewer than 2 towers.
  """
  unknown = [a for a in all_reduces if a not in REPLICATED]
  if unknown:
    raise ValueError("expected all_reduce among %s, got %s"
                     % (", ".join(REPLICATED), ", ".join(unknown)))
  if any(n < 2 for n in tower_counts):
    raise ValueError("expected 2 or more towers (one tower has no copies to "
                     "set), got %s" % list(tower_counts))
  workload = workloads.WORKLOADS[WORKLOAD]
  images, labels = workloads.synthetic_batch(workload, global_batch)
  return {(a, n, variant): graphs.GraphStep(
      workload, REPLICATED[a], n, images, labels, num_devices,
      rewrite=ungate if variant == UNGATED else None)
          for a in all_reduces for n in tower_counts for variant in VARIANTS}


def _bytes_per_step(moved: Dict[str, object]) -> int:
  """Every byte that crosses between devices in a step: the parameters',
  the input's and the others'."""
  return int(sum(f["sent_bytes"] for f in moved["devices"].values())
             + moved["input_bytes"] + moved["other_bytes"])


def _side(step: graphs.GraphStep, seconds: Sequence[float],
          global_batch: int, nodes: Dict[str, int]) -> Dict[str, object]:
  moved = step.traffic
  return {**report.timed_graph(seconds, global_batch, step.num_ops),
          **nodes, "bytes_per_step": _bytes_per_step(moved),
          "tensors_per_step": moved["tensors"] + moved["input_tensors"]
                              + moved["other_tensors"],
          "parameter_devices": moved["devices"],
          "control_edges": moved["control_edges"],
          "startup_sends": moved["startup_sends"]}


def result(steps: Dict[Key, graphs.GraphStep],
           times: Dict[Key, Sequence[float]], nodes: Dict[Key, Dict[str, int]],
           *, global_batch: int, rounds_info: Dict[str, object]
          ) -> Dict[str, object]:
  """Returns the comparison's rows: per all-reduce and tower count, both
  steps, the step-time ratio and what the check adds per step.

  The ratio is the gated median step time over the ungated one (above 1:
  the check costs), with its 95% bootstrap interval
  (`report.ratio_interval`). `nodes` holds each step's `nodes_per_step`.
  """
  rows = []
  for a, n in sorted({(a, n) for a, n, _ in steps}):
    side = {variant: _side(steps[(a, n, variant)], times[(a, n, variant)],
                           global_batch, nodes[(a, n, variant)])
            for variant in VARIANTS}
    gated, ungated = side[GATED], side[UNGATED]
    rows.append({
        "all_reduce": a, "num_towers": n, GATED: gated, UNGATED: ungated,
        "step_time_ratio": (gated["median_step_sec"]
                            / ungated["median_step_sec"]),
        # Ungated's speed over gated's: the step-time ratio.
        "ratio_interval": list(report.ratio_interval(ungated, gated)),
        "nodes_added": gated["nodes_per_step"] - ungated["nodes_per_step"],
        "startup_bytes": gated["bytes_per_step"] - ungated["bytes_per_step"],
        "startup_tensors": (gated["tensors_per_step"]
                            - ungated["tensors_per_step"])})
  return {"title": workloads.WORKLOADS[WORKLOAD].title,
          "global_batch": global_batch, "rows": rows, "rounds": rounds_info}
