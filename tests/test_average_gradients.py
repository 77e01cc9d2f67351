"""average_gradients on its own: None, sparse, weights, the barrier."""

import numpy as np
import pytest
import tensorflow.compat.v1 as tf

import towers


def _variables(*shapes):
  return [tf.get_variable("v%d" % i, shape, initializer=tf.zeros_initializer())
          for i, shape in enumerate(shapes)]


def _ancestors(tensor):
  seen, stack = set(), [tensor.op]
  while stack:
    op = stack.pop()
    if op in seen:
      continue
    seen.add(op)
    stack.extend(t.op for t in op.inputs)
    stack.extend(op.control_inputs)
  return seen


def test_dense_mean_is_weighted_sum_of_towers():
  with tf.Graph().as_default(), tf.Session() as sess:
    v, = _variables([3])
    grads = [np.array([1., 2., 3.], np.float32),
             np.array([3., 2., 1.], np.float32),
             np.array([0., 4., 8.], np.float32)]
    tower_grads = [[(tf.constant(g), v)] for g in grads]
    (mean, var), = towers.average_gradients(tower_grads)
    (weighted, _), = towers.average_gradients(tower_grads, [0.5, 0.25, 0.25])
    assert var is v
    np.testing.assert_allclose(sess.run(mean), np.mean(grads, axis=0),
                               rtol=1e-6)
    np.testing.assert_allclose(sess.run(weighted),
                               0.5 * grads[0] + 0.25 * grads[1]
                               + 0.25 * grads[2], rtol=1e-6)


def test_tensor_weights_are_used_as_given():
  with tf.Graph().as_default(), tf.Session() as sess:
    v, = _variables([2])
    w = tf.placeholder(tf.float32, [])
    tower_grads = [[(tf.constant([2., 4.]), v)], [(tf.constant([4., 8.]), v)]]
    (avg, _), = towers.average_gradients(tower_grads, [w, 1 - w])
    np.testing.assert_allclose(sess.run(avg, {w: 0.75}), [2.5, 5.0])


def test_none_gradient_in_every_tower_passes_through():
  with tf.Graph().as_default():
    a, b = _variables([2], [2])
    tower_grads = [[(None, a), (tf.ones([2]), b)] for _ in range(3)]
    averaged = towers.average_gradients(tower_grads)
    assert averaged[0] == (None, a)
    assert averaged[1][1] is b and averaged[1][0] is not None


def test_none_gradient_in_some_towers_is_an_error_naming_the_variable():
  with tf.Graph().as_default():
    a, = _variables([2])
    tower_grads = [[(tf.ones([2]), a)], [(None, a)]]
    with pytest.raises(ValueError, match=r"v0.*None in tower\(s\) 1"):
      towers.average_gradients(tower_grads)


def test_sparse_gradients_stay_sparse_and_sum_like_dense():
  with tf.Graph().as_default(), tf.Session() as sess:
    emb, = _variables([5, 2])
    slices = [
        tf.IndexedSlices(tf.constant([[1., 1.], [2., 2.]]),
                         tf.constant([0, 3]), tf.constant([5, 2])),
        tf.IndexedSlices(tf.constant([[4., 4.]]), tf.constant([3]),
                         tf.constant([5, 2])),
    ]
    (avg, _), = towers.average_gradients([[(s, emb)] for s in slices],
                                         [0.75, 0.25])
    assert isinstance(avg, tf.IndexedSlices)
    graph_ops = {op.type for op in tf.get_default_graph().get_operations()}
    assert not graph_ops & {"UnsortedSegmentSum", "ScatterNd"}
    dense = sess.run(tf.convert_to_tensor(avg))
    want = np.zeros((5, 2), np.float32)
    want[0] += 0.75 * 1
    want[3] += 0.75 * 2 + 0.25 * 4
    np.testing.assert_allclose(dense, want)


