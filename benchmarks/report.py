"""Targets, the markdown tables, the JSON file and the chart."""

import json
import math
import os
import statistics
from typing import Dict, List, Optional, Sequence, Tuple

from absl import logging
import numpy as np

from benchmarks import graphs
from benchmarks import quiet
from benchmarks import traffic
from benchmarks import transformer

# The targets: towers against plain, one tower and several.
ONE_TOWER_RATIO = 0.97
MANY_TOWERS_RATIO = 0.90
# "Clearly less peak memory" than the original's, made a number: at least
# 20% less.
PEAK_MEMORY_RATIO = 0.80
# Linear build time: in the largest build, the later towers may cost at
# most this much more than the earlier ones (each tower's model and
# gradients, timed inside one build, so machine drift between builds does
# not enter).
BUILD_TOWER_GROWTH = 1.25
# The large model's build (`benchmarks.transformer`) at its largest count:
# replicated with the ring at most this many times the one-copy build.
LARGE_BUILD_RATIO = 1.5
# Synchronized batch norm against per-tower batch norm, at every count: at
# most this many times the step time, and the ops.
SYNC_BN_TIME_RATIO = 1.2
SYNC_BN_OPS_RATIO = 2.0
# The replicated mode's: replicated with the ring or the
# collective all-reduce against the one-copy "cpu" mode, and every mode of
# towers against independent towers (a copy each, nothing exchanged), at
# the same number of towers.
REPLICATED_RATIO = 0.95
INDEPENDENT_RATIO = 0.95
MODES = (graphs.TOWERS, graphs.BALANCED) + tuple(graphs.REPLICATED)
RINGS = (graphs.REPLICATED_RING, graphs.REPLICATED_COLLECTIVE)
# Bytes through the busiest device per step, from this many towers on: a
# ring at most this share of the "cpu" mode's.
BYTES_RATIO = 0.5
BYTES_MIN_TOWERS = 4
# Every variant's measured bytes through its busiest device within this
# share of the figure its design predicts.
TRAFFIC_TOLERANCE = 0.10
# Gradient packing's targets: each packed row against its
# unpacked twin (pack_bytes=0) at the same number of towers. On the model of
# many small variables, from PACKED_MIN_TOWERS towers on, packing must pay,
# in the "cpu" mode and replicated with add_n and the collective; and its
# packed rows must send no more tensors through their busiest device than
# the design predicts (one per pack where there was one per gradient).
PACKED_RATIO = 1.15
PACKED_WORKLOAD = "many_small"
PACKED_MIN_TOWERS = 4
PACKED_MODES = (graphs.TOWERS, graphs.REPLICATED_ADD_N,
                graphs.REPLICATED_COLLECTIVE)
# On the CNNs, whose few small gradients (biases, a small kernel) the
# default packs, packing must not cost: at these tower counts, in the "cpu"
# mode and replicated with add_n.
PACKED_DEFAULT_RATIO = 0.98
PACKED_DEFAULT_WORKLOADS = ("mnist", "cifar10")
PACKED_DEFAULT_TOWERS = (2, 4)
PACKED_DEFAULT_MODES = (graphs.TOWERS, graphs.REPLICATED_ADD_N)
# The fast paths': staged inputs cost at most 5% against the
# same tf.data input unstaged, at 2 towers and more (on CPU there is nothing
# to gain: the devices share memory).
STAGED_RATIO = 0.95
STAGED_MIN_TOWERS = 2
# Gradient accumulation's, at each tower count, the largest k against k=1
# at the same micro-batch per tower (replicated): the bytes per example
# exactly 1/k of k=1's (counts, so exact: the update's reduction is the
# only traffic, once per k micro-batches), and the examples/sec at least
# this share of k=1's (accumulating must not cost what it saves).
ACCUMULATION_SPEED_RATIO = 0.95
# The bytes ratio's tolerance: float rounding of a ratio of exact counts.
ACCUMULATION_BYTES_REL_TOL = 1e-9
# The replicated copies' start-up check (`benchmarks.startup`), at every
# all-reduce and tower count: the gated step against its ungated twin costs
# nothing measurable. Met unless the gated step is both measurably slower
# (the 95% interval of the step-time ratio above 1.0) and more than 1%
# slower (the medians' ratio above this).
STARTUP_RATIO = 1.01
# The process peak (resident memory) must see at least this share of the
# tensors the step allocates at once; below it, resident memory does not
# follow the tensors on this machine, and the measure is unavailable.
PROCESS_VISIBLE_FRACTION = 0.5

MIB = float(1 << 20)
QUICK_NOTE = ("Quick run (--quick): a few steps on tiny batches, to check that "
              "everything runs; these numbers are not measurements. quick "
              "run: no verdicts.")


def step_stats(times: Sequence[float]) -> Dict[str, object]:
  """Returns the median and quartiles of step times, and the times."""
  q1, median, q3 = statistics.quantiles(times, n=4, method="inclusive")
  return {"median_step_sec": median, "q1_step_sec": q1, "q3_step_sec": q3,
          "steps_timed": len(times), "step_seconds": list(times)}


def timed_graph(times: Sequence[float], global_batch: int,
                num_ops: int) -> Dict[str, object]:
  """`step_stats` of a graph's step times, with its examples/sec (the
  global batch over the median step) and its op count."""
  stats = step_stats(times)
  return {**stats, "examples_per_sec": global_batch / stats["median_step_sec"],
          "num_ops": num_ops}


def _target(name: str, met: bool, detail: str) -> Dict[str, object]:
  return {"target": name, "met": bool(met), "detail": detail}


def ratio_interval(row: Dict[str, object], reference: Dict[str, object],
                   resamples: int = 2000) -> Tuple[float, float]:
  """Returns a 95% bootstrap interval of row's speed over reference's.

  The speed ratio is the reference's median step time over the row's; both
  sets of step times are resampled with replacement (as if independent,
  which interleaving makes nearly so), seeded so that runs repeat.
  """
  rng = np.random.RandomState(0)
  mine = np.asarray(row["step_seconds"])
  theirs = np.asarray(reference["step_seconds"])
  ratios = (np.median(rng.choice(theirs, (resamples, theirs.size)), axis=1)
            / np.median(rng.choice(mine, (resamples, mine.size)), axis=1))
  low, high = np.percentile(ratios, [2.5, 97.5])
  return float(low), float(high)


def _ratio_detail(ratio: float, interval: Tuple[float, float],
                  threshold: float) -> str:
  low, high = interval
  noise = ", within noise" if low <= threshold <= high else ""
  return "%.3fx [%.3f, %.3f]%s" % (ratio, low, high, noise)


def _speed_target(row: Dict[str, object], reference: Dict[str, object],
                  need: float) -> Dict[str, object]:
  ratio = row["examples_per_sec"] / reference["examples_per_sec"]
  return _target(">= %.2fx %s" % (need, reference["variant"]), ratio >= need,
                 _ratio_detail(ratio, ratio_interval(row, reference), need))


def throughput_targets(rows: List[Dict[str, object]]) -> None:
  """Adds each row's targets (``row["targets"]``) in place.

  A speed target is met or not by the medians. Each detail gives the ratio
  with its 95% bootstrap interval (`ratio_interval`), and says "within
  noise" where that interval holds the threshold. The traffic targets
  (`traffic_targets`) are counts, not timings: no interval.
  """
  by_key = {(r["variant"], r["num_towers"]): r for r in rows}
  plain = by_key[(graphs.PLAIN, 1)]
  for row in rows:
    row["targets"] = []
    variant, n = row["variant"], row["num_towers"]
    if variant in (graphs.TOWERS, graphs.BALANCED):
      need = ONE_TOWER_RATIO if n == 1 else MANY_TOWERS_RATIO
      row["targets"].append(_target(
          ">= %.2fx plain" % need, row["ratio_to_plain"] >= need,
          _ratio_detail(row["ratio_to_plain"], ratio_interval(row, plain),
                        need)))
      for other in (graphs.ORIGINAL, graphs.MIRRORED):
        rival = by_key.get((other, n))
        if rival is None:
          continue
        speedup = row["examples_per_sec"] / rival["examples_per_sec"]
        row["targets"].append(_target(
            "faster than %s" % other, speedup > 1.0,
            _ratio_detail(speedup, ratio_interval(row, rival), 1.0)))
    one_copy = by_key.get((graphs.TOWERS, n))
    if variant in RINGS and one_copy:
      row["targets"].append(_speed_target(row, one_copy, REPLICATED_RATIO))
    independent = by_key.get((graphs.INDEPENDENT, n))
    if variant in MODES and n > 1 and independent:
      row["targets"].append(_speed_target(row, independent,
                                          INDEPENDENT_RATIO))
    row["targets"] += traffic_targets(row, one_copy)


