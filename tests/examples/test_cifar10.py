"""The CIFAR-10 example, on small CIFAR-format files the tests write.

The files go through the real reader: records of 1 label byte + 3072 image
bytes, depth-major. Downloads are tried only from a server on loopback.
"""

import functools
import hashlib
import http.server
import io
import logging as py_logging
import os
import re
import shutil
import tarfile
import threading

import numpy as np
import pytest
import tensorflow.compat.v1 as tf

import cifar10_data
import cifar10_eval
import cifar10_model
import cifar10_multi_gpu_train
import common
from test_mnist import MinimizeCalled, autotune_off, spy_on_minimize
import towers

NUM_TOWERS = 2
BATCH = 8
TRAIN_STEPS = 30
TEST_IMAGES = 37  # Not a multiple of BATCH: the last batch holds 5.
# Unreachable: nothing listens on the discard port of loopback.
OFFLINE_URL = "http://127.0.0.1:9/cifar-10-binary.tar.gz"
# Below the tutorial's 0.1: with batches of 8 of `_learnable`'s trivially
# separable images, 0.1 diverges to a NaN loss in about one run in eight.
LEARNING_RATE = 0.03


def _records(labels, images):
  """CIFAR-10 binary records: labels [n], HWC uint8 images [n, 32, 32, 3]."""
  depth_major = np.transpose(images, [0, 3, 1, 2]).reshape(len(labels), -1)
  return np.concatenate([np.asarray(labels, np.uint8)[:, None],
                         depth_major.astype(np.uint8)], axis=1).tobytes()


def _learnable(n, rng):
  """Two classes told apart by colour, which survives every distortion."""
  labels = rng.randint(0, 2, n)
  palette = np.array([[220, 40, 40], [40, 40, 220]])
  noise = rng.randint(-30, 31, (n, 32, 32, 3))
  images = np.clip(palette[labels][:, None, None, :] + noise, 0, 255)
  return labels, images.astype(np.uint8)


def _write_cifar(data_dir, train_records=16, test_records=TEST_IMAGES,
                 seed=0):
  rng = np.random.RandomState(seed)
  batches = os.path.join(data_dir, cifar10_data.BATCHES_DIR)
  os.makedirs(batches, exist_ok=True)
  for name in cifar10_data.TRAIN_FILES:
    with open(os.path.join(batches, name), "wb") as f:
      f.write(_records(*_learnable(train_records, rng)))
  with open(os.path.join(batches, "test_batch.bin"), "wb") as f:
    f.write(_records(*_learnable(test_records, rng)))
  return batches


class _Messages(py_logging.Handler):
  """Collects the log messages of the script (absl's logger) and of the
  library (TensorFlow's), at INFO."""

  def __init__(self):
    super().__init__(py_logging.INFO)
    self.messages = []
    self._levels = {}

  def emit(self, record):
    self.messages.append(record.getMessage())

  def __enter__(self):
    for name in ("absl", "tensorflow"):
      logger = py_logging.getLogger(name)
      self._levels[logger] = logger.level
      logger.setLevel(py_logging.INFO)
      logger.addHandler(self)
    return self

  def __exit__(self, *exc):
    for logger, level in self._levels.items():
      logger.removeHandler(self)
      logger.setLevel(level)


def _logged_losses(messages):
  pattern = re.compile(r"^step (\d+), loss = ([0-9.]+) \(([0-9.]+) "
                       r"examples/sec; ([0-9.]+) sec/batch\)$")
  return [float(m.group(2)) for m in map(pattern.match, messages) if m]


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
  path = str(tmp_path_factory.mktemp("cifar10_data"))
  _write_cifar(path)
  return path


@pytest.fixture(scope="module")
def trained(data_dir, tmp_path_factory):
  """A 2-tower run of TRAIN_STEPS steps: its directory and logged losses."""
  train_dir = str(tmp_path_factory.mktemp("cifar10_train"))
  with _Messages() as log:
    step = cifar10_multi_gpu_train.train(
        data_dir=data_dir, train_dir=train_dir, num_gpus=NUM_TOWERS,
        batch_size=BATCH, max_steps=TRAIN_STEPS, log_frequency=1,
        save_summaries_steps=10, initial_learning_rate=LEARNING_RATE,
        urls=[OFFLINE_URL])
  return train_dir, step, log.messages


# The network.