def test_gather_gradients_from_towers_are_not_densified():
  with tf.Graph().as_default(), tf.Session(
      config=towers.virtual_cpu_config(2)) as sess:

    def model_fn(scope, ids):
      emb = tf.get_variable("emb", initializer=np.arange(
          12, dtype=np.float32).reshape(6, 2))
      return tf.reduce_mean(tf.square(tf.gather(emb, ids)))

    ids = tf.constant([0, 1, 1, 5])
    t = towers.build_towers(model_fn, tf.train.GradientDescentOptimizer(1.0),
                            2, inputs=ids, devices=["/cpu:0", "/cpu:1"])
    (avg, emb), = towers.average_gradients(t.tower_grads, t.weights)
    assert all(isinstance(g, tf.IndexedSlices) for g, _ in
               (tower[0] for tower in t.tower_grads))
    assert isinstance(avg, tf.IndexedSlices)
    want = tf.gradients(
        tf.reduce_mean(tf.square(tf.gather(emb, ids))), emb)[0]
    sess.run(tf.global_variables_initializer())
    got, want = sess.run([tf.convert_to_tensor(avg),
                          tf.convert_to_tensor(want)])
    np.testing.assert_allclose(got, want, rtol=1e-6)


def test_every_averaged_gradient_waits_for_every_tower_gradient():
  # The synchronization point with ref variables: no update may start while
  # any tower's backprop still runs (pitfall P15 with GATE_NONE). Gradients
  # that read no variable: every reduction waits for all of them.
  with tf.Graph().as_default():
    a, b = _variables([2], [2])
    a_ref = a.op.type != "VarHandleOp"
    tower_grads = [[(tf.fill([2], float(i)), a),
                    (tf.IndexedSlices(tf.ones([1, 2]) * i, tf.constant([i])),
                     b)]
                   for i in range(3)]
    averaged = towers.average_gradients(tower_grads)
    for position, (grad, _) in enumerate(averaged):
      tensors = [grad.values, grad.indices] if isinstance(
          grad, tf.IndexedSlices) else [grad]
      ancestors = set().union(*(_ancestors(t) for t in tensors))
      for tower in tower_grads:
        for other, (g, _) in enumerate(tower):
          parts = [g.values, g.indices] if isinstance(
              g, tf.IndexedSlices) else [g]
          # Resource variables: each reduction waits for its own gradients
          # (and its variable's reads) only.
          if a_ref or other == position:
            assert all(p.op in ancestors for p in parts)
          else:
            assert not any(p.op in ancestors for p in parts)


def test_each_update_waits_for_every_read_of_its_variable():
  # Pitfall P15, narrowed: a variable's reduction (so its update) waits for
  # every tower's reads of it; with resource variables nothing more, so an
  # update overlaps the rest of backprop.
  from models import batch, devices, model_fn  # pylint: disable=g-import-not-at-top
  with tf.Graph().as_default():
    t = towers.build_towers(
        model_fn(True), tf.train.GradientDescentOptimizer(0.1), 3,
        inputs=tuple(tf.constant(a) for a in batch(6)), devices=devices(3))
    # Unpacked: a pack (tests/test_packing.py) waits for all its gradients.
    averaged = towers.average_gradients(t.tower_grads, t.weights,
                                        control_inputs=t.losses, pack_bytes=0)
    grads = {v.op.name: [tower[k][0] for tower in t.tower_grads]
             for k, (_, v) in enumerate(averaged)}
    step = set().union(*(_ancestors(x) for x in t.losses + [
        g for gs in grads.values() for g in gs]))
    for grad, var in averaged:
      ancestors = _ancestors(grad)
      assert all(loss.op in ancestors for loss in t.losses)
      if var.op.type != "VarHandleOp":
        # Every gradient, or where it is a data part plus weight decay
        # (summed apart, next to the variable), both its parts.
        assert all(g.op in ancestors or all(i.op in ancestors
                                            for i in g.op.inputs)
                   for gs in grads.values() for g in gs)
        continue
      reads = [c for c in var.op.outputs[0].consumers() if c in step]
      assert len(reads) >= 3
      assert all(r in ancestors for r in reads), var.op.name
    # The last layer's reduction does not wait for the first layer's
    # gradients, the last ones backprop computes.
    (last, _), = [p for p in averaged if p[1].op.name == "logits/b"]
    # (Its gradients' parts: the data's and the weight decay's.)
    first_layer = [i.op for g in grads["hidden/w"] for i in g.op.inputs]
    waits_for_all = all(op in _ancestors(last) for op in first_layer)
    assert waits_for_all == (averaged[0][1].op.type != "VarHandleOp")


