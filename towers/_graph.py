"""Walking the graph: the ops a set of ops runs."""

from typing import Any, Iterable, Optional, Set

import tensorflow.compat.v1 as tf


def upstream(roots: Iterable[Any],
             within: Optional[Set[tf.Operation]] = None) -> Set[tf.Operation]:
  """The ops that running `roots` runs: the roots and what they depend on,
  by data or control (only through ops of `within`, if given).

  `roots` are ops, or anything with an ``op`` (tensors, variables).
  """
  seen: Set[tf.Operation] = set()
  stack = [r if isinstance(r, tf.Operation) else r.op for r in roots]
  while stack:
    op = stack.pop()
    if op in seen or (within is not None and op not in within):
      continue
    seen.add(op)
    stack.extend(t.op for t in op.inputs)
    stack.extend(op.control_inputs)
  return seen