def test_model_has_the_tutorials_1068298_parameters():
  with tf.Graph().as_default():
    cifar10_model.inference(tf.placeholder(tf.float32, [None, 24, 24, 3]))
    shapes = {v.op.name: v.shape.as_list() for v in tf.trainable_variables()}
  assert sum(int(np.prod(s)) for s in shapes.values()) == 1068298
  assert cifar10_model.NUM_PARAMETERS == 1068298
  assert shapes == {
      "conv1/weights": [5, 5, 3, 64], "conv1/biases": [64],
      "conv2/weights": [5, 5, 64, 64], "conv2/biases": [64],
      "local3/weights": [2304, 384], "local3/biases": [384],
      "local4/weights": [384, 192], "local4/biases": [192],
      "softmax_linear/weights": [192, 10], "softmax_linear/biases": [10]}


def test_model_takes_any_batch_size_from_its_input():
  with tf.Graph().as_default():
    images = tf.placeholder(tf.float32, [None, 24, 24, 3])
    logits, _ = cifar10_model.inference(images)
    with tf.Session() as sess:
      sess.run(tf.global_variables_initializer())
      for n in (1, 3):
        out = sess.run(logits, {images: np.zeros([n, 24, 24, 3])})
        assert out.shape == (n, 10)


def test_weight_decay_is_in_each_towers_loss_exactly_once():
  rng = np.random.RandomState(1)
  images = rng.randn(6, 24, 24, 3).astype(np.float32)
  labels = rng.randint(0, 10, 6).astype(np.int32)
  with tf.Graph().as_default() as g:
    tf.set_random_seed(0)
    t = towers.build_towers(cifar10_multi_gpu_train.tower_loss,
                            tf.train.GradientDescentOptimizer(0.1), 2,
                            inputs=(tf.constant(images), tf.constant(labels)),
                            devices=["/cpu:0", "/cpu:0"])
    with tf.variable_scope(tf.get_variable_scope(), reuse=True):
      single = cifar10_multi_gpu_train.tower_loss("", tf.constant(images),
                                                  tf.constant(labels))
    decay = g.get_tensor_by_name("tower_0/weight_decay:0")
    xents = [g.get_tensor_by_name("tower_%d/cross_entropy:0" % i)
             for i in range(2)]
    with tf.Session() as sess:
      sess.run(tf.global_variables_initializer())
      mean, one, losses, xent, wd = sess.run(
          [t.loss, single, t.losses, xents, decay])
  assert wd > 1.0  # 0.004 * l2 of local3's and local4's initial weights.
  # Each tower's loss is its own cross entropy plus the whole decay, so the
  # towers' mean is the single-device loss of the whole batch.
  np.testing.assert_allclose(np.subtract(losses, xent), [wd, wd], rtol=1e-5)
  np.testing.assert_allclose(mean, one, rtol=1e-5)


def test_summaries_tags_carry_no_tower_prefix():
  with tf.Graph().as_default(), tf.name_scope("tower_3"):
    cifar10_model.scalar_summary("total_loss", tf.constant(1.0))
    summary = tf.get_collection(tf.GraphKeys.SUMMARIES)[0]
    assert summary.name.startswith("tower_3/")
    with tf.Session() as sess:
      value = tf.Summary.FromString(sess.run(summary)).value[0]
  assert value.tag == "total_loss"


# The reader and the pipelines.


def test_reader_decodes_depth_major_records_and_crops_the_centre(tmp_path):
  rng = np.random.RandomState(2)
  images = rng.randint(0, 256, (3, 32, 32, 3)).astype(np.uint8)
  path = str(tmp_path / "test_batch.bin")
  with open(path, "wb") as f:
    f.write(_records([7, 0, 9], images))
  assert cifar10_data.check_file(path) == 3
  with tf.Graph().as_default():
    batch = tf.data.make_one_shot_iterator(cifar10_data.eval_dataset(
        [path], batch_size=2, num_examples=3)).get_next()
    got_images, got_labels = [], []
    with tf.Session() as sess:
      for _ in range(2):
        x, y = sess.run(batch)
        got_images.append(x)
        got_labels.append(y)
      with pytest.raises(tf.errors.OutOfRangeError):
        sess.run(batch)
  crop = images[:, 4:28, 4:28, :].astype(np.float64)
  flat = crop.reshape(3, -1)
  std = np.maximum(flat.std(1), 1 / np.sqrt(flat.shape[1]))
  want = (flat - flat.mean(1, keepdims=True)) / std[:, None]
  np.testing.assert_array_equal(np.concatenate(got_labels), [7, 0, 9])
  np.testing.assert_allclose(np.concatenate(got_images).reshape(3, -1), want,
                             rtol=1e-4, atol=1e-4)


