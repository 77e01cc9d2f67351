"""The README's shell commands and scripts/test.sh's Python check.

The README's commands run in the virtualenv its one-liner makes, never in
whatever `python` is first on PATH. scripts/test.sh checks python3 before it
does anything: TensorFlow 2.12 has no wheels past Python 3.11, TensorFlow
2.21 none before 3.10 and TensorFlow 1.15 none but for 3.7, so with another
Python the script would fail minutes later in pip; it must say so at once,
with exit status 2, and create nothing.
"""

import os
import re
import stat
import subprocess
import sys

import pytest

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
SCRIPT = os.path.join(ROOT, "scripts", "test.sh")
README = os.path.join(ROOT, "README.md")


def test_readme_commands_use_the_virtualenv():
  with open(README) as f:
    text = f.read()
  blocks = re.findall(r"```sh\n(.*?)```", text, re.S)
  assert len(blocks) >= 5
  bare = [line for block in blocks for line in block.splitlines()
          if re.match(r"(python|pip|tensorboard)\b", line.strip())]
  assert not bare, "README commands outside .venv: %s" % bare
  assert "needs `python3` 3.10 or 3.11" in text


def test_the_readme_test_subset_runs_and_passes():
  # The README's command for the averaging tests, as a newcomer runs it
  # (its pip install aside: this environment has the test extra).
  with open(README) as f:
    commands = [line for line in f.read().splitlines()
                if " -m pytest tests/" in line]
  assert len(commands) == 1, commands
  install, run = commands[0].split(" && ")
  assert install == '.venv/bin/pip install -e ".[tf,test]"'
  assert run.startswith(".venv/bin/python -m pytest ")
  args = [sys.executable] + run.split()[1:]
  done = subprocess.run(args, cwd=ROOT, capture_output=True, text=True,
                        timeout=300, check=False)
  assert done.returncode == 0, done.stdout[-3000:]
  assert re.search(r"\b\d+ passed\b", done.stdout.splitlines()[-1])


def _run_with_python(tmp_path, version, *envs, path=None):
  """Runs test.sh with a python3 that reports `version` and does nothing,
  first on PATH (or on `path` alone)."""
  bin_dir = tmp_path / "bin"
  bin_dir.mkdir()
  fake = bin_dir / "python3"
  # Answers the version question; anything else (making a virtualenv)
  # fails at once, so that a script that skips the check stops quickly.
  fake.write_text('#!/bin/sh\n[ "$1" = "-c" ] && { echo %s; exit 0; }\n'
                  'exit 3\n' % version)
  fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
  venvs = tmp_path / "venvs"
  env = dict(os.environ, PATH="%s:%s" % (bin_dir, path or os.environ["PATH"]),
             VENV_ROOT=str(venvs))
  env.pop("PYTHON", None)
  env.pop("PYTHON37", None)
  done = subprocess.run(["bash", SCRIPT] + list(envs), capture_output=True,
                        text=True, timeout=60, env=env, check=False)
  return done, venvs


@pytest.mark.parametrize("version", ["3.12.1", "3.9.18"])
def test_test_script_refuses_a_python_without_tensorflow_wheels(
    tmp_path, version):
  done, venvs = _run_with_python(tmp_path, version)
  assert done.returncode == 2, (done.stdout, done.stderr)
  message = done.stderr.strip()
  assert "\n" not in message
  assert "needs Python 3.10 to 3.11 as python3" in message
  assert "python3 is %s" % version in message
  assert "TensorFlow 2.12 has wheels for Python 3.8-3.11" in message
  assert done.stdout == ""
  assert not venvs.exists()


def test_test_script_admits_each_environments_own_pythons(tmp_path):
  # Only the oldest environment: 3.12 is too new for TensorFlow 2.12.
  done, venvs = _run_with_python(tmp_path, "3.12.1", "oldest")
  assert done.returncode == 2
  assert "needs Python 3.8 to 3.11 as python3 for oldest" in done.stderr
  assert not venvs.exists()


def test_test_script_refuses_an_unknown_environment(tmp_path):
  done, venvs = _run_with_python(tmp_path, "3.11.7", "newer")
  assert done.returncode == 2
  assert "unknown environment 'newer'" in done.stderr
  assert not venvs.exists()


def test_test_script_needs_a_python_37_for_tensorflow_115(tmp_path):
  # No pyenv and no python3.7 on this PATH.
  done, venvs = _run_with_python(tmp_path, "3.11.7", "tf115",
                                 path="/usr/bin:/bin")
  assert done.returncode == 2, (done.stdout, done.stderr)
  message = done.stderr.strip()
  assert "needs Python 3.7 for TensorFlow 1.15" in message
  assert "set PYTHON37" in message
  assert done.stdout == ""
  assert not venvs.exists()
