"""The graph-mode variants: one device, `towers`, and the original averaging.

`towers` packs small gradients by default (``pack_bytes``); each mode it is
timed with packing off too has an ``_unpacked`` twin (``pack_bytes=0``),
otherwise the same graph.

Every variant gets its own ``tf.Graph`` and ``tf.Session`` with the same
``towers.virtual_cpu_config(num_devices)``, so all of them see the same
devices and share the process's thread pools; the same synthetic global batch
sits in non-trainable variables on ``/cpu:0``, so no input pipeline is timed.
Each variant also counts, in one untimed step, the bytes and tensors that
cross between its devices (`benchmarks.traffic`). The fast paths' rows
(`benchmarks.fast_paths`) pass `towers.minimize` more arguments, and the
staging rows read the same batch through a ``tf.data`` pipeline instead.
"""

import inspect
import time
from typing import Callable, Dict, List, Optional

import numpy as np
import tensorflow.compat.v1 as tf

import towers
from benchmarks import original
from benchmarks import traffic
from benchmarks import workloads

PLAIN = "plain"
TOWERS = "towers"
TOWERS_UNPACKED = "towers_unpacked"
BALANCED = "towers_balanced"
REPLICATED_ADD_N = "replicated_add_n"
REPLICATED_ADD_N_UNPACKED = "replicated_add_n_unpacked"
REPLICATED_RING = "replicated_ring"
REPLICATED_COLLECTIVE = "replicated_collective"
REPLICATED_COLLECTIVE_UNPACKED = "replicated_collective_unpacked"
INDEPENDENT = "independent"
ORIGINAL = "original"
MIRRORED = "mirrored"
# In the order tables and charts list them.
VARIANTS = (PLAIN, TOWERS, TOWERS_UNPACKED, BALANCED, REPLICATED_ADD_N,
            REPLICATED_ADD_N_UNPACKED, REPLICATED_RING, REPLICATED_COLLECTIVE,
            REPLICATED_COLLECTIVE_UNPACKED, INDEPENDENT, ORIGINAL, MIRRORED)
REPLICATED = {REPLICATED_ADD_N: "add_n", REPLICATED_RING: "ring",
              REPLICATED_COLLECTIVE: "collective"}
# Each unpacked variant: its packed twin, the same graph with pack_bytes=0.
UNPACKED = {TOWERS_UNPACKED: TOWERS,
            REPLICATED_ADD_N_UNPACKED: REPLICATED_ADD_N,
            REPLICATED_COLLECTIVE_UNPACKED: REPLICATED_COLLECTIVE}
# The variants whose gradients towers.average_gradients reduces: they pack.
PACKING = (TOWERS, BALANCED) + tuple(REPLICATED)
TITLES = {
    PLAIN: "plain (one device, opt.minimize)",
    TOWERS: "towers (variables on /cpu:0)",
    TOWERS_UNPACKED: "towers (variables on /cpu:0, pack_bytes=0)",
    BALANCED: "towers (variable_device='balanced')",
    REPLICATED_ADD_N: "towers (replicated, all_reduce='add_n')",
    REPLICATED_ADD_N_UNPACKED: ("towers (replicated, all_reduce='add_n', "
                                "pack_bytes=0)"),
    REPLICATED_RING: "towers (replicated, all_reduce='ring')",
    REPLICATED_COLLECTIVE: "towers (replicated, all_reduce='collective')",
    REPLICATED_COLLECTIVE_UNPACKED: ("towers (replicated, "
                                     "all_reduce='collective', "
                                     "pack_bytes=0)"),
    INDEPENDENT: "independent (a copy per tower, nothing exchanged)",
    ORIGINAL: "original average_gradients",
    MIRRORED: "MirroredStrategy (TF2, tf.function)",
}
# How each graph variant's parameters should cross devices
# (`traffic.expected`): through the device each variable lives on (its one
# copy, or copy 0 where the add_n sum runs), around a ring, or not at all.
PATTERNS = {
    PLAIN: traffic.STAR, TOWERS: traffic.STAR, BALANCED: traffic.STAR,
    ORIGINAL: traffic.STAR, REPLICATED_ADD_N: traffic.STAR,
    REPLICATED_RING: traffic.RING, REPLICATED_COLLECTIVE: traffic.RING,
    INDEPENDENT: traffic.NONE,
}
PATTERNS.update({unpacked: PATTERNS[packed]
                 for unpacked, packed in UNPACKED.items()})
