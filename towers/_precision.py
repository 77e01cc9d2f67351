"""Mixed precision: towers compute in float16 or bfloat16 on float32 weights.

The TF1 recipe (NVIDIA's mixed-precision guide, tf_cnn_benchmarks): a model
asks ``tf.get_variable`` for its weights in the compute dtype, and a custom
getter keeps each one in float32 (the master weight: what is saved, averaged
and updated) and hands the model a cast of it. The cast is built in the
tower, so it runs on the tower's device and the float32 value is what
crosses from the variable's device. Variables asked for in float32 (batch-norm
parameters and statistics, which ``tf.layers`` keeps in float32 for half
inputs) are left alone, and so are non-trainable ones: a cast cannot be
assigned to.
"""

import contextlib
from typing import Iterator, Optional, Union

import numpy as np
import tensorflow.compat.v1 as tf

ComputeDtype = Union[None, str, tf.DType]

_HALF = (tf.float16, tf.bfloat16)


def check_compute_dtype(compute_dtype: ComputeDtype) -> Optional[tf.DType]:
  """Returns the compute dtype as a half dtype, or None for float32.

  Raises:
    ValueError: for anything but None, float32, float16 or bfloat16.
  """
  if compute_dtype is None:
    return None
  try:
    dtype = tf.as_dtype(compute_dtype)
  except TypeError:
    dtype = None
  if dtype == tf.float32:
    return None
  if dtype not in _HALF:
    raise ValueError(
        "expected compute_dtype to be 'float16' (GPUs), 'bfloat16' (CPUs, "
        "TPU-era GPUs), 'float32' or None, got %r" % (compute_dtype,))
  return dtype


@contextlib.contextmanager
def master_weights(compute_dtype: Optional[tf.DType]) -> Iterator[None]:
  """Keeps the trainable variables asked for in `compute_dtype` in float32.

  Within this scope, ``tf.get_variable(..., dtype=compute_dtype)`` (and
  ``tf.compat.v1.layers`` on half inputs) creates or reuses a float32
  variable of that name and returns it cast to `compute_dtype`. With None it
  does nothing.
  """
  if compute_dtype is None:
    yield
    return

  def cast_getter(getter, name, *args, **kwargs):
    dtype = kwargs.get("dtype")
    if (dtype is None or tf.as_dtype(dtype).base_dtype != compute_dtype or
        kwargs.get("trainable") is False):
      return getter(name, *args, **kwargs)
    kwargs["dtype"] = tf.float32
    initializer = kwargs.get("initializer")
    # A value as initializer (not a function of shape and dtype) sets the
    # variable's dtype itself: widen it.
    if isinstance(initializer, tf.Tensor):
      kwargs["initializer"] = tf.cast(initializer, tf.float32)
    elif initializer is not None and not callable(initializer):
      kwargs["initializer"] = np.asarray(initializer, np.float32)
    variable = getter(name, *args, **kwargs)
    return tf.cast(variable, compute_dtype, name="%s_%s" % (
        name.rsplit("/", 1)[-1], compute_dtype.name))

  with tf.variable_scope(tf.get_variable_scope(), custom_getter=cast_getter,
                         auxiliary_name_scope=False):
    yield
