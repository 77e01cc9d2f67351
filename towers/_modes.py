"""A builder per variable mode: one copy of each variable, or one per tower.

What differs between the modes while the towers are built lives here, one
class per mode, as tensorpack keeps one trainer per mode: the tower loop
and `build_towers` call the same five methods on either, and never ask
which mode they build. `OneCopy` is every mode whose towers share one copy
(``"cpu"``, ``"gpu"``, ``"balanced"``, a device or a device function);
`Replicated` gives each tower its own copies (`_copies`), read once they
are set from copy 0 (`_startup`). `builder` picks one from the plan.
"""

import contextlib
from typing import ContextManager, Dict, List, Optional, Sequence, Tuple

import tensorflow.compat.v1 as tf

from towers import _copies
from towers import _devices
from towers import _plan
from towers import _regularization
from towers import _shares
from towers import _startup

GradsAndVars = List[Tuple[Optional[_copies.Gradient], tf.Variable]]


class OneCopy:
  """Towers that share one copy of each variable, wherever it lives."""

  def __init__(self, plan: _plan.Plan):
    self.plan = plan

  def tower(self, index: int, device: str) -> ContextManager[None]:
    """Entered around tower `index`'s model function and gradients."""
    del index, device  # tf.get_variable's reuse shares the variables.
    return contextlib.nullcontext()

  def gated(self, index: int) -> ContextManager[None]:
    """Entered around tower `index`'s model function alone."""
    del index  # Nothing to wait for: the variables are set by their init.
    return contextlib.nullcontext()

  def after_model(self, index: int, scope: str, batch: object,
                  losses: Sequence[tf.Tensor],
                  made: List[tf.Operation]) -> Dict[str, str]:
    """Called once tower `index`'s model function has returned; returns
    its weight-decay terms to move next to their variables."""
    del index, made  # Every tower's terms move alike.
    # Weight decay's ops next to their variables, not on the tower.
    return _regularization.place(list(losses), batch, scope)

  def gradients(self, index: int, key: object, opt: tf.train.Optimizer,
                loss: tf.Tensor, var_list: Optional[List[tf.Variable]],
                kwargs: Dict[str, object]) -> GradsAndVars:
    """Tower `index`'s ``opt.compute_gradients`` of the loss `key`."""
    del index, key  # The towers differentiate the same variables.
    if var_list is not None:
      kwargs = dict(kwargs, var_list=var_list)
    return opt.compute_gradients(loss, **kwargs)

  def finish(self) -> None:
    """Called once every tower is built."""


class Replicated(OneCopy):
  """Towers that each train their own copy of every trainable variable."""

  def __init__(self, plan: _plan.Plan):
    super().__init__(plan)
    self._start = _startup.Start()
    # Each loss's variables in tower 0, whose copies the other towers train.
    self._first: Dict[object, List[tf.Variable]] = {}

  def tower(self, index: int, device: str) -> ContextManager[None]:
    return _copies.tower_copies(index, device)

  def gated(self, index: int) -> ContextManager[None]:
    # A tower after the first reads its copies once they are set from
    # copy 0.
    return self._start.gated() if index > 0 else contextlib.nullcontext()

  def after_model(self, index: int, scope: str, batch: object,
                  losses: Sequence[tf.Tensor],
                  made: List[tf.Operation]) -> Dict[str, str]:
    if index > 0:
      # A Keras model's variables, which tf.get_variable did not copy.
      _copies.read_copies(index, self.plan.devices[index], scope, made)
    # A tower's copies are on its own device: weight decay stays there.
    return {}

  def gradients(self, index: int, key: object, opt: tf.train.Optimizer,
                loss: tf.Tensor, var_list: Optional[List[tf.Variable]],
                kwargs: Dict[str, object]) -> GradsAndVars:
    if index > 0:
      return _copies.tower_gradients(opt, loss, self._first[key], index,
                                     **kwargs)
    grads = super().gradients(index, key, opt, loss, var_list, kwargs)
    self._first[key] = [v for _, v in grads]
    # Averaging all-reduces their copies as the plan says.
    _shares.record_copied(self._first[key], self.plan)
    return grads

  def finish(self) -> None:
    copies = _copies.of_towers(range(1, self.plan.num_towers))
    self._start.finish(_devices.host(self.plan.devices[0]), copies)
    # Applying finds the plan by any copy (to refuse another copy's pairs).
    _shares.record_copied([copy for copy, _ in copies], self.plan)


def builder(plan: _plan.Plan) -> OneCopy:
  """The builder of `plan`'s mode."""
  return Replicated(plan) if plan.replicated else OneCopy(plan)