# A collective waiting for a member that never comes would hang the run:
# every graph session fails a step that takes longer than this instead (a
# step takes under a second here; a first step on GPUs, autotuning, longer).
STEP_TIMEOUT_MS = 120 * 1000
# The variants that towers.minimize builds: they take its other arguments.
MINIMIZED = (TOWERS, TOWERS_UNPACKED, BALANCED) + tuple(REPLICATED) + (
    REPLICATED_ADD_N_UNPACKED, REPLICATED_COLLECTIVE_UNPACKED)

# The examples' optimizer. The rate is small so that random labels never
# drive the loss to NaN, whose slow paths would distort the timing.
LEARNING_RATE = 0.01
MOMENTUM = 0.9


class GraphStep:
  """One graph variant, built, initialized and ready to time.

  Attributes:
    num_ops: the operations in the variant's graph.
    traffic: what crosses between devices in one step, measured and
      expected (`traffic.summarize`).
    first_step_sec: the wall time of the first step (the one that counts
      the traffic), TensorFlow's graph optimizations and any XLA
      compilation included.
  """

  def __init__(self, workload: workloads.Workload, variant: str,
               num_towers: int, batch: np.ndarray, labels: np.ndarray,
               num_devices: int, pack_bytes: Optional[int] = None, *,
               minimize_kwargs: Optional[Dict[str, object]] = None,
               dataset: bool = False,
               rewrite: Optional[Callable[[tf.Graph], None]] = None):
    """Builds the variant's training step in a graph of its own.

    Initializes the global variables, then the local ones (the replicated
    copies, set from copy 0), starts the graph's queue runners if it has
    any (``stage_inputs``), and runs one untimed step that counts the
    traffic.

    Args:
      workload: the model.
      variant: a graph variant (any of `VARIANTS` but `MIRRORED`).
      num_towers: the number of towers (1 for `PLAIN`).
      batch: the global batch of images, ``[batch_size, ...]``.
      labels: the global batch's labels, ``[batch_size]``.
      num_devices: the virtual CPU devices of the session (the largest
        number of towers of the run, so that every variant sees the same).
      pack_bytes: for a variant in `PACKING`, the ``pack_bytes`` to pass to
        `towers.minimize`; None leaves the library's default.
      minimize_kwargs: for a variant in `MINIMIZED`, more arguments of
        `towers.minimize` (``compute_dtype``, ``stage_inputs``).
      dataset: read the batch through ``tf.data`` (`_dataset_on_cpu`): each
        tower calls the iterator's ``get_next``. Only for a variant in
        `MINIMIZED`, whose towers then take their batch size from it.
      rewrite: called with the graph once the step is built, before its ops
        are counted and its initializers made: a twin's change to the same
        graph (`benchmarks.startup`).

    Raises:
      ValueError: if `variant` is not a graph variant, `pack_bytes` is
        given for a variant that does not pack, `minimize_kwargs` or
        `dataset` for one that `towers.minimize` does not build, or the
        dataset's batch does not split evenly over the towers.
    """
    if pack_bytes is not None and variant not in PACKING:
      raise ValueError("expected pack_bytes only for a packing variant (%s), "
                       "got pack_bytes=%d for %r"
                       % (", ".join(PACKING), pack_bytes, variant))
    if (minimize_kwargs or dataset) and variant not in MINIMIZED:
      raise ValueError("expected minimize_kwargs and dataset only for a "
                       "variant towers.minimize builds (%s), got %r"
                       % (", ".join(MINIMIZED), variant))
    self.pack_bytes = pack_bytes_in_effect(variant, pack_bytes)
    self._graph = tf.Graph()
    devices = towers.tower_devices(num_towers)
    with self._graph.as_default():
      tf.set_random_seed(0)
      if dataset:
        inputs = _dataset_on_cpu(batch, labels, num_towers)
      else:
        inputs = data_on_cpu(batch, labels)
      train_op = _build(workload, variant, devices, inputs,
                        pack_bytes=pack_bytes,
                        minimize_kwargs=minimize_kwargs)
      if rewrite is not None:
        rewrite(self._graph)
      # What the towers read, for the traffic's input bytes: the batch's
      # variables, or what the iterator hands the towers.
      data = inputs if not dataset else [
          t for op in self._graph.get_operations()
          if op.type == "IteratorGetNext" for t in op.outputs]
      init = tf.global_variables_initializer()
      self.num_ops = len(self._graph.get_operations())
      local_init = tf.local_variables_initializer()
      trainable = tf.trainable_variables()
      # The copies (and their slots) are local variables.
      parameters = trainable + tf.local_variables()
      queue_runners = tf.get_collection(tf.GraphKeys.QUEUE_RUNNERS)
    self._graph.finalize()
    self._train_op = train_op
    # A queue runner's enqueue waits, blocked, while other variants are
    # timed (or the run waits for quiet): no session-wide timeout, which
    # would fail it; each step carries the timeout instead. The unstaged
    # twins of the staged rows (the dataset rows) run the same way, so that
    # the two differ in staging alone.
    self._options = None
    if queue_runners or dataset:
      self._options = tf.RunOptions(timeout_in_ms=STEP_TIMEOUT_MS)
    self._session = tf.Session(graph=self._graph, config=session_config(
        num_devices, timeout_ms=0 if self._options else STEP_TIMEOUT_MS))
    self._coordinator, self._threads = None, []
    try:
      self._session.run(init)
      # Apart, so the copies start equal to copy 0 (the first step would set
      # them anyway).
      self._session.run(local_init)
      if queue_runners:
        self._coordinator = tf.train.Coordinator()
        with self._graph.as_default():
          self._threads = tf.train.start_queue_runners(self._session,
                                                       self._coordinator)
      start = time.perf_counter()
      measured = traffic.measure(self._session, train_op, self._graph,
                                 parameters, data)
      self.first_step_sec = time.perf_counter() - start
    except BaseException:
      # A step that cannot run (a kernel missing for a dtype) leaves no
      # session or reader thread behind.
      self.close()
      raise
    variables = traffic.variable_rows(trainable)
    replicated = UNPACKED.get(variant, variant) in REPLICATED
    expectation = traffic.expected(
        PATTERNS[variant], variables, devices, pack_bytes=self.pack_bytes,
        replicated=replicated)
    collectives = None
    if REPLICATED.get(UNPACKED.get(variant, variant)) == "collective":
      collectives = traffic.expected_collectives(variables, devices,
                                                 pack_bytes=self.pack_bytes)
    self.traffic = traffic.summarize(
        measured, expectation,
        parameter_bytes=sum(map(traffic.variable_bytes, trainable)),
        pack_bytes=self.pack_bytes, expected_collectives=collectives)

  def run(self, steps: int) -> List[float]:
    """Runs `steps` training steps; returns each one's wall time (s)."""
    times = []
    for _ in range(steps):
      start = time.perf_counter()
      self._session.run(self._train_op, options=self._options)
      times.append(time.perf_counter() - start)
    return times

  def traced_step(self) -> tf.RunMetadata:
    """Runs one step with a full trace; returns its ``RunMetadata``, whose
    ``step_stats`` list every node the step ran."""
    options = tf.RunOptions(trace_level=tf.RunOptions.FULL_TRACE)
    if self._options is not None:
      options.MergeFrom(self._options)
    run_metadata = tf.RunMetadata()
    self._session.run(self._train_op, options=options,
                      run_metadata=run_metadata)
    return run_metadata

  def close(self) -> None:
    """Stops the queue runners, if any, then closes the session."""
    if self._coordinator is not None:
      # Stopping cancels the reader's pending enqueue; it ends at once.
      self._coordinator.request_stop()
      self._coordinator.join(self._threads, stop_grace_period_secs=10)
      self._coordinator = None
    self._session.close()


