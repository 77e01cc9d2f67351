"""Runs every benchmark once: a markdown table, a JSON file and a chart.

  python -m benchmarks.run                # results in /tmp/towers_bench
  python -m benchmarks.run --quick        # results in /tmp/towers_bench_quick

In one run, on the same devices (GPUs when there are enough, else virtual CPU
devices) and the same global batch, it times training steps of the MNIST and
CIFAR-10 CNNs on synthetic in-memory batches as

- plain: one device, ``opt.minimize(loss)``, the limit;
- towers: `towers.minimize` over 1, 2 and 4 towers (the global batch split),
  variables on ``/cpu:0``, and with ``variable_device="balanced"``;
- replicated: `towers.minimize` with ``variable_device="replicated"`` (a copy
  of the variables per tower), with each ``all_reduce`` algorithm;
- independent: a copy per tower, each trained on its own shard, nothing
  exchanged: the upper bound of split compute;
- original: the same towers averaged the original tutorial's way;
- mirrored: TF2's ``tf.distribute.MirroredStrategy`` with a ``tf.function``
  step, each strategy in a worker process of its own (skipped, with the
  install command, where tf_keras is missing on TensorFlow >= 2.16);
- unpacked: the towers, replicated add_n and collective rows again with
  gradient packing off (``pack_bytes=0``; the rows above pack small
  gradients, the library's default);

and a model of many small variables (200 x 4 KiB, little compute) as plain
and those packed and unpacked rows only; then a sweep of packed against
unpacked by the size of a gradient (`benchmarks.packing`); then
`towers.average_gradients` alone against the original's on a large
gradient set (time and peak memory), the graph build time and op count
of 1, 2, 4 and 8 towers, the same for a BERT-base-sized transformer with one
copy of the variables and replicated with the ring (`benchmarks.transformer`;
its one-device build beside them), synchronized batch norm
(`towers.batch_normalization`) against per-tower
``tf.compat.v1.layers.batch_normalization`` on a small ResNet-ish CNN at 2
and 4 towers (`benchmarks.batch_norm`), the fast paths on the MNIST and
CIFAR-10 CNNs (`benchmarks.fast_paths`): ``stage_inputs=True`` against the
same ``tf.data`` input unstaged at 2 and 4 towers, and bfloat16, float16
(loss-scaled) and XLA against float32 at 2 towers, gradient accumulation
(`benchmarks.accumulation`): replicated towers with ``accumulate_steps`` 1,
2 and 4 at the same micro-batch per tower, at 2 and 4 towers, against one
run of the same effective batch, with the bytes each applied update moves
per example, the replicated copies' start-up check (`benchmarks.startup`):
the replicated MNIST step as built (gated on a flag read each step) against
its twin with the gates cut off, at 2 and 4 towers, with the nodes each
step runs, and last a CNN (MNIST's by default) across workers
(`benchmarks.across_workers`): 2 workers x 2 towers on loopback, with a
parameter server and with a collective all-reduce, each task a process of
its own, against 1 worker x 4 towers, with the bytes each worker sends and
receives per step. Every graph variant
also counts the bytes and tensors that cross between its devices in one
untimed step, beside the figure its design predicts (`benchmarks.traffic`).
Warm-up steps are not timed; variants are interleaved in rounds (each round
runs a few steps of every variant, in a random order, after one untimed
step) and the median step time over all rounds gives examples/sec. A round
during which other processes kept the machine busy is repeated once they
are quiet (within --quiet_wait_minutes); the cores they used are recorded
per round. Results go to ``--out``: results.json, results.md and
examples_per_sec.png (when matplotlib, the ``bench`` extra, is installed).
``--quick`` runs a small version in about a minute and a half, to check that
everything runs: its results (in their own default directory) say they are a
quick run, and it gives no verdicts on the targets. A section given no sizes
is skipped: ``--workloads= --packing_kib= --averaging_shape= --build_towers=
--large_build_towers= --noacross_workers`` runs the batch-norm comparison,
the fast paths, the gradient accumulation and the start-up check alone,
``--batch_norm_towers=`` skips the first, ``--fast_paths_workloads=`` the
second (``--staging_towers=`` or ``--precision_towers=`` a part of it),
``--accumulation_towers=`` the third, ``--startup_towers=`` the last;
``--noacross_workers`` skips the section across workers, in a quick run
too.
See docs/performance.md.
"""

import datetime
import importlib.util
import os
import platform
import random
import time
from typing import Callable, Dict, List, Optional, Sequence, Tuple

if __name__ == "__main__" and importlib.util.find_spec("tf_keras"):
  # The batch-norm comparison's per-tower layer, tf.compat.v1.layers, comes
  # from tf_keras on TensorFlow >= 2.16, and only if this is set before
  # TensorFlow is imported. It changes which Keras TensorFlow imports (it
  # imports one either way), not the other sections: their models are
  # tf.get_variable and tf.nn, and their graphs serialize to the same bytes
  # with it and without (docs/performance.md). The MirroredStrategy workers
  # set it themselves.
  os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")

from absl import app  # pylint: disable=g-import-not-at-top
from absl import flags
from absl import logging
import numpy as np
import tensorflow.compat.v1 as tf

from benchmarks import accumulation
from benchmarks import across_workers
from benchmarks import averaging
from benchmarks import batch_norm
from benchmarks import build_time
from benchmarks import fast_paths
from benchmarks import graphs
from benchmarks import mirrored
from benchmarks import packing
from benchmarks import quiet
from benchmarks import report
from benchmarks import startup
from benchmarks import transformer
from benchmarks import workloads

FLAGS = flags.FLAGS
# The quick run's "many_small" model: its graphs build in seconds.
QUICK_MANY_SMALL_VARIABLES = 20

# The model made for gradient packing runs plain and the modes
# timed packed and unpacked only: its rows are about packing.
PACKING_WORKLOADS = frozenset(["many_small"])
PACKING_VARIANTS = (graphs.TOWERS, graphs.TOWERS_UNPACKED,
                    graphs.REPLICATED_ADD_N, graphs.REPLICATED_ADD_N_UNPACKED,
                    graphs.REPLICATED_COLLECTIVE,
                    graphs.REPLICATED_COLLECTIVE_UNPACKED)


