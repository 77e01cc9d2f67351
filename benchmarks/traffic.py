"""Bytes and tensors that cross between devices in one training step.

A step's partition graphs (``RunOptions.output_partition_graphs``) hold one
graph per device; a tensor that goes from one device to another leaves its
device through a ``_Send`` node whose ``send_device`` is not its
``recv_device``. Each such send is counted once, for the device that sends
(sent) and the one that receives (received). Its bytes are the static shape
and dtype of the tensor it sends, looked up by name in the graph the step was
built from: the partitioner keeps the names of the nodes it splits (a node
Grappler renamed is looked up as the op it replaces, `_tensor`). Its own
sends, which carry control edges across devices, send a zero-element dummy
constant that is in no graph of ours: they move no data and are counted
apart, as control edges.

Collective ops (``CollectiveReduceV2``) move their data inside the op, not
through sends, so the partition graphs do not show it: their traffic is
counted from their algorithm, a ring (NCCL's between GPUs, TensorFlow's own
between CPUs), in which each of the N devices sends 2·(N−1)/N of the tensor,
in 2·(N−1) messages, and receives as much.

With gradient packing (``pack_bytes``), the small gradients reduced alike
cross as one tensor per pack, not one per variable: `expected` predicts
that from the variables' devices, sizes and dtypes alone, by the design's
rule (`reductions`), not from the library's code, so that the measurement
checks the library.

What a tensor carries decides where it is counted: *parameters* are tensors
computed from a trainable variable or a copy of one (the variables, the
gradients, their sums and the losses), *input* tensors are computed from the
input batch alone (the towers' shards), *other* tensors from neither (a
constant). The counts depend on the graph, not on the hardware: on virtual
CPU devices, where a send passes a pointer, they are the bytes a GPU machine
would copy.

A step is counted as every step after the first runs it. With replicated
variables, the first step after the local init op also sets every copy from
copy 0 (``towers/_startup.py``: a v1 cond named ``set_copies`` on a local
flag, ``copies_are_set``); every later step takes the cond's empty branch,
whose sends carry dead tensors, no data. So the sends of ops inside those
conds are in no count but ``startup_sends`` (`in_startup`), and the flag is
no parameter: the predicate it sends to each copy's device is *other*.
"""

import re
from typing import (Callable, Dict, Iterable, Iterator, List, Optional,
                    Sequence, Set, Tuple)

import tensorflow.compat.v1 as tf

PARAMETERS = "parameters"
INPUT = "input"
OTHER = "other"

# How a variant's parameters are expected to cross devices (`expected`).
STAR = "star"
RING = "ring"
NONE = "none"

COLLECTIVE_OPS = frozenset(["CollectiveReduce", "CollectiveReduceV2"])
SEND_OPS = frozenset(["_Send", "_HostSend"])
# Their tensors' bytes do not follow from shape and dtype.
UNSIZED_DTYPES = frozenset([tf.resource, tf.variant, tf.string])
FIELDS = ("sent_bytes", "received_bytes", "sent_tensors", "received_tensors")
# The start-up's conds and flags, by the names towers/_startup.py gives them.
STARTUP_COND = re.compile(r"(^|/)set_copies(_\d+)?/")
STARTUP_FLAG = re.compile(r"(^|/)copies_are_set(_\d+)?$")


def device_name(device: str) -> str:
  """Returns a device's short name, ``"cpu:0"`` for any spelling of it."""
  spec = tf.DeviceSpec.from_string(device)
  return "%s:%d" % ((spec.device_type or "cpu").lower(),
                    spec.device_index or 0)


def task_name(device: str) -> str:
  """Returns the task a device is on, ``"worker:1"``; ``"local"`` if none.

  Devices of one process spell no job: they are all one task's.
  """
  spec = tf.DeviceSpec.from_string(device)
  if not spec.job:
    return "local"
  return "%s:%d" % (spec.job, spec.task or 0)


