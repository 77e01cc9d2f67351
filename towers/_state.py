"""What towers keeps about a graph between calls: one object per graph.

A user builds towers, averages their gradients and applies them in separate
calls, and TensorFlow's graph is the only thing those calls share. What a
later call needs from an earlier one (which variables are copies of which,
the order collectives launch in on each device) is kept here, in one
`GraphState` per graph, which the graph holds and which dies with it. Each
field has one module that writes it; the others read it through that
module's functions.
"""

from typing import Any, Dict, List, Optional, Set, Tuple

import tensorflow.compat.v1 as tf

# The graph holds its state as an attribute: the state refers to the graph's
# ops, so a table keyed by graph would keep every graph alive; an attribute
# is collected with the graph.
_ATTRIBUTE = "_towers_state"


class GraphState:
  """The state of one graph, each field written by the module named.

  Attributes:
    primary_of: `_copies`: a copy's op name -> ``(copy 0, index)``.
    copy_of: `_copies`: ``(copy 0's op name, index)`` -> the copy.
    sources: `_copies`: ``(local variable, the global one it is set from)``
      for the copies and their optimizer slots.
    averaged: `_copies`: copy index -> {copy 0's averaged gradient's name:
      the copy's}.
    averaged_at: `_copies`: the id of the last op that existed when
      gradients were first averaged, or None.
    group_keys: `_collectives`: collective group key -> its members.
    last_instance: `_collectives`: the last collective instance key.
    tower_sets: `_context`: the number of tower sets built (their keys).
    building: `_context`: the `TowerContext` of the tower being built.
    launch_orders: `_context`: an op built in towers with cross-tower sums
      -> their `LaunchOrder`, which their gradients' all-reduce continues.
    sum_ops: `_context`: the ops of the cross-tower sums built on one
      device, which read every tower's part by design.
    weight_decay: `_regularization`: a tower's gradient's name -> its data
      part and its weight-decay parts.
    plans: `_shares`: a tower's gradient tensor's name -> ``(the towers'
      `_plan.Plan`, tower index)``.
    copied_by: `_shares`: a copied variable's op name (copy 0, or another
      copy) -> the plan of the towers that copied it.
  """

  def __init__(self) -> None:
    self.primary_of: Dict[str, Tuple[Any, int]] = {}
    self.copy_of: Dict[Tuple[str, int], Any] = {}
    self.sources: List[Tuple[Any, Any]] = []
    self.averaged: Dict[int, Dict[str, tf.Tensor]] = {}
    self.averaged_at: Optional[int] = None
    self.group_keys: Dict[int, Tuple[str, ...]] = {}
    self.last_instance = 0
    self.tower_sets = 0
    self.building: Optional[Any] = None
    self.launch_orders: Dict[tf.Operation, Any] = {}
    self.sum_ops: Set[tf.Operation] = set()
    self.weight_decay: Dict[str, Tuple[tf.Tensor, List[tf.Tensor]]] = {}
    self.plans: Dict[str, Tuple[Any, int]] = {}
    self.copied_by: Dict[str, Any] = {}


def of(graph: Optional[tf.Graph] = None) -> GraphState:
  """The state of `graph` (default: the default graph), made on first use."""
  if graph is None:
    graph = tf.get_default_graph()
  state = getattr(graph, _ATTRIBUTE, None)
  if state is None:
    state = GraphState()
    setattr(graph, _ATTRIBUTE, state)
  return state
