"""Every Python snippet of the README and docs/ runs as written, to the end.

Each snippet runs in a fresh process after a prelude that defines what
snippets take as given (``opt``, ``batch``, a ``model_fn``, ...), then an
epilogue that trains what it built on virtual CPU devices for a few steps
(the loss must fall) or runs what it computes. Snippets that run a session
themselves run as they are. Every run is under an operation timeout and a
process timeout: a snippet that would hang fails. TensorFlow's C++ log is on,
and none may warn of an op changed after the session ran (an init op made
too late).
"""

import glob
import importlib.util
import os
import re
import subprocess
import sys
import textwrap

import pytest
import tensorflow as tf2

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")

PRELUDE = textwrap.dedent("""
    import sys
    import numpy as np
    import tensorflow.compat.v1 as tf
    import towers
    tf.disable_eager_execution()
    sys.path.insert(0, %r)
    import mnist_model
    rng = np.random.RandomState(0)
    images = tf.constant(rng.rand(32, 784).astype(np.float32))
    labels = tf.constant(rng.randint(0, 10, 32).astype(np.int64))
    batch = (images, labels)
    opt = tf.train.GradientDescentOptimizer(0.01)

    def tower_loss(images, labels):
      w = tf.get_variable("w", [784, 10], initializer=tf.zeros_initializer())
      return tf.losses.sparse_softmax_cross_entropy(labels,
                                                    tf.matmul(images, w))

    def model_fn(scope, images, labels):
      del scope
      return tower_loss(images, labels)
    """) % os.path.join(ROOT, "examples")

# What a snippet's epilogue runs in a session of 4 virtual CPU devices.
EPILOGUE = textwrap.dedent("""
    if "train_op" not in globals() and "logits" not in globals():
      train_op, t = towers.minimize(model_fn, opt, 4, inputs=batch)
    feeds = {}
    for op in tf.get_default_graph().get_operations():
      if op.type == "Placeholder":
        value = op.outputs[0]
        shape = [8 if d is None else d for d in value.shape.as_list()]
        feeds[value] = rng.rand(*shape).astype(value.dtype.as_numpy_dtype)
    config = towers.virtual_cpu_config(4, operation_timeout_in_ms=60000)
    init = tf.global_variables_initializer()
    local_init = tf.local_variables_initializer()
    with tf.Session(config=config) as sess:
      sess.run(init)
      sess.run(local_init)
      if "train_op" in globals():
        first = sess.run(t.loss, feeds)
        for _ in range(5):
          sess.run(train_op, feeds)
        last = sess.run(t.loss, feeds)
        assert last < first, (first, last)
      else:
        assert sess.run(logits, feeds).shape[0] == 8
    """)