class Quiet:
  """What to do with a round that other processes disturbed.

  A round during which other processes kept more than `max_foreign` cores
  busy (see `quiet.CpuMonitor`) is dropped and run again once they have gone
  quiet, as long as the run's total waiting stays within `wait_seconds`;
  after that, disturbed rounds are kept and counted.
  """

  def __init__(self, monitor: quiet.CpuMonitor, max_foreign: float,
               wait_seconds: float):
    self.monitor = monitor
    self.max_foreign = max_foreign
    self.wait_seconds = wait_seconds
    self.waited = 0.0

  def keep(self, foreign: float) -> bool:
    """Returns whether to keep a round; waits for quiet if not."""
    if foreign <= self.max_foreign:
      return True
    remaining = self.wait_seconds - self.waited
    if remaining <= 0:
      logging.warning("other processes used %.2f cores during this round; "
                      "kept (no waiting time left)", foreign)
      return True
    logging.warning("other processes used %.2f cores during this round; "
                    "waiting for them, then repeating it", foreign)
    self.waited += self.monitor.wait_until_quiet(self.max_foreign, remaining)
    return False

  def start_when_quiet(self) -> None:
    """Waits (within the run's waiting time left) for other processes to go
    quiet, then starts measuring theirs (`quiet.CpuMonitor.start`)."""
    if self.wait_seconds > self.waited:
      self.waited += self.monitor.wait_until_quiet(
          self.max_foreign, self.wait_seconds - self.waited)
    self.monitor.start()


def interleave(runners: Dict[object, object], *, warmup: int, rounds: int,
               steps: int, quiet_policy: Quiet
              ) -> Tuple[Dict[object, List[float]], Dict[str, object]]:
  """Times every runner's steps in interleaved rounds.

  Each round visits every runner once, in a fresh random order (seeded, so
  runs repeat): drift of the machine hits all runners alike, and no runner
  always follows the same one. A visit runs one untimed step, then `steps`
  timed ones: the first step after another runner (another session or
  process) has cold caches, which a training job running only this step
  never has.

  Args:
    runners: name -> an object with ``run(steps) -> [seconds]``.
    warmup: untimed steps of each runner first.
    rounds: rounds to keep.
    steps: timed steps of each runner per round.
    quiet_policy: decides whether a round disturbed by other processes is
      kept.

  Returns:
    ``(times, rounds_info)``: name -> every kept step's seconds, and the
    cores other processes used in each kept round, with the number of
    rounds dropped and repeated.
  """
  names = list(runners)
  for name in names:
    runners[name].run(warmup)
  times = {name: [] for name in names}
  foreign, repeated = [], 0
  while len(foreign) < rounds:
    order = list(names)
    random.Random(len(foreign)).shuffle(order)
    quiet_policy.monitor.start()
    got = [(name, runners[name].run(1 + steps)[1:]) for name in order]
    cores = quiet_policy.monitor.foreign_cores()
    if not quiet_policy.keep(cores):
      repeated += 1
      continue
    for name, seconds in got:
      times[name].extend(seconds)
    foreign.append(cores)
    logging.info("round %d/%d done (other processes: %.2f cores)",
                 len(foreign), rounds, cores)
  return times, {"foreign_cores": foreign, "repeated_rounds": repeated}


def _machine() -> Dict[str, object]:
  model = platform.processor() or "unknown"
  try:
    with open("/proc/cpuinfo") as f:
      for line in f:
        if line.startswith("model name"):
          model = line.split(":", 1)[1].strip()
          break
  except OSError:
    pass
  memory = None
  try:
    with open("/proc/meminfo") as f:
      memory = int(f.readline().split()[1]) * 1024
  except (OSError, ValueError, IndexError):
    pass
  return {"cpu": model, "cores": os.cpu_count(), "memory_bytes": memory,
          "gpus": len(tf.config.list_physical_devices("GPU")),
          "platform": platform.platform(),
          "python": platform.python_version(),
          "tensorflow": tf.__version__, "numpy": np.__version__,
          # oneDNN's kernels change the byte counts (docs/pitfalls.md P36).
          "tf_enable_onednn_opts": os.environ.get("TF_ENABLE_ONEDNN_OPTS",
                                                  "unset")}


def load_average() -> List[float]:
  """Returns the 1, 5 and 15 minute load averages (empty if unknown)."""
  try:
    return list(os.getloadavg())
  except OSError:
    return []


def plan(workload_name: str,
         tower_counts: Sequence[int]) -> List[Tuple[str, int]]:
  """Returns the graph variants timed on a workload: ``(variant, towers)``.

  The MirroredStrategy rows (`has_mirrored`) are not in it: they run in
  worker processes.
  """
  # With one tower, "balanced" places every variable on that tower's
  # device, as "cpu" does here: the same graph, so it is not run again. So
  # do the replicated modes (one copy, nothing to reduce), and one
  # independent tower is plain. Nothing is packed with one tower either.
  many = [n for n in tower_counts if n > 1]
  if workload_name in PACKING_WORKLOADS:
    return [(graphs.PLAIN, 1)] + [(variant, n) for variant in PACKING_VARIANTS
                                  for n in many]
  steps = [(graphs.PLAIN, 1)]
  steps += [(graphs.TOWERS, n) for n in tower_counts]
  steps += [(graphs.BALANCED, n) for n in many]
  steps += [(variant, n) for variant in graphs.REPLICATED for n in many]
  steps += [(graphs.INDEPENDENT, n) for n in many]
  steps += [(graphs.ORIGINAL, n) for n in tower_counts]
  steps += [(variant, n) for variant in graphs.UNPACKED for n in many]
  return steps


def has_mirrored(workload_name: str) -> bool:
  """Whether a workload is also timed on TF2's MirroredStrategy."""
  return workload_name not in PACKING_WORKLOADS


