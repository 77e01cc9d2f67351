"""Trains the MNIST CNN on several GPUs with synchronous updates (towers).

  python examples/mnist_multi_gpu_train.py --num_gpus=2 \
      --data_dir=/tmp/mnist_data --train_dir=/tmp/mnist_train
  python examples/mnist_eval.py --data_dir=/tmp/mnist_data \
      --checkpoint_dir=/tmp/mnist_train --run_once
  tensorboard --logdir=/tmp/mnist_train
  python examples/mnist_multi_gpu_train.py --fake_data --max_steps=200 \
      --train_dir=/tmp/mnist_fake  # speed only
  python examples/mnist_multi_gpu_train.py --dataset=fashion_mnist \
      --train_dir=/tmp/fashion_train
  python examples/mnist_multi_gpu_train.py --num_gpus=4 \
      --variable_device=replicated --all_reduce=ring \
      --train_dir=/tmp/mnist_replicated  # a copy of the variables per tower
  python examples/mnist_multi_gpu_train.py --num_gpus=2 --precision=float16 \
      --xla --stage_inputs --train_dir=/tmp/mnist_fast  # the fast paths

The working version of normanheckscher/mnist-multi-gpu's training script on
`towers`: one replica of the model per GPU (``tower_0``, ``tower_1``, ...),
variables shared on the CPU (by default: see --variable_device), the
towers' gradients averaged and applied once per step. Without enough GPUs
the towers run on virtual CPU devices (one log line says so): the same
graph, for correctness rather than speed.

What changed from the reference, and why (docs/examples.md has the details):
one shared input pipeline on the CPU from which each tower takes its own
batch (it built one per tower, each reading the whole data set); a
learning-rate decay that counts examples, so it is the same for any number
of towers; pixels scaled alike in training and evaluation; the final step
checkpointed; restarts resume from the last checkpoint.

Flags: --num_gpus towers, each taking --batch_size examples per step (the
global batch is batch_size x num_gpus, logged at start with the epochs
--max_steps means); --accumulate_steps=k sums k such micro-batches per
tower into each step's update (a global batch k times larger in the memory
of one, the global step counting updates); the log line every
--log_frequency steps is the original's ``step %d, loss = %.2f (%.1f
examples/sec; %.3f sec/batch)``.
--variable_device places the one copy of each variable ('cpu', the
original's; 'gpu'; 'balanced'), or, with 'replicated', gives every tower a
copy of its own, kept identical by the --all_reduce algorithm ('add_n',
'ring', 'collective'; 'auto' chooses): the checkpoints are the same either
way (copy 0 under single-device names), so mnist_eval.py reads them and a
run may resume in another mode. --pack_bytes (16384, towers' default; 0
turns it off) has the gradients of at most that many bytes reduced in packs,
in every mode and in a cluster: fewer transfers, the same results (bit for
bit, but with --all_reduce=collective over 3 or more towers). A flag out of
range (``--batch_size=0``, ``--pack_bytes=-1``), a bad --train_dir (empty,
a file, under a file, not writable), or --all_reduce without
--variable_device=replicated stops the script at once with one line naming
the flag.

The fast paths (docs/examples.md, "Fast paths"): --precision=float16 or
bfloat16 has the towers compute in that dtype on float32 master weights
(saved under the float32 names, so mnist_eval.py, in float32, reads the
checkpoints as they are); float16 adds dynamic loss scaling, whose scale is
logged with each step line and summarized as ``loss_scale``. In a cluster
float16 is refused (with --ps_hosts SyncReplicasOptimizer cannot skip the
steps loss scaling skips; in collective mode that skip is untested);
bfloat16 needs no loss scaling. --xla compiles
each tower's model and gradient with XLA (the same results within
rounding). --stage_inputs reads each tower's batches ahead, in a background
queue runner, and stages them on its device.

The training directory: restarting with the same --train_dir resumes from
its latest checkpoint; when that is already at --max_steps the script says
so and exits 0 without training. SIGTERM or SIGINT (Ctrl-C) saves a
checkpoint and exits with 128 + the signal's number (143, 130); a second
one kills at once. A second trainer on the same --train_dir is refused (a
lock, ``train.lock``, names the holder's pid), and so is a directory whose
checkpoints it cannot safely resume from (the ``checkpoint`` state file
missing or unreadable, naming another directory, or the latest checkpoint
corrupt): the error names the newest intact checkpoint and the one-line
``echo 'model_checkpoint_path: "model.ckpt-N"' > DIR/checkpoint`` that
resumes from it. Nothing there is deleted but the Saver's leftover
``model.ckpt-N_temp/`` folders and the checkpoints it rotates out.
"""

