"""The benchmark's --quick mode runs and reports every variant.

Speed targets are the benchmark's business (docs/performance.md), never a
test's: this only keeps the benchmark code from rotting, and checks what the
benchmark decides without measuring: when MirroredStrategy is skipped, that a
quick run gives no verdicts, that a process peak blind to the tensors gives
none either.
"""

import importlib.util
import json
import os
import subprocess
import sys

from benchmarks import mirrored
from benchmarks import report
from benchmarks import run

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
MIB = 1 << 20


def test_quick_benchmark_reports_every_variant(tmp_path):
  out = tmp_path / "bench"
  env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
  done = subprocess.run(
      [sys.executable, "-m", "benchmarks.run", "--quick", "--out", str(out)],
      cwd=ROOT, capture_output=True, text=True, timeout=600, env=env,
      check=False)
  assert done.returncode == 0, done.stderr[-3000:]
  with open(out / "results.json") as f:
    results = json.load(f)

  assert results["quick"]
  skipped = mirrored.installed_unavailable_reason()
  assert results["mirrored_skipped"] == skipped
  [mnist] = results["throughput"]
  seen = {(r["variant"], r["num_towers"]) for r in mnist["rows"]}
  want = {("plain", 1), ("towers", 1), ("towers", 2), ("towers_balanced", 2),
          ("original", 1), ("original", 2)}
  if not skipped:
    want |= {("mirrored", 1), ("mirrored", 2)}
  assert seen == want
  for row in mnist["rows"]:
    assert row["examples_per_sec"] > 0, row
    assert row["ratio_to_plain"] > 0, row
    assert row["steps_timed"] > 0, row
    assert row["targets"] == [], row

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

  # A quick run is no measurement: it says so, and gives no verdict.
  assert results["targets"] == []
  assert "| towers | 2 |" in done.stdout
  assert "quick run: no verdicts" in done.stdout
  assert "met" not in done.stdout.replace("not measurements", "")
  table = (out / "results.md").read_text()
  assert table.startswith("**Quick run (--quick)")
  # The chart is optional: drawn exactly when matplotlib is installed.
  has_matplotlib = importlib.util.find_spec("matplotlib") is not None
  assert (out / "examples_per_sec.png").exists() == has_matplotlib


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
  assert "met" not in table.replace("not measurements", "")


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
