"""The whole step: build the towers, average, clip, apply once."""

from typing import Callable, Optional, Tuple

import tensorflow.compat.v1 as tf

from towers import _gradients
from towers import _replicate


def minimize(model_fn: Callable[..., object],
             opt: tf.train.Optimizer,
             num_gpus: int,
             *,
             global_step: Optional[tf.Variable] = None,
             clip_norm: Optional[float] = None,
             average_device: Optional[str] = None,
             **build_towers_kwargs) -> Tuple[tf.Operation, _replicate.Towers]:
  """Builds the towers and one synchronous training step over all of them.

  The step averages the towers' gradients with their weights (see
  `average_gradients`), optionally clips the averaged gradients by their
  global norm (after averaging: the norm of the update is what matters),
  applies them once with ``opt.apply_gradients`` outside the towers' reuse
  scope (so optimizer slots are created normally). The averaged gradients
  also wait for the first tower's update ops and every tower's loss, so the
  update ops run with each step and a loss fetched with the step is the loss
  before the update.

  Args:
    model_fn: as for `build_towers`.
    opt: a ``tf.compat.v1.train.Optimizer``.
    num_gpus: the number of towers.
    global_step: incremented by one per step when given, as with
      ``opt.minimize``.
    clip_norm: if set, the global norm the averaged gradients are clipped to.
    average_device: passed to `average_gradients` as `device`: where the
      towers' gradients are reduced (default: next to each variable). On a
      worker whose variables live on parameter servers, the worker's own
      device keeps the towers' average local.
    **build_towers_kwargs: passed to `build_towers` (``inputs``,
      ``devices``, ``variable_device``, ``compute_gradients`` arguments).

  Returns:
    ``(train_op, towers)``: the training op and the `Towers` built, with
    ``towers.grads_and_vars`` set to the averaged gradients it applied.

  Raises:
    ValueError: if `clip_norm` is not positive, or as `build_towers` and
      `average_gradients` do; also if no variable has a gradient.
  """
  if clip_norm is not None and not clip_norm > 0:
    raise ValueError("expected clip_norm to be a positive number or None, got "
                     "%r" % (clip_norm,))
  towers = _replicate.build_towers(model_fn, opt, num_gpus,
                                   **build_towers_kwargs)
  # The update ops and the losses join the averaging barrier rather than
  # wrapping apply_gradients in control_dependencies: optimizers such as
  # SyncReplicasOptimizer build queues inside apply_gradients, and a queue
  # that depended on the towers would pull an input batch whenever its queue
  # runner touched it.
  grads_and_vars = _gradients.average_gradients(
      towers.tower_grads, towers.weights, device=average_device,
      control_inputs=list(towers.update_ops) + towers.losses)
  if all(g is None for g, _ in grads_and_vars):
    raise ValueError(
        "no variable has a gradient: none of %s reaches the towers' loss"
        % ", ".join(v.name for _, v in grads_and_vars))
  if clip_norm is not None:
    grads, variables = zip(*grads_and_vars)
    grads, _ = tf.clip_by_global_norm(grads, clip_norm)
    grads_and_vars = list(zip(grads, variables))
  train_op = opt.apply_gradients(grads_and_vars, global_step=global_step)
  return train_op, towers._replace(grads_and_vars=grads_and_vars)
