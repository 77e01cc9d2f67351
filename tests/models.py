"""A small model and its single-device reference, shared by the tests."""

import numpy as np
import tensorflow.compat.v1 as tf

import towers

IN, HIDDEN, CLASSES = 6, 5, 3
DECAY = 0.01


def initial_values(seed=0):
  rng = np.random.RandomState(seed)
  return {
      "hidden/w": rng.normal(0, 0.5, (IN, HIDDEN)).astype(np.float32),
      "hidden/b": rng.normal(0, 0.1, (HIDDEN,)).astype(np.float32),
      "logits/w": rng.normal(0, 0.5, (HIDDEN, CLASSES)).astype(np.float32),
      "logits/b": rng.normal(0, 0.1, (CLASSES,)).astype(np.float32),
  }


def batch(size, seed=1):
  rng = np.random.RandomState(seed)
  x = rng.normal(0, 1, (size, IN)).astype(np.float32)
  y = rng.randint(0, CLASSES, size).astype(np.int32)
  return x, y


def _layer(name, inputs, values, regularize):
  with tf.variable_scope(name):
    reg = (lambda w: DECAY * tf.nn.l2_loss(w)) if regularize else None
    w = tf.get_variable("w", initializer=values[name + "/w"], regularizer=reg)
    b = tf.get_variable("b", initializer=values[name + "/b"])
    return tf.matmul(inputs, w) + b


def loss_fn(x, y, regularize=False, values=None):
  """Mean cross-entropy of a two-layer net, plus weight decay if asked."""
  values = values or initial_values()
  hidden = tf.tanh(_layer("hidden", x, values, regularize))
  logits = _layer("logits", hidden, values, regularize)
  loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
      labels=y, logits=logits))
  if regularize:
    loss += tf.losses.get_regularization_loss()
  return loss


def model_fn(regularize=False):
  return lambda scope, x, y: loss_fn(x, y, regularize)


def use_variables(ref):
  """Graph mode in this process (a script a test starts), with ref variables
  (``tf.disable_v2_behavior()``) if `ref`, else resource ones (TensorFlow 2's
  default; TensorFlow 1.15 makes ref variables unless asked)."""
  if ref:
    tf.disable_v2_behavior()
  else:
    tf.disable_eager_execution()
    tf.enable_resource_variables()


def devices(n):
  return ["/cpu:%d" % i for i in range(n)]


def config(num=4, grappler=True):
  """`num` virtual CPUs, under an operation timeout: a collective waiting for
  a peer that never comes fails the test in seconds instead of hanging it."""
  proto = towers.virtual_cpu_config(num)
  proto.operation_timeout_in_ms = 30000
  if not grappler:
    proto.graph_options.rewrite_options.disable_meta_optimizer = True
  return proto


def session(graph, num_devices=4):
  return tf.Session(graph=graph,
                    config=towers.virtual_cpu_config(num_devices))


def reference_gradients(x, y, regularize=False):
  """Loss and {variable name: gradient} of the model on one device."""
  with tf.Graph().as_default() as g:
    loss = loss_fn(tf.constant(x), tf.constant(y), regularize)
    variables = tf.trainable_variables()
    grads = tf.gradients(loss, variables)
    with session(g, 1) as sess:
      sess.run(tf.global_variables_initializer())
      loss_value, grad_values = sess.run([loss, grads])
  return loss_value, {v.op.name: gv for v, gv in zip(variables, grad_values)}


def reference_training(x, y, make_opt, steps, regularize=False):
  """Variable values after `steps` single-device steps of opt.minimize."""
  with tf.Graph().as_default() as g:
    loss = loss_fn(tf.constant(x), tf.constant(y), regularize)
    train_op = make_opt().minimize(
        loss, gate_gradients=tf.train.Optimizer.GATE_GRAPH)
    with session(g, 1) as sess:
      sess.run(tf.global_variables_initializer())
      losses = []
      for _ in range(steps):
        # Separate runs: with ref variables an in-place update could race a
        # loss fetched in the same run.
        losses.append(sess.run(loss))
        sess.run(train_op)
      values = {v.op.name: sess.run(v) for v in tf.trainable_variables()}
  return losses, values


def averaged_gradient_values(graph, t):
  """{variable name: value} of the towers' averaged gradients, run once."""
  averaged = towers.average_gradients(t.tower_grads, t.weights)
  with session(graph) as sess:
    sess.run(tf.global_variables_initializer())
    return sess.run({v.op.name: grad for grad, v in averaged})


def assert_gradients_close(got, want):
  """Checks {variable name: gradient} against the reference's."""
  assert sorted(got) == sorted(want)
  for name in want:
    np.testing.assert_allclose(got[name], want[name], rtol=1e-5, atol=1e-6,
                               err_msg=name)


def state_variables():
  """The graph's global and local variables, without the flags that say
  whether the replicated copies have been set from copy 0 (not state)."""
  return [v for v in tf.global_variables() + tf.local_variables()
          if not v.op.name.split("/")[-1].startswith("copies_are_set")]


def copies_gap(sess, values):
  """The largest difference of a replicated copy from copy 0, given copy
  0's `values` ({name: value} of the global variables)."""
  gap = 0.0
  for var in tf.local_variables():
    if var.op.name.startswith("replica_"):
      primary = values[var.op.name.split("/", 1)[1]]
      gap = max(gap, float(np.max(np.abs(sess.run(var) - primary))))
  return gap


def device_index(device):
  return tf.DeviceSpec.from_string(device).device_index


def weight_sends(graph, metadata, weights):
  """{weight name: {device index: sends}} of one run: the transfers, in the
  run's partition graphs, of a tensor of a weight's size from the weight's
  device to each other device (the sizes must be distinct)."""
  sizes = {v.shape.num_elements(): v for v in weights}
  sent = {v.op.name: {} for v in weights}
  for partition in metadata.partition_graphs:
    for node in partition.node:
      if node.op != "_Send":
        continue
      source, destination = (device_index(node.attr[key].s.decode())
                             for key in ("send_device", "recv_device"))
      op_name, _, index = node.input[0].partition(":")
      try:
        op = graph.get_operation_by_name(op_name)
      except KeyError:
        continue  # Made by Grappler or the partitioner: no weight.
      var = sizes.get(op.outputs[int(index or 0)].shape.num_elements())
      if var is not None and source == device_index(var.device) and (
          destination != source):
        counts = sent[var.op.name]
        counts[destination] = counts.get(destination, 0) + 1
  return sent


def is_collective_reduce(op):
  """Whether `op` is a collective all-reduce (TensorFlow 2's or 1.15's)."""
  return op.type in ("CollectiveReduceV2", "CollectiveReduce")
