"""Gradient accumulation: k micro-batches per update, one reduction.

`towers.minimize(..., accumulate_steps=k)` runs one micro-batch on every
tower per run of its train op and adds the gradients to accumulators on the
towers' own devices; every k-th run also reduces them (one all-reduce),
applies the update and clears them, inside a ``tf.cond``
(``accumulate_gradients/apply_or_accumulate``, whose true branch is the
apply). With ``variable_device="replicated"`` every byte of gradient that
crosses between devices is the reduction, so an update of k micro-batches
moves what an update of one does: per example, 1/k of it.

The rows, per tower count N, at the same per-tower micro-batch b: replicated
towers with k = 1, 2, 4 (`ACCUMULATED`), and `PLAIN`, k = 1 with a per-tower
batch of b·K for the largest K: the same effective batch in one run per
update. They are timed in interleaved rounds (`benchmarks.run.interleave`),
a step of a row being one applied update (k runs of the train op), so
examples/sec is N·b·k over the seconds of an update.

The bytes are counted, not timed (`count_update`): an applied update is
k − 1 runs that accumulate and one that applies. Every run's partition
graphs hold the apply branch's sends, taken or not; in a run that does not
apply they carry dead tensors, no data. So the applying run is
`benchmarks.traffic`'s count of every send, and a run that does not apply
the same count without the sends of ops in the apply branch
(`in_apply_branch`). Per example: the parameters' bytes through the
busiest device (sent + received) per update, over the update's examples.
The same is counted, not timed, with ``variable_device="cpu"`` at k = 1
and the largest K (`CPU`): there the towers read every variable from
``/cpu:0`` in every micro-batch, so only the gradients' part shrinks.

On virtual CPU devices (no GPU here) the timings show overhead only; the
byte counts depend on the graph alone: the bytes a GPU machine would copy.
"""

import time
from typing import Dict, List, Optional, Sequence, Set, Tuple

import tensorflow.compat.v1 as tf

import towers
from benchmarks import graphs
from benchmarks import report
from benchmarks import traffic
from benchmarks import workloads

ACCUMULATED = "accumulated"
PLAIN = "plain"
CPU = "cpu"
VARIANTS = (ACCUMULATED, PLAIN, CPU)
TITLES = {
    ACCUMULATED: "replicated, accumulate_steps=k",
    PLAIN: "replicated, k=1, per-tower batch b*K (one run per update)",
    CPU: "variables on /cpu:0, accumulate_steps=k (counted, not timed)",
}
VARIABLE_DEVICES = {ACCUMULATED: "replicated", PLAIN: "replicated",
                    CPU: "cpu"}
WORKLOAD = "mnist"
# The name scope of the cond whose true branch applies (towers/_accumulate).
APPLY_COND = "accumulate_gradients/apply_or_accumulate"

# (num_towers, variant, accumulate_steps).
Key = Tuple[int, str, int]


def apply_context(train_op: tf.Operation):
  """Returns the control-flow context of the apply branch of `train_op`.

  With ``accumulate_steps`` > 1, `towers.minimize`'s train op is the
  ``Merge`` of the accumulation's ``tf.cond``: one of its inputs comes from
  the true branch, the apply, whose context (a ``CondContext`` of branch 1)
  every op of that branch has, or has as an outer context. It is found by
  identity, not by the ops' names: some ops of the branch are named
  outside the cond's name scope.

  Args:
    train_op: `towers.minimize`'s train op.

  Returns:
    The ``CondContext`` of the apply branch.

  Raises:
    ValueError: if `train_op` is not that ``Merge``.
  """
  for tensor in train_op.inputs:
    for context in traffic.contexts(tensor.op):
      if (getattr(context, "branch", None) == 1
          and context.name.startswith(APPLY_COND + "/")):
        return context
  raise ValueError("expected the train op of accumulate_steps > 1, the Merge "
                   "of the %s cond, got %s (%s)"
                   % (APPLY_COND, train_op.name, train_op.type))