import collections
import contextlib
import os
from typing import Callable, Optional, Sequence, Union

if __name__ == "__main__":
  # Before TensorFlow loads: its C++ INFO and WARNING lines stay out of the
  # log, unless the user chose a level (docs/examples.md, "The log").
  os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from absl import app
from absl import flags
from absl import logging
import tensorflow.compat.v1 as tf

import cluster
import common
import mnist_data
import mnist_model
import towers
import traindir
import watchdog

# 'cpu', 'gpu', 'balanced', 'replicated', a device string or a device
# function.
VariableDevice = Union[str, Callable[[tf.Operation], str]]

TrainGraph = collections.namedtuple("TrainGraph", [
    "train_op", "loss", "global_step", "learning_rate", "summary_op",
    "towers", "optimizer"])
TrainGraph.__doc__ = """What `build_train_graph` built.

Fields:
  train_op: one synchronous step over all towers.
  loss: the global batch's mean loss (cross-entropy plus weight decay).
  global_step: int64, +1 per step (not per tower).
  learning_rate: the decayed learning rate of the current step.
  summary_op: the merged summaries (final tower's, learning rate, loss,
    variable and averaged-gradient histograms).
  towers: the `towers.Towers` built.
  optimizer: the optimizer that applies the step (its session hook, for a
    ``tf.train.SyncReplicasOptimizer``).
"""


# The bounds of `train`'s numeric arguments and of the flags of the same
# names, checked before anything is built (`common.check_args`).
BOUNDS = {
    "num_gpus": dict(at_least=1),
    "batch_size": dict(at_least=1),
    "accumulate_steps": dict(at_least=1),
    "max_steps": dict(at_least=0),
    "learning_rate": dict(above=0),
    "momentum": dict(at_least=0, below=1),
    "learning_rate_decay": dict(above=0, at_most=1),
    "epochs_per_decay": dict(above=0),
    "weight_decay": dict(at_least=0),
    "dropout_rate": dict(at_least=0, below=1),
    "log_frequency": dict(at_least=1),
    "save_checkpoint_secs": dict(at_least=1),
    "save_checkpoint_steps": dict(at_least=1),
    "save_summaries_steps": dict(at_least=0),
    "task_index": dict(at_least=0),
    "replicas_to_aggregate": dict(at_least=1),
    "startup_timeout_secs": dict(above=0),
    "step_timeout_secs": dict(above=0),
    "stall_log_secs": dict(above=0),
    "pack_bytes": dict(at_least=0),
}