def traffic_targets(row: Dict[str, object],
                    one_copy: Optional[Dict[str, object]]
                   ) -> List[Dict[str, object]]:
  """Returns a row's targets on the bytes that cross between devices.

  Every measured row: the bytes through its busiest device within
  `TRAFFIC_TOLERANCE` of the expected figure. The ring and collective rows
  from `BYTES_MIN_TOWERS` towers on: at most `BYTES_RATIO` of the bytes
  through the "cpu" mode's (`one_copy`) busiest device.
  """
  moved = row.get("traffic")
  if not moved:
    return []
  targets = []
  if row["variant"] in RINGS and row["num_towers"] >= BYTES_MIN_TOWERS and (
      one_copy and one_copy.get("traffic")):
    theirs = one_copy["traffic"]["busiest_bytes"]
    ratio = moved["busiest_bytes"] / theirs if theirs else float("inf")
    targets.append(_target(
        "busiest device's bytes <= %.2fx towers'" % BYTES_RATIO,
        ratio <= BYTES_RATIO, "%.1f vs %.1f MiB: %.2fx" % (
            moved["busiest_bytes"] / MIB, theirs / MIB, ratio)))
  error = traffic.relative_error(moved["busiest_bytes"],
                                 moved["expected_busiest_bytes"])
  targets.append(_target(
      "bytes within %d%% of expected" % round(100 * TRAFFIC_TOLERANCE),
      abs(error) <= TRAFFIC_TOLERANCE, "%s %.1f MiB, expected %.1f MiB: %s"
      % (moved["busiest_device"], moved["busiest_bytes"] / MIB,
         moved["expected_busiest_bytes"] / MIB, _percent(error))))
  return targets


def _percent(error: float) -> str:
  return "%+.1f%%" % (100 * error) if error != float("inf") else "expected 0"


def packing_pairs(rows: List[Dict[str, object]]
                 ) -> List[Tuple[Dict[str, object], Dict[str, object]]]:
  """Returns ``(packed row, unpacked row)`` of each twin timed, in order."""
  by_key = {(r["variant"], r["num_towers"]): r for r in rows}
  pairs = []
  for unpacked, packed in graphs.UNPACKED.items():
    for n in sorted({r["num_towers"] for r in rows}):
      if (packed, n) in by_key and (unpacked, n) in by_key:
        pairs.append((by_key[(packed, n)], by_key[(unpacked, n)]))
  return pairs


def packing_targets(workload: Dict[str, object]) -> None:
  """Adds a workload's packing targets to its packed rows, in place.

  The speed targets are `_speed_target`s against the unpacked twin; the
  tensors target is a count (no interval): the tensors through the packed
  row's busiest device at most the expected figure's busiest device's.
  """
  name = workload["workload"]
  for row, twin in packing_pairs(workload["rows"]):
    variant, n = row["variant"], row["num_towers"]
    targets = []
    if (name == PACKED_WORKLOAD and n >= PACKED_MIN_TOWERS
        and variant in PACKED_MODES):
      targets.append(_speed_target(row, twin, PACKED_RATIO))
      moved = row.get("traffic")
      if moved:
        targets.append(_target(
            "busiest device's tensors <= expected",
            moved["busiest_tensors"] <= moved["expected_busiest_tensors"],
            "%s %d, expected %d; unpacked %d" % (
                moved["busiest_tensors_device"], moved["busiest_tensors"],
                moved["expected_busiest_tensors"],
                twin["traffic"]["busiest_tensors"] if twin.get("traffic")
                else 0)))
    elif (name in PACKED_DEFAULT_WORKLOADS and n in PACKED_DEFAULT_TOWERS
          and variant in PACKED_DEFAULT_MODES):
      targets.append(_speed_target(row, twin, PACKED_DEFAULT_RATIO))
    # Marked, so that the packing section lists them apart.
    row["targets"] += [dict(t, packing=True) for t in targets]


def process_unavailable(measured: Dict[str, object]) -> Optional[str]:
  """Returns why one step's process peak is no measurement, or None.

  The process peak (resident set size) can only be trusted where it sees the
  step's tensors: where it reads far less than the tensors TensorFlow
  recorded alive at once, resident memory does not follow them on this
  machine (a sandboxed or unusual kernel), and any ratio of it is noise.
  """
  if not measured.get("rss_peak_reset", True):
    return ("the kernel refused to reset the peak resident size "
            "(/proc/self/clear_refs)")
  rss, tensors = measured["rss_peak_extra_bytes"], measured["tensor_peak_bytes"]
  if rss < PROCESS_VISIBLE_FRACTION * tensors:
    return ("a process peak of %.2f MiB for a step whose tensors peak at "
            "%.2f MiB: resident memory does not show the step's tensors"
            % (rss / MIB, tensors / MIB))
  return None


def process_measure(result: Dict[str, object]) -> None:
  """Decides whether the averaging's process peaks are measurements.

  Sets ``result["process_unavailable"]``: None where every measured step's
  process peak sees its tensors (`process_unavailable`), else why not; then
  the process column is reported as unavailable and gives no verdict.
  """
  steps = [result["towers"], result["original"]]
  for peak in result["peaks_by_towers"]:
    steps += [peak["towers"], peak["original"]]
  reasons = [r for r in map(process_unavailable, steps) if r]
  result["process_unavailable"] = reasons[0] if reasons else None


def averaging_targets(result: Dict[str, object]) -> None:
  """Adds the averaging targets to `result` in place.

  The peak memory verdict comes from the tensors, and from the process too
  where that measure is available (`process_measure`).
  """
  ours, theirs = result["towers"], result["original"]
  time_ratio = ours["median_step_sec"] / theirs["median_step_sec"]
  tensor_ratio = ours["tensor_peak_bytes"] / theirs["tensor_peak_bytes"]
  result["time_ratio"] = time_ratio
  result["tensor_peak_ratio"] = tensor_ratio
  if result.get("process_unavailable"):
    rss_ratio = None
    memory_met = tensor_ratio <= PEAK_MEMORY_RATIO
    detail = "tensors %.2fx; process: unavailable on this machine (%s)" % (
        tensor_ratio, result["process_unavailable"])
  else:
    rss_ratio = ours["rss_peak_extra_bytes"] / theirs["rss_peak_extra_bytes"]
    memory_met = (tensor_ratio <= PEAK_MEMORY_RATIO
                  and rss_ratio <= PEAK_MEMORY_RATIO)
    detail = "tensors %.2fx, process %.2fx" % (tensor_ratio, rss_ratio)
  result["rss_peak_ratio"] = rss_ratio
  result["targets"] = [
      _target("time <= original's", time_ratio <= 1.0,
              "%.2fx the original's" % time_ratio),
      _target("peak memory <= %.2fx original's" % PEAK_MEMORY_RATIO,
              memory_met, detail),
  ]


def build_targets(result: Dict[str, object]) -> None:
  """Adds the build-time target to `result` in place."""
  growth = result["tower_cost_growth"]
  result["targets"] = [_target(
      "build time linear in towers (later towers cost <= %.2fx the earlier)"
      % BUILD_TOWER_GROWTH, growth <= BUILD_TOWER_GROWTH,
      "later/earlier tower cost %.2fx in the %d-tower build; increments "
      "per added tower spread %.2fx (time), %.2fx (ops)"
      % (growth, result["rows"][-1]["num_towers"], result["time_spread"],
         result["ops_spread"]))]