def test_training_batches_are_standardized_24x24_crops(data_dir):
  paths = cifar10_data.data_files(data_dir, train=True)
  with tf.Graph().as_default():
    dataset = cifar10_data.train_dataset(paths, 5, num_records=80)
    images, labels = tf.data.make_one_shot_iterator(dataset).get_next()
    assert images.shape.as_list() == [5, 24, 24, 3]
    with tf.Session() as sess:
      x, y = sess.run([images, labels])
  # Per-image standardization: each image has mean 0 and deviation 1.
  np.testing.assert_allclose(x.reshape(5, -1).mean(1), 0, atol=1e-4)
  np.testing.assert_allclose(x.reshape(5, -1).std(1), 1, atol=1e-3)
  assert set(y) <= {0, 1}


# Corrupt and missing files.


def test_truncated_file_error_names_the_file_and_its_size(tmp_path):
  path = str(tmp_path / "data_batch_1.bin")
  with open(path, "wb") as f:
    f.write(_records([1, 2], np.zeros([2, 32, 32, 3], np.uint8))[:-100])
  with pytest.raises(cifar10_data.CorruptDataError,
                     match=r"data_batch_1\.bin is 6046 bytes, not a positive "
                     r"multiple of the 3073-byte"):
    cifar10_data.check_file(path)


def test_empty_file_is_corrupt(tmp_path):
  path = str(tmp_path / "test_batch.bin")
  open(path, "wb").close()
  with pytest.raises(cifar10_data.CorruptDataError, match="is 0 bytes"):
    cifar10_data.check_file(path)


def test_cifar100_sized_file_gets_a_hint(tmp_path):
  path = str(tmp_path / "train.bin")
  with open(path, "wb") as f:
    f.write(bytes(3074 * 3))
  with pytest.raises(cifar10_data.CorruptDataError, match="CIFAR-100"):
    cifar10_data.check_file(path)


def test_bad_label_error_names_the_file_and_record(tmp_path):
  path = str(tmp_path / "data_batch_2.bin")
  with open(path, "wb") as f:
    f.write(_records([3, 4, 12], np.zeros([3, 32, 32, 3], np.uint8)))
  with pytest.raises(cifar10_data.CorruptDataError,
                     match=r"data_batch_2\.bin: record 2 has label 12"):
    cifar10_data.check_file(path)


def test_training_on_a_corrupt_file_fails_before_building(tmp_path):
  batches = _write_cifar(str(tmp_path))
  path = os.path.join(batches, "data_batch_3.bin")
  with open(path, "ab") as f:
    f.write(b"\0" * 10)
  with pytest.raises(cifar10_data.CorruptDataError, match="data_batch_3.bin"):
    cifar10_multi_gpu_train.train(data_dir=str(tmp_path),
                                  train_dir=str(tmp_path / "train"),
                                  max_steps=1, urls=[OFFLINE_URL])
  assert not os.path.exists(tmp_path / "train")


def test_missing_batch_file_is_named(tmp_path):
  batches = _write_cifar(str(tmp_path))
  os.remove(os.path.join(batches, "data_batch_4.bin"))
  with pytest.raises(FileNotFoundError, match=r"data_batch_4\.bin is missing"):
    cifar10_data.data_files(str(tmp_path), train=True)


# Download and extraction, from loopback only.


def _summary_tags(train_dir):
  """Every summary tag in the event files of `train_dir`."""
  tags = set()
  for name in os.listdir(train_dir):
    if name.startswith("events.out.tfevents"):
      for event in tf.train.summary_iterator(os.path.join(train_dir, name)):
        tags.update(v.tag for v in event.summary.value)
  return tags


def _tarball(members):
  """A gzipped tar of {name: bytes}; None bytes make a symlink."""
  buf = io.BytesIO()
  with tarfile.open(fileobj=buf, mode="w:gz") as tar:
    for name, data in members.items():
      info = tarfile.TarInfo(name)
      if data is None:
        info.type, info.linkname = tarfile.SYMTYPE, "/etc/passwd"
        tar.addfile(info)
      else:
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
  return buf.getvalue()


def _cifar_tarball():
  rng = np.random.RandomState(3)
  names = cifar10_data.TRAIN_FILES + cifar10_data.TEST_FILES
  return _tarball({"cifar-10-batches-bin/" + n: _records(*_learnable(4, rng))
                   for n in names})