def contexts(op: tf.Operation) -> Iterator[object]:
  """`op`'s v1 control-flow context, then each context around it."""
  # No public accessor: tf.cond's own code reads the same attribute.
  context = op._control_flow_context  # pylint: disable=protected-access
  while context is not None:
    yield context
    context = context.outer_context


def in_startup(op: tf.Operation) -> bool:
  """Whether `op` is inside a branch of a start-up cond (``set_copies``),
  which sets the copies at the first step only."""
  return any(STARTUP_COND.search(getattr(c, "name", ""))
             for c in contexts(op))


def _downstream(ops: Iterable[tf.Operation]) -> Set[str]:
  """Returns the names of `ops` and of every op that reads their outputs."""
  seen: Set[str] = set()
  stack = list(ops)
  while stack:
    op = stack.pop()
    if op.name in seen:
      continue
    seen.add(op.name)
    for output in op.outputs:
      stack.extend(output.consumers())
  return seen


def _add(devices: Dict[str, Dict[str, float]], device: str, *,
         sent: float = 0, received: float = 0, sent_tensors: int = 0,
         received_tensors: int = 0) -> None:
  fields = devices.setdefault(device, dict.fromkeys(FIELDS, 0))
  fields["sent_bytes"] += sent
  fields["received_bytes"] += received
  fields["sent_tensors"] += sent_tensors
  fields["received_tensors"] += received_tensors


def _move(devices: Dict[str, Dict[str, float]], source: str, target: str,
          size: float) -> None:
  """Counts one tensor of `size` bytes sent from `source` to `target`."""
  _add(devices, source, sent=size, sent_tensors=1)
  _add(devices, target, received=size, received_tensors=1)


def _ring(devices: Dict[str, Dict[str, float]], device: str, size: float,
          n: int) -> None:
  """Counts one device's part of a ring all-reduce of `size` bytes."""
  share = 2.0 * (n - 1) / n * size
  _add(devices, device, sent=share, received=share,
       sent_tensors=2 * (n - 1), received_tensors=2 * (n - 1))


