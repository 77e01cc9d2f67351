"""The benchmark's --quick mode runs and reports every variant.

Speed targets are the benchmark's business (docs/performance.md), never a
test's: this only keeps the benchmark code from rotting, and checks what the
benchmark decides without measuring: when MirroredStrategy is skipped, that a
quick run gives no verdicts, that a process peak blind to the tensors gives
none either. The bytes that cross between devices are counts, not timings:
those are checked exactly, on a model small enough to count by hand.
"""

import fractions
import importlib.util
import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest
import tensorflow.compat.v1 as tf

import towers
from benchmarks import accumulation
from benchmarks import across_workers
from benchmarks import batch_norm
from benchmarks import build_time
from benchmarks import fast_paths
from benchmarks import graphs
from benchmarks import mirrored
from benchmarks import packing
from benchmarks import report
from benchmarks import run
from benchmarks import transformer
from benchmarks import traffic
from benchmarks import workloads

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
MIB = 1 << 20
# A verdict on a target: "met" or "not met" as a word ("parameters" is none).
VERDICT = re.compile(r"\bmet\b")


def test_quick_benchmark_reports_every_variant(tmp_path):
  out = tmp_path / "bench"
  env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
  done = subprocess.run(
      # The workers' section runs alone below
      # (test_across_workers_runs_alone_and_counts_what_crosses_tasks).
      [sys.executable, "-m", "benchmarks.run", "--quick", "--noacross_workers",
       "--out", str(out)],
      cwd=ROOT, capture_output=True, text=True, timeout=600, env=env,
      check=False)
  assert done.returncode == 0, done.stderr[-3000:]
  with open(out / "results.json") as f:
    results = json.load(f)

  assert results["quick"]
  skipped = mirrored.installed_unavailable_reason()
  assert results["mirrored_skipped"] == skipped
  mnist, many_small = results["throughput"]
  seen = {(r["variant"], r["num_towers"]) for r in mnist["rows"]}
  unpacked = {("towers_unpacked", 2), ("replicated_add_n_unpacked", 2),
              ("replicated_collective_unpacked", 2)}
  want = {("plain", 1), ("towers", 1), ("towers", 2), ("towers_balanced", 2),
          ("replicated_add_n", 2), ("replicated_ring", 2),
          ("replicated_collective", 2), ("independent", 2),
          ("original", 1), ("original", 2)} | unpacked
  if not skipped:
    want |= {("mirrored", 1), ("mirrored", 2)}
  assert seen == want
  # The model of many small variables: plain and the packing rows only.
  assert many_small["workload"] == "many_small"
  assert {(r["variant"], r["num_towers"]) for r in many_small["rows"]} == {
      ("plain", 1), ("towers", 2), ("replicated_add_n", 2),
      ("replicated_collective", 2)} | unpacked
  for row in mnist["rows"] + many_small["rows"]:
    assert row["examples_per_sec"] > 0, row
    assert row["ratio_to_plain"] > 0, row
    assert row["steps_timed"] > 0, row
    assert row["targets"] == [], row

  # Counts, not timings: exact even in a quick run. At 2 towers every
  # pattern sends each device's P once each way: the weight decay, which
  # reads two weights a second time, runs next to them.
  moved = {(r["variant"], r["num_towers"]): r["traffic"]
           for r in mnist["rows"] if r["variant"] != "mirrored"}
  size = moved[("plain", 1)]["parameter_bytes"]
  assert size == 4 * 3274634  # The MNIST CNN's parameters.
  for key in [("replicated_add_n", 2), ("replicated_ring", 2),
              ("replicated_collective", 2)]:
    for device in ("cpu:0", "cpu:1"):
      fields = moved[key]["devices"][device]
      assert fields["sent_bytes"] == fields["received_bytes"] == size, key
      assert fields["expected_sent_bytes"] == size, key
  # 8 variables, 4 of them small (the biases, conv1's kernel): one pack
  # and 3 alone, a collective each per device; 8 each unpacked.
  assert moved[("replicated_collective", 2)]["collectives"] == 8
  assert moved[("replicated_collective_unpacked", 2)]["collectives"] == 16
  for key in [("replicated_collective", 2),
              ("replicated_collective_unpacked", 2)]:
    assert moved[key]["collectives"] == moved[key]["expected_collectives"]
  assert moved[("replicated_ring", 2)]["collectives"] == 0
  # Packed or not, the same bytes; every mode's tensors are its design's.
  for packed, twin in [("towers", "towers_unpacked"),
                       ("replicated_add_n", "replicated_add_n_unpacked"),
                       ("replicated_collective",
                        "replicated_collective_unpacked")]:
    assert moved[(packed, 2)]["busiest_bytes"] == (
        moved[(twin, 2)]["busiest_bytes"])
    assert moved[(packed, 2)]["tensors"] < moved[(twin, 2)]["tensors"]
  for key, fields in moved.items():
    if key[0] not in ("original", "plain", "independent"):
      assert fields["tensors"] == fields["expected_tensors"], key
      assert fields["busiest_bytes"] == fields["expected_busiest_bytes"], key
  # The many small variables' rows move exactly their design: bytes and
  # tensors, per device; every gradient in one pack.
  for row in many_small["rows"]:
    for device, fields in row["traffic"]["devices"].items():
      for field in traffic.FIELDS:
        assert fields[field] == fields["expected_" + field], (row, device)
  small = {r["variant"]: r["traffic"] for r in many_small["rows"]}
  variables = run.QUICK_MANY_SMALL_VARIABLES
  assert small["towers"]["devices"]["cpu:1"]["sent_tensors"] == 1
  assert small["towers_unpacked"]["devices"]["cpu:1"]["sent_tensors"] == (
      variables)
  assert small["replicated_collective"]["collectives"] == 2
  assert small["replicated_collective_unpacked"]["collectives"] == (
      2 * variables)

  # Synchronized batch norm against per-tower at 2 and 4 towers: counts.
  # run.py makes tf.compat.v1.layers available where tf_keras is installed.
  bn = results["batch_norm"]
  if importlib.util.find_spec("tf_keras") is not None:
    assert bn["per_tower"] == batch_norm.LAYERS
  assert (bn["per_tower_reason"] is None) == (
      bn["per_tower"] == batch_norm.LAYERS)
  _check_batch_norm_rows(bn, [2, 4])
  # No collective between CPU devices; 2(N-1) vectors of 2328 bytes
  # through tower 0's device.
  for n, summed in [(2, 4656), (4, 13968)]:
    assert re.search(r"^\| %d \| .* \| 0 \(0\) \| %d \(%d\) \| "
                     % (n, summed, summed), done.stdout, re.M), n

  _check_quick_fast_paths(results["fast_paths"], size, done.stdout)
  _check_quick_accumulation(results["accumulation"], size, done.stdout)
  _check_quick_startup(results["startup"], done.stdout)

  # The sweep: packed against unpacked at 2 sizes, 4 towers, 8 variables.
  sweep = results["packing_sweep"]
  assert [r["size_bytes"] for r in sweep["rows"]] == [1024, 64 * 1024]
  for row in sweep["rows"]:
    assert row["num_variables"] == 8
    assert row["ratio"] > 0
    assert row["packed"]["pack_bytes"] == row["size_bytes"]
    assert row["unpacked"]["pack_bytes"] == 0
    # /cpu:0 sends the 8 variables to 3 towers, which send 1 pack each.
    assert row["packed"]["tensors"] == 8 * 3 + 3
    assert row["unpacked"]["tensors"] == 8 * 3 * 2

  assert moved[("independent", 2)]["busiest_bytes"] == 0
  assert moved[("towers", 2)]["busiest_bytes"] == 2 * size
  assert moved[("towers", 1)]["busiest_bytes"] == 0
  for key, fields in moved.items():
    # The towers' shards of the 32 images and labels; none with one tower.
    shard = 16 * (28 * 28 * 4 + 8)
    assert fields["input_bytes"] == (shard if key[1] == 2 else 0), key
    assert fields["unsized"] == [], key

  averaging = results["average_gradients"]
  for name in ("towers", "original"):
    assert averaging[name]["median_step_sec"] > 0
    assert averaging[name]["tensor_peak_bytes"] > 0
  # By construction: no [num_towers, ...] concat buffer in ours.
  assert (averaging["towers"]["tensor_allocated_bytes"]
          < averaging["original"]["tensor_allocated_bytes"])
  assert "process_unavailable" in averaging
  assert averaging["targets"] == []

  build = results["build"]
  assert [r["num_towers"] for r in build["rows"]] == [1, 2, 4]
  assert all(r["seconds"] > 0 and r["ops"] > 0 for r in build["rows"])
  ops = [r["ops"] for r in build["rows"]]
  assert ops == sorted(ops)

  large = results["large_build"]
  assert large["config"]["layers"] == transformer.TINY.layers
  variants = large["variants"]
  assert [r["num_towers"] for r in variants["one_device"]["rows"]] == [1]
  for name in ("one_copy", "replicated_ring"):
    rows = variants[name]["rows"]
    assert [r["num_towers"] for r in rows] == [1, 2]
    assert rows[0]["ops"] < rows[1]["ops"]
  assert large["targets"] == []
  assert "### Graph build of a large model: BERT-base-sized" in done.stdout

  # A quick run is no measurement: it says so, and gives no verdict.
  assert results["targets"] == []
  assert "| towers | 2 |" in done.stdout
  assert "| replicated_collective * | 2 |" in done.stdout
  assert "| towers_unpacked | 2 |" in done.stdout
  assert "### Many small variables (20 x 1024 floats)" in done.stdout
  assert "### Gradient packing: packed against pack_bytes=0 (quick run)" in (
      done.stdout)
  assert "| many_small | replicated_collective | 2 |" in done.stdout
  assert "| mnist | towers | 2 |" in done.stdout
  assert "### pack_bytes sweep: 4 towers" in done.stdout
  assert "### Synchronized batch norm against per-tower: ResNet-ish" in (
      done.stdout)
  assert "| 64 KiB | 8 |" in done.stdout
  assert "quick run: no verdicts" in done.stdout
  assert not VERDICT.search(done.stdout)
  table = (out / "results.md").read_text()
  assert table.startswith("**Quick run (--quick)")
  # The chart is optional: drawn exactly when matplotlib is installed.
  has_matplotlib = importlib.util.find_spec("matplotlib") is not None
  assert (out / "examples_per_sec.png").exists() == has_matplotlib