def large_build_targets(result: Dict[str, object]) -> None:
  """Adds the large model's build targets to `result` in place: the ring's
  build over one copy's at the largest count, and each linear in towers."""
  variants = result["variants"]
  one_copy = variants[transformer.ONE_COPY]
  ring = variants[transformer.RING]
  ratio = ring["rows"][-1]["seconds"] / one_copy["rows"][-1]["seconds"]
  result["targets"] = [_target(
      "replicated ring build <= %.2fx one copy's at %d towers"
      % (LARGE_BUILD_RATIO, ring["rows"][-1]["num_towers"]),
      ratio <= LARGE_BUILD_RATIO, "%.3fx: %.1f vs %.1f s, %d vs %d ops" % (
          ratio, ring["rows"][-1]["seconds"], one_copy["rows"][-1]["seconds"],
          ring["rows"][-1]["ops"], one_copy["rows"][-1]["ops"]))]
  for name, variant in (("one copy", one_copy), ("replicated ring", ring)):
    growth = variant["tower_cost_growth"]
    result["targets"].append(_target(
        "%s build linear in towers (later towers cost <= %.2fx the earlier)"
        % (name, BUILD_TOWER_GROWTH), growth <= BUILD_TOWER_GROWTH,
        "later/earlier tower cost %.2fx; increments per added tower spread "
        "%.2fx (time), %.2fx (ops)" % (growth, variant["time_spread"],
                                       variant["ops_spread"])))


def batch_norm_targets(section: Dict[str, object]) -> None:
  """Adds synchronized batch norm's targets to each row in place: its step
  time (by the medians, with the interval) and its ops over per-tower's."""
  for row in section["rows"]:
    ops = row["sync"]["num_ops"] / row["per_tower"]["num_ops"]
    # The interval is of per-tower's speed over sync's: the time ratio.
    row["targets"] = [
        _target("step time <= %.2fx per-tower's" % SYNC_BN_TIME_RATIO,
                row["step_time_ratio"] <= SYNC_BN_TIME_RATIO,
                _ratio_detail(row["step_time_ratio"],
                              tuple(row["ratio_interval"]),
                              SYNC_BN_TIME_RATIO)),
        _target("ops <= %.2fx per-tower's" % SYNC_BN_OPS_RATIO,
                ops <= SYNC_BN_OPS_RATIO, "%.3fx: %d vs %d" % (
                    ops, row["sync"]["num_ops"],
                    row["per_tower"]["num_ops"]))]


def fast_paths_targets(section: Dict[str, object]) -> None:
  """Adds the staging target to each staging row in place.

  Staged examples/sec over unstaged, met or not by the medians; the detail
  gives the ratio with its 95% bootstrap interval. The precision rows have
  no target.
  """
  for row in section.get("staging", {}).get("rows", []):
    row["targets"] = []
    if row["num_towers"] >= STAGED_MIN_TOWERS:
      row["targets"].append(_target(
          "staged >= %.2fx unstaged" % STAGED_RATIO,
          row["ratio"] >= STAGED_RATIO,
          _ratio_detail(row["ratio"], tuple(row["ratio_interval"]),
                        STAGED_RATIO)))


def accumulation_targets(section: Dict[str, object]) -> None:
  """Adds gradient accumulation's targets to each comparison in place.

  The bytes target is a count (no interval): bytes per example at the
  largest k over k=1's equal to 1/k. The speed target is met or not by the
  medians; its detail gives the ratio with its 95% bootstrap interval.
  """
  for entry in section.get("comparisons", []):
    k = entry["accumulate_steps"]
    want = entry["expected_bytes_ratio"]
    entry["targets"] = [
        _target("bytes per example at k=%d = %.2fx k=1's" % (k, want),
                math.isclose(entry["bytes_ratio"], want,
                             rel_tol=ACCUMULATION_BYTES_REL_TOL),
                "%.4fx: %s vs %s KiB per example" % (
                    entry["bytes_ratio"],
                    _kib(entry["bytes_per_example"]),
                    _kib(entry["bytes_per_example_k1"]))),
        _target("examples/sec at k=%d >= %.2fx k=1's"
                % (k, ACCUMULATION_SPEED_RATIO),
                entry["speed_ratio"] >= ACCUMULATION_SPEED_RATIO,
                _ratio_detail(entry["speed_ratio"],
                              tuple(entry["speed_interval"]),
                              ACCUMULATION_SPEED_RATIO))]


def startup_targets(section: Dict[str, object]) -> None:
  """Adds the start-up check's target to each row in place: the gated
  step time over the ungated one at most `STARTUP_RATIO`, or within noise
  of 1.0 (its 95% bootstrap interval holds 1.0)."""
  for row in section["rows"]:
    ratio = row["step_time_ratio"]
    low, high = row["ratio_interval"]
    row["targets"] = [_target(
        "start-up check costs nothing measurable (gated/ungated step time "
        "<= %.2fx, or its interval holds 1.0)" % STARTUP_RATIO,
        ratio <= STARTUP_RATIO or low <= 1.0 <= high,
        _ratio_detail(ratio, (low, high), 1.0))]


def add_targets(results: Dict[str, object]) -> None:
  """Gives every target its verdict, or none in a quick run.

  A quick run's few steps on tiny batches are not measurements, so it gets
  no verdicts: every ``targets`` list stays empty.
  """
  averaging = results.get("average_gradients")
  build = results.get("build")
  large = results.get("large_build")
  bn_rows = (results.get("batch_norm") or {}).get("rows", [])
  staging = results.get("fast_paths", {}).get("staging", {}).get("rows", [])
  accumulation = results.get("accumulation")
  startup_rows = (results.get("startup") or {}).get("rows", [])
  if results.get("quick"):
    sections = [row for workload in results["throughput"]
                for row in workload["rows"]] + [
                    s for s in (averaging, build, large) if s] + staging
    sections += bn_rows
    sections += (accumulation or {}).get("comparisons", [])
    sections += startup_rows
    for section in sections:
      section["targets"] = []
  else:
    for workload in results["throughput"]:
      throughput_targets(workload["rows"])
      packing_targets(workload)
    if averaging:
      averaging_targets(averaging)
    if build:
      build_targets(build)
    if large:
      large_build_targets(large)
    if results.get("batch_norm"):
      batch_norm_targets(results["batch_norm"])
    if results.get("fast_paths"):
      fast_paths_targets(results["fast_paths"])
    if accumulation:
      accumulation_targets(accumulation)
    if results.get("startup"):
      startup_targets(results["startup"])
  results["targets"] = summary(results)


def _met(targets: List[Dict[str, object]]) -> str:
  if not targets:
    return "-"
  return "; ".join("%s: %s (%s)" % (t["target"],
                                    "met" if t["met"] else "**not met**",
                                    t["detail"]) for t in targets)


def _rounds_line(rounds) -> str:
  """The line under a section's table: what else ran, rounds repeated."""
  return "Other processes during the kept rounds: %s; rounds repeated: %d." % (
      quiet.describe(rounds["foreign_cores"]), rounds["repeated_rounds"])


def _targets_line(results: Dict[str, object],
                  targets: List[Dict[str, object]]) -> str:
  if results.get("quick"):
    return "Targets: quick run: no verdicts."
  return "Targets: " + _met(targets)


def _process_mib(row: Dict[str, object], unavailable: Optional[str]) -> str:
  if unavailable:
    return "unavailable"
  return "%.0f" % (row["rss_peak_extra_bytes"] / MIB)


def _traffic_note(parameter_bytes: int) -> str:
  return (
      "Bytes that cross between devices in one step, in MiB, for the "
      "parameters (variables, gradients, their sums; P = %s MiB); through a "
      "device = sent + received. Counted from the step's partition graphs, "
      "each `_Send` between two devices sized by its tensor's static shape "
      "and dtype; the all-reduces of the rows marked * are collective ops, "
      "which are no sends: counted from their ring algorithm (each device "
      "sends 2(N-1)/N of each tensor and receives as much). The input "
      "shards that /cpu:0 sends the towers are counted apart (last column), "
      "as are control edges (no bytes). Expected: each variable's device "
      "sends it to the N-1 other towers and receives their N-1 gradients "
      "(towers, towers_balanced, original, replicated_add_n: 2(N-1)P "
      "through /cpu:0, tower 0's device here; 2NP where no tower shares "
      "it); 2(N-1)/N P each way per device (ring, collective); nothing "
      "(plain, independent). With packing (all but the _unpacked rows, "
      "plain, independent and original), the gradients of at most "
      "pack_bytes of one device and dtype cross as one pack: the same "
      "bytes in fewer tensors, which the expected tensors count (the "
      "towers' reads stay one per variable). Counts, not timings: a GPU "
      "machine moves the same bytes." % _mib(parameter_bytes))