def build_train_graph(*, devices: Sequence[str], batch_size: int,
                      train_files: Optional[Sequence[mnist_data.IdxFile]],
                      num_examples: int, learning_rate: float,
                      momentum: float, learning_rate_decay: float,
                      epochs_per_decay: float, weight_decay: float,
                      dropout_rate: float,
                      variable_device: VariableDevice = "cpu",
                      all_reduce: str = "auto",
                      average_device: Optional[str] = None,
                      pack_bytes: int = common.DEFAULT_PACK_BYTES,
                      precision: str = "float32", xla: bool = False,
                      stage_inputs: bool = False,
                      wrap_optimizer: Optional[Callable[
                          [tf.train.Optimizer], tf.train.Optimizer]] = None,
                      replicas: int = 1, num_workers: int = 1,
                      accumulate_steps: int = 1,
                      seed: Optional[int] = None) -> TrainGraph:
  """Builds the input pipeline, the towers and the step in the default graph.

  The learning rate decays by `learning_rate_decay` every `epochs_per_decay`
  epochs, counted in examples (``global_step * batch_size * num_towers *
  replicas * accumulate_steps``), so the schedule over the data is the same
  for any number of towers, workers and micro-batches (the reference counted
  steps, decaying num_towers times too late).

  Args:
    devices: ``[num_towers]`` tower devices (see `common.tower_setup`).
    batch_size: examples per tower per step.
    train_files: ``(images, labels)`` from `mnist_data.find_split`, or None
      for synthetic images (`mnist_data.fake_dataset`).
    num_examples: the examples in one epoch, for the decay schedule.
    learning_rate: the initial learning rate.
    momentum: the momentum of ``tf.train.MomentumOptimizer``.
    learning_rate_decay: the factor applied every `epochs_per_decay`.
    epochs_per_decay: epochs between two decays (a staircase).
    weight_decay: the L2 coefficient of the fully connected weights.
    dropout_rate: the fraction of local3's units dropped in training.
    variable_device: where the variables live, as for
      `towers.build_towers` (``'cpu'``, the original's; ``'replicated'`` for
      a copy on every tower; a device function such as
      ``tf.train.replica_device_setter`` for between-graph training).
    all_reduce: with ``variable_device='replicated'``, how the copies'
      gradients are summed (see `towers.build_towers`); else ``'auto'``.
    average_device: where the towers' gradients are averaged (see
      `towers.minimize`); a worker's own CPU in a cluster.
    pack_bytes: the largest gradient, in bytes, reduced in a pack with
      others (see `towers.minimize`); 0 turns packing off.
    precision: the dtype the towers compute in, one of
      `common.PRECISIONS`: `towers.minimize`'s ``compute_dtype`` (float32
      master weights; float16 with dynamic loss scaling, its default).
    xla: whether each tower's model is built in an XLA ``jit_scope``.
    stage_inputs: whether each tower's batches are read ahead and staged
      on its device (`towers.minimize`'s ``stage_inputs``).
    wrap_optimizer: wraps the momentum optimizer, e.g. in a
      ``tf.train.SyncReplicasOptimizer``.
    replicas: how many workers' gradients one global step applies.
    num_workers: in collective mode, the number of workers whose towers'
      gradients are all-reduced together (`towers.minimize`'s
      ``num_workers``); 1 otherwise.
    accumulate_steps: micro-batches per step (`towers.minimize`'s
      ``accumulate_steps``): each run of the train op takes one.
    seed: the graph's random seed (initial weights, dropout) and the
      shuffle seed, for repeatable runs; None for new ones every run.

  Returns:
    A `TrainGraph`.
  """
  num_towers = len(devices)
  if seed is not None:
    tf.set_random_seed(seed)
  # The pipeline, its iterator, the step counter and the schedule live on
  # the CPU: input ops on a GPU made multi-GPU training slower than one GPU.
  with tf.device(mnist_data.INPUT_DEVICE):
    global_step = tf.train.get_or_create_global_step()
    if train_files is None:
      dataset = mnist_data.fake_dataset(batch_size)
    else:
      dataset = mnist_data.train_dataset(*train_files, batch_size, seed=seed)
    iterator = tf.data.make_one_shot_iterator(dataset)
    examples_seen = global_step * (batch_size * num_towers * replicas *
                                   accumulate_steps)
    lr = tf.train.exponential_decay(
        learning_rate, examples_seen,
        decay_steps=max(1, int(round(epochs_per_decay * num_examples))),
        decay_rate=learning_rate_decay, staircase=True)

  def next_batch():
    # Called once inside each tower's scope: each tower dequeues its own
    # batch from the one shared pipeline. The explicit device wins over the
    # tower's, keeping the dequeue next to the iterator.
    with tf.device(mnist_data.INPUT_DEVICE):
      return iterator.get_next()

  dtype = tf.as_dtype(precision)

  def model_fn(scope, images, labels):
    del scope  # Summaries are collected by the towers.
    with common.xla_scope(xla):
      logits, decay = mnist_model.inference(
          images, dropout_rate=dropout_rate, weight_decay=weight_decay,
          dtype=dtype)
      xent = mnist_model.cross_entropy(logits, labels)
      loss = tf.add(xent, decay, name="total_loss")
      # Named apart from the ops they show: a summary named like an
      # existing op gets a uniquified tag ("cross_entropy_1").
      tf.summary.scalar("losses/cross_entropy", xent)
      tf.summary.scalar("losses/weight_decay", decay)
      tf.summary.scalar("losses/total", loss)
      tf.summary.histogram("logits", logits)
    return loss

  opt = tf.train.MomentumOptimizer(lr, momentum)
  if wrap_optimizer is not None:
    opt = wrap_optimizer(opt)
  train_op, t = towers.minimize(model_fn, opt, num_towers, inputs=next_batch,
                                devices=list(devices),
                                compute_dtype=precision,
                                stage_inputs=stage_inputs,
                                variable_device=variable_device,
                                all_reduce=all_reduce,
                                average_device=average_device,
                                pack_bytes=pack_bytes,
                                global_step=global_step,
                                num_workers=num_workers,
                                accumulate_steps=accumulate_steps)
  summary_op = common.training_summaries(t, lr, accumulate_steps)
  return TrainGraph(train_op=train_op, loss=t.loss, global_step=global_step,
                    learning_rate=lr, summary_op=summary_op, towers=t,
                    optimizer=opt)