def throughput(workload: workloads.Workload, *, global_batch: int,
               tower_counts: Sequence[int], num_devices: int,
               workers: Dict[int, mirrored.MirroredWorker],
               before_timing: Callable[[], object], quiet_policy: Quiet,
               warmup: int, rounds: int, steps: int) -> Dict[str, object]:
  """Times every variant of one workload; returns its rows.

  `before_timing` is called once the graphs are built, before the first
  step; it waits for any start-up work still running beside this process.
  """
  images, labels = workloads.synthetic_batch(workload, global_batch)
  runners, num_ops, moved = {}, {}, {}
  for variant, n in plan(workload.name, tower_counts):
    step = graphs.GraphStep(workload, variant, n, images, labels,
                            num_devices)
    runners[(variant, n)] = step
    num_ops[(variant, n)] = step.num_ops
    moved[(variant, n)] = step.traffic
  before_timing()
  for n, worker in sorted(workers.items()):
    worker.wait_until_ready()
    runners[(graphs.MIRRORED, n)] = worker
  logging.info("%s: timing %d variants, global batch %d", workload.name,
               len(runners), global_batch)
  try:
    times, rounds_info = interleave(runners, warmup=warmup, rounds=rounds,
                                    steps=steps, quiet_policy=quiet_policy)
  finally:
    for key, runner in runners.items():
      if key[0] != graphs.MIRRORED:
        runner.close()
  rows = []
  for (variant, n), seconds in times.items():
    row = {"variant": variant, "num_towers": n,
           "num_ops": num_ops.get((variant, n)),
           "traffic": moved.get((variant, n))}
    row.update(report.step_stats(seconds))
    row["examples_per_sec"] = global_batch / row["median_step_sec"]
    rows.append(row)
  plain = next(r for r in rows if r["variant"] == graphs.PLAIN)
  for row in rows:
    row["ratio_to_plain"] = row["examples_per_sec"] / plain["examples_per_sec"]
  order = {v: i for i, v in enumerate(graphs.VARIANTS)}
  rows.sort(key=lambda r: (order[r["variant"]], r["num_towers"]))
  return {"workload": workload.name, "title": workload.title,
          "global_batch": global_batch, "rows": rows, "rounds": rounds_info,
          "mirrored_planned": has_mirrored(workload.name)}


def _interleave_and_close(runners: Dict[object, object], **kwargs
                         ) -> Tuple[Dict[object, List[float]],
                                    Dict[str, object]]:
  """`interleave`s `runners`, then closes them all, whatever happened."""
  try:
    return interleave(runners, **kwargs)
  finally:
    for runner in runners.values():
      runner.close()


def packing_sweep(*, sizes: Sequence[int], num_towers: int,
                  global_batch: int, num_devices: int, max_variables: int,
                  quiet_policy: Quiet, warmup: int, rounds: int,
                  steps: int) -> Dict[str, object]:
  """Times packed against unpacked steps by gradient size, interleaved."""
  runners = packing.build(sizes=sizes, num_towers=num_towers,
                          global_batch=global_batch, num_devices=num_devices,
                          max_variables=max_variables)
  logging.info("pack_bytes sweep: timing %d sizes at %d towers", len(sizes),
               num_towers)
  times, rounds_info = _interleave_and_close(
      runners, warmup=warmup, rounds=rounds, steps=steps,
      quiet_policy=quiet_policy)
  return packing.result(runners, times, num_towers=num_towers,
                        global_batch=global_batch, rounds_info=rounds_info)


def batch_norm_comparison(*, tower_counts: Sequence[int], global_batch: int,
                          num_devices: int, quiet_policy: Quiet, warmup: int,
                          rounds: int, steps: int) -> Dict[str, object]:
  """Times synchronized against per-tower batch norm, interleaved."""
  started = time.time()
  per_tower = batch_norm.per_tower_layer()
  name, _, reason = per_tower
  if reason:
    logging.warning("%s: the per-tower rows use %s", reason, name)
  runners = batch_norm.build(tower_counts=tower_counts,
                             global_batch=global_batch,
                             num_devices=num_devices, per_tower=per_tower)
  logging.info("batch norm: timing synchronized against %s at %s towers",
               name, list(tower_counts))
  times, rounds_info = _interleave_and_close(
      runners, warmup=warmup, rounds=rounds, steps=steps,
      quiet_policy=quiet_policy)
  result = batch_norm.result(runners, times, global_batch=global_batch,
                             per_tower=name, per_tower_reason=reason,
                             rounds_info=rounds_info)
  result["seconds"] = time.time() - started
  return result


def fast_paths_comparison(*, workload_names: Sequence[str],
                          staging_towers: Sequence[int], staging_batch: int,
                          precision_towers: Sequence[int],
                          precision_batch: int, num_devices: int,
                          quiet_policy: Quiet, warmup: int, rounds: int,
                          steps: int) -> Dict[str, object]:
  """Times the fast paths: staged against unstaged, then the precisions.

  Each comparison is interleaved in rounds of its own (their steps differ
  tenfold in time), its graphs built and closed before the next one's.
  """
  result = {"workloads": list(workload_names)}
  kwargs = dict(quiet_policy=quiet_policy, warmup=warmup, rounds=rounds,
                steps=steps)
  if staging_towers:
    started = time.time()
    runners = fast_paths.build_staging(
        workload_names=workload_names, tower_counts=staging_towers,
        global_batch=staging_batch, num_devices=num_devices)
    logging.info("fast paths: timing staged against unstaged inputs on %s "
                 "at %s towers", list(workload_names), list(staging_towers))
    times, rounds_info = _interleave_and_close(runners, **kwargs)
    result["staging"] = fast_paths.staging_result(
        runners, times, global_batch=staging_batch, rounds_info=rounds_info)
    result["staging"]["seconds"] = time.time() - started
  if precision_towers:
    started = time.time()
    runners, not_run = fast_paths.build_precision(
        workload_names=workload_names, tower_counts=precision_towers,
        global_batch=precision_batch, num_devices=num_devices)
    logging.info("fast paths: timing %s on %s at %s towers",
                 ", ".join(fast_paths.PRECISIONS), list(workload_names),
                 list(precision_towers))
    times, rounds_info = _interleave_and_close(runners, **kwargs)
    result["precision"] = fast_paths.precision_result(
        runners, not_run, times, global_batch=precision_batch,
        rounds_info=rounds_info)
    result["precision"]["seconds"] = time.time() - started
  return result