def session_config(num_devices: int,
                   timeout_ms: int = STEP_TIMEOUT_MS) -> tf.ConfigProto:
  """Returns every variant's session config: the same devices for all.

  On GPUs, memory grows as needed, since several variants' sessions (and
  the MirroredStrategy workers) share the GPUs. A step that takes longer
  than `timeout_ms` (default `STEP_TIMEOUT_MS`; 0: no limit) fails
  (DeadlineExceeded) rather than hanging.
  """
  return towers.virtual_cpu_config(
      num_devices, gpu_options=tf.GPUOptions(allow_growth=True),
      operation_timeout_in_ms=timeout_ms)


def pack_bytes_in_effect(variant: str,
                         pack_bytes: Optional[int] = None) -> int:
  """Returns the ``pack_bytes`` a variant's reduction runs with.

  0 where nothing is packed: the unpacked twins, and the variants whose
  gradients `towers.average_gradients` does not reduce (plain, independent,
  original).
  """
  if variant not in PACKING:
    return 0
  if pack_bytes is None:
    # The library's default, read from its public signature.
    return inspect.signature(towers.minimize).parameters["pack_bytes"].default
  return pack_bytes


def data_on_cpu(images: np.ndarray, labels: np.ndarray, *,
                device: str = "/cpu:0", local: bool = False):
  """Returns the global batch as reads of non-trainable variables.

  On `device`; in the ``LOCAL_VARIABLES`` collection if `local` (each
  worker of a cluster initializes its own), else in the global one.
  """
  # Variables, not constants fed each step: the batch is copied into the
  # graph's memory once, at initialization, and each step only reads it.
  kwargs = dict(trainable=False)
  if local:
    kwargs["collections"] = [tf.GraphKeys.LOCAL_VARIABLES]
  with tf.device(device), tf.variable_scope("synthetic_data"):
    image_var = tf.get_variable("images", initializer=tf.constant(images),
                                **kwargs)
    label_var = tf.get_variable("labels", initializer=tf.constant(labels),
                                **kwargs)
    return image_var.value(), label_var.value()


