"""Packing: many small gradients reduced as one tensor, bitwise the same.

Every reduction of a gradient has a fixed cost beside its bytes: ops to
schedule, a transfer per tower (on GPUs, a copy's latency), a kernel launch.
For small tensors (biases, batch-norm scales and offsets) the fixed cost is
most of it. Packing flattens the small dense gradients that are reduced the
same way (one dtype, the same devices), concatenates them on each tower's
device into one pack, reduces the pack once, and splits the result back into
the gradients' shapes next to each variable.

The invariant: a packed reduction gives the bits of the unpacked one. Every
step of a reduction is elementwise (each tower's weight, the sum, the
division), so an element's result does not depend on which tensor holds it.
The one exception is a ring's order of additions, which depends on the chunk
an element falls in (chunk ``c`` is summed starting from device ``c``): a
pack for the ring is laid out chunk by chunk (chunk 0 of every gradient, then
chunk 1, ...) and the ring is cut at those boundaries, so each element is
summed in the order the unpacked ring sums it. A collective op (NCCL, or
TensorFlow's ring between CPUs) cuts its tensor by its own rule, which no
layout can follow: with three or more devices a packed collective's sums can
differ from the unpacked ones in the last bits (every copy still gets the
same bits).

Not packed: None and ``tf.IndexedSlices`` gradients, gradients larger than
the threshold (concatenating and splitting copy every byte twice more, which
costs more than the transfer saved once tensors are large), gradients whose
static shape is not fully defined (their size is unknown while the graph is
built), and a pack that would hold one gradient.
"""

import numbers
from typing import Dict, Hashable, List, Optional, Sequence, Tuple

import tensorflow.compat.v1 as tf

from towers import _allreduce
from towers import _collectives
from towers import _reduction

# The largest gradient size at which packing still gained in the pack_bytes
# sweep (benchmarks/packing.py; docs/performance.md has the numbers).
DEFAULT_PACK_BYTES = 16 * 1024


def check_pack_bytes(pack_bytes: object) -> int:
  """Returns `pack_bytes` if it is a non-negative int."""
  if isinstance(pack_bytes, bool) or not isinstance(pack_bytes,
                                                    numbers.Integral):
    raise TypeError(
        "expected pack_bytes to be an int (the largest gradient, in bytes, "
        "that is packed; 0 turns packing off), got %r" % (pack_bytes,))
  if pack_bytes < 0:
    raise ValueError(
        "expected pack_bytes >= 0 (the largest gradient, in bytes, that is "
        "packed; 0 turns packing off), got %d" % pack_bytes)
  return int(pack_bytes)


def packable(grad: object, pack_bytes: int) -> bool:
  """Returns whether `grad` is a dense gradient of at most `pack_bytes`."""
  if not isinstance(grad, tf.Tensor) or not grad.shape.is_fully_defined():
    return False
  return grad.shape.num_elements() * grad.dtype.size <= pack_bytes


def key(position: _reduction.VariableGrads,
        pack_bytes: int) -> Optional[Tuple[object, ...]]:
  """What a position packed with this one shares, or None if unpackable:
  its dtype, the devices its towers' gradients are on, and where and how
  it is reduced."""
  if not all(packable(g, pack_bytes) for g in position.grads):
    return None
  dtypes = {g.dtype.base_dtype for g in position.grads}
  if len(dtypes) > 1:
    return None
  return (dtypes.pop(), tuple(g.device for g in position.grads),
          tuple(position.where), position.shared, position.algorithm)


def units(keys: Sequence[Optional[Hashable]]) -> List[List[int]]:
  """Returns the positions of `keys` in units reduced together.

  Positions sharing a key (not None) form one unit, as do positions alone
  under theirs; every other position is a unit of one. Units come in the
  order of their first position, positions within a unit in their order.
  """
  found: List[List[int]] = []
  by_key: Dict[Hashable, List[int]] = {}
  for position, k in enumerate(keys):
    if k is None:
      found.append([position])
    elif k in by_key:
      by_key[k].append(position)
    else:
      by_key[k] = [position]
      found.append(by_key[k])
  return found


def mean_of_pack(members: List[_reduction.VariableGrads],
                 weights: List[_reduction.Weight], uniform: bool,
                 waits: List[List[tf.Operation]],
                 order: _collectives.LaunchOrder
                ) -> List[List[Optional[_reduction.Gradient]]]:
  """Returns `_reduction.mean` of each member, from one reduction of a pack.

  Each tower's gradients are packed on that tower's device, and the result
  unpacked on each device it is left on (next to each copy, or to the
  variable), so one tensor crosses where one per gradient would.
  """
  first = members[0]
  chunks = len(first.where) if first.algorithm == "ring" else 1
  packs, sizes = [], None
  for i in range(len(first.grads)):
    with tf.device(first.grads[i].device):
      packed, sizes = pack([m.grads[i] for m in members], chunks)
      packs.append(packed)
  results = _reduction.mean(packs, weights, uniform, waits, first.where,
                            first.algorithm, order, sizes)
  shapes = [m.grads[0].shape for m in members]
  unpacked = []
  for result, where in zip(results, first.where):
    with tf.device(where):
      unpacked.append(unpack(result, shapes, chunks))
  # [num_devices][num_members] -> [num_members][num_devices]
  return [list(per_member) for per_member in zip(*unpacked)]


def pack(tensors: Sequence[tf.Tensor],
         chunks: int = 1) -> Tuple[tf.Tensor, List[int]]:
  """Returns `tensors` flattened into one vector, and its chunks' sizes.

  With ``chunks > 1`` (a ring's), every tensor is cut as the ring cuts it
  (`_allreduce.split_sizes`) and the vector holds chunk 0 of every tensor,
  then chunk 1, and so on; the sizes say where the ring must cut it.
  """
  pieces: List[List[tf.Tensor]] = [[] for _ in range(chunks)]
  for tensor in tensors:
    flat = tf.reshape(tensor, [-1])
    sizes = _allreduce.split_sizes(tensor.shape.num_elements(), chunks)
    parts = tf.split(flat, sizes) if chunks > 1 else [flat]
    for c, part in enumerate(parts):
      pieces[c].append(part)
  sizes = [sum(p.shape.num_elements() for p in chunk) for chunk in pieces]
  return tf.concat([p for chunk in pieces for p in chunk], 0), sizes


def unpack(packed: tf.Tensor, shapes: Sequence[tf.TensorShape],
           chunks: int = 1) -> List[tf.Tensor]:
  """Returns the tensors of shapes `shapes` that `pack` put in `packed`."""
  cuts = [_allreduce.split_sizes(s.num_elements(), chunks) for s in shapes]
  # In pack's order: chunk 0 of every tensor, then chunk 1, ...
  pieces = tf.split(packed, [cut[c] for c in range(chunks) for cut in cuts])
  tensors = []
  for i, shape in enumerate(shapes):
    parts = pieces[i::len(shapes)]
    flat = parts[0] if chunks == 1 else tf.concat(parts, 0)
    tensors.append(tf.reshape(flat, shape))
  return tensors
