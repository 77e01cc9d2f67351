#!/usr/bin/env bash
# Sets up fresh virtualenvs and runs the tests across the supported TensorFlow
# range (the README's test command; .ci/run runs exactly this):
#   newest  the newest TensorFlow setup.py admits (+ tf_keras for Keras 3):
#           library tests under ref variables (tf.disable_v2_behavior()),
#           then every test, the examples' and the benchmark's included,
#           under resource variables;
#   oldest  TensorFlow 2.12 (numpy<2), the oldest that installs on Python
#           3.11: library tests under both kinds of variables.
# Usage: bash scripts/test.sh [newest] [oldest]     (default: both)
# Virtualenvs go to $VENV_ROOT (default .venv-test/), made anew on each run.
set -euo pipefail
cd "$(dirname "$0")/.."

root="${VENV_ROOT:-.venv-test}"
envs=("$@")
[ ${#envs[@]} -gt 0 ] || envs=(newest oldest)
export TF_CPP_MIN_LOG_LEVEL="${TF_CPP_MIN_LOG_LEVEL:-2}"
summary=()
reports=$(mktemp -d)
trap 'rm -rf "$reports"' EXIT
run=0

tests() {  # tests PYTHON PYTEST_ARGS...
  local py="$1"
  shift
  run=$((run + 1))
  "$py" -m pytest --junitxml="$reports/$run.xml" "$@"
}

setup() {  # setup NAME PIP_ARGS... ; prints the venv's python
  local venv="$root/$1"
  shift
  rm -rf "$venv"
  python3 -m venv "$venv" >&2
  "$venv/bin/python" -m pip install -q --upgrade pip >&2
  "$venv/bin/python" -m pip install -q "$@" >&2
  # Keras 3 (TensorFlow >= 2.16) dropped tf.compat.v1.layers; tf_keras of the
  # same minor version brings them back under TF_USE_LEGACY_KERAS=1.
  local keras_req
  keras_req=$("$venv/bin/python" - 2>/dev/null <<'PY'
import tensorflow as tf
major, minor = map(int, tf.__version__.split(".")[:2])
print("tf_keras==%d.%d.*" % (major, minor) if (major, minor) >= (2, 16) else "")
PY
)
  if [ -n "$keras_req" ]; then
    "$venv/bin/python" -m pip install -q "$keras_req" >&2
  fi
  echo "$venv/bin/python"
}

describe() {  # describe PYTHON KINDS
  "$1" - "$2" 2>/dev/null <<'PY'
import importlib.util, platform, sys
import tensorflow as tf
if importlib.util.find_spec("tf_keras"):
  import tf_keras
  keras = "tf_keras %s" % tf_keras.__version__
else:
  keras = "Keras %s (built in)" % tf.keras.__version__
print("| %s | %s | %s | %s |" % (tf.__version__, keras,
                                  platform.python_version(), sys.argv[1]))
PY
}

for env in "${envs[@]}"; do
  case "$env" in
    newest)
      py=$(setup newest -e ".[tf,test]")
      tests "$py" tests --ref-variables --ignore=tests/examples \
        --ignore=tests/test_benchmarks.py
      tests "$py" tests
      summary+=("$(describe "$py" "ref + resource (examples: resource)")")
      ;;
    oldest)
      py=$(setup oldest "tensorflow==2.12.*" "numpy<2" -e ".[test]")
      tests "$py" tests --ref-variables --ignore=tests/examples \
        --ignore=tests/test_benchmarks.py
      tests "$py" tests --ignore=tests/examples \
        --ignore=tests/test_benchmarks.py
      summary+=("$(describe "$py" "ref + resource")")
      ;;
    *)
      echo "unknown environment '$env' (expected newest or oldest)" >&2
      exit 2
      ;;
  esac
done

echo
echo "Tested:"
echo "| TensorFlow | Keras | Python | variables |"
echo "|---|---|---|---|"
printf '%s\n' "${summary[@]}"
# The README's compatibility table must list every TensorFlow tested here.
for row in "${summary[@]}"; do
  minor=$(echo "$row" | sed -E 's/^\| ([0-9]+\.[0-9]+)\..*/\1/')
  if ! grep -qE "^\| $minor(\.[0-9x]+)? \|" README.md; then
    echo "README.md's compatibility table has no row for TensorFlow $minor" >&2
    exit 1
  fi
done
python3 - "$reports" <<'PY'
import glob, sys, xml.etree.ElementTree as ET
totals = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
for path in glob.glob(sys.argv[1] + "/*.xml"):
  for suite in ET.parse(path).getroot().iter("testsuite"):
    for key in totals:
      totals[key] += int(suite.get(key, 0))
failed = totals["failures"] + totals["errors"]
print("total: %d passed, %d failed, %d skipped" % (
    totals["tests"] - failed - totals["skipped"], failed, totals["skipped"]))
PY
