#!/usr/bin/env bash
# Sets up a virtualenv and runs the whole test suite: the library tests under
# tf.disable_v2_behavior() (ref variables), then everything, the example tests
# included, under resource variables.
#   bash scripts/test.sh            # venv in .venv-test (VENV=... to move it)
set -euo pipefail
cd "$(dirname "$0")/.."

venv="${VENV:-.venv-test}"
python3 -m venv "$venv"
py="$venv/bin/python"
"$py" -m pip install -q --upgrade pip
"$py" -m pip install -q -e ".[tf,test]"
# Keras 3 (TensorFlow >= 2.16) dropped tf.compat.v1.layers; tf_keras of the
# same minor version brings them back under TF_USE_LEGACY_KERAS=1.
keras_req=$("$py" - 2>/dev/null <<'PY'
import tensorflow as tf
major, minor = map(int, tf.__version__.split(".")[:2])
print("tf_keras==%d.%d.*" % (major, minor) if (major, minor) >= (2, 16) else "")
PY
)
if [ -n "$keras_req" ]; then "$py" -m pip install -q "$keras_req"; fi

# The library tests under both kinds of variables; the example tests once.
"$py" -m pytest tests --ref-variables --ignore=tests/examples
"$py" -m pytest tests
