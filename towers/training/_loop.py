"""`train`: the pieces composed into one loop for the common case."""

import os
import signal
from typing import Dict, Iterable, Optional, Union

import tensorflow.compat.v1 as tf

import towers
from towers.training import _cluster
from towers.training import _progress
from towers.training import _signals
from towers.training import _traindir
from towers.training import _watchdog


class Interrupted(Exception):
  """Training stopped on SIGTERM or SIGINT, after the chief saved a checkpoint.

  Attributes:
    signum: the signal's number; a script exits with ``128 + signum``.
    step: the global step reached (and saved, by the chief).
  """

  def __init__(self, signum: int, step: int):
    super().__init__("%s at step %d" % (signal.Signals(signum).name, step))
    self.signum = signum
    self.step = step


def train(train_op: Union[tf.Operation, Dict[str, tf.Operation]],
          t: towers.Towers, *, train_dir: str,
          max_steps: int, examples_per_step: float,
          summary_op: Union[None, tf.Tensor, Dict[str, tf.Tensor]] = None,
          config: Optional[tf.ConfigProto] = None,
          log_every_n_steps: int = 10, save_checkpoint_secs: int = 60,
          save_checkpoint_steps: Optional[int] = None,
          save_summaries_steps: int = 100,
          hooks: Iterable[tf.train.SessionRunHook] = (),
          task: Optional[_cluster.Task] = None,
          optimizer: Optional[tf.train.Optimizer] = None,
          stall_log_secs: float = 30.0) -> int:
  """Runs `train_op` until the global step reaches `max_steps`.

  A ``MonitoredTrainingSession`` with the `TrainDir` guard (a job at
  `max_steps` trains nothing), checkpoints (periodic and final), summaries,
  the `StepLoggerHook` and the `StopOnSignalHook`. With a `task`
  (`start_task`), that worker's session: collective mode starts from the
  chief's values (`towers.broadcast_variables`) and stops on a lost peer;
  with parameter servers the ``SyncReplicasOptimizer`` `optimizer` gets its
  hook; a `Watchdog` bounds every wait.

  Args:
    train_op, t: the step and its `towers.Towers` (`towers.minimize`'s);
      a dict of train ops runs each in turn, one run with its own loss.
    train_dir, max_steps: the checkpoints' directory; the step to stop at.
    examples_per_step: the examples of one update, for the step line.
    summary_op, config, hooks: the summaries (or a dict, run with each
      key's op), session config, more hooks.
    log_every_n_steps, save_*: how often to log, save and summarize.
    task, optimizer, stall_log_secs: a cluster's, see above and `Watchdog`.

  Returns:
    The global step reached.

  Raises:
    TrainDirError: for a training directory it cannot train in.
    Interrupted: after SIGTERM or SIGINT, once the chief has saved.
    ValueError: for a dict of train ops with ps, or summaries' bad keys.
    FloatingPointError: if the loss becomes NaN.
    PeerLost: when a step fails or stalls on another task.
  """
  if isinstance(summary_op, dict) and not set(summary_op) <= set(
      train_op if isinstance(train_op, dict) else [None]):
    raise ValueError(
        "summary_op is a dict with the keys %s, but the train ops' keys are "
        "%s: pass a summary op (or a dict of them) for the train ops' keys"
        % (", ".join(map(repr, summary_op)), ", ".join(map(repr, train_op))
           if isinstance(train_op, dict) else "none (one train op)"))
  if isinstance(train_op, dict) and task is not None and not task.collective:
    raise ValueError(
        "train runs a dict of train ops (%s) as one step of several session "
        "runs, but with parameter servers a lost ps recovers the session "
        "mid-step, and TensorFlow's run_step_fn would go on with the closed "
        "one; run the train ops in your own MonitoredTrainingSession loop, or "
        "train in a collective cluster (no ps)"
        % ", ".join(map(repr, train_op)))
  is_chief = task is None or task.is_chief
  with _traindir.TrainDir(train_dir, is_chief=is_chief) as directory:
    if directory.finished(max_steps):
      return directory.global_step or 0
    directory.check_restores()
    global_step = tf.train.get_or_create_global_step()
    local_init_op = None
    hooks = list(hooks)
    dog = None
    if task is not None:
      config = task.config
      if task.collective:
        # After the whole graph: the chief's values (restored or
        # initialized) go to every worker, then to every tower's copy.
        with tf.control_dependencies(
            [tf.train.Scaffold.default_local_init_op()]):
          local_init_op = towers.broadcast_variables()
        hooks.append(_cluster.VariablesDigestHook(global_step))
      else:
        if isinstance(optimizer, tf.train.SyncReplicasOptimizer):
          hooks.append(_cluster.sync_replicas_hook(optimizer, task.is_chief))
        if not task.is_chief:
          _cluster.wait_for_model(task.server.target, config)
      dog = _watchdog.watchdog_for_task(task, global_step, train_dir,
                                        stall_log_secs=stall_log_secs)
    try:
      return _run(
          train_op, t, directory, max_steps=max_steps,
          examples_per_step=examples_per_step, summary_op=summary_op,
          config=config, log_every_n_steps=log_every_n_steps,
          save_checkpoint_secs=save_checkpoint_secs,
          save_checkpoint_steps=save_checkpoint_steps,
          save_summaries_steps=save_summaries_steps, hooks=hooks, task=task,
          local_init_op=local_init_op, watchdog=dog)
    except _watchdog.PEER_ERRORS as e:
      if dog is None:
        raise
      raise _watchdog.PeerLost(dog.explain(e)) from e