def _mib(size: float) -> str:
  return "%.1f" % (size / MIB)


def _busiest(moved: Optional[Dict[str, object]]) -> str:
  if not moved:
    return "-"
  return "%s %s (%s)" % (moved["busiest_device"],
                         _mib(moved["busiest_bytes"]),
                         _mib(moved["expected_busiest_bytes"]))


def traffic_markdown(workload: Dict[str, object]) -> List[str]:
  """Returns a workload's table of the bytes its variants move per step."""
  rows = [r for r in workload["rows"] if r.get("traffic")]
  if not rows:
    return []
  lines = [_traffic_note(rows[0]["traffic"]["parameter_bytes"]), "",
           "| variant | towers | examples/sec | busiest device, MiB through "
           "it (expected) | per device: MiB sent / received (expected) | "
           "tensors sent per device (expected) | input MiB (tensors) |",
           "|---|---:|---:|---|---|---|---:|"]
  for row in rows:
    moved = row["traffic"]
    devices = moved["devices"]
    per_device = "; ".join(
        "%s %s / %s (%s / %s)" % (d, _mib(f["sent_bytes"]),
                                  _mib(f["received_bytes"]),
                                  _mib(f["expected_sent_bytes"]),
                                  _mib(f["expected_received_bytes"]))
        for d, f in devices.items())
    tensors = "; ".join("%s %d (%d)" % (d, f["sent_tensors"],
                                        f["expected_sent_tensors"])
                        for d, f in devices.items())
    lines.append("| %s%s | %d | %.1f | %s | %s | %s | %s (%d) |" % (
        row["variant"], " *" if moved["collectives"] else "",
        row["num_towers"], row["examples_per_sec"], _busiest(moved),
        per_device, tensors, "%.2f" % (moved["input_bytes"] / MIB),
        moved["input_tensors"]))
  unsized = sorted({n for r in rows for n in r["traffic"]["unsized"]})
  lines.append("")
  if unsized:
    lines += ["Sent tensors of unknown size, in no count: %s."
              % ", ".join(unsized), ""]
  if any(r["variant"] == graphs.MIRRORED for r in workload["rows"]):
    lines += ["mirrored: not counted (its all-reduce runs inside "
              "tf.function, in a worker process).", ""]
  return lines


def _tensors(moved: Optional[Dict[str, object]], key: str) -> str:
  """A tensor count beside its expected figure: ``"603 (603)"``."""
  if not moved:
    return "-"
  return "%d (%d)" % (moved[key], moved["expected_" + key])


def _collectives(moved: Optional[Dict[str, object]]) -> str:
  if not moved or moved.get("expected_collectives") is None:
    return "-"
  return "%d (%d)" % (moved["collectives"], moved["expected_collectives"])


def packing_markdown(results: Dict[str, object]) -> List[str]:
  """Returns the packing section: each packed row against its twin."""
  quick = results.get("quick")
  pairs = [(workload, row, twin) for workload in results["throughput"]
           for row, twin in packing_pairs(workload["rows"])]
  if not pairs:
    return []
  pack_bytes = sorted({row["traffic"]["pack_bytes"] for _, row, _ in pairs
                       if row.get("traffic")})
  lines = ["### Gradient packing: packed against pack_bytes=0%s" % (
      " (quick run)" if quick else ""), "",
           "Each packed row (the library's default pack_bytes, %s) "
           "against its unpacked twin (pack_bytes=0), the same graph "
           "otherwise, timed in the same rounds: packed examples/sec over "
           "unpacked, with its 95%% bootstrap interval. Tensors: the "
           "parameters' tensors that cross between devices in one step, "
           "through the busiest device (sent + received) and in all (each "
           "once), measured (expected: one per pack where there was one per "
           "gradient; the towers' reads stay one per variable per tower). "
           "Collectives: the collective ops of the step, measured "
           "(expected: one per pack per device)."
           % ", ".join(_size(b) for b in pack_bytes), "",
           "| workload | mode | towers | packed / unpacked examples/sec | "
           "busiest device's tensors, packed (expected) | unpacked "
           "(expected) | tensors in all, packed (expected) | unpacked "
           "(expected) | collectives, packed (expected) | unpacked "
           "(expected) |" + ("" if quick else " targets |"),
           "|---|---|---:|---:|---|---|---:|---:|---:|---:|"
           + ("" if quick else "---|")]
  for workload, row, twin in pairs:
    ratio = row["examples_per_sec"] / twin["examples_per_sec"]
    low, high = ratio_interval(row, twin)
    moved, theirs = row.get("traffic"), twin.get("traffic")
    busiest = "-"
    if moved:
      busiest = "%s %s" % (moved["busiest_tensors_device"],
                           _tensors(moved, "busiest_tensors"))
    line = "| %s | %s | %d | %.3fx [%.3f, %.3f] | %s | %s | %s | %s | %s | " \
        "%s |" % (workload["workload"], row["variant"], row["num_towers"],
                  ratio, low, high, busiest,
                  _tensors(theirs, "busiest_tensors"),
                  _tensors(moved, "tensors"), _tensors(theirs, "tensors"),
                  _collectives(moved), _collectives(theirs))
    if not quick:
      line += " %s |" % _met([t for t in row["targets"]
                              if t.get("packing")])
    lines.append(line)
  lines.append("")
  if quick:
    lines += [_targets_line(results, []), ""]
  return lines


def sweep_markdown(results: Dict[str, object]) -> List[str]:
  """Returns the pack_bytes sweep's table: packed against not, by size."""
  sweep = results.get("packing_sweep")
  if not sweep:
    return []
  quick = results.get("quick")
  lines = ["### pack_bytes sweep: %d towers, variables on /cpu:0, global "
           "batch %d%s" % (sweep["num_towers"], sweep["global_batch"],
                           " (quick run)" if quick else ""), "",
           "Layers h = tanh(h * scale + offset) with a scale and an offset "
           "of S bytes each (float32), about the same parameter bytes at "
           "every size; packed (pack_bytes = S: every gradient in one pack) "
           "against unpacked (pack_bytes=0), in interleaved rounds. The "
           "measurement the default pack_bytes rests on; no target.", "",
           "| tensor size | variables | parameters MiB | packed step ms "
           "(median [q1, q3]) | unpacked step ms (median [q1, q3]) | packed "
           "/ unpacked examples/sec | tensors in all, packed / unpacked "
           "(expected) |",
           "|---:|---:|---:|---:|---:|---:|---|"]
  for row in sweep["rows"]:
    packed, unpacked = row["packed"], row["unpacked"]
    low, high = row["ratio_interval"]
    lines.append(
        "| %s | %d | %.2f | %.1f [%.1f, %.1f] | %.1f [%.1f, %.1f] | "
        "%.3fx [%.3f, %.3f] | %d (%d) / %d (%d) |" % (
            _size(row["size_bytes"]), row["num_variables"],
            row["parameter_bytes"] / MIB, 1e3 * packed["median_step_sec"],
            1e3 * packed["q1_step_sec"], 1e3 * packed["q3_step_sec"],
            1e3 * unpacked["median_step_sec"], 1e3 * unpacked["q1_step_sec"],
            1e3 * unpacked["q3_step_sec"], row["ratio"], low, high,
            packed["tensors"], packed["expected_tensors"],
            unpacked["tensors"], unpacked["expected_tensors"]))
  lines += ["", _rounds_line(sweep["rounds"]), ""]
  return lines


def large_build_markdown(results: Dict[str, object]) -> List[str]:
  """Returns the large model's build: each variant at each tower count."""
  section = results.get("large_build")
  if not section:
    return []
  lines = ["### Graph build of a large model: %s, median of %d%s" % (
      section["title"], section["repeats"],
      " (quick run)" if results.get("quick") else ""), "",
           "The whole training step (Adam, clipped to global norm 1, a "
           "global step) on one device (tf.gradients and "
           "opt.apply_gradients), with towers.minimize and one copy of the "
           "variables on /cpu:0, and replicated with the ring all-reduce, "
           "each in a fresh graph, builds interleaved. Per tower: the time "
           "from each tower's model to the next one's (its model and "
           "gradients), tower 0 to n-2.", "",
           "| variant | towers | build s | ops | ops per tower | s per tower |",
           "|---|---:|---:|---:|---:|---|"]
  for name, variant in section["variants"].items():
    for row in variant["rows"]:
      lines.append("| %s | %d | %.2f | %d | %.0f | %s |" % (
          name, row["num_towers"], row["seconds"], row["ops"],
          row["ops_per_tower"],
          " ".join("%.2f" % t for t in row["tower_seconds"]) or "-"))
  lines += ["", "Other processes during the builds: %.2f cores." % section[
      "foreign_cores"], "",
            _targets_line(results, section.get("targets", [])), ""]
  return lines