def train(*, train_dir: str, data_dir: Optional[str] = None,
          dataset: str = "mnist", num_gpus: int = 2, batch_size: int = 64,
          accumulate_steps: int = 1, max_steps: int = 4700,
          learning_rate: float = 0.02,
          momentum: float = 0.9, learning_rate_decay: float = 0.75,
          epochs_per_decay: float = 1.0, weight_decay: float = 5e-4,
          dropout_rate: float = 0.5, fake_data: bool = False,
          log_device_placement: bool = False, log_frequency: int = 10,
          save_checkpoint_secs: int = 60,
          save_checkpoint_steps: Optional[int] = None,
          save_summaries_steps: int = 100,
          variable_device: str = "cpu", all_reduce: str = "auto",
          pack_bytes: int = common.DEFAULT_PACK_BYTES,
          precision: str = "float32", xla: bool = False,
          stage_inputs: bool = False,
          ps_hosts: Sequence[str] = (), worker_hosts: Sequence[str] = (),
          job_name: str = "worker", task_index: int = 0,
          replicas_to_aggregate: Optional[int] = None,
          startup_timeout_secs: float = 60.0,
          step_timeout_secs: Optional[float] = 300.0,
          stall_log_secs: float = 30.0,
          mirrors: Optional[Sequence[str]] = mnist_data.MNIST_MIRRORS,
          seed: Optional[int] = None) -> int:
  """Trains until the global step reaches `max_steps`; returns that step.

  Checkpoints (every `save_checkpoint_secs`, or `save_checkpoint_steps`,
  and at the final step) and summaries go to `train_dir`; a run with the
  same `train_dir` resumes from its latest checkpoint, after
  `traindir.prepare` has locked and checked it. If that checkpoint
  is already at `max_steps`, nothing is trained. SIGTERM or SIGINT stops
  training after a final checkpoint (`common.run_training`).

  With `ps_hosts` and `worker_hosts` this process is one task of a cluster
  (between-graph replication, docs/distributed.md): a parameter server
  serves the variables forever; a worker builds its towers on its own
  devices, averages them there, and a ``tf.train.SyncReplicasOptimizer``
  applies `replicas_to_aggregate` workers' gradients per global step. With
  `worker_hosts` alone (collective mode) there are no parameter servers:
  each worker keeps replicated copies and all-reduces with every other
  worker through collective ops, starting from the chief's values
  (`towers.broadcast_variables`). Worker 0 is the chief: it initializes (or
  restores), saves checkpoints and summaries. In a cluster a watchdog logs
  what a long step waits for and stops a worker that waits too long.

  Args:
    train_dir: checkpoints and event files; never deleted.
    data_dir: the IDX files (see `mnist_data.find_split`); None for the
      dataset's default directory.
    dataset: 'mnist' or 'fashion_mnist'.
    num_gpus: the number of towers.
    batch_size: examples per tower per micro-batch (per step, without
      accumulation).
    accumulate_steps: micro-batches summed into each step's update.
    max_steps: the global step to stop at.
    learning_rate, momentum, learning_rate_decay, epochs_per_decay,
      weight_decay, dropout_rate: see `build_train_graph`.
    fake_data: train on one random batch instead of the data set, to
      measure throughput only.
    log_device_placement: log every op's device.
    log_frequency: steps between two log lines.
    save_checkpoint_secs, save_checkpoint_steps, save_summaries_steps: as
      for `common.run_training`.
    variable_device: one of `common.VARIABLE_DEVICES`, as for
      `build_train_graph`: ``'cpu'``, ``'gpu'``, ``'balanced'`` or
      ``'replicated'`` (with parameter servers only the default, the
      variables living there; collective mode is always ``'replicated'``).
    all_reduce: one of `common.ALL_REDUCE`; other than ``'auto'`` only with
      ``variable_device='replicated'``.
    pack_bytes: as for `build_train_graph`; in every variable mode, and in
      a cluster.
    precision: 'float32', 'float16' or 'bfloat16', as for
      `build_train_graph`; not 'float16' in a cluster (its loss scaling
      skips steps, which ``SyncReplicasOptimizer`` cannot; untested in
      collective mode).
    xla, stage_inputs: as for `build_train_graph`.
    ps_hosts, worker_hosts: the cluster's ``host:port`` lists, the same for
      every task; both empty for training on this machine alone,
      `worker_hosts` alone for collective mode.
    job_name, task_index: this task: 'ps' or 'worker', and its index in
      that list.
    replicas_to_aggregate: workers' gradients per global step; default all
      workers. Fewer makes the rest backup workers (parameter servers only:
      collective mode has none).
    startup_timeout_secs: how long a worker waits for the parameter servers
      (collective mode: the other workers) and the chief before it fails.
    step_timeout_secs: in a cluster, the session's operation timeout; a
      worker with no step for 15 s more stops (`watchdog.Watchdog`). None
      for no timeout.
    stall_log_secs: in a cluster, how long a step waits before the worker
      logs what it waits for (then at least once a minute).
    mirrors: base URLs for downloading missing MNIST files; empty for none.
    seed: the random seed (see `build_train_graph`).

  Returns:
    The global step reached.

  Raises:
    common.FlagError: for an argument out of its `BOUNDS`, a directory
      `common.dir_problem` refuses (empty, a file, under a file, a
      `train_dir` that cannot be written), a `variable_device` and
      `all_reduce` combination that cannot work
      (`common.check_variable_flags`), or a `precision` a cluster cannot
      take (`common.check_precision`); common.DeviceError
      (one) if a session lacks a tower device.
    traindir.TrainDirError: if `train_dir` is in use by another trainer, or
      holds checkpoints it cannot safely resume from (or that lack a
      variable of this run's graph: a float32 run's, for float16).
    common.Interrupted: after SIGTERM or SIGINT, once the checkpoint is
      saved.
    mnist_data.MissingDataError: if the data is absent and not downloadable.
    mnist_data.IdxError: if a data file is corrupt.
    FloatingPointError: if the loss becomes NaN.
    cluster.ClusterError, TimeoutError: for cluster flags that are wrong or
      disagree with the chief's, or tasks that cannot be reached.
    watchdog.PeerLost: when a step fails on a lost or late peer.
  """
  common.check_args(
      BOUNDS, num_gpus=num_gpus, batch_size=batch_size,
      accumulate_steps=accumulate_steps, max_steps=max_steps,
      learning_rate=learning_rate, momentum=momentum,
      learning_rate_decay=learning_rate_decay,
      epochs_per_decay=epochs_per_decay, weight_decay=weight_decay,
      dropout_rate=dropout_rate, log_frequency=log_frequency,
      save_checkpoint_secs=save_checkpoint_secs,
      save_checkpoint_steps=save_checkpoint_steps,
      save_summaries_steps=save_summaries_steps, task_index=task_index,
      replicas_to_aggregate=replicas_to_aggregate,
      startup_timeout_secs=startup_timeout_secs, pack_bytes=pack_bytes,
      step_timeout_secs=step_timeout_secs, stall_log_secs=stall_log_secs)
  common.check_dir("train_dir", train_dir)
  common.check_dir("data_dir", data_dir, common.READ)
  distributed = bool(ps_hosts or worker_hosts)
  collective = distributed and not ps_hosts
  common.check_variable_flags(variable_device, all_reduce, distributed,
                              collective)
  common.check_precision(precision, distributed, collective)
  replicas = 1
  if distributed:
    replicas = replicas_to_aggregate or len(worker_hosts)
    if collective and replicas != len(worker_hosts):
      raise cluster.ClusterError(
          "--replicas_to_aggregate=%d but collective mode (no --ps_hosts) "
          "has no backup workers: every step all-reduces the gradients of "
          "all %d workers; drop --replicas_to_aggregate, or give "
          "--ps_hosts" % (replicas, len(worker_hosts)))
    if not 1 <= replicas <= len(worker_hosts):
      raise cluster.ClusterError(
          "--replicas_to_aggregate=%d but --worker_hosts lists %d workers; "
          "it must be between 1 and the number of workers"
          % (replicas, len(worker_hosts)))
    # A parameter server never returns from here.
    task = cluster.start_task(ps_hosts, worker_hosts, job_name, task_index,
                              num_gpus,
                              log_device_placement=log_device_placement,
                              startup_timeout_secs=startup_timeout_secs,
                              step_timeout_secs=step_timeout_secs)
    if seed is not None:
      seed += task_index  # Each worker its own shuffle order.
  if data_dir is None:
    data_dir = mnist_data.default_data_dir(dataset)
  session_kwargs = {}
  if distributed:
    devices = towers.tower_devices(num_gpus, task=task.worker_device)
    config = task.config
  else:
    devices, config = common.tower_setup(num_gpus, log_device_placement)
  if fake_data:
    logging.info("--fake_data: training on synthetic images (one random "
                 "batch); the examples/sec are real, the loss and "
                 "precision mean nothing")
    train_files = None
    num_examples = 60000  # MNIST's, so the schedule is the real run's.
  else:
    train_files = mnist_data.find_split(data_dir, "train", dataset, mirrors)
    num_examples = train_files[0].count
  common.log_batch(num_gpus, batch_size, max_steps, num_examples, replicas,
                   accumulate_steps)
  is_chief = not distributed or task.is_chief
  state = traindir.prepare(train_dir, is_chief=is_chief)
  with state.lock:
    if traindir.finished(state, train_dir, max_steps):
      return state.global_step or 0
    if collective:
      # Every worker builds the same graph on its own task; the towers of
      # all workers all-reduce their gradients in one collective group.
      scope = task.worker_device
      graph_kwargs = dict(variable_device="replicated",
                          all_reduce="collective", replicas=replicas,
                          num_workers=task.num_workers)
      # Every worker creates its session as a chief would (no parameter
      # server holds shared variables); only worker 0 restores and saves.
      session_kwargs = dict(master=task.server.target, is_chief=task.is_chief,
                            stop_grace_period_secs=5, recover=False)
    elif distributed:
      # The setter around the whole graph puts the step counter and the
      # optimizer's slots on the parameter servers and everything else on
      # this worker; the towers use it for their variables.
      scope = cluster.device_setter(task)
      graph_kwargs = dict(
          variable_device=scope,
          average_device=task.worker_device + "/cpu:0",
          wrap_optimizer=lambda opt: tf.train.SyncReplicasOptimizer(
              opt, replicas_to_aggregate=replicas,
              total_num_replicas=task.num_workers),
          replicas=replicas)
      # A short wait for the session's threads when it closes; the chief's
      # token queue runner, which only the close itself ends, is not one of
      # them (cluster.sync_replicas_hook).
      session_kwargs = dict(master=task.server.target,
                            is_chief=task.is_chief, stop_grace_period_secs=5,
                            save_when_stuck=True)
    else:
      scope = None
      graph_kwargs = dict(variable_device=variable_device,
                          all_reduce=all_reduce)
    with tf.Graph().as_default(), (
        tf.device(scope) if scope else contextlib.nullcontext()):
      g = build_train_graph(
          devices=devices, batch_size=batch_size, train_files=train_files,
          num_examples=num_examples, learning_rate=learning_rate,
          momentum=momentum, learning_rate_decay=learning_rate_decay,
          epochs_per_decay=epochs_per_decay, weight_decay=weight_decay,
          dropout_rate=dropout_rate, pack_bytes=pack_bytes, seed=seed,
          precision=precision, xla=xla, stage_inputs=stage_inputs,
          accumulate_steps=accumulate_steps, **graph_kwargs)
      traindir.check_restores(state, tf.global_variables())
      if not distributed or collective:
        common.log_variables(g.towers, graph_kwargs["variable_device"],
                             all_reduce)
      common.log_packing(g.towers, pack_bytes)
      common.log_fast_paths(g.towers, precision, xla, stage_inputs)
      dog = None
      if collective:
        # After the whole graph: the chief's values (restored, or
        # initialized) go to every worker, then to every tower's copy.
        with tf.control_dependencies(
            [tf.train.Scaffold.default_local_init_op()]):
          session_kwargs["local_init_op"] = towers.broadcast_variables()
        session_kwargs["hooks"] = [cluster.VariablesDigestHook(g.global_step)]
      elif distributed:
        session_kwargs["hooks"] = [
            cluster.sync_replicas_hook(g.optimizer, task.is_chief)]
        if not task.is_chief:
          cluster.wait_for_model(task.server.target, config)
      if distributed:
        dog = session_kwargs["watchdog"] = _watchdog(
            task, g.global_step, train_dir, stall_log_secs,
            step_timeout_secs)
      try:
        return common.run_training(
            g.train_op, g.loss, g.global_step, g.summary_op,
            train_dir=train_dir, max_steps=max_steps,
            examples_per_step=batch_size * num_gpus * accumulate_steps,
            num_towers=num_gpus, applies=g.towers.applies,
            config=config, log_every=log_frequency,
            save_checkpoint_secs=save_checkpoint_secs,
            save_checkpoint_steps=save_checkpoint_steps,
            save_summaries_steps=save_summaries_steps,
            loss_scale=g.towers.loss_scale, **session_kwargs)
      except watchdog.PEER_ERRORS as e:
        if dog is None:
          raise
        raise watchdog.PeerLost(dog.explain(e)) from e


