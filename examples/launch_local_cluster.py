r"""Runs a cluster of the MNIST training script on this machine, to try it out.

Two kinds: with parameter servers (--num_ps=1 or more), or without
(--num_ps=0: collective mode, every worker all-reducing with every other):

  python examples/launch_local_cluster.py --num_ps=1 --num_workers=2 -- \
      --num_gpus=2 --max_steps=500 --train_dir=/tmp/mnist_cluster \
      --data_dir=../shared/data/mnist
  python examples/launch_local_cluster.py --num_ps=0 --num_workers=2 -- \
      --num_gpus=2 --max_steps=500 --train_dir=/tmp/mnist_collective \
      --data_dir=../shared/data/mnist

Starts the parameter servers and workers as separate processes on free
loopback ports, streams their logs with a task prefix, and stops the
parameter servers when the workers are done. It exits with the worst of the
workers' exit statuses, as a shell gives them: 0 when all finished, 128 +
N for one killed by signal N, named in one line (``worker 1 was killed by
SIGKILL (exit status 137)``). SIGTERM or Ctrl-C (SIGINT) is
passed on to the workers, so the chief saves a checkpoint; the parameter
servers, which hold the variables it saves, are stopped only after the
workers have exited (or after --stop_grace_secs, when the rest get
SIGKILL). The launcher then exits with 128 + the signal's number; a second
signal kills every task at once. The tasks never outlive the launcher: on
Linux each is killed (SIGKILL) when the launcher dies, even by SIGKILL, so
a relaunch cannot meet an orphaned chief still writing its --train_dir.

Everything after ``--`` goes to every task; the launcher adds
``--ps_hosts``, ``--worker_hosts``, ``--job_name`` and ``--task_index``.
On real machines, run one task per host instead (docs/distributed.md).

SECURITY: TensorFlow's gRPC servers have no authentication and no
encryption, and each listens on every network interface (0.0.0.0:port,
whatever host the cluster names: TensorFlow has no setting for it). Any
process that can reach a task's port can run any graph in it, with that
task's files and permissions; that includes the tasks this launcher starts
while they run. Use it on a machine whose ports are firewalled from
untrusted networks, for short-lived local clusters only.
"""

import ctypes
import ctypes.util
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Callable, List, Optional, Sequence

from absl import app
from absl import flags
from absl import logging

HERE = os.path.dirname(os.path.abspath(__file__))


def free_ports(count: int) -> List[int]:
  """Returns `count` distinct TCP ports free on 127.0.0.1 just now."""
  sockets = []
  try:
    for _ in range(count):
      s = socket.socket()
      s.bind(("127.0.0.1", 0))
      sockets.append(s)
    return [s.getsockname()[1] for s in sockets]
  finally:
    for s in sockets:
      s.close()


# prctl(2)'s option: the signal the kernel sends a process when the thread
# that started it exits.
_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> Optional[Callable[[], None]]:
  """Returns a `preexec_fn` that has a child die with this process (Linux).

  The child asks the kernel for SIGKILL when its parent exits, however the
  parent ends (SIGKILL included, which no handler of the parent can see),
  then checks that the parent did not die before it asked. Elsewhere
  returns None: the tasks of a launcher killed by SIGKILL keep running.
  """
  if not sys.platform.startswith("linux"):
    return None
  # Loaded before the fork: the child only calls it.
  libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
  parent = os.getpid()

  def preexec():
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent:
      os._exit(1)  # pylint: disable=protected-access

  return preexec


