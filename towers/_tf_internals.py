"""Every use of TensorFlow's internals, each a small function of its own.

towers keeps its promises by editing graphs TensorFlow has already built:
it rewires inputs, adds control inputs, moves ops, builds ops again. No public
API does these, so each use is here, named for what it does, with the
behaviour it relies on and the TensorFlow versions it was checked on.
``tests/test_tf_internals.py`` probes each on a tiny graph, so that a
TensorFlow that changes one fails that probe by name, not a far-away
equivalence test. No other module of towers reaches into TensorFlow's
private names (the probes' file checks it).
"""

import contextlib
import threading
from typing import Callable, Iterator, List, Optional, Sequence

import tensorflow.compat.v1 as tf
# Where random ops take their seeds from, which no public module lets change.
from tensorflow.python.framework import random_seed
# The v1 condition's context, which no public module exports.
from tensorflow.python.ops import control_flow_ops

_COLOCATION = "_class"  # The attr holding an op's colocation groups.


def update_input(op: tf.Operation, index: int, tensor: tf.Tensor) -> None:
  """Makes input `index` of `op` read `tensor` instead.

  Relies on ``Operation._update_input``: it rewires the edge in the C graph,
  as TensorFlow's v1 ``tf.cond`` does, and ``op.inputs`` reads it at once.
  Checked on TensorFlow 2.12 to 2.21 and tf-nightly 2.22.0.dev20260905.
  """
  op._update_input(index, tensor)  # pylint: disable=protected-access


def add_control_input(op: tf.Operation, control: tf.Operation) -> None:
  """Makes `op`, already built, run only after `control`.

  Relies on ``Operation._add_control_input``, the edge TensorFlow's v1
  control flow adds to ops it has built. Checked on TensorFlow 2.12 to 2.21
  and tf-nightly 2.22.0.dev20260905.
  """
  op._add_control_input(control)  # pylint: disable=protected-access


def set_device(op: tf.Operation, device: str) -> None:
  """Requests `device` for `op`, already built, as ``tf.device`` would have.

  Relies on ``Operation._set_device``: the placer honours it like a device
  given at creation. Checked on TensorFlow 2.12 to 2.21 and tf-nightly
  2.22.0.dev20260905.
  """
  op._set_device(device)  # pylint: disable=protected-access


def clear_colocation(op: tf.Operation) -> None:
  """Frees `op` of the ops TensorFlow colocated it with, if any.

  Relies on the ``_class`` attr (``loc:@name`` entries) holding an op's
  colocation groups, and on ``Operation._clear_attr`` removing it, after which
  the placer holds `op` to its own device alone. Checked on TensorFlow 2.12
  to 2.21 and tf-nightly 2.22.0.dev20260905.
  """
  if _COLOCATION in op.node_def.attr:
    op._clear_attr(_COLOCATION)  # pylint: disable=protected-access


def colocation(op: tf.Operation) -> List[bytes]:
  """The groups (``b"loc:@name"``) `op` was colocated with; [] if none.

  Relies on the ``_class`` attr holding them (``colocation_groups()``
  names the op's own group when it has none). Checked on TensorFlow 1.15.5
  and 2.12 to 2.21.
  """
  if _COLOCATION not in op.node_def.attr:
    return []
  return list(op.get_attr(_COLOCATION))


def set_colocation(op: tf.Operation, groups: Sequence[bytes]) -> None:
  """Makes `groups` (``b"loc:@name"`` entries) `op`'s colocation groups, as
  if it had been made under ``colocate_with`` those ops.

  Relies on ``Operation._set_attr`` setting the ``_class`` attr, which the
  placer then honours. Checked on TensorFlow 1.15.5 and 2.12 to 2.21.
  """
  op._set_attr(_COLOCATION, tf.AttrValue(  # pylint: disable=protected-access
      list=tf.AttrValue.ListValue(s=list(groups))))


def creation_index(op: tf.Operation) -> int:
  """`op`'s place in its graph's creation order: later ops have larger ones.

  Relies on ``Operation._id``, a counter the graph increments for each op.
  Checked on TensorFlow 2.12 to 2.21 and tf-nightly 2.22.0.dev20260905.
  """
  return op._id  # pylint: disable=protected-access


def last_op_id() -> int:
  """The `creation_index` of the default graph's last op (0 if none)."""
  ops = tf.get_default_graph().get_operations()
  return creation_index(ops[-1]) if ops else 0


def made_after(op_id: int) -> List[tf.Operation]:
  """The default graph's ops made after the op of index `op_id`."""
  return [op for op in tf.get_default_graph().get_operations()
          if creation_index(op) > op_id]


