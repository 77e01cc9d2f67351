#!/usr/bin/env bash
# Sets up fresh virtualenvs and runs the checks and the tests across the
# supported TensorFlow range (the README's test command; .ci/run runs exactly
# this):
#   checks  lint (ruff; pylint for the 2-space indentation) and types (mypy
#           over towers/), configured in pyproject.toml; the sdist and wheel
#           built (python -m build) and checked (twine check --strict); the
#           wheel installed with the tf extra into a fresh virtualenv, not
#           editable, and the README's quick start run from outside the
#           repository against it;
#   newest  the newest TensorFlow setup.py admits (+ tf_keras for Keras 3):
#           library tests under ref variables (tf.disable_v2_behavior()),
#           then every test, the examples' and the benchmark's included,
#           under resource variables;
#   oldest  TensorFlow 2.12 (numpy<2): library tests under both kinds of
#           variables;
#   tf115   TensorFlow 1.15 on Python 3.7 (setup.py's tf1 extra): library
#           tests under ref variables (1.15's default), then under resource
#           variables with the examples' tests (not the benchmark's, which
#           compares against TensorFlow 2's MirroredStrategy);
#   nightly the next TensorFlow: the newest tf-nightly-cpu the registry serves
#           (or $TF_NIGHTLY, e.g. tf-nightly), with the tf_keras nightly of its
#           version; library tests under both kinds of variables. Not in the
#           default run (a nightly can break for reasons of its own): run it
#           before each release, and before raising setup.py's bound.
# Python: python3 (or $PYTHON) must be 3.10 or 3.11 for the default run:
# TensorFlow 2.21 has wheels for Python 3.10-3.13, TensorFlow 2.12 for
# 3.8-3.11. TensorFlow 1.15 (tf115, and the checks' wheel on it) needs
# Python 3.7: $PYTHON37, else python3.7 on PATH, else pyenv's newest 3.7.
# The script checks both first and exits with status 2 otherwise.
# Usage: bash scripts/test.sh [checks] [newest] [oldest] [tf115] [nightly]
#        (default: checks newest oldest tf115)
# Virtualenvs go to $VENV_ROOT (default .venv-test/), made anew on each run;
# pip's cache is reused. The test runs go in two lanes side by side (LANES=1:
# one after another), each run bounded by $RUN_TIMEOUT_SECS (default 2700):
# lane b (library tests only) starts each run once its environment is set
# up, lane a (the examples' too, whose timed waits want the cores to
# themselves) once every environment is and the checks have run. A failed
# set-up, check or test does not stop the run: the last line counts them
# all, and the exit status is 1 if any failed.
set -euo pipefail
cd "$(dirname "$0")/.."
repo="$PWD"

root="${VENV_ROOT:-.venv-test}"
case "$root" in /*) ;; *) root="$repo/$root" ;; esac
python="${PYTHON:-python3}"
envs=("$@")
[ ${#envs[@]} -gt 0 ] || envs=(checks newest oldest tf115)

# Before anything else: the environments exist, and python3 can install
# their TensorFlow (the Python versions its wheels are built for).
lowest=0; highest=99; newest_tf=""; oldest_tf=""
for env in "${envs[@]}"; do
  case "$env" in
    checks|newest|nightly)  # TensorFlow 2.21 (the checks' wheel[tf] too)
      low=10; high=13
      newest_tf="TensorFlow 2.21 has wheels for Python 3.10-3.13" ;;
    oldest)
      low=8; high=11
      oldest_tf="TensorFlow 2.12 has wheels for Python 3.8-3.11" ;;
    tf115) continue ;;  # Python 3.7, found below
    *)
      echo "unknown environment '$env' (expected checks, newest, oldest," \
        "tf115 or nightly)" >&2
      exit 2 ;;
  esac
  if [ "$low" -gt "$lowest" ]; then lowest=$low; fi
  if [ "$high" -lt "$highest" ]; then highest=$high; fi
done
version=$("$python" -c 'import sys; print("%d.%d.%d" % sys.version_info[:3])' \
  2>/dev/null) || version=""
minor=$(echo "$version" | sed -nE 's/^3\.([0-9]+)\..*/\1/p')
if [ -z "$minor" ] || [ "$minor" -lt "$lowest" ] \
    || [ "$minor" -gt "$highest" ]; then
  because="$newest_tf${newest_tf:+${oldest_tf:+; }}$oldest_tf"
  echo "scripts/test.sh needs Python 3.$lowest to 3.$highest as $python for" \
    "${envs[*]} ($because); $python is ${version:-missing}: put one of those" \
    "first on PATH, or set PYTHON (e.g. PYTHON=python3.$highest)" >&2
  exit 2