def count(partition_graphs: Sequence[tf.GraphDef], graph: tf.Graph,
          parameters: Sequence[tf.Variable],
          inputs: Sequence[tf.Tensor], *,
          tasks: bool = False,
          skip: Optional[Callable[[tf.Operation], bool]] = None
         ) -> Dict[str, object]:
  """Counts what one step's partition graphs move between devices.

  Args:
    partition_graphs: ``RunMetadata.partition_graphs`` of the step.
    graph: the graph the step was built from.
    parameters: the trainable variables and their copies.
    inputs: the input batch's tensors, as read before the towers split it.
    tasks: count what crosses between tasks (`task_name`) instead: a send
      between two devices of one task is not counted, ``devices`` is keyed
      by task. A collective's ring is then in ``collectives`` and
      ``collective_bytes`` only, not in ``devices``: which members' ring
      neighbours are on another task is not in the partition graphs of one
      task's session (`benchmarks.across_workers` counts that part).
    skip: ``skip(op) -> bool`` on the op whose output a send carries (for a
      constant Grappler folded, the op it replaces), and on each collective
      op: where True, that send or collective is in no count but
      ``skipped``. A partition graph holds the sends of both branches of a
      ``tf.cond`` whichever one runs, and those of the branch not taken
      carry dead tensors, no data: a run that takes one branch is counted
      by skipping the other's ops (`benchmarks.accumulation`). None (the
      default) counts everything.

  Returns:
    A dict: ``devices``, device (or task) -> the parameters' sent and
    received bytes and tensors (`FIELDS`); ``input`` and ``other``, the
    bytes and tensors sent in all of those kinds; ``control_edges``, the
    sends of control edges; ``collectives``, the collective ops counted
    from their algorithm;
    ``collective_bytes``, device -> the bytes its collective ops sum (their
    inputs); ``unsized``, the names of sent tensors whose size is unknown
    (in no other count); ``skipped``, the sends and collectives `skip`
    left out; ``startup_sends``, the sends of the start-up's conds, left
    out (`in_startup`).
  """
  from_parameters = _downstream(v.op for v in parameters
                                if not STARTUP_FLAG.search(v.op.name))
  from_inputs = _downstream(t.op for t in inputs)

  def kind(op: tf.Operation) -> str:
    if op.name in from_parameters:
      return PARAMETERS
    return INPUT if op.name in from_inputs else OTHER

  key = task_name if tasks else device_name
  devices: Dict[str, Dict[str, float]] = {}
  totals = {k: {"bytes": 0, "tensors": 0} for k in (INPUT, OTHER)}
  result = {"devices": devices, INPUT: totals[INPUT], OTHER: totals[OTHER],
            "control_edges": 0, "collectives": 0, "collective_bytes": {},
            "unsized": [], "skipped": 0, "startup_sends": 0}
  for partition in partition_graphs:
    nodes = {node.name: node for node in partition.node}
    for node in partition.node:
      if node.op in COLLECTIVE_OPS:
        _count_collective(node, graph, kind, None if tasks else devices,
                          result, skip)
        continue
      if node.op not in SEND_OPS:
        continue
      source = key(node.attr["send_device"].s.decode())
      target = key(node.attr["recv_device"].s.decode())
      if source == target:
        continue
      name = node.input[0]
      tensor = _tensor(graph, name)
      if tensor is not None:
        if in_startup(tensor.op):
          result["startup_sends"] += 1
          continue
        if skip is not None and skip(tensor.op):
          result["skipped"] += 1
          continue
        size, what = _bytes(tensor), kind(tensor.op)
      else:
        sent = nodes.get(name.split(":")[0])
        if _is_control_dummy(sent):
          result["control_edges"] += 1
          continue
        origin = _folded_origin(sent, graph)
        if origin is not None and in_startup(origin):
          result["startup_sends"] += 1
          continue
        if skip is not None and origin is not None and skip(origin):
          result["skipped"] += 1
          continue
        size, what = _folded(sent, graph, kind)
      if size is None:
        result["unsized"].append(name)
      elif what == PARAMETERS:
        _move(devices, source, target, size)
      else:
        totals[what]["bytes"] += size
        totals[what]["tensors"] += 1
  result["devices"] = dict(sorted(devices.items()))
  return result


def _count_collective(node, graph: tf.Graph, kind, devices, result,
                      skip=None) -> None:
  """Counts one device's part of a ring all-reduce from its algorithm.

  With `devices` None, only its bytes summed and the count (``tasks``);
  one that `skip` (`count`'s) leaves out only in ``skipped``.
  """
  try:
    op = graph.get_operation_by_name(node.name)
  except KeyError:
    result["unsized"].append(node.name)
    return
  if skip is not None and skip(op):
    result["skipped"] += 1
    return
  size = _bytes(op.inputs[0])
  if op.type == "CollectiveReduceV2":
    group_size = tf.get_static_value(op.inputs[1])
  else:
    group_size = op.get_attr("group_size")
  if size is None or group_size is None:
    result["unsized"].append(op.name)
    return
  n = int(group_size)
  result["collectives"] += 1
  device = device_name(node.device)
  summed = result["collective_bytes"]
  summed[device] = summed.get(device, 0) + size
  if n < 2 or devices is None:
    return
  what = kind(op)
  if what == PARAMETERS:
    _ring(devices, device, size, n)
  else:
    result[what]["bytes"] += 2.0 * (n - 1) / n * size
    result[what]["tensors"] += 2 * (n - 1)