def in_apply_branch(context):
  """Returns ``skip(op)`` for `traffic.count`: whether `op` is in `context`.

  An op is in it when its own control-flow context is `context` or has it
  as an outer context (a cond nested in the apply, such as a loss scale's).

  Args:
    context: `apply_context`'s result.

  Returns:
    ``skip(op) -> bool``.
  """

  def skip(op: tf.Operation) -> bool:
    return any(inner is context for inner in traffic.contexts(op))

  return skip


def _upstream(tensor: tf.Tensor) -> Set[str]:
  """Returns the names of the ops `tensor` is computed from."""
  seen: Set[str] = set()
  stack = [tensor.op]
  while stack:
    op = stack.pop()
    if op.name in seen:
      continue
    seen.add(op.name)
    stack.extend(t.op for t in op.inputs)
  return seen


def parameters(graph: tf.Graph, applies: tf.Tensor) -> List[tf.Variable]:
  """Returns what `traffic.count` counts as parameters in `graph`.

  The trainable variables and the local ones (the replicated copies, their
  optimizer slots, the accumulators), but for the counter `applies` is
  computed from: its predicate crosses to every device, a bool that is no
  parameter (counted as "other"). The accumulators are listed themselves:
  their reads follow no data edge from a trainable variable.

  Args:
    graph: a graph `towers.minimize` built.
    applies: its ``towers.applies``.

  Returns:
    The variables, for `traffic.count`'s `parameters`.
  """
  counters = _upstream(applies)
  with graph.as_default():
    return tf.trainable_variables() + [
        v for v in tf.local_variables() if v.op.name not in counters]


def _zero() -> Dict[str, float]:
  return dict.fromkeys(traffic.FIELDS, 0)


def per_update(applying: Dict[str, Dict[str, float]],
               non_applying: Optional[Dict[str, Dict[str, float]]],
               accumulate_steps: int) -> Dict[str, Dict[str, float]]:
  """Returns each device's traffic in one applied update.

  ``accumulate_steps - 1`` runs like `non_applying`, one like `applying`.

  Args:
    applying: device -> `traffic.FIELDS` of the run that applies.
    non_applying: the same of a run that does not; None for k = 1.
    accumulate_steps: k.

  Returns:
    device -> `traffic.FIELDS`, summed over the update's runs.
  """
  non_applying = non_applying or {}
  result = {}
  for device in sorted(set(applying) | set(non_applying)):
    mine, theirs = applying.get(device, _zero()), non_applying.get(
        device, _zero())
    result[device] = {f: (accumulate_steps - 1) * theirs[f] + mine[f]
                      for f in traffic.FIELDS}
  return result


def reads(variables: Sequence[tuple], devices: Sequence[str]
         ) -> Dict[str, Dict[str, float]]:
  """Returns what one micro-batch's reads of the variables move per device.

  Each variable's device sends it to every tower on another device: the
  towers of ``variable_device="cpu"`` read each variable once per run.

  Args:
    variables: ``(device, bytes, ...)`` of each trainable variable, as for
      `traffic.expected`.
    devices: the towers' devices.

  Returns:
    device -> `traffic.FIELDS`.
  """
  towers_on = [traffic.device_name(d) for d in devices]
  result = {d: _zero() for d in towers_on}
  for variable in variables:
    home, size = traffic.device_name(variable[0]), variable[1]
    result.setdefault(home, _zero())
    for device in towers_on:
      if device != home:
        result[home]["sent_bytes"] += size
        result[home]["sent_tensors"] += 1
        result[device]["received_bytes"] += size
        result[device]["received_tensors"] += 1
  return dict(sorted(result.items()))