def _check_quick_fast_paths(section, size, stdout):
  """The quick run's fast paths: MNIST at 2 towers, every row, counts.

  `size`: the MNIST CNN's parameter bytes, P.
  """
  assert section["workloads"] == ["mnist"]
  staging = section["staging"]
  assert staging["global_batch"] == 8
  assert staging["devices"] == {"2": ["/cpu:0", "/cpu:1"]}
  (row,) = staging["rows"]
  assert (row["workload"], row["num_towers"]) == ("mnist", 2)
  staged, unstaged = row["staged"], row["unstaged"]
  assert staged["steps_timed"] > 0 and unstaged["steps_timed"] > 0
  assert row["ratio"] == pytest.approx(
      unstaged["median_step_sec"] / staged["median_step_sec"])
  assert row["targets"] == []
  # Tower 1's shard of 4 images and labels crosses inside the unstaged
  # step; the staged step takes it from its staging area, copied by the
  # reader beforehand.
  assert unstaged["input_bytes"] == 4 * (28 * 28 * 4 + 8)
  assert staged["input_bytes"] == 0
  # Staging moves no parameter.
  assert staged["busiest_bytes"] == unstaged["busiest_bytes"] == 2 * size
  assert staged["expected_busiest_bytes"] == 2 * size

  precision = section["precision"]
  assert precision["global_batch"] == 2
  rows = {r["variant"]: r for r in precision["rows"]}
  assert list(rows) == list(fast_paths.PRECISIONS)
  for variant, row in rows.items():
    assert "not_run" not in row, row
    assert row["steps_timed"] > 0 and row["first_step_sec"] > 0, variant
    assert row["ratio_to_float32"] > 0 and row["first_step_ratio"] > 0
    # The float32 master weights and gradients cross, whatever the towers
    # compute in: the same expected bytes for every row.
    assert row["expected_busiest_bytes"] == 2 * size, variant
  assert rows["float32"]["ratio_to_float32"] == 1.0
  assert rows["float16"]["loss_scale"] == "dynamic"
  assert rows["bfloat16"]["loss_scale"] is None
  # Each weight crosses once, cast in each tower or not: the weight decay
  # (float32, of the master weights) runs next to them.
  for variant in ("float32", "bfloat16", "float16"):
    assert rows[variant]["busiest_bytes"] == 2 * size, variant
    assert rows[variant]["unsized"] == [], variant
  assert "### Fast paths: staged inputs against unstaged, global batch 8 " \
      "(quick run)" in stdout
  assert "### Fast paths: mixed precision and XLA against float32, global " \
      "batch 2 (quick run)" in stdout
  assert re.search(r"^\| mnist \| 2 \| .* \| 0\.00 / 0\.01 \| ", stdout,
                   re.M)
  assert "| mnist | float16 (compute_dtype, dynamic loss scaling) | 2 |" in (
      stdout)
  assert "| mnist | float32, XLA (jit_scope) | 2 |" in stdout


def _check_quick_startup(section, stdout):
  """The quick run's start-up check: replicated at 2 towers, add_n and the
  collective, each gated against ungated: counts."""
  assert section["global_batch"] == 8
  rows = {(r["all_reduce"], r["num_towers"]): r for r in section["rows"]}
  assert sorted(rows) == [("add_n", 2), ("collective", 2)]
  for key, row in rows.items():
    gated, ungated = row["gated"], row["ungated"]
    assert gated["steps_timed"] > 0 and ungated["steps_timed"] > 0, key
    assert row["step_time_ratio"] == pytest.approx(
        gated["median_step_sec"] / ungated["median_step_sec"])
    assert row["targets"] == []
    # One graph: the twin only lost the gates' control inputs.
    assert gated["num_ops"] == ungated["num_ops"], key
    # After the first step, the gated step still reads the flag, switches
    # and merges; the twin never runs the cond.
    assert gated["nodes_per_step"] > ungated["nodes_per_step"], key
    assert row["nodes_added"] == (gated["nodes_per_step"]
                                  - ungated["nodes_per_step"])
    assert gated["startup_nodes"] > 0 and ungated["startup_nodes"] == 0
    # The parameters cross alike: the cond's setting sends carry no data
    # after the first step, and are in no count.
    assert gated["parameter_devices"] == ungated["parameter_devices"], key
    assert gated["startup_sends"] > 0 and ungated["startup_sends"] == 0
    # What the check sends per step: the flag, a bool, to tower 1's device
    # for each of its 2 conds (the towers', the update's).
    assert row["startup_bytes"] == row["startup_tensors"] == 2, key
  assert "### Replicated start-up check: gated against ungated, MNIST CNN, " \
      "global batch 8 (quick run)" in stdout
  assert re.search(r"^\| collective \| 2 \| .* \| \d+ / \d+ \(\+\d+\) \| "
                   r"\d+ / 0 \| \d+ / \d+ \(\+2\) \| ", stdout, re.M)


def _check_quick_accumulation(section, size, stdout):
  """The quick run's accumulation: 2 towers, k 1 and 2, 2 per tower.

  `size`: the MNIST CNN's parameter bytes, P.
  """
  assert section["per_tower_batch"] == 2
  assert section["accumulate_steps"] == [1, 2]
  assert section["devices"] == {"2": ["/cpu:0", "/cpu:1"]}
  rows = {(r["variant"], r["accumulate_steps"]): r for r in section["rows"]}
  assert list(rows) == [("accumulated", 1), ("accumulated", 2), ("plain", 1)]
  assert rows[("plain", 1)]["per_tower_batch"] == 4
  for (variant, k), row in rows.items():
    assert row["timed"] and row["steps_timed"] > 0, row
    assert row["examples_per_sec"] > 0 and row["runs_per_step"] == k
    # Each timed step was one applied update: one global step each.
    assert row["global_step"] == row["updates"] > row["steps_timed"]
    moved = row["traffic"]
    assert row["examples_per_update"] == 2 * row["per_tower_batch"] * k
    # Replicated at 2 towers, add_n: each device sends and receives P per
    # update, whatever k; the runs that do not apply move none.
    for device in ("cpu:0", "cpu:1"):
      assert moved["devices"][device]["sent_bytes"] == size, (variant, k)
      assert moved["devices"][device]["received_bytes"] == size
    assert moved["busiest_bytes"] == moved["expected_busiest_bytes"] == (
        2 * size)
    assert moved["non_applying_busiest_bytes"] == (0 if k > 1 else None)
    assert moved["unsized"] == []
  assert rows[("accumulated", 2)]["traffic"]["non_applying_skipped"] > 0
  counted = {r["accumulate_steps"]: r for r in section["counted_rows"]}
  assert sorted(counted) == [1, 2]
  for k, row in counted.items():
    assert row["variant"] == "cpu" and not row["timed"]
    # /cpu:0 sends P to tower 1 in each of the k runs, gets P back once.
    cpu0 = row["traffic"]["devices"]["cpu:0"]
    assert (cpu0["sent_bytes"], cpu0["received_bytes"]) == (k * size, size)
    assert row["traffic"]["busiest_bytes"] == (
        row["traffic"]["expected_busiest_bytes"])
  (entry,) = section["comparisons"]
  assert (entry["num_towers"], entry["accumulate_steps"]) == (2, 2)
  assert entry["bytes_ratio"] == entry["expected_bytes_ratio"] == 0.5
  assert entry["cpu_bytes_ratio"] == 0.75
  assert entry["speed_ratio"] > 0 and entry["plain_speed_ratio"] > 0
  assert entry["targets"] == []
  assert any("virtual CPU devices" in note for note in section["not_run"])
  assert "### Gradient accumulation: MNIST CNN, 2 per tower per run (quick " \
      "run)" in stdout
  assert re.search(r"^\| 2 \| accumulated \| 2 \| 2 \| 8 \| .* \| cpu:0 25\.0 "
                   r"\(25\.0\) \| 0\.0 \| 3197\.9 \(3197\.9\) \|$", stdout,
                   re.M)
  assert re.search(r"^\| 2 \| 2 \| 0\.5000x \(0\.5000x\) \| .* \| 0\.7500x "
                   r"\|$", stdout, re.M)


def test_quick_run_has_its_own_default_directory():
  assert run.default_out("", quick=False) == "/tmp/towers_bench"
  assert run.default_out("", quick=True) == "/tmp/towers_bench_quick"
  assert run.default_out("/elsewhere", quick=True) == "/elsewhere"


def test_mirrored_needs_tf_keras_of_tensorflows_minor_version():
  assert mirrored.unavailable_reason("2.12.1", None) is None
  assert mirrored.unavailable_reason("2.21.0", "2.21.0") is None
  missing = mirrored.unavailable_reason("2.21.0", None)
  assert "tf_keras is not installed" in missing
  assert missing.endswith('pip install "tf_keras==2.21.*"')
  assert "\n" not in missing
  other = mirrored.unavailable_reason("2.21.0", "2.20.1")
  assert "tf_keras 2.20.1 is installed" in other
  assert other.endswith('pip install "tf_keras==2.21.*"')


def _row(variant, num_towers, seconds):
  return {"variant": variant, "num_towers": num_towers,
          "examples_per_sec": 32 / seconds, "ratio_to_plain": 0.1 / seconds,
          "median_step_sec": seconds, "q1_step_sec": seconds,
          "q3_step_sec": seconds, "step_seconds": [seconds] * 4}


def _peak(tensor_mib, rss_mib):
  return {"tensor_peak_bytes": tensor_mib * MIB,
          "rss_peak_extra_bytes": int(rss_mib * MIB),
          "tensor_allocated_bytes": 2 * tensor_mib * MIB,
          "rss_peak_reset": True}


def _results(*, quick, ours_rss_mib=112, theirs_rss_mib=152,
             mirrored_skipped=None):
  """Made-up results of the shape `run.run` writes."""
  ours, theirs = _peak(112, ours_rss_mib), _peak(160, theirs_rss_mib)
  ours.update(median_step_sec=0.1, q1_step_sec=0.1, q3_step_sec=0.1)
  theirs.update(median_step_sec=0.3, q1_step_sec=0.3, q3_step_sec=0.3)
  averaging = {"num_towers": 4, "num_vars": 8, "num_floats": 4 << 20,
               "towers": ours, "original": theirs,
               "peaks_by_towers": [{"num_towers": 2,
                                    "towers": _peak(32, ours_rss_mib),
                                    "original": _peak(96, theirs_rss_mib)}]}
  report.process_measure(averaging)
  rounds = {"foreign_cores": [0.0], "repeated_rounds": 0}
  return {
      "quick": quick, "mirrored_skipped": mirrored_skipped,
      "throughput": [{"workload": "mnist", "title": "MNIST CNN",
                      "global_batch": 32, "rounds": rounds,
                      "rows": [_row("plain", 1, 0.1), _row("towers", 1, 0.1),
                               _row("original", 1, 0.1)]}],
      "average_gradients": averaging,
      "build": {"title": "MNIST CNN", "repeats": 1, "tower_cost_growth": 1.0,
                "time_spread": 1.0, "ops_spread": 1.0, "increments": [],
                "rows": [{"num_towers": 1, "seconds": 0.5, "ops": 256,
                          "ops_per_tower": 256.0, "tower_seconds": []}]}}


