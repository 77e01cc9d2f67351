"""A task of a TensorFlow cluster: checked flags, a server, a session config.

Two kinds of cluster: with parameter servers (``ps_hosts``), which hold the
variables a ``SyncReplicasOptimizer`` updates; and without (collective
mode), where every worker holds a copy of the variables and all-reduces its
gradients with every other worker's. The classic TF1 cluster flags
(``--ps_hosts``, ``--worker_hosts``, ``--job_name``, ``--task_index``) are
easy to get wrong, and a wrong one usually shows as a hang; here each is a
clear error instead, and every wait has a deadline.
"""

import collections
import hashlib
import json
import socket
import time
from typing import Callable, List, Optional, Sequence, Tuple

import numpy as np
import tensorflow.compat.v1 as tf

import towers


class ClusterError(ValueError):
  """The cluster flags are wrong, or this task's disagree with the chief's."""


Task = collections.namedtuple("Task", [
    "server", "cluster", "is_chief", "worker_device", "config",
    "num_workers", "collective", "step_timeout_secs"])
Task.__doc__ = """This process's place in the cluster (see `start_task`).

Fields:
  server: its running ``tf.train.Server``; ``server.target`` is the master.
  cluster: the ``tf.train.ClusterSpec``.
  is_chief: whether this is worker task 0, which initializes and saves.
  worker_device: ``'/job:worker/task:<i>'``.
  config: the session config: `num_towers` virtual CPU devices where GPUs
    are missing, device filters so the session talks only to the
    parameter servers and this worker (a dead peer worker cannot stall it;
    in collective mode to this worker only, the collectives reach the
    others), the collective group leader in collective mode, and the
    operation timeout.
  num_workers: the number of worker tasks.
  collective: whether the cluster has no parameter servers: the workers
    all-reduce their gradients with collective ops.
  step_timeout_secs: the session's operation timeout, or None.
"""

# Where the workers of a collective cluster meet to form their group.
COLLECTIVE_LEADER = "/job:worker/replica:0/task:0"


def make_cluster(ps_hosts: Sequence[str], worker_hosts: Sequence[str],
                 job_name: str, task_index: int) -> tf.train.ClusterSpec:
  """Returns the cluster, after checking the flags that describe it.

  Raises:
    ClusterError: naming the flag at fault: a missing or malformed host list,
      a host listed twice, an unknown job name, or a task index outside the
      job's list.
  """
  if not worker_hosts:
    raise ClusterError("--worker_hosts is empty: list the cluster's "
                       "host:port pairs, comma-separated, the same on every "
                       "task")
  for flag, hosts in (("--ps_hosts", ps_hosts),
                      ("--worker_hosts", worker_hosts)):
    for host in hosts:
      name, _, port = host.rpartition(":")
      if not name or not port.isdigit():
        raise ClusterError("%s holds %r, which is not host:port" % (flag, host))
  everyone = list(ps_hosts) + list(worker_hosts)
  repeated = sorted({h for h in everyone if everyone.count(h) > 1})
  if repeated:
    raise ClusterError("%s listed more than once in --ps_hosts/--worker_hosts; "
                     "every task needs its own host:port" % ", ".join(repeated))
  jobs = {"ps": ps_hosts, "worker": worker_hosts}
  if job_name not in jobs:
    raise ClusterError("--job_name=%r: expected 'ps' or 'worker'" % (job_name,))
  if job_name == "ps" and not ps_hosts:
    raise ClusterError("--job_name=ps but --ps_hosts is empty: without "
                       "parameter servers (collective mode) every task is a "
                       "worker")
  if not 0 <= task_index < len(jobs[job_name]):
    raise ClusterError(
        "--task_index=%d but --%s_hosts lists %d %s task(s) (indices 0-%d); "
        "task i is the i-th host of the list"
        % (task_index, job_name, len(jobs[job_name]), job_name,
           len(jobs[job_name]) - 1))
  if not ps_hosts:
    return tf.train.ClusterSpec({"worker": list(worker_hosts)})
  return tf.train.ClusterSpec({"ps": list(ps_hosts),
                               "worker": list(worker_hosts)})


def _wait_until(done: Callable[[], bool], timeout_secs: float, waiting: str,
                late: Callable[[], str]) -> None:
  """Calls `done` twice a second until it is true.

  Logs `waiting` once if the first call is false, and raises
  ``TimeoutError(late())`` once `timeout_secs` have passed.
  """
  deadline = time.time() + timeout_secs
  if done():
    return
  tf.logging.info(waiting)
  while not done():
    if time.time() > deadline:
      raise TimeoutError(late())
    time.sleep(0.5)


def accepts_connections(host: str) -> bool:
  """Whether ``host:port`` accepts a TCP connection now (2 s at most)."""
  name, _, port = host.rpartition(":")
  try:
    with socket.create_connection((name, int(port)), timeout=2):
      return True
  except OSError:
    return False