@pytest.fixture
def loopback_server(tmp_path):
  """Serves tmp_path/served over HTTP on 127.0.0.1; yields the base URL."""
  served = tmp_path / "served"
  served.mkdir()

  class Quiet(http.server.SimpleHTTPRequestHandler):

    def log_message(self, *args):
      pass

  server = http.server.HTTPServer(
      ("127.0.0.1", 0), functools.partial(Quiet, directory=str(served)))
  thread = threading.Thread(target=server.serve_forever, args=(0.05,),
                            daemon=True)
  thread.start()
  try:
    yield "http://127.0.0.1:%d/" % server.server_port, served
  finally:
    server.shutdown()
    server.server_close()


def test_offline_message_names_data_dir_and_fake_data(tmp_path):
  with pytest.raises(common.DownloadError) as e:
    cifar10_data.maybe_download_and_extract(str(tmp_path), [OFFLINE_URL])
  assert "--data_dir=%s" % tmp_path in str(e.value)
  assert "--fake_data" in str(e.value)
  assert not os.path.exists(tmp_path / cifar10_data.TARBALL)


def test_a_failed_download_leaves_no_directory_behind(tmp_path):
  with pytest.raises(common.DownloadError):
    cifar10_data.maybe_download_and_extract(str(tmp_path / "new" / "data"),
                                            [OFFLINE_URL])
  assert os.listdir(str(tmp_path)) == []  # Neither new/ nor new/data/.


def test_download_is_hash_checked_extracted_and_read(tmp_path,
                                                     loopback_server):
  url, served = loopback_server
  data = _cifar_tarball()
  (served / cifar10_data.TARBALL).write_bytes(data)
  data_dir = str(tmp_path / "data")
  batches = cifar10_data.maybe_download_and_extract(
      data_dir, [url + cifar10_data.TARBALL], hashlib.md5(data).hexdigest())
  assert batches == os.path.join(data_dir, cifar10_data.BATCHES_DIR)
  files = cifar10_data.data_files(data_dir, train=True)
  assert cifar10_data.check_files(files) == 20
  # Only the tarball (the cache) and the batches are left behind.
  assert sorted(os.listdir(data_dir)) == [cifar10_data.BATCHES_DIR,
                                          cifar10_data.TARBALL]


def test_download_with_a_wrong_md5_is_refused(tmp_path, loopback_server):
  url, served = loopback_server
  (served / cifar10_data.TARBALL).write_bytes(_cifar_tarball())
  with pytest.raises(common.DownloadError, match="MD5"):
    cifar10_data.maybe_download_and_extract(str(tmp_path / "data"),
                                            [url + cifar10_data.TARBALL])
  assert not os.path.exists(tmp_path / "data" / cifar10_data.TARBALL)


def test_cached_tarball_with_a_wrong_md5_is_reported_not_removed(tmp_path):
  (tmp_path / cifar10_data.TARBALL).write_bytes(_cifar_tarball())
  with pytest.raises(cifar10_data.CorruptDataError,
                     match="cifar-10-binary.tar.gz has MD5"):
    cifar10_data.maybe_download_and_extract(str(tmp_path), [OFFLINE_URL])
  assert os.path.exists(tmp_path / cifar10_data.TARBALL)


@pytest.mark.parametrize("member", ["../escaped.bin", "/tmp/absolute.bin",
                                    "cifar-10-batches-bin/link"])
def test_unsafe_tar_members_are_refused(tmp_path, member):
  members = {"cifar-10-batches-bin/test_batch.bin": bytes(3073)}
  members[member] = None if member.endswith("link") else b"x"
  data = _tarball(members)
  data_dir = tmp_path / "data"
  data_dir.mkdir()
  (data_dir / cifar10_data.TARBALL).write_bytes(data)
  with pytest.raises(cifar10_data.CorruptDataError, match=re.escape(member)):
    cifar10_data.maybe_download_and_extract(str(data_dir), [OFFLINE_URL],
                                            hashlib.md5(data).hexdigest())
  assert sorted(os.listdir(data_dir)) == [cifar10_data.TARBALL]
  assert not os.path.exists(tmp_path / "escaped.bin")


def test_truncated_tarball_names_the_tarball(tmp_path):
  data = _cifar_tarball()[:500]
  (tmp_path / cifar10_data.TARBALL).write_bytes(data)
  with pytest.raises(cifar10_data.CorruptDataError,
                     match="cannot extract .*cifar-10-binary.tar.gz"):
    cifar10_data.maybe_download_and_extract(str(tmp_path), [OFFLINE_URL],
                                            hashlib.md5(data).hexdigest())
  assert sorted(os.listdir(tmp_path)) == [cifar10_data.TARBALL]


# Training.


