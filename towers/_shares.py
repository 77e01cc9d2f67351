"""Each tower's share of the global batch, known from its gradients.

The seed's ``average_gradients(tower_grads)`` passes no weights, and a plain
mean of the towers' means is wrong when their shards differ (11 examples on
2 towers: 6 and 5). So the towers record their gradients with their
shares, and `average_gradients` without weights takes the shares of the
towers the lists come from. Lists it cannot tie to one set of towers, in a
graph whose towers hold unequal shares, are refused: their shares are
unknown, and a plain mean would be silently off.
"""

import numbers
from typing import List, Optional, Sequence, Set, Tuple

from towers import _reduction
from towers import _state

Weight = _reduction.Weight


def record(tower_grads: Sequence[Sequence[Tuple[object, object]]],
           weights: Sequence[Weight]) -> None:
  """Records ``[num_towers]`` lists of ``(grad, var)`` as those towers', with
  their shares of the global batch."""
  state = _state.of()
  index = len(state.share_records)
  state.share_records.append(list(weights))
  for tower, pairs in enumerate(tower_grads):
    for grad, _ in pairs:
      for tensor in _reduction.tensors(grad):
        state.shares[tensor.name] = (index, tower)


def weights_of(tower_grads: Sequence[Sequence[Tuple[object, object]]]
              ) -> Optional[List[Weight]]:
  """The recorded shares of the towers `tower_grads` come from; None where a
  plain mean is exact (equal shares, or lists no towers recorded).

  Raises:
    ValueError: for lists of towers with unequal shares that are not one
      recorded list per tower.
  """
  state = _state.of()
  found: List[Set[Tuple[int, int]]] = []
  for pairs in tower_grads:
    found.append({state.shares[t.name] for grad, _ in pairs
                  for t in _reduction.tensors(grad)
                  if t.name in state.shares})
  marks = [next(iter(f)) for f in found if len(f) == 1]
  if len(marks) == len(found) and len({r for r, _ in marks}) == 1:
    shares = state.share_records[marks[0][0]]
    towers = [t for _, t in marks]
    if sorted(towers) == list(range(len(shares))):
      if _reduction.is_uniform(shares):
        return None
      return [shares[t] for t in towers]
  touched = {r for f in found for r, _ in f}
  uneven = [r for r, shares in enumerate(state.share_records)
            if not _reduction.is_uniform(shares) and (
                r in touched or (not touched and
                                 len(shares) == len(tower_grads)))]
  if not uneven:
    return None
  shares = state.share_records[uneven[0]]
  raise ValueError(
      "average_gradients got no weights, and these %d gradient lists are not "
      "one list of each tower built in this graph (towers whose shares of "
      "the global batch differ: %s), so their shares are unknown and a plain "
      "mean would be wrong; pass weights=t.weights (Towers.weights, each "
      "tower's share), or weights=[1/n]*n for a plain mean on purpose"
      % (len(tower_grads), _describe(shares)))


def _describe(shares: Sequence[Weight]) -> str:
  if all(isinstance(s, numbers.Real) for s in shares):
    return ", ".join("%.4g" % s for s in shares)  # type: ignore[str-format]
  return "known at run time"

