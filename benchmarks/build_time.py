"""Graph build time and op count of `towers.minimize` against the towers.

Each measurement builds the whole training step (`towers.minimize` of a
workload on a placeholder global batch, Momentum, global step) in a fresh
``tf.Graph``; no session is made. Repeats are interleaved over the tower
counts, and a first untimed build pays for one-time costs (imports, op
registrations) that would otherwise land on the first count.
"""

import gc
import statistics
import time
from typing import Dict, List, Sequence, Tuple

import tensorflow.compat.v1 as tf

import towers
from benchmarks import graphs
from benchmarks import workloads


def _build_once(workload: workloads.Workload, num_towers: int,
                batch_size: int) -> Tuple[float, int, List[float]]:
  """Returns (seconds, ops, tower seconds) of building one training step.

  The tower seconds are, for each tower but the last, the time from its
  `model_fn` call to the next tower's: its model and its gradients.
  """
  # The previous build's garbage is collected first, so that no build pays
  # for another's; collections during the build are part of its cost.
  gc.collect()
  graph = tf.Graph()
  with graph.as_default():
    images = tf.placeholder(tf.float32, [batch_size] + workload.image_shape)
    labels = tf.placeholder(tf.int64, [batch_size])
    global_step = tf.train.get_or_create_global_step()
    opt = tf.train.MomentumOptimizer(graphs.LEARNING_RATE, graphs.MOMENTUM)

    calls = []

    def model_fn(scope, images, labels):
      del scope  # No summaries are kept.
      calls.append(time.perf_counter())
      return workload.loss_fn(images, labels)

    devices = ["/cpu:%d" % i for i in range(num_towers)]
    start = time.perf_counter()
    towers.minimize(model_fn, opt, num_towers, inputs=(images, labels),
                    devices=devices, global_step=global_step)
    seconds = time.perf_counter() - start
    tower_seconds = [b - a for a, b in zip(calls, calls[1:])]
    return seconds, len(graph.get_operations()), tower_seconds


def measure(workload: workloads.Workload, tower_counts: Sequence[int],
            repeats: int, batch_size: int) -> Dict[str, object]:
  """Times graph construction for each number of towers.

  Args:
    workload: the model.
    tower_counts: increasing numbers of towers, such as ``[1, 2, 4, 8]``.
    repeats: builds per count; the median is reported.
    batch_size: the placeholder's static global batch (at least the largest
      count).

  Returns:
    ``{"rows": [...], "increments": [...], ...}``: per count the median
    seconds, the op count and how long each tower but the last took to
    build (its model and gradients, from its `model_fn` call to the next
    tower's), then per step between consecutive counts the
    added seconds and ops per added tower; ``time_spread`` and
    ``ops_spread``, the largest over the smallest of those increments (1.0
    when perfectly linear); and ``tower_cost_growth`` (see `_growth`) of the
    largest build.
  """
  counts = sorted(tower_counts)
  _build_once(workload, counts[0], batch_size)
  seconds = {n: [] for n in counts}
  tower_seconds = {n: [] for n in counts}
  ops = {}
  for r in range(repeats):
    # Rotated order, so drift does not always favour the same count.
    for n in counts[r % len(counts):] + counts[:r % len(counts)]:
      elapsed, ops[n], towers_built = _build_once(workload, n, batch_size)
      seconds[n].append(elapsed)
      tower_seconds[n].append(towers_built)
  rows = []
  for n in counts:
    # Per tower position, the median over the repeats.
    by_tower = [statistics.median(t) for t in zip(*tower_seconds[n])]
    rows.append({"num_towers": n, "seconds": statistics.median(seconds[n]),
                 "all_seconds": seconds[n], "ops": ops[n],
                 "ops_per_tower": ops[n] / n, "tower_seconds": by_tower})
  increments = []
  for low, high in zip(rows, rows[1:]):
    added = high["num_towers"] - low["num_towers"]
    increments.append({
        "from_towers": low["num_towers"], "to_towers": high["num_towers"],
        "seconds_per_tower": (high["seconds"] - low["seconds"]) / added,
        "ops_per_tower": (high["ops"] - low["ops"]) / added})
  per_tower = [i["seconds_per_tower"] for i in increments]
  spread = (max(per_tower) / min(per_tower)
            if per_tower and min(per_tower) > 0 else float("inf"))
  ops_per_tower = [i["ops_per_tower"] for i in increments]
  ops_spread = (max(ops_per_tower) / min(ops_per_tower)
                if ops_per_tower and min(ops_per_tower) > 0 else float("inf"))
  return {"workload": workload.name, "batch_size": batch_size,
          "repeats": repeats, "rows": rows, "increments": increments,
          "time_spread": spread, "ops_spread": ops_spread,
          "tower_cost_growth": _growth(rows[-1]["tower_seconds"])}


def _growth(tower_seconds: List[float]) -> float:
  """Returns how much more the later towers of one build cost than earlier.

  Tower 0 creates the variables, so it is left out; the rest are split into
  an earlier and a later half, and the ratio of their mean seconds is
  returned: about 1.0 when each tower costs the same however many came
  before it (linear build time), above 1 when later towers cost more.
  NaN with fewer than two towers to compare.
  """
  rest = tower_seconds[1:]
  if len(rest) < 2:
    return float("nan")
  half = len(rest) // 2
  early, late = rest[:half], rest[len(rest) - half:]
  return statistics.mean(late) / statistics.mean(early)
