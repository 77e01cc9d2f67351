"""`average_gradients` alone: ours against the original's on a large set.

Each tower's gradients are reads of non-trainable variables on the tower's
device (``towers.tower_devices``: GPUs when there are enough, else virtual
CPUs; ``[num_towers][num_vars]`` of ``[num_floats]`` float32), so a step
does little but average: each variable's average is reduced next to it on
``/cpu:0``, and the step fetches the sum of all averages (a cheap sink, so
that Grappler does not prune the averaging).

Time is measured in the benchmark's process, interleaved with the other
variant. Peak memory is measured in a fresh process per variant
(``python -m benchmarks.averaging --variant=towers ...`` prints one JSON
line), after one warm-up step, in two ways:

- tensors: TensorFlow's own allocation records of one traced step
  (``RunOptions.FULL_TRACE``; each node's allocations and frees with their
  times), replayed in time order: the peak of the bytes allocated during the
  step and alive at once, and their total;
- process: the peak resident set size (VmHWM) of the same step minus the
  resident size before it, the peak reset through ``/proc/self/clear_refs``
  first. glibc's malloc is told (``MALLOC_MMAP_THRESHOLD_``) to map every
  buffer of 1 MiB or more on its own and unmap it when freed, so resident
  memory follows live tensors instead of a heap that keeps freed memory.
  Where the kernel refuses the reset, the result says so.
"""

import json
import os
import subprocess
import sys
import threading
import time
from typing import Dict, List, Sequence, Tuple

from absl import app
from absl import flags
import tensorflow.compat.v1 as tf

import towers
from benchmarks import graphs
from benchmarks import original

OURS = "towers"
ORIGINAL = "original"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Buffers from this size up get their own mapping in the memory process.
MMAP_THRESHOLD = 1 << 20


class AveragingStep:
  """One variant's averaging graph, built, initialized and ready to time."""

  def __init__(self, variant: str, num_towers: int, num_vars: int,
               num_floats: int):
    graph = tf.Graph()
    with graph.as_default():
      step = _build(variant, num_towers, num_vars, num_floats)
      init = tf.global_variables_initializer()
    graph.finalize()
    self._step = step
    self._session = tf.Session(graph=graph,
                               config=graphs.session_config(num_towers))
    self._session.run(init)

  def run(self, steps: int) -> List[float]:
    """Runs `steps` averaging steps; returns each one's wall time (s)."""
    times = []
    for _ in range(steps):
      start = time.perf_counter()
      self._session.run(self._step)
      times.append(time.perf_counter() - start)
    return times

  def run_traced(self) -> tf.RunMetadata:
    """Runs one step with a full trace; returns its metadata."""
    run_metadata = tf.RunMetadata()
    self._session.run(
        self._step,
        options=tf.RunOptions(trace_level=tf.RunOptions.FULL_TRACE),
        run_metadata=run_metadata)
    return run_metadata

  def close(self) -> None:
    self._session.close()


def _build(variant: str, num_towers: int, num_vars: int,
           num_floats: int) -> tf.Tensor:
  with tf.device("/cpu:0"):
    variables = [tf.get_variable("var_%d" % j, [num_floats],
                                 initializer=tf.zeros_initializer())
                 for j in range(num_vars)]
  tower_grads = []
  for i, device in enumerate(towers.tower_devices(num_towers)):
    # A fill, not random numbers: initialization stays fast, and the
    # values do not matter to the speed of a sum.
    with tf.device(device):
      grads = [tf.get_variable(
          "grad_%d_%d" % (i, j), [num_floats], trainable=False,
          initializer=tf.constant_initializer(float(i + 1))).value()
               for j in range(num_vars)]
    tower_grads.append(list(zip(grads, variables)))
  if variant == OURS:
    averaged = towers.average_gradients(tower_grads)
  elif variant == ORIGINAL:
    with tf.device("/cpu:0"):
      averaged = original.average_gradients(tower_grads)
  else:
    raise ValueError("expected variant %r or %r, got %r"
                     % (OURS, ORIGINAL, variant))
  # Grappler prunes ops whose results nothing reads, so the step fetches
  # the sum of every average: a cheap sink, the same for both variants,
  # that allocates nothing large.
  with tf.device("/cpu:0"):
    return tf.add_n([tf.reduce_sum(grad) for grad, _ in averaged],
                    name="average")


def temporary_bytes(variant: str, num_towers: int, num_floats: int) -> int:
  """Returns the bytes one variable's averaging allocates, by construction.

  Ours: the ``add_n`` result (the ``1/N`` scaling reuses its buffer). The
  original's: the ``[num_towers, ...]`` concat buffer plus the mean.
  """
  size = num_floats * 4
  if variant == OURS:
    return size
  return (num_towers + 1) * size