def count_update(session: tf.Session, train_op: tf.Operation,
                 applies: tf.Tensor, graph: tf.Graph,
                 counted: Sequence[tf.Variable],
                 inputs: Sequence[tf.Tensor], accumulate_steps: int
                ) -> Dict[str, object]:
  """Counts what one applied update moves between devices.

  Runs `train_op` until its next run applies (``applies`` true; at most
  ``accumulate_steps - 1`` runs), then runs it once more, asking for its
  partition graphs (as `traffic.measure` does), which are counted twice
  (`traffic.count`). That run applies: its count is every send's.
  A run that does not apply has the same partition graphs, its sends of the
  apply branch carrying dead tensors: its count skips them
  (`in_apply_branch`). After the count the next run starts an update.

  Args:
    session: a session of `graph`, its variables initialized.
    train_op: `towers.minimize`'s train op.
    applies: `towers.minimize`'s ``towers.applies``.
    graph: the graph.
    counted: the parameters (`parameters`).
    inputs: the input batch's tensors, as read before the towers split it.
    accumulate_steps: k.

  Returns:
    ``applying`` and ``non_applying``, `traffic.count`'s results (None for
    k = 1: every run applies); ``per_update``, device -> `traffic.FIELDS` of
    the k runs of an update (`per_update`); ``runs``, the runs made before
    the counted one.

  Raises:
    RuntimeError: if no run within ``accumulate_steps - 1`` would apply.
  """
  runs = 0
  while not session.run(applies):
    if runs >= accumulate_steps - 1:
      raise RuntimeError("no run of %d would apply: expected one in every "
                         "%d" % (runs + 1, accumulate_steps))
    session.run(train_op)
    runs += 1
  run_metadata = tf.RunMetadata()
  session.run(train_op, options=tf.RunOptions(output_partition_graphs=True),
              run_metadata=run_metadata)
  partitions = run_metadata.partition_graphs
  applying = traffic.count(partitions, graph, counted, inputs)
  non_applying = None
  if accumulate_steps > 1:
    non_applying = traffic.count(
        partitions, graph, counted, inputs,
        skip=in_apply_branch(apply_context(train_op)))
  return {"applying": applying, "non_applying": non_applying,
          "per_update": per_update(
              applying["devices"],
              non_applying["devices"] if non_applying else None,
              accumulate_steps),
          "runs": runs}


