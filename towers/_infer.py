"""Inference on towers: a forward function over a split batch, in order."""

from typing import Callable, Optional, Sequence

import tensorflow.compat.v1 as tf

from towers import _device_check
from towers import _modes
from towers import _placement
from towers import _plan
from towers import _tower_loop


def infer(model_fn: Callable[..., object],
          num_gpus: int,
          *,
          inputs: object,
          devices: Optional[Sequence[str]] = None,
          variable_device: _placement.VariableDevice = "cpu",
          tower_name: str = "tower") -> object:
  """Runs a forward-only function on towers; returns its outputs in order.

  The global batch is split as `build_towers` splits it, tower ``i`` calls
  ``model_fn(scope, *shard)`` on its device with the variables shared, and
  each output's shards are concatenated back on axis 0 (row ``k`` is example
  ``k``). No gradients. A batch smaller than `num_gpus` (an evaluation
  set's last) leaves the later towers an empty shard.

  Args:
    model_fn: ``model_fn(scope, *batch)`` -> tensors, examples on axis 0.
    num_gpus: the number of towers, a positive int.
    inputs: the global batch (nested tensors; not a callable).
    devices: ``[num_gpus]`` tower devices; as for `build_towers`.
    variable_device: as for `build_towers` (``'replicated'``: each copy).
    tower_name: the prefix of the towers' name scopes.

  Returns:
    What `model_fn` returns, each tensor over the whole batch.

  Raises:
    RuntimeError: if eager execution is on.
    TypeError: for a `model_fn`, `inputs` or outputs of the wrong kind.
    ValueError: as `build_towers` for devices and inputs, or for a scalar
      output (it has no examples to put back in order).
  """
  if not callable(model_fn):
    raise TypeError("expected model_fn to be callable as model_fn(scope, "
                    "*batch), got %r" % (model_fn,))
  if inputs is None or callable(inputs):
    raise TypeError(
        "infer needs inputs holding the global batch (a tensor or a nested "
        "structure of tensors), to put the outputs back in its order; got "
        "%r" % (inputs,))
  plan = _plan.resolve(num_gpus, devices=devices,
                       variable_device=variable_device, tower_name=tower_name)

  def tower(index, scope, batch, check):
    del index, check  # Every tower runs the same function; see below.
    outputs = model_fn(scope, *batch)
    for t in tf.nest.flatten(outputs):
      if not isinstance(t, tf.Tensor):
        raise TypeError(
            "expected model_fn to return tensors in %s (each with the "
            "tower's examples on axis 0), got %r" % (scope.rstrip("/"), t))
      if t.shape.rank == 0:
        raise ValueError(
            "model_fn returned the scalar %s in %s: infer puts outputs back "
            "in batch order along axis 0, so each needs the tower's examples "
            "on axis 0" % (t.name, scope.rstrip("/")))
    return outputs

  built = _tower_loop.build_each_tower(tower, _modes.builder(plan),
                                       inputs=inputs, allow_empty=True)
  first = built.results[0]
  for outputs, scope in zip(built.results[1:], built.scopes[1:]):
    try:
      tf.nest.assert_same_structure(first, outputs)
    except (TypeError, ValueError) as e:
      raise ValueError("model_fn returned a different structure in %s than "
                       "in the first tower: %s" % (scope.rstrip("/"), e)
                      ) from None
  with tf.name_scope("%s_outputs" % tower_name):
    return tf.nest.map_structure(
        lambda *t: _device_check.gate(tf.concat(t, axis=0),
                                      built.device_check), *built.results)