def _build_variant(seconds, ops, tower_seconds):
  rows = [{"num_towers": n, "seconds": s, "ops": o, "ops_per_tower": o / n,
           "tower_seconds": t} for n, s, o, t in zip(
               [1, 8], seconds, ops, [[], tower_seconds])]
  return {"rows": rows, "tower_cost_growth": build_time._growth(
      tower_seconds), "time_spread": 1.0, "ops_spread": 1.0}


def test_the_large_build_and_batch_norm_get_their_targets():
  large = {"variants": {
      "one_copy": _build_variant([3.0, 20.0], [10000, 50000], [2.0] * 7),
      "replicated_ring": _build_variant([3.0, 31.0], [10000, 80000],
                                        [2.0] * 4 + [3.0] * 3)}}
  report.large_build_targets(large)
  assert [t["met"] for t in large["targets"]] == [False, True, False]
  assert large["targets"][0]["detail"].startswith("1.550x: 31.0 vs 20.0 s")
  assert "1.50x; increments" in large["targets"][2]["detail"]

  def side(seconds, ops):
    return {"median_step_sec": seconds, "num_ops": ops}
  section = {"rows": [
      {"num_towers": 2, "sync": side(0.11, 1900), "per_tower": side(0.1, 1000),
       "step_time_ratio": 1.1, "ratio_interval": [1.05, 1.25]},
      {"num_towers": 4, "sync": side(0.13, 2100), "per_tower": side(0.1, 1000),
       "step_time_ratio": 1.3, "ratio_interval": [1.25, 1.35]}]}
  report.batch_norm_targets(section)
  assert [[t["met"] for t in row["targets"]] for row in section["rows"]] == [
      [True, True], [False, False]]
  assert section["rows"][0]["targets"][0]["detail"] == (
      "1.100x [1.050, 1.250], within noise")


def test_full_results_give_verdicts():
  results = _results(quick=False)
  report.add_targets(results)
  assert results["targets"]
  table = report.markdown(results)
  assert "Quick run" not in table
  assert "tensors 0.70x, process 0.74x" in table


def test_quick_results_give_no_verdicts():
  results = _results(quick=True)
  report.add_targets(results)
  assert results["targets"] == []
  table = report.markdown(results)
  assert table.startswith("**Quick run (--quick)")
  assert "(quick run)" in table
  assert table.count("Targets: quick run: no verdicts.") == 3
  assert not VERDICT.search(table)


def test_a_process_peak_blind_to_the_tensors_is_unavailable():
  # What a machine whose resident memory does not follow the tensors read:
  # 0.06-0.27 MiB for steps whose tensors peak at 32-160 MiB.
  results = _results(quick=False, ours_rss_mib=0.27, theirs_rss_mib=0.06)
  averaging = results["average_gradients"]
  assert "resident memory does not show the step's tensors" in (
      averaging["process_unavailable"])
  report.add_targets(results)
  [_, memory] = averaging["targets"]
  # The verdict comes from the tensors alone (0.70x: met).
  assert memory["met"]
  assert "process: unavailable on this machine" in memory["detail"]
  assert averaging["rss_peak_ratio"] is None
  table = report.markdown(results)
  assert "Peak process memory: unavailable on this machine" in table
  assert "process 4.50x" not in table
  assert "| towers | 100.0 [100.0, 100.0] | 112 | unavailable | 224 |" in table


def test_a_refused_peak_reset_makes_the_process_peak_unavailable():
  results = _results(quick=False)
  results["average_gradients"]["towers"]["rss_peak_reset"] = False
  report.process_measure(results["average_gradients"])
  assert "refused" in results["average_gradients"]["process_unavailable"]


def test_a_skipped_mirrored_strategy_is_reported_with_its_reason():
  reason = mirrored.unavailable_reason("2.21.0", None)
  results = _results(quick=True, mirrored_skipped=reason)
  report.add_targets(results)
  assert reason in report.markdown(results)


def _linear(scope, batch):
  """w [4, 4] and b [4]: P = 20 floats = 80 bytes."""
  del scope  # Unused.
  w = tf.get_variable("w", [4, 4])
  b = tf.get_variable("b", [4])
  return tf.reduce_mean(tf.square(tf.matmul(batch, w) + b))


def _two_layers(scope, batch):
  """Four small variables: w1 [4, 4], b1 [4], w2 [4, 4], b2 [4] (64, 16, 64
  and 16 bytes: whole floats in each of a ring's 2 or 4 chunks)."""
  del scope  # Unused.
  w1 = tf.get_variable("w1", [4, 4])
  b1 = tf.get_variable("b1", [4])
  w2 = tf.get_variable("w2", [4, 4])
  b2 = tf.get_variable("b2", [4])
  hidden = tf.tanh(tf.matmul(batch, w1) + b1)
  return tf.reduce_mean(tf.square(tf.matmul(hidden, w2) + b2))


def _tiny_traffic(model_fn=_linear, num_towers=4, **minimize_kwargs):
  """Counts one step of a tiny model on `num_towers` towers.

  The global batch x is [8, 4] floats on /cpu:0, so each of 4 towers'
  shards is [2, 4] = 32 bytes.

  Returns:
    ``(measured, variables)``: `traffic.measure`'s count, and
    ``(device, bytes, dtype)`` of each trainable variable, as the
    benchmark's graphs give them to `traffic.expected`.
  """
  devices = ["/cpu:%d" % i for i in range(num_towers)]
  graph = tf.Graph()
  with graph.as_default():
    with tf.device("/cpu:0"):
      x = tf.constant(np.arange(32, dtype=np.float32).reshape([8, 4]))
    train_op, _ = towers.minimize(
        model_fn, tf.train.GradientDescentOptimizer(0.1), num_towers,
        inputs=x, devices=devices, **minimize_kwargs)
    variables = traffic.variable_rows(tf.trainable_variables())
    parameters = tf.trainable_variables() + tf.local_variables()
    init = tf.global_variables_initializer()
    local_init = tf.local_variables_initializer()
  config = towers.virtual_cpu_config(4, operation_timeout_in_ms=60000)
  with tf.Session(graph=graph, config=config) as session:
    session.run(init)
    session.run(local_init)
    return traffic.measure(session, train_op, graph, parameters,
                           [x]), variables


def _fields(sent, received, sent_tensors, received_tensors):
  return {"sent_bytes": sent, "received_bytes": received,
          "sent_tensors": sent_tensors, "received_tensors": received_tensors}


# By hand, P = 80 bytes in 2 variables, 4 towers on /cpu:0 ... /cpu:3.
# cpu: /cpu:0 sends w and b to each other tower (3 x 80 bytes, 6 tensors)
# and gets each one's 2 gradients back; each other tower the reverse.
STAR_FROM_CPU0 = {"cpu:0": _fields(240, 240, 6, 6),
                  **{"cpu:%d" % i: _fields(80, 80, 2, 2) for i in (1, 2, 3)}}
# ring: each variable cut in 4 chunks (w: 4 x 16 bytes, b: 4 x 4), each
# device sends 3 chunks of each while summing and 3 while gathering:
# 2 x 3/4 x 80 = 120 bytes in 2 x 2 x 3 = 12 tensors, and gets as much.
RING_OF_4 = {"cpu:%d" % i: _fields(120, 120, 12, 12) for i in range(4)}
# Packed (both gradients are small, of one dtype, on the same devices): the
# same bytes, one pack where there were 2 gradients. cpu: the towers still
# read w and b, but each sends 1 pack of 80 bytes back.
STAR_PACKED_CPU = {"cpu:0": _fields(240, 240, 6, 3),
                   **{"cpu:%d" % i: _fields(80, 80, 1, 2) for i in (1, 2, 3)}}
# add_n: each copy sends its pack to /cpu:0, which sends the packed sum back.
STAR_PACKED_ADD_N = {"cpu:0": _fields(240, 240, 3, 3),
                     **{"cpu:%d" % i: _fields(80, 80, 1, 1)
                        for i in (1, 2, 3)}}
# ring: one pack of 80 bytes, 3 chunks sent each way per device.
RING_PACKED = {"cpu:%d" % i: _fields(120, 120, 6, 6) for i in range(4)}
OFF = {"pack_bytes": 0}
ADD_N = {"variable_device": "replicated", "all_reduce": "add_n"}
RING = {"variable_device": "replicated", "all_reduce": "ring"}
COLLECTIVE = {"variable_device": "replicated", "all_reduce": "collective"}
# The library's default, which `minimize` uses when not told.
DEFAULT_PACK_BYTES = graphs.pack_bytes_in_effect(graphs.TOWERS)


@pytest.mark.parametrize("minimize_kwargs, want", [
    (OFF, STAR_FROM_CPU0),
    (dict(ADD_N, **OFF), STAR_FROM_CPU0),
    (dict(RING, **OFF), RING_OF_4),
    (dict(COLLECTIVE, **OFF), RING_OF_4),
    ({}, STAR_PACKED_CPU),
    (ADD_N, STAR_PACKED_ADD_N),
    (RING, RING_PACKED),
    (COLLECTIVE, RING_PACKED),
], ids=["cpu", "add_n", "ring", "collective", "cpu_packed", "add_n_packed",
        "ring_packed", "collective_packed"])
def test_traffic_of_a_tiny_model_is_what_its_design_moves(minimize_kwargs,
                                                         want):
  measured, _ = _tiny_traffic(**minimize_kwargs)
  assert measured["devices"] == want
  # The shards of x that /cpu:0 sends towers 1-3, counted apart.
  assert measured["input"] == {"bytes": 3 * 32, "tensors": 3}
  # The device check: each other tower's float32 read back, to the host.
  # Replicated, also the start-up's flag (a bool) to each other tower, for
  # the towers' gate and the update's; the copies it sets at the first step
  # move in no later one (traffic.in_startup).
  all_reduce = minimize_kwargs.get("all_reduce")
  flags = 2 * 3 if all_reduce else 0
  assert measured["other"] == {"bytes": 3 * 4 + flags, "tensors": 3 + flags}
  assert (measured["startup_sends"] > 0) == bool(all_reduce)
  assert measured["unsized"] == []
  assert measured["control_edges"] > 0
  pack_bytes = minimize_kwargs.get("pack_bytes", DEFAULT_PACK_BYTES)
  # Counted from the algorithm: 2 variables (or 1 pack) on 4 devices.
  if all_reduce == "collective":
    assert measured["collectives"] == (8 if pack_bytes == 0 else 4)
  else:
    assert measured["collectives"] == 0
  pattern = traffic.RING if all_reduce in ("ring", "collective") else (
      traffic.STAR)
  variables = [("/cpu:0", 64, "float32"), ("/cpu:0", 16, "float32")]
  expectation = traffic.expected(
      pattern, variables, ["/cpu:%d" % i for i in range(4)],
      pack_bytes=pack_bytes, replicated=all_reduce is not None)
  assert expectation == want