def _tensor(graph: tf.Graph, name: str):
  """Returns the tensor of `graph` a partition graph's `name` carries, or
  None. A node Grappler's arithmetic optimizer rewrote (a chain of adds made
  a tree, ``<scope>/ArithmeticOptimizer/AddOpsRewrite_<op>``) stands in for
  the op it is named after: the same output, shape and dtype."""
  name = re.sub(r"(^|/)ArithmeticOptimizer/[A-Za-z]+_([^/]+)$", r"\1\2",
                name)
  try:
    return graph.get_tensor_by_name(name if ":" in name else name + ":0")
  except (KeyError, ValueError):
    return None


def _bytes(tensor: tf.Tensor):
  """Returns a tensor's bytes from its static shape, or None if unknown."""
  dtype = tensor.dtype.base_dtype
  if not tensor.shape.is_fully_defined() or dtype in UNSIZED_DTYPES:
    return None
  return tensor.shape.num_elements() * dtype.size


def _folded(node, graph: tf.Graph, kind):
  """Returns ``(bytes, kind)`` of a constant Grappler made, or (None, None).

  Constant folding replaces ops whose inputs are all constants (the split
  of a constant batch) with a ``Const`` named after the op it replaces
  (``ConstantFolding/<op>-folded-<i>``), so it is counted as that op's
  output. A folded constant never comes from a variable.
  """
  if node is None or node.op != "Const":
    return None, None
  value = node.attr["value"].tensor
  dtype = tf.as_dtype(value.dtype)
  if dtype in UNSIZED_DTYPES:
    return None, None
  size = dtype.size
  for dim in value.tensor_shape.dim:
    size *= dim.size
  origin = _folded_origin(node, graph)
  return size, OTHER if origin is None else kind(origin)


def _folded_origin(node, graph: tf.Graph) -> Optional[tf.Operation]:
  """Returns the op of `graph` a folded constant replaces, or None."""
  if node is None or node.op != "Const":
    return None
  origin = re.sub(r"-folded(-\d+)?$", "", node.name.split("/", 1)[-1]
                  if node.name.startswith("ConstantFolding/") else node.name)
  try:
    return graph.get_operation_by_name(origin)
  except KeyError:
    return None


def _is_control_dummy(node) -> bool:
  """Whether a partition node is the partitioner's control-edge dummy."""
  if node is None or node.op != "Const":
    return False
  dims = node.attr["value"].tensor.tensor_shape.dim
  return any(d.size == 0 for d in dims)


def variable_bytes(var: tf.Variable) -> int:
  """Returns a variable's bytes, from its static shape."""
  return var.shape.num_elements() * var.dtype.base_dtype.size


def variable_rows(variables: Sequence[tf.Variable]) -> List[tuple]:
  """Returns ``(device, bytes, dtype name)`` of each variable: what
  `reductions`, `expected` and `expected_collectives` take."""
  return [(v.device, variable_bytes(v), v.dtype.base_dtype.name)
          for v in variables]


def reductions(variables: Sequence[tuple], num_towers: int,
               pack_bytes: int) -> List[Tuple[str, float]]:
  """Returns what the design reduces: ``(home device, bytes)`` per tensor.

  With two or more towers and ``pack_bytes > 0``, the variables of at most
  `pack_bytes` bytes that share a home device and a dtype are one pack
  when there are two or more of them; every other variable is reduced
  alone. Packs come first, in the order of their first variable, then the
  variables reduced alone, in their order. Every variable's gradients are
  taken to come from the same tower devices, as in every variant here.

  Args:
    variables: ``(device, bytes)`` or ``(device, bytes, dtype)`` of each
      trainable variable (copy 0's); a missing dtype is one dtype for all.
    num_towers: the number of towers.
    pack_bytes: the largest variable, in bytes, that is packed; 0 packs
      nothing.
  """
  keys: List[Optional[Tuple[str, object]]] = []
  sizes: Dict[Tuple[str, object], List[float]] = {}
  for variable in variables:
    home, size = device_name(variable[0]), variable[1]
    key = None
    if num_towers > 1 and pack_bytes > 0 and size <= pack_bytes:
      key = (home, variable[2] if len(variable) > 2 else None)
      sizes.setdefault(key, []).append(size)
    keys.append(key)
  packs = [(home, sum(s)) for (home, _), s in sizes.items() if len(s) > 1]
  alone = [(device_name(v[0]), v[1]) for v, key in zip(variables, keys)
           if key is None or len(sizes[key]) == 1]
  return packs + alone


