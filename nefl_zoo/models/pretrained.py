"""Load torchvision (ResNet, Wide-ResNet) and timm (ViT) weights into zoo models.

Every weights file, local or from a cache, goes through one loader, :func:`read_weights`: the
file is read once into memory, its hash checked where the source publishes one, and those same
bytes decoded as tensors only: safetensors, or ``torch.load(..., weights_only=True)``, which
refuses any pickled object but tensors and plain containers (no code runs). A file that holds
anything else, or cannot be decoded, is a one-line :class:`PretrainedError` naming it.

* ``torchvision:NAME``: the file torchvision publishes for ``NAME``'s default weights, from
  torch.hub's cache (``torch.hub.get_dir()/checkpoints``; downloaded there when absent). Its
  name carries the sha256 prefix (``resnet18-f37072fd.pth``), checked as torch.hub does.
* ``timm:NAME``: timm's weights for ``NAME`` from the Hugging Face cache (``model.safetensors``,
  else ``pytorch_model.bin``; downloaded when absent), checked against the sha256 the cache
  names its blob by; or, for weights timm publishes by URL only, as ``torchvision:``.
"""

from __future__ import annotations

import hashlib
import io
import os
import pickle
import re
from pathlib import Path
from typing import Mapping
from urllib.parse import urlparse

import torch

from .base import NestedNet

_HUB_HASH = re.compile(r"-([0-9a-f]{8,64})\.")  # torch.hub's check_hash convention: NAME-<sha256 prefix>.EXT
_HF_FILES = ("model.safetensors", "pytorch_model.bin")


class PretrainedError(ValueError):
    """Raised when weights cannot be loaded into a model."""


def _first_line(exc: BaseException) -> str:
    """The gist of ``exc`` on one line (for torch's weights-only refusals, the refused item)."""
    text = str(exc).strip()
    refused = re.search(r"Unsupported global: GLOBAL (\S+)", text)
    if refused:
        return f"it names {refused.group(1)}"
    detail = re.search(r"WeightsUnpickler error:\s*(.+)", text)
    if detail:
        return detail.group(1).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _check_hash(data: bytes, path: Path, expected: tuple[str, str] | None) -> None:
    """``expected``: ``("sha256", hex prefix or whole)`` or ``("git-blob", sha1)``."""
    if expected is None:
        return
    kind, want = expected
    if kind == "git-blob":
        digest = hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()
    else:
        digest = hashlib.sha256(data).hexdigest()
    if not digest.startswith(want):
        raise PretrainedError(
            f"{path}: {kind} {digest[:len(want)]} does not match the published {want}; the file is damaged or was "
            "replaced (delete it to download it again)"
        )


def _decode(data: bytes, path: Path, safetensors: bool) -> dict[str, torch.Tensor]:
    if safetensors:
        from safetensors.torch import load

        try:
            return load(data)
        except Exception as exc:  # noqa: BLE001 - SafetensorError, or a Rust panic on a bad header
            raise PretrainedError(f"{path}: not a readable safetensors file ({_first_line(exc)})") from None
    try:
        state = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        if "Unsupported global" in str(exc):
            raise PretrainedError(
                f"{path}: refused: it holds Python objects besides tensors ({_first_line(exc)}); "
                "give a state dict of tensors (.pth saved from model.state_dict(), or .safetensors)"
            ) from None
        raise PretrainedError(f"{path}: not a readable PyTorch weights file ({_first_line(exc)})") from None
    except MemoryError:
        raise
    except Exception as exc:  # noqa: BLE001 - a truncated or foreign file fails in many ways
        raise PretrainedError(f"{path}: not a readable PyTorch weights file ({type(exc).__name__}: {_first_line(exc)})") from None
    for wrapper in ("state_dict", "model"):
        if isinstance(state, dict) and isinstance(state.get(wrapper), dict):
            state = state[wrapper]
    if not isinstance(state, dict):
        raise PretrainedError(f"{path}: expected a state_dict, got {type(state).__name__}")
    return state


def _check_tensors(state: Mapping, source: str) -> dict[str, torch.Tensor]:
    for key, value in state.items():
        if not isinstance(key, str) or not isinstance(value, torch.Tensor):
            raise PretrainedError(
                f"{source}: entry {key!r} is a {type(value).__name__}, not a tensor; weights map parameter names to tensors"
            )
    return dict(state)


def read_weights(path: str | Path, expected_hash: tuple[str, str] | None = None) -> dict[str, torch.Tensor]:
    """The tensors of a weights file, read once, hash-checked (``expected_hash``, see
    :func:`_check_hash`) and decoded from those bytes as tensors only: safetensors by the
    ``.safetensors`` suffix, else PyTorch's format."""
    path = Path(path)
    if not path.is_file():
        raise PretrainedError(f"{path}: no such weights file (give a .pth/.pt/.safetensors file)")
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise PretrainedError(f"{path}: cannot read it ({exc.strerror or exc})") from None
    _check_hash(data, path, expected_hash)
    state = _decode(data, path, path.suffix == ".safetensors")
    return _check_tensors(state, str(path))


