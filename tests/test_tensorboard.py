"""The documented ``tensorboard --logdir=...`` command starts and serves.

docs/examples.md and the example scripts tell users to watch training with
TensorBoard; the ``tf`` extra installs it (TensorFlow >= 2.21 no longer
does), so the command must work where the extra was installed.
"""

import importlib.util
import os
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest

from towers import training

# TensorBoard loads its plugins (and TensorFlow) before it serves.
START_SECONDS = 60


def _tensorboard_command():
  """The console script next to this Python, else the one on PATH."""
  here = os.path.dirname(sys.executable)
  return (shutil.which("tensorboard", path=here)
          or shutil.which("tensorboard"))


def test_documented_tensorboard_command_serves_the_logdir(tmp_path):
  if importlib.util.find_spec("tensorboard") is None:
    pytest.skip('tensorboard is not installed: install towers with the '
                '"tf" extra (pip install -e ".[tf]")')
  command = _tensorboard_command()
  if command is None:
    pytest.skip("the tensorboard package is installed but its command is "
                "not (no tensorboard next to %s or on PATH)" % sys.executable)
  # A port found free may still be taken before TensorBoard binds it (by a
  # process that chose the same one): then it says so and exits, and a new
  # port is tried.
  for _ in range(3):
    status, url, exit_code, output = _serve(command, tmp_path)
    if "Address already in use" not in output:
      break
  assert status == 200, (
      "tensorboard did not answer on %s within %d s (exit code %s); its "
      "output:\n%s" % (url, START_SECONDS, exit_code, output[-3000:]))


def _serve(command, logdir):
  """Starts the documented command on a free port and asks it for its page.

  Returns the HTTP status (None if it never answered), the URL, the exit
  code (None while running) and its output.
  """
  port = training.free_ports(1)[0]
  url = "http://127.0.0.1:%d/" % port
  log = logdir / "tensorboard.log"
  env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
  with open(log, "w") as out:
    process = subprocess.Popen(
        [command, "--logdir=%s" % logdir, "--port=%d" % port,
         "--host=127.0.0.1"], stdout=out, stderr=subprocess.STDOUT, env=env)
  try:
    deadline = time.monotonic() + START_SECONDS
    status = None
    while time.monotonic() < deadline and process.poll() is None:
      try:
        with urllib.request.urlopen(url, timeout=2) as reply:
          status = reply.status
          break
      except (urllib.error.URLError, ConnectionError, OSError):
        time.sleep(0.5)
    return status, url, process.poll(), log.read_text()
  finally:
    process.terminate()
    try:
      process.wait(timeout=20)
    except subprocess.TimeoutExpired:
      process.kill()
      process.wait()