def control_flow_context(graph: tf.Graph):
  """The v1 control-flow context ops made now in `graph` join, or None.

  Relies on ``Graph._get_control_flow_context``: a ``CondContext`` or
  ``WhileContext`` inside v1 ``tf.cond``/``tf.while_loop``, None outside.
  Checked on TensorFlow 2.12 to 2.21 and tf-nightly 2.22.0.dev20260905.
  """
  return graph._get_control_flow_context()  # pylint: disable=protected-access


def in_control_flow(op: tf.Operation) -> bool:
  """Whether `op` was made inside a v1 ``tf.cond`` or ``tf.while_loop``.

  Relies on ``Operation._control_flow_context``, set from the graph's when an
  op is made. Checked on TensorFlow 2.12 to 2.21 and tf-nightly
  2.22.0.dev20260905.
  """
  return op._control_flow_context is not None  # pylint: disable=protected-access


@contextlib.contextmanager
def entered(graph: tf.Graph, context) -> Iterator[None]:
  """Makes the ops built inside join `context` (a `control_flow_context`).

  ``tf.control_dependencies(None)`` leaves the context; this enters it again.
  Relies on ``Graph._set_control_flow_context``; the outer context is restored
  on exit, an exception's included. Checked on TensorFlow 2.12 to 2.21 and
  tf-nightly 2.22.0.dev20260905.
  """
  outer = control_flow_context(graph)
  graph._set_control_flow_context(context)  # pylint: disable=protected-access
  try:
    yield
  finally:
    graph._set_control_flow_context(outer)  # pylint: disable=protected-access


def copy_op(op: tf.Operation, inputs: Sequence[tf.Tensor],
            name: str) -> tf.Operation:
  """Builds `op` again, named `name`, on `inputs`.

  The copy has `op`'s type and attrs, but none of its colocation (it goes
  where the current device scope says), and the current control dependencies
  and control-flow context. Relies on ``Graph.create_op`` (deprecated), which
  takes an op's attrs and ``OpDef`` as they are. Checked on TensorFlow 2.12 to
  2.21 and tf-nightly 2.22.0.dev20260905.
  """
  attrs = {k: v for k, v in op.node_def.attr.items() if k != _COLOCATION}
  new = op.graph.create_op(
      op.type, list(inputs), [t.dtype for t in op.outputs],
      input_types=[t.dtype for t in op.inputs], name=name, attrs=attrs,
      op_def=op.op_def)
  for old, tensor in zip(op.outputs, new.outputs):
    tensor.set_shape(old.shape)
  return new


def apart_from_sums(tensor: tf.Tensor) -> tf.Tensor:
  """`tensor`, as an input of an addition that Grappler leaves alone.

  Grappler's arithmetic optimizer rewrites a tree of additions as one
  ``AddN``, its inputs sorted by name, which changes the order of the
  additions. A ``Snapshot`` between a sum and the addition that reads it keeps
  them apart: Grappler treats it as an op of its own. Checked on TensorFlow
  2.12 to 2.21 and tf-nightly 2.22.0.dev20260905.
  """
  if tensor.op.type in ("Add", "AddV2", "AddN"):
    return tf.raw_ops.Snapshot(input=tensor)
  return tensor


def cond_v1(pred: tf.Tensor, true_fn: Callable[[], tf.Tensor],
            false_fn: Callable[[], tf.Tensor], name: str) -> tf.Tensor:
  """``tf.cond(pred, true_fn, false_fn)`` as ``Switch`` and ``Merge`` ops in
  this graph, whatever control flow v2's process-wide switch says.

  Both functions return a scalar tensor of one dtype. Relies on
  ``CondContext`` (``Enter``, ``BuildCondBranch`` returning the flattened
  result, ``Exit``), the context the
  v1 ``tf.cond`` builds each branch in: it switches every tensor a branch
  reads from outside, so the branch's ops run only when taken. Nested
  conditions follow the switch as they would anyway. Checked on TensorFlow
  2.12 to 2.21 and tf-nightly 2.22.0.dev20260905.
  """
  with tf.name_scope(name, "cond", [pred]):
    if_false, if_true = tf.raw_ops.Switch(data=pred, pred=pred)
    pivots = [tf.identity(if_true, name="switch_t"),
              tf.identity(if_false, name="switch_f")]
    pred = tf.identity(pred, name="pred_id")
    for tensor in [if_false, if_true, pivots[0], pivots[1], pred]:
      tensor.graph.prevent_fetching(tensor.op)
    results: List[tf.Tensor] = []
    contexts = []
    for branch, pivot, fn in ((1, pivots[0], true_fn),
                              (0, pivots[1], false_fn)):
      context = control_flow_ops.CondContext(pred, pivot, branch=branch)
      context.Enter()
      try:
        # The branch's result flattened: a list of one tensor here.
        _, (result,) = context.BuildCondBranch(fn)
        context.ExitResult([result])
      finally:
        context.Exit()
      results.append(result)
      contexts.append(context)
    merged = tf.raw_ops.Merge(inputs=[results[1], results[0]]).output
  if contexts[0].outer_context is None:
    # As tf.cond does: an exported meta graph keeps the contexts.
    for context in contexts:
      tf.add_to_collection(tf.GraphKeys.COND_CONTEXT, context)
  return merged


