"""Across workers: 2 workers x 2 towers on loopback, against 1 x 4.

Three ways to train the same model on 4 towers of the same per-tower batch
(so the same global batch), each timed in interleaved rounds like the other
sections (`run.interleave`):

- **baseline**: one process, one session, 4 towers on 4 virtual CPU devices,
  ``towers.minimize`` with its defaults (one copy of the variables, on
  ``/cpu:0``): the suite's ``towers`` row (`graphs.GraphStep`).
- **ps** (parameter server): 1 ps task and 2 worker tasks, each its own
  process with a ``tf.train.Server`` on 127.0.0.1. Each worker builds its
  own graph, as `examples/mnist_multi_gpu_train.py` does in a cluster: 2
  towers over its own devices (``towers.tower_devices(2, task=...)``),
  variables on the ps (``tf.train.replica_device_setter`` as
  ``variable_device``), the towers' gradients averaged on the worker's CPU
  (``average_device``) and aggregated by ``tf.train.SyncReplicasOptimizer``
  (2 replicas to aggregate of 2) through its session hook
  (``towers.training.sync_replicas_hook``).
- **collective**: 2 worker tasks and no ps: each worker keeps its own
  copies (``variable_device='replicated'``) and all-reduces its towers'
  gradients with the other worker's in one collective group of all 4 towers
  (``all_reduce='collective', num_workers=2``); the workers start from the
  chief's values (``towers.broadcast_variables``).

Each visit of a round tells every worker of a cluster to run one step at
once (a synchronous step needs them all), as many times as it has steps,
and takes, step by step, the slowest worker's time: examples/sec is the
global batch over the median of those. One step per command, not several:
with a ps, a worker told to run several could take both of the step's
``SyncReplicasOptimizer`` tokens and finish, leaving the other's step
waiting for a token no gradient of the finished worker would release (seen
as a 2-minute timeout in 2 of 6 runs of the test). A step that waits longer than
`graphs.STEP_TIMEOUT_MS` fails (the collective sessions'
``operation_timeout_in_ms``; with a ps, each step's own), and a process
that does not answer in `REPLY_TIMEOUT_SECS` fails the run and is killed:
nothing hangs.

Bytes per worker per step, two ways:

- *counted*: one step's partition graphs (``output_partition_graphs``),
  each ``_Send`` whose send and receive devices are on different tasks,
  sized by its tensor's static shape (`traffic.count` with ``tasks=True``).
  The collective's all-reduce runs inside its ops, not through sends: it is
  counted from its algorithm. TensorFlow's CPU collectives reduce around a
  ring of the group's N members ordered by task, so each task's members are
  neighbours and the ring crosses between tasks once from each task: a
  member sends 2(N-1)/N of each tensor to its neighbour, so each worker
  sends 2(N-1)/N of its collectives' bytes across (and receives as much).
- *measured*: the TCP bytes each worker process sent (acknowledged) and
  received on its sockets over `measure_steps` steps, read from the
  kernel's ``tcp_info`` (``ss -tinp``): real loopback traffic, gRPC's
  framing and its control messages included.
"""

import collections
import json
import os
import queue
import re
import subprocess
import sys
import threading
import time
from typing import Dict, List, Optional, Sequence, Tuple

from absl import logging
import tensorflow.compat.v1 as tf

import towers
from towers import training
from benchmarks import graphs
from benchmarks import report
from benchmarks import traffic
from benchmarks import workloads

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

BASELINE = "baseline"
PS = "ps"
COLLECTIVE = "collective"
KINDS = (BASELINE, PS, COLLECTIVE)
TITLES = {
    BASELINE: "1 worker x 4 towers (one process, variables on /cpu:0)",
    PS: "2 workers x 2 towers, 1 ps (SyncReplicasOptimizer)",
    COLLECTIVE: "2 workers x 2 towers, collective all-reduce (replicated)",
}
NUM_WORKERS = 2
TOWERS_PER_WORKER = 2
# The longest the parent waits for a process's answer: start-up (importing
# TensorFlow, building the graph) of several processes on a shared machine,
# or a step's timeout, whichever fails first.
REPLY_TIMEOUT_SECS = 300

Socket = collections.namedtuple("Socket", ["pids", "sent", "received"])