@pytest.mark.parametrize("num_towers", [2, 4])
@pytest.mark.parametrize("mode", [{}, ADD_N, RING, COLLECTIVE],
                         ids=["cpu", "add_n", "ring", "collective"])
def test_packed_and_unpacked_tensors_per_device_are_as_expected(mode,
                                                                num_towers):
  # Four small variables on the first tower's device: unpacked, packed in
  # part (32 bytes: b1 and b2 in one pack, w1 and w2 alone) and all packed.
  devices = ["/cpu:%d" % i for i in range(num_towers)]
  all_reduce = mode.get("all_reduce")
  pattern = traffic.RING if all_reduce in ("ring", "collective") else (
      traffic.STAR)
  sent = {}
  for pack_bytes in (0, 32, DEFAULT_PACK_BYTES):
    measured, variables = _tiny_traffic(_two_layers, num_towers,
                                        pack_bytes=pack_bytes, **mode)
    assert [v[1:] for v in variables] == [(64, "float32"), (16, "float32"),
                                          (64, "float32"), (16, "float32")]
    expectation = traffic.expected(pattern, variables, devices,
                                   pack_bytes=pack_bytes,
                                   replicated=all_reduce is not None)
    assert measured["devices"] == expectation, pack_bytes
    want = (traffic.expected_collectives(variables, devices,
                                         pack_bytes=pack_bytes)
            if all_reduce == "collective" else 0)
    assert measured["collectives"] == want
    sent[pack_bytes] = {d: f["sent_tensors"]
                        for d, f in measured["devices"].items()}
  # Each other tower sends a gradient per variable, then one per pack.
  last = "cpu:%d" % (num_towers - 1)
  per_reduction = 2 * (num_towers - 1) if pattern == traffic.RING else 1
  assert [sent[b][last] for b in (0, 32, DEFAULT_PACK_BYTES)] == [
      4 * per_reduction, 3 * per_reduction, per_reduction]
  if not mode:
    # The towers' reads are not packed: /cpu:0 sends each variable to each.
    assert sent[0]["cpu:0"] == sent[DEFAULT_PACK_BYTES]["cpu:0"] == (
        4 * (num_towers - 1))


def test_expected_packs_the_small_variables_of_one_device_and_dtype():
  variables = [("/cpu:0", 16, "float32"), ("/cpu:0", 8, "float16"),
               ("/cpu:0", 16, "float32"), ("/cpu:1", 16, "float32"),
               ("/cpu:0", 100, "float32"), ("/cpu:1", 12, "float32")]
  # Packs first (cpu:0's float32s, cpu:1's), then the rest in order: the
  # large one and the lone float16.
  assert traffic.reductions(variables, 2, 64) == [
      ("cpu:0", 32), ("cpu:1", 28), ("cpu:0", 8), ("cpu:0", 100)]
  assert traffic.reductions(variables, 2, 0) == [
      (traffic.device_name(d), b) for d, b, _ in variables]
  # One tower reduces nothing: nothing is packed.
  assert len(traffic.reductions(variables, 1, 64)) == len(variables)
  devices = ["/cpu:0", "/cpu:1"]
  star = traffic.expected(traffic.STAR, variables, devices, pack_bytes=64)
  unpacked = traffic.expected(traffic.STAR, variables, devices)
  # The same bytes as unpacked.
  for device in ("cpu:0", "cpu:1"):
    for field in ("sent_bytes", "received_bytes"):
      assert star[device][field] == unpacked[device][field]
  # cpu:0 sends its 4 variables' values (reads are not packed) and cpu:1's
  # 1 pack; cpu:1 sends its 2 variables and cpu:0's 3 (1 pack, 2 alone).
  assert star["cpu:0"]["sent_tensors"] == 4 + 1
  assert star["cpu:1"]["sent_tensors"] == 2 + 3
  assert unpacked["cpu:0"]["sent_tensors"] == 4 + 2
  # Replicated, the sums go out instead of the variables: one per reduction.
  replicated = traffic.expected(traffic.STAR, variables, devices,
                                pack_bytes=64, replicated=True)
  assert replicated["cpu:0"]["sent_tensors"] == 3 + 1
  assert replicated["cpu:1"]["sent_tensors"] == 1 + 3
  ring = traffic.expected(traffic.RING, variables, devices, pack_bytes=64)
  assert ring["cpu:0"]["sent_tensors"] == 2 * 4
  assert traffic.expected_collectives(variables, devices, pack_bytes=64) == 8
  assert traffic.expected_collectives(variables, devices) == 12
  assert traffic.expected_collectives(variables, ["/cpu:0"]) == 0


def test_traffic_expected_for_parameters_on_a_device_of_their_own():
  # Variables on /cpu:0 and 4 towers elsewhere (GPUs): 2NP through /cpu:0.
  expectation = traffic.expected(traffic.STAR, [("/cpu:0", 80)],
                                 ["/gpu:%d" % i for i in range(4)])
  assert traffic.busiest(expectation) == ("cpu:0", 2 * 4 * 80)
  assert expectation["gpu:3"] == _fields(80, 80, 1, 1)
  assert traffic.expected(traffic.NONE, [("/cpu:0", 80)], ["/cpu:0",
                                                            "/cpu:1"]) == {
      "cpu:0": _fields(0, 0, 0, 0), "cpu:1": _fields(0, 0, 0, 0)}


def _moved(devices, expectation, collectives=0, **summarize_kwargs):
  """A made-up traffic count of 4 towers, summarized as `run.run` does."""
  measured = {"devices": devices, "input": {"bytes": MIB, "tensors": 3},
              "other": {"bytes": 0, "tensors": 0}, "control_edges": 3,
              "collectives": collectives, "unsized": []}
  return traffic.summarize(measured, expectation, parameter_bytes=80 * MIB,
                           **summarize_kwargs)


def test_replicated_rows_get_speed_and_traffic_verdicts():
  results = _results(quick=False)
  devices = ["/cpu:%d" % i for i in range(4)]
  star = traffic.expected(traffic.STAR, [("/cpu:0", 80 * MIB)], devices)
  ring = traffic.expected(traffic.RING, [("/cpu:0", 80 * MIB)], devices)
  # The one-copy mode reads its 80 MiB one and a half times: 600 MiB
  # through /cpu:0 where 480 are expected.
  read_twice = {d: dict(f) for d, f in star.items()}
  read_twice["cpu:0"]["sent_bytes"] = 360 * MIB
  nothing = traffic.expected(traffic.NONE, [], devices)
  rows = results["throughput"][0]["rows"]
  rows += [dict(_row("towers", 4, 0.10), traffic=_moved(read_twice, star)),
           dict(_row("replicated_ring", 4, 0.10), traffic=_moved(ring, ring)),
           dict(_row("replicated_collective", 4, 0.20),
                traffic=_moved(ring, ring, collectives=8)),
           dict(_row("independent", 4, 0.10),
                traffic=_moved(nothing, nothing))]
  report.add_targets(results)
  verdicts = {(t["scope"], t["target"]): t for t in results["targets"]}

  def met(scope, target):
    return verdicts[("mnist %s" % scope, target)]["met"]

  assert met("replicated_ring x4", ">= 0.95x towers")
  assert not met("replicated_collective x4", ">= 0.95x towers")
  assert met("replicated_ring x4", ">= 0.95x independent")
  assert met("towers x4", ">= 0.95x independent")
  assert not met("replicated_collective x4", ">= 0.95x independent")
  # 240 MiB through each device of the ring against 600: 0.40x.
  ring_bytes = verdicts[("mnist replicated_ring x4",
                         "busiest device's bytes <= 0.50x towers'")]
  assert ring_bytes["met"] and "0.40x" in ring_bytes["detail"]
  within = "bytes within 10% of expected"
  assert not met("towers x4", within)
  assert "+25.0%" in verdicts[("mnist towers x4", within)]["detail"]
  assert met("replicated_ring x4", within)
  assert met("independent x4", within)
  assert ("mnist original x1", within) not in verdicts  # Not counted.
  table = report.markdown(results)
  assert "| replicated_collective * | 4 | 160.0 | cpu:0 240.0 (240.0) |" in (
      table)
  assert "| towers | 4 | 320.0 | cpu:0 600.0 (480.0) |" in table
  assert "cpu:0 360.0 / 240.0 (240.0 / 240.0); cpu:1 80.0 / 80.0" in table


def _packing_workload(name, seconds, num_towers=4, sent_more=0):
  """Made-up rows of a workload of 200 variables of 4 KiB on /cpu:0.

  `seconds`: variant -> its step time; `sent_more`: tensors the packed
  "cpu" row's busiest device sends beyond its design.
  """
  devices = ["/cpu:%d" % i for i in range(num_towers)]
  variables = [("/cpu:0", 4096, "float32")] * 200
  rows = [_row("plain", 1, 0.1)]
  for variant, step in seconds.items():
    packed = graphs.UNPACKED.get(variant, variant)
    pack_bytes = graphs.pack_bytes_in_effect(variant)
    replicated = packed != graphs.TOWERS
    pattern = traffic.RING if packed == graphs.REPLICATED_COLLECTIVE else (
        traffic.STAR)
    expectation = traffic.expected(pattern, variables, devices,
                                   pack_bytes=pack_bytes,
                                   replicated=replicated)
    measured = {d: dict(f) for d, f in expectation.items()}
    if variant == graphs.TOWERS:
      measured["cpu:0"]["sent_tensors"] += sent_more
    collectives = None
    if pattern == traffic.RING:
      collectives = traffic.expected_collectives(variables, devices,
                                                 pack_bytes=pack_bytes)
    rows.append(dict(_row(variant, num_towers, step), traffic=_moved(
        measured, expectation, collectives or 0, pack_bytes=pack_bytes,
        expected_collectives=collectives)))
  return {"workload": name, "title": name, "global_batch": 32,
          "rounds": {"foreign_cores": [0.0], "repeated_rounds": 0},
          "rows": rows}


