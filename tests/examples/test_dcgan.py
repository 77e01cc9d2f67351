"""The DCGAN example: two losses on two towers, and the picture it writes."""

import glob
import os
import re
import struct
import subprocess
import sys

import tensorflow.compat.v1 as tf

EXAMPLES = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..",
                                        "examples"))


def _png_size(data):
  assert data[:8] == b"\x89PNG\r\n\x1a\n"
  return struct.unpack(">II", data[16:24])  # IHDR: width, height.


def test_the_dcgan_trains_200_steps_and_writes_its_grid_of_digits(tmp_path):
  train_dir = str(tmp_path / "dcgan")
  done = subprocess.run(
      [sys.executable,
       os.path.join(EXAMPLES, "dcgan_mnist_multi_gpu_train.py"),
       "--num_gpus=2", "--fake_data", "--max_steps=200", "--batch_size=4",
       "--log_frequency=50", "--save_summaries_steps=100",
       "--train_dir=" + train_dir],
      env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2"), capture_output=True,
      text=True, timeout=600, check=False)
  assert done.returncode == 0, done.stderr[-3000:]
  assert "Traceback" not in done.stderr
  steps = re.findall(r"step (\d+), loss d = (\d+\.\d+), g = (\d+\.\d+) ",
                     done.stderr)
  assert [int(s) for s, _, _ in steps] == [50, 100, 150, 200], \
      done.stderr[-3000:]
  assert tf.train.latest_checkpoint(train_dir).endswith("model.ckpt-200")
  with open(os.path.join(train_dir, "generated.png"), "rb") as f:
    assert _png_size(f.read()) == (224, 224)  # 8 x 8 digits of 28 x 28.
  images, scalars = {}, set()
  for path in glob.glob(os.path.join(train_dir, "events.out.tfevents.*")):
    for event in tf.train.summary_iterator(path):
      for value in event.summary.value:
        if value.HasField("image"):
          images[event.step] = (value.tag, value.image.width,
                                value.image.height)
        else:
          scalars.add(value.tag)
  assert images[200] == ("generated/image", 224, 224), images
  assert {"loss/d", "loss/g"} <= scalars
  assert ("Wrote 64 generated samples (fake data: noise by design) to " +
          train_dir) in done.stderr