def _run(train_op, t, directory: _traindir.TrainDir, *, max_steps,
         examples_per_step, summary_op, config, log_every_n_steps,
         save_checkpoint_secs, save_checkpoint_steps, save_summaries_steps,
         hooks, task, local_init_op, watchdog) -> int:
  """The session and its loop; see `train`."""
  train_dir = directory.path
  ops = dict(train_op) if isinstance(train_op, dict) else {None: train_op}
  summaries = dict(summary_op) if isinstance(summary_op, dict) else {
      list(ops)[-1]: summary_op}
  *earlier, last = list(ops)
  is_chief = task is None or task.is_chief
  logger = _progress.StepLoggerHook(
      t, examples_per_step, every_n_steps=log_every_n_steps,
      count_locally=task is None or task.collective)
  # The summaries of keys before the last, run with their own train ops
  # when the last key's (the hooked run's) are due.
  due = tf.train.SecondOrStepTimer(every_steps=save_summaries_steps) if (
      is_chief and save_summaries_steps) else None

  def run_step(step_context):
    # A step of several losses runs their train ops in turn, each fetching
    # its own loss and summaries (what its loss goes through, no other
    # key's inputs); the hooks see the last run, which counts the step.
    step = logger.step + 1
    write = due is not None and due.should_trigger_for_step(step)
    for key in earlier:
      fetches = {"loss": t.loss[key]}
      if write and summaries.get(key) is not None:
        fetches["summary"] = summaries[key]
      values = step_context.session.run([ops[key], fetches])[1]
      logger.record({key: values["loss"]})
      if "summary" in values:
        tf.summary.FileWriterCache.get(train_dir).add_summary(
            values["summary"], step)
    if write:
      due.update_last_triggered_step(step)
    step_context.run_with_hooks(ops[last])

  # Collective mode cannot recover a session: a lost peer's collectives
  # cannot be replayed, so every worker stops instead.
  recover = task is None or not task.collective
  saver = directory.saver()
  scaffold = tf.train.Scaffold(summary_op=summaries.get(last), saver=saver,
                               local_init_op=local_init_op)
  global_step = tf.train.get_global_step()
  signals = _signals.StopOnSignalHook()
  all_hooks = [tf.train.StopAtStepHook(last_step=max_steps), logger, signals]
  all_hooks += hooks + ([watchdog] if watchdog is not None else [])
  with signals:
    if watchdog is not None:
      def save():
        return saver.save(watchdog.session,
                          os.path.join(train_dir,
                                       _traindir.CHECKPOINT_BASENAME),
                          global_step=global_step, write_meta_graph=False)

      # Only with parameter servers may the chief save beside a stuck step.
      watchdog.start(lambda: signals.received,
                     save=save if is_chief and not task.collective else None)
    try:
      with _session(
          recover, master=task.server.target if task else "",
          is_chief=is_chief, train_dir=train_dir, scaffold=scaffold,
          hooks=all_hooks, config=config,
          save_checkpoint_secs=None if save_checkpoint_steps else
          save_checkpoint_secs,
          save_checkpoint_steps=save_checkpoint_steps,
          save_summaries_steps=save_summaries_steps
          if summaries.get(last) is not None else None,
          stop_grace_period_secs=120 if task is None else 5) as sess:
        while not sess.should_stop() and signals.received is None:
          if not earlier:
            sess.run(ops[last])
          else:
            sess.run_step_fn(run_step)
        if watchdog is not None:
          watchdog.closing()
    finally:
      if watchdog is not None:
        watchdog.stop()
    # The session has closed: the chief's final checkpoint is saved. Its
    # hooks' event writer is cached for the process and flushed only every
    # 2 minutes: flush it, so the directory is complete on return.
    if is_chief:
      tf.summary.FileWriterCache.get(train_dir).flush()
  if signals.received is not None and logger.step < max_steps:
    step = logger.step
    if is_chief:
      # The step saved: in a cluster the logger's count may lag it by one.
      saved = _traindir.latest_step(train_dir)
      step = step if saved is None else saved
    tf.logging.info("Received %s at step %d: %s, stopping",
                    signal.Signals(signals.received).name, step,
                    "saved a checkpoint" if is_chief else
                    "the chief saves the checkpoints")
    raise Interrupted(signals.received, step)
  return logger.step