class Cluster:
  """The processes of one local cluster; a context manager that stops them.

  Without parameter servers (`num_ps` 0) the workers form a collective
  cluster. On Linux each task is killed when the thread that started it
  ends (the kernel's parent-death signal): start them from a thread that
  outlives them, such as the main thread.
  """

  def __init__(self, script: str, num_ps: int, num_workers: int,
               args: Sequence[str], out=None):
    ports = free_ports(num_ps + num_workers)
    self.ps_hosts = ["127.0.0.1:%d" % p for p in ports[:num_ps]]
    self.worker_hosts = ["127.0.0.1:%d" % p for p in ports[num_ps:]]
    self._script = script
    self._args = list(args)
    self._out = out or sys.stdout
    self._lock = threading.Lock()
    self._threads = []
    self.tasks = {}  # "ps0", "worker1", ... -> Popen

  def command(self, job: str, index: int) -> List[str]:
    return [sys.executable, self._script,
            "--ps_hosts=" + ",".join(self.ps_hosts),
            "--worker_hosts=" + ",".join(self.worker_hosts),
            "--job_name=" + job, "--task_index=%d" % index] + self._args

  def start(self, job: str, index: int) -> subprocess.Popen:
    """Starts one task and a thread that streams its output, prefixed."""
    name = "%s%d" % (job, index)
    # A session of its own: Ctrl-C reaches the launcher only, which then
    # stops every task in order.
    proc = subprocess.Popen(self.command(job, index), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True,
                            start_new_session=True,
                            preexec_fn=_die_with_parent())
    self.tasks[name] = proc
    thread = threading.Thread(target=self._stream, args=(name, proc),
                              daemon=True)
    thread.start()
    self._threads.append(thread)
    return proc

  def _stream(self, name: str, proc: subprocess.Popen) -> None:
    for line in proc.stdout:
      with self._lock:
        self._out.write("[%s] %s" % (name, line))
        self._out.flush()

  def start_all(self) -> None:
    for i in range(len(self.ps_hosts)):
      self.start("ps", i)
    for i in range(len(self.worker_hosts)):
      self.start("worker", i)

  def workers(self):
    return {n: p for n, p in self.tasks.items() if n.startswith("worker")}

  def parameter_servers(self):
    return {n: p for n, p in self.tasks.items() if n.startswith("ps")}

  def wait_for_workers(self, poll_secs: float = 0.5,
                       stop: Callable[[], bool] = lambda: False
                      ) -> Optional[int]:
    """Waits until every worker has exited; returns the worst exit status.

    A failed worker does not stop the others: with backup workers
    (--replicas_to_aggregate below the number of workers) training goes on.
    Each task that failed, or was killed, is logged in one line (`describe`),
    a parameter server that ended on its own too. The status is the shell's
    (`exit_status`: 128 + the signal's number for a killed worker), the
    highest of the workers'. Returns None as soon as `stop()` is true, with
    workers still running.
    """
    while any(p.poll() is None for p in self.workers().values()):
      if stop():
        return None
      time.sleep(poll_secs)
    for name, proc in sorted(self.tasks.items()):
      if proc.poll():
        logging.warning("%s", describe(name, proc.returncode))
    return max((exit_status(p.returncode) for p in self.workers().values()),
               default=0)

  def stop(self, signum: int = signal.SIGTERM, grace_secs: float = 30.0,
           ps_grace_secs: float = 5.0) -> None:
    """Stops every task still running: the workers first, then the ps.

    The workers get `signum` and `grace_secs` to exit: the chief saves its
    final checkpoint, which needs the parameter servers still running. Then
    the parameter servers get SIGTERM. A task still running after its grace
    period gets SIGKILL.
    """
    _stop(self.workers().values(), signum, grace_secs)
    _stop(self.parameter_servers().values(), signal.SIGTERM, ps_grace_secs)
    for thread in self._threads:
      thread.join(timeout=2)

  def kill(self) -> None:
    """Kills every task at once (SIGKILL)."""
    for proc in self.tasks.values():
      if proc.poll() is None:
        _signal(proc, signal.SIGKILL)

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.stop()


def exit_status(returncode: int) -> int:
  """A `subprocess` return code as a shell's exit status (0-255).

  A process killed by signal N (return code -N) is 128 + N: 137 for
  SIGKILL, 143 for SIGTERM.
  """
  return 128 - returncode if returncode < 0 else returncode


