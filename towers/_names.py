"""Names in every tower: a single-device model's default names line up.

Three rules make an unchanged single-device ``model_fn`` ask every tower for
tower 0's variables, and keep single-device names in checkpoints:

- Each tower re-enters the caller's variable scope afresh, which makes
  TensorFlow restart the counters of the default names below it: the
  unnamed ``tf.layers.dense`` is ``dense``, ``dense_1``, ... in every tower,
  and so is ``tf.variable_scope(None, default_name='bert')``. Op names stay
  unique, since each tower has its own name scope.
- A global variable that tower 0 creates without ``tf.get_variable`` (a Keras
  layer's weights, built on its first call; a ``tf.Variable``) is named
  without the tower's name scope: ``sequential/dense/kernel``, as on one
  device, not ``tower_0/sequential/dense/kernel``.
- A tower after the first that asks ``tf.get_variable`` for a variable tower
  0 did not create gets an error that names both and says why.
"""

import contextlib
import difflib
from typing import Iterator, List

import tensorflow.compat.v1 as tf

from towers import _tf_versions


@contextlib.contextmanager
def tower_variable_scope(outer: tf.VariableScope, index: int, tower: str,
                         requested: List[str]) -> Iterator[None]:
  """Re-enters `outer` for tower `index` (named `tower` in errors), reusing
  variables after tower 0.

  Tower 0 records in `requested` the names it asks ``tf.get_variable`` for;
  a later tower asking for another name that does not exist raises.
  """

  # TensorFlow passes the next getter as `getter`, by keyword.
  def check(getter, name, *args, **kwargs):
    if index == 0:
      requested.append(name)
      return getter(name, *args, **kwargs)
    try:
      return getter(name, *args, **kwargs)
    except ValueError as e:
      if name in requested or kwargs.get("reuse") is not True:
        raise
      raise _unknown_variable_error(tower, name, requested) from e

  # No auxiliary name scope: it would open the caller's name scope again
  # inside itself (model/model/tower_0).
  with tf.variable_scope(outer, reuse=True if index > 0 else None,
                         custom_getter=check, auxiliary_name_scope=False):
    yield


def _unknown_variable_error(tower: str, name: str,
                            requested: List[str]) -> ValueError:
  close = difflib.get_close_matches(name, requested, n=1)
  hint = " (did you mean %s?)" % close[0] if close else ""
  return ValueError(
      "%s asks for the variable %s, which tower 0 did not create%s: every "
      "tower must ask tf.get_variable for tower 0's variables by the same "
      "names. towers restart the default names of tf.layers and "
      "tf.variable_scope(None, default_name=...) in each tower, but a name "
      "model_fn makes differently on each call (from a Python counter, the "
      "tower's scope or a global step) cannot line up: give it the same "
      "name in every call" % (tower, name, hint))


@contextlib.contextmanager
def single_device_names(scope: str, index: int) -> Iterator[None]:
  """Names tower 0's global variables made in `scope` as on one device.

  Local variables (``tf.metrics`` accumulators) are the tower's own and
  keep the tower's name scope, as do later towers' variables.
  """
  if index > 0:
    yield
    return
  outer = scope[:scope.rstrip("/").rfind("/") + 1]
  graph = tf.get_default_graph()

  def creator(next_creator, **kwargs):
    current = _tf_versions.name_scope(graph) + "/"
    collections = kwargs.get("collections") or [tf.GraphKeys.GLOBAL_VARIABLES]
    if (not current.startswith(scope) or
        tf.GraphKeys.GLOBAL_VARIABLES not in collections):
      return next_creator(**kwargs)
    # An absolute name scope: the one the model has on one device.
    with graph.name_scope(outer + current[len(scope):]):
      return next_creator(**kwargs)

  with tf.variable_creator_scope(creator):
    yield
