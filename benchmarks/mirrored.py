"""TF2's MirroredStrategy on the same models and batches, in worker processes.

MirroredStrategy needs eager execution and its logical devices configured
before TensorFlow's runtime starts, and strategies over different device sets
(or different models) in one process clash in TensorFlow's collective-op
keys. So each strategy (one workload, one tower count) runs in a worker
process of its own, started once and driven step by step (`MirroredWorker`):
in every round the parent asks each worker for its steps between the graph
variants' steps, so the machine's drift hits it as it hits them, and only
one process computes at a time.

The workers train the examples' models unchanged: their ``tf.get_variable``
calls run inside a Keras layer decorated with
``tf.compat.v1.keras.utils.track_tf1_style_variables`` (TF2's migration shim,
from tf_keras on TensorFlow >= 2.16, hence ``TF_USE_LEGACY_KERAS=1``), which
creates them once as mirrored variables. A ``tf.function`` step runs
``strategy.run`` of a replica step (forward, ``GradientTape`` backward, the
Keras SGD-with-momentum ``apply_gradients``, which all-reduces the replicas'
gradients) and reduces the loss; each replica's loss is divided by the number
of replicas, as TF2's custom-loop guide does, so the summed all-reduce is the
mean over the global batch.

Without that tf_keras (of TensorFlow's own minor version) the workers cannot
start: `unavailable_reason` says so, with the install command, and the
benchmark skips the MirroredStrategy rows instead of failing.

Protocol: one JSON object per line, parent to worker on stdin
(``{"steps": n}``, ``{"quit": true}``), worker to parent on its original
stdout (``{"ready": ...}``, ``{"times": [...]}``, ``{"error": ...}``).
"""

import importlib.metadata
import json
import os
import subprocess
import sys
import time
from typing import Dict, List, Optional

from absl import logging

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# Keras 3 (TensorFlow >= 2.16) has no track_tf1_style_variables; tf_keras does.
LEGACY_KERAS_SINCE = (2, 16)


def unavailable_reason(tf_version: str,
                       tf_keras_version: Optional[str]) -> Optional[str]:
  """Returns why the MirroredStrategy workers cannot run, or None if they can.

  On TensorFlow >= 2.16 the workers need tf_keras of TensorFlow's own minor
  version (`TF_USE_LEGACY_KERAS=1`); without it they fail at start-up with
  "Keras cannot be imported".

  Args:
    tf_version: the installed TensorFlow's version, such as "2.21.0".
    tf_keras_version: the installed tf_keras's version, or None if it is not
      installed.

  Returns:
    A one-line reason with the exact install command, or None.
  """
  major, minor = (int(v) for v in tf_version.split(".")[:2])
  if (major, minor) < LEGACY_KERAS_SINCE:
    return None
  if tf_keras_version is not None:
    if tf_keras_version.split(".")[:2] == [str(major), str(minor)]:
      return None
    got = "tf_keras %s is installed" % tf_keras_version
  else:
    got = "tf_keras is not installed"
  return ("MirroredStrategy skipped: on TensorFlow %s its workers need "
          "tf_keras %d.%d (%s); install it with: pip install "
          "\"tf_keras==%d.%d.*\"" % (tf_version, major, minor, got, major,
                                      minor))


def installed_unavailable_reason() -> Optional[str]:
  """`unavailable_reason` for the TensorFlow and tf_keras installed here."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  try:
    tf_keras_version: Optional[str] = importlib.metadata.version("tf_keras")
  except importlib.metadata.PackageNotFoundError:
    tf_keras_version = None
  return unavailable_reason(tf.__version__, tf_keras_version)


def job_key(workload: str, num_towers: int) -> str:
  return "%s/%d" % (workload, num_towers)


class MirroredWorker:
  """The parent's handle on one worker process: one strategy, one model.

  Each worker holds a single MirroredStrategy: strategies over different
  device sets (or different models) in one process clash in TensorFlow's
  collective-op keys.
  """

  def __init__(self, workload: str, num_towers: int, batch_size: int,
               num_devices: int):
    """Starts the worker; `wait_until_ready` waits for its model.

    Args:
      workload: the workload's name.
      num_towers: the strategy's replicas (tower devices).
      batch_size: the global batch, split over the replicas.
      num_devices: the logical CPU devices the worker makes (the largest
        number of towers), when the machine has too few GPUs.
    """
    self.key = job_key(workload, num_towers)
    self.devices = None
    env = dict(os.environ)
    env["TF_USE_LEGACY_KERAS"] = "1"
    env["PYTHONPATH"] = os.pathsep.join(
        [ROOT] + [p for p in [env.get("PYTHONPATH")] if p])
    spec = json.dumps({"workload": workload, "num_towers": num_towers,
                       "batch_size": batch_size, "num_devices": num_devices})
    # The worker's logs go to our stderr; its stdout is the reply channel.
    self._process = subprocess.Popen(
        [sys.executable, "-m", "benchmarks.mirrored", spec],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)

  @property
  def pid(self) -> int:
    return self._process.pid

  def wait_until_ready(self) -> None:
    """Waits until the worker has built its model.

    Raises:
      RuntimeError: if the worker failed.
    """
    if self.devices is None:
      self.devices = self._read()["devices"]

  def _read(self) -> Dict[str, object]:
    line = self._process.stdout.readline()
    if not line:
      code = self._process.wait()
      raise RuntimeError("the MirroredStrategy worker for %s exited with "
                         "status %s (its log is above)" % (self.key, code))
    reply = json.loads(line)
    if "error" in reply:
      raise RuntimeError("the MirroredStrategy worker for %s failed: %s"
                         % (self.key, reply["error"]))
    return reply

  def run(self, steps: int) -> List[float]:
    """Runs `steps` training steps; returns each one's wall time (s)."""
    self.wait_until_ready()
    self._process.stdin.write(json.dumps({"steps": steps}) + "\n")
    self._process.stdin.flush()
    return self._read()["times"]

  def close(self) -> None:
    """Stops the worker."""
    if self._process.poll() is None:
      try:
        self._process.stdin.write(json.dumps({"quit": True}) + "\n")
        self._process.stdin.flush()
        self._process.wait(timeout=60)
      except (OSError, subprocess.TimeoutExpired):
        self._process.kill()
        self._process.wait()