def _watchdog(task: cluster.Task, global_step: tf.Tensor, train_dir: str,
              stall_log_secs: float, step_timeout_secs: Optional[float]
             ) -> watchdog.Watchdog:
  """The worker's watchdog: what its steps wait for, and how to resume."""
  if task.collective:
    waiting_for = ("the collective all-reduce with every worker (%s)"
                   % ", ".join(task.cluster.job_tasks("worker")))
  else:
    waiting_for = ("the parameter servers (%s) and, through "
                   "SyncReplicasOptimizer's tokens, the other workers' "
                   "gradients" % ", ".join(task.cluster.job_tasks("ps")))

  def advice():
    # None where this worker cannot read it: the chief's own directory.
    step = traindir.latest_step(train_dir)
    resume = ("the chief's last checkpoint, step %d in %s" % (step, train_dir)
              if step is not None else
              "the chief's last checkpoint in --train_dir")
    if task.collective:
      return ("Collective mode has no backup workers: every worker stops. "
              "Restart every worker with the same flags: training resumes "
              "from %s (the steps after it are lost)" % resume)
    return ("Restart the lost task with the same flags (the workers recover "
            "a parameter server that comes back); or restart the cluster: "
            "training resumes from %s (the steps after it are lost)"
            % resume)

  return watchdog.Watchdog(
      global_step, waiting_for, cluster.peers(task),
      log_after_secs=stall_log_secs,
      timeout_secs=step_timeout_secs + 15 if step_timeout_secs else None,
      advice=advice)


