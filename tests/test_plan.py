"""The plan: the towers' arguments checked and resolved once, in one value.

None of these tests runs a session: resolving a plan and placing variables
are decisions made on device strings and graph ops alone.
"""

import dataclasses

import pytest
import tensorflow.compat.v1 as tf

import towers
from towers import _plan
from towers import _shares
from towers import _tf_versions
from towers import _workers

CPUS = ["/cpu:0", "/cpu:1"]
GPUS = ["/gpu:0", "/gpu:1"]


def _model_fn(scope, x):
  del scope
  return tf.reduce_mean(tf.matmul(x, tf.get_variable("w", [3, 1])))


def test_defaults_resolve_to_one_copy_on_the_cpu():
  with tf.Graph().as_default():
    plan = _plan.resolve(2, devices=CPUS)
  assert plan.devices == tuple(CPUS)
  assert plan.num_towers == 2
  assert plan.variable_device == "cpu" and not plan.replicated
  assert plan.all_reduce is None and plan.sums == "add_n"
  assert (plan.num_workers, plan.compute_dtype, plan.stage_inputs) == (
      1, None, False)
  assert plan.shares == ()


def test_default_devices_are_tower_devices():
  with tf.Graph().as_default():
    assert _plan.resolve(3).devices == tuple(towers.tower_devices(3))


@pytest.mark.parametrize("devices,all_reduce,want,sums", [
    (CPUS, "auto", "add_n", "add_n"),
    (GPUS, "auto", "collective", "collective"),
    (["/gpu:0", "/gpu:0"], "auto", "add_n", "add_n"),
    (CPUS, "ring", "ring", "add_n"),
    (CPUS, "collective", "collective", "collective"),
])
def test_replicated_all_reduce_is_resolved_for_the_devices(devices, all_reduce,
                                                           want, sums):
  with tf.Graph().as_default():
    plan = _plan.resolve(2, devices=devices, variable_device="replicated",
                         all_reduce=all_reduce)
  assert plan.replicated
  assert (plan.all_reduce, plan.sums) == (want, sums)


@pytest.mark.skipif(not _tf_versions.collectives_time_out(),
                    reason="%s's collectives ignore operation_timeout_in_ms: "
                    "towers refuses num_workers > 1 there"
                    % _tf_versions.describe())
def test_workers_resolve_to_collectives_over_this_workers_devices():
  worker_1 = ["/job:worker/task:1/cpu:0", "/job:worker/task:1/cpu:1"]
  with tf.Graph().as_default() as graph:
    plan = _plan.resolve(2, devices=worker_1, variable_device="replicated",
                         num_workers=2)
    assert not graph.get_operations()
    one = _plan.resolve(2, devices=CPUS)
  assert (plan.all_reduce, plan.sums) == ("collective", "collective")
  assert plan.workers == _workers.Workers(2, (
      "/job:worker/task:1/device:CPU:0", "/job:worker/task:1/device:CPU:1"))
  assert plan.workers.home == "/job:worker/task:1/device:CPU:0"
  assert one.workers == _workers.ONE


def test_one_graph_is_one_worker_by_its_plans_workers():
  mine = _workers.Workers(2, ("/job:worker/task:1/device:CPU:0",))
  for built in [_workers.ONE, mine]:
    _workers.check_one_cluster(mine, built)
    _workers.check_one_cluster(_workers.ONE, built)
  with pytest.raises(ValueError) as raised:
    _workers.check_one_cluster(mine._replace(num_workers=3), mine)
  assert "one graph is one worker" in str(raised.value)


def test_one_copy_towers_on_distinct_gpus_sum_across_towers_by_collective():
  # Synchronized batch norm's sums follow what the gradients of replicated
  # towers on those devices would use.
  with tf.Graph().as_default():
    plan = _plan.resolve(2, devices=GPUS, variable_device="balanced")
  assert (plan.all_reduce, plan.sums) == (None, "collective")


