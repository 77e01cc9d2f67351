"""Packaging for towers. TensorFlow is an extra so that installing towers
never replaces a TensorFlow already there (tensorflow-cpu, a GPU build)."""

import os
import re

from setuptools import find_packages, setup

HERE = os.path.dirname(os.path.abspath(__file__))


def _version():
  with open(os.path.join(HERE, "towers", "__init__.py")) as f:
    return re.search(r'^__version__ = "([^"]+)"', f.read(), re.M).group(1)


def _readme():
  with open(os.path.join(HERE, "README.md")) as f:
    return f.read()


setup(
    name="towers",
    version=_version(),
    description="In-graph multi-GPU data parallelism (the CIFAR-10 tower "
    "recipe) for TensorFlow 1.x-style graph-mode code",
    long_description=_readme(),
    long_description_content_type="text/markdown",
    packages=find_packages(include=["towers", "towers.*"]),
    # 3.7: TensorFlow 1.15.5's wheels (NVIDIA's 1.15 builds: 3.8).
    python_requires=">=3.7",
    install_requires=["numpy"],
    extras_require={
        # The bound is the minor after the newest release scripts/test.sh
        # tests: it rises once a release passes there, never ahead of one.
        # tensorboard: TensorFlow <= 2.20 brings the matching version, 2.21
        # no longer does; the range matches the TensorFlow range, and each of
        # TensorFlow 2.12-2.20 pins its own minor version.
        "tf": ["tensorflow>=2.12,<2.22", "tensorboard>=2.12,<2.22"],
        # TensorFlow 1.15 (Python 3.7): its protobuf bound is missing from
        # its own requirements, and a newer protobuf fails at import.
        "tf1": ["tensorflow>=1.15,<1.16", "protobuf<3.21"],
        # tf-slim: the tests train its layers' regularizers on towers.
        "test": ["pytest>=7", "tf-slim>=1.1"],
        "bench": ["matplotlib"],
    },
    classifiers=[
        "Programming Language :: Python :: 3",
        "Topic :: Scientific/Engineering :: Artificial Intelligence",
    ],
    # A plain license field: SPDX expressions need setuptools >= 77, which
    # Python 3.7 cannot install.
    license="Apache-2.0",
)
