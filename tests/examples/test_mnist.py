"""The MNIST example: IDX reader, input pipeline, train, eval and resume.

Tiny synthetic data sets are written as real IDX files (gzipped or raw), so
the reader the scripts use is the one under test; one end-to-end run uses the
real MNIST files when they are present. Downloads only ever go to loopback.
"""

import ast
import collections
import functools
import glob
import gzip
import http.server
import inspect
import os
import re
import shutil
import signal
import struct
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import tensorflow.compat.v1 as tf

import common
import mnist_data
import mnist_eval
import mnist_multi_gpu_train as mnist_train
import towers
from towers import _tf_versions
from towers import training

EXAMPLES = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..",
                                        "examples"))
# Nothing listens on the discard port: a download fails at once, offline.
OFFLINE = ["http://127.0.0.1:9/"]
NUM_TRAIN, NUM_TEST = 64, 20
LOG_LINE = re.compile(r"step (\d+), loss = \d+\.\d\d \(\d+\.\d "
                      r"examples/sec; \d+\.\d\d\d sec/batch\)")


def idx_bytes(array: np.ndarray) -> bytes:
  """Encodes a uint8 array as IDX: magic 0x0000080N, dims, data."""
  header = struct.pack(">I", 0x800 + array.ndim)
  header += struct.pack(">%dI" % array.ndim, *array.shape)
  return header + array.astype(np.uint8).tobytes()


def write_file(path, data: bytes, compress: bool) -> str:
  if compress:
    path += ".gz"
    with gzip.open(path, "wb") as f:
      f.write(data)
  else:
    with open(path, "wb") as f:
      f.write(data)
  return path


def write_split(directory, split, images, labels, compress=True):
  """Writes one split's two IDX files; returns their paths."""
  os.makedirs(directory, exist_ok=True)
  names = mnist_data.SPLITS[split]
  return [write_file(os.path.join(str(directory), name), idx_bytes(a),
                     compress)
          for name, a in zip(names, (images, labels))]


def synthetic(count, seed):
  """Images with a bright bar at a row that depends on the label."""
  rng = np.random.RandomState(seed)
  labels = rng.randint(0, 10, count).astype(np.uint8)
  images = rng.randint(0, 40, (count, 28, 28)).astype(np.uint8)
  for image, label in zip(images, labels):
    image[2 + 2 * label:4 + 2 * label, 4:24] = 255
  return images, labels


@pytest.fixture
def tiny_mnist(tmp_path):
  """A directory with a 64-example train split and a 20-example test split."""
  directory = tmp_path / "data"
  write_split(directory, "train", *synthetic(NUM_TRAIN, 0))
  write_split(directory, "test", *synthetic(NUM_TEST, 1), compress=False)
  return str(directory)



def checkpoint_step(directory):
  path = tf.train.latest_checkpoint(directory)
  return None if path is None else int(path.rsplit("-", 1)[1])


def summary_tags(directory):
  tags = set()
  for path in glob.glob(os.path.join(directory, "events.out.tfevents.*")):
    for event in tf.train.summary_iterator(path):
      tags.update(v.tag for v in event.summary.value)
  return tags


# The reader.


@pytest.mark.parametrize("compress", [True, False], ids=["gzip", "raw"])
def test_reader_checks_and_reads_gzipped_and_raw_files(tmp_path, compress):
  images, labels = synthetic(12, 0)
  write_split(tmp_path, "test", images, labels, compress=compress)
  got_images, got_labels = mnist_data.find_split(str(tmp_path), "test",
                                                 mirrors=())
  assert (got_images.count, got_labels.count) == (12, 12)
  assert got_images.compressed == got_labels.compressed == compress
  with tf.Graph().as_default():
    ds = mnist_data.eval_dataset(got_images, got_labels, batch_size=5)
    x, y = tf.data.make_one_shot_iterator(ds).get_next()
    batches = []
    with tf.Session() as sess:
      while True:
        try:
          batches.append(sess.run([x, y]))
        except tf.errors.OutOfRangeError:
          break
  assert [len(b[1]) for b in batches] == [5, 5, 2]  # Once, partial last.
  np.testing.assert_array_equal(np.concatenate([b[1] for b in batches]),
                                labels)
  pixels = np.concatenate([b[0] for b in batches])[..., 0]
  np.testing.assert_allclose(pixels, images / 255.0 - 0.5, atol=1e-6)


def test_train_and_eval_pipelines_scale_pixels_alike(tmp_path):
  ramp = np.tile(np.arange(28 * 28) % 256, (16, 1)).reshape(16, 28, 28)
  write_split(tmp_path, "train", ramp, np.arange(16) % 10)
  write_split(tmp_path, "test", ramp, np.arange(16) % 10)
  train = mnist_data.find_split(str(tmp_path), "train", mirrors=())
  test = mnist_data.find_split(str(tmp_path), "test", mirrors=())
  with tf.Graph().as_default():
    train_x, _ = tf.data.make_one_shot_iterator(
        mnist_data.train_dataset(*train, batch_size=4, seed=1)).get_next()
    test_x, _ = tf.data.make_one_shot_iterator(
        mnist_data.eval_dataset(*test, batch_size=4)).get_next()
    assert train_x.shape.as_list() == [4, 28, 28, 1]  # Static per tower.
    with tf.Session() as sess:
      got_train, got_test = sess.run([train_x, test_x])
  want = ramp[:4, :, :, None] / 255.0 - 0.5
  np.testing.assert_allclose(got_train, want, atol=1e-6)
  np.testing.assert_allclose(got_test, want, atol=1e-6)
  assert got_train.min() == -0.5 and got_train.max() == 0.5


def autotune_off(make_dataset):
  """Whether the pipeline `make_dataset()` builds has tf.data's autotuning
  model off, in what the runtime reads: its graph's options, or (TensorFlow
  1.15) its iterator's ops."""
  try:
    from tensorflow.core.framework import dataset_options_pb2
  except ImportError:  # TensorFlow 1.15: the model is a ModelDataset op.
    return _no_model_dataset(make_dataset)
  with tf.Graph().as_default() as g:
    make_dataset()
  options = [dataset_options_pb2.Options.FromString(
      op.get_attr("serialized_options")).autotune_options
             for op in g.get_operations() if op.type == "OptionsDataset"]
  return bool(options) and all(o.HasField("enabled") and not o.enabled
                               for o in options)


def _no_model_dataset(make_dataset):
  """Whether an iterator on `make_dataset()` has no autotuning model, which
  TensorFlow 1.15 adds as a ModelDataset op when the iterator is made."""
  with tf.Graph().as_default() as g:
    tf.data.make_initializable_iterator(make_dataset())
  return not [op for op in g.get_operations() if op.type == "ModelDataset"]


def test_pipelines_run_without_tf_datas_autotuning_thread(tiny_mnist):
  # A closing session waits for that thread to wake, up to a minute after
  # a long run (common.without_autotune).
  train = mnist_data.find_split(tiny_mnist, "train", mirrors=())
  test = mnist_data.find_split(tiny_mnist, "test", mirrors=())
  assert autotune_off(lambda: mnist_data.train_dataset(*train, batch_size=4))
  assert autotune_off(lambda: mnist_data.eval_dataset(*test, batch_size=4))
  assert autotune_off(lambda: mnist_data.fake_dataset(batch_size=4))
  assert not autotune_off(lambda: tf.data.Dataset.range(3).prefetch(1))