def batch_norm_markdown(results: Dict[str, object]) -> List[str]:
  """Returns the batch-norm comparison: synchronized against per-tower."""
  section = results.get("batch_norm")
  if not section:
    return []
  quick = results.get("quick")
  channels = section["bn_channels"]
  per_tower = section["per_tower"]
  fallback = section.get("per_tower_reason")
  lines = ["### Synchronized batch norm against per-tower: %s, global batch "
           "%d%s" % (section["title"], section["global_batch"],
                     " (quick run)" if quick else ""), "",
           "The same model trained with towers.minimize (variables on "
           "/cpu:0), its %d batch-norm layers (%s channels) either "
           "towers.batch_normalization(training=True), which sums each "
           "layer's count, sum and sum of squares (1 + 2C floats) across "
           "the towers forward and the sums of dy and dy * xhat (2C floats) "
           "in the gradient (between GPUs, one collective op per tower each "
           "time; between CPU devices, on the first tower's device), or %s "
           "(per tower: each shard normalized alone, nothing exchanged), "
           "timed in the same rounds. Step time ratio: the synchronized "
           "median over the per-tower one (above 1: what exactness costs), "
           "with its 95%% bootstrap interval. "
           "Collectives: the collective ops of one step, measured from its "
           "partition graphs (expected: 2 per layer per tower on GPUs, none "
           "between CPU devices). Sum bytes: what the synchronized step "
           "sends and receives through its busiest device beyond the "
           "per-tower step, measured (expected from the layer shapes, S = "
           "sum(1 + 4C) x 4 bytes per tower: 2(N-1) S through the first "
           "tower's device; a ring's 4(N-1)/N S between GPUs)."
           % (len(channels), ", ".join(str(c) for c in channels),
              per_tower), "",
           "| towers | sync step ms (median [q1, q3]) | per-tower step ms "
           "(median [q1, q3]) | sync / per-tower step time | ops, sync / "
           "per-tower | collectives per step (expected) | sum bytes "
           "through the busiest device per step (expected) | per-tower "
           "layer |",
           "|---:|---:|---:|---:|---|---:|---:|---|"]
  for row in section["rows"]:
    sync, alone, want = row["sync"], row["per_tower"], row["expected"]
    low, high = row["ratio_interval"]
    lines.append(
        "| %d | %.1f [%.1f, %.1f] | %.1f [%.1f, %.1f] | %.3fx [%.3f, %.3f] "
        "| %d / %d | %d (%d) | %.0f (%.0f) | %s |" % (
            row["num_towers"], 1e3 * sync["median_step_sec"],
            1e3 * sync["q1_step_sec"], 1e3 * sync["q3_step_sec"],
            1e3 * alone["median_step_sec"], 1e3 * alone["q1_step_sec"],
            1e3 * alone["q3_step_sec"], row["step_time_ratio"], low, high,
            sync["num_ops"], alone["num_ops"], sync["collectives"],
            want["collectives"], max(row["sum_bytes"].values(), default=0),
            want["busiest_bytes"],
            per_tower + (" (fallback)" if fallback else "")))
  lines.append("")
  if fallback:
    lines += ["Per-tower layer: %s; the per-tower rows use %s, the kernel "
              "tf.layers runs for 4-D inputs, with tf.layers' variables and "
              "moving-average updates." % (fallback, per_tower), ""]
  lines += [_rounds_line(section["rounds"]), ""]
  return lines


def _on_devices(devices: Dict[str, List[str]], cpu_caveat: str) -> str:
  """Says where the rows ran, and what that lets them show.

  `cpu_caveat` says why virtual CPU devices show overhead only.
  """
  listed = "; ".join("%s towers: %s" % (n, ", ".join(d))
                     for n, d in devices.items())
  if all("gpu" in d.lower() for names in devices.values() for d in names):
    return "On GPUs (%s): the rows show the fast paths' effect." % listed
  return ("On virtual CPU devices (%s): the rows show overhead only: %s. "
          "With enough GPUs the same rows run on them." % (listed,
                                                            cpu_caveat))


def _counted(side: Dict[str, object]) -> str:
  """MiB through the busiest device, and the sends that could not be sized.

  XLA's clusters send their outputs under names of their own, which the
  graph does not have (`traffic.count`): those are in no count.
  """
  unsized = len(side["unsized"])
  return _mib(side["busiest_bytes"]) + (
      " + %d tensors of unknown size" % unsized if unsized else "")


def _first_step(row: Dict[str, object]) -> str:
  ratio = row.get("first_step_ratio")
  return "%.2f%s" % (row["first_step_sec"],
                     " (%.2fx)" % ratio if ratio is not None else "")


def fast_paths_markdown(results: Dict[str, object]) -> List[str]:
  """Returns the fast paths' tables: staging, then precision and XLA."""
  section = results.get("fast_paths")
  if not section:
    return []
  quick = results.get("quick")
  title = " (quick run)" if quick else ""
  lines = []
  staging = section.get("staging")
  if staging:
    lines += ["### Fast paths: staged inputs against unstaged, global batch "
              "%d%s" % (staging["global_batch"], title), "",
              "towers.minimize (variables on /cpu:0) with stage_inputs=True "
              "against the same step without it, both reading the same "
              "synthetic batch through the same tf.data pipeline (in "
              "memory, repeated, batched per tower, prefetched; each tower "
              "calls iterator.get_next), timed in the same rounds; the "
              "staged step's reader is the graph's queue runner. Ratio: "
              "staged examples/sec over unstaged, with its 95% bootstrap "
              "interval. Input MiB: the batch bytes that cross between "
              "devices inside the timed step (the staged step's copies run "
              "in its reader's steps instead). Parameters: MiB through the "
              "busiest device per step (expected). " +
              _on_devices(staging["devices"], "the devices share host "
                          "memory, so a staged copy is one that was free"),
              "",
              "| workload | towers | staged step ms (median [q1, q3]) | "
              "unstaged step ms (median [q1, q3]) | staged / unstaged "
              "examples/sec | input MiB in the step, staged / unstaged | "
              "parameters MiB, staged / unstaged (expected) |"
              + ("" if quick else " targets |"),
              "|---|---:|---:|---:|---:|---:|---|" + ("" if quick else
                                                      "---|")]
    for row in staging["rows"]:
      staged, unstaged = row["staged"], row["unstaged"]
      low, high = row["ratio_interval"]
      line = ("| %s | %d | %.1f [%.1f, %.1f] | %.1f [%.1f, %.1f] | %.3fx "
              "[%.3f, %.3f] | %.2f / %.2f | %s / %s (%s) |" % (
                  row["workload"], row["num_towers"],
                  1e3 * staged["median_step_sec"],
                  1e3 * staged["q1_step_sec"], 1e3 * staged["q3_step_sec"],
                  1e3 * unstaged["median_step_sec"],
                  1e3 * unstaged["q1_step_sec"],
                  1e3 * unstaged["q3_step_sec"], row["ratio"], low, high,
                  staged["input_bytes"] / MIB, unstaged["input_bytes"] / MIB,
                  _counted(staged), _counted(unstaged),
                  _mib(unstaged["expected_busiest_bytes"])))
      if not quick:
        line += " %s |" % _met(row.get("targets", []))
      lines.append(line)
    lines += ["", _rounds_line(staging["rounds"]), ""]
    if quick:
      lines += [_targets_line(results, []), ""]
  precision = section.get("precision")
  if precision:
    lines += ["### Fast paths: mixed precision and XLA against float32, "
              "global batch %d%s" % (precision["global_batch"], title), "",
              "towers.minimize (variables on /cpu:0) with the towers "
              "computing in float32, bfloat16 or float16 (compute_dtype: "
              "float32 master weights, cast in each tower; float16 with "
              "dynamic loss scaling), or in float32 with the model compiled "
              "by XLA (jit_scope around the model), timed in the same "
              "rounds. x float32: examples/sec over float32's, with its "
              "95% bootstrap interval. First step: its seconds (and over "
              "float32's), TensorFlow's graph optimizations and XLA's "
              "compilation included; not in the timed steps. Parameters: "
              "MiB through the busiest device per step (expected: the "
              "float32 master weights and gradients cross, whatever the "
              "towers compute in). No target. " +
              _on_devices(precision["devices"], "float16 has no fast CPU "
                          "kernels, bfloat16 is fast only where oneDNN "
                          "finds bf16 instructions, and XLA compiles for "
                          "the CPU"), "",
              "| workload | variant | towers | examples/sec | x float32 | "
              "step ms (median [q1, q3]) | first step s | parameters MiB "
              "(expected) |",
              "|---|---|---:|---:|---:|---:|---:|---:|"]
    for row in precision["rows"]:
      if "not_run" in row:
        lines.append("| %s | %s | %d | not run: %s | - | - | - | - |" % (
            row["workload"], row["title"], row["num_towers"],
            row["not_run"]))
        continue
      ratio = "-"
      if "ratio_to_float32" in row:
        ratio = "%.3fx [%.3f, %.3f]" % (row["ratio_to_float32"],
                                        *row["ratio_interval"])
      lines.append(
          "| %s | %s | %d | %.1f | %s | %.1f [%.1f, %.1f] | %s | %s (%s) |"
          % (row["workload"], row["title"], row["num_towers"],
             row["examples_per_sec"], ratio, 1e3 * row["median_step_sec"],
             1e3 * row["q1_step_sec"], 1e3 * row["q3_step_sec"],
             _first_step(row), _counted(row),
             _mib(row["expected_busiest_bytes"])))
    lines += ["", _rounds_line(precision["rounds"]), ""]
  return lines


