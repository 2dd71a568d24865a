"""What is known about each image dataset, without loading any: normalisation and class names.

A leaf module (standard library only), shared by training (:mod:`nefl_zoo.fl.data`) and the
exporter (:mod:`nefl_zoo.export`), so that exporting does not import the training engine.
"""

from __future__ import annotations

# (mean, std) per channel of pixels scaled to [0, 1]; SVHN's are the NeFL appendix's.
NORMALIZATION: dict[str, tuple[tuple[float, float, float], tuple[float, float, float]]] = {
    "cifar10": ((0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)),
    "cifar100": ((0.5071, 0.4865, 0.4409), (0.2673, 0.2564, 0.2762)),
    "svhn": ((0.4376821, 0.4437697, 0.47280442), (0.19803012, 0.20101562, 0.19703614)),
    "cinic10": ((0.47889522, 0.47227842, 0.43047404), (0.24205776, 0.23828046, 0.25874835)),
    "imagefolder": ((0.485, 0.456, 0.406), (0.229, 0.224, 0.225)),
}

CIFAR10_CLASSES = ("airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck")
CLASS_NAMES: dict[str, tuple[str, ...]] = {
    "cifar10": CIFAR10_CLASSES,
    "cinic10": CIFAR10_CLASSES,
    "svhn": tuple(str(d) for d in range(10)),
}

__all__ = ["CIFAR10_CLASSES", "CLASS_NAMES", "NORMALIZATION"]