def _hub_file(url: str, label: str) -> tuple[Path, tuple[str, str] | None]:
    """A file published at ``url``, from torch.hub's cache (downloaded there, hash-checked,
    when absent), and the sha256 prefix its name carries."""
    filename = os.path.basename(urlparse(url).path)
    path = Path(torch.hub.get_dir()) / "checkpoints" / filename
    found = _HUB_HASH.search(filename)
    prefix = found.group(1) if found else None
    if not path.is_file():
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            torch.hub.download_url_to_file(url, str(path), hash_prefix=prefix, progress=False)
        except Exception as exc:  # noqa: BLE001 - URLError, OSError, a hash mismatch (RuntimeError)
            raise PretrainedError(
                f"{label}: cannot download {url} ({_first_line(exc)}); without a network, put the file at {path}"
            ) from None
    return path, ("sha256", prefix) if prefix else None


def _hf_file(repo: str, revision: str | None, label: str) -> tuple[Path, tuple[str, str] | None]:
    """timm's weights file of Hugging Face ``repo`` (cached, else downloaded) and the hash the
    cache names its blob by (sha256 for LFS files)."""
    from huggingface_hub import constants, hf_hub_download, try_to_load_from_cache
    from huggingface_hub.errors import EntryNotFoundError

    path = None
    for filename in _HF_FILES:
        cached = try_to_load_from_cache(repo, filename, cache_dir=constants.HF_HUB_CACHE, revision=revision)
        if isinstance(cached, str):
            path = Path(cached)
            break
    problem = "no weights file"
    for filename in _HF_FILES if path is None else ():
        try:
            path = Path(hf_hub_download(repo, filename, revision=revision))
            break
        except EntryNotFoundError:
            continue  # the repository has the other file
        except Exception as exc:  # noqa: BLE001 - offline, HTTP errors
            problem = _first_line(exc)
            break
    if path is None:
        raise PretrainedError(f"{label}: cannot get {repo} from the Hugging Face hub ({problem}); give a local file")
    blob = path.resolve().name
    if re.fullmatch(r"[0-9a-f]{64}", blob):
        return path, ("sha256", blob)
    if re.fullmatch(r"[0-9a-f]{40}", blob):
        return path, ("git-blob", blob)
    return path, None


def _read_state_dict(source: str | Path) -> dict[str, torch.Tensor]:
    text = str(source)
    if text.startswith("torchvision:"):
        import torchvision

        name = text.split(":", 1)[1]
        try:
            weights = torchvision.models.get_model_weights(name).DEFAULT
        except (ValueError, KeyError, AttributeError) as exc:
            raise PretrainedError(f"{text}: no torchvision weights for {name!r} ({_first_line(exc)})") from None
        path, expected = _hub_file(weights.url, text)
        return read_weights(path, expected)
    if text.startswith("timm:"):
        import timm

        name = text.split(":", 1)[1]
        try:
            cfg = timm.models.get_pretrained_cfg(name, allow_unregistered=False)
        except RuntimeError as exc:
            raise PretrainedError(f"{text}: no timm weights ({_first_line(exc)})") from None
        if cfg.hf_hub_id:
            repo, _, revision = cfg.hf_hub_id.partition("@")
            path, expected = _hf_file(repo, revision or None, text)
        elif cfg.url and not cfg.custom_load:
            path, expected = _hub_file(cfg.url, text)
        else:
            raise PretrainedError(f"{text}: timm publishes these weights in a format only timm reads; give a local file")
        return read_weights(path, expected)  # the cache's file name keeps its suffix (blobs are linked)
    return read_weights(source)


def load_pretrained(
    model: NestedNet, source: str | Path | Mapping[str, torch.Tensor]
) -> list[str]:
    """Copy a torchvision/timm state dict into a full-size zoo ``model``.

    ``source`` is a state dict, a file (``.pth``, ``.pt``, ``.safetensors``) or
    ``torchvision:NAME`` / ``timm:NAME`` (from the torch.hub / Hugging Face cache, downloaded
    when absent; hash-checked). Files are read as tensors only (see the module docstring).
    Step sizes absent from the source keep their value (1). A classifier of another size is
    left as initialised.

    Args:
        model: a full-size zoo model (``gamma_w`` 1, every block).
        source: a state dict, a weights file, or ``torchvision:NAME`` / ``timm:NAME``.

    Returns:
        The keys that were not loaded (step sizes, a classifier of another size).

    Raises:
        PretrainedError: weights that do not fit the model, a file that is not tensors only,
            or a download whose hash does not match.
    """
    label = "state dict" if isinstance(source, Mapping) else str(source)
    state = _check_tensors(source, label) if isinstance(source, Mapping) else _read_state_dict(source)
    state = {k.removeprefix("module."): v for k, v in state.items()}
    own = model.state_dict()
    steps = model.step_keys()
    classifier = set(model.get_classifier().state_dict(prefix=f"{model.default_cfg['classifier']}."))
    skipped: list[str] = []
    for key, target in own.items():
        if key not in state:
            if key in steps:
                skipped.append(key)
                continue
            raise PretrainedError(f"{label}: pretrained weights lack {key!r} (is this the right model?)")
        value = state[key]
        if value.shape != target.shape:
            if key in classifier:
                skipped.append(key)
                continue
            raise PretrainedError(
                f"{label}: {key}: pretrained shape {tuple(value.shape)} != model shape {tuple(target.shape)}"
            )
        with torch.no_grad():
            target.copy_(value)
    unknown = sorted(set(state) - set(own))
    if unknown:
        raise PretrainedError(f"{label}: pretrained weights have keys the model lacks: {unknown[:5]}")
    return skipped
