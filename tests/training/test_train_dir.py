"""TrainDir: the lock, and the checks before a session resumes a directory.

Each refusal is one line that names the newest intact checkpoint and a
command that resumes from it; the tests run that command, then train.
"""

import errno
import glob
import os
import re
import shutil
import signal
import subprocess

import pytest
import tensorflow.compat.v1 as tf

from towers import training
from towers.training import _traindir


@pytest.fixture(scope="module")
def trained(tmp_path_factory, train_tiny):
  """A directory of a 6-step run with checkpoints 0, 2, 4 and 6."""
  train_dir = str(tmp_path_factory.mktemp("trained"))
  assert train_tiny(train_dir, 6, save_checkpoint_steps=2) == 6
  return train_dir


def _copy(trained, tmp_path):
  copy = str(tmp_path / "train")
  shutil.copytree(trained, copy)
  return copy


def _listing(directory):
  """{name: (size, mtime)} of a directory's files."""
  return {n: (os.path.getsize(os.path.join(directory, n)),
              os.path.getmtime(os.path.join(directory, n)))
          for n in os.listdir(directory)}


def _refusal(path, **kwargs):
  """The message of the TrainDirError that entering TrainDir(path) raises."""
  with pytest.raises(training.TrainDirError) as error:
    with training.TrainDir(path, **kwargs):
      pass
  message = str(error.value)
  assert "\n" not in message
  return message


def _run_fix(message):
  """Runs the shell line an error gives after 'run: ', up to ' ; '."""
  command = message.split("run: ", 1)[1].split(" ; ", 1)[0]
  subprocess.run(command, shell=True, check=True, timeout=10)


def _fix_line(step):
  return "echo 'model_checkpoint_path: \"model.ckpt-%d\"' > " % step


# The lock.


def test_a_second_trainer_is_refused_naming_the_holders_pid_until_it_leaves(
    tmp_path):
  path = str(tmp_path / "train")
  lock = os.path.join(path, "train.lock")
  with training.TrainDir(path) as first:
    assert first.path == path and first.global_step is None
    with open(lock) as f:
      assert f.read() == "%d\n" % os.getpid()
    message = _refusal(path, name="--model_dir")
    assert message.startswith(
        "--model_dir=%s is in use by another trainer (pid %d holds %s): two "
        "trainers in one directory overwrite each other's checkpoints"
        % (path, os.getpid(), lock))
    assert message.endswith("give this one another --model_dir")
    with open(lock) as f:  # The refused one erased nothing.
      assert f.read() == "%d\n" % os.getpid()
  with training.TrainDir(path):  # Released.
    pass
  assert os.path.exists(lock)  # Kept: see _traindir._lock.


def test_the_lock_of_a_process_killed_by_sigkill_blocks_no_one(
    tmp_path, python, wait_until):
  path = str(tmp_path / "train")
  holder = python.start(
      ["-c", "import sys, time\n"
       "from towers import training\n"
       "with training.TrainDir(sys.argv[1]):\n"
       "  time.sleep(120)\n", path])
  lock = os.path.join(path, "train.lock")

  def locked():
    return os.path.exists(lock) and open(lock).read() == "%d\n" % holder.pid

  wait_until(locked, 60, "the subprocess to take the lock", holder)
  assert "(pid %d holds" % holder.pid in _refusal(path)
  holder.send_signal(signal.SIGKILL)
  assert holder.wait(timeout=10) == -signal.SIGKILL
  with open(lock) as f:  # Its pid is still in the file, its lock gone.
    assert f.read() == "%d\n" % holder.pid
  with training.TrainDir(path):
    with open(lock) as f:
      assert f.read() == "%d\n" % os.getpid()