def _sweep():
  """A made-up pack_bytes sweep of 2 sizes."""
  def side(seconds, pack_bytes, tensors):
    return {"median_step_sec": seconds, "q1_step_sec": seconds,
            "q3_step_sec": seconds, "step_seconds": [seconds] * 4,
            "examples_per_sec": 16 / seconds, "pack_bytes": pack_bytes,
            "tensors": tensors, "expected_tensors": tensors}
  rows = []
  for size, packed, unpacked in [(1024, 0.010, 0.020), (262144, 0.030,
                                                        0.025)]:
    count = packing.num_variables(size)
    rows.append({"size_bytes": size, "num_variables": count,
                 "parameter_bytes": count * size,
                 "packed": side(packed, size, 3 * count + 3),
                 "unpacked": side(unpacked, 0, 6 * count),
                 "ratio": unpacked / packed,
                 "ratio_interval": [unpacked / packed] * 2})
  return {"num_towers": 4, "global_batch": 16, "variable_device": "cpu",
          "rows": rows, "rounds": {"foreign_cores": [0.0],
                                   "repeated_rounds": 0}}


def test_the_sweep_keeps_the_parameter_bytes_about_constant():
  assert [packing.num_variables(k * 1024) for k in (1, 4, 16, 64, 256)] == [
      200, 200, 200, 64, 16]
  assert packing.num_variables(4 << 20) == 8
  assert packing.num_variables(1024, high=8) == 8
  with pytest.raises(ValueError, match="multiples of 4"):
    packing.build(sizes=[1022], num_towers=2, global_batch=4, num_devices=2)


def test_many_small_is_200_variables_of_4_kib():
  workload = workloads.WORKLOADS["many_small"]
  assert workload.title == "Many small variables (200 x 1024 floats)"
  images, labels = workloads.synthetic_batch(workload, 4)
  assert images.shape == (4, 1024) and labels.shape == (4,)
  with tf.Graph().as_default():
    loss = workload.loss_fn(tf.constant(images), tf.constant(labels))
    assert loss.shape == []
    variables = tf.trainable_variables()
  assert len(variables) == 200
  assert {tuple(v.shape.as_list()) for v in variables} == {(1024,)}
  assert variables[0].name == "layer_0/scale:0"
  with pytest.raises(ValueError, match="even number of variables"):
    workloads.small_variables(256, 7)
  with pytest.raises(ValueError, match="at least 10 floats"):
    workloads.small_variables(8, 2)


def test_packing_rows_get_their_targets_and_a_section():
  results = _results(quick=False)
  results["throughput"][0]["rows"] += [
      # MNIST at 2 towers: packed 0.99x unpacked (met), add_n 0.95x (not).
      _row("towers", 2, 0.099), _row("towers_unpacked", 2, 0.098),
      _row("replicated_add_n", 2, 0.100), _row("replicated_add_n_unpacked",
                                               2, 0.095)]
  results["throughput"].append(_packing_workload("many_small", {
      "towers": 0.080, "towers_unpacked": 0.100,  # 1.25x: met.
      "replicated_add_n": 0.090, "replicated_add_n_unpacked": 0.100,
      "replicated_collective": 0.050, "replicated_collective_unpacked": 0.200,
  }, sent_more=1))
  results["packing_sweep"] = _sweep()
  report.add_targets(results)
  verdicts = {(t["scope"], t["target"]): t for t in results["targets"]}

  def met(scope, target):
    return verdicts[(scope, target)]["met"]

  assert met("mnist towers x2", ">= 0.98x towers_unpacked")
  assert not met("mnist replicated_add_n x2",
                 ">= 0.98x replicated_add_n_unpacked")
  assert met("many_small towers x4", ">= 1.15x towers_unpacked")
  assert not met("many_small replicated_add_n x4",
                 ">= 1.15x replicated_add_n_unpacked")
  assert met("many_small replicated_collective x4",
             ">= 1.15x replicated_collective_unpacked")
  tensors = "busiest device's tensors <= expected"
  # The packed "cpu" row sends one tensor more than its design.
  assert not met("many_small towers x4", tensors)
  assert ("cpu:0 604, expected 603; unpacked 1200"
          in verdicts[("many_small towers x4", tensors)]["detail"])
  assert met("many_small replicated_add_n x4", tensors)
  assert met("many_small replicated_collective x4", tensors)
  # The unpacked twins get no packing target of their own.
  assert not [k for k, t in verdicts.items()
              if "unpacked x" in k[0] and t.get("packing")]
  assert not [k for k in verdicts if k[0] == "many_small towers x1"]
  table = report.markdown(results)
  assert "### Gradient packing: packed against pack_bytes=0\n" in table
  assert "the library's default pack_bytes, 16 KiB" in table
  assert ("| many_small | towers | 4 | 1.250x [1.250, 1.250] | cpu:0 604 "
          "(603) | 1200 (1200) | 604 (603) | 1200 (1200) | - | - | "
          ">= 1.15x towers_unpacked: met") in table
  assert ("| many_small | replicated_collective | 4 | 4.000x [4.000, 4.000] "
          "| cpu:0 12 (12) | 2400 (2400) | 24 (24) | 4800 (4800) | 4 (4) | "
          "800 (800) |") in table
  assert "| 1 KiB | 200 | 0.20 | 10.0 [10.0, 10.0] | 20.0 [20.0, 20.0] |" in (
      table)
  assert "| 256 KiB | 16 | 4.00 |" in table


def test_quick_packing_section_gives_no_verdicts():
  results = _results(quick=True)
  results["throughput"].append(_packing_workload("many_small", {
      "towers": 0.080, "towers_unpacked": 0.100}))
  results["packing_sweep"] = _sweep()
  report.add_targets(results)
  assert results["targets"] == []
  table = report.markdown(results)
  assert "### Gradient packing: packed against pack_bytes=0 (quick run)" in (
      table)
  assert "### pack_bytes sweep: 4 towers, variables on /cpu:0, global batch " \
      "16 (quick run)" in table
  assert not VERDICT.search(table)


# The benchmark's batch-norm CNN: 6 layers of 16, 16, 16, 32, 32 and 32
# channels, each summing 1 + 2C floats forward and 2C in the gradient:
# 3 x 65 + 3 x 129 = 582 floats = 2328 bytes per device per step.
BN_SUMMED_BYTES = 2328


def _check_batch_norm_rows(section, tower_counts):
  """Every row's counts, measured from one step, are the prediction's."""
  assert [r["num_towers"] for r in section["rows"]] == tower_counts
  for row in section["rows"]:
    n, sync, alone = row["num_towers"], row["sync"], row["per_tower"]
    assert row["expected"] == batch_norm.expected(n)
    # Between CPU devices the sums are on tower 0's device: each other
    # tower's vectors go there and back, and nothing else differs.
    assert sync["collectives"] == row["expected"]["collectives"] == 0
    assert row["sum_bytes"] == {
        "cpu:%d" % i: BN_SUMMED_BYTES * (2 * (n - 1) if i == 0 else 2)
        for i in range(n)}
    assert max(row["sum_bytes"].values()) == row["expected"]["busiest_bytes"]
    assert alone["collectives"] == 0
    assert sync["steps_timed"] > 0 and alone["steps_timed"] > 0
    assert row["step_time_ratio"] == pytest.approx(
        sync["median_step_sec"] / alone["median_step_sec"])


def test_batch_norm_prediction_follows_the_layer_shapes():
  with tf.Graph().as_default():
    workload = batch_norm.model(batch_norm.sync_batch_norm, "bn", "BN")
    images, labels = workloads.synthetic_batch(workload, 4)
    loss = workload.loss_fn(tf.constant(images), tf.constant(labels))
    assert loss.shape == []
    gammas = [v for v in tf.trainable_variables()
              if v.op.name.endswith("/gamma")]
  assert [v.shape.as_list() for v in gammas] == [
      [c] for c in batch_norm.BN_CHANNELS] == [[16]] * 3 + [[32]] * 3
  assert batch_norm.expected(1) == {
      "sums_per_device": 0, "collectives": 0,
      "summed_bytes_per_device": 0, "busiest_bytes": 0.0}
  assert batch_norm.expected(2) == {
      "sums_per_device": 12, "collectives": 0,
      "summed_bytes_per_device": BN_SUMMED_BYTES,
      "busiest_bytes": 2 * BN_SUMMED_BYTES}
  assert batch_norm.expected(4)["busiest_bytes"] == 6 * BN_SUMMED_BYTES
  # Between GPUs: a ring, 2(N-1)/N of each vector sent and as much received.
  assert batch_norm.expected(2, collective=True) == {
      "sums_per_device": 12, "collectives": 24,
      "summed_bytes_per_device": BN_SUMMED_BYTES,
      "busiest_bytes": 2 * BN_SUMMED_BYTES}
  assert batch_norm.expected(4, collective=True)["busiest_bytes"] == (
      3 * BN_SUMMED_BYTES)
  assert batch_norm.expected(4, [3])["summed_bytes_per_device"] == (7 + 6) * 4


def test_fused_fallback_normalizes_each_batch_alone_as_tf_layers_does():
  x = np.random.RandomState(0).normal(2.0, 3.0, (4, 3, 3, 2)).astype(
      np.float32)
  with tf.Graph().as_default():
    y = batch_norm.fused_batch_norm(tf.constant(x), "bn")
    updates = tf.get_collection(tf.GraphKeys.UPDATE_OPS)
    variables = {v.op.name: v for v in tf.global_variables()}
    with tf.Session() as session:
      session.run(tf.global_variables_initializer())
      got, _ = session.run([y, updates])
      values = session.run(variables)
  assert sorted(values) == ["bn/beta", "bn/gamma", "bn/moving_mean",
                            "bn/moving_variance"]
  mean, variance = x.mean((0, 1, 2)), x.var((0, 1, 2))
  np.testing.assert_allclose(
      got, (x - mean) / np.sqrt(variance + batch_norm.EPSILON), atol=1e-4)
  # tf.layers' update (momentum 0.99), with the kernel's unbiased variance
  # (n = 36 values per channel).
  np.testing.assert_allclose(values["bn/moving_mean"], 0.01 * mean,
                             rtol=1e-4)
  np.testing.assert_allclose(values["bn/moving_variance"],
                             0.99 + 0.01 * variance * 36 / 35, rtol=1e-4)