def test_compute_dtype_is_resolved_to_a_dtype():
  with tf.Graph().as_default():
    assert _plan.resolve(2, devices=CPUS,
                         compute_dtype="bfloat16").compute_dtype == tf.bfloat16
    assert _plan.resolve(2, devices=CPUS,
                         compute_dtype="float32").compute_dtype is None


def test_a_plan_is_immutable_and_takes_shares_as_a_new_value():
  with tf.Graph().as_default():
    plan = _plan.resolve(2, devices=CPUS)
  with pytest.raises(dataclasses.FrozenInstanceError):
    plan.devices = ("/cpu:1",)  # type: ignore[misc]
  shared = plan.with_shares([0.75, 0.25])
  assert shared.shares == (0.75, 0.25) and plan.shares == ()
  assert shared.devices == plan.devices


BAD = [
    (dict(num_towers=0), ValueError, "num_gpus to be a positive int"),
    (dict(num_towers=True), TypeError, "num_gpus to be a positive int"),
    (dict(devices="/cpu:0"), TypeError, "a list of 2 device strings"),
    (dict(devices=["/cpu:0"]), ValueError, "one device per tower"),
    (dict(devices=["/cpu:0", 1]), TypeError, "device strings"),
    (dict(devices=["/cpu:0", "/cpu:x:y"]), ValueError, "'/cpu:x:y'"),
    (dict(variable_device=3), TypeError, "variable_device"),
    (dict(variable_device="/cpu:x:y"), ValueError, "variable_device"),
    (dict(all_reduce="nccl"), ValueError, "all_reduce to be one of"),
    (dict(all_reduce="ring"), ValueError, "pass variable_device='replicated'"),
    (dict(variable_device="replicated", all_reduce="collective",
          devices=["/cpu:0", "/cpu:0"]), ValueError, "distinct device"),
    (dict(compute_dtype="int8"), ValueError, "compute_dtype"),
    (dict(num_workers=2), ValueError, "variable_device='replicated'"),
    (dict(num_workers=1.0), TypeError, "num_workers to be an int"),
]
# What only build_towers takes: its inputs and optimizers.
TRAINING = [
    (dict(stage_inputs=True, inputs=None), ValueError, "stage_inputs"),
    (dict(variable_device="replicated", opt="sync"), ValueError,
     "SyncReplicasOptimizer"),
]


def _optimizer(kwargs):
  """Makes the optimizer a case names, in the current graph."""
  opt = tf.train.GradientDescentOptimizer(0.1)
  if kwargs.pop("opt", None) == "sync":
    opt = tf.train.SyncReplicasOptimizer(opt, 2)
  return opt


@pytest.mark.parametrize("kwargs,error,match", BAD)
def test_bad_arguments_are_refused_before_any_op(kwargs, error, match):
  kwargs = dict(kwargs)
  num_towers = kwargs.pop("num_towers", 2)
  kwargs.setdefault("devices", CPUS)
  graph = tf.Graph()
  with graph.as_default(), pytest.raises(error, match=match):
    _plan.resolve(num_towers, **kwargs)
  assert not graph.get_operations()


@pytest.mark.parametrize("kwargs,error,match", TRAINING)
def test_training_arguments_are_refused_before_any_op(kwargs, error, match):
  kwargs = dict(kwargs)
  graph = tf.Graph()
  with graph.as_default():
    opt = _optimizer(kwargs)
    with pytest.raises(error, match=match):
      _plan.check_training(kwargs.get("variable_device", "cpu"),
                           kwargs.get("stage_inputs", False),
                           kwargs.get("inputs", "a batch"), [opt])
  assert not graph.get_operations()


