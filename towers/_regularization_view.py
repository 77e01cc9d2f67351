"""Each tower's regularization losses collection holds one device's.

On one device, ``tf.losses.get_regularization_loss()`` sums one loss per
regularizer. A tower after the first may make its own of some of them: a
``tf.layers`` or tf-slim layer regularizes a replicated tower's copy of its
weight anew, and an activity regularizer, or a model function's own
``tf.add_to_collection``, runs on every tower's call. Appended beside tower
0's, each would count twice in that tower's loss.

So while tower ``i`` is built, a loss it adds to ``REGULARIZATION_LOSSES``
takes the place of tower 0's loss of the same name within their scopes
(``tower_1/fc/kernel/Regularizer/mul`` stands in for
``tower_0/fc/kernel/Regularizer/mul``), and once tower ``i`` is built the
collection is again as tower 0 left it: one device's. What each tower added
is returned for the checks (`_isolation`), which compare the towers' losses
by these names.
"""

import contextlib
from typing import Dict, Iterator, List, Optional, Sequence

import tensorflow.compat.v1 as tf

from towers import _tf_internals

_KEY = tf.GraphKeys.REGULARIZATION_LOSSES


def name_within(loss: object, scope: str) -> Optional[str]:
  """The name of `loss`'s op within `scope`, or None if it is outside."""
  op = getattr(loss, "op", None)
  name = getattr(op, "name", None)
  if not isinstance(name, str) or not name.startswith(scope):
    return None
  return name[len(scope):]


class _TowerCollection(list):
  """The collection while one tower is built.

  ``Graph.add_to_collection`` and the layers' own helpers add to a
  collection with ``append``: each added loss is recorded, and one named as
  a loss of the first tower's, within the two scopes, takes its place.
  """

  def __init__(self, items: List[object], scope: str,
               first: Dict[str, object]) -> None:
    super().__init__(items)
    self.added: List[object] = []
    self._scope = scope
    self._first = first

  def append(self, value: object) -> None:  # pylint: disable=arguments-renamed
    self.added.append(value)
    name = name_within(value, self._scope)
    replaced = self._first.get(name) if name is not None else None
    if replaced is not None:
      for k, item in enumerate(self):
        if item is replaced:
          self[k] = value
          return
    super().append(value)


@contextlib.contextmanager
def tower(scope: str, first_scope: Optional[str] = None,
          first_added: Sequence[object] = ()) -> Iterator[List[object]]:
  """Builds the tower of `scope` on its own view of the collection.

  Tower 0 (`first_scope` None) adds to the collection as one device does;
  a later tower's losses stand in for those of `first_added` (tower 0's) of
  the same name, and are taken out again on exit.

  Yields:
    A list that holds, on exit, the losses the tower added and kept.
  """
  graph = tf.get_default_graph()
  before = graph.get_collection(_KEY)
  kept: List[object] = []
  if first_scope is None:
    try:
      yield kept
    finally:
      known = {id(item) for item in before}
      kept.extend(loss for loss in graph.get_collection(_KEY)
                  if id(loss) not in known)
    return
  first = {}
  for loss in first_added:
    name = name_within(loss, first_scope)
    if name is not None:
      first[name] = loss
  view = _TowerCollection(before, scope, first)
  _tf_internals.install_collection(graph, _KEY, view)
  try:
    yield kept
  finally:
    now = {id(item) for item in graph.get_collection(_KEY)}
    kept.extend(loss for loss in view.added if id(loss) in now)
    graph.clear_collection(_KEY)
    for loss in before:
      graph.add_to_collection(_KEY, loss)
