r"""Runs a parameter-server cluster on this machine, for trying it out.

Starts the parameter servers and workers of the MNIST training script as
separate processes on free loopback ports, streams their logs with a task
prefix, and stops them all when the workers are done, on Ctrl-C, or when a
worker fails:

  python examples/launch_local_cluster.py --num_ps=1 --num_workers=2 -- \
      --num_gpus=2 --max_steps=500 --train_dir=/tmp/mnist_cluster \
      --data_dir=../shared/data/mnist

Everything after ``--`` goes to every task; the launcher adds
``--ps_hosts``, ``--worker_hosts``, ``--job_name`` and ``--task_index``.
On real machines, run one task per host instead (docs/distributed.md).
"""

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import List, Optional, Sequence

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


class Cluster:
  """The processes of one local cluster; a context manager that stops them."""

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
                            start_new_session=True)
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

  def wait_for_workers(self, poll_secs: float = 0.5) -> int:
    """Waits until every worker has exited; returns the worst exit code.

    A failed worker does not stop the others: with backup workers
    (--replicas_to_aggregate below the number of workers) training goes on.
    """
    while any(p.poll() is None for p in self.workers().values()):
      time.sleep(poll_secs)
    codes = {n: p.returncode for n, p in self.workers().items()}
    for name, code in sorted(codes.items()):
      if code:
        logging.warning("%s exited with code %d", name, code)
    return max(codes.values(), key=abs) if codes else 0

  def stop(self, grace_secs: float = 5.0) -> None:
    """Stops every task still running: SIGTERM, then SIGKILL after grace."""
    running = [p for p in self.tasks.values() if p.poll() is None]
    for proc in running:
      _signal(proc, signal.SIGTERM)
    deadline = time.time() + grace_secs
    for proc in running:
      try:
        proc.wait(timeout=max(0.1, deadline - time.time()))
      except subprocess.TimeoutExpired:
        _signal(proc, signal.SIGKILL)
        proc.wait()
    for thread in self._threads:
      thread.join(timeout=2)

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.stop()


def _signal(proc: subprocess.Popen, sig: int) -> None:
  try:
    os.killpg(proc.pid, sig)
  except ProcessLookupError:
    pass


def run(num_ps: int, num_workers: int, args: Sequence[str],
        script: Optional[str] = None) -> int:
  """Runs the cluster until its workers finish; returns the worst exit code."""
  script = script or os.path.join(HERE, "mnist_multi_gpu_train.py")
  with Cluster(script, num_ps, num_workers, args) as cluster:
    logging.info("ps: %s; workers: %s", ",".join(cluster.ps_hosts),
                 ",".join(cluster.worker_hosts))
    cluster.start_all()
    try:
      return cluster.wait_for_workers()
    except KeyboardInterrupt:
      logging.info("Interrupted: stopping every task")
      return 130


FLAGS = flags.FLAGS
flags.DEFINE_integer("num_ps", 1, "Parameter-server tasks.")
flags.DEFINE_integer("num_workers", 2, "Worker tasks (the first is the chief).")
flags.DEFINE_string("script", None,
                    "The training script; default: mnist_multi_gpu_train.py "
                    "beside this file.")


def _interrupt(signum, frame):
  raise KeyboardInterrupt()


def main(argv):
  # SIGTERM (from a test harness, say) stops the cluster as Ctrl-C does.
  signal.signal(signal.SIGTERM, _interrupt)
  return run(FLAGS.num_ps, FLAGS.num_workers, argv[1:], FLAGS.script)


if __name__ == "__main__":
  app.run(main)