def wait_for_hosts(hosts: Sequence[str], timeout_secs: float) -> None:
  """Waits until every ``host:port`` accepts a TCP connection.

  Raises:
    TimeoutError: naming the hosts still unreachable at the deadline.
  """
  waiting = list(hosts)

  def reached():
    waiting[:] = [h for h in waiting if not accepts_connections(h)]
    return not waiting

  _wait_until(
      reached, timeout_secs,
      "Waiting for %s to accept connections" % ", ".join(hosts),
      lambda: "cannot reach %s after %ds: start those tasks, and check that "
      "every task has the same --ps_hosts and --worker_hosts"
      % (", ".join(waiting), timeout_secs))


def check_same_cluster(target: str, cluster: tf.train.ClusterSpec,
                       is_chief: bool, config: tf.ConfigProto,
                       timeout_secs: float) -> None:
  """Makes sure this worker and the chief describe the same cluster.

  The chief writes its cluster, as JSON, into a string variable on parameter
  server task 0 (in collective mode, on itself); every other worker waits
  for it there and compares. Without this, a worker started with other host
  lists would wait forever for variables the chief placed elsewhere, for
  aggregation tokens of another number of replicas, or for a collective
  group of another size.

  Raises:
    ClusterError: if this worker's cluster differs from the chief's.
    TimeoutError: if the chief has not written its cluster in time.
  """
  mine = json.dumps(cluster.as_dict(), sort_keys=True)
  job = "ps" if "ps" in cluster.jobs else "worker"
  config = _copy(config)
  config.device_filters.append("/job:%s/task:0" % job)
  with tf.Graph().as_default():
    with tf.device("/job:%s/task:0" % job):
      spec = tf.Variable(mine, name="towers_cluster_spec", trainable=False,
                         collections=[], use_resource=False)
    with tf.Session(target, config=config) as sess:
      if is_chief:
        sess.run(spec.initializer)
        return
      with tf.device("/job:%s/task:0" % job):
        written = tf.is_variable_initialized(spec)
      ps0 = cluster.task_address(job, 0)
      _wait_until(
          lambda: sess.run(written), timeout_secs,
          "Waiting for the chief (worker task 0) to register its cluster on "
          + ps0,
          lambda: "the chief (worker task 0) has not registered its cluster "
          "on %s after %ds: start it, and give every task the same "
          "--ps_hosts and --worker_hosts" % (ps0, timeout_secs))
      chiefs = sess.run(spec).decode()
  if chiefs != mine:
    raise ClusterError(
        "this worker's cluster %s differs from the chief's %s: start every "
        "task with the same --ps_hosts and --worker_hosts" % (mine, chiefs))
  tf.logging.info("Cluster matches the chief's: %s", mine)


def wait_for_model(target: str, config: tf.ConfigProto,
                   timeout_secs: float = 30 * 60) -> None:
  """Waits until the chief has initialized (or restored) every variable.

  Call it in a worker's finished training graph, before the training session.
  ``tf.train.MonitoredTrainingSession`` waits for the chief as well, but checks
  only every 30 seconds: on a short or fast run the chief can be done before a
  worker's first step. The 30-minute default is that session's own limit.

  Raises:
    TimeoutError: if some global variable is still uninitialized at the
      deadline (the chief is not running, or is stuck).
  """
  uninitialized = tf.report_uninitialized_variables(tf.global_variables())
  with tf.Session(target, config=config) as sess:
    _wait_until(
        lambda: not len(sess.run(uninitialized)), timeout_secs,
        "Waiting for the chief (worker task 0) to initialize the model",
        lambda: "the chief (worker task 0) has not initialized the model "
        "after %ds: check that it is running and look at its log"
        % timeout_secs)


def start_task(ps_hosts: Sequence[str], worker_hosts: Sequence[str],
               job_name: str, task_index: int, num_towers: int, *,
               log_device_placement: bool = False,
               startup_timeout_secs: float = 60.0,
               step_timeout_secs: Optional[float] = None) -> Task:
  """Checks the flags, starts this task's server and meets the cluster.

  A parameter server serves forever here (this call does not return for
  one). A worker waits for the parameter servers (`wait_for_hosts`; without
  parameter servers, for the other workers), then makes sure its cluster is
  the chief's (`check_same_cluster`). With `step_timeout_secs` every
  session op of the worker fails with a ``DeadlineExceededError`` after that
  long (``operation_timeout_in_ms``) instead of waiting forever.

  Raises:
    ClusterError, TimeoutError: as `make_cluster`, `wait_for_hosts` and
      `check_same_cluster` do; ClusterError also if some GPUs are visible
      but fewer than `num_towers`.
  """
  cluster = make_cluster(ps_hosts, worker_hosts, job_name, task_index)
  collective = not ps_hosts
  config = towers.virtual_cpu_config(num_towers,
                                     log_device_placement=log_device_placement)
  try:
    gpus = towers.tower_devices(num_towers)[0].startswith("/gpu")
  except ValueError as e:
    raise ClusterError("--num_gpus=%d: %s" % (num_towers, e)) from None
  if gpus:
    config = tf.ConfigProto(allow_soft_placement=True,
                            log_device_placement=log_device_placement)
  if collective:
    # The server and every session name the same leader, which gathers the
    # group (every worker's towers) at the first collective.
    config.experimental.collective_group_leader = COLLECTIVE_LEADER
  server = tf.train.Server(cluster, job_name=job_name, task_index=task_index,
                           config=config)
  if job_name == "ps":
    tf.logging.info("Parameter server %d serving on %s", task_index,
                    ps_hosts[task_index])
    server.join()
  worker_device = "/job:worker/task:%d" % task_index
  if step_timeout_secs:
    config.operation_timeout_in_ms = int(step_timeout_secs * 1000)
  if collective:
    # This worker only: the collective ops reach the others by themselves,
    # and a session that listed them would wait for each at creation.
    config.device_filters[:] = [worker_device]
    wait_for_hosts(worker_hosts, startup_timeout_secs)
  else:
    config.device_filters[:] = ["/job:ps", worker_device]
    wait_for_hosts(ps_hosts, startup_timeout_secs)
  check_same_cluster(server.target, cluster, task_index == 0, config,
                     startup_timeout_secs)
  return Task(server=server, cluster=cluster, is_chief=task_index == 0,
              worker_device=worker_device, config=config,
              num_workers=len(worker_hosts), collective=collective,
              step_timeout_secs=step_timeout_secs)


