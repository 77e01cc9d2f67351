"""The cluster pieces: flags checked before a server starts, bounded waits."""

import time

import pytest
import tensorflow.compat.v1 as tf

from towers import training
from towers.training import _cluster


@pytest.mark.parametrize("ps_hosts,worker_hosts,job_name,task_index,words", [
    (["a:1"], [], "ps", 0, "--worker_hosts is empty"),
    ([], ["a:1"], "ps", 0, "--job_name=ps but --ps_hosts is empty"),
    (["a"], ["b:1"], "worker", 0, "not host:port"),
    (["a:1"], ["a:1"], "worker", 0, "listed more than once"),
    (["a:1"], ["b:1"], "chief", 0, "expected 'ps' or 'worker'"),
    (["a:1"], ["b:1"], "ps", 1, "--task_index=1 but --ps_hosts"),
    (["a:1"], ["b:1"], "worker", 3, "--task_index=3 but --worker_hosts lists "
     "1 worker"),
])
def test_the_cluster_flags_are_checked_before_a_server_starts(
    ps_hosts, worker_hosts, job_name, task_index, words):
  with pytest.raises(training.ClusterError, match=words):
    training.start_task(ps_hosts, worker_hosts, job_name, task_index, 1)


def test_a_cluster_without_parameter_servers_is_collective():
  assert _cluster.make_cluster([], ["a:1"], "worker", 0).jobs == ["worker"]


def test_a_worker_waiting_for_a_missing_chief_is_a_clear_error():
  server = tf.train.Server.create_local_server()
  with tf.Graph().as_default():
    tf.get_variable("w", [2])
    started = time.time()
    with pytest.raises(TimeoutError, match="has not initialized the model "
                       "after 1s"):
      training.wait_for_model(server.target, tf.ConfigProto(),
                              timeout_secs=1)
  assert time.time() - started < 30
