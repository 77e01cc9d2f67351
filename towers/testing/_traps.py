"""The known traps behind a difference, each found where it shows.

A table of differences says where towers and one device part, not why. Most
ports that part fall into one of a few traps, each recognizable:

- a loss summed over the batch, not averaged: by the numbers, one device's
  first loss is the towers' losses added, not their weighted mean;
- per-tower batch norm: by the graph, an op of tower 0 normalizes with its
  shard's own statistics (``FusedBatchNorm`` in training, or the moments of
  axis 0), where one device normalizes the whole batch; with accumulated
  micro-batches, even synchronized batch norm normalizes each alone;
- a replicated copy apart from copy 0: something wrote copy 0 alone;
- a loss that collects every tower's (``tf.losses.get_total_loss()``
  without a scope): by `build_towers`' refusal, whose message names it.

Random ops that a loss reads (dropout) are no trap but a test that cannot
be made: towers draw them per shard. `check_repeatable` refuses them before
anything runs.
"""

from typing import Any, Dict, Iterable, List, Sequence, Tuple

import numpy as np
import tensorflow.compat.v1 as tf

from towers import _batch_norm
from towers import _losses

# Where each trap is told: docs/pitfalls.md, whose ids are stable.
SUM = "pitfall P54 in docs/pitfalls.md"
BATCH_NORM = "pitfall P27 in docs/pitfalls.md"
COPIES = "pitfalls P19 and P23 in docs/pitfalls.md"
COLLECTS = "pitfall P16 in docs/pitfalls.md"
ACCUMULATION = "gradient accumulation in docs/api.md"

_FUSED = frozenset(["FusedBatchNorm", "FusedBatchNormV2", "FusedBatchNormV3"])
# Ops that draw random numbers, stateful or seeded.
_RANDOM = frozenset([
    "RandomUniform", "RandomUniformInt", "RandomStandardNormal",
    "TruncatedNormal", "ParameterizedTruncatedNormal", "Multinomial",
    "RandomShuffle", "RandomGamma", "RandomPoisson", "RandomPoissonV2",
    "StatelessRandomUniform", "StatelessRandomUniformV2",
    "StatelessRandomNormal", "StatelessRandomNormalV2",
    "StatelessTruncatedNormal", "StatelessTruncatedNormalV2",
    "StatelessMultinomial"])


def check_repeatable(computed: Iterable[tf.Operation]) -> None:
  """Raises if random numbers are among `computed`, the ops of `model_fn`
  its losses run.

  Raises:
    ValueError: naming the random ops, and the fix.
  """
  drawn = sorted(op.name for op in computed if op.type in _RANDOM)
  if drawn:
    raise ValueError(
        "model_fn's loss reads random numbers (%s): towers draw them per "
        "shard, one device for the whole batch, so no run of one could "
        "repeat the other's; turn them off for the test (dropout's rate 0, "
        "or training=False for the dropout layers alone)"
        % ", ".join(drawn[:3] + (["..."] if len(drawn) > 3 else [])))


def batch_norm_ops(scope: str) -> Tuple[List[str], List[str]]:
  """The batch norms in `scope` of the default graph: the ops that normalize
  with their own input's statistics, and the synchronized layers' scopes."""
  shard, synchronized = [], []
  for op in tf.get_default_graph().get_operations():
    if not op.name.startswith(scope):
      continue
    if op.type in _FUSED and op.get_attr("is_training"):
      shard.append(op.name)
    elif (op.type == "Mean" and op.name.endswith("moments/mean") and
          0 in np.ravel(tf.get_static_value(op.inputs[1]))):
      shard.append(op.name)
    elif op.name.endswith("/%s/Sum" % _batch_norm.MOMENTS_SCOPE):
      synchronized.append(op.name.rsplit("/", 2)[0])
  return shard, synchronized


def hints(failed: Sequence[str], first_loss: Dict[_losses.Key, Any],
          added: Dict[_losses.Key, float],
          batch_norm: Tuple[Sequence[str], Sequence[str]],
          accumulate_steps: int) -> Dict[str, str]:
  """The likely causes of one case's failed values, by trap (``"sum"``,
  ``"batch_norm"``, ``"copies"``).

  Args:
    failed: what failed (`_compare.Row.what`).
    first_loss: one device's loss at the first update, by key.
    added: the towers' losses of the first update added (over the towers
      and micro-batches), by key.
    batch_norm: tower 0's batch norms (`batch_norm_ops`).
    accumulate_steps: the micro-batches per update.
  """
  found = {}
  for key, loss in first_loss.items():
    if (abs(added[key] - loss) <= 1e-3 * abs(loss) and
        "loss" + _losses.named(key) in failed):
      found["sum"] = (
          "the loss%s is a sum over the batch, not a mean: one device's first "
          "loss, %.6g, is the towers' losses added, not their mean. Towers "
          "average the towers' losses and gradients, each weighted by its "
          "share of the batch: average the loss over the examples "
          "(tf.reduce_mean, the default reduction of tf.losses) (%s)"
          % (_losses.named(key), loss, SUM))
  shard, synchronized = batch_norm
  values = any(not w.startswith("copy ") for w in failed)
  if shard and values:
    each = ("each tower's shard" if accumulate_steps == 1 else
            "each tower's shard of each micro-batch")
    found["batch_norm"] = (
        "%s normalizes %s with that shard's own mean and variance, where one "
        "device normalizes the whole batch: use towers.batch_normalization, "
        "tf.layers' drop-in that normalizes with the global batch's "
        "statistics (%s)" % (_named_ops(shard), each, BATCH_NORM))
  elif synchronized and values and accumulate_steps > 1:
    found["batch_norm"] = (
        "%s normalizes each of the %d micro-batches with its own statistics, "
        "where one device normalizes the whole batch: by design, as one "
        "device taking the micro-batches in turn would (%s); test the model "
        "with accumulate_steps=1" % (_named_ops(synchronized),
                                     accumulate_steps, ACCUMULATION))
  if any(w.startswith("copy ") for w in failed):
    found["copies"] = (
        "a replicated copy is apart from copy 0: the first step sets every "
        "copy from copy 0, and each step updates all of them alike, so "
        "something wrote copy 0 alone: an update op or assign of model_fn's "
        "on a trainable variable (tower 0's update ops write copy 0 only), or "
        "a restore after the first step (run the local init op again after "
        "it) (%s)" % COPIES)
  return found


def refused(message: str) -> List[str]:
  """The likely cause of `build_towers`' refusal with `message`."""
  if "get_total_loss()" in message:
    return ["a loss that collects every tower's losses, such as "
            "tf.losses.get_total_loss() without a scope (%s)" % COLLECTS]
  return []


def _named_ops(names: Sequence[str]) -> str:
  return ", ".join(names[:2]) + (" (and %d more)" % (len(names) - 2)
                                 if len(names) > 2 else "")