def parse_ss(text: str) -> List[Socket]:
  """Parses ``ss -tinpH``: each socket's processes and its bytes.

  Each socket is a line naming its processes (``users:(("python",pid=12,
  fd=3))``), then an indented line of its ``tcp_info``; ``bytes_acked``
  (sent and acknowledged: no retransmission twice) and ``bytes_received``
  are missing while 0.
  """
  found = []
  pids: Tuple[int, ...] = ()
  for line in text.splitlines():
    if not line.strip():
      continue
    if not line[0].isspace():
      pids = tuple(int(p) for p in re.findall(r"pid=(\d+)", line))
      continue
    acked = re.search(r"\bbytes_acked:(\d+)", line)
    received = re.search(r"\bbytes_received:(\d+)", line)
    found.append(Socket(pids, int(acked.group(1)) if acked else 0,
                        int(received.group(1)) if received else 0))
    pids = ()
  return found


def tcp_bytes(pids: Sequence[int]) -> Optional[Dict[int, Tuple[int, int]]]:
  """Returns pid -> (bytes sent, bytes received) on its TCP sockets now.

  None where ``ss`` is missing or fails (then nothing is measured).
  """
  try:
    done = subprocess.run(["ss", "-tinpH"], capture_output=True, text=True,
                          timeout=30, check=True)
  except (OSError, subprocess.SubprocessError):
    return None
  totals = {pid: (0, 0) for pid in pids}
  for s in parse_ss(done.stdout):
    for pid in s.pids:
      if pid in totals:
        sent, received = totals[pid]
        totals[pid] = (sent + s.sent, received + s.received)
  return totals


def ring_across(collective_bytes: Dict[str, float], group_size: int
               ) -> float:
  """Returns what a worker's collectives send to other tasks per step.

  In a ring of `group_size` members ordered by task, one member of each
  task has its neighbour on the next task (in each of the ring's
  subdivisions, whichever member that is): the task sends what one member
  sends, 2(N-1)/N of what each member sums, and receives as much.

  Args:
    collective_bytes: this worker's devices -> the bytes their collectives
      sum per step (`traffic.count`): the same for each member.
    group_size: N, every worker's towers.
  """
  if group_size < 2 or not collective_bytes:
    return 0.0
  return 2.0 * (group_size - 1) / group_size * max(collective_bytes.values())


