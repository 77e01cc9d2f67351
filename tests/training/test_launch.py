"""The local cluster launcher, with stand-in tasks (no TensorFlow in them).

A stand-in task prints its arguments, records what happens to it in a file
of its own under --log_dir ("started", "signal<N>" and "exit" with their
times, and its pid), and runs until the file "finish" appears there, or
for --secs (--secs_<task> for one task); then it exits with --exit_<task>
(default 0). On SIGTERM or SIGINT it exits with 128 + N after 0.5 s, as a
chief saving would, unless it is listed in --stubborn: then only SIGKILL
ends it.
"""

import io
import os
import signal
import socket
import subprocess
import sys

import pytest

from towers import training
from towers.training import _launch

STAND_IN = r"""
import os, signal, sys, time
args = dict(a[2:].split("=", 1) for a in sys.argv[1:] if "=" in a)
name = args["job_name"] + args["task_index"]


def record(what, value=None):
  with open(os.path.join(args["log_dir"], name), "a") as f:
    f.write("%s %s\n" % (what, time.time() if value is None else value))


def handle(signum, frame):
  del frame
  record("signal%d" % signum)
  if name not in args.get("stubborn", "").split(","):
    time.sleep(0.5)
    record("exit")
    sys.exit(128 + signum)


signal.signal(signal.SIGTERM, handle)
signal.signal(signal.SIGINT, handle)
print(" ".join(sys.argv[1:]), flush=True)
record("pid", os.getpid())
record("started")
end = time.time() + float(args.get("secs_" + name, args.get("secs", 600)))
while time.time() < end and not os.path.exists(
    os.path.join(args["log_dir"], "finish")):
  time.sleep(0.05)
sys.exit(int(args.get("exit_" + name, 0)))
"""

NAMES = ("ps0", "worker0", "worker1")

# The launcher as a script runs it: its tasks, its signals, its exit status.
LAUNCHER = ("import sys\n"
            "from absl import logging\n"
            "from towers import training\n"
            "logging.use_absl_handler()\n"
            "logging.set_verbosity(logging.INFO)\n"
            "sys.exit(training.run_local_cluster(\n"
            "    sys.argv[1], 1, 2, sys.argv[3:],\n"
            "    stop_grace_secs=float(sys.argv[2])))\n")


@pytest.fixture
def stand_in(tmp_path):
  """(script, log_dir) of the stand-in task."""
  script = tmp_path / "task.py"
  script.write_text(STAND_IN)
  log_dir = tmp_path / "log"
  log_dir.mkdir()
  return str(script), log_dir


def _events(log_dir, name):
  """{event: time (or pid)} of a stand-in task's record."""
  path = log_dir / name
  if not path.exists():
    return {}
  return {w: float(t) for w, t in (line.split() for line in
                                   path.read_text().splitlines())}


def _all_started(log_dir):
  return lambda: all("started" in _events(log_dir, n) for n in NAMES)


def _pids(log_dir):
  return [int(_events(log_dir, n)["pid"]) for n in NAMES]


def _alive(pid):
  """Whether `pid` runs (a zombie, dead but not yet reaped, does not)."""
  try:
    with open("/proc/%d/stat" % pid) as f:
      return f.read().rsplit(")", 1)[1].split()[0] != "Z"
  except FileNotFoundError:
    return False


@pytest.fixture
def no_task_left():
  """Pids to check at the end: any still alive is killed, and fails."""
  pids = []
  yield pids
  alive = [p for p in pids if _alive(p)]
  for pid in alive:
    os.kill(pid, signal.SIGKILL)
  assert not alive, "tasks left running: %s" % alive


