"""The benchmark's --quick mode runs and reports every variant.

Speed targets are the benchmark's business (docs/performance.md), never a
test's: this only keeps the benchmark code from rotting.
"""

import importlib.util
import json
import os
import subprocess
import sys

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")


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
  [mnist] = results["throughput"]
  seen = {(r["variant"], r["num_towers"]) for r in mnist["rows"]}
  assert seen == {("plain", 1), ("towers", 1), ("towers", 2),
                  ("towers_balanced", 2), ("original", 1), ("original", 2),
                  ("mirrored", 1), ("mirrored", 2)}
  for row in mnist["rows"]:
    assert row["examples_per_sec"] > 0, row
    assert row["ratio_to_plain"] > 0, row
    assert row["steps_timed"] > 0, row
    if row["variant"].startswith("towers"):
      assert {t["target"] for t in row["targets"]} >= {
          "faster than original", "faster than mirrored"}, row

  averaging = results["average_gradients"]
  for name in ("towers", "original"):
    assert averaging[name]["median_step_sec"] > 0
    assert averaging[name]["tensor_peak_bytes"] > 0
  # By construction: no [num_towers, ...] concat buffer in ours.
  assert (averaging["towers"]["tensor_allocated_bytes"]
          < averaging["original"]["tensor_allocated_bytes"])
  assert len(averaging["targets"]) == 2

  build = results["build"]
  assert [r["num_towers"] for r in build["rows"]] == [1, 2, 4]
  assert all(r["seconds"] > 0 and r["ops"] > 0 for r in build["rows"])
  ops = [r["ops"] for r in build["rows"]]
  assert ops == sorted(ops)

  assert all(isinstance(t["met"], bool) for t in results["targets"])
  assert "| towers | 2 |" in done.stdout
  assert (out / "results.md").exists()
  # The chart is optional: drawn exactly when matplotlib is installed.
  has_matplotlib = importlib.util.find_spec("matplotlib") is not None
  assert (out / "examples_per_sec.png").exists() == has_matplotlib