@pytest.mark.parametrize("weights", [None, [0.2, 0.3, 0.5]])
def test_the_sum_is_in_tower_order_whatever_the_ops_are_named(weights):
  # Grappler sorts an AddN's inputs by name when they are products (here,
  # each tower's weight times its gradient); the towers' sum is a chain of
  # additions in tower order instead, so its bits do not follow op names.
  rng = np.random.RandomState(0)
  values = [(rng.standard_normal(500) * 10.0 ** rng.uniform(-4, 4, 500)
            ).astype(np.float32) for _ in range(3)]
  with tf.Graph().as_default():
    v, = _variables([500])
    feeds, tower_grads = {}, []
    for i, name in enumerate(["zz", "aa", "mm"]):
      with tf.device("/cpu:%d" % i):
        p = tf.placeholder(tf.float32, [500], name=name)
        feeds[p] = values[i]
        tower_grads.append([(tf.multiply(p, 2.0, name=name + "_grad"), v)])
    (avg, _), = towers.average_gradients(tower_grads, weights, pack_bytes=0)
    with tf.Session(config=towers.virtual_cpu_config(3)) as sess:
      got = sess.run(avg, feeds)
  grads = [g * np.float32(2.0) for g in values]
  if weights is None:
    want = (grads[0] + grads[1] + grads[2]) * np.float32(1.0 / 3)
  else:
    scaled = [g * np.float32(w) for g, w in zip(grads, weights)]
    want = scaled[0] + scaled[1] + scaled[2]
  assert got.tobytes() == want.tobytes()


def test_one_tower_is_an_identity_behind_the_barrier():
  with tf.Graph().as_default(), tf.Session() as sess:
    a, = _variables([2])
    g = tf.constant([1., 2.])
    (avg, _), = towers.average_gradients([[(g, a)]])
    assert avg is not g
    np.testing.assert_allclose(sess.run(avg), [1., 2.])


def test_gradients_are_averaged_next_to_their_variable():
  with tf.Graph().as_default():
    with tf.device("/cpu:3"):
      a, = _variables([2])
    tower_grads = []
    for i in range(2):
      with tf.device("/cpu:%d" % i):
        tower_grads.append([(tf.ones([2]) * i, a)])
    (avg, _), = towers.average_gradients(tower_grads, [0.25, 0.75])
    assert avg.device == a.device == "/device:CPU:3"
    assert not [op for op in tf.get_default_graph().get_operations()
                if op.type == "ConcatV2"]


def test_an_explicit_device_keeps_the_reduction_there():
  # Between-graph replication: the towers of one worker average on that
  # worker, so one gradient per variable crosses to the parameter server.
  with tf.Graph().as_default():
    with tf.device("/job:ps/task:0"):
      a, = _variables([2])
    tower_grads = []
    for i in range(2):
      with tf.device("/job:worker/task:1/cpu:%d" % i):
        tower_grads.append([(tf.ones([2]) * i, a)])
    (avg, _), = towers.average_gradients(tower_grads,
                                         device="/job:worker/task:1/cpu:0")
    assert avg.device == "/job:worker/task:1/device:CPU:0"
    assert avg.op.inputs[0].op.device == "/job:worker/task:1/device:CPU:0"


def test_control_inputs_join_the_barrier():
  with tf.Graph().as_default():
    a, = _variables([2])
    side = tf.no_op(name="side_effect")
    tower_grads = [[(tf.ones([2]), a)], [(tf.ones([2]), a)]]
    (avg, _), = towers.average_gradients(tower_grads, control_inputs=[side])
    assert side in _ancestors(avg)
