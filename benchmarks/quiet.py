"""Noticing other processes' CPU use while the benchmark times its steps.

On a shared machine another job can start in the middle of a run. The load
average cannot tell it apart from the benchmark's own work, so this reads
the CPU time the whole machine spent (``/proc/stat``) and subtracts what the
benchmark's own processes spent (``/proc/<pid>/stat``): the rest, divided by
the wall time, is the number of cores other processes kept busy ("foreign
cores"). The benchmark records it for every round and, if allowed to wait,
repeats a round that other processes disturbed once they have gone quiet.
"""

import os
import time
from typing import Callable, Iterable, Optional

from absl import logging

_TICKS = os.sysconf("SC_CLK_TCK")


def _machine_busy_seconds() -> float:
  """Returns the CPU seconds all cores spent not idle since boot."""
  with open("/proc/stat") as f:
    # cpu user nice system idle iowait irq softirq steal ...
    ticks = [int(v) for v in f.readline().split()[1:9]]
  return (sum(ticks) - ticks[3] - ticks[4]) / _TICKS


def _process_seconds(pid: int) -> float:
  """Returns a process's user + system CPU seconds (0 once it is gone)."""
  try:
    with open("/proc/%d/stat" % pid) as f:
      stat = f.read()
  except OSError:
    return 0.0
  # The fields after the parenthesized command name; utime and stime are
  # fields 14 and 15 of the whole line.
  fields = stat[stat.rindex(")") + 2:].split()
  return (int(fields[11]) + int(fields[12])) / _TICKS


class CpuMonitor:
  """Measures the cores other processes keep busy.

  Available on Linux only (`available` is False elsewhere; every
  measurement is then 0).
  """

  def __init__(self, own_pids: Callable[[], Iterable[int]]):
    """Args: own_pids: returns the benchmark's processes besides this one."""
    self._own_pids = own_pids
    self.available = os.path.exists("/proc/stat")
    self._start = None

  def _own_seconds(self) -> float:
    return sum(_process_seconds(p)
               for p in [os.getpid()] + list(self._own_pids()))

  def start(self) -> None:
    """Starts a measurement window."""
    if self.available:
      self._start = (time.monotonic(), _machine_busy_seconds(),
                     self._own_seconds())

  def foreign_cores(self) -> float:
    """Returns the cores others kept busy since `start`, on average."""
    if not self.available or self._start is None:
      return 0.0
    wall0, busy0, own0 = self._start
    wall = time.monotonic() - wall0
    if wall <= 0:
      return 0.0
    busy = _machine_busy_seconds() - busy0
    own = self._own_seconds() - own0
    return max(0.0, (busy - own) / wall)

  def wait_until_quiet(self, max_foreign: float, max_seconds: float,
                       window: float = 5.0) -> float:
    """Waits until others use at most `max_foreign` cores over a window.

    Returns:
      The seconds waited (at most about `max_seconds`).
    """
    started = time.monotonic()
    while time.monotonic() - started < max_seconds:
      self.start()
      time.sleep(window)
      foreign = self.foreign_cores()
      if foreign <= max_foreign:
        break
      logging.info("other processes use %.2f cores; waiting", foreign)
    return time.monotonic() - started


def describe(foreign: Optional[Iterable[float]]) -> str:
  values = list(foreign or [])
  if not values:
    return "not measured"
  return "mean %.2f, max %.2f cores" % (sum(values) / len(values),
                                        max(values))