FLAGS = flags.FLAGS


def define_flags() -> None:
  """Defines the script's flags (only when run as a script)."""
  flags.DEFINE_integer("num_gpus", 2, "How many towers (GPUs) to use; "
                       "virtual CPU devices stand in for missing GPUs.")
  flags.DEFINE_integer("batch_size", 64, "Examples per tower per step; the "
                       "global batch is batch_size x num_gpus.")
  flags.DEFINE_integer("accumulate_steps", 1, "Micro-batches of batch_size "
                       "per tower summed into each step's update: the "
                       "global batch grows by this factor, memory does "
                       "not.")
  flags.DEFINE_enum("dataset", "mnist", list(mnist_data.DATASETS),
                    "mnist, or fashion_mnist (same format; Debian's "
                    "dataset-fashion-mnist package has it).")
  flags.DEFINE_string("data_dir", None, "Directory of the IDX files; "
                      "default /tmp/mnist_data for mnist (downloaded there "
                      "when absent), %s for fashion_mnist."
                      % mnist_data.FASHION_MNIST_DIR)
  flags.DEFINE_string("train_dir", "/tmp/mnist_train", "Directory for "
                      "checkpoints and event logs; a run resumes from it.")
  flags.DEFINE_integer("max_steps", 4700, "The global step to stop at "
                       "(4700 x 128 examples: 10 epochs with the defaults).")
  flags.DEFINE_float("learning_rate", 0.02, "Initial learning rate.")
  flags.DEFINE_float("momentum", 0.9, "Momentum.")
  flags.DEFINE_float("learning_rate_decay", 0.75, "Factor applied to the "
                     "learning rate every --epochs_per_decay epochs.")
  flags.DEFINE_float("epochs_per_decay", 1.0, "Epochs (counted in examples, "
                     "whatever --num_gpus) between two decays.")
  flags.DEFINE_float("weight_decay", 5e-4, "L2 coefficient of the fully "
                     "connected weights.")
  flags.DEFINE_float("dropout_rate", 0.5, "Fraction of the 1024 hidden "
                     "units dropped in training.")
  flags.DEFINE_boolean("fake_data", False, "Train on synthetic images, to "
                       "measure throughput only.")
  flags.DEFINE_boolean("log_device_placement", False, "Log each op's "
                       "device.")
  flags.DEFINE_integer("log_frequency", 10, "Steps between log lines.")
  flags.DEFINE_integer("save_checkpoint_secs", 60, "Seconds between "
                       "checkpoints (the final step is always saved).")
  flags.DEFINE_integer("save_checkpoint_steps", None, "Steps between "
                       "checkpoints; replaces --save_checkpoint_secs.")
  flags.DEFINE_integer("save_summaries_steps", 100, "Steps between "
                       "summaries (0: none).")
  flags.DEFINE_integer("seed", None, "Random seed of the initial "
                       "weights, dropout and shuffle (default: random).")
  common.define_variable_flags(" Only the default with --ps_hosts (the "
                               "variables live on the parameter servers); "
                               "collective mode (--worker_hosts alone) is "
                               "always replicated, all-reduced with "
                               "collective ops.")
  common.define_pack_bytes_flag()
  common.define_precision_flag(
      " Not float16 in a cluster (SyncReplicasOptimizer cannot skip a "
      "step; untested in collective mode): bfloat16 needs no loss scaling.")
  common.define_xla_and_staging_flags()
  flags.DEFINE_list("ps_hosts", [], "Parameter servers' host:port list, "
                    "the same on every task; empty to train on this machine "
                    "alone, or, with --worker_hosts, in collective mode.")
  flags.DEFINE_list("worker_hosts", [], "Workers' host:port list, the same "
                    "on every task; the first is the chief.")
  flags.DEFINE_enum("job_name", "worker", ["ps", "worker"], "This task's "
                    "job in the cluster.")
  flags.DEFINE_integer("task_index", 0, "This task's index in its job's "
                       "host list.")
  flags.DEFINE_integer("replicas_to_aggregate", None, "Workers' gradients "
                       "applied per global step (default: all workers; "
                       "fewer makes the others backup workers).")
  flags.DEFINE_float("startup_timeout_secs", 60, "Seconds a worker waits "
                     "for the parameter servers (collective mode: the other "
                     "workers) and the chief.")
  flags.DEFINE_float("step_timeout_secs", 300, "In a cluster, a session op "
                     "waiting longer for another task fails, and a worker "
                     "with no step done for 15 s more (a session that "
                     "cannot be created included) stops, saying what it "
                     "waited for and how to resume. Synchronous steps wait "
                     "for the slowest worker: keep it well above a step's "
                     "time and a restarted task's start-up.")
  flags.DEFINE_float("stall_log_secs", 30, "In a cluster, a step (or "
                     "session creation) running longer logs what it waits "
                     "for and which tasks do not accept connections, then "
                     "again every min(60, this) seconds.")
  flags.DEFINE_list("mirrors", list(mnist_data.MNIST_MIRRORS), "Base URLs "
                    "to download missing MNIST files from (comma "
                    "separated; empty for no download).")
  common.register_flag_checks(BOUNDS, directories=dict(
      train_dir=common.WRITTEN, data_dir=common.READ))
  # --help lists the main module's key flags: the shared ones count too.
  flags.adopt_module_key_flags(common)


