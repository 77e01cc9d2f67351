"""The README's quick start runs as written and trains."""

import os
import re
import subprocess
import sys

README = os.path.join(os.path.dirname(__file__), "..", "README.md")


def test_readme_quick_start_runs_and_the_loss_falls():
  with open(README) as f:
    text = f.read()
  code = re.search(r"## Quick start\s+```python\n(.*?)```", text, re.S).group(1)
  # Record the first and last loss; the snippet itself stays as users see it.
  code = code.replace("  for step in range(20):\n",
                      "  seen = []\n  for step in range(20):\n")
  code += "    seen.append(loss)\n  print(seen[0], seen[-1])\n"
  env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
  done = subprocess.run([sys.executable, "-c", code], capture_output=True,
                        text=True, timeout=300, env=env, check=False)
  assert done.returncode == 0, done.stderr[-3000:]
  first, last = map(float, done.stdout.split())
  assert last < first
