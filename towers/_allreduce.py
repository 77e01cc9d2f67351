"""All-reduce algorithms: one sum of the towers' tensors, on every device.

Each algorithm takes ``[num_towers]`` dense tensors of one shape, tensor ``i``
on ``devices[i]``, and returns their sum on each device. What differs is where
the bytes go (P bytes per tensor, N towers):

- ``"add_n"``: the towers' sum on one device (a chain of additions in tower
  order, `sum_in_order`), whose result every device reads: about 2·(N−1)·P
  through that device. It is the one-copy modes' sum too, so its result is
  bitwise theirs.
- ``"ring"``: graph ops only. Each tensor is cut into N chunks; chunk ``c``
  is summed as it travels the ring from device ``c`` (N−1 hops, one add on
  each), then the finished chunk travels on around (N−1 hops, copies).
  Every device sends about 2·(N−1)/N·P, in parallel.
- ``"collective"``: TensorFlow's ``CollectiveReduceV2`` with
  ``communication_hint="nccl"``: NCCL between GPUs, TensorFlow's own ring
  between CPUs. The same op on both, so CPU tests run the GPU code path.

The ring and the collective give every device the same bytes (each chunk is
summed once, then copied), so copies updated with them stay bitwise
identical; their sums differ from ``add_n``'s in the last bits only (the
order of additions differs).

A collective op waits for its whole group: fetching one device's output
alone would hang. Each output here waits for every op of its group, so any
fetch runs the whole group; each device launches them in one order
(`_collectives`).
"""

import functools
from typing import List, Optional, Sequence

import tensorflow.compat.v1 as tf

from towers import _collectives
from towers import _devices
from towers import _tf_versions

ALGORITHMS = ("add_n", "ring", "collective")
CHOICES = ("auto",) + ALGORITHMS


def check_name(all_reduce: object) -> str:
  """Returns `all_reduce` if it names an algorithm or ``"auto"``."""
  if not isinstance(all_reduce, str) or all_reduce not in CHOICES:
    raise ValueError(
        "expected all_reduce to be one of %s, got %r"
        % (", ".join(map(repr, CHOICES)), all_reduce))
  return all_reduce


def resolve(all_reduce: str, devices: Sequence[str],
            num_workers: int = 1) -> str:
  """Returns the algorithm `all_reduce` stands for on `devices`, of one of
  `num_workers` workers.

  ``"auto"`` is ``"collective"`` (NCCL) when every device is a distinct
  GPU or the towers are one of several workers' (`_workers`), and
  ``"add_n"`` otherwise: between CPU devices of one host there is no link
  to spare, and ``"add_n"`` is bitwise the one-copy mode.

  Raises:
    ValueError: for an unknown name, or ``"collective"`` with two towers on
      one device (a collective group needs one member per device).
  """
  check_name(all_reduce)
  spelled = [_devices.canonical(d) for d in devices]
  distinct = len(set(spelled)) == len(spelled)
  if all_reduce == "auto" and num_workers > 1:
    all_reduce = "collective"
  if all_reduce == "auto":
    gpus = all(tf.DeviceSpec.from_string(d).device_type == "GPU"
               for d in spelled)
    return "collective" if gpus and distinct and len(devices) > 1 \
        else "add_n"
  if all_reduce == "collective" and not distinct:
    raise ValueError(
        "all_reduce='collective' needs a distinct device per tower (a "
        "collective group has one member per device), got %s; use "
        "all_reduce='ring' or 'add_n', or one tower per device"
        % ", ".join(devices))
  return all_reduce


def all_sum(tensors: Sequence[tf.Tensor], devices: Sequence[str],
            algorithm: str, order: _collectives.LaunchOrder,
            chunks: Optional[Sequence[int]] = None,
            divisor: int = 1) -> List[tf.Tensor]:
  """Returns the sum of `tensors` on each of `devices` by `algorithm`,
  divided by `divisor`.

  ``"add_n"`` sums on ``devices[0]`` and returns that one tensor for every
  device (one tensor alone is an identity there, so that it can wait for
  what the caller's control dependencies say). A collective launches in
  `order`. `chunks`, for the ring, are the sizes of its N chunks of the
  flattened tensor (a pack's, `_packing.pack`); None cuts it with
  `split_sizes`. A `divisor` is applied once per element where the sum is
  finished (`_scaled`), not once per device: the ring multiplies each
  finished chunk by ``1 / divisor`` before it travels on, the collective
  divides inside (``final_op="Div"``) when `divisor` is its group's size.
  """
  if algorithm == "add_n":
    with tf.device(devices[0]):
      total = sum_in_order(tensors) if len(tensors) > 1 \
          else tf.identity(tensors[0])
      total = _scaled(total, divisor)
    return [total] * len(devices)
  if algorithm == "ring":
    return _ring(tensors, devices, chunks, divisor)
  if algorithm == "collective":
    return _collective(tensors, devices, order, divisor)
  raise ValueError("unknown all-reduce algorithm %r" % (algorithm,))