def accumulation_comparison(*, tower_counts: Sequence[int],
                            accumulate_steps: Sequence[int],
                            per_tower_batch: int, num_devices: int,
                            quiet_policy: Quiet, warmup: int, rounds: int,
                            steps: int) -> Dict[str, object]:
  """Times gradient accumulation's rows, interleaved; counts its bytes.

  The rows with the variables on /cpu:0 are counted first, each graph
  closed before the next is built; the timed rows' steps are applied
  updates (`accumulation.AccumulationStep`).
  """
  started = time.time()
  sizes = dict(tower_counts=tower_counts, accumulate_steps=accumulate_steps,
               per_tower_batch=per_tower_batch, num_devices=num_devices)
  counted = accumulation.count_only(**sizes)
  runners = accumulation.build(**sizes)
  logging.info("accumulation: timing accumulate_steps %s at %s towers, %d "
               "per tower", accumulation.steps_with_one(accumulate_steps),
               list(tower_counts), per_tower_batch)
  try:
    times, rounds_info = interleave(runners, warmup=warmup, rounds=rounds,
                                    steps=steps, quiet_policy=quiet_policy)
    # Before closing: each row reads its global step.
    result = accumulation.result(
        runners, times, counted, per_tower_batch=per_tower_batch,
        accumulate_steps=accumulate_steps, rounds_info=rounds_info)
  finally:
    for runner in runners.values():
      runner.close()
  result["seconds"] = time.time() - started
  return result


def startup_comparison(*, tower_counts: Sequence[int],
                       all_reduces: Sequence[str], global_batch: int,
                       num_devices: int, quiet_policy: Quiet, warmup: int,
                       rounds: int, steps: int) -> Dict[str, object]:
  """Times the replicated step gated against ungated, interleaved; counts
  the nodes each runs in a traced step after the first."""
  started = time.time()
  runners = startup.build(tower_counts=tower_counts, all_reduces=all_reduces,
                          global_batch=global_batch, num_devices=num_devices)
  try:
    nodes = {key: startup.nodes_per_step(step)
             for key, step in runners.items()}
  except BaseException:
    for runner in runners.values():
      runner.close()
    raise
  logging.info("start-up check: timing gated against ungated, %s, at %s "
               "towers", ", ".join(all_reduces), list(tower_counts))
  times, rounds_info = _interleave_and_close(
      runners, warmup=warmup, rounds=rounds, steps=steps,
      quiet_policy=quiet_policy)
  result = startup.result(runners, times, nodes, global_batch=global_batch,
                          rounds_info=rounds_info)
  result["seconds"] = time.time() - started
  return result


def across_workers_comparison(*, workload_name: str, per_tower_batch: int,
                              measure_steps: int, own_pids: List[int],
                              quiet_policy: Quiet, warmup: int, rounds: int,
                              steps: int) -> Dict[str, object]:
  """Times 2 workers x 2 towers (ps, collective) against 1 x 4, interleaved.

  Every task is a process of its own (`benchmarks.across_workers`); their
  pids join `own_pids`, so that the rounds count their CPU time as the
  benchmark's own.
  """
  started = time.time()
  clusters = across_workers.start(workload=workload_name,
                                  per_tower_batch=per_tower_batch)
  try:
    own_pids.extend(pid for c in clusters.values() for pid in c.pids)
    across_workers.prepare(clusters, measure_steps)
    logging.info("across workers: timing %s on %s, %d per tower",
                 ", ".join(clusters), workload_name, per_tower_batch)
    times, rounds_info = interleave(clusters, warmup=warmup, rounds=rounds,
                                    steps=steps, quiet_policy=quiet_policy)
  finally:
    for cluster in clusters.values():
      cluster.close()
  result = across_workers.result(
      clusters, times, workload=workload_name,
      title=workloads.WORKLOADS[workload_name].title,
      per_tower_batch=per_tower_batch, rounds_info=rounds_info)
  result["seconds"] = time.time() - started
  return result


def average_gradients_result(peaks: averaging.PeakMeasurements, *,
                             num_towers: int, num_vars: int, num_floats: int,
                             peak_tower_counts: Sequence[int],
                             quiet_policy: Quiet, warmup: int, rounds: int,
                             steps: int) -> Dict[str, object]:
  """Times both averagings interleaved; adds the peaks measured apart."""
  runners = {name: averaging.AveragingStep(name, num_towers, num_vars,
                                           num_floats)
             for name in (averaging.OURS, averaging.ORIGINAL)}
  logging.info("average_gradients: timing %d towers x %d x %d floats",
               num_towers, num_vars, num_floats)
  times, rounds_info = _interleave_and_close(
      runners, warmup=warmup, rounds=rounds, steps=steps,
      quiet_policy=quiet_policy)
  measured = peaks.results()
  result = {"num_towers": num_towers, "num_vars": num_vars,
            "num_floats": num_floats, "peaks_by_towers": [],
            "rounds": rounds_info}
  for name, seconds in times.items():
    result[name] = report.step_stats(seconds)
    result[name].update(measured[(name, num_towers)])
    result[name]["temporary_bytes_per_variable"] = averaging.temporary_bytes(
        name, num_towers, num_floats)
  for n in peak_tower_counts:
    result["peaks_by_towers"].append({
        "num_towers": n,
        **{name: measured[(name, n)]
           for name in (averaging.OURS, averaging.ORIGINAL)}})
  report.process_measure(result)
  return result