def _kib(size: float) -> str:
  return "%.1f" % (size / 1024.0)


def _interval(ratio: Optional[float],
              interval: Optional[Sequence[float]]) -> str:
  if ratio is None:
    return "-"
  if interval is None:
    return "%.3fx" % ratio
  return "%.3fx [%.3f, %.3f]" % (ratio, interval[0], interval[1])


def accumulation_markdown(results: Dict[str, object]) -> List[str]:
  """Returns gradient accumulation's tables: its rows, then the ratios."""
  section = results.get("accumulation")
  if not section:
    return []
  quick = results.get("quick")
  rows = list(section["rows"]) + list(section["counted_rows"])
  size = rows[0]["traffic"]["parameter_bytes"] if rows else 0
  largest = max(section["accumulate_steps"])
  lines = [
      "### Gradient accumulation: %s, %d per tower per run%s" % (
          section["title"], section["per_tower_batch"],
          " (quick run)" if quick else ""), "",
      "towers.minimize(..., accumulate_steps=k) with "
      "variable_device='replicated' (all_reduce %s), every k at the same "
      "micro-batch b per tower, and plain: k=1 with a per-tower batch of "
      "b*%d, the same examples per update in one run. Each run of the "
      "train op runs one micro-batch on every tower and adds the "
      "gradients to accumulators on the towers' devices; every k-th also "
      "reduces, applies and clears them. Timed in the same rounds, a step "
      "being one applied update (k runs): examples/sec = N*b*k over the "
      "median update. Bytes: the parameters' bytes (P = %s MiB) through "
      "the busiest device (sent + received) per applied update, counted "
      "from the partition graphs of the applying run; each of the k-1 "
      "runs that do not apply counts the same sends but those of the "
      "apply branch, whose tensors are dead (no data) when it is not "
      "taken (its MiB: 'not applying'). Per example: over the update's "
      "N*b*k examples. Expected: replicated, one reduction per update "
      "whatever k; variables on /cpu:0 (counted, not timed), the towers' "
      "reads of every variable in each of the k runs and the gradients "
      "once. Counts, not timings: the bytes a GPU machine would copy." % (
          ", ".join(sorted({str(r["all_reduce"]) for r in section["rows"]}))
          or "-", largest, _mib(size)), "",
      "| towers | row | k | per-tower batch | examples per update | "
      "examples/sec | update ms (median [q1, q3]) | MiB per update through "
      "busiest device (expected) | not applying, MiB per run | KiB per "
      "example (expected) |",
      "|---:|---|---:|---:|---:|---:|---:|---|---:|---:|"]
  for row in rows:
    moved = row["traffic"]
    timed = ("%.1f | %.1f [%.1f, %.1f]" % (
        row["examples_per_sec"], 1e3 * row["median_step_sec"],
        1e3 * row["q1_step_sec"], 1e3 * row["q3_step_sec"])
             if row["timed"] else "not timed | -")
    quiet_run = moved["non_applying_busiest_bytes"]
    lines.append(
        "| %d | %s | %d | %d | %d | %s | %s %s (%s) | %s | %s (%s) |" % (
            row["num_towers"], row["variant"], row["accumulate_steps"],
            row["per_tower_batch"], row["examples_per_update"], timed,
            moved["busiest_device"], _mib(moved["busiest_bytes"]),
            _mib(moved["expected_busiest_bytes"]),
            "-" if quiet_run is None else _mib(quiet_run),
            _kib(moved["bytes_per_example"]),
            _kib(moved["expected_bytes_per_example"])))
  lines.append("")
  unsized = sorted({n for r in rows for n in r["traffic"]["unsized"]})
  if unsized:
    lines += ["Sent tensors of unknown size, in no count: %s."
              % ", ".join(unsized), ""]
  if section["comparisons"]:
    lines += [
        "At each tower count, the largest k against k=1 (replicated): "
        "bytes per example over k=1's (expected 1/k: counted, exact), "
        "examples/sec over k=1's and over plain's (with their 95% "
        "bootstrap intervals), and bytes per example over k=1's with the "
        "variables on /cpu:0 (counted; not 1/k: the reads cross in every "
        "run).", "",
        "| towers | k | bytes per example / k=1 (expected) | examples/sec / "
        "k=1 | examples/sec / plain | variables on /cpu:0: bytes per "
        "example / k=1 |" + ("" if quick else " targets |"),
        "|---:|---:|---:|---:|---:|---:|" + ("" if quick else "---|")]
    for entry in section["comparisons"]:
      cpu = entry["cpu_bytes_ratio"]
      line = "| %d | %d | %.4fx (%.4fx) | %s | %s | %s |" % (
          entry["num_towers"], entry["accumulate_steps"],
          entry["bytes_ratio"], entry["expected_bytes_ratio"],
          _interval(entry["speed_ratio"], entry["speed_interval"]),
          _interval(entry["plain_speed_ratio"],
                    entry["plain_speed_interval"]),
          "-" if cpu is None else "%.4fx" % cpu)
      if not quick:
        line += " %s |" % _met(entry.get("targets", []))
      lines.append(line)
    lines.append("")
  lines += ["Not run or not measured here: %s." % "; ".join(
      section["not_run"]), ""]
  lines += [_rounds_line(section["rounds"]), ""]
  if quick:
    lines += [_targets_line(results, []), ""]
  return lines


def _ms(side: Dict[str, object]) -> str:
  """A step's median and quartiles in ms: ``"41.2 [40.8, 42.0]"``."""
  return "%.1f [%.1f, %.1f]" % (1e3 * side["median_step_sec"],
                                1e3 * side["q1_step_sec"],
                                1e3 * side["q3_step_sec"])


