"""One process of tests/test_accumulate.py: accumulated micro-batches with
the variables on a parameter server, both servers on loopback in this
process, against one device on the same micro-batches.

The last line of its output is JSON: the accumulators, those placed on the
parameter server (none is right), the largest gap to the reference and the
global step.
"""

import argparse
import json
import os
import sys

import numpy as np
import tensorflow.compat.v1 as tf

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(
    __file__))))

# pylint: disable=wrong-import-position
import towers  # noqa: E402
from towers import training  # noqa: E402
from tests import models  # noqa: E402
from tests import test_accumulate  # noqa: E402


def main() -> None:
  parser = argparse.ArgumentParser()
  parser.add_argument("--ref-variables", action="store_true")
  args = parser.parse_args()
  models.use_variables(args.ref_variables)
  ps_port, worker_port = training.free_ports(2)
  cluster = tf.train.ClusterSpec({"ps": ["127.0.0.1:%d" % ps_port],
                                  "worker": ["127.0.0.1:%d" % worker_port]})
  config = models.config(2)
  tf.train.Server(cluster, job_name="ps", task_index=0, config=config)
  worker = tf.train.Server(cluster, job_name="worker", task_index=0,
                           config=config)
  batches = test_accumulate.make_batches([4] * 4)
  make_opt = test_accumulate.OPTIMIZERS["momentum"]
  task = "/job:worker/task:0"
  with tf.Graph().as_default():
    setter = tf.train.replica_device_setter(ps_tasks=1, worker_device=task)
    with tf.device(setter):
      x = tf.placeholder(tf.float32, [4, models.IN])
      y = tf.placeholder(tf.int32, [4])
      global_step = tf.train.get_or_create_global_step()
      train_op, _ = towers.minimize(
          models.model_fn(True), make_opt(), 2, inputs=(x, y),
          devices=towers.tower_devices(2, task=task),
          variable_device=setter, average_device=task + "/cpu:0",
          global_step=global_step, accumulate_steps=2)
    accumulators = [v for v in tf.local_variables()
                    if v.op.name.startswith("accumulate_gradients/")]
    with tf.Session(worker.target, config=config) as sess:
      sess.run(tf.global_variables_initializer())
      sess.run(tf.local_variables_initializer())
      for bx, by in batches:
        sess.run(train_op, {x: bx, y: by})
      got = {v.op.name: sess.run(v) for v in tf.global_variables()}
  want = test_accumulate.one_device(batches, 2, make_opt)
  print(json.dumps({
      "accumulators": len(accumulators),
      "on_parameter_servers": [v.op.name for v in accumulators
                               if not v.device.startswith(task)],
      "largest_gap": max(float(np.max(np.abs(got[k] - want[k])))
                         for k in want),
      "global_step": int(got["global_step"])}))
  sys.stdout.flush()


if __name__ == "__main__":
  main()
