"""CIFAR-10 binary files: download, checks, and the tf.data input pipelines.

Used by the CIFAR-10 example scripts; run them, not this module:

  python examples/cifar10_multi_gpu_train.py --data_dir=/tmp/cifar10_data
  python examples/cifar10_eval.py --data_dir=/tmp/cifar10_data --run_once

The data are the CIFAR-10 binary version, ``cifar-10-batches-bin/`` with
``data_batch_1.bin`` ... ``data_batch_5.bin`` (50,000 training images) and
``test_batch.bin`` (10,000 test images). Each record is 3073 bytes: one label
byte (0-9), then a 32x32 RGB image stored depth-major (1024 red, 1024 green,
1024 blue bytes, each plane row by row). How many records there are comes
from the files, so small files in the same format work too.

The pipelines are the tutorial's: for training a random 24x24 crop, a random
left-right flip, random brightness and contrast and per-image
standardization, shuffled and repeated; for evaluation the central 24x24
crop and per-image standardization, each record exactly once.
"""

import os
import shutil
import tarfile
import tempfile
from typing import List, Optional, Sequence, Tuple

from absl import logging
import numpy as np
import tensorflow.compat.v1 as tf

import common

URLS = ("https://www.cs.toronto.edu/~kriz/cifar-10-binary.tar.gz",)
TARBALL = "cifar-10-binary.tar.gz"
# The MD5 published on the CIFAR-10 page; no SHA-256 is published.
TARBALL_MD5 = "c32a1d4ab5d03f1284b67883e8d87530"
BATCHES_DIR = "cifar-10-batches-bin"
TRAIN_FILES = tuple("data_batch_%d.bin" % i for i in range(1, 6))
TEST_FILES = ("test_batch.bin",)

HEIGHT, WIDTH, DEPTH = 32, 32, 3
LABEL_BYTES = 1
IMAGE_BYTES = HEIGHT * WIDTH * DEPTH
RECORD_BYTES = LABEL_BYTES + IMAGE_BYTES  # 3073
NUM_CLASSES = 10
# The network sees 24x24 crops, as in the tutorial.
IMAGE_SIZE = 24
# What --fake_data stands in for: the size of the real training set, so that
# the learning-rate schedule is the real run's.
NUM_TRAIN_EXAMPLES = 50000
# The tutorial keeps 40% of an epoch in its shuffling queue.
SHUFFLE_FRACTION = 0.4


class CorruptDataError(ValueError):
  """A CIFAR-10 file or tarball is truncated or not in the expected format."""


def maybe_download_and_extract(data_dir: str,
                               urls: Sequence[str] = URLS,
                               md5: str = TARBALL_MD5) -> str:
  """Returns the directory holding the binary batches, fetching it if absent.

  When ``data_dir/cifar-10-batches-bin`` exists it is used as it is. Else the
  tarball ``data_dir/cifar-10-binary.tar.gz`` is used if present (the cache),
  or downloaded from the first of `urls` that works; either way its MD5 must
  match before it is extracted. Extraction goes to a temporary directory
  inside `data_dir` and is renamed into place only when complete; tar members
  that are not plain files or directories, or whose paths leave the
  directory, are refused.

  Args:
    data_dir: the directory for the tarball and ``cifar-10-batches-bin/``.
    urls: where to download the tarball from, tried in order.
    md5: the tarball's expected MD5 hex digest.

  Returns:
    The path of ``cifar-10-batches-bin``.

  Raises:
    common.DownloadError: if the tarball is absent and cannot be downloaded
      (the message names --data_dir and --fake_data).
    CorruptDataError: if the tarball fails its MD5 check, cannot be read,
      does not hold ``cifar-10-batches-bin/``, or holds a link, a special
      file or a path leaving the directory (nothing is extracted then).
  """
  batches = os.path.join(data_dir, BATCHES_DIR)
  if os.path.isdir(batches):
    return batches
  tarball = os.path.join(data_dir, TARBALL)
  try:
    common.maybe_download(urls, tarball, md5=md5)
  except common.DownloadError as e:
    raise common.DownloadError(
        "CIFAR-10 is not in --data_dir=%s (no %s/ there) and could not be "
        "downloaded: %s. Without internet, copy %s (or its extracted %s/) "
        "into --data_dir, or run with --fake_data for a throughput-only run "
        "on synthetic images" % (data_dir, BATCHES_DIR, e, TARBALL,
                                 BATCHES_DIR)) from e
  got = common.md5_of(tarball)
  if got != md5:
    # The cache is the user's file: reported, never removed.
    raise CorruptDataError(
        "%s has MD5 %s, expected %s: it is incomplete or not the CIFAR-10 "
        "binary tarball; remove it to download it again" % (tarball, got, md5))
  _extract(tarball, data_dir)
  return batches