fi

find_python37() {  # prints a Python 3.7 interpreter, or fails
  local root candidate
  root=$(pyenv root 2>/dev/null) || root=""
  # pyenv's versions directly: its python3.7 shim answers only when a 3.7
  # version is selected.
  for candidate in "${PYTHON37:-}" python3.7 \
      $(ls -d "$root"/versions/3.7.*/bin/python3.7 2>/dev/null | sort -V -r)
  do
    if [ -n "$candidate" ] && "$candidate" -c \
        'import sys; sys.exit(sys.version_info[:2] != (3, 7))' 2>/dev/null
    then
      echo "$candidate"
      return 0
    fi
  done
  return 1
}
python37=""
case " ${envs[*]} " in *" checks "*|*" tf115 "*)
  if ! python37=$(find_python37); then
    echo "scripts/test.sh needs Python 3.7 for TensorFlow 1.15 (tf115, and" \
      "the checks' wheel on it; TensorFlow 1.15.5 has wheels for Python" \
      "3.7 only): set PYTHON37 to a python3.7, put one on PATH, or install" \
      "one with pyenv (pyenv install 3.7.16); or leave out checks and tf115" \
      "(bash scripts/test.sh newest oldest)" >&2
    exit 2
  fi ;;
esac

export TF_CPP_MIN_LOG_LEVEL="${TF_CPP_MIN_LOG_LEVEL:-2}"
summary=()
checked=()
failed=0
reports=$(mktemp -d)
lane_b=""
stop_lane_b() {  # on an early exit: no run of lane b outlives the script
  if [ -n "$lane_b" ] && kill -0 "$lane_b" 2>/dev/null; then
    pkill -TERM -P "$lane_b" 2>/dev/null || true
    kill "$lane_b" 2>/dev/null || true
  fi
}
trap 'stop_lane_b; rm -rf "$reports"' EXIT
run=0

# The test runs go to two lanes that run side by side: pytest keeps about
# one core busy, and the machines have two. LANES=1 runs them one after
# another.
tests() {  # tests LANE ENV PYTEST_ARGS... ; queues a pytest run in ENV
  local lane="$1"
  shift
  [ "${LANES:-2}" -gt 1 ] || lane=a
  printf '%q ' "$@" >> "$reports/lane-$lane.jobs"
  echo >> "$reports/lane-$lane.jobs"
}

ready() {  # ready ENV ; waits until ENV is set up; fails if it was not
  until [ -e "$reports/ready-$1" ]; do
    [ ! -e "$reports/unready-$1" ] || return 1
    sleep 2
  done
}

run_lane() {  # run_lane LANE ; its pytest runs, one after another
  local lane="$1" n=0 line py
  [ -f "$reports/lane-$lane.jobs" ] || return 0
  while IFS= read -r line; do
    n=$((n + 1))
    eval "set -- $line"
    local xml="$reports/lane-$lane-$n.xml"
    if ! ready "$1"; then  # one failure in the count
      echo "== lane $lane: $1 was not set up; its run $n is skipped"
      touch "$reports/lane-failed"
      cat > "$xml" <<XML
<testsuite name="lanes" tests="1" failures="1" errors="0" skipped="0"><testcase classname="lanes" name="lane $lane run $n: $1 not set up"/></testsuite>
XML
      continue
    fi
    py="$root/$1/bin/python"
    shift
    echo "== lane $lane: $py -m pytest $*"
    # A bound on the whole run: a test that hangs (TensorFlow 1.15's
    # collectives ignore timeouts) fails it instead of stalling CI.
    timeout --kill-after=60 "${RUN_TIMEOUT_SECS:-2700}" \
      "$py" -m pytest --junitxml="$xml" "$@" || touch "$reports/lane-failed"
    if [ ! -e "$xml" ]; then  # timed out or died: one failure in the count
      echo "== lane $lane: pytest ended without a report"
      cat > "$xml" <<XML
<testsuite name="lanes" tests="1" failures="1" errors="0" skipped="0"><testcase classname="lanes" name="lane $lane run $n"/></testsuite>
XML
    fi
  done < "$reports/lane-$lane.jobs"
}

check() {  # check NAME COMMAND... ; counted like a test in the total
  local name="$1" start=$SECONDS status=0
  shift
  echo "== check: $name"
  "$@" || status=$?
  run=$((run + 1))
  cat > "$reports/$run.xml" <<XML
<testsuite name="checks" tests="1" failures="$((status != 0))" errors="0" skipped="0"><testcase classname="checks" name="$name"/></testsuite>
XML
  local verdict=passed
  if [ "$status" -ne 0 ]; then
    verdict="FAILED (exit status $status)"
    failed=1
  fi
  checked+=("| $name | $verdict | $((SECONDS - start)) s |")
}

