"""MNIST input for the examples: IDX files, downloads and one tf.data pipeline.

  python examples/mnist_multi_gpu_train.py --data_dir=/tmp/mnist_data
  python examples/mnist_eval.py --data_dir=/tmp/mnist_data --run_once
  python examples/mnist_multi_gpu_train.py --dataset=fashion_mnist

The four IDX files (``train-images-idx3-ubyte`` and so on, gzipped or raw)
are looked for in the data directory and, for MNIST, downloaded there once
(hash-checked) when absent. Headers are checked in Python before TensorFlow
reads a byte, so a corrupt or truncated file is an `IdxError` naming it, not
a hang, a giant allocation or a silently short epoch. TensorFlow's own
``FixedLengthRecordDataset`` then reads the records: the arrays never become
graph constants (a 47 MB constant would bloat every saved graph).
Example code, not part of the `towers` library.
"""

import collections
import gzip
import os
import struct
import zlib
from typing import Optional, Sequence, Tuple

from absl import logging
import tensorflow.compat.v1 as tf

import common

IMAGE_SIZE = 28
NUM_CLASSES = 10
IMAGES_MAGIC = 2051  # 0x00000803: unsigned bytes, 3 dimensions.
LABELS_MAGIC = 2049  # 0x00000801: unsigned bytes, 1 dimension.
INPUT_DEVICE = "/cpu:0"

# [split] -> (images file, labels file), without the ".gz".
SPLITS = {
    "train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
    "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
}

# SHA-256 of the official gzipped MNIST files.
MNIST_SHA256 = {
    "train-images-idx3-ubyte.gz":
        "0b367032e93c5d0cea0925647cfdb18614af8ee15f83e6f2fc2ad904a6835971",
    "train-labels-idx1-ubyte.gz":
        "1787548bbe0bff1ec2ecdc0ef292b02df999e2d1a6002d27500982c652b17203",
    "t10k-images-idx3-ubyte.gz":
        "1a1a05eab793c14bb050b398624a11b0ffd1a2953baed553b1b9bd079e2a20be",
    "t10k-labels-idx1-ubyte.gz":
        "b91679a0acfe4ba0e50a2437a903084cba1f5f92592b016a25a7dfd00455798b",
}
MNIST_MIRRORS = (
    "https://storage.googleapis.com/cvdf-datasets/mnist/",
    "https://ossci-datasets.s3.amazonaws.com/mnist/",
)

# Debian's dataset-fashion-mnist package ships Fashion-MNIST in the same
# format and file names. Its gzip files are recompressed (their hashes are
# not upstream's), so no hash is known for a download: Fashion-MNIST is
# read from disk only.
FASHION_MNIST_DIR = "/usr/share/datasets/fashion-mnist"
DEFAULT_DATA_DIRS = {
    "mnist": "/tmp/mnist_data",
    "fashion_mnist": FASHION_MNIST_DIR,
}
DATASETS = tuple(DEFAULT_DATA_DIRS)

IdxFile = collections.namedtuple(
    "IdxFile", ["path", "count", "header_bytes", "record_bytes",
                "compressed"])
IdxFile.__doc__ = """A checked IDX file.

Fields:
  path: the file.
  count: how many records (images or labels) it holds.
  header_bytes: the header's length (16 for images, 8 for labels).
  record_bytes: one record's length (784 for an image, 1 for a label).
  compressed: whether the file is gzipped (known from its content, not its
    name).
"""


class DataError(Exception):
  """The data cannot be read; the message says why and what to do."""


class IdxError(DataError, ValueError):
  """An IDX file is corrupt, truncated or not the expected kind."""


class MissingDataError(DataError, FileNotFoundError):
  """The data files are absent and could not be downloaded."""


def default_data_dir(dataset: str) -> str:
  """Returns where `dataset`'s files are looked for by default."""
  _check_dataset(dataset)
  return DEFAULT_DATA_DIRS[dataset]


def _check_dataset(dataset: str) -> None:
  if dataset not in DEFAULT_DATA_DIRS:
    raise ValueError("expected dataset to be one of %s, got %r"
                     % (", ".join(DATASETS), dataset))