@pytest.fixture
def start_launcher(stand_in, python, wait_until, no_task_left):
  """Starts LAUNCHER in a process and waits until every task has started:
  ``start(grace_secs, *args, **popen_kwargs)`` gives (process, task pids)."""
  script, log_dir = stand_in

  def start(grace_secs, *args, **popen_kwargs):
    popen_kwargs.setdefault("stdout", subprocess.DEVNULL)
    popen_kwargs.setdefault("stderr", subprocess.DEVNULL)
    proc = python.start(["-c", LAUNCHER, script, str(grace_secs),
                         "--log_dir=%s" % log_dir] + list(args),
                        **popen_kwargs)
    wait_until(_all_started(log_dir), 60, "the tasks to start", proc)
    pids = _pids(log_dir)
    no_task_left.extend(pids)
    return proc, pids

  return start


def test_exit_status_is_the_shells():
  assert [training.exit_status(c) for c in (0, 1, 3, -9, -15, -2)] == [
      0, 1, 3, 137, 143, 130]


def test_describe_exit_is_one_line_naming_the_task_and_how_it_ended():
  assert training.describe_exit("worker1", -signal.SIGKILL) == (
      "worker 1 was killed by SIGKILL (exit status 137)")
  assert training.describe_exit("ps0", -signal.SIGTERM) == (
      "ps 0 was killed by SIGTERM (exit status 143)")
  assert training.describe_exit("worker12", 3) == (
      "worker 12 exited with status 3")
  assert training.describe_exit("worker0", -99) == (
      "worker 0 was killed by signal 99 (exit status 227)")


def _ephemeral_range():
  try:
    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
      return tuple(map(int, f.read().split()))
  except OSError:
    return 49152, 65535


def test_free_ports_are_distinct_free_and_outside_the_ephemeral_range():
  low, high = _ephemeral_range()
  for _ in range(20):
    ports = training.free_ports(4)
    assert len(set(ports)) == 4
    for port in ports:
      # Outside the range the kernel lends to outgoing connections and to
      # binds of port 0, so no other process can be given it by chance.
      assert 1024 <= port < 65536 and not low <= port <= high, (port, low, high)
      with socket.socket() as s:
        s.bind(("", port))
  assert training.free_ports(0) == []


def test_a_port_held_on_one_ipv4_address_is_not_free():
  # TensorFlow's gRPC server binds the wildcard address, which a socket on
  # any one address blocks: 127.0.0.2 too, where a bind of 127.0.0.1 alone
  # would find the port free.
  for host in ("127.0.0.1", "127.0.0.2"):
    port = training.free_ports(1)[0]
    with socket.socket() as held:
      held.bind((host, port))
      assert not _launch._port_is_free(port)
    assert _launch._port_is_free(port)


def test_each_task_gets_the_cluster_flags_and_its_output_prefixed(
    stand_in, no_task_left):
  script, log_dir = stand_in
  out = io.StringIO()
  args = ["--log_dir=%s" % log_dir, "--secs=0.2"]
  with training.LocalCluster(script, 1, 2, args, out=out) as cluster:
    cluster.start_all()
    assert sorted(cluster.tasks) == sorted(NAMES)
    no_task_left.extend(p.pid for p in cluster.tasks.values())
    assert cluster.wait_for_workers(poll_secs=0.05) == 0
  hosts = "--ps_hosts=%s --worker_hosts=%s" % (
      cluster.ps_hosts[0], ",".join(cluster.worker_hosts))
  assert sorted(out.getvalue().splitlines(keepends=True)) == [
      "[%s%d] %s --job_name=%s --task_index=%d %s\n"
      % (job, i, hosts, job, i, " ".join(args))
      for job, i in [("ps", 0), ("worker", 0), ("worker", 1)]]
  assert cluster.command("worker", 1)[:2] == [sys.executable, script]
  collective = training.LocalCluster(script, 0, 2, [])
  assert collective.ps_hosts == []
  assert collective.command("worker", 0)[2] == "--ps_hosts="