def _check_members(tar: tarfile.TarFile, tarball: str, dest: str) -> None:
  root = os.path.realpath(dest)
  for member in tar.getmembers():
    if not (member.isfile() or member.isdir()):
      raise CorruptDataError(
          "%s holds %r, which is a link or a special file; the CIFAR-10 "
          "tarball holds only plain files, so it was not extracted"
          % (tarball, member.name))
    target = os.path.realpath(os.path.join(root, member.name))
    if os.path.isabs(member.name) or os.path.commonpath(
        [root, target]) != root:
      raise CorruptDataError(
          "%s holds %r, whose path leaves the directory it is extracted to; "
          "it was not extracted" % (tarball, member.name))


def _extract(tarball: str, data_dir: str) -> None:
  logging.info("Extracting %s", tarball)
  scratch = tempfile.mkdtemp(prefix=".%s-" % BATCHES_DIR, dir=data_dir)
  try:
    try:
      with tarfile.open(tarball, "r:gz") as tar:
        _check_members(tar, tarball, scratch)
        if hasattr(tarfile, "data_filter"):
          tar.extractall(scratch, filter="data")
        else:
          tar.extractall(scratch)
    except (tarfile.TarError, EOFError, OSError) as e:
      raise CorruptDataError(
          "cannot extract %s (%s): it is incomplete or not a gzipped tar; "
          "remove it to download it again" % (tarball, e)) from e
    extracted = os.path.join(scratch, BATCHES_DIR)
    if not os.path.isdir(extracted):
      raise CorruptDataError(
          "%s holds no %s/ directory: it is not the CIFAR-10 binary tarball"
          % (tarball, BATCHES_DIR))
    os.replace(extracted, os.path.join(data_dir, BATCHES_DIR))
  finally:
    # Only the scratch directory made above is removed, never the user's.
    shutil.rmtree(scratch, ignore_errors=True)


def data_files(data_dir: str, train: bool) -> List[str]:
  """Returns the training (or test) batch files under `data_dir`.

  Raises:
    FileNotFoundError: if one is missing (the message names it).
  """
  batches = os.path.join(data_dir, BATCHES_DIR)
  paths = [os.path.join(batches, name)
           for name in (TRAIN_FILES if train else TEST_FILES)]
  for path in paths:
    if not os.path.isfile(path):
      raise FileNotFoundError(
          "%s is missing; %s/ must hold %s (extract %s into --data_dir=%s "
          "again)" % (path, BATCHES_DIR, ", ".join(TRAIN_FILES + TEST_FILES),
                      TARBALL, data_dir))
  return paths


def check_file(path: str) -> int:
  """Checks one binary batch file; returns its number of records.

  The size must be a positive multiple of the 3073-byte record and every
  label byte in 0-9. Reads only the label bytes (through a memory map).

  Raises:
    CorruptDataError: naming the file, its size or the bad record.
  """
  size = os.path.getsize(path)
  if size == 0 or size % RECORD_BYTES:
    hint = ""
    if size and size % (RECORD_BYTES + 1) == 0:
      hint = " (its size fits the 3074-byte records of CIFAR-100)"
    raise CorruptDataError(
        "%s is %d bytes, not a positive multiple of the %d-byte CIFAR-10 "
        "record (1 label byte + %d image bytes)%s: the file is truncated or "
        "not a CIFAR-10 binary batch; extract it again from %s"
        % (path, size, RECORD_BYTES, IMAGE_BYTES, hint, TARBALL))
  records = np.memmap(path, dtype=np.uint8, mode="r").reshape(
      -1, RECORD_BYTES)
  labels = np.array(records[:, 0])  # A copy: the map is closed on return.
  bad = np.flatnonzero(labels >= NUM_CLASSES)
  if bad.size:
    raise CorruptDataError(
        "%s: record %d has label %d, but CIFAR-10 labels are 0-%d (%d bad "
        "records in all): the file is corrupt or not a CIFAR-10 binary batch"
        % (path, bad[0], labels[bad[0]], NUM_CLASSES - 1, bad.size))
  return len(labels)


def check_files(paths: Sequence[str]) -> int:
  """Checks each file with `check_file`; returns the total record count."""
  return sum(check_file(p) for p in paths)


def _decode(record: tf.Tensor) -> Tuple[tf.Tensor, tf.Tensor]:
  """Returns a [32, 32, 3] float32 image and an int32 label from a record."""
  raw = tf.io.decode_raw(record, tf.uint8)
  label = tf.cast(raw[0], tf.int32)
  depth_major = tf.reshape(raw[LABEL_BYTES:RECORD_BYTES],
                           [DEPTH, HEIGHT, WIDTH])
  image = tf.cast(tf.transpose(depth_major, [1, 2, 0]), tf.float32)
  return image, label


