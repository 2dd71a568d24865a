"""The data below training and export: what is known about each dataset (:mod:`.datasets`,
normalisation and class names, standard library only), the ``data:`` section
(:mod:`.config`), loading and partitioning over clients (:mod:`.loading`, with the MNIST family
in :mod:`.mnist`, several datasets as one in :mod:`.multidata` and the device classes' data in
:mod:`.device_partition`).

Importing this package imports neither torch nor pydantic (``nefl-zoo --help`` stays quick):
loading, which needs torch, is :func:`nefl_zoo.data.loading.load_data`.
"""

from .datasets import CIFAR10_CLASSES, CLASS_NAMES, MNIST_FAMILY, NORMALIZATION, DatasetNotFoundError, normalization, per_channel

__all__ = ["CIFAR10_CLASSES", "CLASS_NAMES", "DatasetNotFoundError", "MNIST_FAMILY", "NORMALIZATION", "normalization", "per_channel"]