@pytest.mark.parametrize("kwargs,error,match", BAD + TRAINING)
def test_build_towers_refuses_through_the_plan_and_builds_nothing(
    kwargs, error, match):
  kwargs = dict(kwargs)
  num_gpus = kwargs.pop("num_towers", 2)
  kwargs.setdefault("devices", CPUS)
  graph = tf.Graph()
  with graph.as_default():
    opt = _optimizer(kwargs)
    kwargs.setdefault("inputs", (tf.ones([4, 3]),))
    known = len(graph.get_operations())
    with pytest.raises(error, match=match):
      towers.build_towers(_model_fn, opt, num_gpus, **kwargs)
    assert len(graph.get_operations()) == known


def test_build_towers_resolves_the_plan_once(monkeypatch):
  calls = []
  resolve = _plan.resolve
  monkeypatch.setattr(_plan, "resolve",
                      lambda *a, **k: calls.append(a) or resolve(*a, **k))
  with tf.Graph().as_default():
    _, t = towers.minimize(_model_fn, tf.train.GradientDescentOptimizer(0.1),
                           2, inputs=(tf.ones([5, 3]),), devices=CPUS,
                           variable_device="replicated")
  assert len(calls) == 1
  assert t.plan.devices == tuple(t.devices) and t.plan.replicated
  assert t.plan.all_reduce == t.all_reduce == "add_n"
  assert t.plan.shares == tuple(t.weights) == (0.6, 0.4)


def _variable_op(graph, name, shape):
  with graph.as_default(), tf.device(None):
    return tf.get_variable(name, shape, use_resource=True).op


@pytest.mark.parametrize("variable_device,want", [
    ("cpu", ["/device:CPU:0"] * 3),
    ("gpu", ["/gpu:0"] * 3),
    ("replicated", ["/gpu:0"] * 3),
    ("/job:ps/task:0", ["/job:ps/task:0"] * 3),
    # Greedy by bytes: the largest first goes to the first GPU, then the
    # least loaded takes each next one.
    ("balanced", ["/gpu:0", "/gpu:1", "/gpu:1"]),
])
def test_where_each_variable_goes(variable_device, want):
  graph = tf.Graph()
  ops = [_variable_op(graph, "a", [100]), _variable_op(graph, "b", [10]),
         _variable_op(graph, "c", [20])]
  with graph.as_default():
    plan = _plan.resolve(2, devices=GPUS, variable_device=variable_device)
  placer = plan.placer()
  assert [placer(op) for op in ops] == want


def test_a_device_function_places_every_variable():
  graph = tf.Graph()
  op = _variable_op(graph, "a", [4])
  setter = tf.train.replica_device_setter(ps_tasks=2)
  with graph.as_default():
    plan = _plan.resolve(2, devices=CPUS, variable_device=setter)
  assert plan.placer() is setter
  assert plan.placer()(op).startswith("/job:ps/task:")


def test_each_build_balances_afresh():
  graph = tf.Graph()
  big, small = _variable_op(graph, "a", [100]), _variable_op(graph, "b", [1])
  with graph.as_default():
    plan = _plan.resolve(2, devices=GPUS, variable_device="balanced")
  first = plan.placer()
  assert [first(big), first(small)] == ["/gpu:0", "/gpu:1"]
  assert plan.placer()(small) == "/gpu:0"


def test_averaging_finds_the_plan_by_gradient_else_by_copied_variable():
  with tf.Graph().as_default():
    t = towers.build_towers(_model_fn, tf.train.GradientDescentOptimizer(0.1),
                            2, inputs=(tf.ones([5, 3]),), devices=CPUS,
                            variable_device="replicated", all_reduce="ring")
    assert _shares.plan_of(t.tower_grads) is t.plan
    assert _shares.weights_of(t.tower_grads) == [0.6, 0.4]
    # Each tower's gradients transformed first: no longer the towers', but
    # their copies are, and they are all-reduced as they were built.
    scaled = [[(g * 2.0, v) for g, v in pairs] for pairs in t.tower_grads]
    assert _shares.plan_of(scaled).all_reduce == "ring"
    unrelated = [[(tf.ones([3, 1]), tf.get_variable("u", [3, 1]))]] * 2
    assert _shares.plan_of(unrelated) is None