def test_training_on_two_virtual_cpu_towers_lowers_the_loss(trained):
  train_dir, step, messages = trained
  assert step == TRAIN_STEPS
  assert tf.train.load_variable(train_dir, "global_step") == TRAIN_STEPS
  assert any("2 towers x 8 examples = 16 examples per step" in m
             for m in messages)
  assert any("virtual CPU devices /cpu:0, /cpu:1" in m for m in messages)
  # The biases and softmax_linear's weights (7,680 bytes).
  assert any(m.startswith("--pack_bytes=16384: 6 of the 10 gradients are at "
                          "most 16384 bytes") for m in messages)
  losses = _logged_losses(messages)
  assert len(losses) == TRAIN_STEPS
  # The initial loss is the tutorial's ~4.68: cross entropy ln(10) plus
  # about 2.4 of weight decay.
  assert 4.3 < losses[0] < 5.1
  assert np.mean(losses[-5:]) < np.mean(losses[:5]) - 0.5


def test_summaries_have_the_final_towers_learning_rate_and_histograms(
    trained):
  train_dir, _, _ = trained
  tags = _summary_tags(train_dir)
  for tag in ["learning_rate", "loss", "total_loss", "cross_entropy",
              "weight_decay", "conv1/activations", "local3/sparsity",
              "conv1/weights", "conv1/weights/gradients"]:
    assert tag in tags
  assert not [t for t in tags if re.search(r"_\d+$", t)]
  assert not [t for t in tags if t.startswith("tower_")]


def test_training_resumes_from_the_train_dir(trained, data_dir, tmp_path):
  train_dir = str(tmp_path / "train")
  shutil.copytree(trained[0], train_dir)
  with _Messages() as log:
    step = cifar10_multi_gpu_train.train(
        data_dir=data_dir, train_dir=train_dir, num_gpus=NUM_TOWERS,
        batch_size=BATCH, max_steps=TRAIN_STEPS + 3, log_frequency=1,
        initial_learning_rate=LEARNING_RATE, urls=[OFFLINE_URL])
  assert step == TRAIN_STEPS + 3
  steps = [m.split(",")[0] for m in log.messages if m.startswith("step ")]
  assert steps == ["step %d" % s for s in range(TRAIN_STEPS + 1,
                                                TRAIN_STEPS + 4)]
  assert tf.train.load_variable(train_dir, "global_step") == TRAIN_STEPS + 3


def test_fake_data_needs_no_files_and_a_nan_loss_stops_training(tmp_path):
  with pytest.raises(FloatingPointError, match="loss is NaN at step"):
    cifar10_multi_gpu_train.train(
        data_dir=str(tmp_path / "absent"), train_dir=str(tmp_path / "train"),
        num_gpus=NUM_TOWERS, batch_size=4, max_steps=50, fake_data=True,
        initial_learning_rate=1e4, log_frequency=1)
  assert not os.path.exists(tmp_path / "absent")


def _train(data_dir, train_dir, max_steps, **kwargs):
  return cifar10_multi_gpu_train.train(
      data_dir=data_dir, train_dir=train_dir, num_gpus=NUM_TOWERS,
      batch_size=BATCH, max_steps=max_steps,
      initial_learning_rate=LEARNING_RATE, urls=[OFFLINE_URL], **kwargs)


@pytest.mark.parametrize("args,words", [
    (dict(batch_size=-4), "--batch_size=-4 must be >= 1"),
    (dict(num_gpus=0), "--num_gpus=0 must be >= 1"),
    (dict(save_checkpoint_steps=0), "--save_checkpoint_steps=0 must be"),
    (dict(pack_bytes=-1), "--pack_bytes=-1 must be >= 0"),
])
def test_train_refuses_bad_arguments_naming_the_flag(tmp_path, args, words):
  with pytest.raises(common.FlagError, match=re.escape(words)):
    cifar10_multi_gpu_train.train(
        data_dir=str(tmp_path / "data"), train_dir=str(tmp_path / "train"),
        fake_data=True, max_steps=5, **args)
  assert os.listdir(str(tmp_path)) == []


@pytest.mark.parametrize("args,want", [
    (dict(), common.DEFAULT_PACK_BYTES), (dict(pack_bytes=0), 0),
    (dict(pack_bytes=512, variable_device="balanced"), 512)])
def test_train_passes_pack_bytes_to_towers_minimize(tmp_path, monkeypatch,
                                                    args, want):
  seen = spy_on_minimize(monkeypatch)
  with pytest.raises(MinimizeCalled):
    cifar10_multi_gpu_train.train(
        data_dir=str(tmp_path / "data"), train_dir=str(tmp_path / "train"),
        num_gpus=NUM_TOWERS, fake_data=True, max_steps=1, **args)
  assert seen == [want]