def _scaled(total: tf.Tensor, divisor: int) -> tf.Tensor:
  """`total` times ``1 / divisor`` (itself for 1), on its device."""
  if divisor == 1:
    return total
  with tf.device(total.device):
    return total * tf.constant(1.0 / divisor, total.dtype)


def sum_in_order(tensors: Sequence[tf.Tensor]) -> tf.Tensor:
  """Returns ``((t0 + t1) + t2) + ...``: the towers' sum in tower order.

  A chain of additions, not ``tf.add_n``: Grappler's arithmetic optimizer
  sorts an ``AddN``'s inputs by their names when they are products (a
  tower's weight times its gradient, or a regularizer's gradient), so its
  order of additions, and the sum's last bits, would follow op names, and a
  pack's sum would differ from the gradients' own. A binary addition gives
  the same bits either way round, so the chain's order holds; each addition
  can reuse its left input's buffer.
  """
  total = tensors[0]
  for tensor in tensors[1:]:
    total = tf.add(total, tensor)
  return total


def _ring(tensors: Sequence[tf.Tensor], devices: Sequence[str],
          sizes: Optional[Sequence[int]], divisor: int) -> List[tf.Tensor]:
  n = len(tensors)
  shape = tensors[0].shape
  chunks = []
  for tensor, device in zip(tensors, devices):
    with tf.device(device):
      flat = tf.reshape(tensor, [-1])
      chunks.append(tf.split(flat, list(sizes) if sizes is not None
                             else _chunk_sizes(flat, n)))
  # Reduce-scatter: chunk c starts on device c; each next device adds its
  # own part, so the sum's order is fixed by the graph, not by a rewrite.
  finished = []
  for c in range(n):
    total = chunks[c][c]
    for step in range(1, n):
      d = (c + step) % n
      with tf.device(devices[d]):
        total = total + chunks[d][c]
    finished.append(_scaled(total, divisor))
  # All-gather: the finished chunk c (on device c-1) travels on around.
  gathered: List[List[tf.Tensor]] = [[None] * n for _ in range(n)]
  for c in range(n):
    here = (c - 1) % n
    gathered[here][c] = finished[c]
    for step in range(1, n):
      d = (here + step) % n
      with tf.device(devices[d]):
        gathered[d][c] = tf.identity(gathered[(d - 1) % n][c])
  results = []
  for d in range(n):
    with tf.device(devices[d]):
      flat = tf.concat(gathered[d], 0)
      results.append(tf.reshape(flat, tf.shape(tensors[d]))
                     if not shape.is_fully_defined()
                     else tf.reshape(flat, shape))
  return results


def split_sizes(size: int, n: int) -> List[int]:
  """Sizes of the `n` chunks the ring cuts `size` elements into: differing
  by at most one, the larger first (some may be empty)."""
  small, extra = divmod(size, n)
  return [small + 1] * extra + [small] * (n - extra)


def _chunk_sizes(flat: tf.Tensor, n: int):
  """`split_sizes` of a vector, as a tensor where its size is unknown."""
  size = flat.shape[0]
  if size is not None:
    return split_sizes(int(size), n)
  total = tf.size(flat)
  small, extra = total // n, total % n
  return tf.stack([small + tf.cast(i < extra, total.dtype)
                   for i in range(n)])


def all_gather(tensors: Sequence[tf.Tensor], device: str,
               order: _collectives.LaunchOrder) -> List[tf.Tensor]:
  """Concatenates each of `tensors` (on `device`) with its peers on the
  other workers along axis 0, worker after worker (``CollectiveGatherV2``;
  every worker's must have the same shape at run time)."""
  size, group = _collectives.group_of([device], order.workers.num_workers)
  return [order.launch(device, functools.partial(
      _tf_versions.collective_gather, tensor, size, group,
      _collectives.instance_key())) for tensor in tensors]


def _collective(tensors: Sequence[tf.Tensor], devices: Sequence[str],
                order: _collectives.LaunchOrder,
                divisor: int) -> List[tf.Tensor]:
  size, group = _collectives.group_of(devices, order.workers.num_workers)
  instance = _collectives.instance_key()
  inside = divisor == size
  outputs = [order.launch(device, functools.partial(
      _collectives.member, tensor, size, group, instance, inside))
             for tensor, device in zip(tensors, devices)]
  ops = [o.op for o in outputs]
  tied = []
  for output, device in zip(outputs, devices):
    with tf.device(device), tf.control_dependencies(ops):
      tied.append(_scaled(tf.identity(output), 1 if inside else divisor))
  return tied