def test_a_file_system_that_refuses_locks_is_not_taken_for_another_trainer(
    tmp_path, monkeypatch):
  # As on some network file systems: flock fails with ENOLCK, which says
  # nothing of another trainer.
  def flock(f, operation):
    del f, operation
    raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))

  monkeypatch.setattr(_traindir.fcntl, "flock", flock)
  message = _refusal(str(tmp_path / "train"))
  assert "in use by another trainer" not in message
  assert "cannot be created or written (%s" % os.strerror(errno.ENOLCK) in (
      message)


def test_a_directory_that_cannot_be_created_is_one_error_naming_it(
    tmp_path, monkeypatch):
  # What a flag's checks cannot see, such as a read-only file system.
  def makedirs(path, exist_ok=False):
    del exist_ok
    raise OSError(errno.EROFS, os.strerror(errno.EROFS), path)

  monkeypatch.setattr(_traindir.os, "makedirs", makedirs)
  path = str(tmp_path / "train")
  assert _refusal(path) == (
      "train_dir=%s cannot be created or written (Read-only file system: "
      "%s): point it at a directory you can write to" % (path, path))


# What a session would restore.


def test_the_state_file_holds_relative_paths_and_a_copy_resumes_from_itself(
    trained, tmp_path, train_tiny, checkpoint_step):
  with open(os.path.join(trained, "checkpoint")) as f:
    state = f.read()
  assert 'model_checkpoint_path: "model.ckpt-6"' in state
  assert re.findall(r'all_model_checkpoint_paths: "([^"]*)"', state) == [
      "model.ckpt-0", "model.ckpt-2", "model.ckpt-4", "model.ckpt-6"]
  before = _listing(trained)
  copy = _copy(trained, tmp_path)
  # Two more checkpoints: the Saver keeps 5, so model.ckpt-0 goes.
  assert train_tiny(copy, 8) == 8
  assert checkpoint_step(copy) == 8
  assert not glob.glob(os.path.join(copy, "model.ckpt-0.*"))
  assert _listing(trained) == before  # Neither read-modified nor deleted.


def test_saver_and_scaffold_pass_their_arguments_on():
  # Their relative paths: the test above (train's) and test_loop's own loop
  # (the scaffold's).
  with tf.Graph().as_default():
    tf.train.get_or_create_global_step()
    saver = training.TrainDir.saver(max_to_keep=2)
    assert saver.saver_def.sharded
    assert saver.saver_def.max_to_keep == 2
    summary = tf.constant(b"")
    scaffold = training.TrainDir("unused").scaffold(summary_op=summary)
    assert scaffold.summary_op is summary
    assert scaffold.saver.saver_def.sharded
    assert training.TrainDir.saver().saver_def.max_to_keep == 5


@pytest.mark.parametrize("damage", ["deleted", "garbage", "empty"])
def test_checkpoints_without_a_readable_state_file_are_refused_with_the_fix(
    trained, tmp_path, train_tiny, logs, damage):
  train_dir = _copy(trained, tmp_path)
  state = os.path.join(train_dir, "checkpoint")
  if damage == "deleted":
    os.remove(state)
  else:
    with open(state, "w") as f:
      f.write("model_checkpoint_path: {garbage" if damage == "garbage"
              else "")
  message = _refusal(train_dir)
  assert message.startswith(
      "train_dir=%s holds checkpoints (model.ckpt-6 the newest) but its "
      "state file %s %s, so training would start again at step 0 and "
      "overwrite them; to resume from the newest intact checkpoint, "
      "model.ckpt-6, run: " % (train_dir, state,
                               "is missing" if damage == "deleted"
                               else "cannot be read"))
  assert _fix_line(6) + state in message
  assert message.endswith(" ; or start over with another train_dir")
  _run_fix(message)
  assert train_tiny(train_dir, 7) == 7
  assert [m for m in logs() if m.startswith("step ")][0].startswith(
      "step 7,")  # Resumed from step 6.


def test_an_unreadable_state_file_beside_no_checkpoint_is_a_new_run(
    tmp_path):
  (tmp_path / "checkpoint").write_text("model_checkpoint_path: {garbage")
  with training.TrainDir(str(tmp_path)) as directory:
    assert directory.global_step is None and directory.checkpoint is None