# Snippets that need more than the prelude, by a line of theirs.
SETUPS = {
    # Convolutions: image-shaped inputs.
    'tf.layers.conv2d(images, 32, 3, padding="same"': textwrap.dedent("""
        images = tf.constant(rng.rand(16, 8, 8, 1).astype(np.float32))
        labels = tf.constant(rng.randint(0, 10, 16).astype(np.int64))
        """),
    # A cluster of one worker, with its server on loopback.
    "num_workers=W": textwrap.dedent("""
        from towers.training import free_ports
        port = free_ports(1)[0]
        server = tf.train.Server(
            tf.train.ClusterSpec({"worker": ["127.0.0.1:%d" % port]}),
            job_name="worker", task_index=0,
            config=towers.virtual_cpu_config(2))
        task_index, num_workers, towers_per_worker = 0, 1, 2
        global_step = tf.train.get_or_create_global_step()
        """),
    # Accumulation: towers that each read their own batch.
    "accumulate_steps=4": textwrap.dedent("""
        num_gpus = 2
        global_step = tf.train.get_or_create_global_step()
        next_batch = tf.data.make_one_shot_iterator(
            tf.data.Dataset.from_tensors(batch).repeat()).get_next
        """),
    # Several losses: a generator, a discriminator, noise beside the images.
    "discriminator(images)": textwrap.dedent("""
        z_dim = 8
        z = tf.constant(rng.randn(32, z_dim).astype(np.float32))
        batches = [(rng.rand(64, 784).astype(np.float32),
                    rng.randn(64, z_dim).astype(np.float32))] * 3
        d_opt = tf.train.MomentumOptimizer(0.05, 0.9)
        g_opt = tf.train.GradientDescentOptimizer(0.05)

        def generator(z):
          with tf.variable_scope("generator"):
            return tf.tanh(tf.matmul(z, tf.get_variable("w", [8, 784])))

        def discriminator(x):
          with tf.variable_scope("discriminator", reuse=tf.AUTO_REUSE):
            return tf.matmul(x, tf.get_variable("w", [784, 1]))

        def xent(logits, label):
          return tf.reduce_mean(tf.nn.sigmoid_cross_entropy_with_logits(
              labels=tf.fill(tf.shape(logits), label), logits=logits))
        """),
    # The runner's pieces: a training directory of its own.
    "with training.TrainDir(train_dir) as guard:": textwrap.dedent("""
        import tempfile
        from towers import training
        train_dir = tempfile.mkdtemp()
        """),
    # Fine-tuning: a pretrained checkpoint of bert/, a model with a new head.
    "tf.train.init_from_checkpoint(pretrained, assignment_map)":
        textwrap.dedent("""
        import os
        import tempfile

        def model_fn(scope, images, labels):
          del scope
          with tf.variable_scope("bert"):
            hidden = tf.tanh(tf.matmul(images, tf.get_variable("w", [784, 16])))
          with tf.variable_scope("head"):
            w = tf.get_variable("w", [16, 10])
          return tf.losses.sparse_softmax_cross_entropy(labels,
                                                        tf.matmul(hidden, w))

        checkpoint_dir = tempfile.TemporaryDirectory()
        with tf.Graph().as_default():
          tf.get_variable("bert/w", [784, 16])
          with tf.Session() as sess:
            sess.run(tf.global_variables_initializer())
            pretrained = tf.train.Saver().save(
                sess, os.path.join(checkpoint_dir.name, "model.ckpt"))
        """),
    # A Keras model per program, for towers.testing: a global batch.
    "def make_model_fn():": textwrap.dedent("""
        rng = np.random.RandomState(0)
        x = rng.rand(12, 784).astype(np.float32)
        y = rng.randint(0, 10, 12)
        """),
}
EPILOGUES = {
    # It asserts by itself.
    "testing.assert_matches_one_device(": "\n",
    "train_ops[key] = opt.apply_gradients": textwrap.dedent("""
        init = tf.global_variables_initializer()
        with tf.Session(config=towers.virtual_cpu_config(2)) as sess:
          sess.run(init)
          first = sess.run(t.loss)
          for _ in range(5):
            sess.run(train_ops["d"])
          last = sess.run(t.loss)
        assert last["d"] < first["d"], (first, last)
        """),
    "tf.estimator.Estimator(": textwrap.dedent("""
        def input_fn():
          x = np.random.RandomState(0).rand(32, 8).astype(np.float32)
          y = np.random.RandomState(1).randint(0, 10, 32).astype(np.int32)
          return tf.data.Dataset.from_tensor_slices(({"x": x}, y)).batch(8)

        estimator.train(input_fn, steps=4)
        saved = [n for n, _ in tf.train.list_variables(estimator.model_dir)]
        assert not any(n.startswith("replica_") for n in saved), saved
        estimator.evaluate(input_fn, steps=1)
        """),
    "num_workers=W": textwrap.dedent("""
        config = towers.virtual_cpu_config(2, operation_timeout_in_ms=60000)
        config.experimental.collective_group_leader = (
            "/job:worker/replica:0/task:0")
        with tf.train.MonitoredTrainingSession(
            master=server.target, is_chief=True, scaffold=scaffold,
            config=config) as sess:
          first = sess.run(t.loss)
          for _ in range(5):
            sess.run(train_op)
          last = sess.run(t.loss)
        assert last < first, (first, last)
        """),
}


def _snippets():
  paths = [os.path.join(ROOT, "README.md")] + sorted(
      glob.glob(os.path.join(ROOT, "docs", "*.md")))
  for path in paths:
    with open(path) as f:
      text = f.read()
    for match in re.finditer(r"^```python\n(.*?)^```", text, re.S | re.M):
      line = text.count("\n", 0, match.start()) + 1
      yield "%s:%d" % (os.path.relpath(path, ROOT), line), match.group(1)