def test_the_batch_norm_comparison_runs_alone(tmp_path):
  # Every other section skipped (empty sizes); in this process, which did
  # not ask for tf_keras, the per-tower rows may use the fused fallback.
  results = run.run(
      out_dir=str(tmp_path), workload_names=[], tower_counts=[],
      global_batches={}, warmup=1, rounds=2, steps=1, averaging_shape=[],
      averaging_rounds=1, averaging_peak_towers=[], build_workload="mnist",
      build_counts=[], build_repeats=1, quick=True, batch_norm_towers=[2],
      batch_norm_batch=4)
  assert set(results) >= {"throughput", "batch_norm"}
  assert results["throughput"] == []
  assert "average_gradients" not in results and "build" not in results
  section = results["batch_norm"]
  _check_batch_norm_rows(section, [2])
  assert results["settings"]["num_devices"] == 2
  table = (tmp_path / "results.md").read_text()
  assert ("### Synchronized batch norm against per-tower: ResNet-ish CIFAR "
          "CNN") in table
  assert re.search(r"^\| 2 \| .* \| 0 \(0\) \| 4656 \(4656\) \| "
                   r"%s" % re.escape(section["per_tower"]), table, re.M)
  if section["per_tower_reason"]:
    assert section["per_tower"] == batch_norm.FUSED
    assert "tf.nn.fused_batch_norm (fallback) |" in table
    assert "TF_USE_LEGACY_KERAS=1" in table
  assert not (tmp_path / "examples_per_sec.png").exists()


def _fast_paths(staged_seconds=0.104, xla_unsized=()):
  """Made-up fast-path rows: MNIST staged at 2 and 4 towers, unstaged at
  0.1 s; float32, bfloat16 (not run), float16 and XLA at 2 towers."""
  def side(seconds, **more):
    return {"median_step_sec": seconds, "q1_step_sec": seconds,
            "q3_step_sec": seconds, "step_seconds": [seconds] * 4,
            "examples_per_sec": 256 / seconds, "first_step_sec": 10 * seconds,
            "busiest_device": "cpu:0", "busiest_bytes": 2 * MIB,
            "expected_busiest_bytes": 2 * MIB, "input_bytes": 0,
            "input_tensors": 0, "unsized": [], **more}
  rounds = {"foreign_cores": [0.0], "repeated_rounds": 0}
  cpus = {"2": ["/cpu:0", "/cpu:1"]}
  staging = [{"workload": "mnist", "num_towers": n,
              "staged": side(seconds), "unstaged": side(0.1),
              "ratio": 0.1 / seconds, "ratio_interval": [0.1 / seconds] * 2}
             for n, seconds in ((2, staged_seconds), (4, 0.2))]
  precision = [
      dict(side(0.1), workload="mnist", num_towers=2, variant="float32",
           title=fast_paths.TITLES["float32"], loss_scale=None,
           ratio_to_float32=1.0, ratio_interval=[1.0, 1.0],
           first_step_ratio=1.0),
      {"workload": "mnist", "num_towers": 2, "variant": "bfloat16",
       "title": fast_paths.TITLES["bfloat16"], "loss_scale": None,
       "not_run": "no DT_BFLOAT16 kernel for LRN on these devices (node "
                  "tower_0/norm1)"},
      dict(side(0.4), workload="mnist", num_towers=2, variant="float16",
           title=fast_paths.TITLES["float16"], loss_scale="dynamic",
           ratio_to_float32=0.25, ratio_interval=[0.2, 0.3],
           first_step_ratio=4.0),
      dict(side(0.05, unsized=list(xla_unsized)), workload="mnist",
           num_towers=2, variant="xla", title=fast_paths.TITLES["xla"],
           loss_scale=None, ratio_to_float32=2.0, ratio_interval=[1.8, 2.2],
           first_step_ratio=0.5)]
  return {"workloads": ["mnist"],
          "staging": {"global_batch": 256, "rows": staging, "devices": cpus,
                      "rounds": rounds},
          "precision": {"global_batch": 64, "rows": precision,
                        "devices": cpus, "rounds": rounds}}


def test_staged_inputs_get_their_target_and_the_precisions_none():
  results = _results(quick=False)
  # 2 towers: 0.962x unstaged, met; 4 towers: 0.5x, not met.
  results["fast_paths"] = _fast_paths(xla_unsized=["cluster_1_1/merge"])
  report.add_targets(results)
  verdicts = {(t["scope"], t["target"]): t for t in results["targets"]}
  assert verdicts[("fast_paths mnist staged x2",
                   "staged >= 0.95x unstaged")]["met"]
  assert not verdicts[("fast_paths mnist staged x4",
                       "staged >= 0.95x unstaged")]["met"]
  assert not [k for k in verdicts if "float" in k[0] or "xla" in k[0]]
  table = report.markdown(results)
  assert "### Fast paths: staged inputs against unstaged, global batch 256" \
      in table
  assert ("| mnist | 2 | 104.0 [104.0, 104.0] | 100.0 [100.0, 100.0] | "
          "0.962x [0.962, 0.962] | 0.00 / 0.00 | 2.0 / 2.0 (2.0) | staged >= "
          "0.95x unstaged: met (0.962x [0.962, 0.962])") in table
  assert "staged >= 0.95x unstaged: **not met** (0.500x" in table
  assert ("| mnist | bfloat16 (compute_dtype) | 2 | not run: no DT_BFLOAT16 "
          "kernel for LRN on these devices (node tower_0/norm1) |") in table
  assert ("| mnist | float16 (compute_dtype, dynamic loss scaling) | 2 | "
          "640.0 | 0.250x [0.200, 0.300] | 400.0 [400.0, 400.0] | 4.00 "
          "(4.00x) | 2.0 (2.0) |") in table
  assert "| 0.50 (0.50x) | 2.0 + 1 tensors of unknown size (2.0) |" in table
  assert "On virtual CPU devices (2 towers: /cpu:0, /cpu:1)" in table
  assert "overhead only" in table


def test_quick_fast_paths_give_no_verdicts():
  results = _results(quick=True)
  results["fast_paths"] = _fast_paths()
  report.add_targets(results)
  assert results["targets"] == []
  assert all(row["targets"] == []
             for row in results["fast_paths"]["staging"]["rows"])
  table = report.markdown(results)
  assert "global batch 256 (quick run)" in table
  assert "global batch 64 (quick run)" in table
  assert not VERDICT.search(table)


def test_a_missing_kernel_is_a_reason_and_another_error_is_none():
  message = ("No OpKernel was registered to support Op 'LRN' used by "
             "{{node tower_0/norm1}} with these attrs: [alpha=0.0001, bias=1, "
             "depth_radius=4, T=DT_BFLOAT16, beta=0.75]\nRegistered devices: "
             "[CPU]")
  assert fast_paths.missing_kernel(tf.errors.InvalidArgumentError(
      None, None, message)) == (
          "no DT_BFLOAT16 kernel for LRN on these devices (node "
          "tower_0/norm1)")
  assert fast_paths.missing_kernel(tf.errors.InvalidArgumentError(
      None, None, "Incompatible shapes: [2] vs. [3]")) is None


@pytest.mark.parametrize("compute_dtype", ["bfloat16", "float16"])
def test_a_cnn_in_half_precision_keeps_float32_variables_of_its_names(
    compute_dtype):
  def variables(workload, **kwargs):
    images, labels = workloads.synthetic_batch(workload, 4)
    with tf.Graph().as_default():
      towers.build_towers(
          lambda scope, x, y: workload.loss_fn(x, y),
          tf.train.GradientDescentOptimizer(0.1), 2,
          inputs=(tf.constant(images), tf.constant(labels)),
          devices=["/cpu:0", "/cpu:0"], **kwargs)
      return [(v.op.name, v.dtype.base_dtype, v.shape.as_list())
              for v in tf.trainable_variables()]

  for name in fast_paths.WORKLOADS:
    workload = workloads.WORKLOADS[name]
    half = workloads.computing_in(workload, compute_dtype)
    assert half.name == name and half.title.endswith(compute_dtype)
    assert variables(half, compute_dtype=compute_dtype) == variables(
        workload)
  assert workloads.computing_in(workload, "float32") is workload
  with pytest.raises(ValueError, match="expected a CNN workload"):
    workloads.computing_in(workloads.WORKLOADS["many_small"], "float16")


def test_minimize_arguments_and_a_dataset_only_for_minimized_variants():
  workload = workloads.WORKLOADS["mnist"]
  images, labels = workloads.synthetic_batch(workload, 4)
  for kwargs in ({"minimize_kwargs": {"stage_inputs": True}},
                 {"dataset": True}):
    with pytest.raises(ValueError, match="only for a variant towers.minimize"):
      graphs.GraphStep(workload, graphs.PLAIN, 1, images, labels, 1,
                       **kwargs)


def test_across_workers_runs_alone_and_counts_what_crosses_tasks(tmp_path):
  # Every other section skipped; six processes (a ps, 2 + 2 workers, the
  # baseline) on loopback, a batch of 2 per tower.
  results = run.run(
      out_dir=str(tmp_path), workload_names=[], tower_counts=[],
      global_batches={}, warmup=1, rounds=2, steps=1, averaging_shape=[],
      averaging_rounds=1, averaging_peak_towers=[], build_workload="mnist",
      build_counts=[], build_repeats=1, quick=True,
      across_workers_workload="mnist", across_workers_batch=2,
      across_workers_measure_steps=2, chart=False)
  section = results["across_workers"]
  assert (section["workload"], section["per_tower_batch"]) == ("mnist", 2)
  rows = {r["kind"]: r for r in section["rows"]}
  assert list(rows) == list(across_workers.KINDS)
  size = 4 * 3274634  # The MNIST CNN's parameters, P.
  for kind, row in rows.items():
    assert row["parameter_bytes"] == size, kind
    assert row["global_batch"] == 8, kind
    assert row["steps_timed"] == 2, kind
    assert row["examples_per_sec"] > 0 and row["ratio_to_baseline"] > 0
  base, ps, ring = rows["baseline"], rows["ps"], rows["collective"]
  assert (base["num_workers"], base["towers_per_worker"]) == (1, 4)
  assert base["ratio_to_baseline"] == 1.0
  assert base["expected"] is None and base["measured"] is None
  for row in (ps, ring):
    assert (row["num_workers"], row["towers_per_worker"]) == (2, 2)
    assert sorted(row["counted"]) == ["worker:0", "worker:1"]
  # Around the ring of 4: 2 x 3/4 P each way per worker, exactly; 4
  # collectives on each of its 2 devices, as in one process at 2 towers.
  for task, counted in ring["counted"].items():
    assert counted["ring_bytes"] == 1.5 * size, task
    assert counted["sent_bytes"] == counted["received_bytes"] == 1.5 * size
    assert counted["collectives"] == 2 * 4, task
  assert ring["expected"]["sent_bytes"] == 1.5 * size
  # With a ps: the averaged gradient out, P; the variables in: each tower
  # reads each one once, 2P (the weight decay runs on the ps, next to the
  # weights it reads). The token and the local step the accumulators take:
  # 8 + 8 x 8 bytes.
  for task, counted in ps["counted"].items():
    assert counted["sent_bytes"] == size, task
    assert counted["received_bytes"] == 2 * size, task
    assert counted["other_bytes"] == 8 + 8 * 8, task
    assert counted["ring_bytes"] == 0 and counted["unsized"] == [], task
  assert ps["expected"] == {"sent_bytes": size, "received_bytes": size}
  # The kernel's TCP bytes agree with the counts within gRPC's overhead.
  if ps["measured"] is not None:
    for row in (ps, ring):
      for task, counted in row["counted"].items():
        for field in ("sent_bytes", "received_bytes"):
          assert row["measured"][task][field] == pytest.approx(
              counted[field], rel=0.02), (row["kind"], task, field)
  table = (tmp_path / "results.md").read_text()
  assert ("### Across workers: MNIST CNN, 2 workers x 2 towers against 1 x "
          "4, 2 per tower (global batch 8) (quick run)") in table
  assert re.search(r"^\| 2 workers x 2 towers, collective all-reduce "
                   r"\(replicated\) \| 2 x 2 \| .* \| worker:0 18\.7 / 18\.7; "
                   r"worker:1 18\.7 / 18\.7 \| .* \| 18\.7 / 18\.7 \|$",
                   table, re.M)
  assert "| 1 worker x 4 towers (one process, variables on /cpu:0) | 1 x 4 |" \
      in table
  assert not VERDICT.search(table)