class AccumulationStep:
  """One row's training step, built, initialized, counted, ready to time.

  A step of `run` is one applied update: ``accumulate_steps`` runs of the
  train op, the last of which applies.

  Attributes:
    num_ops: the operations in the row's graph.
    examples_per_update: ``num_towers * per_tower_batch *
      accumulate_steps``.
    all_reduce: the reduction's algorithm (`towers.Towers.all_reduce`).
    traffic: the counted update (`summary`).
    first_update_sec: the wall time of the first update, the counted one,
      TensorFlow's graph optimizations included.
  """

  def __init__(self, workload: workloads.Workload, variant: str,
               num_towers: int, per_tower_batch: int, accumulate_steps: int,
               num_devices: int):
    """Builds the row's step in a graph of its own and counts one update.

    Args:
      workload: the model.
      variant: `ACCUMULATED`, `PLAIN` or `CPU` (its variable device).
      num_towers: N.
      per_tower_batch: the examples per tower per run.
      accumulate_steps: k, the runs per update.
      num_devices: the session's virtual CPU devices (`graphs.GraphStep`).
    """
    self.variant = variant
    self.num_towers = num_towers
    self.per_tower_batch = per_tower_batch
    self.accumulate_steps = accumulate_steps
    self.examples_per_update = num_towers * per_tower_batch * accumulate_steps
    self.updates = 0
    images, labels = workloads.synthetic_batch(workload,
                                               num_towers * per_tower_batch)
    devices = towers.tower_devices(num_towers)
    self._graph = tf.Graph()
    with self._graph.as_default():
      tf.set_random_seed(0)
      inputs = graphs.data_on_cpu(images, labels)
      self._global_step = tf.train.get_or_create_global_step()

      def model_fn(scope, x, y):
        del scope  # No summaries are kept.
        return workload.loss_fn(x, y)

      self._train_op, built = towers.minimize(
          model_fn, tf.train.MomentumOptimizer(graphs.LEARNING_RATE,
                                               graphs.MOMENTUM),
          num_towers, inputs=inputs, devices=devices,
          variable_device=VARIABLE_DEVICES[variant],
          global_step=self._global_step, accumulate_steps=accumulate_steps)
      self.all_reduce = built.all_reduce
      self._applies = built.applies
      counted = parameters(self._graph, built.applies)
      trainable = tf.trainable_variables()
      init = tf.global_variables_initializer()
      local_init = tf.local_variables_initializer()
      self.num_ops = len(self._graph.get_operations())
    self._graph.finalize()
    self._session = tf.Session(graph=self._graph,
                               config=graphs.session_config(num_devices))
    try:
      self._session.run(init)
      # Apart: the copies' initializers read copy 0, which must be set first.
      self._session.run(local_init)
      start = time.perf_counter()
      moved = count_update(self._session, self._train_op, self._applies,
                           self._graph, counted, inputs, accumulate_steps)
      self.first_update_sec = time.perf_counter() - start
      self.updates = 1
    except BaseException:
      self.close()
      raise
    variables = traffic.variable_rows(trainable)
    self.traffic = summary(
        moved, expected_update(variables, devices, VARIABLE_DEVICES[variant],
                               self.all_reduce, accumulate_steps),
        parameter_bytes=sum(map(traffic.variable_bytes, trainable)),
        examples_per_update=self.examples_per_update,
        accumulate_steps=accumulate_steps)

  def run(self, steps: int) -> List[float]:
    """Runs `steps` applied updates; returns each one's wall time (s)."""
    times = []
    for _ in range(steps):
      start = time.perf_counter()
      for _ in range(self.accumulate_steps):
        self._session.run(self._train_op)
      times.append(time.perf_counter() - start)
      self.updates += 1
    return times

  def global_step(self) -> int:
    """Returns the global step: the updates applied so far."""
    return int(self._session.run(self._global_step))

  def close(self) -> None:
    self._session.close()


def expected_update(variables: Sequence[tuple], devices: Sequence[str],
                    variable_device: str, all_reduce: Optional[str],
                    accumulate_steps: int) -> Dict[str, Dict[str, float]]:
  """Returns what one applied update should move per device, by design.

  Replicated: the reduction of one update (`traffic.expected` of its
  ``add_n`` star, or of its ring), whatever k; nothing else crosses.
  Variables on one device: each micro-batch's reads (`reads`), k times,
  and the gradients once (`traffic.expected`'s star holds one read and
  the gradients).

  Args:
    variables: as for `traffic.expected`.
    devices: the towers' devices.
    variable_device: ``"replicated"`` or ``"cpu"``.
    all_reduce: the replicated towers' algorithm (``"add_n"``, ``"ring"``,
      ``"collective"``); None for one copy.
    accumulate_steps: k.

  Returns:
    device -> `traffic.FIELDS`, the parameters' traffic of an update.
  """
  pack_bytes = graphs.pack_bytes_in_effect(graphs.TOWERS)
  if variable_device == "replicated":
    pattern = traffic.STAR if all_reduce == "add_n" else traffic.RING
    return traffic.expected(pattern, variables, devices,
                            pack_bytes=pack_bytes, replicated=True)
  once = traffic.expected(traffic.STAR, variables, devices,
                          pack_bytes=pack_bytes)
  return per_update(once, reads(variables, devices), accumulate_steps)