def peers(task: Task) -> List[Tuple[str, str]]:
  """``(name, 'host:port')`` of every other task: ``('ps0', ...)``, ..."""
  mine = "worker%d" % int(task.worker_device.rsplit(":", 1)[1])
  found = []
  for job in ("ps", "worker"):
    if job in task.cluster.jobs:
      for i, host in enumerate(task.cluster.job_tasks(job)):
        if "%s%d" % (job, i) != mine:
          found.append(("%s%d" % (job, i), host))
  return found


def _copy(config: tf.ConfigProto) -> tf.ConfigProto:
  copied = tf.ConfigProto()
  copied.CopyFrom(config)
  return copied


def device_setter(task: Task):
  """Returns the device function of this worker's graph.

  Variables (and the optimizer's slots) go to the parameter servers, round
  robin over the ps tasks; every other op to this worker. Used around the
  whole graph and as `variable_device` of the towers, so both share one
  round-robin count.
  """
  return tf.train.replica_device_setter(cluster=task.cluster,
                                        worker_device=task.worker_device)


def sync_replicas_hook(optimizer: tf.train.SyncReplicasOptimizer,
                       is_chief: bool) -> tf.train.SessionRunHook:
  """Returns the optimizer's session hook, without a traceback at the end.

  The chief's token queue runner waits for the workers' gradients in an op
  that only closing the session ends. ``MonitoredTrainingSession`` joins its
  coordinator before it closes the session, so the queue runner then reports
  the cancellation to a joined coordinator, which re-raises it in that
  thread: a ``CancelledError`` traceback after a successful run. Here the
  queue runner reports to a coordinator of its own that counts the
  cancellation as a clean stop; any other error of the queue runner is
  raised at the next step, as the session's coordinator would have.
  """
  return _OwnCoordinatorHook(optimizer.make_session_run_hook(is_chief))


class _OwnCoordinatorHook(tf.train.SessionRunHook):
  """Runs `hook` with a coordinator of its own for the threads it starts."""

  def __init__(self, hook: tf.train.SessionRunHook):
    self._hook = hook
    self._coord = None  # One per session: `after_create_session`.

  def begin(self):
    self._hook.begin()

  def after_create_session(self, session, coord):
    del coord  # The session's; its threads get ours.
    # A new one for each session: after a parameter server was lost, the
    # last one holds that error, which would stop the recreated session too.
    self._coord = tf.train.Coordinator(clean_stop_exception_types=(
        tf.errors.OutOfRangeError, tf.errors.CancelledError))
    self._hook.after_create_session(session, self._coord)

  def before_run(self, run_context):
    self._coord.raise_requested_exception()
    return self._hook.before_run(run_context)

  def after_run(self, run_context, run_values):
    self._hook.after_run(run_context, run_values)

  def end(self, session):
    self._coord.request_stop()
    self._hook.end(session)


class VariablesDigestHook(tf.train.SessionRunHook):
  """Logs a digest of the global variables when training ends cleanly.

  ``Variables at step N: sha256 <hex> (K variables)``: in collective mode
  every worker holds its own copy of every variable, and the workers'
  digests being equal shows that the copies are identical, bit for bit.
  """

  def __init__(self, global_step: tf.Tensor):
    self._global_step = global_step
    self._variables = None

  def begin(self):
    self._variables = sorted(tf.global_variables(), key=lambda v: v.op.name)

  def end(self, session):
    values, step = session.run([self._variables, self._global_step])
    digest = hashlib.sha256()
    for var, value in zip(self._variables, values):
      digest.update(var.op.name.encode())
      digest.update(np.ascontiguousarray(value).tobytes())
    tf.logging.info("Variables at step %d: sha256 %s (%d variables)", step,
                    digest.hexdigest(), len(values))
