"""Data that depends on the device: ``data.partition: devices``.

Each client holds what its device class's ``data`` says (:class:`~.config.ClassData`; the
client's class is the one the population deals it, :func:`device_kinds`):

1. **The class's images.** A class of ``N`` clients holding ``samples`` images each gets ``N x
   samples`` images, split over the labels in proportion to its mix ``labels`` (normalised; none:
   the training set's own mix), rounded by largest remainders: this is the class's label mix,
   exactly. Every label must have enough images for all the classes together (else a one-line
   error naming the label, what the classes ask and what the training set has); images no class
   asks for are held by no client.
2. **Its clients.** The class's images are dealt to its clients in client order, ``samples`` each:
   a client's label counts are its proportions times ``samples`` rounded by largest remainders
   (the class mix, or with ``alpha`` a draw from Dirichlet(alpha x the class mix) over the labels
   the class holds), as far as the class's images of each label go; what a label lacks comes from
   the labels with images left, in proportion to what is left (the last client takes the rest).
3. **The images.** Each label's training images are shuffled once (seeded with the run seed) and
   handed out in turn to the clients, in client order.

Everything derives from the run seed, so every method of a comparison sees the same partition.
``data.local_split`` then holds out part of each client's images, as for any partition.
"""

from __future__ import annotations

from typing import Protocol, Sequence

import numpy as np

from .config import ClassData


class DeviceClass(Protocol):
    """What the partition reads of a device class (the ``devices:`` section's classes,
    :class:`nefl_zoo.fl.devices.population.DeviceClass`): its share of the clients and its data."""

    share: float
    data: ClassData | None


class PartitionError(ValueError):
    """A device-class partition the training set cannot give: the config ``field`` to change and a one-line ``message``."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field, self.message = field, message


def largest_remainder(total: int, weights: np.ndarray) -> np.ndarray:
    """``total`` split in proportion to ``weights`` as integers summing to ``total``: each share
    floored, the units left to the largest remainders (ties: the lower index)."""
    weights = np.asarray(weights, dtype=np.float64)
    return _rounded(total * weights / weights.sum(), total)


def _rounded(exact: np.ndarray, total: int) -> np.ndarray:
    """``exact`` shares of ``total`` as integers summing to ``total``: floored, the units left to
    the largest remainders (ties: the lower index)."""
    counts = np.floor(exact).astype(np.int64)
    counts[np.argsort(-(exact - counts), kind="stable")[: total - int(counts.sum())]] += 1
    return counts


def class_mixes(classes: Sequence[DeviceClass], label_counts: np.ndarray) -> np.ndarray:
    """Each class's label mix (rows summing to 1): its ``data.labels`` normalised, or the training
    set's own mix (``label_counts``) for a class without them."""
    rows = []
    for i, c in enumerate(classes):
        labels = c.data.labels if c.data is not None else None
        if labels is not None and len(labels) != len(label_counts):
            raise PartitionError(f"devices.classes[{i}].data.labels",
                                 f"{len(labels)} weights, but the dataset has {len(label_counts)} labels: give one weight per label")
        weights = np.asarray(labels if labels is not None else label_counts, dtype=np.float64)
        rows.append(weights / weights.sum())
    return np.array(rows)


def class_label_counts(classes: Sequence[DeviceClass], clients: np.ndarray, label_counts: np.ndarray) -> np.ndarray:
    """``(classes, labels)``: the images of each label each class holds (its ``clients`` x
    ``samples`` split by its mix, largest remainders); a one-line :class:`PartitionError` when the
    classes ask for more images of a label than the training set has."""
    mixes = class_mixes(classes, label_counts)
    counts = np.array([largest_remainder(int(n) * c.data.samples, m) for c, n, m in zip(classes, clients, mixes)])
    need = counts.sum(0)
    short = np.flatnonzero(need > label_counts)
    if short.size:
        y = int(short[0])
        raise PartitionError("devices.classes", f"label {y}: the classes' clients ask for {int(need[y]):,} images, the training set has "
                             f"{int(label_counts[y]):,}; lower data.samples or label {y}'s weight in data.labels")
    return counts


def _client_counts(pool: np.ndarray, clients: int, samples: int, mix: np.ndarray, alpha: float | None,
                   rng: np.random.Generator) -> np.ndarray:
    """``(clients, labels)``: a class's ``pool`` (images per label) dealt to its clients, ``samples`` each."""
    remaining = pool.copy()
    held = np.flatnonzero(mix > 0)
    out = np.zeros((clients, len(pool)), dtype=np.int64)
    for k in range(clients):
        proportions = mix
        if alpha is not None:
            draw = rng.dirichlet(alpha * mix[held])
            if np.isfinite(draw).all() and draw.sum() > 0:
                proportions = np.zeros_like(mix)
                proportions[held] = draw
        take = np.minimum(largest_remainder(samples, proportions), remaining)
        short = samples - int(take.sum())
        if short:
            take += largest_remainder(short, remaining - take)
        remaining -= take
        out[k] = take
    return out


def device_partition(targets: np.ndarray, num_classes: int, kinds: np.ndarray, classes: Sequence[DeviceClass],
                     seed: int) -> list[np.ndarray]:
    """Each client's training indices (sorted) when its device class shapes its data (see the
    module docstring); ``kinds`` is every client's class index, ``classes`` the ``devices``
    section's classes, every one with ``data``."""
    label_counts = np.bincount(targets, minlength=num_classes)
    members = [np.flatnonzero(kinds == i) for i in range(len(classes))]
    pools = class_label_counts(classes, np.array([len(m) for m in members]), label_counts)
    mixes = class_mixes(classes, label_counts)
    counts = np.zeros((len(kinds), num_classes), dtype=np.int64)
    for i, (c, who) in enumerate(zip(classes, members)):
        counts[who] = _client_counts(pools[i], len(who), c.data.samples, mixes[i], c.data.alpha, np.random.default_rng([seed, 11, i]))
    rng = np.random.default_rng([seed, 12])
    parts: list[list[np.ndarray]] = [[] for _ in kinds]
    for y in range(num_classes):
        images = rng.permutation(np.flatnonzero(targets == y))
        ends = np.cumsum(counts[:, y])
        for client, (start, end) in enumerate(zip(ends - counts[:, y], ends)):
            parts[client].append(images[start:end])
    return [np.sort(np.concatenate(p)) for p in parts]


def device_kinds(classes: Sequence[DeviceClass], num_clients: int, seed: int) -> np.ndarray:
    """The class index of every client: each class takes ``share`` of the clients (largest
    remainders), dealt by a shuffle seeded with the run seed."""
    counts = _rounded(np.array([c.share * num_clients for c in classes]), num_clients)
    order = np.random.default_rng([seed, 1]).permutation(num_clients)
    kind = np.empty(num_clients, dtype=np.int64)
    kind[order] = np.repeat(np.arange(len(classes)), counts)
    return kind
