"""Replicated copies set from copy 0 at the first step, whatever came first.

Copy 0 can change after the local init op has set the copies: the common TF1
start-up ``sess.run(init_op); saver.restore(sess, path)`` restores copy 0
alone, and ``tf.group(global_init, local_init)`` runs both initializers in
any order. So the first step after the local init op sets every copy (and
every copy's slot) from copy 0 before anything reads it. A local boolean,
False after the local init op, says whether that step has come; later steps
read it and take the setting's empty branch: a switch per tensor the setting
would read (the flag, one byte, sent to each copy's device), nothing copied.

The ops that read the copies wait for a gate, a no-op made before the copies
exist, on the reader's device; `Start.finish` makes the gates wait for the
setting once the copies are made. The setting reads copy 0 before its first
update: every update of copy 0 waits for the gated towers' gradients, or for
a gate itself.
"""

import contextlib
from typing import Iterator, List, Sequence, Tuple

import tensorflow.compat.v1 as tf

from towers import _copies
from towers import _tf_internals


class Start:
  """The gates of one part of the graph: the towers, or one update of every
  copy."""

  def __init__(self) -> None:
    self._gates: List[tf.Operation] = []
    self._first = len(_copies.sources())

  @contextlib.contextmanager
  def gated(self) -> Iterator[None]:
    """Ops made inside run, at the first step, after the copies are set."""
    gate = tf.no_op(name="wait_for_copies")
    self._gates.append(gate)
    with tf.control_dependencies([gate]):
      yield

  def made(self) -> List[Tuple[tf.Variable, tf.Variable]]:
    """The ``(copy, what it is set from)`` pairs made since this `Start`."""
    return _copies.sources()[self._first:]

  def finish(self, host: str,
             pairs: Sequence[Tuple[tf.Variable, tf.Variable]]) -> None:
    """Makes the gates wait, at the first step, for each ``(copy, source)``
    of `pairs` to be set from its source, behind a flag on `host`."""
    if not pairs or not self._gates:
      return
    # Outside any control flow or dependency: the flag is a variable.
    with tf.control_dependencies(None), tf.device(host):
      done = tf.Variable(False, trainable=False, name="copies_are_set",
                         collections=[tf.GraphKeys.LOCAL_VARIABLES])

    def set_copies() -> tf.Tensor:
      assigns = []
      for copy, source in pairs:
        with tf.device(copy.device):
          assigns.append(copy.assign(source.read_value()).op)
      with tf.control_dependencies(assigns):
        return tf.identity(done.assign(True, read_value=True))

    with tf.device(host):
      setting = _tf_internals.cond_v1(
          done.read_value(), lambda: tf.constant(True), set_copies,
          name="set_copies")
    for gate in self._gates:
      _tf_internals.add_control_input(gate, setting.op)