def summary(moved: Dict[str, object],
            expectation: Dict[str, Dict[str, float]], *,
            parameter_bytes: int, examples_per_update: int,
            accumulate_steps: int) -> Dict[str, object]:
  """Returns an update's counted traffic beside its expectation.

  Args:
    moved: `count_update`'s result.
    expectation: `expected_update`'s result.
    parameter_bytes: the trainable variables' bytes, P.
    examples_per_update: the update's examples.
    accumulate_steps: k, the runs per update.

  Returns:
    Per device, the parameters' traffic of an update (``devices``) and its
    expectation; the busiest device's bytes, and per example; the
    applying run's busiest bytes and, with k > 1, the busiest bytes of a
    run that does not apply and the sends it skips; the input and other
    bytes of an update; the sends of unknown size.
  """
  update = moved["per_update"]
  applying, non_applying = moved["applying"], moved["non_applying"]
  device, busiest = traffic.busiest(update)
  expected_device, expected_busiest = traffic.busiest(expectation)
  result = {
      "parameter_bytes": parameter_bytes,
      "devices": update, "expected_devices": expectation,
      "busiest_device": device, "busiest_bytes": busiest,
      "expected_busiest_device": expected_device,
      "expected_busiest_bytes": expected_busiest,
      "bytes_per_example": busiest / examples_per_update,
      "expected_bytes_per_example": expected_busiest / examples_per_update,
      "applying_busiest_bytes": traffic.busiest(applying["devices"])[1],
      "non_applying_busiest_bytes": None, "non_applying_skipped": None,
      "collectives_per_update": applying["collectives"],
      "unsized": list(applying["unsized"]),
      "counted_from": ("partition graphs of an applying run; a run that "
                       "does not apply: the same without the apply "
                       "branch's sends" if non_applying else
                       "partition graphs (every run applies)")}
  for kind in (traffic.INPUT, traffic.OTHER):
    result[kind + "_bytes_per_update"] = applying[kind]["bytes"] + (
        (accumulate_steps - 1) * non_applying[kind]["bytes"]
        if non_applying else 0)
  if non_applying:
    result["non_applying_busiest_bytes"] = traffic.busiest(
        non_applying["devices"])[1]
    result["non_applying_skipped"] = non_applying["skipped"]
  return result


def steps_with_one(accumulate_steps: Sequence[int]) -> List[int]:
  """Returns the k of the rows, sorted, with 1 (the baseline) among them.

  Args:
    accumulate_steps: the k asked for.

  Returns:
    The k to run, ascending.

  Raises:
    ValueError: for a k below 1.
  """
  for k in accumulate_steps:
    if k < 1:
      raise ValueError("expected accumulate_steps of at least 1, got %d" % k)
  return sorted(set(accumulate_steps) | {1})


def build(*, tower_counts: Sequence[int], accumulate_steps: Sequence[int],
          per_tower_batch: int, num_devices: int,
          workload_name: str = WORKLOAD) -> Dict[Key, AccumulationStep]:
  """Builds the timed rows: replicated at every k, and plain.

  Args:
    tower_counts: the rows' tower counts.
    accumulate_steps: their k (`steps_with_one`).
    per_tower_batch: b, each tower's micro-batch.
    num_devices: the session's virtual CPU devices.
    workload_name: the model (`workloads.WORKLOADS`).

  Returns:
    ``(towers, ACCUMULATED or PLAIN, k)`` -> its step, counted and ready
    to time; PLAIN's k is 1, its per-tower batch b·K for the largest K.
  """
  workload = workloads.WORKLOADS[workload_name]
  ks = steps_with_one(accumulate_steps)
  steps: Dict[Key, AccumulationStep] = {}
  try:
    for n in tower_counts:
      for k in ks:
        steps[(n, ACCUMULATED, k)] = AccumulationStep(
            workload, ACCUMULATED, n, per_tower_batch, k, num_devices)
      if ks[-1] > 1:
        steps[(n, PLAIN, 1)] = AccumulationStep(
            workload, PLAIN, n, per_tower_batch * ks[-1], 1, num_devices)
  except BaseException:
    for step in steps.values():
      step.close()
    raise
  return steps