def _send(name, tensor, source, target):
  """A partition graph's ``_Send`` of `tensor` from `source` to `target`."""
  node = tf.NodeDef(name=name, op="_Send", input=[tensor])
  node.attr["send_device"].s = source.encode()
  node.attr["recv_device"].s = target.encode()
  return node


def _read_and_gradient(variable_device, gradient_device):
  """A graph of a 64-byte variable, its read, and a "gradient" on another
  device: ``(graph, w, read, grad)``."""
  graph = tf.Graph()
  with graph.as_default():
    with tf.device(variable_device):
      w = tf.get_variable("w", [4, 4])
    read = w.value()
    with tf.device(gradient_device):
      grad = tf.identity(read * 2.0, name="grad")
  return graph, w, read, grad


def test_sends_between_tasks_are_counted_by_task():
  graph, w, read, grad = _read_and_gradient("/job:ps/task:0/cpu:0",
                                            "/job:worker/task:1/cpu:0")
  ps0 = "/job:ps/replica:0/task:0/device:CPU:0"
  w1 = "/job:worker/replica:0/task:1/device:CPU:%d"
  partition = tf.GraphDef(node=[
      _send("a", read.name, ps0, w1 % 0),
      _send("b", grad.name, w1 % 0, w1 % 1),  # Within one task: not counted.
      _send("c", grad.name, w1 % 1, ps0)])
  moved = traffic.count([partition], graph, [w], [], tasks=True)
  assert moved["devices"] == {
      "ps:0": _fields(64, 64, 1, 1), "worker:1": _fields(64, 64, 1, 1)}
  # By device name alone, the tasks' devices are one: the ps's send to
  # worker 1's cpu:0 is not counted, the send within worker 1 is.
  by_device = traffic.count([partition], graph, [w], [])
  assert by_device["devices"] == {
      "cpu:0": _fields(64, 64, 1, 1), "cpu:1": _fields(64, 64, 1, 1)}
  assert traffic.task_name("/cpu:3") == "local"
  # A ring of 4 over 2 tasks crosses once from each: 3/2 of a member's sum.
  assert across_workers.ring_across({"cpu:0": 80, "cpu:1": 80}, 4) == 120
  assert across_workers.ring_across({"cpu:0": 80}, 1) == 0


def test_tcp_bytes_are_read_per_process_from_ss():
  text = (
      "ESTAB 0 0 [::ffff:127.0.0.1]:34741 [::ffff:127.0.0.1]:59560 "
      "users:((\"python\",pid=28373,fd=10))\n"
      "\t bbr wscale:10,10 bytes_sent:4294 bytes_retrans:589 "
      "bytes_acked:3705 bytes_received:256865 segs_out:6870\n"
      "ESTAB 0 0 127.0.0.1:40319 127.0.0.1:55722 "
      "users:((\"python\",pid=28375,fd=11))\n"
      "\t cubic wscale:7,7 rto:204 segs_out:3\n")
  assert across_workers.parse_ss(text) == [
      across_workers.Socket((28373,), 3705, 256865),
      across_workers.Socket((28375,), 0, 0)]


def _tiny_update(accumulate_steps, variable_device="replicated"):
  """Counts one applied update of `_linear` on 4 towers (`_tiny_traffic`'s).

  Returns:
    ``(counted, variables, global_step)``: `accumulation.count_update`'s
    result, the variables as for `traffic.expected`, and the global step
    after the counted update.
  """
  devices = ["/cpu:%d" % i for i in range(4)]
  graph = tf.Graph()
  with graph.as_default():
    with tf.device("/cpu:0"):
      x = tf.constant(np.arange(32, dtype=np.float32).reshape([8, 4]))
    step = tf.train.get_or_create_global_step()
    train_op, built = towers.minimize(
        _linear, tf.train.GradientDescentOptimizer(0.1), 4, inputs=x,
        devices=devices, variable_device=variable_device, global_step=step,
        accumulate_steps=accumulate_steps)
    variables = traffic.variable_rows(tf.trainable_variables())
    counted = accumulation.parameters(graph, built.applies)
    init = tf.global_variables_initializer()
    local_init = tf.local_variables_initializer()
  config = towers.virtual_cpu_config(4, operation_timeout_in_ms=60000)
  with tf.Session(graph=graph, config=config) as session:
    session.run(init)
    session.run(local_init)
    moved = accumulation.count_update(session, train_op, built.applies,
                                      graph, counted, [x], accumulate_steps)
    # The update counted was the one applied; the next run starts another.
    assert not accumulate_steps > 1 or not session.run(built.applies)
    return moved, variables, int(session.run(step))


NOTHING = _fields(0, 0, 0, 0)


def test_an_accumulated_update_moves_one_reduction_per_k_micro_batches():
  # Replicated, add_n, packed: each copy's pack to /cpu:0, the sum back
  # (STAR_PACKED_ADD_N), per update whatever k.
  one, variables, step = _tiny_update(1)
  assert step == 1 and one["runs"] == 0 and one["non_applying"] is None
  assert one["applying"]["devices"] == STAR_PACKED_ADD_N
  assert one["per_update"] == STAR_PACKED_ADD_N
  four, _, step = _tiny_update(4)
  # 3 runs that accumulate, then the counted one, which applied.
  assert step == 1 and four["runs"] == 3
  applying, quiet_run = four["applying"], four["non_applying"]
  assert applying["devices"] == STAR_PACKED_ADD_N
  assert applying["skipped"] == 0
  # The apply branch's 6 sends (3 packs in, 3 sums out), and the start-up
  # flag of the update inside it (a bool to each other tower), are in the
  # partition graphs of every run; left out, nothing of the parameters
  # crosses. Everything else counts alike: the input shards, the device
  # check's floats, the cond's predicate and the towers' start-up flag (a
  # bool to each other tower each).
  assert quiet_run["skipped"] == 6 + 3
  assert quiet_run["devices"] == {}
  assert quiet_run["input"] == applying["input"]
  assert quiet_run["other"] == {"bytes": 3 * 4 + 3 + 3, "tensors": 9}
  assert applying["input"] == {"bytes": 3 * 32, "tensors": 3}
  assert applying["other"] == {"bytes": 3 * 4 + 3 + 2 * 3, "tensors": 12}
  assert four["per_update"] == STAR_PACKED_ADD_N
  expectation = accumulation.expected_update(
      variables, ["/cpu:%d" % i for i in range(4)], "replicated", "add_n", 4)
  assert expectation == STAR_PACKED_ADD_N
  # Per example (8 per run): exactly a quarter at k=4.
  per_example = {k: fractions.Fraction(
      int(traffic.busiest(moved["per_update"])[1]), 8 * k)
                 for k, moved in ((1, one), (4, four))}
  assert per_example[1] == fractions.Fraction(480, 8)
  assert per_example[4] / per_example[1] == fractions.Fraction(1, 4)
  summary = accumulation.summary(four, expectation, parameter_bytes=80,
                                 examples_per_update=32, accumulate_steps=4)
  assert summary["bytes_per_example"] == 15.0
  assert summary["non_applying_busiest_bytes"] == 0
  assert summary["non_applying_skipped"] == 6 + 3
  assert summary["input_bytes_per_update"] == 4 * 3 * 32


def test_with_one_copy_the_towers_read_the_variables_every_micro_batch():
  one, _, _ = _tiny_update(1, "cpu")
  assert one["per_update"] == STAR_PACKED_CPU
  four, variables, step = _tiny_update(4, "cpu")
  assert step == 1
  # A run that does not apply: /cpu:0 sends w and b to the 3 other towers
  # (6 tensors, 240 bytes); the gradients' 3 packs cross once per update.
  assert four["non_applying"]["devices"] == {
      "cpu:0": _fields(240, 0, 6, 0),
      **{"cpu:%d" % i: _fields(0, 80, 0, 2) for i in (1, 2, 3)}}
  assert four["non_applying"]["skipped"] == 3
  want = {"cpu:0": _fields(4 * 240, 240, 4 * 6, 3),
          **{"cpu:%d" % i: _fields(80, 4 * 80, 1, 4 * 2) for i in (1, 2, 3)}}
  assert four["per_update"] == want
  assert accumulation.expected_update(
      variables, ["/cpu:%d" % i for i in range(4)], "cpu", None, 4) == want
  # 1200 bytes through /cpu:0 per 32 examples against 480 per 8: 0.625x.
  assert fractions.Fraction(1200, 32) / fractions.Fraction(480, 8) == (
      fractions.Fraction(5, 8))
  assert traffic.busiest(four["per_update"]) == ("cpu:0", 1200)


def test_a_skipped_send_or_collective_is_in_no_count():
  graph, w, read, grad = _read_and_gradient("/cpu:0", "/cpu:1")
  cpu = "/job:localhost/replica:0/task:0/device:CPU:%d"
  partition = tf.GraphDef(node=[_send("a", read.name, cpu % 0, cpu % 1),
                                _send("b", grad.name, cpu % 1, cpu % 0)])
  every = traffic.count([partition], graph, [w], [])
  assert every["skipped"] == 0
  assert every["devices"] == {"cpu:0": _fields(64, 64, 1, 1),
                              "cpu:1": _fields(64, 64, 1, 1)}
  some = traffic.count([partition], graph, [w], [],
                       skip=lambda op: op.name == "grad")
  assert some["skipped"] == 1
  assert some["devices"] == {"cpu:0": _fields(64, 0, 1, 0),
                             "cpu:1": _fields(0, 64, 0, 1)}