def run(*, out_dir: str, workload_names: Sequence[str],
        tower_counts: Sequence[int], global_batches: Dict[str, int],
        warmup: int, rounds: int, steps: int, averaging_shape: Sequence[int],
        averaging_rounds: int, averaging_peak_towers: Sequence[int],
        build_workload: str,
        build_counts: Sequence[int], build_repeats: int, quick: bool,
        large_build_counts: Sequence[int] = (),
        large_build_repeats: int = 3,
        large_build_config: transformer.Config = transformer.BERT_BASE,
        packing_sizes: Sequence[int] = (), packing_towers: int = 4,
        packing_batch: int = 16,
        packing_max_variables: int = packing.MAX_VARIABLES,
        many_small_variables: int = workloads.MANY_SMALL_VARIABLES,
        batch_norm_towers: Sequence[int] = (), batch_norm_batch: int = 128,
        fast_paths_workloads: Sequence[str] = (),
        staging_towers: Sequence[int] = (), staging_batch: int = 256,
        precision_towers: Sequence[int] = (), precision_batch: int = 64,
        accumulation_towers: Sequence[int] = (),
        accumulation_steps: Sequence[int] = (1, 2, 4),
        accumulation_batch: int = 64,
        startup_towers: Sequence[int] = (),
        startup_all_reduces: Sequence[str] = ("add_n", "collective"),
        startup_batch: int = 64, startup_rounds: int = 30,
        across_workers_workload: str = "", across_workers_batch: int = 64,
        across_workers_measure_steps: int = 5,
        mirrored_skipped: Optional[str] = None,
        max_foreign_cores: float = 0.25, quiet_wait_seconds: float = 0.0,
        chart: bool = True) -> Dict[str, object]:
  """Runs the benchmarks; writes and returns the results.

  Args:
    out_dir: where results.json, results.md and the chart go (created if
      missing; files there of the same names are overwritten).
    workload_names: keys of `workloads.WORKLOADS` to time.
    tower_counts: the tower counts of the towers, original and mirrored
      variants.
    global_batches: workload name -> global batch (the same for every
      variant and tower count).
    warmup: untimed steps per variant.
    rounds: interleaved rounds.
    steps: timed steps per variant per round.
    averaging_shape: ``(towers, variables, floats per variable)`` of the
      average_gradients benchmark; empty skips it.
    averaging_rounds: its interleaved rounds (of `steps` steps).
    averaging_peak_towers: further tower counts at which its peak memory
      (not its time) is measured.
    build_workload: the model whose graph build is timed.
    build_counts: the tower counts of the build benchmark; empty skips it.
    build_repeats: builds per count.
    large_build_counts: the tower counts at which the build of a large
      model (`benchmarks.transformer`) is timed, one copy and replicated
      with the ring (on one device: once, beside the smallest); empty skips
      it.
    large_build_repeats: its builds per variant and count.
    large_build_config: its model's size.
    quick: a quick run: recorded in the results, said in the tables and
      the chart, and no target gets a verdict (a few steps on tiny batches
      are not measurements).
    packing_sizes: the gradient sizes (bytes) of the pack_bytes sweep
      (`benchmarks.packing`); empty skips it.
    packing_towers: its towers.
    packing_batch: its global batch.
    packing_max_variables: the most variables of one of its models.
    many_small_variables: the variables of the "many_small" workload
      (`workloads.MANY_SMALL_VARIABLES`; fewer in a quick run, whose graphs
      must build fast).
    batch_norm_towers: the tower counts at which synchronized batch norm is
      timed against per-tower batch norm (`benchmarks.batch_norm`); empty
      skips it.
    batch_norm_batch: its global batch.
    fast_paths_workloads: the workloads ("mnist", "cifar10") of the fast
      paths' rows (`benchmarks.fast_paths`); empty skips them.
    staging_towers: the tower counts at which staged inputs are timed
      against unstaged; empty skips them.
    staging_batch: their global batch.
    precision_towers: the tower counts at which bfloat16, float16 and XLA
      are timed against float32; empty skips them.
    precision_batch: their global batch.
    accumulation_towers: the tower counts of the gradient accumulation
      rows (`benchmarks.accumulation`); empty skips them.
    accumulation_steps: their ``accumulate_steps`` (1 is always among
      them: the baseline).
    accumulation_batch: their micro-batch per tower.
    startup_towers: the tower counts at which the replicated step is timed
      gated against ungated (`benchmarks.startup`); empty skips it.
    startup_all_reduces: its ``all_reduce`` algorithms.
    startup_batch: its global batch (MNIST).
    startup_rounds: its interleaved rounds (of `steps` steps).
    across_workers_workload: the workload ("mnist", "cifar10") trained on
      2 workers x 2 towers, with a parameter server and with a collective
      all-reduce, against 1 worker x 4 towers
      (`benchmarks.across_workers`); empty skips it.
    across_workers_batch: its batch per tower (the same in all three).
    across_workers_measure_steps: the steps over which each worker's TCP
      bytes are measured.
    mirrored_skipped: why the MirroredStrategy rows cannot run here
      (`mirrored.installed_unavailable_reason`), or None to run them.
    max_foreign_cores: other processes' cores above which a timed round
      counts as disturbed.
    quiet_wait_seconds: how long the whole run may wait for other processes
      to go quiet before repeating a disturbed round; 0 keeps every round
      (the cores are recorded either way).
    chart: draw the chart when matplotlib is installed.

  Returns:
    The results, as written to results.json.
  """
  started = time.time()
  report.ensure_dir(out_dir)
  if not fast_paths_workloads:
    staging_towers, precision_towers = (), ()
  num_devices = max(list(tower_counts) + list(averaging_shape[:1])
                    + list(batch_norm_towers) + list(staging_towers)
                    + list(precision_towers) + list(accumulation_towers)
                    + list(startup_towers)
                    + ([packing_towers] if packing_sizes else []) + [1])
  results = {"quick": quick, "mirrored_skipped": mirrored_skipped,
             "machine": _machine(),
             "started": datetime.datetime.now().isoformat(timespec="seconds"),
             "load_average_start": load_average(),
             "settings": {
                 "tower_counts": list(tower_counts),
                 "global_batches": dict(global_batches),
                 "many_small_variables": many_small_variables,
                 "packing_sizes": list(packing_sizes),
                 "packing_towers": packing_towers,
                 "packing_batch": packing_batch,
                 "packing_max_variables": packing_max_variables,
                 "batch_norm_towers": list(batch_norm_towers),
                 "batch_norm_batch": batch_norm_batch,
                 "fast_paths_workloads": list(fast_paths_workloads),
                 "staging_towers": list(staging_towers),
                 "staging_batch": staging_batch,
                 "precision_towers": list(precision_towers),
                 "precision_batch": precision_batch,
                 "accumulation_towers": list(accumulation_towers),
                 "accumulation_steps": list(accumulation_steps),
                 "accumulation_batch": accumulation_batch,
                 "startup_towers": list(startup_towers),
                 "startup_all_reduces": list(startup_all_reduces),
                 "startup_batch": startup_batch,
                 "startup_rounds": startup_rounds,
                 "across_workers_workload": across_workers_workload,
                 "across_workers_batch": across_workers_batch,
                 "across_workers_measure_steps":
                     across_workers_measure_steps,
                 "warmup_steps": warmup, "rounds": rounds,
                 "untimed_steps_per_visit": 1,
                 "steps_per_round": steps, "num_devices": num_devices,
                 "max_foreign_cores": max_foreign_cores,
                 "quiet_wait_seconds": quiet_wait_seconds,
                 "optimizer": "Momentum(%g, %g)" % (graphs.LEARNING_RATE,
                                                    graphs.MOMENTUM)}}
  logging.info("Machine: %s", results["machine"])
  logging.info("Load average at start: %s", results["load_average_start"])
  # Start-up work that is not timed runs side by side: the MirroredStrategy
  # workers build their models and the peak-memory processes measure, while
  # this process builds its graphs. All of it ends before the first timed
  # round.
  if mirrored_skipped:
    logging.warning("%s", mirrored_skipped)
  workers = {(name, n): mirrored.MirroredWorker(
      name, n, global_batches[name], num_devices)
             for name in workload_names for n in tower_counts
             if has_mirrored(name) and not mirrored_skipped}
  # The across-workers section's processes, once started.
  own_pids: List[int] = []
  monitor = quiet.CpuMonitor(
      lambda: [w.pid for w in workers.values()] + own_pids)
  quiet_policy = Quiet(monitor, max_foreign_cores, quiet_wait_seconds)
  peak_tower_counts = []
  if averaging_shape:
    peak_tower_counts = sorted(set(averaging_peak_towers)
                               | {averaging_shape[0]})
  peaks = averaging.PeakMeasurements(
      [(name, n, averaging_shape[1], averaging_shape[2])
       for n in peak_tower_counts
       for name in (averaging.OURS, averaging.ORIGINAL)])
  try:
    results["throughput"] = []
    for name in workload_names:
      results["throughput"].append(throughput(
          _workload(name, many_small_variables),
          global_batch=global_batches[name],
          tower_counts=tower_counts, num_devices=num_devices,
          workers={n: w for (wn, n), w in workers.items() if wn == name},
          before_timing=peaks.results, quiet_policy=quiet_policy,
          warmup=warmup, rounds=rounds, steps=steps))
      # Done with this workload: its workers' memory is freed.
      for (wn, _), worker in workers.items():
        if wn == name:
          worker.close()
    results["mirrored_devices"] = {
        "%s/%d" % key: w.devices for key, w in workers.items()}
  finally:
    for worker in workers.values():
      worker.close()
  if packing_sizes:
    results["packing_sweep"] = packing_sweep(
        sizes=packing_sizes, num_towers=packing_towers,
        global_batch=packing_batch, num_devices=num_devices,
        max_variables=packing_max_variables, quiet_policy=quiet_policy,
        warmup=warmup, rounds=rounds, steps=steps)
  if averaging_shape:
    results["average_gradients"] = average_gradients_result(
        peaks, num_towers=averaging_shape[0], num_vars=averaging_shape[1],
        num_floats=averaging_shape[2], peak_tower_counts=peak_tower_counts,
        quiet_policy=quiet_policy, warmup=warmup, rounds=averaging_rounds,
        steps=steps)
  if build_counts:
    logging.info("Graph build: %s, %s towers", build_workload, build_counts)
    quiet_policy.start_when_quiet()
    build = build_time.measure(workloads.WORKLOADS[build_workload],
                               build_counts, build_repeats,
                               global_batches.get(build_workload, 128))
    build["foreign_cores"] = monitor.foreign_cores()
    build["title"] = workloads.WORKLOADS[build_workload].title
    results["build"] = build
  if large_build_counts:
    results["large_build"] = large_build(
        large_build_config, large_build_counts, large_build_repeats,
        quiet_policy)
  # Last, so that the sections before it run as in earlier runs (the first
  # tf.layers call also loads more of tf_keras).
  if batch_norm_towers:
    results["batch_norm"] = batch_norm_comparison(
        tower_counts=batch_norm_towers, global_batch=batch_norm_batch,
        num_devices=num_devices, quiet_policy=quiet_policy, warmup=warmup,
        rounds=rounds, steps=steps)
  # After batch norm, so that every section before it runs as in earlier
  # runs.
  if staging_towers or precision_towers:
    results["fast_paths"] = fast_paths_comparison(
        workload_names=fast_paths_workloads, staging_towers=staging_towers,
        staging_batch=staging_batch, precision_towers=precision_towers,
        precision_batch=precision_batch, num_devices=num_devices,
        quiet_policy=quiet_policy, warmup=warmup, rounds=rounds, steps=steps)
  # After the fast paths, so that every section before it runs as in
  # earlier runs.
  if accumulation_towers:
    results["accumulation"] = accumulation_comparison(
        tower_counts=accumulation_towers, accumulate_steps=accumulation_steps,
        per_tower_batch=accumulation_batch, num_devices=num_devices,
        quiet_policy=quiet_policy, warmup=warmup, rounds=rounds, steps=steps)
  # After gradient accumulation, so that every section before it runs as in
  # earlier runs.
  if startup_towers:
    results["startup"] = startup_comparison(
        tower_counts=startup_towers, all_reduces=startup_all_reduces,
        global_batch=startup_batch, num_devices=num_devices,
        quiet_policy=quiet_policy, warmup=warmup, rounds=startup_rounds,
        steps=steps)
  # Last: its six processes start once every section before it is done.
  if across_workers_workload:
    results["across_workers"] = across_workers_comparison(
        workload_name=across_workers_workload,
        per_tower_batch=across_workers_batch,
        measure_steps=across_workers_measure_steps, own_pids=own_pids,
        quiet_policy=quiet_policy, warmup=warmup, rounds=rounds, steps=steps)
  results["quiet_waited_seconds"] = quiet_policy.waited
  report.add_targets(results)
  results["load_average_end"] = load_average()
  results["seconds"] = time.time() - started
  table = report.markdown(results)
  report.write_json(results, os.path.join(out_dir, "results.json"))
  with open(os.path.join(out_dir, "results.md"), "w") as f:
    f.write(table + "\n")
  if chart:
    path = report.chart(results, os.path.join(out_dir, "examples_per_sec.png"))
    if path:
      logging.info("Chart: %s", path)
  logging.info("Done in %.0f s; load average at end: %s; results in %s",
               results["seconds"], results["load_average_end"], out_dir)
  print(table)
  return results