def test_accumulated_micro_batches_move_the_averages_once_per_update(
    data_dir, tmp_path):
  with tf.Graph().as_default():
    g = cifar10_multi_gpu_train.build_train_graph(
        devices=["/cpu:0", "/cpu:1"], batch_size=2, train_files=None,
        examples_per_epoch=1000, accumulate_steps=2)
    weights = [v for v in tf.trainable_variables()
               if v.op.name == "local3/weights"][0]
    average = [v for v in tf.global_variables() if v.op.name ==
               "local3/weights/ExponentialMovingAverage"][0]
    with tf.Session(config=towers.virtual_cpu_config(2)) as sess:
      sess.run(tf.global_variables_initializer())
      sess.run(tf.local_variables_initializer())
      start = sess.run(average)
      sess.run(g.train_op)  # A micro-batch: nothing moves.
      np.testing.assert_array_equal(sess.run(average), start)
      np.testing.assert_array_equal(sess.run(weights), start)
      sess.run(g.train_op)  # The update, and one step of the averages.
      assert sess.run(g.global_step) == 1
      assert float(np.max(np.abs(sess.run(average) - start))) > 0
  # The trainer and the evaluator, end to end.
  train_dir = str(tmp_path / "train")
  assert _train(data_dir, train_dir, 2, accumulate_steps=2) == 2
  g = cifar10_eval.build_eval_graph(
      cifar10_data.data_files(data_dir, train=False), TEST_IMAGES, BATCH)
  result = cifar10_eval.evaluate_checkpoint(
      g, tf.train.latest_checkpoint(train_dir))
  assert (result.count, result.global_step) == (TEST_IMAGES, 2)


def test_learning_rate_falls_tenfold_every_350_epochs_of_examples():
  with tf.Graph().as_default():
    step = tf.placeholder(tf.int64, [])
    lr = cifar10_multi_gpu_train.learning_rate(step, 2 * 128, 50000)
    with tf.Session() as sess:
      rates = {s: sess.run(lr, {step: s})
               for s in [0, 68359, 68360, 136718, 136719]}
  # 350 epochs are 17,500,000 examples: step 68,360 with 2 x 128 per step
  # (counting steps of one GPU's batch would wait for step 136,719).
  np.testing.assert_allclose(
      [rates[s] for s in sorted(rates)], [0.1, 0.1, 0.01, 0.01, 0.001],
      rtol=1e-6)


def test_pipelines_run_without_tf_datas_autotuning_thread(data_dir):
  # A closing session waits for that thread to wake, up to a minute after
  # a long run (common.without_autotune).
  train = cifar10_data.data_files(data_dir, train=True)
  test = cifar10_data.data_files(data_dir, train=False)
  assert autotune_off(lambda: cifar10_data.train_dataset(train, BATCH, 16))
  assert autotune_off(lambda: cifar10_data.fake_train_dataset(BATCH))
  assert autotune_off(lambda: cifar10_data.eval_dataset(test, BATCH,
                                                        TEST_IMAGES))


def test_input_stays_on_the_cpu_and_each_tower_on_its_device():
  with tf.Graph().as_default() as g:
    cifar10_multi_gpu_train.build_train_graph(
        devices=["/gpu:0", "/gpu:1"], batch_size=4, train_files=None,
        examples_per_epoch=50000)
    ops = {op.name: op.device for op in g.get_operations()}
  assert ops["tower_1/conv1/Conv2D"] == "/device:GPU:1"
  assert ops["tower_0/local3/MatMul"] == "/device:GPU:0"
  for name, device in ops.items():
    if (name.startswith("tower_") and "IteratorGetNext" in name
        or name.endswith("ExponentialMovingAverage")
        or name in ("conv1/weights", "global_step", "decayed_learning_rate")):
      assert device == "/device:CPU:0", name


def test_replicated_copies_keep_their_updates_and_averages_on_their_tower():
  with tf.Graph().as_default() as g:
    cifar10_multi_gpu_train.build_train_graph(
        devices=["/gpu:0", "/gpu:1"], batch_size=4, train_files=None,
        examples_per_epoch=50000, variable_device="replicated",
        all_reduce="ring")
    ops = {op.name: op.device for op in g.get_operations()}
    trainable = [v.op.name for v in tf.trainable_variables()]
  # The graph is built under the tutorial's tf.device("/cpu:0"): the copies,
  # their updates and copy 0's moving average stay on their towers anyway.
  assert ops["conv1/weights"] == "/device:GPU:0"
  assert ops["replica_1/conv1/weights"] == "/device:GPU:1"
  assert ops["GradientDescent/update_replica_1/conv1/weights/"
             "ResourceApplyGradientDescent"] == "/device:GPU:1"
  assert ops["conv1/weights/ExponentialMovingAverage"] == "/device:GPU:0"
  for name in ("tower_1/IteratorGetNext", "global_step",
               "decayed_learning_rate"):
    assert ops[name] == "/device:CPU:0", name
  # Copy 0 alone is trainable, so alone averaged (and saved).
  assert len(trainable) == 10 and not [n for n in trainable if "replica_" in n]
  assert not [n for n in ops if n.startswith("replica_")
              and "ExponentialMovingAverage" in n]