def test_a_sum_grappler_rewrote_is_counted_as_the_op_it_replaces():
  graph = tf.Graph()
  with graph.as_default():
    with tf.device("/cpu:0"):
      w = tf.get_variable("w", [4, 4])
      # A chain of adds: Grappler makes it a tree with a name of its own.
      total = w * 1.0 + w * 2.0 + w * 3.0 + w * 4.0
    with tf.device("/cpu:1"):
      out = tf.reduce_sum(total * 5.0)
  with tf.Session(graph=graph,
                  config=towers.virtual_cpu_config(
                      2, operation_timeout_in_ms=60000)) as session:
    session.run(w.initializer)
    run_metadata = tf.RunMetadata()
    # The op, not its value: nothing goes back to the client.
    session.run(out.op, options=tf.RunOptions(output_partition_graphs=True),
                run_metadata=run_metadata)
  sent = [n.input[0] for p in run_metadata.partition_graphs for n in p.node
          if n.op == "_Send"]
  assert any("ArithmeticOptimizer/" in name for name in sent), sent
  moved = traffic.count(run_metadata.partition_graphs, graph, [w], [])
  assert moved["unsized"] == []
  assert moved["devices"] == {"cpu:0": _fields(64, 0, 1, 0),
                              "cpu:1": _fields(0, 64, 0, 1)}


def test_the_apply_branch_is_found_from_the_train_op():
  with tf.Graph().as_default():
    x = tf.constant(np.ones([4, 4], np.float32))
    train_op, built = towers.minimize(
        _linear, tf.train.GradientDescentOptimizer(0.1), 2, inputs=x,
        devices=["/cpu:0", "/cpu:1"], variable_device="replicated",
        accumulate_steps=2)
    skip = accumulation.in_apply_branch(accumulation.apply_context(train_op))
    ops = tf.get_default_graph().get_operations()
    skipped = [op for op in ops if skip(op)]
    # The reduction and the update of both copies are in it (some named
    # outside the cond's scope: the context decides, not the name); the
    # towers, the accumulators' adds and the other branch's count are not.
    assert any(op.type == "AddV2" and "average_gradients" in op.name
               for op in skipped)
    updates = [op for op in ops if op.type == "ResourceApplyGradientDescent"]
    assert len(updates) == 4 and all(map(skip, updates))
    adds = [op for op in ops if op.type == "AssignAddVariableOp"]
    # 2 variables x 2 towers, and the counter's (in the other branch).
    assert len(adds) == 5 and not any(map(skip, adds))
    assert not [op for op in ops if op.name.startswith("tower_") and skip(op)]
    assert not skip(built.applies.op)
  with tf.Graph().as_default():
    one_op, _ = towers.minimize(
        _linear, tf.train.GradientDescentOptimizer(0.1), 2,
        inputs=tf.constant(np.ones([4, 4], np.float32)),
        devices=["/cpu:0", "/cpu:1"], variable_device="replicated")
    with pytest.raises(ValueError, match="Merge"):
      accumulation.apply_context(one_op)
  assert accumulation.steps_with_one([4, 2]) == [1, 2, 4]
  with pytest.raises(ValueError, match="at least 1"):
    accumulation.steps_with_one([0])


def _accumulation_section(speed_4=0.96, bytes_4=None):
  """Made-up accumulation rows at 4 towers: k=1 and k=4, 2 per tower.

  `speed_4`: k=4's examples/sec over k=1's; `bytes_4`: k=4's bytes through
  the busiest device per update (default: k=1's, a quarter per example).
  """
  def row_of(variant, k, batch, seconds, busiest, timed=True):
    examples = 4 * batch * k
    moved = {"parameter_bytes": 80 * MIB, "busiest_device": "cpu:0",
             "busiest_bytes": busiest, "expected_busiest_bytes": 6 * 80 * MIB,
             "bytes_per_example": busiest / examples,
             "expected_bytes_per_example": 6 * 80 * MIB / examples,
             "non_applying_busiest_bytes": 0 if k > 1 else None,
             "unsized": []}
    row = {"variant": variant, "num_towers": 4, "accumulate_steps": k,
           "per_tower_batch": batch, "examples_per_update": examples,
           "all_reduce": "add_n", "timed": timed, "traffic": moved}
    if timed:
      row.update(median_step_sec=seconds, q1_step_sec=seconds,
                 q3_step_sec=seconds, step_seconds=[seconds] * 4,
                 examples_per_sec=examples / seconds)
    return row
  p6 = 6 * 80 * MIB
  rows = [row_of("accumulated", 1, 2, 0.1, p6),
          row_of("accumulated", 4, 2, 0.4 / speed_4,
                 p6 if bytes_4 is None else bytes_4),
          row_of("plain", 1, 8, 0.2, p6)]
  counted = [row_of("cpu", 1, 2, None, p6, timed=False),
             row_of("cpu", 4, 2, None, 2.5 * p6, timed=False)]
  return {"title": "MNIST CNN", "per_tower_batch": 2,
          "accumulate_steps": [1, 4], "rows": rows, "counted_rows": counted,
          "comparisons": accumulation.comparisons(rows, counted),
          "not_run": accumulation.not_run({"4": ["/cpu:%d" % i
                                                 for i in range(4)]}),
          "rounds": {"foreign_cores": [0.0], "repeated_rounds": 0}}


def test_accumulation_gets_its_bytes_and_speed_verdicts():
  results = _results(quick=False)
  results["accumulation"] = _accumulation_section()
  (entry,) = results["accumulation"]["comparisons"]
  assert entry["bytes_ratio"] == 0.25
  assert entry["speed_ratio"] == pytest.approx(0.96)
  assert entry["speed_interval"] == pytest.approx([0.96, 0.96])
  # k=4 takes 0.4167 s for 32 examples, plain 0.2 s: 0.48x.
  assert entry["plain_speed_ratio"] == pytest.approx(0.48)
  assert entry["cpu_bytes_ratio"] == 0.625
  report.add_targets(results)
  verdicts = {(t["scope"], t["target"]): t for t in results["targets"]}
  assert verdicts[("accumulation x4",
                   "bytes per example at k=4 = 0.25x k=1's")]["met"]
  assert verdicts[("accumulation x4",
                   "examples/sec at k=4 >= 0.95x k=1's")]["met"]
  table = report.markdown(results)
  assert "### Gradient accumulation: MNIST CNN, 2 per tower per run\n" in (
      table)
  assert ("| 4 | accumulated | 4 | 2 | 32 | 76.8 | 416.7 [416.7, 416.7] | "
          "cpu:0 480.0 (480.0) | 0.0 | 15360.0 (15360.0) |") in table
  assert ("| 4 | cpu | 4 | 2 | 32 | not timed | - | cpu:0 1200.0 (480.0) | "
          "0.0 |") in table
  assert ("| 4 | 4 | 0.2500x (0.2500x) | 0.960x [0.960, 0.960] | 0.480x "
          "[0.480, 0.480] | 0.6250x | bytes per example at k=4 = 0.25x "
          "k=1's: met (0.2500x: 15360.0 vs 61440.0 KiB per example)") in table
  assert "no GPU: the towers ran on virtual CPU devices" in table

  # One byte more per update, or 10% slower: not met.
  results = _results(quick=False)
  results["accumulation"] = _accumulation_section(speed_4=0.9,
                                                  bytes_4=6 * 80 * MIB + 1)
  report.add_targets(results)
  verdicts = {(t["scope"], t["target"]): t for t in results["targets"]}
  assert not verdicts[("accumulation x4",
                       "bytes per example at k=4 = 0.25x k=1's")]["met"]
  assert not verdicts[("accumulation x4",
                       "examples/sec at k=4 >= 0.95x k=1's")]["met"]


def test_quick_accumulation_gives_no_verdicts():
  results = _results(quick=True)
  results["accumulation"] = _accumulation_section()
  report.add_targets(results)
  assert results["targets"] == []
  assert results["accumulation"]["comparisons"][0]["targets"] == []
  table = report.markdown(results)
  assert "2 per tower per run (quick run)" in table
  assert not VERDICT.search(table)


def _startup_section(ratio, interval):
  """A made-up start-up check at 2 towers: `ratio` the gated step time over
  the ungated one, `interval` its 95% bootstrap interval."""
  def side(seconds, nodes):
    return {"median_step_sec": seconds, "q1_step_sec": seconds,
            "q3_step_sec": seconds, "nodes_per_step": nodes,
            "startup_nodes": nodes - 245, "bytes_per_step": 100 + nodes - 245,
            "control_edges": 6}
  row = {"all_reduce": "add_n", "num_towers": 2,
         "gated": side(0.1 * ratio, 312), "ungated": side(0.1, 245),
         "step_time_ratio": ratio, "ratio_interval": list(interval),
         "nodes_added": 67, "startup_bytes": 67}
  return {"title": "MNIST CNN", "global_batch": 64, "rows": [row],
          "rounds": {"foreign_cores": [0.0], "repeated_rounds": 0}}


@pytest.mark.parametrize("ratio, interval, met", [
    (1.008, (1.002, 1.014), True),  # Measurable, but within 1%.
    (1.03, (0.98, 1.07), True),  # Above 1%, but within noise.
    (0.97, (0.95, 0.99), True),
    (1.03, (1.02, 1.04), False),
])
def test_the_startup_check_is_met_unless_measurably_and_over_1_percent_slower(
    ratio, interval, met):
  results = _results(quick=False)
  results["startup"] = _startup_section(ratio, interval)
  report.add_targets(results)
  (verdict,) = [t for t in results["targets"]
                if t["scope"] == "startup add_n x2"]
  assert verdict["met"] == met
  table = report.markdown(results)
  assert "### Replicated start-up check: gated against ungated, MNIST CNN, " \
      "global batch 64\n" in table
  (line,) = [text for text in table.splitlines()
             if text.startswith("| add_n | 2 | ")]
  assert "| 312 / 245 (+67) | 67 / 0 | " in line
  assert ("**not met**" in line) != met

  quick = _results(quick=True)
  quick["startup"] = _startup_section(ratio, interval)
  report.add_targets(quick)
  assert quick["targets"] == [] and quick["startup"]["rows"][0]["targets"] == []
  assert not VERDICT.search(report.markdown(quick))