def test_without_a_state_file_the_fix_names_the_newest_intact_checkpoint(
    trained, tmp_path):
  train_dir = _copy(trained, tmp_path)
  os.remove(os.path.join(train_dir, "checkpoint"))
  _damage(os.path.join(train_dir, "model.ckpt-6"), "truncated_data")
  message = _refusal(train_dir)
  assert "(model.ckpt-6 the newest)" in message
  assert "to resume from the newest intact checkpoint, model.ckpt-4" in (
      message)
  assert _fix_line(4) in message


def test_a_copy_whose_state_file_names_the_original_is_refused(
    trained, tmp_path, train_tiny):
  # As an older trainer wrote it: absolute paths, into the original.
  before = _listing(trained)
  copy = _copy(trained, tmp_path)
  state = os.path.join(copy, "checkpoint")
  with open(state, "w") as f:
    f.write('model_checkpoint_path: "%s/model.ckpt-6"\n'
            'all_model_checkpoint_paths: "%s/model.ckpt-6"\n'
            % (trained, trained))
  message = _refusal(copy)
  assert message.startswith(
      "the state file %s names checkpoints in another directory "
      "(%s/model.ckpt-6): it was written with absolute paths" % (state,
                                                                 trained))
  assert "In this directory, to resume from the newest intact checkpoint, " \
      "model.ckpt-6, run: " + _fix_line(6) + state in message
  _run_fix(message)
  assert train_tiny(copy, 7) == 7
  assert _listing(trained) == before