def expected(pattern: str, variables: Sequence[tuple],
             devices: Sequence[str], *, pack_bytes: int = 0,
             replicated: bool = False) -> Dict[str, Dict[str, float]]:
  """Returns what each device should send and receive per step.

  Args:
    pattern: `STAR`: each variable is read by every tower from the device it
      lives on (its only copy, or copy 0 where the ``add_n`` sum runs), and
      each tower's gradient goes back there: that device sends the variable
      (or the sum) once to every other tower device and receives one
      gradient from each.
      `RING`: each device sends and receives 2·(N−1)/N of every variable,
      in 2·(N−1) messages. `NONE`: nothing.
      With packing, a pack crosses where its gradients would (`reductions`):
      the same bytes in fewer tensors. What the towers read stays one tensor
      per variable per tower; with `replicated` (``add_n`` over copies), what
      goes out is the sums instead, one per pack.
    variables: ``(device, bytes)`` or ``(device, bytes, dtype)`` of each
      trainable variable (copy 0's).
    devices: the towers' devices.
    pack_bytes: the ``pack_bytes`` in effect; 0 (the default) packs nothing.
    replicated: whether each tower has its own copy (`STAR`: the variable's
      device sends the sums, not the variables).

  Returns:
    device -> `FIELDS`, the parameters' traffic.
  """
  if pattern not in (STAR, RING, NONE):
    raise ValueError("expected pattern %r, %r or %r, got %r"
                     % (STAR, RING, NONE, pattern))
  towers = [device_name(d) for d in devices]
  result = {d: dict.fromkeys(FIELDS, 0) for d in towers}
  if pattern == NONE:
    return dict(sorted(result.items()))
  units = reductions(variables, len(towers), pack_bytes)
  if pattern == RING:
    if len(towers) > 1:
      for tower in towers:
        for _, size in units:
          _ring(result, tower, size, len(towers))
    return dict(sorted(result.items()))
  # What goes out: the sums (one per reduction), or the variables' reads.
  out = units if replicated else [(device_name(v[0]), v[1])
                                  for v in variables]
  for home, size in out:
    for tower in towers:
      if tower != home:
        _move(result, home, tower, size)
  for home, size in units:
    for tower in towers:
      if tower != home:
        _move(result, tower, home, size)
  return dict(sorted(result.items()))


def expected_collectives(variables: Sequence[tuple], devices: Sequence[str],
                         *, pack_bytes: int = 0) -> int:
  """Returns the collective ops of a step: one per reduction per device.

  Args are those of `expected`.
  """
  n = len(devices)
  return n * len(reductions(variables, n, pack_bytes)) if n > 1 else 0


def through(fields: Dict[str, float]) -> float:
  """Returns the bytes through a device: sent plus received."""
  return fields["sent_bytes"] + fields["received_bytes"]


def tensors_through(fields: Dict[str, float]) -> int:
  """Returns the tensors through a device: sent plus received."""
  return int(fields["sent_tensors"] + fields["received_tensors"])


def busiest(devices: Dict[str, Dict[str, float]],
            measure: Callable[[Dict[str, float]], float] = through
           ) -> Tuple[str, float]:
  """Returns the device with the most through it, and that amount.

  `measure` says what is counted: bytes (`through`, the default) or
  tensors (`tensors_through`). Ties go to the first device by name.
  """
  if not devices:
    return "-", 0
  name = max(sorted(devices), key=lambda d: measure(devices[d]))
  return name, measure(devices[name])