def large_build(config: transformer.Config, tower_counts: Sequence[int],
                repeats: int, quiet_policy: Quiet) -> Dict[str, object]:
  """Times the build of `config`'s training step, each variant at each
  count (`build_time.measure_variants`); one device at one count."""
  title = transformer.title(config)
  logging.info("Large model build: %s, %s towers", title, tower_counts)
  quiet_policy.start_when_quiet()
  counts = {transformer.PLAIN: [min(tower_counts)],
            transformer.ONE_COPY: tower_counts, transformer.RING: tower_counts}
  measured = build_time.measure_variants(
      transformer.build_variants(config), counts, repeats)
  return {"title": title, "config": config._asdict(), "repeats": repeats,
          "variants": measured,
          "foreign_cores": quiet_policy.monitor.foreign_cores()}


def _workload(name: str, many_small_variables: int) -> workloads.Workload:
  """Returns a workload by name, "many_small" with its number of variables."""
  if name == "many_small":
    return workloads.small_variables(workloads.MANY_SMALL_WIDTH,
                                     many_small_variables)
  return workloads.WORKLOADS[name]


def main(argv):
  if len(argv) > 1:
    raise app.UsageError("unexpected arguments: %s" % " ".join(argv[1:]))
  if FLAGS.quick:
    # The packing rows on a model of 20 small variables, not 200: the 200
    # variables' graphs alone take a minute to build.
    settings = dict(
        workload_names=["mnist", "many_small"], tower_counts=[1, 2],
        global_batches={"mnist": 32, "cifar10": 32, "many_small": 8},
        many_small_variables=QUICK_MANY_SMALL_VARIABLES, warmup=1, rounds=2,
        steps=2, averaging_shape=[4, 4, 256 * 1024], averaging_rounds=2,
        averaging_peak_towers=[],
        build_workload="mnist", build_counts=[1, 2, 4], build_repeats=1,
        large_build_counts=[1, 2], large_build_repeats=1,
        large_build_config=transformer.TINY,
        packing_sizes=[1 * packing.KIB, 64 * packing.KIB], packing_towers=4,
        packing_batch=8, packing_max_variables=8, batch_norm_towers=[2, 4],
        batch_norm_batch=8, fast_paths_workloads=["mnist"],
        staging_towers=[2], staging_batch=8, precision_towers=[2],
        precision_batch=2, accumulation_towers=[2],
        accumulation_steps=[1, 2], accumulation_batch=2,
        startup_towers=[2], startup_all_reduces=["add_n", "collective"],
        startup_batch=8, startup_rounds=2,
        across_workers_workload="mnist",
        across_workers_batch=2, across_workers_measure_steps=2,
        quiet_wait_seconds=0)
  else:
    settings = dict(
        workload_names=FLAGS.workloads,
        tower_counts=[int(n) for n in FLAGS.towers],
        global_batches={"mnist": FLAGS.mnist_batch,
                        "cifar10": FLAGS.cifar10_batch,
                        "many_small": FLAGS.many_small_batch},
        warmup=FLAGS.warmup, rounds=FLAGS.rounds, steps=FLAGS.steps,
        averaging_shape=[int(n) for n in FLAGS.averaging_shape if n],
        averaging_rounds=FLAGS.averaging_rounds,
        averaging_peak_towers=[int(n) for n in FLAGS.averaging_peak_towers
                               if n],
        build_workload="cifar10",
        build_counts=[int(n) for n in FLAGS.build_towers if n],
        build_repeats=FLAGS.build_repeats,
        large_build_counts=[int(n) for n in FLAGS.large_build_towers if n],
        large_build_repeats=FLAGS.large_build_repeats,
        packing_sizes=[int(k) * packing.KIB for k in FLAGS.packing_kib if k],
        packing_towers=FLAGS.packing_towers,
        packing_batch=FLAGS.packing_batch,
        batch_norm_towers=[int(n) for n in FLAGS.batch_norm_towers if n],
        batch_norm_batch=FLAGS.batch_norm_batch,
        fast_paths_workloads=[w for w in FLAGS.fast_paths_workloads if w],
        staging_towers=[int(n) for n in FLAGS.staging_towers if n],
        staging_batch=FLAGS.staging_batch,
        precision_towers=[int(n) for n in FLAGS.precision_towers if n],
        precision_batch=FLAGS.precision_batch,
        accumulation_towers=[int(n) for n in FLAGS.accumulation_towers if n],
        accumulation_steps=[int(k) for k in FLAGS.accumulation_steps if k],
        accumulation_batch=FLAGS.accumulation_batch,
        startup_towers=[int(n) for n in FLAGS.startup_towers if n],
        startup_all_reduces=[a for a in FLAGS.startup_all_reduce if a],
        startup_batch=FLAGS.startup_batch,
        startup_rounds=FLAGS.startup_rounds,
        across_workers_workload=FLAGS.across_workers_workload,
        across_workers_batch=FLAGS.across_workers_batch,
        quiet_wait_seconds=60 * FLAGS.quiet_wait_minutes)
  if not FLAGS.across_workers:
    settings["across_workers_workload"] = ""
  settings["max_foreign_cores"] = FLAGS.max_foreign_cores
  run(out_dir=default_out(FLAGS.out, FLAGS.quick), quick=FLAGS.quick,
      mirrored_skipped=mirrored.installed_unavailable_reason(),
      chart=FLAGS.chart, **settings)