def distort(image: tf.Tensor) -> tf.Tensor:
  """The tutorial's training distortions of one [32, 32, 3] float image."""
  image = tf.image.random_crop(image, [IMAGE_SIZE, IMAGE_SIZE, DEPTH])
  image = tf.image.random_flip_left_right(image)
  image = tf.image.random_brightness(image, max_delta=63)
  image = tf.image.random_contrast(image, lower=0.2, upper=1.8)
  return tf.image.per_image_standardization(image)


def center(image: tf.Tensor) -> tf.Tensor:
  """The evaluation view of one [32, 32, 3] image: central 24x24 crop."""
  image = tf.image.resize_with_crop_or_pad(image, IMAGE_SIZE, IMAGE_SIZE)
  return tf.image.per_image_standardization(image)


# The per-example functions below use TensorFlow ops only, with no Python
# control flow: AutoGraph would only slow down building the graph.
@tf.autograph.experimental.do_not_convert
def _train_example(record: tf.Tensor) -> Tuple[tf.Tensor, tf.Tensor]:
  image, label = _decode(record)
  return _with_shape(distort(image)), label


@tf.autograph.experimental.do_not_convert
def _eval_example(record: tf.Tensor) -> Tuple[tf.Tensor, tf.Tensor]:
  image, label = _decode(record)
  return _with_shape(center(image)), label


@tf.autograph.experimental.do_not_convert
def _fake_example(seed: tf.Tensor) -> Tuple[tf.Tensor, tf.Tensor]:
  image = tf.random.stateless_uniform(
      [HEIGHT, WIDTH, DEPTH], tf.stack([seed, tf.zeros_like(seed)]),
      minval=0, maxval=256, dtype=tf.int32)
  label = tf.cast(seed % NUM_CLASSES, tf.int32)
  return _with_shape(distort(tf.cast(image, tf.float32))), label


def _with_shape(image: tf.Tensor) -> tf.Tensor:
  image.set_shape([IMAGE_SIZE, IMAGE_SIZE, DEPTH])
  return image


def train_dataset(paths: Sequence[str], batch_size: int,
                  num_records: int,
                  shuffle_buffer: Optional[int] = None) -> tf.data.Dataset:
  """Returns the endless, shuffled, distorted training batches.

  Build it on the CPU. Shuffling holds raw records (3 KB each), 40% of the
  training set by default as in the tutorial; distortions are drawn anew
  each epoch. Every batch holds exactly `batch_size` examples. Like the
  other pipelines here it runs without tf.data's autotuning model, whose
  thread a closing session waits for (`common.without_autotune`).

  Args:
    paths: the training batch files (checked with `check_files`).
    batch_size: examples per batch: one tower's batch.
    num_records: how many records the files hold.
    shuffle_buffer: records in the shuffle buffer; None for 40% of
      `num_records`.
  """
  if shuffle_buffer is None:
    shuffle_buffer = max(1, int(SHUFFLE_FRACTION * num_records))
  dataset = tf.data.FixedLengthRecordDataset(list(paths), RECORD_BYTES)
  dataset = dataset.shuffle(shuffle_buffer).repeat()
  dataset = dataset.map(_train_example,
                        num_parallel_calls=tf.data.experimental.AUTOTUNE)
  return common.without_autotune(dataset.batch(
      batch_size, drop_remainder=True).prefetch(
          tf.data.experimental.AUTOTUNE))


def fake_train_dataset(batch_size: int) -> tf.data.Dataset:
  """Returns endless batches of synthetic images with arbitrary labels.

  For throughput runs without the data: each example is a fresh random
  32x32x3 byte image through the same distortions as real data, so only the
  file reading is missing from the cost. Nothing can be learned from it.
  """
  # Each example's index seeds its image (Dataset.random is TensorFlow 2's).
  dataset = tf.data.Dataset.range(np.iinfo(np.int64).max).map(
      _fake_example, num_parallel_calls=tf.data.experimental.AUTOTUNE)
  return common.without_autotune(dataset.batch(
      batch_size, drop_remainder=True).prefetch(
          tf.data.experimental.AUTOTUNE))


def eval_dataset(paths: Sequence[str], batch_size: int,
                 num_examples: int) -> tf.data.Dataset:
  """Returns the first `num_examples` records once, centrally cropped.

  The last batch holds the remainder, so every example counts exactly once.
  """
  dataset = tf.data.FixedLengthRecordDataset(list(paths), RECORD_BYTES)
  dataset = dataset.take(num_examples)
  dataset = dataset.map(_eval_example,
                        num_parallel_calls=tf.data.experimental.AUTOTUNE)
  return common.without_autotune(
      dataset.batch(batch_size).prefetch(tf.data.experimental.AUTOTUNE))