def _status(field: str) -> int:
  """Returns a /proc/self/status memory field (such as VmRSS) in bytes."""
  with open("/proc/self/status") as f:
    for line in f:
      if line.startswith(field + ":"):
        return int(line.split()[1]) * 1024
  raise RuntimeError("no %s in /proc/self/status" % field)


def _reset_peak() -> bool:
  """Resets VmHWM to the current RSS (Linux >= 4.0); False if refused."""
  try:
    with open("/proc/self/clear_refs", "w") as f:
      f.write("5")
    return True
  except OSError:
    return False


def _tensor_peak(run_metadata: tf.RunMetadata) -> Tuple[int, int]:
  """Returns (peak live bytes, total bytes) allocated during a traced step."""
  records = []
  for device in run_metadata.step_stats.dev_stats:
    for node in device.node_stats:
      for memory in node.memory:
        records.extend((r.alloc_micros, r.alloc_bytes)
                       for r in memory.allocation_records)
  live = peak = total = 0
  # Frees sort before allocations of the same microsecond.
  for _, size in sorted(records):
    live += size
    peak = max(peak, live)
    total += max(size, 0)
  return peak, total


def measure_peak(variant: str, num_towers: int, num_vars: int,
                 num_floats: int) -> Dict[str, object]:
  """Builds one variant here and returns the peak memory of one step.

  Call in a fresh process (`PeakMeasurements`): the peak resident size is per
  process.
  """
  step = AveragingStep(variant, num_towers, num_vars, num_floats)
  step.run(1)
  before = _status("VmRSS")
  reset = _reset_peak()
  run_metadata = step.run_traced()
  peak = _status("VmHWM")
  step.close()
  tensor_peak, tensor_total = _tensor_peak(run_metadata)
  return {"variant": variant, "rss_before_bytes": before,
          "rss_peak_extra_bytes": max(0, peak - before),
          "rss_peak_reset": reset,
          "tensor_peak_bytes": tensor_peak,
          "tensor_allocated_bytes": tensor_total}


class PeakMeasurements:
  """`measure_peak` of several setups, one fresh Python process each.

  Memory does not depend on what else the machine runs, so the benchmark
  starts these early, next to its other start-up work, and collects them
  before anything is timed. The processes run one after another (from a
  background thread), so that at most one large gradient set is in memory.
  """

  def __init__(self, setups: Sequence[Tuple[str, int, int, int]]):
    """Starts measuring.

    Args:
      setups: ``(variant, num_towers, num_vars, num_floats)`` tuples.
    """
    self._setups = list(setups)
    self._results = {}
    self._error = None
    self._thread = threading.Thread(target=self._measure_all, daemon=True)
    self._thread.start()

  def _measure_all(self) -> None:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [ROOT] + [p for p in [env.get("PYTHONPATH")] if p])
    env["MALLOC_MMAP_THRESHOLD_"] = str(MMAP_THRESHOLD)
    for variant, num_towers, num_vars, num_floats in self._setups:
      done = subprocess.run(
          [sys.executable, "-m", "benchmarks.averaging",
           "--variant=" + variant, "--num_towers=%d" % num_towers,
           "--num_vars=%d" % num_vars, "--num_floats=%d" % num_floats],
          stdout=subprocess.PIPE, text=True, env=env, check=False)
      if done.returncode != 0:
        self._error = ("the peak-memory process for %s with %d towers "
                       "exited with status %d (its log is above)"
                       % (variant, num_towers, done.returncode))
        return
      self._results[(variant, num_towers)] = json.loads(
          done.stdout.strip().splitlines()[-1])

  def results(self) -> Dict[Tuple[str, int], Dict[str, object]]:
    """Waits for every measurement; returns (variant, towers) -> result.

    Raises:
      RuntimeError: if a measuring process failed.
    """
    self._thread.join()
    if self._error:
      raise RuntimeError(self._error)
    return dict(self._results)


def main(argv):
  del argv  # Unused.
  print(json.dumps(measure_peak(flags.FLAGS.variant, flags.FLAGS.num_towers,
                                flags.FLAGS.num_vars,
                                flags.FLAGS.num_floats)))


if __name__ == "__main__":
  flags.DEFINE_enum("variant", OURS, [OURS, ORIGINAL], "Which averaging.")
  flags.DEFINE_integer("num_towers", 4, "Towers.")
  flags.DEFINE_integer("num_vars", 8, "Variables (gradients per tower).")
  flags.DEFINE_integer("num_floats", 4 * 1024 * 1024, "Floats per variable.")
  app.run(main)
