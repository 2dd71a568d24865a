"""The batches of local training, evaluation and BN recompute, on the computing device.

:func:`shuffled_batches` gives exactly the batches of ``DataLoader(dataset, batch_size,
shuffle=True, generator=seeded)`` epoch after epoch, augmentation drawn from torch's global RNG
as the dataset's transform would. For in-memory images (:class:`~nefl_zoo.data.loading.TensorImages`,
e.g. digits, or a subset of them) whose transform is none or a zero-padded square
``RandomCrop``, the images are kept on the device once and each batch is gathered and cropped
there as one tensor operation, with the same shuffling and the same crop offsets drawn in the
same order from the same RNGs, so the tensors are bit-identical to the DataLoader's (tested);
any other dataset goes through the DataLoader and its batches are moved to the device.
"""

from __future__ import annotations

from typing import Iterator

import torch
from torch.utils.data import DataLoader, Dataset, Subset

from ...data.loading import TensorImages

Batch = tuple[torch.Tensor, torch.Tensor]


def _crop_padding(transform) -> int | None:
    """The padding of a crop this module reproduces (0: no transform), else ``None``."""
    if transform is None:
        return 0
    from torchvision.transforms import v2

    if type(transform) is not v2.RandomCrop or transform.padding_mode != "constant" or transform.pad_if_needed:
        return None
    pads = set(transform.padding or (0,))
    fill = transform.fill if not isinstance(transform.fill, dict) else set(transform.fill.values())
    if len(pads) != 1 or fill not in (0, {0}, {None}) or transform.size[0] != transform.size[1]:
        return None
    return pads.pop()


def _resident(dataset: Dataset) -> tuple[TensorImages, torch.Tensor | None, int] | None:
    """``(images, indices or None, crop padding)`` when ``dataset`` can be batched on the device."""
    indices = None
    if isinstance(dataset, Subset):
        indices, dataset = torch.as_tensor(dataset.indices, dtype=torch.int64), dataset.dataset
    if type(dataset) is not TensorImages:
        return None
    pad = _crop_padding(dataset.transform)
    return None if pad is None else (dataset, indices, pad)


def _gather(images: TensorImages, device: torch.device, rows: torch.Tensor, pad: int) -> Batch:
    """The batch of ``rows`` (indices into ``images``), randomly cropped when ``pad``: per image a
    top then a left offset from torch's global RNG, as ``v2.RandomCrop`` draws them."""
    x_all, y_all = images.resident(device, pad)
    rows_d = rows.to(device)
    if not pad:
        return x_all[rows_d], y_all[rows_d]
    size = images.images.shape[-1]
    offsets = torch.randint(0, 2 * pad + 1, (len(rows), 2)).to(device)  # top, left of image 0, then image 1, ...
    span = torch.arange(size, device=device)
    top = (offsets[:, 0, None] + span)[:, None, :, None]
    left = (offsets[:, 1, None] + span)[:, None, None, :]
    channels = torch.arange(x_all.shape[1], device=device)[None, :, None, None]
    return x_all[rows_d[:, None, None, None], channels, top, left], y_all[rows_d]


def shuffled_batches(dataset: Dataset, batch_size: int, seed: int, epochs: int = 1,
                     device: torch.device | str = "cpu", min_batch: int = 1, merge: bool = False) -> Iterator[Batch]:
    """``epochs`` epochs of ``dataset`` shuffled by a generator seeded with ``seed``, as
    ``DataLoader(shuffle=True)`` gives them, on ``device``; run it under the caller's seeded RNG
    (augmentation draws from torch's global RNG while the batches are produced).

    An epoch's last batch with fewer than ``min_batch`` samples is dropped, or with ``merge``
    joined to the batch before it (an epoch that is one such batch is dropped either way). A
    dropped batch is still drawn, augmentation included, so the RNG streams and the other
    batches are the same for every ``min_batch``."""
    device = torch.device(device)
    generator = torch.Generator().manual_seed(seed)
    resident = _resident(dataset)
    if resident is None:
        n = len(dataset)
    else:
        images, indices, pad = resident
        n = len(indices) if indices is not None else len(images)
    count = -(-n // batch_size)
    small = count > 0 and n - (count - 1) * batch_size < min_batch  # the epoch's last batch is below min_batch
    if resident is None:
        loader = DataLoader(dataset, batch_size=batch_size, shuffle=True, generator=generator)
        for _ in range(epochs):
            yield from _last_batch_rule(((x.to(device), y.to(device)) for x, y in loader), count, small, merge)
        return
    for _ in range(epochs):
        torch.empty((), dtype=torch.int64).random_(generator=generator)  # the DataLoader's per-epoch base seed
        order = torch.randperm(n, generator=generator)
        torch.randperm(n, generator=generator)  # RandomSampler draws (and drops) one more at the epoch's end
        parts = (_gather(images, device, indices[part] if indices is not None else part, pad) for part in order.split(batch_size))
        yield from _last_batch_rule(parts, count, small, merge)


def _last_batch_rule(batches: Iterator[Batch], count: int, small: bool, merge: bool) -> Iterator[Batch]:
    """One epoch's ``count`` batches with its last one, when ``small``, merged into the one
    before (``merge``, and there is one) or dropped; the count is known in advance, so no batch
    is drawn early."""
    held = None
    for i, batch in enumerate(batches):
        if small and merge and i == count - 2:
            held = batch
        elif small and i == count - 1:
            if held is not None:
                yield torch.cat((held[0], batch[0])), torch.cat((held[1], batch[1]))
        else:
            yield batch


def ordered_batches(dataset: Dataset, batch_size: int, device: torch.device | str = "cpu") -> Iterator[Batch]:
    """``dataset`` in order, as ``DataLoader(dataset, batch_size)`` gives it, on ``device``."""
    device = torch.device(device)
    resident = _resident(dataset)
    if resident is None or resident[2]:
        for x, y in DataLoader(dataset, batch_size=batch_size):
            yield x.to(device), y.to(device)
        return
    images, indices, _ = resident
    rows = indices if indices is not None else torch.arange(len(images))
    for part in rows.split(batch_size):
        yield _gather(images, device, part, 0)
