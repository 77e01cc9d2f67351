"""One process of tests/test_workers.py: a worker of a collective cluster on
loopback (``--ports``), or the one-worker reference (no ``--ports``).

It trains a small model (a dense layer, an embedding whose gradient is
sparse, a synchronized batch norm, Momentum; with ``--model regularized``,
layers that every weight-regularizer style decays; with ``--model gan``, a
generator with synchronized batch norm and a discriminator, each step a D
update with Momentum then a G update with SGD) on a fixed
global batch per step (``--accumulate_steps`` of them per update), worker
``k`` taking the ``k``-th slice, and writes every global variable after
each update to
``--out`` (an ``.npz``: ``name -> [steps + 1,
...]``, row 0 being the values the first step starts from). The last line
of its output is JSON: the largest gap between a replicated copy and copy
0, and the global step.
"""

import argparse
import json
import sys

import numpy as np
import tensorflow.compat.v1 as tf

import models
import towers

GLOBAL_TOWERS = 4
PER_TOWER = 4


def main() -> None:
  parser = argparse.ArgumentParser()
  parser.add_argument("--task", type=int, default=0)
  parser.add_argument("--ports", default="")
  parser.add_argument("--towers", type=int, default=GLOBAL_TOWERS)
  parser.add_argument("--steps", type=int, default=20)
  parser.add_argument("--out", required=True)
  parser.add_argument("--init_seed", type=int, default=0)
  parser.add_argument("--restore", default=None)
  parser.add_argument("--save", default=None)
  parser.add_argument("--timeout_ms", type=int, default=120000)
  parser.add_argument("--variable_device", default="replicated")
  parser.add_argument("--accumulate_steps", type=int, default=1)
  parser.add_argument("--per_tower", type=int, default=PER_TOWER)
  parser.add_argument("--model", choices=["batch_norm", "regularized", "gan"],
                      default="batch_norm")
  parser.add_argument("--ref-variables", action="store_true")
  args = parser.parse_args()
  models.use_variables(args.ref_variables)
  ports = [p for p in args.ports.split(",") if p]
  workers = max(1, len(ports))
  config = towers.virtual_cpu_config(args.towers)
  if ports:
    config.experimental.collective_group_leader = (
        "/job:worker/replica:0/task:0")
    cluster = tf.train.ClusterSpec(
        {"worker": ["127.0.0.1:%s" % p for p in ports]})
    server = tf.train.Server(cluster, job_name="worker",
                             task_index=args.task, config=config)
    target = server.target
    task = "/job:worker/task:%d" % args.task
    devices = towers.tower_devices(args.towers, task=task)
    session_config = tf.ConfigProto()
    session_config.CopyFrom(config)
    session_config.device_filters[:] = [task]
  else:
    target, task, devices = "", "", towers.tower_devices(args.towers)
    session_config = tf.ConfigProto()
    session_config.CopyFrom(config)
  session_config.operation_timeout_in_ms = args.timeout_ms

  init = np.random.RandomState(args.init_seed)
  values = {"w1": init.randn(6, 8), "emb": init.randn(10, 8),
            "w2": init.randn(8, 3), "w3": init.randn(8, 8) * 0.3,
            "g_w1": init.randn(6, 8) * 0.5, "g_w2": init.randn(8, 3) * 0.5,
            "d_w1": init.randn(3, 8) * 0.5, "d_w2": init.randn(8, 1) * 0.5}
  per_worker = args.towers * args.per_tower
  x = tf.placeholder(tf.float32, [per_worker, 6])
  ids = tf.placeholder(tf.int32, [per_worker])
  y = tf.placeholder(tf.int32, [per_worker])

  def variable(name, **kwargs):
    return tf.get_variable(name, values[name].shape, initializer=(
        tf.constant_initializer(values[name])), **kwargs)

  def model_fn(_, x, ids, y):
    hidden = tf.matmul(x, variable("w1")) + tf.gather(variable("emb"), ids)
    hidden = towers.batch_normalization(tf.nn.relu(hidden), training=True)
    logits = tf.matmul(hidden, variable("w2"))
    return tf.losses.sparse_softmax_cross_entropy(y, logits)

  opt = tf.train.MomentumOptimizer(0.1, 0.9)
  kwargs = {}
  if args.model == "regularized":
    model_fn = regularized_model(values, variable)
  elif args.model == "gan":
    model_fn = gan_model(variable)
    opt = {"d": opt, "g": tf.train.GradientDescentOptimizer(0.2)}
    kwargs["var_list"] = {"d": "d_", "g": "g_"}

  with tf.device(task + "/cpu:0" if task else "/cpu:0"):
    global_step = tf.train.get_or_create_global_step()
  train_op, _ = towers.minimize(
      model_fn, opt, args.towers,
      inputs=(x, ids, y), devices=devices,
      variable_device=args.variable_device,
      all_reduce="collective" if args.variable_device == "replicated"
      else "auto", num_workers=workers, global_step=global_step,
      accumulate_steps=args.accumulate_steps, **kwargs)
  # Several losses: their train ops in turn, one run each.
  train_ops = list(train_op.values()) if isinstance(train_op, dict) \
      else [train_op]
  with tf.control_dependencies([tf.train.Scaffold.default_local_init_op()]):
    sync = towers.broadcast_variables()
  saver = tf.train.Saver()
  variables = sorted(tf.global_variables(), key=lambda v: v.op.name)
  copies = [(c, s) for c in tf.local_variables()
            for s in variables if c.op.name.endswith("/" + s.op.name)
            and c.op.name.startswith("replica_")]

  data = np.random.RandomState(1234)
  history = {v.op.name: [] for v in variables}
  gap = 0.0
  with tf.Session(target, config=session_config) as sess:
    sess.run(tf.global_variables_initializer())
    if args.restore and args.task == 0:
      saver.restore(sess, args.restore)
    sess.run(sync)
    for step in range(args.steps + 1):
      for var, value in zip(variables, sess.run(variables)):
        history[var.op.name].append(value)
      for copy, source in copies:
        a, b = sess.run([copy, source])
        gap = max(gap, float(np.max(np.abs(a - b))))
      if step == args.steps:
        break
      # With accumulation, a step is that many micro-batches.
      for _ in range(args.accumulate_steps):
        batch = GLOBAL_TOWERS * PER_TOWER
        feed_x = data.randn(batch, 6).astype(np.float32)
        feed_ids = data.randint(0, 10, batch).astype(np.int32)
        feed_y = data.randint(0, 3, batch).astype(np.int32)
        part = slice(args.task * per_worker, (args.task + 1) * per_worker)
        for op in train_ops:
          sess.run(op, {x: feed_x[part], ids: feed_ids[part],
                        y: feed_y[part]})
    if args.save:
      saver.save(sess, args.save, write_meta_graph=False)
    final_step = int(sess.run(global_step))
  np.savez(args.out, **{k: np.stack(v) for k, v in history.items()})
  print(json.dumps({"copies_gap": gap, "global_step": final_step,
                    "copies": len(copies)}))
  sys.stdout.flush()


