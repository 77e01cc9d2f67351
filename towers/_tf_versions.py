"""The public TensorFlow APIs that differ between 1.15 and 2.x, one function
each.

towers runs on TensorFlow 1.15 and 2.12 onwards from one code base. Where a
public API moved or changed between them, the library calls the function
here, which asks TensorFlow what it has (never its version number) and does
the same thing on each. ``tests/test_tf_versions.py`` probes each function
on the TensorFlow it runs under; no other module of towers checks versions.
(The private APIs towers relies on are in ``_tf_internals``.)
"""

import contextlib
from typing import Any, Iterator, List, Sequence

import tensorflow.compat.v1 as tf

# TensorFlow 2's collectives take their keys as inputs and honour
# operation_timeout_in_ms; 1.15's (V1) take them as attributes and do not.
_HAS_COLLECTIVES_V2 = hasattr(tf.raw_ops, "CollectiveReduceV2")

# 1.15's CPU collective kernels have no float16 (they fail at run time) and
# none of them take bfloat16 (refused when the graph is built).
_V1_WIDENED = (tf.float16, tf.bfloat16)


def physical_gpus() -> List[Any]:
  """The GPUs this process's runtime sees (``tf.config`` device objects).

  ``tf.config.list_physical_devices`` in 2.x; under ``experimental`` in 1.15.
  """
  config = tf.config
  listing = getattr(config, "list_physical_devices", None) or \
      config.experimental.list_physical_devices
  return list(listing("GPU"))


def name_scope(graph: tf.Graph) -> str:
  """`graph`'s current name scope, ``""`` at the root.

  1.15 gives None at the root inside ``tf.get_variable`` (which enters
  ``name_scope(None)``); 2.x gives ``""``.
  """
  return graph.get_name_scope() or ""


def loss_scale_optimizers() -> tuple:
  """The classes of TensorFlow's own loss-scaling optimizer wrappers.

  ``tf.mixed_precision.MixedPrecisionLossScaleOptimizer`` in 2.x,
  ``tf.train.experimental.MixedPrecisionLossScaleOptimizer`` in 1.15.
  """
  found = []
  mixed = getattr(tf, "mixed_precision", None)
  experimental = getattr(tf.train, "experimental", None)
  for home in (mixed, experimental):
    cls = getattr(home, "MixedPrecisionLossScaleOptimizer", None)
    if isinstance(cls, type) and cls not in found:
      found.append(cls)
  return tuple(found)


@contextlib.contextmanager
def variables_outside_xla() -> Iterator[None]:
  """Keeps the variables made inside out of a model's ``jit_scope``.

  TensorFlow 1.15 compiles the ops of a resource variable made under a
  ``jit_scope`` with the model, and the session's checks then find every
  variable uninitialized (``MonitoredTrainingSession`` fails to start); 2.x
  starts either way. A variable is state, never worth compiling.
  """

  def creator(next_creator, **kwargs):
    with tf.xla.experimental.jit_scope(compile_ops=False):
      return next_creator(**kwargs)

  with tf.variable_creator_scope(creator):
    yield


def _widened(tensor: tf.Tensor) -> tf.Tensor:
  if not _HAS_COLLECTIVES_V2 and tensor.dtype in _V1_WIDENED:
    return tf.cast(tensor, tf.float32)
  return tensor


def _narrowed(result: tf.Tensor, dtype: tf.DType) -> tf.Tensor:
  return tf.cast(result, dtype) if result.dtype != dtype else result


def collective_reduce(tensor: tf.Tensor, group_size: int, group_key: int,
                      instance_key: int, mean: bool, hint: str) -> tf.Tensor:
  """One member's all-reduce sum of `tensor` (divided by `group_size` if
  `mean`) over a group of collectives.

  1.15's kernels have no float16: there the sum is taken in float32 and
  cast back, which rounds once instead of at every addition.
  """
  final_op = "Div" if mean else "Id"
  if _HAS_COLLECTIVES_V2:
    return tf.raw_ops.CollectiveReduceV2(
        input=tensor, group_size=group_size, group_key=group_key,
        instance_key=instance_key, ordering_token=[], merge_op="Add",
        final_op=final_op, communication_hint=hint)
  return _narrowed(tf.raw_ops.CollectiveReduce(
      input=_widened(tensor), group_size=group_size, group_key=group_key,
      instance_key=instance_key, merge_op="Add", final_op=final_op,
      subdiv_offsets=[0], communication_hint=hint), tensor.dtype)


def collective_gather(tensor: tf.Tensor, group_size: int, group_key: int,
                      instance_key: int) -> tf.Tensor:
  """One member's concatenation of every member's `tensor` along axis 0."""
  if _HAS_COLLECTIVES_V2:
    return tf.raw_ops.CollectiveGatherV2(
        input=tensor, group_size=group_size, group_key=group_key,
        instance_key=instance_key, ordering_token=[],
        communication_hint="auto")
  return _narrowed(tf.raw_ops.CollectiveGather(
      input=_widened(tensor), group_size=group_size, group_key=group_key,
      instance_key=instance_key, shape=[0], communication_hint="auto"),
                   tensor.dtype)


def broadcast_send(tensor: tf.Tensor, group_size: int, group_key: int,
                   instance_key: int) -> tf.Tensor:
  """The sender's side of a broadcast of `tensor` (of a static shape)."""
  if _HAS_COLLECTIVES_V2:
    return tf.raw_ops.CollectiveBcastSendV2(
        input=tensor, group_size=group_size, group_key=group_key,
        instance_key=instance_key, communication_hint="auto")
  return _narrowed(tf.raw_ops.CollectiveBcastSend(
      input=_widened(tensor), group_size=group_size, group_key=group_key,
      instance_key=instance_key, shape=tensor.shape.as_list(),
      communication_hint="auto"), tensor.dtype)


def broadcast_recv(dtype: tf.DType, shape: Sequence[int], group_size: int,
                   group_key: int, instance_key: int) -> tf.Tensor:
  """A receiver's side of a broadcast: the sender's tensor."""
  if _HAS_COLLECTIVES_V2:
    return tf.raw_ops.CollectiveBcastRecvV2(
        group_size=group_size, group_key=group_key,
        instance_key=instance_key, shape=list(shape), T=dtype,
        communication_hint="auto")
  wide = tf.float32 if dtype in _V1_WIDENED else dtype
  return _narrowed(tf.raw_ops.CollectiveBcastRecv(
      group_size=group_size, group_key=group_key, instance_key=instance_key,
      shape=list(shape), T=wide, communication_hint="auto"), dtype)


def collectives_time_out() -> bool:
  """Whether a collective whose peer never comes fails under the session's
  ``operation_timeout_in_ms`` (2.x), rather than waiting forever (1.15)."""
  return _HAS_COLLECTIVES_V2


def describe() -> str:
  """``'TensorFlow X.Y.Z'``, for messages that name what this one lacks."""
  return "TensorFlow %s" % tf.__version__