def describe(name: str, returncode: int) -> str:
  """One line: how task `name` ("worker1", "ps0") ended, by `returncode`."""
  job = name.rstrip("0123456789")
  task = "%s %s" % (job, name[len(job):])
  if returncode < 0:
    try:
      how = "was killed by %s" % signal.Signals(-returncode).name
    except ValueError:
      how = "was killed by signal %d" % -returncode
    return "%s %s (exit status %d)" % (task, how, exit_status(returncode))
  return "%s exited with status %d" % (task, returncode)


def _stop(procs, signum: int, grace_secs: float) -> None:
  running = [p for p in procs if p.poll() is None]
  for proc in running:
    _signal(proc, signum)
  deadline = time.time() + grace_secs
  for proc in running:
    try:
      proc.wait(timeout=max(0.1, deadline - time.time()))
    except subprocess.TimeoutExpired:
      _signal(proc, signal.SIGKILL)
      proc.wait()


def _signal(proc: subprocess.Popen, sig: int) -> None:
  try:
    os.killpg(proc.pid, sig)
  except ProcessLookupError:
    pass


def run(num_ps: int, num_workers: int, args: Sequence[str],
        script: Optional[str] = None, stop_grace_secs: float = 30.0) -> int:
  """Runs the cluster until its workers finish; returns the worst exit status.

  SIGTERM or SIGINT (Ctrl-C) is passed on to the workers, which get
  `stop_grace_secs` to save and exit before the parameter servers are
  stopped; the launcher then returns 128 + the signal's number. A second
  signal kills every task at once. Handlers are installed only when called
  from the main thread, and put back on return.
  """
  script = script or os.path.join(HERE, "mnist_multi_gpu_train.py")
  received = []
  with Cluster(script, num_ps, num_workers, args) as cluster:

    def handle(signum, frame):
      del frame
      if received:  # The second signal: no more waiting.
        cluster.kill()
        os._exit(128 + signum)  # pylint: disable=protected-access
      received.append(signum)

    previous = {}
    if threading.current_thread() is threading.main_thread():
      for signum in (signal.SIGTERM, signal.SIGINT):
        previous[signum] = signal.signal(signum, handle)
    try:
      logging.info("ps: %s; workers: %s", ",".join(cluster.ps_hosts) or
                   "none (collective mode)", ",".join(cluster.worker_hosts))
      logging.warning("The tasks' gRPC servers listen on every interface "
                      "without authentication: any process reaching their "
                      "ports can run graphs in them (see --help)")
      cluster.start_all()
      code = cluster.wait_for_workers(stop=lambda: bool(received))
      if code is not None:
        return code
      name = signal.Signals(received[0]).name
      logging.info("Received %s: passing it to the workers (up to %gs to "
                   "save and exit), then stopping the parameter servers",
                   name, stop_grace_secs)
      cluster.stop(received[0], stop_grace_secs)
      return 128 + received[0]
    finally:
      for signum, handler in previous.items():
        signal.signal(signum, signal.SIG_DFL if handler is None else handler)


FLAGS = flags.FLAGS
flags.DEFINE_integer("num_ps", 1, "Parameter-server tasks; 0 for a "
                     "collective cluster (no parameter servers: every "
                     "worker all-reduces its gradients with the others).",
                     lower_bound=0)
flags.DEFINE_integer("num_workers", 2, "Worker tasks (the first is the "
                     "chief).", lower_bound=1)
flags.DEFINE_string("script", None,
                    "The training script; default: mnist_multi_gpu_train.py "
                    "beside this file.")
flags.DEFINE_float("stop_grace_secs", 30, "Seconds the workers get to save "
                   "and exit after SIGTERM or SIGINT, before SIGKILL.",
                   lower_bound=0)


def main(argv):
  return run(FLAGS.num_ps, FLAGS.num_workers, argv[1:], FLAGS.script,
             FLAGS.stop_grace_secs)


if __name__ == "__main__":
  app.run(main)