def install_collection(graph: tf.Graph, key: str, items: list) -> None:
  """Makes `items` (a list, or a subclass of one) `graph`'s collection `key`.

  No public call installs a collection's list. Relies on ``Graph._collections``
  holding the lists by key, ``tf.add_to_collection`` appending to the list
  there and ``get_collection`` copying it. Checked on TensorFlow 2.12 to 2.21
  and tf-nightly 2.22.0.dev20260905.
  """
  graph._collections[key] = items  # pylint: disable=protected-access


def queue_runner(queue: tf.QueueBase,
                 enqueue_ops: List[tf.Operation]) -> tf.train.QueueRunner:
  """``tf.train.QueueRunner(queue, enqueue_ops)``, without its deprecation.

  TensorFlow deprecates queue runners in favour of ``tf.data``, but staging
  needs one (the background reader ``MonitoredTrainingSession`` starts), and
  the advice is not for its users, whose input may be ``tf.data``'s already.
  Relies on the deprecation wrapper of ``QueueRunner.__init__`` keeping the
  constructor as ``__wrapped__`` (as ``functools.wraps`` does): called
  directly, it logs nothing and marks nothing, so a queue runner the user
  makes still warns. Checked on TensorFlow 1.15.5 and 2.21.0.
  """
  runner = tf.train.QueueRunner.__new__(tf.train.QueueRunner)
  tf.train.QueueRunner.__init__.__wrapped__(runner, queue, enqueue_ops)
  return runner


# What `op_seeds_as_if_alone` needs: TensorFlow's own get_seed, the calls under
# way (by thread: the graph and how many ops to leave out) and how many.
_GET_SEED = random_seed.get_seed
_SEEDING = threading.local()
_SEEDING_LOCK = threading.Lock()
_seeding_users = 0
_seeds_count_ops: Optional[bool] = None


def _get_seed(op_seed):
  """TensorFlow's ``get_seed``, with the op count `op_seeds_as_if_alone`
  asks for in its thread and graph."""
  left_out = getattr(_SEEDING, "left_out", None)
  graph = tf.get_default_graph()
  if (op_seed is None and left_out and left_out[-1][0] is graph and
      graph.seed is not None):
    # pylint: disable=protected-access
    op_seed = graph._last_id - left_out[-1][1]
  return _GET_SEED(op_seed)


def _op_seeds_count_ops() -> bool:
  """Whether a graph's default op seed is its op count (TensorFlow 1.15), not
  a count of the seeds it has handed out (2.x)."""
  global _seeds_count_ops
  if _seeds_count_ops is None:
    with tf.Graph().as_default() as graph:
      graph.seed = 1
      # No op is made between the two: 1.15 hands out the same seed twice.
      _seeds_count_ops = _GET_SEED(None) == _GET_SEED(None)
  return _seeds_count_ops


@contextlib.contextmanager
def op_seeds_as_if_alone(first_id: int) -> Iterator[None]:
  """Seeds the random ops made inside as if the default graph's ops made
  after creation index `first_id`, before entering, did not exist.

  Under a graph seed, a random op without a seed of its own takes its op
  seed from its graph: TensorFlow 1.15 takes the graph's op count
  (``Graph._last_id``), so ops towers makes before a model change the
  model's initial values; 2.x counts only the seeds handed out, and this does
  nothing there. Relies on random ops calling ``random_seed.get_seed``
  through its module, which is replaced while any thread is inside (ops of
  other threads and graphs get TensorFlow's seeds). Checked on TensorFlow
  1.15.5.
  """
  global _seeding_users
  if not _op_seeds_count_ops():
    yield
    return
  graph = tf.get_default_graph()
  left_out = last_op_id() - first_id
  stack = _SEEDING.__dict__.setdefault("left_out", [])
  with _SEEDING_LOCK:
    _seeding_users += 1
    random_seed.get_seed = _get_seed
  stack.append((graph, left_out))
  try:
    yield
  finally:
    stack.pop()
    with _SEEDING_LOCK:
      _seeding_users -= 1
      if not _seeding_users:
        random_seed.get_seed = _GET_SEED