def startup_markdown(results: Dict[str, object]) -> List[str]:
  """Returns the start-up check's table: gated against ungated."""
  section = results.get("startup")
  if not section:
    return []
  quick = results.get("quick")
  lines = [
      "### Replicated start-up check: gated against ungated, %s, global "
      "batch %d%s" % (section["title"], section["global_batch"],
                      " (quick run)" if quick else ""), "",
      "towers.minimize(..., variable_device='replicated') as built "
      "(gated: each tower but the first, and the update of the copies, "
      "wait for a no-op gate that waits for a cond on the host reading a "
      "local flag; at the first step after the local init op it sets "
      "every copy from copy 0, at every later one it takes its empty "
      "branch) against its ungated twin: the same graph with the gates' "
      "control inputs removed, so that the cond never runs. Timed in the "
      "same rounds, every step after the first. Step time ratio: the "
      "gated median over the ungated one, with its 95%% bootstrap "
      "interval; target: the gated step not both measurably slower (the "
      "interval above 1.0) and more than %.0f%% slower (the ratio above "
      "%.2f). Nodes: what a traced step after the first ran "
      "(sends and receives included), gated / ungated (added), and of "
      "those the start-up cond's. Bytes: every byte between devices per "
      "step (parameters, input, others; counted as in every step after "
      "the first: the setting branch's sends carry no data then), gated / "
      "ungated, and the difference, the start-up's: the flag (a bool) to "
      "the copies' devices." % (100 * (STARTUP_RATIO - 1), STARTUP_RATIO),
      "",
      "| all_reduce | towers | gated step ms (median [q1, q3]) | ungated "
      "step ms (median [q1, q3]) | gated / ungated step time | nodes per "
      "step, gated / ungated (added) | start-up nodes, gated / ungated | "
      "bytes per step, gated / ungated (start-up's) | control edges, gated "
      "/ ungated |" + ("" if quick else " targets |"),
      "|---|---:|---:|---:|---:|---|---|---|---|" + ("" if quick else
                                                      "---|")]
  for row in section["rows"]:
    gated, ungated = row["gated"], row["ungated"]
    line = ("| %s | %d | %s | %s | %s | %d / %d (%+d) | %d / %d | %d / %d "
            "(%+d) | %d / %d |" % (
                row["all_reduce"], row["num_towers"], _ms(gated),
                _ms(ungated), _interval(row["step_time_ratio"],
                                        row["ratio_interval"]),
                gated["nodes_per_step"], ungated["nodes_per_step"],
                row["nodes_added"], gated["startup_nodes"],
                ungated["startup_nodes"], gated["bytes_per_step"],
                ungated["bytes_per_step"], row["startup_bytes"],
                gated["control_edges"], ungated["control_edges"]))
    if not quick:
      line += " %s |" % _met(row.get("targets", []))
    lines.append(line)
  lines += ["", _rounds_line(section["rounds"]), ""]
  if quick:
    lines += [_targets_line(results, []), ""]
  return lines


def _per_worker(tasks: Optional[Dict[str, Dict[str, float]]]) -> str:
  """Each worker's MiB sent / received per step: ``"worker:0 1.5 / 1.5"``."""
  if not tasks:
    return "-"
  return "; ".join("%s %s / %s" % (task, _mib(f["sent_bytes"]),
                                    _mib(f["received_bytes"]))
                   for task, f in sorted(tasks.items()))


def across_workers_markdown(results: Dict[str, object]) -> List[str]:
  """Returns the across-workers table: each cluster against 1 x 4."""
  section = results.get("across_workers")
  if not section:
    return []
  rows = section["rows"]
  base = next(r for r in rows if r["num_workers"] == 1)
  across = next(r for r in rows if r["num_workers"] > 1)
  size = base["parameter_bytes"]
  steps = max(r["measured_steps"] for r in rows)
  lines = [
      "### Across workers: %s, %d workers x %d towers against %d x %d, %d "
      "per tower (global batch %d)%s" % (
          section["title"], across["num_workers"],
          across["towers_per_worker"], base["num_workers"],
          base["towers_per_worker"], section["per_tower_batch"],
          base["global_batch"],
          " (quick run)" if results.get("quick") else ""), "",
      "The same model on 4 towers of the same batch each: in one process "
      "(towers.minimize's default, one copy of the variables on /cpu:0), "
      "or in 2 worker processes of 2 towers each, tasks of a cluster on "
      "127.0.0.1 (a tf.train.Server each): with a parameter-server "
      "process (variables on the ps, each worker's towers averaged on its "
      "CPU, SyncReplicasOptimizer aggregating the 2 workers' averages), "
      "or without one (variable_device='replicated', one collective "
      "all-reduce over all 4 towers: all_reduce='collective', "
      "num_workers=2). Timed in the same rounds; a step's time is its "
      "slowest worker's. x 1 x 4: examples/sec over the one process's, "
      "with its 95%% bootstrap interval. MiB per worker per step, sent / "
      "received, of the parameters (P = %s MiB): "
      "*counted* from one step's partition graphs (each _Send between two "
      "tasks, sized by its tensor), plus the collective's ring from its "
      "algorithm (the ring of N = 4 members passes each task's members in "
      "a row, so one member per task sends 2(N-1)/N of every tensor to "
      "the other task); *measured*: the TCP bytes each worker process "
      "sent (acknowledged) and received on its sockets over %d steps "
      "(the kernel's tcp_info, read with ss), gRPC's framing and control "
      "messages included; *formula*: P each way with a ps (the worker's "
      "averaged gradient out, each variable in once), 2(N-1)/N P each way "
      "around the ring. Every task shares this machine's cores and "
      "loopback is no network: the ratios show what the cluster runtime "
      "costs on one machine; the bytes are what a network would carry."
      % (_mib(size), steps), "",
      "| cluster | workers x towers | examples/sec | x 1 x 4 | step ms "
      "(median [q1, q3]) | MiB per worker per step: counted | measured "
      "(TCP) | formula |",
      "|---|---|---:|---:|---:|---|---|---|"]
  for row in rows:
    low, high = row["ratio_interval"]
    want = row["expected"]
    lines.append(
        "| %s | %d x %d | %.1f | %.3fx [%.3f, %.3f] | %.1f [%.1f, %.1f] | "
        "%s | %s | %s |" % (
            row["title"], row["num_workers"], row["towers_per_worker"],
            row["examples_per_sec"], row["ratio_to_baseline"], low, high,
            1e3 * row["median_step_sec"], 1e3 * row["q1_step_sec"],
            1e3 * row["q3_step_sec"],
            _per_worker(row["counted"]) if row["num_workers"] > 1 else "-",
            _per_worker(row["measured"]),
            "%s / %s" % (_mib(want["sent_bytes"]),
                         _mib(want["received_bytes"])) if want else "-"))
  unsized = sorted({n for r in rows for c in r["counted"].values()
                    for n in c["unsized"]})
  lines.append("")
  if unsized:
    lines += ["Sent tensors of unknown size, in no count: %s."
              % ", ".join(unsized), ""]
  if any(r["num_workers"] > 1 and not r["measured"] for r in rows):
    lines += ["Measured: not available here (ss -tinp failed).", ""]
  lines += [_rounds_line(section["rounds"]), ""]
  return lines