def _corrupt(directory, case):
  """Writes a test split broken as `case`; returns the broken file's name."""
  images, labels = synthetic(10, 0)
  images_path, labels_path = write_split(directory, "test", images, labels)
  raw = idx_bytes(images)
  if case == "bad_magic":
    write_file(images_path[:-3], b"\x12\x34\x56\x78" + raw[4:], True)
  elif case == "labels_named_as_images":
    write_file(images_path[:-3], idx_bytes(labels), True)
  elif case == "wrong_image_size":
    write_file(images_path[:-3], idx_bytes(np.zeros((10, 32, 32))), True)
  elif case == "truncated_raw":
    os.remove(images_path)
    return os.path.basename(write_file(images_path[:-3], raw[:-100], False))
  elif case == "trailing_bytes":
    write_file(images_path[:-3], raw + b"\0" * 7, True)
  elif case == "huge_count_in_header":
    write_file(images_path[:-3], raw[:4] + struct.pack(">I", 2**31 - 1)
               + raw[8:], True)
  elif case == "truncated_gzip":
    with open(images_path, "rb") as f:
      data = f.read()
    with open(images_path, "wb") as f:
      f.write(data[:len(data) // 2])
  elif case == "not_gzip_inside":
    with open(images_path, "wb") as f:
      f.write(b"\x1f\x8b" + b"garbage" * 20)
  elif case == "short_header":
    write_file(images_path[:-3], raw[:9], True)
  elif case == "label_out_of_range":
    write_file(labels_path[:-3], idx_bytes(np.full(10, 11)), True)
    return os.path.basename(labels_path)
  elif case == "count_mismatch":
    write_file(labels_path[:-3], idx_bytes(labels[:9]), True)
  return os.path.basename(images_path)


@pytest.mark.parametrize("case,words", [
    ("bad_magic", "bad magic number"),
    ("labels_named_as_images", "labels file"),
    ("wrong_image_size", "32x32"),
    ("truncated_raw", "truncated"),
    ("trailing_bytes", "wrong size"),
    ("huge_count_in_header", "2147483647 images"),
    ("truncated_gzip", "not a valid gzip file"),
    ("not_gzip_inside", "not a valid gzip file"),
    ("short_header", "fewer than an IDX images header"),
    ("label_out_of_range", "label 11"),
    ("count_mismatch", "10 images but"),
])
def test_corrupt_files_get_an_error_naming_them(tmp_path, case, words):
  name = _corrupt(str(tmp_path), case)
  with pytest.raises(mnist_data.IdxError, match=words) as error:
    mnist_data.find_split(str(tmp_path), "test", mirrors=())
  assert name in str(error.value)


# Downloads: loopback only.


def test_offline_the_error_says_what_to_do(tmp_path):
  with pytest.raises(mnist_data.MissingDataError) as error:
    mnist_data.find_split(str(tmp_path), "train", mirrors=OFFLINE)
  message = str(error.value)
  for words in ["train-images-idx3-ubyte", str(tmp_path), "--data_dir",
                "--fake_data", "--dataset=fashion_mnist",
                "dataset-fashion-mnist", "127.0.0.1:9"]:
    assert words in message
  assert os.listdir(str(tmp_path)) == []  # No partial file left behind.


def test_a_failed_download_leaves_no_directory_behind(tmp_path):
  data_dir = tmp_path / "new" / "mnist"
  with pytest.raises(mnist_data.MissingDataError):
    mnist_data.find_split(str(data_dir), "train", mirrors=OFFLINE)
  assert os.listdir(str(tmp_path)) == []  # Neither new/ nor new/mnist/.


def test_fashion_mnist_is_read_from_disk_only(tmp_path):
  with pytest.raises(mnist_data.MissingDataError,
                     match="apt-get install dataset-fashion-mnist"):
    mnist_data.find_split(str(tmp_path), "test", "fashion_mnist",
                          mirrors=OFFLINE)
  assert mnist_data.default_data_dir("fashion_mnist") == (
      "/usr/share/datasets/fashion-mnist")


@pytest.fixture
def loopback_server(tmp_path):
  """Serves a directory over HTTP on 127.0.0.1; yields (url, directory)."""
  root = tmp_path / "mirror"
  root.mkdir()
  handler = functools.partial(http.server.SimpleHTTPRequestHandler,
                              directory=str(root))
  handler.log_message = lambda *args: None
  server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
  thread = threading.Thread(target=server.serve_forever, daemon=True)
  thread.start()
  try:
    yield "http://127.0.0.1:%d/" % server.server_address[1], root
  finally:
    server.shutdown()
    server.server_close()


def test_download_is_hash_checked_and_cached(tmp_path, mnist_dir,
                                             loopback_server):
  url, root = loopback_server
  for name in mnist_data.SPLITS["test"]:
    shutil.copy(os.path.join(mnist_dir, name + ".gz"), str(root))
  data_dir = str(tmp_path / "cache")
  images, labels = mnist_data.find_split(data_dir, "test",
                                         mirrors=OFFLINE + [url])
  assert (images.count, labels.count) == (10000, 10000)
  assert sorted(os.listdir(data_dir)) == sorted(
      n + ".gz" for n in mnist_data.SPLITS["test"])
  # Cached: no mirror needed the second time.
  assert mnist_data.find_split(data_dir, "test", mirrors=())[0].count == 10000


def test_download_with_a_wrong_hash_is_refused(tmp_path, loopback_server):
  url, root = loopback_server
  images, labels = synthetic(10, 0)
  write_split(str(root), "test", images, labels)  # Valid IDX, wrong hash.
  data_dir = str(tmp_path / "cache")
  with pytest.raises(mnist_data.MissingDataError, match="SHA-256"):
    mnist_data.find_split(data_dir, "test", mirrors=[url])
  assert not os.path.exists(data_dir) or os.listdir(data_dir) == []


# The training graph.


def _build(data_dir, num_towers, batch_size=4, **kwargs):
  files = mnist_data.find_split(data_dir, "train", mirrors=())
  args = dict(learning_rate=0.1, momentum=0.9, learning_rate_decay=0.5,
              epochs_per_decay=1.0, weight_decay=5e-4, dropout_rate=0.5)
  args.update(kwargs)
  return mnist_train.build_train_graph(
      devices=["/cpu:%d" % i for i in range(num_towers)],
      batch_size=batch_size, train_files=files,
      num_examples=files[0].count, **args)


def test_towers_share_one_input_pipeline_on_the_cpu(tiny_mnist):
  with tf.Graph().as_default() as g:
    _build(tiny_mnist, num_towers=2)
    ops = g.get_operations()
    iterators = [op for op in ops if op.type in ("OneShotIterator",
                                                 "IteratorV2", "Iterator")]
    dequeues = [op for op in ops if op.type == "IteratorGetNext"]
    assert len(iterators) == 1
    assert sorted(op.name for op in dequeues) == [
        "tower_0/IteratorGetNext", "tower_1/IteratorGetNext"]
    for op in iterators + dequeues:
      assert tf.DeviceSpec.from_string(op.device).device_type == "CPU"
      assert tf.DeviceSpec.from_string(op.device).device_index == 0
    conv = g.get_operation_by_name("tower_1/conv1/Conv2D")
    assert tf.DeviceSpec.from_string(conv.device).device_index == 1
    names = sorted(v.op.name for v in tf.trainable_variables())
    assert names == sorted(
        "%s/%s" % (layer, kind)
        for layer in ["conv1", "conv2", "local3", "softmax_linear"]
        for kind in ["weights", "biases"])


def test_each_tower_takes_its_own_batch_and_an_epoch_is_shared(tmp_path):
  # Pixel (0, 0) holds the example's index: 64 examples, 2 towers of 4.
  images = np.zeros((NUM_TRAIN, 28, 28), np.uint8)
  images[:, 0, 0] = np.arange(NUM_TRAIN)
  write_split(tmp_path, "train", images, np.arange(NUM_TRAIN) % 10)
  with tf.Graph().as_default() as g:
    graph = _build(str(tmp_path), num_towers=2)
    batches = [g.get_tensor_by_name("tower_%d/IteratorGetNext:0" % i)
               for i in range(2)]
    seen = []
    with tf.Session(graph=g, config=tf.ConfigProto(
        device_count={"CPU": 2})) as sess:
      sess.run(tf.global_variables_initializer())
      for _ in range(NUM_TRAIN // 8):
        _, tower0, tower1 = sess.run([graph.train_op] + batches)
        seen.append((tower0[:, 0, 0, 0], tower1[:, 0, 0, 0]))

  def index(pixels):
    return np.rint((pixels + 0.5) * 255).astype(int)

  for tower0, tower1 in seen:
    assert not set(index(tower0)) & set(index(tower1))
  # One epoch in 64 / (4 x 2) steps: every example exactly once.
  assert sorted(i for pair in seen for t in pair for i in index(t)) == list(
      range(NUM_TRAIN))


@pytest.mark.parametrize("num_towers", [1, 2])
def test_learning_rate_decays_per_epoch_of_examples(tiny_mnist, num_towers):
  # 64 examples, 4 per tower: an epoch is 16 steps on one tower, 8 on two.
  steps_per_epoch = NUM_TRAIN // (4 * num_towers)
  with tf.Graph().as_default() as g:
    graph = _build(tiny_mnist, num_towers)
    with tf.Session(graph=g, config=tf.ConfigProto(
        device_count={"CPU": num_towers})) as sess:
      rates = []
      for step in [0, steps_per_epoch - 1, steps_per_epoch,
                   3 * steps_per_epoch]:
        sess.run(graph.global_step.assign(step))
        rates.append(sess.run(graph.learning_rate))
  np.testing.assert_allclose(rates, [0.1, 0.1, 0.05, 0.0125], rtol=1e-6)


# train(...) and evaluate(...).


def test_train_then_evaluate_on_idx_files(tiny_mnist, tmp_path, logs):
  train_dir = str(tmp_path / "train")
  step = mnist_train.train(train_dir=train_dir, data_dir=tiny_mnist,
                           num_gpus=2, batch_size=4, max_steps=6,
                           log_frequency=2, save_checkpoint_secs=3600,
                           save_summaries_steps=3, mirrors=(), seed=0)
  assert step == 6
  assert checkpoint_step(train_dir) == 6  # The final step is saved.
  lines = logs()
  assert any("virtual CPU devices" in m for m in lines)
  # The global batch, and the epochs --max_steps means (6 x 8 of 64).
  assert "2 towers x 4 examples = 8 examples per step; --max_steps=6 is 0.8 " \
      "epochs of 64 examples" in lines
  assert [int(LOG_LINE.search(m).group(1)) for m in lines
          if LOG_LINE.search(m)] == [2, 4, 6]
  tags = summary_tags(train_dir)
  for tag in ["learning_rate", "loss", "tower_1/losses/cross_entropy",
              "tower_1/losses/weight_decay", "conv1/weights/gradients"]:
    assert tag in tags
  # The variable's histogram (its tag may be uniquified as conv1/weights_1).
  assert any(re.fullmatch(r"conv1/weights(_\d+)?", t) for t in tags)
  assert not any(t.startswith("tower_0/") for t in tags)  # Final tower's.

  result = mnist_eval.evaluate(checkpoint_dir=train_dir, data_dir=tiny_mnist,
                               batch_size=8, run_once=True, mirrors=())
  assert result.num_examples == NUM_TEST  # 8 + 8 + 4: each image once.
  assert result.global_step == 6
  assert 0.0 <= result.precision <= 1.0
  assert result.precision == result.num_correct / NUM_TEST
  assert any(re.search(r"precision @ 1 = [01]\.\d{4}", m)
             for m in logs())
  assert "precision @ 1" in summary_tags(os.path.join(train_dir, "eval"))

  # On 3 towers (towers.infer), batches of 9, 9 and 2: the last leaves a
  # tower empty. The same checkpoint gives exactly the same count.
  towered = mnist_eval.evaluate(checkpoint_dir=train_dir, data_dir=tiny_mnist,
                                batch_size=9, run_once=True, num_gpus=3,
                                eval_dir=str(tmp_path / "eval3"), mirrors=())
  assert towered.num_examples == NUM_TEST
  assert towered.num_correct == result.num_correct


def test_accumulated_micro_batches_train_and_evaluate(tiny_mnist, tmp_path,
                                                     logs):
  train_dir = str(tmp_path / "train")
  step = mnist_train.train(train_dir=train_dir, data_dir=tiny_mnist,
                           num_gpus=2, batch_size=2, accumulate_steps=4,
                           max_steps=4, log_frequency=2,
                           save_checkpoint_secs=3600, save_summaries_steps=1,
                           mirrors=(), seed=0)
  assert step == 4
  assert checkpoint_step(train_dir) == 4  # Global steps count updates.
  lines = logs()
  assert "2 towers x 2 examples x 4 micro-batches = 16 examples per step; " \
      "--max_steps=4 is 1.0 epochs of 64 examples" in lines
  # One line every 2 updates (8 runs), not every 2 runs.
  assert [int(LOG_LINE.search(m).group(1)) for m in lines
          if LOG_LINE.search(m)] == [2, 4]
  # Gradient histograms come from the runs that apply.
  assert "conv1/weights/gradients" in summary_tags(train_dir)
  result = mnist_eval.evaluate(checkpoint_dir=train_dir, data_dir=tiny_mnist,
                               batch_size=8, run_once=True, mirrors=())
  assert result.global_step == 4
  assert result.num_examples == NUM_TEST


def test_evaluate_without_a_checkpoint_says_to_train_first(tiny_mnist,
                                                           tmp_path):
  with pytest.raises(FileNotFoundError, match="train first"):
    mnist_eval.evaluate(checkpoint_dir=str(tmp_path), data_dir=tiny_mnist,
                        run_once=True, mirrors=())
  assert not os.path.exists(tmp_path / "eval")  # No event writer yet.


def test_fake_data_reads_no_file(tmp_path, logs):
  step = mnist_train.train(train_dir=str(tmp_path / "train"),
                           data_dir=str(tmp_path / "nothing"), fake_data=True,
                           num_gpus=2, batch_size=4, max_steps=3,
                           log_frequency=1, mirrors=OFFLINE)
  assert step == 3
  assert any("synthetic images" in m for m in logs())
  assert not os.path.exists(str(tmp_path / "nothing"))

# The scripts as a user runs them.


def _script(name, *flags):
  env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
  return [sys.executable, os.path.join(EXAMPLES, name)] + list(flags), env


def test_script_offline_exits_with_the_message(tmp_path):
  args, env = _script("mnist_multi_gpu_train.py",
                      "--data_dir=%s" % tmp_path, "--mirrors=%s" % OFFLINE[0],
                      "--train_dir=%s" % (tmp_path / "train"))
  done = subprocess.run(args, env=env, capture_output=True, text=True,
                        timeout=120)
  assert done.returncode == 1
  assert "--fake_data" in done.stderr
  assert "--dataset=fashion_mnist" in done.stderr
  assert "Traceback" not in done.stderr


def test_a_killed_run_resumes_from_its_last_checkpoint(tiny_mnist, tmp_path):
  train_dir = str(tmp_path / "train")
  args, env = _script("mnist_multi_gpu_train.py", "--data_dir=" + tiny_mnist,
                      "--train_dir=" + train_dir, "--num_gpus=2",
                      "--batch_size=4", "--save_checkpoint_steps=3",
                      "--log_frequency=1", "--mirrors=")
  log = tmp_path / "first.log"
  with open(str(log), "w") as stderr:
    first = subprocess.Popen(args + ["--max_steps=1000000"], env=env,
                             stdout=subprocess.DEVNULL, stderr=stderr)
  try:
    deadline = time.time() + 90
    while (checkpoint_step(train_dir) or 0) < 6:
      assert first.poll() is None, log.read_text()[-2000:]
      assert time.time() < deadline, "no checkpoint past step 3 in 90s"
      time.sleep(0.2)
    first.send_signal(signal.SIGKILL)
    first.wait(timeout=30)
  finally:
    if first.poll() is None:
      first.kill()
      first.wait()
  assert first.returncode == -signal.SIGKILL
  resumed_from = checkpoint_step(train_dir)
  assert resumed_from >= 6
  # The killed run's lock file is left, but the lock went with the process.
  assert os.path.exists(os.path.join(train_dir, "train.lock"))

  done = subprocess.run(args + ["--max_steps=%d" % (resumed_from + 3)],
                        env=env, capture_output=True, text=True, timeout=120)
  assert done.returncode == 0, done.stderr[-2000:]
  steps = [int(s) for s in LOG_LINE.findall(done.stderr)]
  assert steps == [resumed_from + 1, resumed_from + 2, resumed_from + 3]
  assert checkpoint_step(train_dir) == resumed_from + 3


# Losing work: the training directory's checks, the lock, signals.


@pytest.fixture(scope="module")
def trained_dir(tmp_path_factory):
  """(data_dir, train_dir) of a 6-step run with checkpoints 0, 2, 4 and 6."""
  data_dir = tmp_path_factory.mktemp("data")
  write_split(data_dir, "train", *synthetic(NUM_TRAIN, 0))
  train_dir = str(tmp_path_factory.mktemp("trained"))
  mnist_train.train(train_dir=train_dir, data_dir=str(data_dir), num_gpus=2,
                    batch_size=4, max_steps=6, save_checkpoint_steps=2,
                    save_summaries_steps=0, mirrors=(), seed=0)
  return str(data_dir), train_dir


def _copy(trained_dir, tmp_path, name="train"):
  train_dir = str(tmp_path / name)
  shutil.copytree(trained_dir[1], train_dir)
  return train_dir


def _train(data_dir, train_dir, max_steps, **kwargs):
  args = dict(num_gpus=2, batch_size=4, save_checkpoint_steps=1,
              save_summaries_steps=0, mirrors=(), seed=0)
  args.update(kwargs)
  return mnist_train.train(train_dir=train_dir, data_dir=data_dir,
                           max_steps=max_steps, **args)


def _listing(directory):
  """{name: (size, mtime)} of a directory's files."""
  return {n: (os.path.getsize(os.path.join(directory, n)),
              os.path.getmtime(os.path.join(directory, n)))
          for n in os.listdir(directory)}


@pytest.mark.parametrize("args,words", [
    (dict(batch_size=0), "--batch_size=0 must be >= 1"),
    (dict(batch_size=-4), "--batch_size=-4 must be >= 1"),
    (dict(num_gpus=0), "--num_gpus=0 must be >= 1"),
    (dict(max_steps=-1), "--max_steps=-1 must be >= 0"),
    (dict(dropout_rate=1.0), "--dropout_rate=1.0 must be >= 0 and < 1"),
    (dict(learning_rate=0.0), "--learning_rate=0.0 must be > 0"),
    (dict(save_checkpoint_steps=0), "--save_checkpoint_steps=0 must be"),
    (dict(pack_bytes=-1), "--pack_bytes=-1 must be >= 0"),
    (dict(variable_device="replicated", ps_hosts=["localhost:2222"],
          worker_hosts=["localhost:2223"]),
     "--variable_device=replicated applies to training on one machine: "
     "with --ps_hosts the variables live on the parameter servers"),
    (dict(variable_device="gpu", ps_hosts=["localhost:2222"],
          worker_hosts=["localhost:2223"]),
     "--variable_device=gpu applies to training on one machine"),
    (dict(variable_device="balanced", worker_hosts=["localhost:2223"]),
     "a cluster without --ps_hosts (collective mode) keeps a copy of the "
     "variables on every tower of every worker"),
    (dict(precision="float16", ps_hosts=["localhost:2222"],
          worker_hosts=["localhost:2223"]),
     "--precision=float16 needs loss scaling, which skips the steps whose "
     "gradients overflow, but with --ps_hosts SyncReplicasOptimizer needs "
     "every worker's gradients at every step: use --precision=bfloat16"),
    (dict(precision="float16", worker_hosts=["localhost:2223"]),
     "--precision=float16 needs loss scaling, which skips the steps whose "
     "gradients overflow, and that skip is not tested across the workers "
     "of collective mode"),
    (dict(replicas_to_aggregate=3, ps_hosts=["localhost:2222"],
          worker_hosts=["localhost:2223"]),
     "--replicas_to_aggregate=3 but --worker_hosts lists 1 workers"),
])
def test_train_refuses_bad_arguments_naming_the_flag(tmp_path, args, words):
  args = dict(dict(max_steps=5), **args)
  with pytest.raises(common.FlagError, match=re.escape(words)):
    _train(str(tmp_path / "data"), str(tmp_path / "train"), fake_data=True,
           **args)
  assert os.listdir(str(tmp_path)) == []  # Nothing built or created.


# What the library checks, the script does not check again: its error is
# raised as it is (and, from the script, logged as one line).
@pytest.mark.parametrize("args,words", [
    (dict(all_reduce="ring"), "all_reduce='ring' applies to "
     "variable_device='replicated'"),
    (dict(variable_device="balanced", all_reduce="collective"),
     "with variable_device='balanced' the towers share one copy"),
    (dict(variable_device="replicated", all_reduce="nccl"),
     "expected all_reduce to be one of 'auto', 'add_n', 'ring', "
     "'collective', got 'nccl'"),
    (dict(precision="float64"), "expected compute_dtype to be"),
])
def test_train_passes_on_the_librarys_own_errors(tmp_path, args, words):
  with pytest.raises(ValueError, match=re.escape(words)):
    _train(str(tmp_path / "data"), str(tmp_path / "train"), fake_data=True,
           max_steps=5, **args)
  assert os.listdir(str(tmp_path)) == []  # Nothing built or created.


def test_a_train_dir_that_is_a_file_is_refused(tmp_path):
  path = tmp_path / "train"
  path.write_text("not a directory")
  with pytest.raises(common.FlagError, match="--train_dir=%s is a file"
                     % path):
    _train(str(tmp_path), str(path), max_steps=5, fake_data=True)


def test_every_numeric_argument_of_the_four_scripts_is_bounded():
  import cifar10_eval  # pylint: disable=g-import-not-at-top
  import cifar10_multi_gpu_train  # pylint: disable=g-import-not-at-top
  unbounded = []
  for module, function in [(mnist_train, mnist_train.train),
                           (mnist_eval, mnist_eval.evaluate),
                           (cifar10_multi_gpu_train,
                            cifar10_multi_gpu_train.train),
                           (cifar10_eval, cifar10_eval.evaluate)]:
    for name, p in inspect.signature(function).parameters.items():
      if isinstance(p.default, (int, float)) and not isinstance(
          p.default, bool) and name != "seed" and name not in module.BOUNDS:
        unbounded.append("%s.%s" % (module.__name__, name))
  assert not unbounded


def test_pack_bytes_default_is_towers_minimize_default():
  # The examples write the default out (they use the public API only).
  import cifar10_multi_gpu_train  # pylint: disable=g-import-not-at-top
  want = inspect.signature(towers.minimize).parameters["pack_bytes"].default
  assert common.DEFAULT_PACK_BYTES == want
  for function in [mnist_train.train, mnist_train.build_train_graph,
                   cifar10_multi_gpu_train.train,
                   cifar10_multi_gpu_train.build_train_graph]:
    assert inspect.signature(function).parameters["pack_bytes"].default == (
        want), function.__qualname__


class MinimizeCalled(Exception):
  """Raised by a stand-in for towers.minimize, once it has seen its call."""


def spy_on_minimize(monkeypatch):
  """Replaces towers.minimize; returns the pack_bytes of each call.

  The stand-in raises `MinimizeCalled`, so training stops before a session.
  """
  seen = []

  def minimize(*args, **kwargs):
    del args
    seen.append(kwargs.get("pack_bytes"))
    raise MinimizeCalled()

  monkeypatch.setattr(towers, "minimize", minimize)
  return seen


@pytest.mark.parametrize("args,want", [
    (dict(), common.DEFAULT_PACK_BYTES), (dict(pack_bytes=0), 0),
    (dict(pack_bytes=512), 512),
    (dict(pack_bytes=512, variable_device="replicated", all_reduce="ring"),
     512)])
def test_train_passes_pack_bytes_to_towers_minimize(tmp_path, monkeypatch,
                                                    args, want):
  seen = spy_on_minimize(monkeypatch)
  with pytest.raises(MinimizeCalled):
    _train(str(tmp_path), str(tmp_path / "train"), max_steps=1,
           fake_data=True, **args)
  assert seen == [want]


def test_tower_devices_the_session_lacks_are_a_clear_error(tmp_path,
                                                           monkeypatch):
  # As when GPUs are visible but this process cannot use them.
  monkeypatch.setattr(towers, "tower_devices",
                      lambda n: ["/gpu:%d" % i for i in range(n)])
  with pytest.raises(common.DeviceError) as error:
    _train(str(tmp_path), str(tmp_path / "train"), max_steps=5,
           fake_data=True)
  message = str(error.value)
  for words in ["--num_gpus=2 needs the tower devices /gpu:0, /gpu:1",
                "it has /cpu:0", "fewer --num_gpus",
                "towers.virtual_cpu_config(2)"]:
    assert words in message
  assert not os.path.exists(tmp_path / "train")


def test_fewer_gpus_than_towers_are_a_clear_error(tmp_path, monkeypatch):
  # As when CUDA_VISIBLE_DEVICES hides one of two GPUs.
  gpus = [collections.namedtuple("Device", "name device_type")(
      "/physical_device:GPU:0", "GPU")]
  monkeypatch.setattr(_tf_versions, "physical_gpus", lambda: gpus)
  with pytest.raises(common.DeviceError, match=r"--num_gpus=2: 2 towers but "
                     r"1 GPU\(s\) visible.*Build 1 towers"):
    _train(str(tmp_path), str(tmp_path / "train"), max_steps=5,
           fake_data=True)
  assert not os.path.exists(tmp_path / "train")


def test_sigterm_stops_the_script_at_once_with_a_checkpoint_and_143(
    tiny_mnist, tmp_path):
  train_dir = str(tmp_path / "train")
  args, env = _script("mnist_multi_gpu_train.py", "--data_dir=" + tiny_mnist,
                      "--train_dir=" + train_dir, "--num_gpus=2",
                      "--batch_size=4", "--save_checkpoint_secs=3600",
                      "--log_frequency=1", "--mirrors=",
                      "--max_steps=1000000")
  log = tmp_path / "train.log"
  with open(str(log), "w") as stderr:
    proc = subprocess.Popen(args, env=env, stdout=subprocess.DEVNULL,
                            stderr=stderr)
  try:
    deadline = time.time() + 120
    while not LOG_LINE.search(log.read_text()):
      assert proc.poll() is None, log.read_text()[-2000:]
      assert time.time() < deadline, "no step logged in 120s"
      time.sleep(0.2)
    # Meanwhile a second trainer on its directory is refused, naming it.
    with pytest.raises(training.TrainDirError,
                       match=r"in use by another trainer \(pid %d"
                       % proc.pid):
      _train(tiny_mnist, train_dir, max_steps=5)
    sent = time.time()
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=60)
    took = time.time() - sent
  finally:
    if proc.poll() is None:
      proc.kill()
      proc.wait()
  text = log.read_text()
  assert proc.returncode == 128 + signal.SIGTERM, text[-2000:]
  assert took < 15, took  # A step and a save, not a timeout.
  stopped = re.findall(r"Received SIGTERM at step (\d+): saved a checkpoint, "
                       r"stopping", text)
  assert len(stopped) == 1, text[-2000:]
  assert checkpoint_step(train_dir) == int(stopped[0])
  assert "Traceback" not in text

# One script of each kind as a subprocess (the checks are common's, and
# test_every_numeric_argument_of_the_four_scripts_is_bounded covers the
# rest): absl stops it before anything is built.
@pytest.mark.parametrize("script,flag,words", [
    ("mnist_multi_gpu_train.py", "--batch_size=0",
     "--batch_size=0: must be >= 1"),
    ("mnist_multi_gpu_train.py", "--train_dir={tmp}/file",
     "--train_dir={tmp}/file: is a file, not a directory"),
    ("cifar10_eval.py", "--num_examples=0", "--num_examples=0: must be >= 1"),
    ("mnist_multi_gpu_train.py", "--all_reduce=ring --fake_data",
     "all_reduce='ring' applies to variable_device='replicated'"),
    ("mnist_multi_gpu_train.py",
     "--variable_device=replicated --ps_hosts=localhost:2222",
     "--variable_device=replicated applies to training on one machine"),
    ("cifar10_multi_gpu_train.py", "--pack_bytes=-1",
     "--pack_bytes=-1: must be >= 0"),
    ("mnist_multi_gpu_train.py", "--precision=float16 --ps_hosts=h:2222",
     "--precision=float16 needs loss scaling"),
])
def test_scripts_refuse_a_bad_flag_in_one_line(tmp_path, script, flag, words):
  _assert_refused_in_one_line(tmp_path, script, flag, words)


def _assert_refused_in_one_line(tmp_path, script, flag, words, **paths):
  """Runs `script` with `flag`: exit 1, one line holding `words`, no file.

  `flag` and `words` may name {tmp} (holding the empty file "file") and
  the `paths` given.
  """
  (tmp_path / "file").write_text("")
  paths = dict(paths, tmp=tmp_path)
  args, env = _script(script, *flag.format(**paths).split())
  done = subprocess.run(args, env=env, capture_output=True, text=True,
                        timeout=120, cwd=str(tmp_path))
  assert done.returncode == 1, done.stderr[-2000:]
  lines = [line for line in done.stderr.splitlines()
           if words.format(**paths) in line]
  assert len(lines) == 1, done.stderr[-2000:]
  assert "Traceback" not in done.stderr
  assert os.listdir(str(tmp_path)) == ["file"]
  return lines[0]


def _unwritable_dir(tmp_path_factory):
  """A directory this process cannot write to, or a skip.

  A read-only one of its own; as root, who writes anywhere, /proc/sys (a
  read-only mount).
  """
  if os.geteuid() != 0:
    path = tmp_path_factory.mktemp("read_only")
    path.chmod(0o555)
    return str(path)
  if not os.access("/proc/sys", os.W_OK):
    return "/proc/sys"
  pytest.skip("running as root, with no read-only directory to try")


# Every way a directory flag can be wrong, in the scripts that have it: the
# flag checks' line (absl's exit status 1), or for --checkpoint_dir's eval/
# subdirectory, the evaluator's (its FlagError, also 1).
@pytest.mark.parametrize("script,flag,words", [
    ("mnist_multi_gpu_train.py", "--train_dir=",
     "flag --train_dir=: is empty: name a directory, or leave the flag out"),
    ("mnist_multi_gpu_train.py", "--train_dir={tmp}/file/sub",
     "flag --train_dir={tmp}/file/sub: is under {tmp}/file, which is a "
     "file: point it at a directory"),
    ("mnist_multi_gpu_train.py", "--train_dir={ro}/sub",
     "flag --train_dir={ro}/sub: cannot be created ({ro} is not writable): "
     "point it at a directory you can write to"),
    ("cifar10_multi_gpu_train.py", "--train_dir={ro}",
     "flag --train_dir={ro}: is not writable"),
    ("mnist_multi_gpu_train.py", "--data_dir={tmp}/file/sub",
     "flag --data_dir={tmp}/file/sub: is under {tmp}/file"),
    ("mnist_eval.py", "--checkpoint_dir={tmp}/file",
     "flag --checkpoint_dir={tmp}/file: is a file, not a directory: point "
     "it at a directory"),
    ("mnist_eval.py", "--checkpoint_dir=",
     "flag --checkpoint_dir=: is empty"),
    ("cifar10_eval.py", "--checkpoint_dir={tmp}/file/sub",
     "flag --checkpoint_dir={tmp}/file/sub: is under {tmp}/file"),
    ("mnist_eval.py", "--checkpoint_dir={ro} --run_once",
     "--checkpoint_dir={ro}: without --eval_dir the evaluation summaries go "
     "to {ro}/eval, which cannot be created ({ro} is not writable): give "
     "--eval_dir"),
    ("cifar10_eval.py", "--eval_dir={tmp}/file",
     "flag --eval_dir={tmp}/file: is a file, not a directory: point it at "
     "a directory (it is created if absent)"),
])
def test_a_bad_directory_flag_is_one_line_naming_it(
    tmp_path, tmp_path_factory, script, flag, words):
  paths = {"ro": _unwritable_dir(tmp_path_factory)} if "{ro}" in flag else {}
  line = _assert_refused_in_one_line(tmp_path, script, flag, words, **paths)
  if "checkpoint_dir" in flag:  # Read, never created.
    assert "created if absent" not in line


def test_dir_problem_names_what_is_wrong_and_the_fix(tmp_path,
                                                      tmp_path_factory):
  (tmp_path / "file").write_text("")
  problem = common.dir_problem
  assert problem(None) is None  # An optional flag left out.
  assert problem(str(tmp_path)) is None
  assert problem(str(tmp_path / "new" / "deeper")) is None  # Created.
  assert problem("") == ("is empty: name a directory, or leave the flag out "
                         "for its default")
  assert problem(str(tmp_path / "file")) == (
      "is a file, not a directory: point it at a directory (it is created "
      "if absent)")
  assert problem(str(tmp_path / "file"), common.READ) == (
      "is a file, not a directory: point it at a directory")
  for kind in (common.WRITTEN, common.READ):
    assert problem(str(tmp_path / "file" / "a" / "b"), kind) == (
        "is under %s, which is a file: point it at a directory"
        % (tmp_path / "file"))
  # A dangling symbolic link is no directory either.
  os.symlink(str(tmp_path / "gone"), str(tmp_path / "link"))
  assert problem(str(tmp_path / "link")).startswith("is not a directory")
  read_only = _unwritable_dir(tmp_path_factory)
  assert problem(read_only) == ("is not writable: point it at a directory "
                                "you can write to")
  assert problem(os.path.join(read_only, "x")) == (
      "cannot be created (%s is not writable): point it at a directory you "
      "can write to" % read_only)
  assert problem(read_only, common.READ) is None  # Only read.
  with pytest.raises(common.FlagError, match=re.escape(
      "--checkpoint_dir=%s: without --eval_dir the evaluation summaries go "
      "to %s/eval, which cannot be created (%s is not writable): give "
      "--eval_dir" % (read_only, read_only, read_only))):
    common.check_default_eval_dir(read_only)

# The log: each line once (TensorFlow's Python lines through absl's handler
# only, not through its own too), TensorFlow's C++ INFO and WARNING lines
# off unless the user sets TF_CPP_MIN_LOG_LEVEL.

# absl's prefix (a Python line) and TensorFlow's C++ one (a .cc file).
ABSL_PREFIX = re.compile(r"^[IWEF]\d{4} [\d:.]+ +\d+ [\w.-]+\.py:\d+\] ")
CPP_LINE = re.compile(r"^[IWEF]\d{4} [\d:.]+ +\d+ [\w.-]+\.cc:\d+\] ")


def test_a_short_run_logs_each_line_once(tiny_mnist, tmp_path):
  args, env = _script("mnist_multi_gpu_train.py", "--data_dir=" + tiny_mnist,
                      "--train_dir=%s" % (tmp_path / "train"),
                      "--num_gpus=2", "--batch_size=4", "--max_steps=3",
                      "--log_frequency=1", "--mirrors=")
  del env["TF_CPP_MIN_LOG_LEVEL"]  # The script's own default.
  done = subprocess.run(args, env=env, capture_output=True, text=True,
                        timeout=120)
  assert done.returncode == 0, done.stderr[-2000:]
  lines = [line for line in done.stderr.splitlines() if line.strip()]
  assert [int(s) for s in LOG_LINE.findall(done.stderr)] == [1, 2, 3]
  assert not any(line.startswith(("INFO:tensorflow:", "WARNING:tensorflow:"))
                 for line in lines), done.stderr[-2000:]
  # What TensorFlow's libraries print before its log level applies (each
  # of its two libraries the same banners, oneDNN's and CUDA's absence, in
  # C++): no setting hides them. After the script's first line, none.
  first = next(i for i, line in enumerate(lines) if ABSL_PREFIX.match(line))
  late = [line for line in lines[first:]
          if CPP_LINE.match(line) and line[0] in "IW"]
  assert not late, late
  # A message is a record's first line with the lines that continue it
  # (TensorFlow's deprecation warnings take three).
  messages = []
  for line in lines[first:]:
    if ABSL_PREFIX.match(line):
      messages.append(ABSL_PREFIX.sub("", line))
    elif not CPP_LINE.match(line) and messages:
      messages[-1] += "\n" + line
  repeated = sorted({m for m in messages if messages.count(m) > 1})
  assert not repeated, done.stderr[-3000:]
  assert any("Saving checkpoints for 3 into" in m for m in messages)


# The flags each script defines itself, and those common.py defines for it.
SHARED = ["xla", "stage_inputs", "variable_device", "all_reduce",
          "pack_bytes"]


@pytest.mark.parametrize("script,names", [
    ("mnist_multi_gpu_train.py", ["train_dir", "ps_hosts", "precision"] +
     SHARED),
    ("cifar10_multi_gpu_train.py", ["train_dir", "use_fp16"] + SHARED),
    ("mnist_eval.py", ["checkpoint_dir", "eval_dir", "run_once"]),
    ("cifar10_eval.py", ["checkpoint_dir", "eval_dir", "num_examples"]),
    ("launch_local_cluster.py", ["num_ps", "num_workers", "stop_grace_secs"]),
    ("dcgan_mnist_multi_gpu_train.py", ["train_dir", "z_dim", "beta1"]),
])
def test_help_lists_each_scripts_flags_the_shared_ones_included(
    script, names):
  args, env = _script(script, "--help")
  done = subprocess.run(args, env=env, capture_output=True, text=True,
                        timeout=120)
  listed = set(re.findall(r"^  --(?:\[no\])?(\w+):", done.stdout, re.M))
  for name in names:
    assert name in listed, (name, done.stdout[-3000:])
  # Only the script's own: absl's and TensorFlow's are --helpfull's.
  assert "verbosity" not in listed
  # The docstring's usage lines, each command on its lines as written.
  with open(args[1]) as f:
    usage = [p for p in ast.get_docstring(ast.parse(f.read())).split("\n\n")
             if p.startswith("  python examples/")][0]
  assert usage in done.stdout, done.stdout[:2000]


# Replicated variables (--variable_device=replicated): checkpoints, eval,
# resume.


def _checkpoint(directory):
  """{name: value} of the latest checkpoint in `directory`."""
  path = tf.train.latest_checkpoint(directory)
  return {name: tf.train.load_variable(path, name)
          for name, _ in tf.train.list_variables(path)}


# Each tower its own batch of the IDX files; no dropout, whose masks depend
# on the ops' creation order (the replicated graph has more ops) and on
# which tower dequeued which batch.
REPLICATED_RUN = dict(num_gpus=2, batch_size=4, max_steps=3, dropout_rate=0.0,
                      log_frequency=1, save_summaries_steps=3, mirrors=(),
                      seed=0)


@pytest.fixture(scope="module")
def one_copy_run(tmp_path_factory):
  """(data_dir, train_dir, EvalResult) of REPLICATED_RUN in the 'cpu' mode."""
  data_dir = tmp_path_factory.mktemp("data")
  write_split(data_dir, "train", *synthetic(NUM_TRAIN, 0))
  write_split(data_dir, "test", *synthetic(NUM_TEST, 1))
  train_dir = str(tmp_path_factory.mktemp("one_copy"))
  mnist_train.train(train_dir=train_dir, data_dir=str(data_dir),
                    **REPLICATED_RUN)
  result = mnist_eval.evaluate(checkpoint_dir=train_dir,
                               data_dir=str(data_dir), batch_size=8,
                               run_once=True, mirrors=())
  return str(data_dir), train_dir, result


@pytest.mark.parametrize("all_reduce", ["add_n", "ring", "collective"])
def test_replicated_training_saves_the_one_copy_checkpoint_for_eval(
    one_copy_run, tmp_path, logs, op_timeout, all_reduce):
  del op_timeout  # Used for its effect.
  data_dir, one_copy, one_copy_result = one_copy_run
  train_dir = str(tmp_path / "train")
  assert mnist_train.train(train_dir=train_dir, data_dir=data_dir,
                           variable_device="replicated", all_reduce=all_reduce,
                           **REPLICATED_RUN) == 3
  lines = logs()
  assert ("--variable_device=replicated: a copy of each variable on each of "
          "the 2 towers, their gradients summed by the '%s' all-reduce; "
          "checkpoints hold copy 0 (/cpu:0) under single-device names"
          % all_reduce) in lines
  assert [int(LOG_LINE.search(m).group(1)) for m in lines
          if LOG_LINE.search(m)] == [1, 2, 3]
  # Copy 0 and its momentum alone, under the one-copy run's names, with its
  # values: 'add_n' is that run's step bit for bit, the others its sums in
  # another order.
  got, want = _checkpoint(train_dir), _checkpoint(one_copy)
  assert sorted(got) == sorted(want)
  for name, value in want.items():
    if all_reduce == "add_n":
      np.testing.assert_array_equal(got[name], value, err_msg=name)
    else:
      np.testing.assert_allclose(got[name], value, rtol=1e-5, atol=1e-6,
                                 err_msg=name)
  # Histograms of copy 0 only (the copies are not trainable): no replica_1/.
  tags = summary_tags(train_dir)
  for name in want:
    if name.endswith(("weights", "biases")):
      assert {name, name + "/gradients"} <= tags
  assert not [t for t in tags if "replica_" in t]
  # mnist_eval reads the checkpoint as it is.
  result = mnist_eval.evaluate(checkpoint_dir=train_dir, data_dir=data_dir,
                               batch_size=8, run_once=True, mirrors=())
  assert (result.num_examples, result.global_step) == (NUM_TEST, 3)
  if all_reduce == "add_n":
    assert result.num_correct == one_copy_result.num_correct


def _pack_concats(data_dir, **kwargs):
  """The names of the ops that concatenate a pack, in `_build`'s graph."""
  with tf.Graph().as_default() as g:
    _build(data_dir, num_towers=2, dropout_rate=0.0, **kwargs)
  return [op.name for op in g.get_operations()
          if op.type == "ConcatV2" and "/pack/" in op.name]


@pytest.mark.parametrize("mode", [
    dict(), dict(variable_device="replicated", all_reduce="ring")],
    ids=["cpu", "ring"])
def test_packing_changes_no_bit_of_the_trained_variables(
    one_copy_run, tmp_path, logs, mode):
  data_dir = one_copy_run[0]
  # The default packs (the biases and conv1/weights: 5 of the 8), 0 none.
  assert len(_pack_concats(data_dir, **mode)) >= 2
  assert not _pack_concats(data_dir, pack_bytes=0, **mode)
  # one_copy_run is the 'cpu' mode's run with the default.
  dirs = {} if mode else {common.DEFAULT_PACK_BYTES: one_copy_run[1]}
  for pack_bytes in (common.DEFAULT_PACK_BYTES, 0):
    if pack_bytes not in dirs:
      dirs[pack_bytes] = str(tmp_path / str(pack_bytes))
      assert mnist_train.train(
          train_dir=dirs[pack_bytes], data_dir=data_dir,
          pack_bytes=pack_bytes, **mode, **REPLICATED_RUN) == 3
  lines = logs()
  assert "--pack_bytes=0: packing off, each gradient is reduced on its own" in (
      lines)
  if mode:
    assert ("--pack_bytes=16384: 5 of the 8 gradients are at most 16384 "
            "bytes; those reduced alike (one dtype, the same devices) share "
            "a pack, one transfer per tower instead of one per gradient (0 "
            "turns packing off)") in lines
  # Every variable, slot and the step, bit for bit.
  packed, unpacked = (_checkpoint(dirs[p])
                      for p in (common.DEFAULT_PACK_BYTES, 0))
  assert sorted(packed) == sorted(unpacked)
  for name, value in unpacked.items():
    np.testing.assert_array_equal(packed[name], value, err_msg=name)


def test_one_tower_logs_that_it_packs_nothing(logs):
  t = towers.Towers(**dict.fromkeys(towers.Towers._fields))
  common.log_packing(t._replace(devices=["/cpu:0"]), 16384)
  assert logs() == ["--pack_bytes=16384: one tower, whose gradients need "
                         "no reduction, so none is packed"]


def test_checkpoints_resume_across_modes_and_set_every_copy(
    trained_dir, tmp_path, op_timeout):
  del op_timeout  # Used for its effect.
  data_dir = trained_dir[0]
  train_dir = _copy(trained_dir, tmp_path)  # The 'cpu' mode's, at step 6.
  names = sorted(_checkpoint(train_dir))
  # cpu -> replicated, replicated -> replicated with another all-reduce,
  # replicated -> cpu: each run goes on from the last one's step.
  for max_steps, mode in [(7, dict(variable_device="replicated",
                                   all_reduce="ring")),
                          (8, dict(variable_device="replicated",
                                   all_reduce="collective")),
                          (9, dict(variable_device="cpu"))]:
    assert _train(data_dir, train_dir, max_steps, **mode) == max_steps
    assert sorted(_checkpoint(train_dir)) == names
  # Restored into the replicated graph as the trainer's session restores
  # it, copy 1 and its momentum hold the checkpoint's copy 0 values.
  saved = _checkpoint(train_dir)
  with tf.Graph().as_default():
    _build(data_dir, num_towers=2, variable_device="replicated")
    variables = {v.op.name: v for v in tf.global_variables()}
    copies = {v.op.name[len("replica_1/"):]: v for v in tf.local_variables()
              if v.op.name.startswith("replica_1/")}
    assert len(copies) == 16  # 8 variables and their momentum.
    creator = tf.train.ChiefSessionCreator(
        checkpoint_dir=train_dir, config=towers.virtual_cpu_config(2))
    with tf.train.MonitoredSession(session_creator=creator) as sess:
      restored, copied = sess.run([variables, copies])
  for name, value in copied.items():
    np.testing.assert_array_equal(value, saved[name], err_msg=name)
    np.testing.assert_array_equal(restored[name], saved[name], err_msg=name)


# The fast paths: --precision, --xla, --stage_inputs.

LOSS_SCALE_VARIABLES = ["loss_scale", "loss_scale_good_steps"]


def _logged(lines):
  """[(step, loss, rest of the line)] of the step lines in `lines`."""
  found = [(LOG_LINE.search(m), m) for m in lines]
  return [(int(f.group(1)), float(m.split("loss = ")[1].split()[0]),
           m[f.end():]) for f, m in found if f]


@pytest.mark.parametrize("precision", ["float16", "bfloat16"])
def test_half_precision_saves_float32_weights_that_eval_restores(
    one_copy_run, tmp_path, logs, precision):
  data_dir, one_copy = one_copy_run[:2]
  train_dir = str(tmp_path / "train")
  assert mnist_train.train(train_dir=train_dir, data_dir=data_dir,
                           precision=precision, **REPLICATED_RUN) == 3
  lines = logs()
  float16 = precision == "float16"
  assert any(m.startswith("--precision=%s: the towers compute in %s on "
                          "float32 master weights" % (precision, precision))
             and ("dynamic loss scaling" in m) == float16 for m in lines)
  logged = _logged(lines)
  assert [step for step, _, _ in logged] == [1, 2, 3]
  assert all(np.isfinite(loss) for _, loss, _ in logged)
  # Dynamic loss scaling starts at 2**15; no step of these overflows.
  assert [rest for _, _, rest in logged] == (
      [", loss scale = 32768"] * 3 if float16 else ["", "", ""])
  assert ("loss_scale" in summary_tags(train_dir)) == float16
  # The float32 run's variables, names and dtypes, and the loss scale.
  path = tf.train.latest_checkpoint(train_dir)
  names = [name for name, _ in tf.train.list_variables(path)]
  assert sorted(names) == sorted(list(_checkpoint(one_copy)) + (
      LOSS_SCALE_VARIABLES if float16 else []))
  for name in names:
    if name != "global_step":
      assert tf.train.load_variable(path, name).dtype == np.float32, name
  # The float32 evaluation graph restores it as it is.
  result = mnist_eval.evaluate(checkpoint_dir=train_dir, data_dir=data_dir,
                               batch_size=8, run_once=True, mirrors=())
  assert (result.num_examples, result.global_step) == (NUM_TEST, 3)
  if float16:
    # And float32 training resumes from it (the loss scale left unread).
    assert _train(data_dir, train_dir, max_steps=4) == 4


def test_a_float32_checkpoint_resumes_in_bfloat16_not_in_float16(
    trained_dir, tmp_path):
  data_dir = trained_dir[0]
  train_dir = _copy(trained_dir, tmp_path)
  before = _listing(train_dir)
  with pytest.raises(training.TrainDirError) as error:
    _train(data_dir, train_dir, max_steps=7, precision="float16")
  message = str(error.value)
  for words in ["model.ckpt-6 lacks loss_scale, loss_scale_good_steps",
                "float16 training adds a loss scale",
                "resume with the settings it was trained with"]:
    assert words in message
  after = _listing(train_dir)
  del before["train.lock"], after["train.lock"]
  assert after == before  # Refused before a session.
  assert _train(data_dir, train_dir, max_steps=7, precision="bfloat16") == 7


def _xla_compiled(op):
  try:
    return op.get_attr("_XlaCompile")
  except ValueError:
    return False


def test_xla_compiles_the_towers_and_trains_within_rounding(
    one_copy_run, tmp_path, logs):
  data_dir, one_copy = one_copy_run[:2]
  with tf.Graph().as_default() as g:
    _build(data_dir, num_towers=2, xla=True)
    compiled = {op.name for op in g.get_operations() if _xla_compiled(op)}
  # Each tower's forward and gradient ops; not the averaging or the update.
  for name in ["tower_0/conv1/Conv2D", "tower_1/local3/MatMul",
               "tower_1/gradients/tower_1/conv1/Conv2D_grad/"
               "Conv2DBackpropFilter"]:
    assert name in compiled
  assert not [n for n in compiled if n.startswith(("Momentum", "average"))]
  train_dir = str(tmp_path / "train")
  assert mnist_train.train(train_dir=train_dir, data_dir=data_dir, xla=True,
                           **REPLICATED_RUN) == 3
  assert ("--xla: each tower's model and its gradient are compiled with XLA"
          in logs())
  # one_copy_run's steps, within rounding: XLA fuses and reorders the math.
  got, want = _checkpoint(train_dir), _checkpoint(one_copy)
  assert sorted(got) == sorted(want)
  for name, value in want.items():
    np.testing.assert_allclose(got[name], value, rtol=1e-4, atol=1e-6,
                               err_msg=name)


def test_staged_inputs_train_the_same_steps_bit_for_bit(
    one_copy_run, tmp_path, logs):
  data_dir, one_copy = one_copy_run[:2]
  train_dir = str(tmp_path / "train")
  assert mnist_train.train(train_dir=train_dir, data_dir=data_dir,
                           stage_inputs=True, **REPLICATED_RUN) == 3
  assert any(m.startswith("--stage_inputs: each tower's batches are read "
                          "ahead") for m in logs())
  # The same batches in the same steps: each step takes the next two.
  got, want = _checkpoint(train_dir), _checkpoint(one_copy)
  assert sorted(got) == sorted(want)
  for name, value in want.items():
    np.testing.assert_array_equal(got[name], value, err_msg=name)


def test_staged_inputs_end_cleanly_with_the_data(tiny_mnist, tmp_path,
                                                 monkeypatch):
  # The scripts' training data repeat forever; an input that ends (six
  # batches: three steps of two towers) ends training after its last
  # staged batch, with the final checkpoint, not a hang or an error.
  train_dataset = mnist_data.train_dataset
  monkeypatch.setattr(mnist_data, "train_dataset",
                      lambda *args, **kwargs: train_dataset(
                          *args, **kwargs).take(6))
  train_dir = str(tmp_path / "train")
  started = time.time()
  assert _train(tiny_mnist, train_dir, max_steps=100, stage_inputs=True,
                save_checkpoint_steps=None, save_checkpoint_secs=3600) == 3
  assert checkpoint_step(train_dir) == 3
  assert time.time() - started < 60


# The real data.


def test_two_towers_learn_real_mnist(mnist_dir, tmp_path):
  train_dir = str(tmp_path / "train")
  # 19,200 examples (a third of an epoch), halving the rate every 6,000: a
  # margin over 0.97 whichever weights the TensorFlow version draws.
  mnist_train.train(train_dir=train_dir, data_dir=mnist_dir, num_gpus=2,
                    batch_size=32, max_steps=300, learning_rate=0.05,
                    learning_rate_decay=0.5, epochs_per_decay=0.1,
                    dropout_rate=0.0, log_frequency=50, mirrors=(), seed=0)
  result = mnist_eval.evaluate(checkpoint_dir=train_dir, data_dir=mnist_dir,
                               run_once=True, mirrors=())
  assert result.num_examples == 10000
  assert result.precision > 0.97