SNIPPETS = dict(_snippets())


def _program(code):
  setup = "".join(s for key, s in SETUPS.items() if key in code)
  if "tf.Session(" in code:
    epilogue = ""  # It runs itself.
  else:
    epilogue = "".join(e for key, e in EPILOGUES.items() if key in code) \
        or EPILOGUE
  return PRELUDE + setup + code + epilogue + '\nprint("snippet ran")\n'


def test_the_docs_have_snippets():
  assert len(SNIPPETS) >= 10


@pytest.mark.parametrize("where", sorted(SNIPPETS))
def test_snippet_runs_to_the_end(where):
  code = SNIPPETS[where]
  keras_3 = tuple(map(int, tf2.__version__.split(".")[:2])) >= (2, 16)
  legacy = "tf.layers." in code or "tf.keras." in code
  if legacy and keras_3 and importlib.util.find_spec("tf_keras") is None:
    pytest.skip("TensorFlow %s has Keras 3 and tf_keras is not installed"
                % tf2.__version__)
  if "tf.estimator." in code and not hasattr(tf2.compat.v1, "estimator"):
    pytest.skip("tf.estimator was removed in TensorFlow 2.16 (this is %s)"
                % tf2.__version__)
  done = _run(_program(code))
  assert done.returncode == 0, "%s failed:\n%s" % (where, done.stderr[-3000:])
  assert done.stdout.rstrip().endswith("snippet ran")
  # Documented code runs clean: no op is made after the session has run.
  assert CHANGED_AFTER_RUN not in done.stderr, done.stderr[-3000:]


# TensorFlow's warning for an op changed after a session ran its graph (an
# initializer made after the first run marks the ops it groups).
CHANGED_AFTER_RUN = "was changed by setting attribute after it was run"


def _run(program):
  """Runs `program` in a process of its own, TensorFlow's C++ log on."""
  env = dict(os.environ, TF_USE_LEGACY_KERAS="1", TF_CPP_MIN_LOG_LEVEL="0")
  return subprocess.run([sys.executable, "-c", program], env=env,
                        capture_output=True, text=True, timeout=300,
                        check=False)


def _snippet(line):
  """The one snippet that has `line`."""
  found = [code for code in SNIPPETS.values() if line in code]
  assert len(found) == 1, line
  return found[0]


def test_the_quick_start_runs_clean_in_the_replicated_mode():
  code = _snippet("import towers\n\ntf.disable_eager_execution()")
  replicated = code.replace("inputs=(images, labels),",
                            'inputs=(images, labels), variable_device='
                            '"replicated",')
  assert replicated != code
  done = _run(replicated + '  print("loss", loss)\n')
  assert done.returncode == 0, done.stderr[-3000:]
  assert done.stdout.startswith("loss ")
  assert CHANGED_AFTER_RUN not in done.stderr, done.stderr[-3000:]


def test_the_runner_loop_logs_each_line_once_in_a_plain_script():
  # The api.md loop in a plain script, no absl.app.run: its documented
  # verbosity shows the step lines, and nothing adds a handler to the root
  # logger (which would print every TensorFlow line twice).
  setup = "with training.TrainDir(train_dir) as guard:"
  code = _snippet(setup)
  assert code.startswith("tf.logging.set_verbosity(tf.logging.INFO)")
  done = _run(PRELUDE + SETUPS[setup] + code +
              "import logging\nprint(len(logging.getLogger().handlers))\n")
  assert done.returncode == 0, done.stderr[-3000:]
  assert done.stdout.split() == ["0"]
  lines = [line for line in done.stderr.splitlines()
           if line.startswith(("INFO:tensorflow:", "WARNING:tensorflow:"))]
  steps = [line for line in lines if line.startswith("INFO:tensorflow:step ")]
  assert [s.split(",")[0] for s in steps] == [
      "INFO:tensorflow:step 10", "INFO:tensorflow:step 20"], done.stderr
  saved = [line for line in lines if line.startswith(
      "INFO:tensorflow:Saving checkpoints for 20 into ")]
  assert len(saved) == 1, lines
  assert len(lines) == len(set(lines)), lines