def _size(size: int) -> str:
  if size % 1024 == 0:
    return "%d KiB" % (size // 1024)
  return "%d B" % size


def markdown(results: Dict[str, object]) -> str:
  """Returns the results as markdown tables.

  A quick run says so first, and its throughput tables have no targets
  column.
  """
  quick = results.get("quick")
  lines = []
  if quick:
    lines += ["**%s**" % QUICK_NOTE, ""]
  for workload in results["throughput"]:
    lines += ["### %s, global batch %d%s" % (
        workload["title"], workload["global_batch"],
        " (quick run)" if quick else ""), ""]
    header = ("| variant | towers | examples/sec | x plain | step ms "
              "(median [q1, q3]) | MiB/step through busiest device "
              "(expected) |")
    if quick:
      lines += [header, "|---|---:|---:|---:|---:|---:|"]
    else:
      lines += [header + " targets |", "|---|---:|---:|---:|---:|---:|---|"]
    for row in workload["rows"]:
      line = "| %s | %d | %.1f | %.3f | %.1f [%.1f, %.1f] | %s |" % (
          row["variant"], row["num_towers"], row["examples_per_sec"],
          row["ratio_to_plain"], 1e3 * row["median_step_sec"],
          1e3 * row["q1_step_sec"], 1e3 * row["q3_step_sec"],
          _busiest(row.get("traffic")))
      if not quick:
        line += " %s |" % _met(row["targets"])
      lines.append(line)
    lines += [""]
    if results.get("mirrored_skipped") and workload.get("mirrored_planned",
                                                        True):
      lines += [results["mirrored_skipped"], ""]
    if quick:
      lines += [_targets_line(results, []), ""]
    lines += [_rounds_line(workload["rounds"]), ""]
    lines += traffic_markdown(workload)
  lines += packing_markdown(results)
  lines += sweep_markdown(results)
  averaging = results.get("average_gradients")
  if averaging:
    unavailable = averaging.get("process_unavailable")
    lines += ["### average_gradients alone: %d towers x %d variables x "
              "%d floats (%.0f MiB per tower)%s" % (
                  averaging["num_towers"], averaging["num_vars"],
                  averaging["num_floats"],
                  averaging["num_vars"] * averaging["num_floats"] * 4 / MIB,
                  " (quick run)" if quick else ""),
              "",
              "| averaging | step ms (median [q1, q3]) | peak tensors MiB | "
              "peak process MiB | allocated MiB |",
              "|---|---:|---:|---:|---:|"]
    for name in ("towers", "original"):
      row = averaging[name]
      lines.append("| %s | %.1f [%.1f, %.1f] | %.0f | %s | %.0f |" % (
          name, 1e3 * row["median_step_sec"], 1e3 * row["q1_step_sec"],
          1e3 * row["q3_step_sec"], row["tensor_peak_bytes"] / MIB,
          _process_mib(row, unavailable),
          row["tensor_allocated_bytes"] / MIB))
    lines += [""]
    if unavailable:
      lines += ["Peak process memory: unavailable on this machine (%s); no "
                "verdict comes from it." % unavailable, ""]
    lines += [_targets_line(results, averaging["targets"]), ""]
    if len(averaging["peaks_by_towers"]) > 1:
      lines += ["Peak memory against the number of towers (same variables):",
                "", "| towers | towers peak MiB (tensors, process) | "
                "original peak MiB (tensors, process) | tensors ratio | "
                "allocated MiB (towers, original) |",
                "|---:|---:|---:|---:|---:|"]
      for peak in averaging["peaks_by_towers"]:
        ours, theirs = peak["towers"], peak["original"]
        lines.append("| %d | %.0f, %s | %.0f, %s | %.2f | %.0f, %.0f |" % (
            peak["num_towers"], ours["tensor_peak_bytes"] / MIB,
            _process_mib(ours, unavailable),
            theirs["tensor_peak_bytes"] / MIB,
            _process_mib(theirs, unavailable),
            ours["tensor_peak_bytes"] / theirs["tensor_peak_bytes"],
            ours["tensor_allocated_bytes"] / MIB,
            theirs["tensor_allocated_bytes"] / MIB))
      lines.append("")
  build = results.get("build")
  if build:
    lines += ["### Graph build (towers.minimize, %s), median of %d%s" % (
        build["title"], build["repeats"], " (quick run)" if quick else ""),
              "",
              "| towers | build s | ops | ops per tower | s per tower, "
              "tower 0 to n-2 |",
              "|---:|---:|---:|---:|---|"]
    for row in build["rows"]:
      lines.append("| %d | %.3f | %d | %.1f | %s |" % (
          row["num_towers"], row["seconds"], row["ops"],
          row["ops_per_tower"],
          " ".join("%.3f" % t for t in row["tower_seconds"]) or "-"))
    lines += ["", "| added towers | s per added tower | ops per added "
              "tower |", "|---|---:|---:|"]
    for inc in build["increments"]:
      lines.append("| %d -> %d | %.3f | %.1f |" % (
          inc["from_towers"], inc["to_towers"], inc["seconds_per_tower"],
          inc["ops_per_tower"]))
    lines += ["", _targets_line(results, build["targets"]), ""]
  lines += large_build_markdown(results)
  lines += batch_norm_markdown(results)
  lines += fast_paths_markdown(results)
  lines += accumulation_markdown(results)
  lines += startup_markdown(results)
  lines += across_workers_markdown(results)
  return "\n".join(lines)


def write_json(results: Dict[str, object], path: str) -> None:
  with open(path, "w") as f:
    json.dump(results, f, indent=2, sort_keys=True)
    f.write("\n")


def chart(results: Dict[str, object], path: str) -> Optional[str]:
  """Draws examples/sec against towers, one line per variant.

  Returns:
    `path`, or None when matplotlib is not installed (the ``bench`` extra)
    or no model's throughput was timed.
  """
  try:
    import matplotlib  # pylint: disable=g-import-not-at-top
    matplotlib.use("Agg")
    from matplotlib import pyplot  # pylint: disable=g-import-not-at-top
  except ImportError:
    logging.info("matplotlib is not installed (pip install -e '.[bench]'); "
                 "no chart")
    return None
  workloads = results["throughput"]
  if not workloads:
    logging.info("no throughput rows to draw; no chart")
    return None
  figure, axes = pyplot.subplots(1, len(workloads), squeeze=False,
                                 figsize=(5.0 * len(workloads), 3.6))
  styles = {graphs.TOWERS: "o-", graphs.BALANCED: "s--",
            graphs.REPLICATED_ADD_N: "D-", graphs.REPLICATED_RING: "P-",
            graphs.REPLICATED_COLLECTIVE: "X--", graphs.INDEPENDENT: "h-.",
            graphs.ORIGINAL: "^-", graphs.MIRRORED: "v-",
            graphs.TOWERS_UNPACKED: "o:",
            graphs.REPLICATED_ADD_N_UNPACKED: "D:",
            graphs.REPLICATED_COLLECTIVE_UNPACKED: "X:"}
  # An unpacked twin takes its packed variant's color, dotted.
  bases = [v for v in graphs.VARIANTS
           if v != graphs.PLAIN and v not in graphs.UNPACKED]
  colors = {v: "C%d" % bases.index(graphs.UNPACKED.get(v, v))
            for v in styles}
  for ax, workload in zip(axes[0], workloads):
    rows = workload["rows"]
    counts = sorted({r["num_towers"] for r in rows})
    for variant in graphs.VARIANTS:
      points = sorted((r["num_towers"], r["examples_per_sec"])
                      for r in rows if r["variant"] == variant)
      if not points:
        continue
      if variant == graphs.PLAIN:
        ax.axhline(points[0][1], color="black", linestyle=":",
                   label="plain (one device)")
        continue
      x, y = zip(*points)
      ax.plot(x, y, styles[variant], color=colors[variant], label=variant)
    ax.set_xscale("log", base=2)
    ax.set_xticks(counts)
    ax.set_xticklabels([str(c) for c in counts])
    ax.set_ylim(bottom=0)
    ax.set_xlabel("towers (global batch %d)" % workload["global_batch"])
    ax.set_ylabel("examples/sec")
    ax.set_title(workload["title"]
                 + (" (quick run)" if results.get("quick") else ""),
                 fontsize="medium")
    ax.grid(alpha=0.3)
  axes[0][0].legend(fontsize="small", loc="lower left")
  if results.get("quick"):
    figure.suptitle("Quick run (--quick): not measurements", fontsize="small")
  figure.tight_layout()
  figure.savefig(path, dpi=90)
  pyplot.close(figure)
  return path


def summary(results: Dict[str, object]) -> List[Dict[str, object]]:
  """Returns every target of the run, flattened, with where it applies."""
  flat = []
  for workload in results["throughput"]:
    for row in workload["rows"]:
      for t in row["targets"]:
        flat.append(dict(t, scope="%s %s x%d" % (
            workload["workload"], row["variant"], row["num_towers"])))
  for key in ("average_gradients", "build", "large_build"):
    if results.get(key):
      flat += [dict(t, scope=key) for t in results[key]["targets"]]
  for row in (results.get("batch_norm") or {}).get("rows", []):
    flat += [dict(t, scope="batch_norm x%d" % row["num_towers"])
             for t in row.get("targets", [])]
  for row in results.get("fast_paths", {}).get("staging", {}).get("rows", []):
    flat += [dict(t, scope="fast_paths %s staged x%d" % (
        row["workload"], row["num_towers"])) for t in row["targets"]]
  for entry in (results.get("accumulation") or {}).get("comparisons", []):
    flat += [dict(t, scope="accumulation x%d" % entry["num_towers"])
             for t in entry.get("targets", [])]
  for row in (results.get("startup") or {}).get("rows", []):
    flat += [dict(t, scope="startup %s x%d" % (row["all_reduce"],
                                                row["num_towers"]))
             for t in row.get("targets", [])]
  return flat


def ensure_dir(path: str) -> str:
  os.makedirs(path, exist_ok=True)
  return path