def _session(recover: bool, *, master: str, is_chief: bool, train_dir: str,
             scaffold: tf.train.Scaffold, hooks, config,
             save_checkpoint_secs: Optional[int],
             save_checkpoint_steps: Optional[int],
             save_summaries_steps: Optional[int],
             stop_grace_period_secs: float):
  """A ``MonitoredTrainingSession``, or, without `recover`, its equal.

  Without `recover`: a ``SingularMonitoredSession`` (which raises what a
  step raises instead of recreating the session) created as a chief's, with
  the hooks ``MonitoredTrainingSession`` gives a chief, when `is_chief`:
  the checkpoint saver and the summary writer.
  """
  # The chief's saver and summary hooks after the others, so that a run the
  # StepLoggerHook fails (a NaN loss) is not saved: MonitoredTrainingSession
  # would put its own before the hooks it is given.
  hooks = list(hooks)
  if is_chief:
    if save_summaries_steps:
      hooks.append(tf.train.SummarySaverHook(
          save_steps=save_summaries_steps, output_dir=train_dir,
          scaffold=scaffold))
    hooks.append(tf.train.CheckpointSaverHook(
        train_dir, save_secs=save_checkpoint_secs,
        save_steps=save_checkpoint_steps, scaffold=scaffold))
  if recover:
    return tf.train.MonitoredTrainingSession(
        master=master, is_chief=is_chief, checkpoint_dir=train_dir,
        scaffold=scaffold, hooks=hooks, config=config,
        save_checkpoint_secs=None, save_checkpoint_steps=None,
        save_summaries_steps=None, save_summaries_secs=None,
        log_step_count_steps=0,
        stop_grace_period_secs=stop_grace_period_secs)
  return tf.train.SingularMonitoredSession(
      hooks=hooks, scaffold=scaffold, master=master, config=config,
      checkpoint_dir=train_dir if is_chief else None,
      stop_grace_period_secs=stop_grace_period_secs)
