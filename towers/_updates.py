"""Update ops that nothing would run: a Keras layer's, found in the graph.

A Keras ``BatchNormalization`` called in graph mode makes the assignments of
its moving statistics and keeps them in ``model.updates``, a Python list, not
in ``UPDATE_OPS``: on towers nothing runs them, so the statistics would stay
at their initial values. A write of a global variable that a tower makes and
that no op, collection or output of ``model_fn`` refers to can only be such
an update: it joins ``UPDATE_OPS``, so tower 0's run once per step like
``tf.layers``'.
``model.updates`` then holds every tower's, and must not be run as well.
"""

from typing import Iterator, List

import tensorflow.compat.v1 as tf

from towers import _graph

# Ops that write a variable (resource and ref).
WRITES = frozenset(["AssignVariableOp", "AssignAddVariableOp",
                    "AssignSubVariableOp", "Assign", "AssignAdd", "AssignSub"])


def collect(made: List[tf.Operation], scope: str, losses: List[tf.Tensor],
            outputs: object) -> None:
  """Adds to ``UPDATE_OPS`` the writes of global variables among `made` (the
  ops `model_fn` made) in `scope` that nothing runs: neither the losses, nor
  `outputs`, a collection or a variable's initializer depends on them."""
  writes = [op for op in made if op.type in WRITES and
            op.name.startswith(scope)]
  if not writes:
    return
  graph = tf.get_default_graph()
  variables = (graph.get_collection(tf.GraphKeys.GLOBAL_VARIABLES) +
               graph.get_collection(tf.GraphKeys.LOCAL_VARIABLES))
  roots = [loss.op for loss in losses] + list(_ops(tf.nest.flatten(outputs)))
  roots += [v.initializer for v in variables]
  for key in graph.get_all_collection_keys():
    roots.extend(_ops(graph.get_collection(key)))
  live = _graph.upstream(roots, within=set(made))
  owned = {v.op for v in graph.get_collection(tf.GraphKeys.GLOBAL_VARIABLES)}
  for op in writes:
    if op not in live and op.inputs[0].op in owned:
      tf.add_to_collection(tf.GraphKeys.UPDATE_OPS, op)


def _ops(items: List[object]) -> Iterator[tf.Operation]:
  """The ops of those of `items` that are ops, tensors or variables."""
  for item in items:
    op = item if isinstance(item, tf.Operation) else getattr(item, "op", None)
    if isinstance(op, tf.Operation):
      yield op