def regularized_model(values, variable):
  """A model whose weights every regularizer style decays: tf.layers' and
  tf-slim's (tf.layers under TF_USE_LEGACY_KERAS=1 on Keras 3), a Keras
  layer's, tf.get_variable's and the CIFAR-10 tutorial's."""
  decay = 0.05
  keras = tf.keras
  dense = keras.layers.Dense(3, kernel_regularizer=keras.regularizers.l2(
      decay), kernel_initializer=keras.initializers.Constant(values["w2"]))

  try:
    import tf_slim as slim  # pylint: disable=import-outside-toplevel
  except ImportError:
    slim = None

  def l2(w):
    return decay * tf.nn.l2_loss(w)

  def model_fn(scope, x, ids, y):
    hidden = tf.layers.dense(
        x, 8, tf.nn.relu, kernel_regularizer=l2, name="fc1",
        kernel_initializer=tf.constant_initializer(values["w1"]))
    hidden += tf.gather(variable("emb", regularizer=l2), ids)
    if slim is not None:
      hidden = slim.fully_connected(
          hidden, 8, tf.tanh, scope="fc2",
          weights_initializer=tf.constant_initializer(values["w3"]),
          weights_regularizer=slim.l2_regularizer(decay))
    w2 = variable("w2")
    tf.add_to_collection("losses", tf.multiply(tf.nn.l2_loss(w2), decay,
                                               name="weight_loss"))
    logits = tf.matmul(hidden, w2) + dense(hidden)
    tf.losses.sparse_softmax_cross_entropy(y, logits)
    return (tf.add_n(tf.get_collection("losses", scope)) +
            tf.losses.get_regularization_loss() + tf.add_n(dense.losses))

  return model_fn


def gan_model(variable):
  """A GAN: noise `x` through the generator (synchronized batch norm), the
  discriminator on it and on the one-hot labels as the real data."""

  def discriminator(data):
    with tf.variable_scope("", reuse=tf.AUTO_REUSE):
      hidden = tf.nn.leaky_relu(tf.matmul(data, variable("d_w1")))
      return tf.matmul(hidden, variable("d_w2"))

  def xent(logits, label):
    return tf.reduce_mean(tf.nn.sigmoid_cross_entropy_with_logits(
        labels=tf.fill(tf.shape(logits), label), logits=logits))

  def model_fn(_, x, ids, y):
    del ids
    hidden = towers.batch_normalization(tf.matmul(x, variable("g_w1")),
                                        training=True, name="g_bn")
    fake = tf.nn.softmax(tf.matmul(tf.nn.relu(hidden), variable("g_w2")))
    real = tf.one_hot(y, 3)
    d_real, d_fake = discriminator(real), discriminator(fake)
    return {"d": xent(d_real, 1.0) + xent(d_fake, 0.0),
            "g": xent(d_fake, 1.0)}

  return model_fn


if __name__ == "__main__":
  main()