def default_out(out: str, quick: bool) -> str:
  """Returns --out, or the default directory of a full or a quick run.

  A quick run has a directory of its own, so that it never overwrites the
  results of a full run.
  """
  if out:
    return out
  return "/tmp/towers_bench_quick" if quick else "/tmp/towers_bench"


def define_flags():
  flags.DEFINE_string("out", "", "Directory for results.json, results.md "
                      "and the chart; created if missing. Default: "
                      "/tmp/towers_bench, or /tmp/towers_bench_quick with "
                      "--quick.")
  flags.DEFINE_boolean("quick", False, "A small run (MNIST and 20 small "
                       "variables, tiny batches and sets, few steps) in "
                       "about a minute and a half, to check that everything "
                       "runs: no verdicts on the targets. It ignores the size "
                       "flags below.")
  flags.DEFINE_list("workloads", ["mnist", "cifar10", "many_small"],
                    "Models to time.")
  flags.DEFINE_list("towers", ["1", "2", "4"], "Tower counts.")
  flags.DEFINE_integer("mnist_batch", 256, "MNIST global batch.")
  flags.DEFINE_integer("cifar10_batch", 256, "CIFAR-10 global batch.")
  flags.DEFINE_integer("many_small_batch", 64, "Global batch of the model "
                       "of many small variables. Small: it does little "
                       "compute per example, so the per-tensor cost of the "
                       "gradients' reduction shows, as it does for small "
                       "layers on a GPU.")
  flags.DEFINE_list("packing_kib", ["1", "4", "16", "64", "256"], "Gradient "
                    "sizes (KiB) of the pack_bytes sweep, packed against "
                    "unpacked; empty skips it.")
  flags.DEFINE_integer("packing_towers", 4, "Towers of the pack_bytes "
                       "sweep.")
  flags.DEFINE_integer("packing_batch", 16, "Global batch of the pack_bytes "
                       "sweep: little compute, so that the reductions "
                       "show.")
  flags.DEFINE_list("batch_norm_towers", ["2", "4"], "Tower counts at "
                    "which synchronized batch norm "
                    "(towers.batch_normalization) is timed against "
                    "per-tower tf.compat.v1.layers.batch_normalization on "
                    "a small ResNet-ish CNN; empty skips it.")
  flags.DEFINE_integer("batch_norm_batch", 128, "Global batch of the "
                       "batch-norm comparison (32x32x3 images).")
  flags.DEFINE_list("fast_paths_workloads", ["mnist", "cifar10"], "Models "
                    "of the fast paths' rows (staged inputs, mixed "
                    "precision, XLA: benchmarks/fast_paths.py), run last; "
                    "empty skips them.")
  flags.DEFINE_list("staging_towers", ["2", "4"], "Tower counts at which "
                    "stage_inputs=True is timed against the same tf.data "
                    "input unstaged; empty skips it.")
  flags.DEFINE_integer("staging_batch", 256, "Global batch of the staging "
                       "rows.")
  flags.DEFINE_list("precision_towers", ["2"], "Tower counts at which "
                    "bfloat16, float16 (loss-scaled) and XLA are timed "
                    "against float32; empty skips them.")
  flags.DEFINE_integer("precision_batch", 64, "Global batch of the "
                       "precision rows: small, since bfloat16 and float16 "
                       "steps on a CPU without their instructions take "
                       "several times float32's.")
  flags.DEFINE_list("accumulation_towers", ["2", "4"], "Tower counts at "
                    "which gradient accumulation (towers.minimize's "
                    "accumulate_steps, replicated variables) is timed, "
                    "and its bytes per example counted "
                    "(benchmarks/accumulation.py); empty skips it.")
  flags.DEFINE_list("accumulation_steps", ["1", "2", "4"], "Its "
                    "accumulate_steps (k, micro-batches per update; 1, the "
                    "baseline, is always run); the largest is compared "
                    "with k=1 and with one run of the same effective "
                    "batch.")
  flags.DEFINE_integer("accumulation_batch", 64, "Its micro-batch per "
                       "tower, the same at every k (at 4 towers, one run "
                       "is MNIST's global batch of the throughput rows).")
  flags.DEFINE_list("startup_towers", ["2", "4"], "Tower counts at which "
                    "the replicated MNIST step is timed as built, its "
                    "copies' start-up check gated on a flag each step, "
                    "against its twin with the gates cut off "
                    "(benchmarks/startup.py); empty skips it.")
  flags.DEFINE_list("startup_all_reduce", ["add_n", "collective"], "Its "
                    "all_reduce algorithms.")
  flags.DEFINE_integer("startup_batch", 64, "Its global batch: small, so "
                       "that a fixed cost per step shows.")
  flags.DEFINE_integer("startup_rounds", 30, "Its interleaved rounds: the "
                       "difference sought is small.")
  flags.DEFINE_boolean("across_workers", True, "Time 2 workers x 2 towers "
                       "on loopback (a parameter-server cluster and a "
                       "collective one, each task a process) against 1 "
                       "worker x 4 towers, last (benchmarks/"
                       "across_workers.py); --noacross_workers skips it, "
                       "in a quick run too.")
  flags.DEFINE_enum("across_workers_workload", "mnist", ["mnist", "cifar10"],
                    "The model trained across workers.")
  flags.DEFINE_integer("across_workers_batch", 64, "Batch per tower across "
                       "workers (the global batch is 4 times it in all "
                       "three).")
  flags.DEFINE_integer("warmup", 3, "Untimed steps per variant.")
  flags.DEFINE_integer("rounds", 10, "Interleaved rounds.")
  flags.DEFINE_integer("steps", 3, "Timed steps per variant per round.")
  flags.DEFINE_list("averaging_shape", ["4", "8", str(4 * 1024 * 1024)],
                    "Towers, variables, floats per variable of the "
                    "average_gradients benchmark; empty skips it.")
  flags.DEFINE_integer("averaging_rounds", 10, "Its interleaved rounds.")
  flags.DEFINE_list("averaging_peak_towers", ["2", "8"], "Further tower "
                    "counts at which only its peak memory is measured.")
  flags.DEFINE_list("build_towers", ["1", "2", "4", "8"], "Tower counts of "
                    "the graph build benchmark; empty skips it.")
  flags.DEFINE_integer("build_repeats", 5, "Builds per tower count.")
  flags.DEFINE_list("large_build_towers", ["1", "2", "4", "8"], "Tower "
                    "counts of the large model's build (BERT-base-sized, "
                    "one copy and replicated ring); empty skips it.")
  flags.DEFINE_integer("large_build_repeats", 3, "Its builds per variant "
                       "and tower count.")
  flags.DEFINE_float("max_foreign_cores", 0.25, "A timed round during "
                     "which other processes kept more cores busy than this "
                     "is repeated once they are quiet (see "
                     "--quiet_wait_minutes).")
  flags.DEFINE_float("quiet_wait_minutes", 30, "The most a run waits for "
                     "other processes in all; after that, disturbed rounds "
                     "are kept (and counted). --quick never waits.")
  flags.DEFINE_boolean("chart", True, "Draw the chart if matplotlib is "
                       "installed.")


if __name__ == "__main__":
  define_flags()
  app.run(main)
