"""Benchmarks of `towers` against one device, the original recipe and TF2.

  python -m benchmarks.run --out=/tmp/towers_bench
  python -m benchmarks.run --quick --out=/tmp/towers_bench_quick

Speed of the example models (MNIST and CIFAR-10 CNNs) on synthetic in-memory
batches, trained as a plain single-device graph, on `towers`, on the same
towers averaged the original tutorial's way, and with TF2's
``tf.distribute.MirroredStrategy``; time and peak memory of
`towers.average_gradients` against the original's on a large gradient set;
graph build time and op count against the number of towers; gradient
packing against none, on a model of many small variables and by the size of
a gradient; synchronized batch norm (`towers.batch_normalization`) against
per-tower ``tf.compat.v1.layers.batch_normalization``. See
docs/performance.md. Not part of the `towers` library.
"""