def count_only(*, tower_counts: Sequence[int],
               accumulate_steps: Sequence[int], per_tower_batch: int,
               num_devices: int, workload_name: str = WORKLOAD
              ) -> List[Dict[str, object]]:
  """Counts, without timing, the `CPU` rows at k = 1 and the largest K.

  Each one's graph is built, one update counted and its session closed
  before the next is built. Arguments as for `build`.

  Returns:
    Their rows (`row`), untimed.
  """
  workload = workloads.WORKLOADS[workload_name]
  ks = steps_with_one(accumulate_steps)
  rows = []
  for n in tower_counts:
    for k in sorted({1, ks[-1]}):
      step = AccumulationStep(workload, CPU, n, per_tower_batch, k,
                              num_devices)
      try:
        rows.append(row(step))
      finally:
        step.close()
  return rows


def row(step: AccumulationStep,
        seconds: Optional[Sequence[float]] = None) -> Dict[str, object]:
  """Returns a step's row; with the seconds of its timed updates, timed.

  A timed row has `report.step_stats` of its updates, its examples/sec (an
  update's examples over the median update), and the updates it ran
  beside the global step (one per applied update: equal).

  Args:
    step: the row's step, not closed yet if timed (its global step is
      read).
    seconds: its timed updates' seconds; None for a row only counted.

  Returns:
    The row, as results.json holds it.
  """
  result = {"variant": step.variant, "title": TITLES[step.variant],
            "num_towers": step.num_towers,
            "accumulate_steps": step.accumulate_steps,
            "per_tower_batch": step.per_tower_batch,
            "examples_per_update": step.examples_per_update,
            "variable_device": VARIABLE_DEVICES[step.variant],
            "all_reduce": step.all_reduce, "num_ops": step.num_ops,
            "first_update_sec": step.first_update_sec,
            "timed": seconds is not None, "traffic": step.traffic}
  if seconds is not None:
    stats = report.step_stats(seconds)
    result.update(stats, runs_per_step=step.accumulate_steps,
                  examples_per_sec=(step.examples_per_update
                                    / stats["median_step_sec"]),
                  updates=step.updates, global_step=step.global_step())
  return result


def _speed(row_: Dict[str, object], reference: Dict[str, object]
          ) -> Tuple[float, List[float]]:
  """Returns row's examples/sec over reference's, with a 95% interval.

  `report.ratio_interval` is of the median update times; the updates'
  examples differ, so it is scaled by their ratio.

  Args:
    row_: a timed row.
    reference: the timed row it is compared with.

  Returns:
    ``(ratio, [low, high])``.
  """
  scale = row_["examples_per_update"] / reference["examples_per_update"]
  low, high = report.ratio_interval(row_, reference)
  return (row_["examples_per_sec"] / reference["examples_per_sec"],
          [scale * low, scale * high])


def comparisons(rows: Sequence[Dict[str, object]],
                counted: Sequence[Dict[str, object]]
               ) -> List[Dict[str, object]]:
  """Returns, per tower count, the largest K against k = 1 (and plain).

  ``bytes_ratio``: bytes per example at K over k = 1, replicated (its
  design: 1/K, ``expected_bytes_ratio``); ``speed_ratio``: examples/sec
  at K over k = 1 with its 95% bootstrap interval; ``plain_speed_ratio``:
  at K over plain's (the same examples per update in one run);
  ``cpu_bytes_ratio``: bytes per example at K over k = 1 with the
  variables on /cpu:0, where counted.

  Args:
    rows: the timed rows (`row`).
    counted: the rows only counted (`count_only`).

  Returns:
    One entry per tower count whose largest k is above 1.
  """
  by_key = {(r["num_towers"], r["variant"], r["accumulate_steps"]): r
            for r in list(rows) + list(counted)}
  result = []
  for n in sorted({r["num_towers"] for r in rows}):
    most = max(k for m, v, k in by_key if m == n and v == ACCUMULATED)
    if most == 1:
      continue
    one, top = by_key[(n, ACCUMULATED, 1)], by_key[(n, ACCUMULATED, most)]
    speed, interval = _speed(top, one)
    entry = {"num_towers": n, "accumulate_steps": most,
             "bytes_ratio": (top["traffic"]["bytes_per_example"]
                             / one["traffic"]["bytes_per_example"]),
             "expected_bytes_ratio": 1.0 / most,
             "bytes_per_example": top["traffic"]["bytes_per_example"],
             "bytes_per_example_k1": one["traffic"]["bytes_per_example"],
             "speed_ratio": speed, "speed_interval": interval,
             "plain_speed_ratio": None, "plain_speed_interval": None,
             "cpu_bytes_ratio": None}
    plain = by_key.get((n, PLAIN, 1))
    if plain is not None:
      entry["plain_speed_ratio"], entry["plain_speed_interval"] = _speed(
          top, plain)
    cpu_one, cpu_top = by_key.get((n, CPU, 1)), by_key.get((n, CPU, most))
    if cpu_one is not None and cpu_top is not None:
      entry["cpu_bytes_ratio"] = (cpu_top["traffic"]["bytes_per_example"]
                                  / cpu_one["traffic"]["bytes_per_example"])
    result.append(entry)
  return result


