"""Graph build time and op count of a training step against the towers.

Each measurement builds the whole training step (`cnn_step`: `towers.minimize`
of a workload on a placeholder global batch, Momentum, global step; or a
`benchmarks.transformer` variant) in a fresh ``tf.Graph``; no session is
made. Repeats are interleaved over the variants and tower counts, and a first
untimed build pays for one-time costs (imports, op registrations) that would
otherwise land on the first count.
"""

import gc
import statistics
import time
from typing import Callable, Dict, List, Sequence, Tuple

import tensorflow.compat.v1 as tf

import towers
from benchmarks import graphs
from benchmarks import workloads

# ``build(num_towers, mark)``: builds one training step in the default
# graph, calling ``mark()`` as each tower's model starts.
Build = Callable[[int, Callable[[], None]], None]


def cnn_step(workload: workloads.Workload, batch_size: int) -> Build:
  """Returns the `Build` of `workload`'s step: `towers.minimize` on a
  placeholder global batch of `batch_size`, Momentum, a global step."""

  def build(num_towers: int, mark: Callable[[], None]) -> None:
    images = tf.placeholder(tf.float32, [batch_size] + workload.image_shape)
    labels = tf.placeholder(tf.int64, [batch_size])
    global_step = tf.train.get_or_create_global_step()
    opt = tf.train.MomentumOptimizer(graphs.LEARNING_RATE, graphs.MOMENTUM)

    def model_fn(scope, images, labels):
      del scope  # No summaries are kept.
      mark()
      return workload.loss_fn(images, labels)

    devices = ["/cpu:%d" % i for i in range(num_towers)]
    towers.minimize(model_fn, opt, num_towers, inputs=(images, labels),
                    devices=devices, global_step=global_step)

  return build


def _build_once(build: Build, num_towers: int
               ) -> Tuple[float, int, List[float]]:
  """Returns (seconds, ops, tower seconds) of building one training step.

  The tower seconds are, for each tower but the last, the time from its
  model's start to the next tower's: its model and its gradients.
  """
  # The previous build's garbage is collected first, so that no build pays
  # for another's; collections during the build are part of its cost.
  gc.collect()
  graph = tf.Graph()
  with graph.as_default():
    calls: List[float] = []
    start = time.perf_counter()
    build(num_towers, lambda: calls.append(time.perf_counter()))
    seconds = time.perf_counter() - start
    tower_seconds = [b - a for a, b in zip(calls, calls[1:])]
    return seconds, len(graph.get_operations()), tower_seconds


def measure(workload: workloads.Workload, tower_counts: Sequence[int],
            repeats: int, batch_size: int) -> Dict[str, object]:
  """Times graph construction of `cnn_step` for each number of towers.

  Args:
    workload: the model.
    tower_counts: increasing numbers of towers, such as ``[1, 2, 4, 8]``.
    repeats: builds per count; the median is reported.
    batch_size: the placeholder's static global batch (at least the largest
      count).

  Returns:
    `measure_variants`' result for the one variant, with ``workload`` and
    ``batch_size``.
  """
  result = measure_variants({"towers": cnn_step(workload, batch_size)},
                            {"towers": tower_counts}, repeats)["towers"]
  return {"workload": workload.name, "batch_size": batch_size, **result}


def measure_variants(builds: Dict[str, Build],
                     tower_counts: Dict[str, Sequence[int]],
                     repeats: int) -> Dict[str, Dict[str, object]]:
  """Times graph construction of each variant for each number of towers.

  Builds are interleaved over the variants and their counts, in an order
  rotated each repeat, so that drift does not always favour the same one;
  a first untimed build of each variant pays for one-time costs (imports,
  op registrations).

  Args:
    builds: variant -> its `Build`.
    tower_counts: variant -> its increasing numbers of towers.
    repeats: builds per variant and count; the median is reported.

  Returns:
    Per variant ``{"rows": [...], "increments": [...], ...}``: per count
    the median seconds, the op count and how long each tower but the last
    took to build (its model and gradients), then per step between
    consecutive counts the added seconds and ops per added tower;
    ``time_spread`` and ``ops_spread``, the largest over the smallest of
    those increments (1.0 when perfectly linear); and
    ``tower_cost_growth`` (see `_growth`) of the largest build.
  """
  jobs = [(v, n) for v in builds for n in sorted(tower_counts[v])]
  for variant, build in builds.items():
    _build_once(build, min(tower_counts[variant]))
  seconds: Dict[Tuple[str, int], List[float]] = {j: [] for j in jobs}
  tower_seconds: Dict[Tuple[str, int], List[List[float]]] = {
      j: [] for j in jobs}
  ops: Dict[Tuple[str, int], int] = {}
  for r in range(repeats):
    for job in jobs[r % len(jobs):] + jobs[:r % len(jobs)]:
      elapsed, ops[job], towers_built = _build_once(builds[job[0]], job[1])
      seconds[job].append(elapsed)
      tower_seconds[job].append(towers_built)
  return {variant: _summary(
      [(n, seconds[(variant, n)], ops[(variant, n)],
        tower_seconds[(variant, n)]) for n in sorted(tower_counts[variant])],
      repeats) for variant in builds}


def _summary(measured, repeats: int) -> Dict[str, object]:
  rows = []
  for n, times, op_count, towers_built in measured:
    # Per tower position, the median over the repeats.
    by_tower = [statistics.median(t) for t in zip(*towers_built)]
    rows.append({"num_towers": n, "seconds": statistics.median(times),
                 "all_seconds": times, "ops": op_count,
                 "ops_per_tower": op_count / n, "tower_seconds": by_tower})
  increments = []
  for low, high in zip(rows, rows[1:]):
    added = high["num_towers"] - low["num_towers"]
    increments.append({
        "from_towers": low["num_towers"], "to_towers": high["num_towers"],
        "seconds_per_tower": (high["seconds"] - low["seconds"]) / added,
        "ops_per_tower": (high["ops"] - low["ops"]) / added})
  return {"repeats": repeats, "rows": rows, "increments": increments,
          "time_spread": _spread([i["seconds_per_tower"]
                                  for i in increments]),
          "ops_spread": _spread([i["ops_per_tower"] for i in increments]),
          "tower_cost_growth": _growth(rows[-1]["tower_seconds"])}


def _spread(values: List[float]) -> float:
  return (max(values) / min(values) if values and min(values) > 0
          else float("inf"))


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