def test_replicated_checkpoints_are_evaluated_and_resumed_as_one_copy(
    trained, data_dir, tmp_path, op_timeout):
  del op_timeout  # Used for its effect.
  train_dir = str(tmp_path / "train")
  with _Messages() as log:
    assert _train(data_dir, train_dir, 3, log_frequency=1,
                  save_summaries_steps=2, variable_device="replicated",
                  all_reduce="collective") == 3
  assert len(_logged_losses(log.messages)) == 3
  assert any("summed by the 'collective' all-reduce" in m
             for m in log.messages)
  # The one-copy run's names: copy 0, its moving average, the step.
  path = tf.train.latest_checkpoint(train_dir)
  names = sorted(n for n, _ in tf.train.list_variables(path))
  assert names == sorted(n for n, _ in tf.train.list_variables(
      tf.train.latest_checkpoint(trained[0])))
  tags = _summary_tags(train_dir)
  assert {"conv1/weights", "conv1/weights/gradients", "total_loss"} <= tags
  assert not [t for t in tags if t.startswith(("replica_", "tower_"))]
  # cifar10_eval restores the moving averages of copy 0.
  g = cifar10_eval.build_eval_graph(
      cifar10_data.data_files(data_dir, train=False), TEST_IMAGES, BATCH)
  with g.graph.as_default():
    weights = [v for v in tf.trainable_variables()
               if v.op.name == "local3/weights"]
  with tf.Session(graph=g.graph) as sess:
    g.saver.restore(sess, path)
    np.testing.assert_array_equal(sess.run(weights[0]), tf.train.load_variable(
        path, "local3/weights/ExponentialMovingAverage"))
  result = cifar10_eval.evaluate_checkpoint(g, path)
  assert (result.count, result.global_step) == (TEST_IMAGES, 3)
  # And the one-copy mode resumes from it.
  assert _train(data_dir, train_dir, 4) == 4


# The fast paths: --use_fp16, --xla, --stage_inputs.


def test_use_fp16_saves_float32_weights_and_averages_for_eval(
    trained, data_dir, tmp_path):
  train_dir = str(tmp_path / "train")
  with _Messages() as log:
    assert _train(data_dir, train_dir, 3, log_frequency=1,
                  save_summaries_steps=3, use_fp16=True) == 3
  assert any(m.startswith("--use_fp16: the towers compute in float16 on "
                          "float32 master weights") for m in log.messages)
  steps = [m for m in log.messages if m.startswith("step ")]
  assert len(steps) == 3
  # Dynamic loss scaling starts at 2**15; no step of these overflows.
  assert all(m.endswith(", loss scale = 32768") for m in steps), steps
  losses = [float(m.split("loss = ")[1].split()[0]) for m in steps]
  assert all(np.isfinite(losses)) and 4.3 < losses[0] < 5.1
  tags = _summary_tags(train_dir)
  assert {"loss_scale", "total_loss", "conv1/activations"} <= tags
  # The float32 run's variables and moving averages, all float32, and the
  # loss scale.
  path = tf.train.latest_checkpoint(train_dir)
  names = [n for n, _ in tf.train.list_variables(path)]
  assert sorted(names) == sorted(
      [n for n, _ in tf.train.list_variables(
          tf.train.latest_checkpoint(trained[0]))]
      + ["loss_scale", "loss_scale_good_steps"])
  for name in names:
    if name != "global_step":
      assert tf.train.load_variable(path, name).dtype == np.float32, name
  # cifar10_eval, in float32, restores the averages as they are.
  g = cifar10_eval.build_eval_graph(
      cifar10_data.data_files(data_dir, train=False), TEST_IMAGES, BATCH)
  result = cifar10_eval.evaluate_checkpoint(g, path)
  assert (result.count, result.global_step) == (TEST_IMAGES, 3)


