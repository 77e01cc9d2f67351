"""A local cluster: a training script's tasks as processes on this machine.

Each task runs on a free loopback port with its output streamed under a task
prefix; a signal reaches the workers first, so the chief saves while the
parameter servers still hold the variables; and the tasks never outlive the
launcher (on Linux, the kernel kills them when it dies, even by SIGKILL).
TensorFlow's gRPC servers have no authentication and listen on every
interface: run local clusters on a machine firewalled from untrusted
networks.
"""

import ctypes
import ctypes.util
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import tensorflow.compat.v1 as tf


# Where the kernel's range cannot be read (macOS, Windows): IANA's
# dynamic ports, which those systems use.
_EPHEMERAL_FILE = "/proc/sys/net/ipv4/ip_local_port_range"
_IANA_EPHEMERAL = (49152, 65535)
_TRIES = 1000


def _ephemeral_range() -> Tuple[int, int]:
  try:
    with open(_EPHEMERAL_FILE, encoding="ascii") as f:
      low, high = map(int, f.read().split())
    return low, high
  except (OSError, ValueError):
    return _IANA_EPHEMERAL


def _port_is_free(port: int) -> bool:
  """True if no socket holds `port` on any IPv4 address.

  TensorFlow's gRPC server binds the wildcard address, which a socket on
  any one address (not only 127.0.0.1) blocks.
  """
  with socket.socket() as s:
    try:
      s.bind(("", port))
    except OSError:
      return False
  return True


def free_ports(count: int) -> List[int]:
  """Returns `count` distinct TCP ports that servers can bind just now.

  Each port is free on every IPv4 address and, unless that range spans
  every unprivileged port, lies outside the kernel's ephemeral range
  (Linux's `ip_local_port_range`): the ports the kernel hands to outgoing
  connections and to binds of port 0, so no other process is given one
  by chance before a server binds it.

  Args:
    count: how many ports.

  Returns:
    A list of `count` distinct port numbers.

  Raises:
    RuntimeError: if `count` free ports were not found in 1,000 tries.
  """
  low, high = _ephemeral_range()
  candidates = [p for p in range(1024, 65536) if not low <= p <= high]
  if not candidates:  # The kernel lends every port out.
    candidates = list(range(1024, 65536))
  rng = random.Random()  # Seeded apart from the caller's random.seed().
  ports: List[int] = []
  tries = 0
  while len(ports) < count:
    if tries == _TRIES:
      raise RuntimeError(
          "found %d of %d free TCP ports in %d tries outside the kernel's "
          "ephemeral range %d-%d: free some ports, or narrow that range"
          % (len(ports), count, _TRIES, low, high))
    tries += 1
    port = rng.choice(candidates)
    if port not in ports and _port_is_free(port):
      ports.append(port)
  return ports


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


class LocalCluster:
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
    self._threads: List[threading.Thread] = []
    self.tasks: Dict[str, subprocess.Popen] = {}  # "ps0", "worker1", ...

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
    for line in proc.stdout or ():
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
    Each task that failed, or was killed, is logged in one line
    (`describe_exit`),
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
        tf.logging.warning("%s", describe_exit(name, proc.returncode))
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


def describe_exit(name: str, returncode: int) -> str:
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


def run_local_cluster(script: str, num_ps: int, num_workers: int,
                      args: Sequence[str], stop_grace_secs: float = 30.0
                     ) -> int:
  """Runs `script`'s cluster until its workers end; returns the worst status.

  Every task runs ``python script --ps_hosts=... --worker_hosts=...
  --job_name=... --task_index=...`` followed by `args`; without parameter
  servers (`num_ps` 0) the workers form a collective cluster. The status is
  a shell's: 0 when every worker finished, 128 + N for one killed by signal
  N. SIGTERM or SIGINT (Ctrl-C) is passed on to the workers, which get
  `stop_grace_secs` to save and exit before the parameter servers are
  stopped; the launcher then returns 128 + the signal's number. A second
  signal kills every task at once. Handlers are installed only when called
  from the main thread, and put back on return.
  """
  received: List[int] = []
  with LocalCluster(script, num_ps, num_workers, args) as cluster:

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
      tf.logging.info("ps: %s; workers: %s", ",".join(cluster.ps_hosts) or
                      "none (collective mode)", ",".join(cluster.worker_hosts))
      tf.logging.warning("The tasks' gRPC servers listen on every interface "
                         "without authentication: any process reaching their "
                         "ports can run graphs in them (see --help)")
      cluster.start_all()
      code = cluster.wait_for_workers(stop=lambda: bool(received))
      if code is not None:
        return code
      name = signal.Signals(received[0]).name
      tf.logging.info("Received %s: passing it to the workers (up to %gs to "
                      "save and exit), then stopping the parameter servers",
                      name, stop_grace_secs)
      cluster.stop(received[0], stop_grace_secs)
      return 128 + received[0]
    finally:
      for signum, handler in previous.items():
        signal.signal(signum, signal.SIG_DFL if handler is None else handler)