# The worker side. Everything below runs in the worker process only.


def _configure_devices(num_devices: int) -> List[str]:
  """Returns the worker's tower devices: GPUs, else logical CPUs."""
  import tensorflow.compat.v2 as tf  # pylint: disable=g-import-not-at-top
  gpus = tf.config.list_physical_devices("GPU")
  for gpu in gpus:
    # Other workers and the parent's sessions share the GPUs.
    tf.config.experimental.set_memory_growth(gpu, True)
  if len(gpus) >= num_devices:
    return ["/gpu:%d" % i for i in range(num_devices)]
  cpus = tf.config.list_physical_devices("CPU")
  tf.config.set_logical_device_configuration(
      cpus[0], [tf.config.LogicalDeviceConfiguration()] * num_devices)
  return ["/cpu:%d" % i for i in range(num_devices)]


class _Job:
  """One MirroredStrategy, its model, optimizer, batch and step."""

  def __init__(self, workload_name: str, num_towers: int, batch_size: int,
               devices: List[str]):
    # TF2 code: MirroredStrategy, tf.function and GradientTape are v2 APIs.
    import tensorflow.compat.v2 as tf  # pylint: disable=g-import-not-at-top
    from benchmarks import graphs  # pylint: disable=g-import-not-at-top
    from benchmarks import workloads  # pylint: disable=g-import-not-at-top

    workload = workloads.WORKLOADS[workload_name]
    strategy = tf.distribute.MirroredStrategy(devices=devices[:num_towers])
    track = tf.compat.v1.keras.utils.track_tf1_style_variables

    class Model(tf.keras.layers.Layer):

      @track
      def call(self, images, labels):
        return workload.loss_fn(images, labels)

    images, labels = workloads.synthetic_batch(workload, batch_size)
    tf.random.set_seed(0)
    with strategy.scope():
      model = Model(name=workload_name)
      optimizer = tf.keras.optimizers.SGD(
          learning_rate=graphs.LEARNING_RATE, momentum=graphs.MOMENTUM)
      # One eager call creates the variables, mirrored on every device.
      model(images[:1], labels[:1])
    sizes = _shard_sizes(batch_size, num_towers)
    starts = [sum(sizes[:i]) for i in range(num_towers)]

    def shard(context):
      # Called under each replica's device: the shard is copied there once,
      # so no input pipeline is timed.
      i = context.replica_id_in_sync_group
      part = slice(starts[i], starts[i] + sizes[i])
      return (tf.identity(tf.constant(images[part])),
              tf.identity(tf.constant(labels[part])))

    self._data = strategy.experimental_distribute_values_from_function(shard)

    @tf.function
    def train_step(images, labels):

      def replica_step(images, labels):
        with tf.GradientTape() as tape:
          loss = model(images, labels) / strategy.num_replicas_in_sync
        variables = model.trainable_variables
        grads = tape.gradient(loss, variables)
        optimizer.apply_gradients(zip(grads, variables))
        return loss

      losses = strategy.run(replica_step, args=(images, labels))
      return strategy.reduce(tf.distribute.ReduceOp.SUM, losses, axis=None)

    self._step = train_step
    self.num_variables = len(model.trainable_variables)

  def run(self, steps: int) -> List[float]:
    times = []
    for _ in range(steps):
      start = time.perf_counter()
      # .numpy() waits for the step to finish.
      self._step(*self._data).numpy()
      times.append(time.perf_counter() - start)
    return times


def _shard_sizes(batch_size: int, num_shards: int) -> List[int]:
  """Nearly equal shards, the larger first: the split `towers` makes."""
  base, extra = divmod(batch_size, num_shards)
  return [base + (1 if i < extra else 0) for i in range(num_shards)]


def _serve(spec: Dict[str, object], replies) -> None:
  devices = _configure_devices(spec["num_devices"])
  job = _Job(spec["workload"], spec["num_towers"], spec["batch_size"],
             devices)
  # One step traces the tf.function now, while the parent is busy building
  # its own graphs, rather than in the parent's warm-up.
  job.run(1)
  logging.info("MirroredStrategy worker: %s on %s, traced",
               job_key(spec["workload"], spec["num_towers"]),
               ", ".join(devices[:spec["num_towers"]]))

  def reply(message):
    replies.write(json.dumps(message) + "\n")
    replies.flush()

  reply({"ready": True, "devices": devices[:spec["num_towers"]]})
  for line in sys.stdin:
    command = json.loads(line)
    if command.get("quit"):
      return
    reply({"times": job.run(command["steps"])})


def main() -> None:
  # Only this channel carries replies; anything else the libraries write to
  # stdout goes to stderr instead.
  replies = os.fdopen(os.dup(sys.stdout.fileno()), "w")
  os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
  logging.set_verbosity(logging.INFO)
  try:
    _serve(json.loads(sys.argv[1]), replies)
  except Exception as e:  # pylint: disable=broad-except
    # Any failure is reported to the parent, which raises it.
    logging.exception("MirroredStrategy worker failed")
    replies.write(json.dumps({"error": "%s: %s" % (type(e).__name__, e)})
                  + "\n")
    replies.flush()
    raise SystemExit(1)


if __name__ == "__main__":
  main()