def not_run(devices: Dict[str, List[str]]) -> List[str]:
  """Says what these rows did not run or measure, and what they show.

  Args:
    devices: the towers' devices, by tower count.

  Returns:
    One sentence per note, for results.json and the table.
  """
  notes = []
  if not all("gpu" in d.lower() for names in devices.values()
             for d in names):
    notes.append(
        "no GPU: the towers ran on virtual CPU devices "
        "(towers.virtual_cpu_config), which share this machine's cores and "
        "memory; a send between them passes a pointer, so the timings show "
        "the graphs' overhead (the accumulators' adds, the cond), not what "
        "a reduction over a GPU link costs")
  notes += [
      "the bytes were counted, not measured on a link: each _Send between "
      "two devices in the partition graphs, sized by its tensor's static "
      "shape and dtype; they are the bytes a GPU machine would copy",
      "a run that does not apply was not traced on its own: its partition "
      "graphs are the applying run's (the same fetches), whose apply "
      "branch's sends carry dead tensors, no data, when the branch is not "
      "taken; they are left out of its count",
      "the variable_device='cpu' rows were counted, not timed"]
  return notes


def result(steps: Dict[Key, AccumulationStep],
           times: Dict[Key, Sequence[float]],
           counted: Sequence[Dict[str, object]], *, per_tower_batch: int,
           accumulate_steps: Sequence[int], rounds_info: Dict[str, object],
           workload_name: str = WORKLOAD) -> Dict[str, object]:
  """Returns the section: its timed rows, the counted ones, the ratios.

  Reads each step's global step: call it before closing them.

  Args:
    steps: `build`'s steps, timed.
    times: each step's timed updates' seconds (`benchmarks.run.interleave`).
    counted: `count_only`'s rows.
    per_tower_batch: b.
    accumulate_steps: the k asked for.
    rounds_info: `benchmarks.run.interleave`'s.
    workload_name: the model.

  Returns:
    The section of results.json: the rows, the counted rows, the
    comparisons (`comparisons`), the devices and what was not run.
  """
  order = {v: i for i, v in enumerate(VARIANTS)}
  keys = sorted(steps, key=lambda k: (k[0], order[k[1]], k[2]))
  rows = [row(steps[key], times[key]) for key in keys]
  counts = sorted({key[0] for key in keys} | {r["num_towers"]
                                               for r in counted})
  devices = {str(n): towers.tower_devices(n) for n in counts}
  return {"workload": workload_name,
          "title": workloads.WORKLOADS[workload_name].title,
          "per_tower_batch": per_tower_batch,
          "accumulate_steps": steps_with_one(accumulate_steps),
          "tower_counts": counts, "variable_device": "replicated",
          "rows": rows, "counted_rows": list(counted),
          "comparisons": comparisons(rows, counted), "devices": devices,
          "not_run": not_run(devices), "rounds": rounds_info}
