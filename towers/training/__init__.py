"""The training runner: pieces for a ``MonitoredTrainingSession`` loop.

Each piece works in a user's own loop without the others: `TrainDir`
guards the training directory, `StopOnSignalHook` turns SIGTERM and SIGINT
into a saved stop, `StepLoggerHook` and `training_summaries` report, the
cluster pieces start and check a task of a TensorFlow cluster, `Watchdog`
bounds its waits, `run_local_cluster` runs a script's cluster on this
machine. `train` composes them for the common case. ``import towers`` does
not import this package.
"""

from towers.training._cluster import ClusterError
from towers.training._cluster import COLLECTIVE_LEADER
from towers.training._cluster import device_setter
from towers.training._cluster import start_task
from towers.training._cluster import sync_replicas_hook
from towers.training._cluster import Task
from towers.training._cluster import VariablesDigestHook
from towers.training._cluster import wait_for_model
from towers.training._launch import describe_exit
from towers.training._launch import exit_status
from towers.training._launch import free_ports
from towers.training._launch import LocalCluster
from towers.training._launch import run_local_cluster
from towers.training._loop import Interrupted
from towers.training._loop import train
from towers.training._progress import StepLoggerHook
from towers.training._progress import training_summaries
from towers.training._signals import StopOnSignalHook
from towers.training._traindir import TrainDir
from towers.training._traindir import TrainDirError
from towers.training._watchdog import PEER_ERRORS
from towers.training._watchdog import PeerLost
from towers.training._watchdog import Watchdog
from towers.training._watchdog import watchdog_for_task

__all__ = [
    "COLLECTIVE_LEADER",
    "PEER_ERRORS",
    "ClusterError",
    "Interrupted",
    "LocalCluster",
    "PeerLost",
    "StepLoggerHook",
    "StopOnSignalHook",
    "Task",
    "TrainDir",
    "TrainDirError",
    "VariablesDigestHook",
    "Watchdog",
    "describe_exit",
    "device_setter",
    "exit_status",
    "free_ports",
    "run_local_cluster",
    "start_task",
    "sync_replicas_hook",
    "train",
    "training_summaries",
    "wait_for_model",
    "watchdog_for_task",
]