def test_stage_inputs_trains_to_max_steps(data_dir, tmp_path):
  train_dir = str(tmp_path / "train")
  with _Messages() as log:
    assert _train(data_dir, train_dir, 3, log_frequency=1,
                  stage_inputs=True) == 3
  assert any(m.startswith("--stage_inputs: each tower's batches are read "
                          "ahead") for m in log.messages)
  assert len(_logged_losses(log.messages)) == 3
  assert tf.train.load_variable(train_dir, "global_step") == 3


def test_xla_compiles_each_towers_network_and_gradient():
  with tf.Graph().as_default() as g:
    cifar10_multi_gpu_train.build_train_graph(
        devices=["/cpu:0", "/cpu:1"], batch_size=4, train_files=None,
        examples_per_epoch=50000, xla=True)

    def compiled(op):
      try:
        return op.get_attr("_XlaCompile")
      except ValueError:
        return False

    names = {op.name for op in g.get_operations() if compiled(op)}
  for i in range(NUM_TOWERS):
    for name in ["conv1/Conv2D", "norm1", "local4/MatMul",
                 "gradients/tower_%d/conv2/Conv2D_grad/Conv2DBackpropInput"
                 % i]:
      assert "tower_%d/%s" % (i, name) in names
  # Not the averaging, the update or the moving averages.
  assert not [n for n in names if not n.startswith("tower_")
              and not n.startswith(("conv", "local", "softmax_linear"))]
  assert not [n for n in names if "ExponentialMovingAverage" in n]


# Evaluation.


def test_eval_restores_the_moving_averages_not_the_raw_weights(trained,
                                                               data_dir):
  train_dir, _, _ = trained
  path = tf.train.latest_checkpoint(train_dir)
  g = cifar10_eval.build_eval_graph(
      cifar10_data.data_files(data_dir, train=False), TEST_IMAGES, BATCH)
  with g.graph.as_default():
    variables = tf.trainable_variables()
  with tf.Session(graph=g.graph) as sess:
    g.saver.restore(sess, path)
    values = sess.run(variables)
  assert len(variables) == 10
  for var, value in zip(variables, values):
    name = var.op.name
    shadow = tf.train.load_variable(path, name + "/ExponentialMovingAverage")
    raw = tf.train.load_variable(path, name)
    np.testing.assert_array_equal(value, shadow, err_msg=name)
    if name.endswith("weights"):
      assert not np.allclose(value, raw), name
  # The averages moved with the steps: a bias that starts at 0.1 everywhere
  # no longer has an average of 0.1.
  shadow = tf.train.load_variable(path, "conv2/biases/ExponentialMovingAverage")
  assert not np.allclose(shadow, 0.1)


def test_eval_counts_each_test_image_exactly_once(trained, data_dir):
  path = tf.train.latest_checkpoint(trained[0])
  files = cifar10_data.data_files(data_dir, train=False)
  for num_examples in (TEST_IMAGES, 30):
    g = cifar10_eval.build_eval_graph(files, num_examples, BATCH)
    result = cifar10_eval.evaluate_checkpoint(g, path)
    assert result.count == num_examples
    assert result.global_step == TRAIN_STEPS
    assert result.precision == result.correct / result.count


def test_eval_run_once_logs_and_writes_precision(trained, data_dir,
                                                 tmp_path):
  eval_dir = str(tmp_path / "eval")
  with _Messages() as log:
    precision = cifar10_eval.evaluate(
        data_dir=data_dir, checkpoint_dir=trained[0], eval_dir=eval_dir,
        batch_size=BATCH, run_once=True, urls=[OFFLINE_URL])
  line = [m for m in log.messages if "precision @ 1" in m]
  assert line == ["step %d: precision @ 1 = %.4f (%d of %d test images)"
                  % (TRAIN_STEPS, precision, round(precision * TEST_IMAGES),
                     TEST_IMAGES)]
  # Two classes told apart by colour: the averaged weights have learned it.
  assert precision > 0.5
  events = [os.path.join(eval_dir, n) for n in os.listdir(eval_dir)]
  values = [v for e in events for ev in tf.train.summary_iterator(e)
            for v in ev.summary.value if v.tag == "precision @ 1"]
  assert values and abs(values[0].simple_value - precision) < 1e-6


def test_eval_without_a_checkpoint_says_train_first(data_dir, tmp_path):
  with pytest.raises(FileNotFoundError, match="train first"):
    cifar10_eval.evaluate(data_dir=data_dir,
                          checkpoint_dir=str(tmp_path / "none"),
                          eval_dir=str(tmp_path / "eval"), run_once=True,
                          urls=[OFFLINE_URL])
  assert not os.path.exists(tmp_path / "eval")  # No event writer yet.
