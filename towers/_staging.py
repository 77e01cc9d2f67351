"""Staged inputs: each tower's next batch copied to its device ahead of time.

A background reader (a ``tf.train.QueueRunner``, which
``MonitoredTrainingSession``, ``Supervisor`` and
``tf.train.start_queue_runners`` start) reads every tower's batch, in tower
order, puts each into a staging area on its tower's device, and then
enqueues one token into a small queue on the host. A training step dequeues
a token first and only then takes each tower's batch from its area, so the
copies to the devices run while the previous steps compute.

The token queue is what makes the end of the data clean. When the reader
meets the end (``OutOfRangeError``), the queue runner closes the queue; the
steps go on taking the batches already staged, and the first step after the
last one fails with ``OutOfRangeError`` at its dequeue, before it reads any
area or changes any variable, as an unstaged step fails at the end of its
input. Nothing staged is dropped, no step waits on an area that will never
be filled, and stopping early cancels the reader's pending enqueue, as for
any queue runner. A callable input that ends after some towers have read
their batch of a step stages none of that step: as unstaged, a step needs a
batch in every tower. Staging areas have no capacity of their own: the token
queue's `CAPACITY` bounds them (a device holds at most ``CAPACITY + 1``
batches ahead of the one being trained).
"""

from typing import List, Sequence

import tensorflow.compat.v1 as tf

from towers import _graph
from towers import _tf_internals

CAPACITY = 1

_PLACEHOLDERS = frozenset(["Placeholder", "PlaceholderV2"])


def stage(batches: Sequence[List[object]], devices: Sequence[str],
          scopes: Sequence[str]) -> List[List[object]]:
  """Stages each tower's batch on its device; returns the staged batches.

  Args:
    batches: ``[num_towers]`` of each tower's `model_fn` arguments (nested
      structures of tensors), already read in the tower's scope.
    devices: ``[num_towers]`` tower devices.
    scopes: ``[num_towers]`` tower name scopes.

  Returns:
    ``[num_towers]`` batches of the same structure, read from the areas;
    static shapes are kept.

  Raises:
    TypeError: if a batch holds something other than tensors.
    ValueError: if a batch depends on a ``tf.placeholder``, which the
      background reader cannot feed.
  """
  flat = [tf.nest.flatten(batch) for batch in batches]
  for scope, tensors in zip(scopes, flat):
    _check_tensors(tensors, scope)
  host = _host(devices[0])
  with tf.name_scope("staging") as staging, tf.device(host):
    tokens = tf.FIFOQueue(CAPACITY, [tf.int32], shapes=[[]], name="tokens")
  puts = []
  everything = [t for tensors in flat for t in tensors]
  for i, (device, scope, tensors) in enumerate(zip(devices, scopes, flat)):
    # A tower stages only once every tower has its batch: an input that
    # ends within a step leaves every area as it was.
    with tf.device(device), tf.name_scope(scope), tf.name_scope("stage"), \
        tf.control_dependencies(everything):
      puts.append(tf.raw_ops.Stage(values=tensors,
                                   shared_name=_area(tokens, i)))
  with tf.name_scope(staging), tf.device(host):
    with tf.control_dependencies(puts):
      enqueue = tokens.enqueue(tf.constant(0))
    # What the deprecated tf.train.add_queue_runner does.
    tf.add_to_collection(tf.GraphKeys.QUEUE_RUNNERS,
                         _tf_internals.queue_runner(tokens, [enqueue]))
    token = tokens.dequeue()
  staged = []
  for i, (device, scope, tensors) in enumerate(zip(devices, scopes, flat)):
    with tf.device(device), tf.name_scope(scope), tf.name_scope("stage"), \
        tf.control_dependencies([token]):
      values = tf.raw_ops.Unstage(dtypes=[t.dtype for t in tensors],
                                  shared_name=_area(tokens, i))
    for value, tensor in zip(values, tensors):
      value.set_shape(tensor.shape)
    staged.append(tf.nest.pack_sequence_as(batches[i], list(values)))
  return staged


def _area(tokens: tf.FIFOQueue, index: int) -> str:
  # The queue's op name is unique in the graph, so are the areas' names.
  return "%s_area_%d" % (tokens.name, index)


def _host(device: str) -> str:
  """The CPU of the task holding `device` (queues have only CPU kernels)."""
  spec = tf.DeviceSpec.from_string(device or "")
  return spec.replace(device_type="CPU", device_index=0).to_string()


def _check_tensors(tensors: List[object], scope: str) -> None:
  tower = scope.rstrip("/").rsplit("/", 1)[-1]
  if not tensors:
    raise ValueError("stage_inputs=True, but %s's batch holds no tensor; "
                     "pass inputs, or drop stage_inputs" % tower)
  for t in tensors:
    if not isinstance(t, tf.Tensor):
      raise TypeError("stage_inputs=True stages tensors, but %s's batch "
                      "holds %r; return tensors from the input" % (tower, t))
  placeholder = _placeholder_above(tensors)
  if placeholder is not None:
    raise ValueError(
        "stage_inputs=True reads %s's batch in a background queue runner, "
        "which cannot feed the placeholder %s; read the batches from a "
        "tf.data iterator or a queue, or drop stage_inputs"
        % (tower, placeholder.name))


def _placeholder_above(tensors: List[tf.Tensor]):
  """A placeholder op the tensors depend on (the first by name), or None."""
  found = [op for op in _graph.upstream(tensors) if op.type in _PLACEHOLDERS]
  return min(found, key=lambda op: op.name) if found else None
