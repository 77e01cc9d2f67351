"""The example tests import the example scripts' modules from examples/.

The `op_timeout` fixture bounds the time of their sessions' ops.
"""

import os
import sys

import pytest

import towers

EXAMPLES = os.path.join(os.path.dirname(__file__), "..", "..", "examples")
sys.path.insert(0, os.path.abspath(EXAMPLES))


@pytest.fixture
def op_timeout(monkeypatch):
  """The scripts' virtual CPU sessions give up on an op after 60 s.

  A collective all-reduce waits for its whole group: were a step ever to run
  part of one, the test fails with a DeadlineExceededError, not a hang.
  """
  make = towers.virtual_cpu_config

  def config(*args, **kwargs):
    made = make(*args, **kwargs)
    made.operation_timeout_in_ms = 60000
    return made

  monkeypatch.setattr(towers, "virtual_cpu_config", config)