def _dataset_on_cpu(images: np.ndarray, labels: np.ndarray,
                    num_towers: int) -> Callable[[], object]:
  """Returns a ``tf.data`` iterator's ``get_next`` over the global batch.

  Each call reads one tower's share: the batch held in memory, sliced,
  repeated and batched by ``len(images) // num_towers`` (static shapes),
  and prefetched, as an input pipeline ends.
  """
  if len(images) % num_towers:
    raise ValueError("expected a global batch that splits evenly over %d "
                     "towers, got %d examples" % (num_towers, len(images)))
  with tf.device("/cpu:0"), tf.name_scope("synthetic_data"):
    dataset = tf.data.Dataset.from_tensor_slices((images, labels))
    dataset = dataset.repeat().batch(len(images) // num_towers,
                                     drop_remainder=True).prefetch(1)
    return tf.data.make_one_shot_iterator(dataset).get_next


def _build(workload: workloads.Workload, variant: str, devices: List[str],
           inputs, *, pack_bytes: Optional[int] = None,
           minimize_kwargs: Optional[Dict[str, object]] = None
          ) -> tf.Operation:
  """Builds a variant's train op.

  `inputs` is ``(images, labels)``, or for a variant in `MINIMIZED` also a
  callable that returns a tower's batch.
  """
  global_step = tf.train.get_or_create_global_step()
  opt = tf.train.MomentumOptimizer(LEARNING_RATE, MOMENTUM)
  num_towers = len(devices)
  # The packed variants leave the library's default unless told otherwise.
  options = {} if pack_bytes is None else {"pack_bytes": pack_bytes}
  if variant in UNPACKED:
    variant, options = UNPACKED[variant], {"pack_bytes": 0}
  options.update(minimize_kwargs or {})

  def model_fn(scope, images, labels):
    del scope  # No summaries are kept.
    return workload.loss_fn(images, labels)

  if variant == PLAIN:
    # What a single-device user writes: the model on one device, with its
    # variables, and opt.minimize.
    with tf.device(devices[0]):
      return opt.minimize(workload.loss_fn(*inputs),
                          global_step=global_step)
  if variant in (TOWERS, BALANCED):
    train_op, _ = towers.minimize(
        model_fn, opt, num_towers, inputs=inputs, devices=devices,
        variable_device="balanced" if variant == BALANCED else "cpu",
        global_step=global_step, **options)
    return train_op
  if variant in REPLICATED:
    train_op, _ = towers.minimize(
        model_fn, opt, num_towers, inputs=inputs, devices=devices,
        variable_device="replicated", all_reduce=REPLICATED[variant],
        global_step=global_step, **options)
    return train_op
  if variant == INDEPENDENT:
    # tf_cnn_benchmarks' upper bound for split compute: each tower's own
    # gradient, unreduced, updates its own copy; nothing is exchanged.
    built = towers.build_towers(model_fn, opt, num_towers,
                                inputs=inputs, devices=devices,
                                variable_device="replicated")
    # Another optimizer than build_towers' (whose apply_gradients takes
    # copy 0's pairs and updates every copy): it applies the pairs as given.
    return tf.train.MomentumOptimizer(LEARNING_RATE, MOMENTUM).apply_gradients(
        [pair for tower in built.tower_grads for pair in tower],
        global_step=global_step)
  if variant == ORIGINAL:
    return original.minimize(model_fn, opt, num_towers,
                             inputs=inputs, devices=devices,
                             global_step=global_step)
  raise ValueError("expected a graph variant (%s), got %r"
                   % (", ".join(v for v in VARIANTS if v != MIRRORED),
                      variant))