def _damage(prefix, how):
  """Damages the checkpoint at `prefix`; each shard of its data alike."""
  shards = sorted(glob.glob(prefix + ".data-*"))
  assert shards
  for data in shards:
    size = os.path.getsize(data)
    if how == "truncated_data" and size:
      with open(data, "r+b") as f:
        f.truncate(size // 2)
    elif how == "checksum_mismatch" and size:
      with open(data, "r+b") as f:
        f.seek(size // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))
  if how == "missing_data":
    os.remove(shards[0])
  elif how == "missing_index":
    os.remove(prefix + ".index")


@pytest.mark.parametrize("how", ["truncated_data", "checksum_mismatch",
                                 "missing_data", "missing_index"])
def test_a_corrupt_latest_checkpoint_is_refused_naming_the_intact_one(
    trained, tmp_path, train_tiny, how):
  train_dir = _copy(trained, tmp_path)
  _damage(os.path.join(train_dir, "model.ckpt-6"), how)
  message = _refusal(train_dir)
  assert message.startswith("the latest checkpoint %s/model.ckpt-6 is "
                            "corrupt or incomplete (" % train_dir)
  assert "to resume from the newest intact checkpoint, model.ckpt-4, run: " \
      + _fix_line(4) + os.path.join(train_dir, "checkpoint") in message
  if how == "truncated_data":
    _run_fix(message)
    assert train_tiny(train_dir, 5) == 5  # From step 4.


def test_with_no_intact_checkpoint_left_the_advice_is_to_start_over(
    trained, tmp_path):
  train_dir = _copy(trained, tmp_path)
  for step in (0, 2, 4, 6):
    _damage(os.path.join(train_dir, "model.ckpt-%d" % step), "missing_index")
  assert _refusal(train_dir).endswith(
      "no earlier checkpoint there is intact: start over with another "
      "train_dir")


def test_only_the_savers_temp_folders_are_removed(tmp_path, logs):
  train_dir = tmp_path / "train"
  outside = tmp_path / "outside"
  (outside / "part").mkdir(parents=True)
  for name in ["model.ckpt-7_temp", "model.ckpt-7_temp_mine", "my_temp"]:
    (train_dir / name / "part").mkdir(parents=True)
  (train_dir / "model.ckpt-8_temp").symlink_to(outside)
  (train_dir / "model.ckpt-9_temp").write_text("a file")
  with training.TrainDir(str(train_dir)) as directory:
    assert directory.global_step is None and directory.checkpoint is None
  assert sorted(os.listdir(str(train_dir))) == [
      "model.ckpt-7_temp_mine", "model.ckpt-8_temp", "model.ckpt-9_temp",
      "my_temp", "train.lock"]
  assert (outside / "part").is_dir()
  assert logs() == [
      "Removed %s, left by a checkpoint save that was interrupted"
      % (train_dir / "model.ckpt-7_temp")]


# What a resumed run needs.


def test_finished_compares_the_latest_step_with_max_steps(
    trained, tmp_path, logs):
  with training.TrainDir(trained) as directory:
    assert directory.global_step == 6
    assert directory.checkpoint == os.path.join(trained, "model.ckpt-6")
    assert not directory.finished(7)
    assert not logs()
    assert directory.finished(6) and directory.finished(4)
  assert logs() == [
      "Nothing to train: %s/model.ckpt-6 is at global step 6 and max_steps "
      "is %d (raise it to train on)" % (trained, n) for n in (6, 4)]
  fresh = str(tmp_path / "fresh")
  with training.TrainDir(fresh, name="--logdir") as directory:
    assert not directory.finished(1)
    assert directory.finished(0)
  assert logs()[-1] == (
      "Nothing to train: --logdir=%s is at global step 0 and max_steps is "
      "0 (raise it to train on)" % fresh)


def test_check_restores_names_the_variables_the_checkpoint_lacks(
    trained, tmp_path, tiny_model, train_tiny):
  # float16 training adds a loss scale, which a float32 run never saved.
  half = tiny_model(compute_dtype="float16")
  with half.graph.as_default(), training.TrainDir(trained) as directory:
    with pytest.raises(training.TrainDirError) as error:
      directory.check_restores()
    directory.check_restores([v for v in tf.global_variables()
                              if not v.op.name.startswith("loss_scale")])
  assert str(error.value) == (
      "the latest checkpoint %s/model.ckpt-6 lacks loss_scale, "
      "loss_scale_good_steps, which this run would restore: it was written "
      "by a run with other settings (float16 training adds a loss scale, "
      "for one); resume with the settings it was trained with, or train in "
      "another train_dir" % trained)
  with tiny_model().graph.as_default(), training.TrainDir(trained) as same:
    same.check_restores()
  with half.graph.as_default(), training.TrainDir(
      str(tmp_path / "fresh")) as fresh:
    fresh.check_restores()  # Nothing to restore.
  # train() checks before a session: nothing is written.
  copy = _copy(trained, tmp_path)
  before = _listing(copy)
  with pytest.raises(training.TrainDirError, match="lacks loss_scale"):
    train_tiny(copy, 7, model=tiny_model(compute_dtype="float16"))
  after = _listing(copy)
  del before["train.lock"], after["train.lock"]
  assert after == before


def test_a_worker_that_is_not_the_chief_only_reads_the_latest_step(
    trained, tmp_path):
  absent = str(tmp_path / "absent")
  with training.TrainDir(absent, is_chief=False) as directory:
    assert directory.global_step is None
  assert not os.path.exists(absent)  # Not created: the chief's to write.
  train_dir = _copy(trained, tmp_path)
  temp = os.path.join(train_dir, "model.ckpt-7_temp")
  os.makedirs(temp)
  with training.TrainDir(train_dir, is_chief=False) as worker:
    assert worker.global_step == 6
  assert os.path.isdir(temp)  # The chief's to remove.
  with training.TrainDir(train_dir):  # The chief holds the lock.
    with training.TrainDir(train_dir, is_chief=False) as worker:
      assert worker.global_step == 6
  os.remove(os.path.join(train_dir, "checkpoint"))  # The chief's to check.
  with training.TrainDir(train_dir, is_chief=False) as worker:
    assert worker.global_step is None