make_venv() {  # make_venv NAME PIP_ARGS... ; prints the venv's python
  # Each step returns on failure: callers run it where set -e is off. The
  # venv's Python is $venv_python, else $python.
  local venv="$root/$1"
  shift
  rm -rf "$venv" || return 1
  "${venv_python:-$python}" -m venv "$venv" >&2 || return 1
  "$venv/bin/python" -m pip install -q --upgrade pip >&2 || return 1
  "$venv/bin/python" -m pip install -q "$@" >&2 || return 1
  echo "$venv/bin/python"
}

setup() {  # setup NAME PIP_ARGS... ; prints the venv's python
  local py
  py=$(make_venv "$@") || return 1
  # Keras 3 (TensorFlow >= 2.16) dropped tf.compat.v1.layers; tf_keras of the
  # same minor version brings them back under TF_USE_LEGACY_KERAS=1.
  local keras_req
  keras_req=$("$py" - 2>/dev/null <<'PY'
import tensorflow as tf
major, minor = map(int, tf.__version__.split(".")[:2])
print("tf_keras==%d.%d.*" % (major, minor) if (major, minor) >= (2, 16) else "")
PY
)
  if [ -n "$keras_req" ]; then
    "$py" -m pip install -q "$keras_req" >&2 || return 1
  fi
  echo "$py"
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

build_dist() {  # build_dist DIR ; the sdist, then the wheel from the sdist
  if ! "$cpy" -m build --outdir "$1" . > "$reports/build.log" 2>&1; then
    tail -n 40 "$reports/build.log"
    return 1
  fi
  ls "$1"
}

wheel_quick_start() {  # wheel_quick_start DIST_DIR EXTRA [PYTHON]
  local wheel
  wheel=$(ls "$1"/towers-*.whl) || return 1
  # Not editable, and with TensorFlow from the extra (pip's cache is
  # reused, so TensorFlow is downloaded once per machine).
  local wpy
  wpy=$(venv_python="${3:-}" make_venv "wheel-$2" "$wheel[$2]") || return 1
  # From a directory outside the repository, so that `import towers` finds
  # the installed wheel, never the source tree.
  local outside
  outside=$(mktemp -d)
  (cd "$outside" && "$wpy" - "$repo/README.md" <<'PY'
import os, re, subprocess, sys
with open(sys.argv[1]) as f:
  text = f.read()
code = re.search(r"## Quick start\s+```python\n(.*?)```", text, re.S).group(1)
code = code.replace("  for step in range(20):\n",
                    "  seen = []\n  for step in range(20):\n")
code += ("    seen.append(loss)\n"
         "  print(towers.__file__)\n"
         "  print(seen[0], seen[-1])\n")
done = subprocess.run([sys.executable, "-c", code], capture_output=True,
                      text=True, check=False)
if done.returncode != 0:
  sys.exit("the README's quick start failed:\n" + done.stderr[-3000:])
where, losses = done.stdout.strip().splitlines()[-2:]
first, last = map(float, losses.split())
site = os.path.join(sys.prefix, "lib")
if not os.path.realpath(where).startswith(os.path.realpath(site)):
  sys.exit("towers was imported from %s, not from the wheel in %s"
           % (where, sys.prefix))
if not last < first:
  sys.exit("the quick start's loss did not fall: %g -> %g" % (first, last))
print("README quick start from the installed wheel (%s): loss %.3f -> %.3f"
      % (where, first, last))
PY
  )
  local status=$?
  rm -rf "$outside"
  return $status
}

# Tests that do not depend on the kind of variables run once per environment,
# under resource variables (the training runner's among them; the docs'
# snippets, which run in processes of their own under resource variables).
once_only=(--ignore=tests/test_tensorboard.py
           --ignore=tests/test_commands.py
           --ignore=tests/test_snippets.py
           --ignore=tests/training)

# The runs, queued before any environment is set up. The library's tests
# leave out the examples' and the benchmark's.
library=(--ignore=tests/examples --ignore=tests/test_benchmarks.py)
for env in "${envs[@]}"; do
  case "$env" in
    newest)
      tests b newest tests --ref-variables "${library[@]}" "${once_only[@]}"
      tests a newest tests ;;
    oldest)
      tests b oldest tests --ref-variables "${library[@]}" "${once_only[@]}"
      tests b oldest tests "${library[@]}" ;;
    tf115)
      tests b tf115 tests --ref-variables "${library[@]}" "${once_only[@]}"
      tests a tf115 tests --ignore=tests/test_benchmarks.py ;;
    nightly)
      tests a nightly tests --ref-variables "${library[@]}" "${once_only[@]}"
      tests b nightly tests "${library[@]}" ;;
  esac