def test_the_worst_workers_status_is_returned_and_each_failure_logged(
    stand_in, logs, no_task_left):
  script, log_dir = stand_in
  before = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
  code = training.run_local_cluster(
      script, 1, 2, ["--log_dir=%s" % log_dir, "--secs=0.3",
                     "--exit_worker1=3", "--secs_ps0=0", "--exit_ps0=2"])
  no_task_left.extend(_pids(log_dir))
  assert code == 3
  ended = [m for m in logs() if m.startswith(("worker ", "ps "))]
  # A parameter server that ended on its own is logged too.
  assert ended == ["ps 0 exited with status 2", "worker 1 exited with "
                   "status 3"]
  assert (signal.getsignal(signal.SIGINT),
          signal.getsignal(signal.SIGTERM)) == before


def test_a_worker_killed_by_sigkill_gives_137_and_one_line_naming_it(
    stand_in, logs, wait_until, no_task_left):
  script, log_dir = stand_in
  with training.LocalCluster(script, 1, 2, ["--log_dir=%s" % log_dir],
                             out=io.StringIO()) as cluster:
    cluster.start_all()
    no_task_left.extend(p.pid for p in cluster.tasks.values())
    wait_until(_all_started(log_dir), 30, "the tasks to start")
    os.kill(cluster.tasks["worker1"].pid, signal.SIGKILL)
    cluster.tasks["worker1"].wait(timeout=10)
    (log_dir / "finish").write_text("")  # The others exit 0.
    assert cluster.wait_for_workers(poll_secs=0.05) == 128 + signal.SIGKILL
  lines = [m for m in logs() if "worker" in m or "ps 0" in m]
  assert lines == ["worker 1 was killed by SIGKILL (exit status 137)"]


def test_a_signal_reaches_the_workers_first_then_the_ps_is_stopped(
    stand_in, start_launcher):
  _, log_dir = stand_in
  launcher, _ = start_launcher(2, "--stubborn=worker1",
                               stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True)
  launcher.send_signal(signal.SIGINT)  # Ctrl-C.
  out, _ = launcher.communicate(timeout=60)
  assert launcher.returncode == 128 + signal.SIGINT, out
  assert ("Received SIGINT: passing it to the workers (up to 2s to save and "
          "exit), then stopping the parameter servers") in out
  chief, stubborn, ps = (_events(log_dir, n) for n in NAMES[1:] + NAMES[:1])
  sigint, sigterm = ("signal%d" % s for s in (signal.SIGINT, signal.SIGTERM))
  # The workers get the signal itself; the chief has exited (saved) before
  # the parameter server is stopped, with SIGTERM.
  assert sigint in chief and "exit" in chief
  assert sigint not in ps
  assert ps[sigterm] >= chief["exit"]
  # The worker that ignored it got SIGKILL after the 2 s grace, and only
  # then was the parameter server stopped.
  assert sigint in stubborn and "exit" not in stubborn
  assert ps[sigterm] >= stubborn[sigint] + 1.9
  assert "Traceback" not in out


def test_a_second_signal_kills_every_task_at_once(
    stand_in, start_launcher, wait_until):
  _, log_dir = stand_in
  launcher, pids = start_launcher(60, "--stubborn=ps0,worker0,worker1")
  launcher.send_signal(signal.SIGTERM)
  wait_until(lambda: all("signal%d" % signal.SIGTERM in _events(log_dir, n)
                         for n in NAMES[1:]), 30, "the workers' signal",
             launcher)
  launcher.send_signal(signal.SIGTERM)
  # Not the 60 s grace.
  assert launcher.wait(timeout=20) == 128 + signal.SIGTERM
  wait_until(lambda: not any(_alive(p) for p in pids), 10,
             "the tasks to be killed")


def test_the_tasks_die_with_the_launcher_even_by_sigkill(start_launcher,
                                                         wait_until):
  launcher, pids = start_launcher(30)
  assert all(_alive(p) for p in pids)
  launcher.kill()
  assert launcher.wait(timeout=10) == -signal.SIGKILL
  wait_until(lambda: not any(_alive(p) for p in pids), 10,
             "the tasks to die with the launcher")