def _is_gzip(path: str) -> bool:
  with open(path, "rb") as f:
    return f.read(2) == b"\x1f\x8b"


def _payload_length(path: str, compressed: bool) -> int:
  """Returns the file's (decompressed) length, streaming: no big buffer."""
  if not compressed:
    return os.path.getsize(path)
  total = 0
  try:
    with gzip.open(path, "rb") as f:
      for block in iter(lambda: f.read(1 << 20), b""):
        total += len(block)
  except (OSError, EOFError, zlib.error) as e:
    raise IdxError(
        "%s is not a valid gzip file (%s): it is corrupt or truncated; "
        "delete it (a download fetches it again) or replace it"
        % (path, e)) from None
  return total


def _read_header(path: str, compressed: bool, length: int) -> bytes:
  opener = gzip.open if compressed else open
  with opener(path, "rb") as f:
    return f.read(length)


def read_idx_header(path: str, kind: str) -> IdxFile:
  """Checks an IDX file of MNIST `kind` ('images' or 'labels').

  The magic number, the image size (28x28) and the record count must agree
  with the file's actual (decompressed) length, so a truncated file is caught
  here instead of giving a short epoch or a hang. Nothing proportional to the
  claimed count is allocated.

  Args:
    path: the file, gzipped or raw.
    kind: 'images' or 'labels'.

  Returns:
    An `IdxFile`.

  Raises:
    IdxError: naming the file, if it is not a valid IDX file of that kind.
    ValueError: if `kind` is neither 'images' nor 'labels'.
  """
  if kind not in ("images", "labels"):
    raise ValueError("expected kind 'images' or 'labels', got %r" % (kind,))
  compressed = _is_gzip(path)
  if kind == "images":
    magic_wanted, header_bytes = IMAGES_MAGIC, 16
    record_bytes = IMAGE_SIZE * IMAGE_SIZE
  else:
    magic_wanted, header_bytes, record_bytes = LABELS_MAGIC, 8, 1
  length = _payload_length(path, compressed)
  header = _read_header(path, compressed, header_bytes)
  if len(header) < header_bytes:
    raise IdxError(
        "%s holds %d bytes, fewer than an IDX %s header (%d bytes): it is "
        "truncated or not an MNIST file" % (path, len(header), kind,
                                            header_bytes))
  fields = struct.unpack(">%dI" % (header_bytes // 4), header)
  magic, count = fields[0], fields[1]
  if magic != magic_wanted:
    hint = ""
    if magic in (IMAGES_MAGIC, LABELS_MAGIC):
      hint = "; it looks like a %s file: are the files' names swapped?" % (
          "labels" if magic == LABELS_MAGIC else "images")
    raise IdxError(
        "%s has the bad magic number %d (0x%08x), expected %d for MNIST %s"
        "%s" % (path, magic, magic, magic_wanted, kind, hint or
                ": the file is corrupt or not an MNIST IDX file"))
  if kind == "images" and fields[2:] != (IMAGE_SIZE, IMAGE_SIZE):
    raise IdxError("%s holds %dx%d images, expected %dx%d (MNIST)"
                   % ((path,) + fields[2:] + (IMAGE_SIZE, IMAGE_SIZE)))
  expected = header_bytes + count * record_bytes
  if length != expected:
    raise IdxError(
        "%s has the wrong size: its header announces %d %s (%d bytes%s) but "
        "it holds %d bytes; it is %s, delete or replace it"
        % (path, count, kind, expected,
           " decompressed" if compressed else "", length,
           "truncated" if length < expected else "corrupt"))
  return IdxFile(path, count, header_bytes, record_bytes, compressed)


def _check_labels(labels: IdxFile) -> None:
  """Rejects label values outside [0, NUM_CLASSES) (the file is small)."""
  opener = gzip.open if labels.compressed else open
  with opener(labels.path, "rb") as f:
    values = f.read()[labels.header_bytes:]
  bad = max(values) if values else 0
  if bad >= NUM_CLASSES:
    raise IdxError("%s holds the label %d at position %d; MNIST labels are "
                   "0 to %d: the file is corrupt"
                   % (labels.path, bad, values.index(bad), NUM_CLASSES - 1))


def _find(data_dir: str, name: str) -> Optional[str]:
  """Returns the raw or gzipped file called `name` in `data_dir`, if any."""
  for candidate in (name, name + ".gz"):
    path = os.path.join(data_dir, candidate)
    if os.path.isfile(path):
      return path
  return None


def _missing_message(dataset: str, data_dir: str, name: str,
                     reason: str) -> str:
  what = "Fashion-MNIST" if dataset == "fashion_mnist" else "MNIST"
  advice = [
      "put the four %s IDX files (gzipped or raw) in --data_dir" % what,
      "run offline on synthetic images with --fake_data (throughput only)",
  ]
  if dataset == "fashion_mnist":
    advice.append("install Debian's dataset-fashion-mnist package "
                  "(apt-get install dataset-fashion-mnist puts the files in "
                  "%s)" % FASHION_MNIST_DIR)
  else:
    advice.append("use --dataset=fashion_mnist with Debian's "
                  "dataset-fashion-mnist package (apt-get install "
                  "dataset-fashion-mnist puts the files in %s)"
                  % FASHION_MNIST_DIR)
  return "%s file %s is not in --data_dir=%s and %s. Either %s." % (
      what, name, data_dir, reason, "; or ".join(advice))


def _locate(data_dir: str, name: str, dataset: str,
            mirrors: Sequence[str]) -> str:
  path = _find(data_dir, name)
  if path is not None:
    return path
  if dataset != "mnist":
    raise MissingDataError(_missing_message(
        dataset, data_dir, name, "Fashion-MNIST is never downloaded"))
  if not mirrors:
    raise MissingDataError(_missing_message(
        dataset, data_dir, name, "no download mirror was given"))
  gz = name + ".gz"
  try:
    return common.maybe_download([m + gz for m in mirrors],
                                 os.path.join(data_dir, gz),
                                 MNIST_SHA256[gz])
  except common.DownloadError as e:
    raise MissingDataError(_missing_message(
        dataset, data_dir, name, "the download failed (%s)" % e)) from None


def find_split(data_dir: str, split: str, dataset: str = "mnist",
               mirrors: Optional[Sequence[str]] = MNIST_MIRRORS
              ) -> Tuple[IdxFile, IdxFile]:
  """Returns the checked images and labels files of `split`.

  Files are looked for in `data_dir`, raw (``train-images-idx3-ubyte``)
  before gzipped (``train-images-idx3-ubyte.gz``). Missing MNIST files are
  downloaded into `data_dir` (cached there, SHA-256 checked, progress
  logged); Fashion-MNIST files are never downloaded.

  Args:
    data_dir: the directory holding the IDX files.
    split: 'train' or 'test'.
    dataset: 'mnist' or 'fashion_mnist'.
    mirrors: base URLs to download missing MNIST files from; empty or None
      for no download.

  Returns:
    ``(images, labels)``, two `IdxFile`.

  Raises:
    MissingDataError: if a file is absent and cannot be downloaded; the
      message names --data_dir, --fake_data and --dataset=fashion_mnist.
    IdxError: if a file is corrupt, or images and labels disagree.
    ValueError: if `split` or `dataset` is unknown.
  """
  _check_dataset(dataset)
  if split not in SPLITS:
    raise ValueError("expected split 'train' or 'test', got %r" % (split,))
  images_name, labels_name = SPLITS[split]
  images = read_idx_header(
      _locate(data_dir, images_name, dataset, mirrors or ()), "images")
  labels = read_idx_header(
      _locate(data_dir, labels_name, dataset, mirrors or ()), "labels")
  if images.count != labels.count:
    raise IdxError("%s holds %d images but %s holds %d labels; the two files "
                   "must come from the same split"
                   % (images.path, images.count, labels.path, labels.count))
  _check_labels(labels)
  logging.info("%s %s split: %d examples from %s", dataset, split,
               images.count, os.path.dirname(images.path))
  return images, labels


def normalize(images: tf.Tensor) -> tf.Tensor:
  """Maps uint8 pixels [0, 255] to float32 [-0.5, 0.5], train and eval alike.

  The one place pixels are scaled, so evaluation sees what training saw.
  """
  return tf.cast(images, tf.float32) * (1.0 / 255.0) - 0.5


def _records(f: IdxFile) -> tf.data.Dataset:
  return tf.data.FixedLengthRecordDataset(
      f.path, f.record_bytes, header_bytes=f.header_bytes,
      compression_type="GZIP" if f.compressed else "")


def _decode(image_bytes: tf.Tensor, label_bytes: tf.Tensor
           ) -> Tuple[tf.Tensor, tf.Tensor]:
  """Decodes a batch of records into [batch, 28, 28, 1] images and labels."""
  batch = image_bytes.shape  # Static when the batch size is.
  images = tf.io.decode_raw(image_bytes, tf.uint8)
  images = tf.reshape(images, [-1, IMAGE_SIZE, IMAGE_SIZE, 1])
  images.set_shape(batch.concatenate([IMAGE_SIZE, IMAGE_SIZE, 1]))
  labels = tf.reshape(tf.io.decode_raw(label_bytes, tf.uint8), [-1])
  labels.set_shape(batch)
  return normalize(images), tf.cast(labels, tf.int32)


def train_dataset(images: IdxFile, labels: IdxFile, batch_size: int, *,
                  shuffle_buffer: Optional[int] = None,
                  seed: Optional[int] = None) -> tf.data.Dataset:
  """Returns shuffled, repeated, batched, prefetched training examples.

  One pipeline for all towers: each tower's ``get_next`` takes the next
  batch, so N towers see N different batches per step and an epoch takes
  ``count / (batch_size * N)`` steps. Batches have the static size
  `batch_size` (the last, partial batch of the repeated stream never comes).
  Build it, and its iterator, under ``tf.device(INPUT_DEVICE)``. Like the
  other pipelines here it runs without tf.data's autotuning model, whose
  thread a closing session waits for (`common.without_autotune`).

  Args:
    images, labels: from `find_split`.
    batch_size: examples per batch (per tower).
    shuffle_buffer: examples in the shuffle buffer; default the whole split
      (a full shuffle; the buffer holds the undecoded bytes, 47 MB for
      MNIST).
    seed: the shuffle seed, for repeatable tests.
  """
  ds = tf.data.Dataset.zip((_records(images), _records(labels)))
  ds = ds.shuffle(shuffle_buffer or images.count, seed=seed,
                  reshuffle_each_iteration=True)
  ds = ds.repeat().batch(batch_size, drop_remainder=True)
  return common.without_autotune(
      ds.map(_decode).prefetch(tf.data.experimental.AUTOTUNE))


def eval_dataset(images: IdxFile, labels: IdxFile,
                 batch_size: int) -> tf.data.Dataset:
  """Returns every example of the split exactly once, in file order.

  No repeat, and the final batch may be partial (``drop_remainder=False``),
  so a pass over it counts exactly ``images.count`` examples.
  """
  ds = tf.data.Dataset.zip((_records(images), _records(labels)))
  return common.without_autotune(ds.batch(batch_size).map(_decode).prefetch(
      tf.data.experimental.AUTOTUNE))


def fake_dataset(batch_size: int, seed: int = 0) -> tf.data.Dataset:
  """Returns one random batch, repeated forever, for throughput runs.

  Images are uniform in [-0.5, 0.5] (already normalized) and labels uniform
  in [0, 10): nothing to learn, and nothing read from disk.
  """
  def make(_):
    images = tf.random.stateless_uniform(
        [batch_size, IMAGE_SIZE, IMAGE_SIZE, 1], [seed, 1], -0.5, 0.5)
    labels = tf.random.stateless_uniform([batch_size], [seed, 2], 0,
                                         NUM_CLASSES, dtype=tf.int32)
    return images, labels
  return common.without_autotune(
      tf.data.Dataset.range(1).map(make).cache().repeat().prefetch(
          tf.data.experimental.AUTOTUNE))