done
run_lane b > "$reports/lane-b.log" 2>&1 &
lane_b=$!

setup_nightly() {  # prints the nightly venv's python
  # tf_keras's nightly pins tf-nightly, a second TensorFlow beside
  # tf-nightly-cpu: it goes in without its dependencies.
  local py keras_req
  py=$(make_venv nightly --pre "${TF_NIGHTLY:-tf-nightly-cpu}" -e ".[test]") \
    || return 1
  keras_req=$("$py" -c 'import tensorflow as tf
print("tf-keras-nightly~=%s.0.dev" % ".".join(tf.__version__.split(".")[:2]))'
  ) || return 1
  "$py" -m pip install -q --pre --no-deps "$keras_req" >&2 || return 1
  echo "$py"
}

set_up() {  # set_up ENV KINDS COMMAND... ; COMMAND prints ENV's python
  local env="$1" kinds="$2" py
  shift 2
  if py=$("$@"); then
    summary+=("$(describe "$py" "$kinds")")
    touch "$reports/ready-$env"  # the lanes may run in it
  else
    echo "== $env: its virtualenv could not be set up" >&2
    touch "$reports/unready-$env"
  fi
}

for env in "${envs[@]}"; do
  case "$env" in
    newest)
      set_up newest "ref + resource (examples: resource)" \
        setup newest -e ".[tf,test]" ;;
    oldest)
      set_up oldest "ref + resource" \
        setup oldest "tensorflow==2.12.*" "numpy<2" -e ".[test]" ;;
    tf115)
      venv_python="$python37" set_up tf115 \
        "ref + resource (examples: resource)" setup tf115 -e ".[tf1,test]" ;;
    nightly)
      set_up nightly "ref + resource (nightly)" setup_nightly ;;
  esac
done

case " ${envs[*]} " in *" checks "*)
  # Pinned, so that a new release of a tool cannot fail a run by itself.
  # NumPy: its type hints, for mypy.
  cpy=$(make_venv checks "ruff==0.17.6" "pylint==4.1.4" "mypy==2.4.1" \
    "build==1.6.1" "twine==7.0.0" numpy)
  dist=$(mktemp -d "$reports/dist.XXXXXX")
  check "ruff" "$cpy" -m ruff check .
  check "indentation (pylint)" "$cpy" -m pylint towers benchmarks \
    examples tests setup.py
  check "mypy towers/" "$cpy" -m mypy
  check "build sdist and wheel" build_dist "$dist"
  check "twine check" "$cpy" -m twine check --strict "$dist"/*
  check "wheel[tf] runs the README quick start" wheel_quick_start \
    "$dist" tf
  check "wheel[tf1] runs the README quick start on TensorFlow 1.15" \
    wheel_quick_start "$dist" tf1 "$python37"
  ;;
esac

# Lane b's output follows lane a's, once both have ended.
run_lane a
wait "$lane_b" || true
if [ -s "$reports/lane-b.log" ]; then
  echo
  cat "$reports/lane-b.log"
fi
[ ! -e "$reports/lane-failed" ] || failed=1

# The README's compatibility table must list every release tested here.
for row in "${summary[@]+"${summary[@]}"}"; do
  case "$row" in *"(nightly)"*) continue ;; esac
  minor=$(echo "$row" | sed -E 's/^\| ([0-9]+\.[0-9]+)\..*/\1/')
  check "README.md's compatibility table lists TensorFlow $minor" \
    grep -qE "^\| $minor(\.[0-9x]+)? \|" README.md
done
if [ ${#checked[@]} -gt 0 ]; then
  echo
  echo "Checked:"
  echo "| check | result | time |"
  echo "|---|---|---:|"
  printf '%s\n' "${checked[@]}"
fi
if [ ${#summary[@]} -gt 0 ]; then
  echo
  echo "Tested:"
  echo "| TensorFlow | Keras | Python | variables |"
  echo "|---|---|---|---|"
  printf '%s\n' "${summary[@]}"
fi
"$python" - "$reports" <<'PY'
import glob, sys, xml.etree.ElementTree as ET
totals = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
for path in glob.glob(sys.argv[1] + "/*.xml"):
  root = ET.parse(path).getroot()
  for suite in root.iter("testsuite"):
    for key in totals:
      totals[key] += int(suite.get(key, 0))
failed = totals["failures"] + totals["errors"]
print("total: %d passed, %d failed, %d skipped" % (
    totals["tests"] - failed - totals["skipped"], failed, totals["skipped"]))
PY
exit "$failed"
