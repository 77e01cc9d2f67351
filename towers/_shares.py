"""The plan of the towers gradients come from: their shares, their all-reduce.

The CIFAR-10 tutorial's ``average_gradients(tower_grads)`` passes only the
gradients, but averaging needs the towers' plan: a plain mean of the
towers' means is wrong when their shards differ (11 examples on 2 towers:
6 and 5), and replicated copies are all-reduced as they were built. So each
tower's gradients are recorded with the towers' plan, which holds the
shares, and so is each variable whose copies the plan made; here, and only
here, a later call finds the plan again (applying by the variables, and
`broadcast_variables` the workers of the graph's towers). Lists it cannot
tie to one plan, in a graph whose towers hold unequal shares, are refused:
their shares are unknown, and a plain mean would be silently off.
"""

import numbers
from typing import Any, Dict, List, Optional, Sequence, Tuple

from towers import _plan
from towers import _reduction
from towers import _state
from towers import _workers

Weight = _reduction.Weight


def record(tower_grads: Sequence[Sequence[Tuple[object, object]]],
           plan: _plan.Plan) -> None:
  """Records ``[num_towers]`` lists of ``(grad, var)`` as those of the towers
  of `plan`, whose shares they take."""
  state = _state.of()
  for tower, pairs in enumerate(tower_grads):
    for grad, _ in pairs:
      for tensor in _reduction.tensors(grad):
        state.plans[tensor.name] = (plan, tower)


def record_copied(variables: Sequence[Any], plan: _plan.Plan) -> None:
  """Records `variables` (copy 0, or the other copies) as copied by the
  towers of `plan`."""
  state = _state.of()
  for var in variables:
    state.copied_by[var.op.name] = plan


def plan_of(tower_grads: Sequence[Sequence[Tuple[object, object]]]
           ) -> Optional[_plan.Plan]:
  """The plan of the towers `tower_grads` come from: that of their first
  recorded gradient, else of their first copied variable; None if none."""
  state = _state.of()
  for pairs in tower_grads:
    for grad, _ in pairs:
      for t in _reduction.tensors(grad):
        if t.name in state.plans:
          return state.plans[t.name][0]
  return copied_plan([v for _, v in tower_grads[0]] if tower_grads else [])


def copied_plan(variables: Sequence[Any]) -> Optional[_plan.Plan]:
  """The plan of the towers that copied any of `variables` (copy 0 or
  another copy); None if none did."""
  state = _state.of()
  for var in variables:
    name = getattr(getattr(var, "op", None), "name", None)
    if name in state.copied_by:
      return state.copied_by[name]
  return None


def graph_workers() -> _workers.Workers:
  """The workers of the towers built in the default graph: those of several
  workers, if any (one graph is one worker), else one."""
  # Towers of several workers are replicated: their copies name their plan.
  return next((p.workers for p in _state.of().copied_by.values()
               if p.num_workers > 1), _workers.ONE)


def weights_of(tower_grads: Sequence[Sequence[Tuple[object, object]]]
              ) -> Optional[List[Weight]]:
  """The shares of the towers `tower_grads` come from; None where a plain
  mean is exact (equal shares, or lists no towers recorded).

  Raises:
    ValueError: for lists of towers with unequal shares that are not one
      recorded list per tower.
  """
  state = _state.of()
  found: List[Dict[Tuple[int, int], _plan.Plan]] = []
  for pairs in tower_grads:
    marks = {}
    for grad, _ in pairs:
      for t in _reduction.tensors(grad):
        if t.name in state.plans:
          plan, tower = state.plans[t.name]
          marks[(id(plan), tower)] = plan
    found.append(marks)
  if all(len(f) == 1 for f in found) and len(
      {key for f in found for key, _ in f}) == 1:
    plan = next(iter(found[0].values()))
    towers = [tower for f in found for _, tower in f]
    if sorted(towers) == list(range(plan.num_towers)):
      if _reduction.is_uniform(plan.shares):
        return None
      return [plan.shares[t] for t in towers]
  touched = {id(p): p for f in found for p in f.values()}
  if touched:
    candidates = list(touched.values())
  else:
    candidates = [p for p, _ in state.plans.values()
                  if p.num_towers == len(tower_grads)]
  uneven = [p for p in candidates if not _reduction.is_uniform(p.shares)]
  if not uneven:
    return None
  raise ValueError(
      "average_gradients got no weights, and these %d gradient lists are not "
      "one list of each tower built in this graph (towers whose shares of "
      "the global batch differ: %s), so their shares are unknown and a plain "
      "mean would be wrong; pass weights=t.weights (Towers.weights, each "
      "tower's share), or weights=[1/n]*n for a plain mean on purpose"
      % (len(tower_grads), _describe(uneven[0].shares)))


def _describe(shares: Sequence[Weight]) -> str:
  if all(isinstance(s, numbers.Real) for s in shares):
    return ", ".join("%.4g" % s for s in shares)  # type: ignore[str-format]
  return "known at run time"

