"""The recipe by hand: the script runs as written and its loss falls."""

import os
import re
import subprocess
import sys

EXAMPLES = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..",
                                        "examples"))


def test_the_by_hand_recipe_trains_on_two_towers():
  done = subprocess.run(
      [sys.executable, os.path.join(EXAMPLES, "towers_by_hand.py"),
       "--num_gpus=2", "--steps=100"],
      env=_without("TF_CPP_MIN_LOG_LEVEL"), capture_output=True, text=True,
      timeout=300, check=False)
  assert done.returncode == 0, done.stderr[-2000:]
  losses = [float(m) for m in re.findall(r"step \d+, loss = (\d+\.\d+)",
                                         done.stderr)]
  assert len(losses) == 3, done.stderr[-2000:]  # Steps 1, 50 and 100.
  assert losses[-1] < 0.5 * losses[0], losses
  assert "Traceback" not in done.stderr
  # Like the other scripts, it keeps TensorFlow's C++ INFO lines out.
  assert "mlir_graph_optimization_pass" not in done.stderr, done.stderr


def _without(name):
  return {k: v for k, v in os.environ.items() if k != name}