def summarize(measured: Dict[str, object],
              expectation: Dict[str, Dict[str, float]], *,
              parameter_bytes: int, pack_bytes: int = 0,
              expected_collectives: Optional[int] = None
             ) -> Dict[str, object]:
  """Puts a measurement beside its expectation, per device and busiest.

  Every tower device is listed, with zeros where nothing crossed. The
  busiest device is given in bytes and, apart, in tensors; ``tensors`` is
  every tensor that crossed (each counted once, where it was sent).

  Args:
    measured: `count`'s result.
    expectation: `expected`'s result.
    parameter_bytes: the trainable variables' bytes (copy 0's).
    pack_bytes: the ``pack_bytes`` in effect, recorded.
    expected_collectives: the collective ops the design makes
      (`expected_collectives`), or None where it makes none.
  """
  names = sorted(set(measured["devices"]) | set(expectation))
  zero = dict.fromkeys(FIELDS, 0)
  devices = {}
  for name in names:
    row = dict(measured["devices"].get(name, zero))
    row.update({"expected_" + k: v
                for k, v in expectation.get(name, zero).items()})
    devices[name] = row
  expected_devices = {d: {k: v["expected_" + k] for k in FIELDS}
                      for d, v in devices.items()}
  device, measured_bytes = busiest(devices)
  expected_device, expected_bytes = busiest(expected_devices)
  tensor_device, measured_tensors = busiest(devices, tensors_through)
  expected_tensor_device, expected_tensors = busiest(expected_devices,
                                                     tensors_through)
  collectives = measured["collectives"]
  return {
      "devices": devices, "parameter_bytes": parameter_bytes,
      "pack_bytes": pack_bytes,
      "busiest_device": device, "busiest_bytes": measured_bytes,
      "expected_busiest_device": expected_device,
      "expected_busiest_bytes": expected_bytes,
      "busiest_tensors_device": tensor_device,
      "busiest_tensors": measured_tensors,
      "expected_busiest_tensors_device": expected_tensor_device,
      "expected_busiest_tensors": expected_tensors,
      "tensors": int(sum(f["sent_tensors"] for f in devices.values())),
      "expected_tensors": int(sum(f["expected_sent_tensors"]
                                  for f in devices.values())),
      "expected_collectives": expected_collectives,
      "input_bytes": measured[INPUT]["bytes"],
      "input_tensors": measured[INPUT]["tensors"],
      "other_bytes": measured[OTHER]["bytes"],
      "other_tensors": measured[OTHER]["tensors"],
      "control_edges": measured["control_edges"],
      "startup_sends": measured.get("startup_sends", 0),
      "collectives": collectives,
      "collective_bytes": dict(sorted(measured.get("collective_bytes",
                                                   {}).items())),
      "unsized": list(measured["unsized"]),
      "counted_from": ("partition graphs; collectives from their ring "
                       "algorithm" if collectives else "partition graphs")}


def measure(session: tf.Session, fetches, graph: tf.Graph,
            parameters: Sequence[tf.Variable],
            inputs: Sequence[tf.Tensor], *, tasks: bool = False,
            timeout_ms: int = 0,
            skip: Optional[Callable[[tf.Operation], bool]] = None
           ) -> Dict[str, object]:
  """Runs one step of `fetches` and `count`s its partition graphs.

  `tasks` and `skip` are `count`'s. A step that takes longer than
  `timeout_ms` fails (0: only the session's ``operation_timeout_in_ms``
  applies).
  """
  run_metadata = tf.RunMetadata()
  session.run(fetches,
              options=tf.RunOptions(output_partition_graphs=True,
                                    timeout_in_ms=timeout_ms),
              run_metadata=run_metadata)
  return count(run_metadata.partition_graphs, graph, parameters, inputs,
               tasks=tasks, skip=skip)


def relative_error(measured: float, expectation: float) -> float:
  """Returns ``measured / expectation - 1``; 0 when both are 0."""
  if expectation == 0:
    return 0.0 if measured == 0 else float("inf")
  return measured / expectation - 1.0