def main(argv):
  expected = (mnist_data.DataError, FloatingPointError, cluster.ClusterError,
              TimeoutError, common.FlagError, traindir.TrainDirError,
              watchdog.PeerLost)
  return common.run_main(argv, lambda: train(
      train_dir=FLAGS.train_dir, data_dir=FLAGS.data_dir, dataset=FLAGS.dataset,
      num_gpus=FLAGS.num_gpus, batch_size=FLAGS.batch_size,
      accumulate_steps=FLAGS.accumulate_steps,
      max_steps=FLAGS.max_steps, learning_rate=FLAGS.learning_rate,
      momentum=FLAGS.momentum, learning_rate_decay=FLAGS.learning_rate_decay,
      epochs_per_decay=FLAGS.epochs_per_decay, weight_decay=FLAGS.weight_decay,
      dropout_rate=FLAGS.dropout_rate, fake_data=FLAGS.fake_data,
      log_device_placement=FLAGS.log_device_placement,
      log_frequency=FLAGS.log_frequency,
      save_checkpoint_secs=FLAGS.save_checkpoint_secs,
      save_checkpoint_steps=FLAGS.save_checkpoint_steps,
      save_summaries_steps=FLAGS.save_summaries_steps, seed=FLAGS.seed,
      variable_device=FLAGS.variable_device, all_reduce=FLAGS.all_reduce,
      pack_bytes=FLAGS.pack_bytes, precision=FLAGS.precision, xla=FLAGS.xla,
      stage_inputs=FLAGS.stage_inputs, mirrors=FLAGS.mirrors,
      ps_hosts=FLAGS.ps_hosts, worker_hosts=FLAGS.worker_hosts,
      job_name=FLAGS.job_name, task_index=FLAGS.task_index,
      replicas_to_aggregate=FLAGS.replicas_to_aggregate,
      startup_timeout_secs=FLAGS.startup_timeout_secs,
      step_timeout_secs=FLAGS.step_timeout_secs,
      stall_log_secs=FLAGS.stall_log_secs), expected)


if __name__ == "__main__":
  define_flags()
  app.run(main)