class _Process:
  """One task's process, driven by JSON lines (as `benchmarks.mirrored`).

  Parent to process on stdin: ``{"command": ..., ...}``; process to parent,
  on its original stdout: one reply per command, ``{"error": ...}`` on
  failure. A thread reads the replies, so that a wait can time out.
  """

  def __init__(self, spec: Dict[str, object]):
    self.name = "%s %s:%d" % (spec["kind"], spec["job"], spec["task_index"])
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [ROOT] + [p for p in [env.get("PYTHONPATH")] if p])
    self._process = subprocess.Popen(
        [sys.executable, "-m", "benchmarks.across_workers",
         json.dumps(spec)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
    self._replies: "queue.Queue[Optional[str]]" = queue.Queue()
    threading.Thread(target=self._read_all, daemon=True).start()

  @property
  def pid(self) -> int:
    return self._process.pid

  def _read_all(self) -> None:
    for line in self._process.stdout:
      self._replies.put(line)
    self._replies.put(None)

  def send(self, **command) -> None:
    self._process.stdin.write(json.dumps(command) + "\n")
    self._process.stdin.flush()

  def reply(self, timeout: float = REPLY_TIMEOUT_SECS) -> Dict[str, object]:
    """Returns the process's next reply.

    Raises:
      RuntimeError: if it failed, exited, or gave no reply in `timeout`.
    """
    try:
      line = self._replies.get(timeout=timeout)
    except queue.Empty:
      raise RuntimeError("%s gave no answer in %d s (its log is above)"
                         % (self.name, timeout)) from None
    if line is None:
      raise RuntimeError("%s exited with status %s (its log is above)"
                         % (self.name, self._process.wait()))
    answer = json.loads(line)
    if "error" in answer:
      raise RuntimeError("%s failed: %s" % (self.name, answer["error"]))
    return answer

  def close(self) -> None:
    """Asks the process to quit; kills it if it does not within 30 s."""
    if self._process.poll() is not None:
      return
    try:
      self.send(command="quit")
      self._process.wait(timeout=30)
    except (OSError, subprocess.TimeoutExpired):
      self._process.kill()
      self._process.wait()


class Cluster:
  """The processes of one kind: ready to time, step by step.

  Attributes:
    kind: `BASELINE`, `PS` or `COLLECTIVE`.
    traffic: per worker task, what one step's partition graphs send between
      tasks (`_Worker.count`'s reply); set by `count`.
    tcp: per worker task, the TCP bytes its process sent and received per
      step; set by `measure_tcp` (None where ``ss`` is unavailable), over
      `tcp_steps` steps.
  """

  def __init__(self, kind: str, *, workload: str, per_tower_batch: int):
    """Starts the kind's processes; `wait_until_ready` waits for them."""
    self.kind = kind
    self.traffic: Dict[str, Dict[str, object]] = {}
    self.tcp: Optional[Dict[str, Dict[str, float]]] = None
    self.tcp_steps = 0
    spec = {"kind": kind, "workload": workload,
            "per_tower_batch": per_tower_batch}
    if kind == BASELINE:
      self.num_workers = 1
      self.towers_per_worker = NUM_WORKERS * TOWERS_PER_WORKER
      hosts = {}
    else:
      self.num_workers = NUM_WORKERS
      self.towers_per_worker = TOWERS_PER_WORKER
      # The launcher's own way to pick ports.
      ports = training.free_ports(
          NUM_WORKERS + (1 if kind == PS else 0))
      hosts = {"worker": ["127.0.0.1:%d" % p for p in ports[:NUM_WORKERS]]}
      if kind == PS:
        hosts["ps"] = ["127.0.0.1:%d" % ports[-1]]
    spec.update(hosts=hosts, num_towers=self.towers_per_worker,
                num_workers=self.num_workers)
    self._ps = [_Process(dict(spec, job="ps", task_index=0))] \
        if kind == PS else []
    self.workers = [_Process(dict(spec, job="worker", task_index=k))
                    for k in range(self.num_workers)]
    self.global_batch = per_tower_batch * self.num_workers * (
        self.towers_per_worker)

  @property
  def pids(self) -> List[int]:
    return [p.pid for p in self._ps + self.workers]

  def _all(self, command: str, **args) -> List[Dict[str, object]]:
    """Sends `command` to every worker at once; returns their replies."""
    for worker in self.workers:
      worker.send(command=command, **args)
    return [worker.reply() for worker in self.workers]

  def wait_until_ready(self) -> None:
    """Waits until every task has built its graph, then initializes.

    The parameter server answers once its server runs; each worker once its
    graph is built (its server runs). Then every worker initializes at
    once: in the ps cluster the chief initializes the variables and the
    other worker waits for them; in the collective one both initialize and
    receive the chief's values together (a collective broadcast).
    """
    for process in self._ps:
      process.reply()
    for worker in self.workers:
      worker.reply()
    self._all("init")

  def count(self) -> None:
    """Counts one step's sends between tasks, on every worker at once."""
    for k, answer in enumerate(self._all("count")):
      self.traffic["worker:%d" % k] = answer["traffic"]

  def _steps(self, steps: int) -> List[List[float]]:
    """Each worker's times of `steps` steps, run one at a time on every
    worker at once (see the module's docstring)."""
    times: List[List[float]] = [[] for _ in self.workers]
    for _ in range(steps):
      for k, reply in enumerate(self._all("steps", steps=1)):
        times[k] += reply["times"]
    return times

  def measure_tcp(self, steps: int) -> None:
    """Measures the TCP bytes of each worker process over `steps` steps."""
    if self.kind == BASELINE:
      return
    pids = [w.pid for w in self.workers]
    before = tcp_bytes(pids)
    self._steps(steps)
    after = tcp_bytes(pids)
    if before is None or after is None:
      logging.warning("ss -tinp is unavailable: no TCP bytes measured")
      return
    self.tcp = {"worker:%d" % k: {
        "sent_bytes": (after[pid][0] - before[pid][0]) / steps,
        "received_bytes": (after[pid][1] - before[pid][1]) / steps}
                for k, pid in enumerate(pids)}
    self.tcp_steps = steps

  def run(self, steps: int) -> List[float]:
    """Runs `steps` steps on every worker; returns each one's slowest."""
    return [max(times) for times in zip(*self._steps(steps))]

  def close(self) -> None:
    """Stops the workers, then the parameter server."""
    for process in self.workers + self._ps:
      process.close()


def start(*, workload: str, per_tower_batch: int) -> Dict[str, Cluster]:
  """Starts every kind's processes at once (their start-up overlaps)."""
  clusters = {}
  try:
    for kind in KINDS:
      clusters[kind] = Cluster(kind, workload=workload,
                               per_tower_batch=per_tower_batch)
  except BaseException:
    for cluster in clusters.values():
      cluster.close()
    raise
  return clusters


def prepare(clusters: Dict[str, Cluster], measure_steps: int) -> None:
  """Initializes every cluster, then counts and measures its bytes.

  Waits for every cluster's start-up (they start together); then, one
  cluster at a time, counts one step's sends between tasks and measures
  each worker's TCP bytes over `measure_steps` steps: counts, not timings.
  """
  for cluster in clusters.values():
    cluster.wait_until_ready()
  for cluster in clusters.values():
    cluster.count()
    cluster.measure_tcp(measure_steps)


def expected(kind: str, size: float, group_size: int
            ) -> Optional[Dict[str, float]]:
  """The design's bytes per worker per step, each way: None for one worker.

  `size` is P, the trainable variables' bytes. ps: the worker sends its
  towers' average gradient, P, and reads every variable once, P.
  collective: 2(N-1)/N P each way, N = `group_size` (`ring_across`).
  """
  if kind == PS:
    return {"sent_bytes": size, "received_bytes": size}
  if kind == COLLECTIVE:
    share = 2.0 * (group_size - 1) / group_size * size
    return {"sent_bytes": share, "received_bytes": share}
  return None


def result(clusters: Dict[str, Cluster], times: Dict[str, Sequence[float]],
           *, workload: str, title: str, per_tower_batch: int,
           rounds_info: Dict[str, object]) -> Dict[str, object]:
  """Returns the section's rows, each kind against the baseline."""
  rows = []
  for kind, cluster in clusters.items():
    size = next(iter(cluster.traffic.values()))["parameter_bytes"]
    group = cluster.num_workers * cluster.towers_per_worker
    row = {"kind": kind, "title": TITLES[kind],
           "num_workers": cluster.num_workers,
           "towers_per_worker": cluster.towers_per_worker,
           "global_batch": cluster.global_batch,
           "parameter_bytes": size, "expected": expected(kind, size, group),
           "counted": {}, "measured": cluster.tcp,
           "measured_steps": cluster.tcp_steps,
           **report.step_stats(times[kind])}
    row["examples_per_sec"] = cluster.global_batch / row["median_step_sec"]
    for task, moved in cluster.traffic.items():
      counted = {"sent_bytes": 0.0, "received_bytes": 0.0,
                 "other_bytes": moved[traffic.OTHER]["bytes"],
                 "input_bytes": moved[traffic.INPUT]["bytes"],
                 "collectives": moved["collectives"],
                 "unsized": moved["unsized"]}
      if cluster.num_workers > 1:
        fields = moved["devices"].get(task, {})
        ring = ring_across(moved["collective_bytes"], group)
        counted["sent_bytes"] = fields.get("sent_bytes", 0) + ring
        counted["received_bytes"] = fields.get("received_bytes", 0) + ring
        counted["ring_bytes"] = ring
      row["counted"][task] = counted
    rows.append(row)
  base = next(r for r in rows if r["kind"] == BASELINE)
  for row in rows:
    row["ratio_to_baseline"] = (row["examples_per_sec"]
                                / base["examples_per_sec"])
    row["ratio_interval"] = list(report.ratio_interval(row, base))
  return {"workload": workload, "title": title,
          "per_tower_batch": per_tower_batch, "rows": rows,
          "rounds": rounds_info}


# The task side. Everything below runs in the task's process only.


def _ps_step(model_fn, opt, cluster: tf.train.ClusterSpec, task: str,
             devices: List[str], data, num_workers: int):
  """A worker's step with a ps: the example's cluster graph.

  Returns:
    ``(train_op, optimizer)``: the step, and the SyncReplicasOptimizer whose
    session hook runs the aggregation.
  """
  # Around the whole graph, as the example's: the step counter and the
  # optimizer's slots on the ps, everything else on this worker; the
  # towers use it for their variables.
  setter = tf.train.replica_device_setter(cluster=cluster,
                                          worker_device=task)
  with tf.device(setter):
    global_step = tf.train.get_or_create_global_step()
    opt = tf.train.SyncReplicasOptimizer(opt,
                                         replicas_to_aggregate=num_workers,
                                         total_num_replicas=num_workers)
    train_op, _ = towers.minimize(
        model_fn, opt, len(devices), inputs=data, devices=devices,
        variable_device=setter, average_device=task + "/cpu:0",
        global_step=global_step)
  return train_op, opt


def _collective_step(model_fn, opt, task: str, devices: List[str], data,
                     num_workers: int):
  """A worker's step without a ps: copies all-reduced with the others'.

  Returns:
    ``(train_op, sync)``: the step, and the op (to run on every worker at
    once, after the initializer) that gives each worker the chief's values.
  """
  with tf.device(task + "/cpu:0"):
    global_step = tf.train.get_or_create_global_step()
  train_op, _ = towers.minimize(
      model_fn, opt, len(devices), inputs=data, devices=devices,
      variable_device="replicated", all_reduce="collective",
      num_workers=num_workers, global_step=global_step)
  with tf.control_dependencies([tf.train.Scaffold.default_local_init_op()]):
    sync = towers.broadcast_variables()
  return train_op, sync


class _Worker:
  """One worker task of a cluster: its server, graph, session and steps."""

  def __init__(self, spec: Dict[str, object]):
    self._kind, k = spec["kind"], spec["task_index"]
    num_towers = spec["num_towers"]
    self.is_chief = k == 0
    workload = workloads.WORKLOADS[spec["workload"]]
    images, labels = workloads.synthetic_batch(
        workload, spec["per_tower_batch"] * num_towers, seed=k)
    cluster = tf.train.ClusterSpec(spec["hosts"])
    task = "/job:worker/task:%d" % k
    server_config = towers.virtual_cpu_config(num_towers)
    if self._kind == COLLECTIVE:
      # The server's and the session's: task 0 resolves the groups.
      server_config.experimental.collective_group_leader = (
          training.COLLECTIVE_LEADER)
    self.server = tf.train.Server(cluster, job_name="worker", task_index=k,
                                  config=server_config)
    # A step that waits for a task that never comes fails instead of
    # hanging. With a ps, each step carries the limit: the chief's queue
    # runner waits for the workers' gradients in one op while other
    # clusters are timed (or the run waits for quiet), which a session-wide
    # limit would fail. The session talks to this worker (and the ps) only.
    self._options = tf.RunOptions(timeout_in_ms=graphs.STEP_TIMEOUT_MS)
    self._config = towers.virtual_cpu_config(
        num_towers, operation_timeout_in_ms=(
            0 if self._kind == PS else graphs.STEP_TIMEOUT_MS),
        device_filters=[task] + (["/job:ps"] if self._kind == PS else []))
    self._config.experimental.collective_group_leader = (
        server_config.experimental.collective_group_leader)
    devices = towers.tower_devices(num_towers, task=task)

    def model_fn(scope, images, labels):
      del scope  # No summaries are kept.
      return workload.loss_fn(images, labels)

    self.graph = tf.Graph()
    with self.graph.as_default():
      tf.set_random_seed(0)
      # Local: each worker initializes its own (a ps would otherwise hold
      # the chief's), outside any device function (a replica_device_setter
      # puts variables on the ps).
      data = graphs.data_on_cpu(images, labels, device=task + "/cpu:0",
                                local=True)
      opt = tf.train.MomentumOptimizer(graphs.LEARNING_RATE, graphs.MOMENTUM)
      if self._kind == PS:
        self.train_op, opt = _ps_step(model_fn, opt, cluster, task, devices,
                                      data, spec["num_workers"])
        self._hooks = [training.sync_replicas_hook(
            opt, self.is_chief)]
      else:
        self.train_op, self._sync = _collective_step(
            model_fn, opt, task, devices, data, spec["num_workers"])
        self._init = tf.global_variables_initializer()
      # The variables and their copies (local, replicated): not the batch's
      # variables, nor SyncReplicasOptimizer's local step (counted with
      # the "other" bytes, as its token).
      self._parameters = tf.trainable_variables() + [
          v for v in tf.local_variables()
          if not v.op.name.startswith("synthetic_data/")
          and "sync_rep_local_step" not in v.op.name]
      self._data = list(data)
      self.parameter_bytes = sum(map(traffic.variable_bytes,
                                     tf.trainable_variables()))
    self.session = None

  def init(self) -> None:
    """Creates the session and initializes (with the other workers)."""
    with self.graph.as_default():
      if self._kind == PS:
        if not self.is_chief:
          training.wait_for_model(
              self.server.target, self._config,
              timeout_secs=graphs.STEP_TIMEOUT_MS / 1000)
        self.session = tf.train.MonitoredTrainingSession(
            master=self.server.target, is_chief=self.is_chief,
            hooks=self._hooks, config=self._config, log_step_count_steps=0,
            save_checkpoint_secs=None, save_summaries_steps=None,
            save_summaries_secs=None, stop_grace_period_secs=5)
      else:
        self.session = tf.Session(self.server.target, config=self._config)
        self.session.run(self._init)
        self.session.run(self._sync)
    self.graph.finalize()

  def count(self) -> Dict[str, object]:
    """Runs one step; returns what it sends between tasks."""
    moved = traffic.measure(self.session, self.train_op, self.graph,
                            self._parameters, self._data, tasks=True,
                            timeout_ms=graphs.STEP_TIMEOUT_MS)
    return dict(moved, parameter_bytes=self.parameter_bytes)

  def run(self, steps: int) -> List[float]:
    times = []
    for _ in range(steps):
      start = time.perf_counter()
      self.session.run(self.train_op, options=self._options)
      times.append(time.perf_counter() - start)
    return times

  def close(self) -> None:
    if self.session is not None:
      self.session.close()


class _Baseline:
  """The one-process baseline: the suite's own step (`graphs.GraphStep`)."""

  def __init__(self, spec: Dict[str, object]):
    workload = workloads.WORKLOADS[spec["workload"]]
    n = spec["num_towers"]
    images, labels = workloads.synthetic_batch(
        workload, spec["per_tower_batch"] * n)
    self._step = graphs.GraphStep(workload, graphs.TOWERS, n, images, labels,
                                  n)
    self.parameter_bytes = self._step.traffic["parameter_bytes"]

  def init(self) -> None:
    pass  # GraphStep initializes.

  def count(self) -> Dict[str, object]:
    # One process, one task: nothing crosses between tasks.
    nothing = {"bytes": 0, "tensors": 0}
    return {"devices": {}, "collectives": 0, "collective_bytes": {},
            traffic.INPUT: nothing, traffic.OTHER: nothing, "unsized": [],
            "parameter_bytes": self.parameter_bytes}

  def run(self, steps: int) -> List[float]:
    return self._step.run(steps)

  def close(self) -> None:
    self._step.close()


def _serve(spec: Dict[str, object], reply) -> None:
  tf.disable_eager_execution()
  if spec["job"] == "ps":
    server = tf.train.Server(tf.train.ClusterSpec(spec["hosts"]), job_name="ps",
                             task_index=0,
                             config=towers.virtual_cpu_config(1))
    reply({"ready": True})
    # It serves while this process runs: until the parent says quit (or
    # goes, closing stdin).
    for line in sys.stdin:
      if json.loads(line)["command"] == "quit":
        break
    logging.info("ps on %s stops", server.target)
    return
  task = _Baseline(spec) if spec["kind"] == BASELINE else _Worker(spec)
  reply({"ready": True})
  try:
    for line in sys.stdin:
      command = json.loads(line)
      name = command["command"]
      if name == "quit":
        return
      if name == "init":
        task.init()
        reply({"initialized": True})
      elif name == "count":
        reply({"traffic": task.count()})
      elif name == "steps":
        reply({"times": task.run(command["steps"])})
      else:
        raise ValueError("unknown command %r" % name)
  finally:
    task.close()


def main() -> None:
  # Only this channel carries replies; anything else the libraries write to
  # stdout goes to stderr instead.
  replies = os.fdopen(os.dup(sys.stdout.fileno()), "w")
  os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
  logging.set_verbosity(logging.WARNING)

  def reply(message):
    replies.write(json.dumps(message) + "\n")
    replies.flush()

  try:
    _serve(json.loads(sys.argv[1]), reply)
  except Exception as e:  # pylint: disable=broad-except
    # Any failure is reported to the parent, which raises it.
    logging.exception("across_workers task failed")
    reply({"error": "%s: %s" % (type(e).__name__, e)})
    raise SystemExit(1) from e


if __name__ == "__main__":
  main()
