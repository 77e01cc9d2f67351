r"""Runs a cluster of the MNIST training script on this machine, to try it out.

Two kinds: with parameter servers (--num_ps=1 or more), or without
(--num_ps=0: collective mode, every worker all-reducing with every other):

  python examples/launch_local_cluster.py --num_ps=1 --num_workers=2 -- \
      --num_gpus=2 --max_steps=500 --train_dir=/tmp/mnist_cluster \
      --data_dir=../shared/data/mnist
  python examples/launch_local_cluster.py --num_ps=0 --num_workers=2 -- \
      --num_gpus=2 --max_steps=500 --train_dir=/tmp/mnist_collective \
      --data_dir=../shared/data/mnist

Each task is a process on a free loopback port, its log prefixed
(``[worker1] ...``); everything after ``--`` goes to every task, and the
launcher adds --ps_hosts, --worker_hosts, --job_name and --task_index. It
exits with the worst worker's status (128 + N for one killed by signal N).
SIGTERM or Ctrl-C reaches the workers first, so the chief saves while the
parameter servers still run; a second signal kills every task. The tasks
die with the launcher. Their gRPC servers have no authentication and listen
on every interface: use it on a firewalled machine only
(docs/distributed.md has real machines and security).
"""

import os

from absl import app
from absl import flags

import common
from towers import training

HERE = os.path.dirname(os.path.abspath(__file__))

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
  common.log_tensorflow_through_absl()
  script = FLAGS.script or os.path.join(HERE, "mnist_multi_gpu_train.py")
  return training.run_local_cluster(script, FLAGS.num_ps, FLAGS.num_workers,
                                    argv[1:], FLAGS.stop_grace_secs)


if __name__ == "__main__":
  app.run(main)
