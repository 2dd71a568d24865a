"""Weights from disk or a hub cache: tensors only, hash-checked, and one-line errors.

Every hostile file here is a pickle whose unpickling would write a marker file; the test first
shows that plain unpickling does run it, then that the loader refuses it without running it.
"""

from __future__ import annotations

import hashlib
import pathlib
import pickle
from types import SimpleNamespace

import pytest
import torch
import torchvision
from safetensors.torch import save_file

from nefl_zoo.models import create_model, load_pretrained
from nefl_zoo.models.pretrained import PretrainedError, read_weights

torch.set_num_threads(1)


class Payload:
    """Unpickling this writes ``marker`` (it stands for any code a pickle can run)."""

    def __init__(self, marker: pathlib.Path):
        self.marker = marker

    def __reduce__(self):
        return pathlib.Path.write_text, (self.marker, "code ran")


@pytest.fixture
def hostile(tmp_path):
    """A .pth file (torch.save format) whose loading with pickle would run code, and the marker."""
    marker = tmp_path / "marker"
    path = tmp_path / "evil.pth"
    torch.save({"conv1.weight": torch.zeros(1), "x": Payload(marker)}, path)
    torch.load(path, weights_only=False)  # the payload is real: full unpickling runs it
    assert marker.exists()
    marker.unlink()
    return path, marker


def test_a_pickle_that_would_run_code_is_refused_without_running_it(hostile, tmp_path):
    path, marker = hostile
    with pytest.raises(PretrainedError, match=r"evil.pth: refused: it holds Python objects besides tensors") as info:
        load_pretrained(create_model("resnet20"), path)
    assert "\n" not in str(info.value)
    assert not marker.exists()
    raw = tmp_path / "raw.pt"  # the legacy (non-zip) format, a bare pickle
    raw.write_bytes(pickle.dumps({"w": Payload(marker)}))
    with pytest.raises(PretrainedError, match="raw.pt: "):
        read_weights(raw)
    assert not marker.exists()


@pytest.mark.parametrize("content, expected", [
    (lambda p: torch.save({"conv1.weight": torch.zeros(1), "epoch": 3}, p), r"entry 'epoch' is a int, not a tensor"),
    (lambda p: torch.save([torch.zeros(1)], p), "expected a state_dict, got list"),
    (lambda p: p.write_bytes(b"not weights at all"), "not a readable PyTorch weights file"),
    (lambda p: (torch.save({"a": torch.zeros(100)}, p), p.write_bytes(p.read_bytes()[:200])), "not a readable PyTorch weights file"),
    (lambda p: p.write_bytes(b""), "not a readable PyTorch weights file"),
])
def test_non_tensor_or_corrupt_files_are_one_line_errors_naming_the_file(tmp_path, content, expected):
    path = tmp_path / "w.pth"
    content(path)
    with pytest.raises(PretrainedError, match=expected) as info:
        read_weights(path)
    assert str(info.value).startswith(f"{path}: ") and "\n" not in str(info.value)


def test_a_truncated_safetensors_file_is_a_one_line_error(tmp_path):
    path = tmp_path / "w.safetensors"
    save_file({"a": torch.zeros(100)}, str(path))
    path.write_bytes(path.read_bytes()[:-50])
    with pytest.raises(PretrainedError, match=f"^{path}: not a readable safetensors file") as info:
        read_weights(path)
    assert "\n" not in str(info.value)


@pytest.fixture
def hub(tmp_path, monkeypatch):
    """torch.hub's cache in a temporary folder; returns its checkpoints folder."""
    monkeypatch.setattr(torch.hub, "get_dir", lambda: str(tmp_path / "hub"))
    (tmp_path / "hub" / "checkpoints").mkdir(parents=True)
    return tmp_path / "hub" / "checkpoints"


def test_a_planted_torchvision_cache_file_with_the_wrong_hash_is_refused(hub, hostile):
    path, marker = hostile
    url = torchvision.models.get_model_weights("resnet18").DEFAULT.url  # .../resnet18-f37072fd.pth
    planted = hub / url.rsplit("/", 1)[1]
    planted.write_bytes(path.read_bytes())
    with pytest.raises(PretrainedError, match=r"resnet18-f37072fd.pth: sha256 [0-9a-f]{8} does not match the published f37072fd"):
        load_pretrained(create_model("resnet18", stem="imagenet", num_classes=1000), "torchvision:resnet18")
    assert not marker.exists()


def publish(monkeypatch, data: bytes) -> str:
    """Make torchvision's resnet18 weights URL carry the sha256 prefix of ``data``; its file name."""
    name = f"resnet18-{hashlib.sha256(data).hexdigest()[:8]}.pth"
    weights = SimpleNamespace(DEFAULT=SimpleNamespace(url=f"https://download.invalid/models/{name}"))
    monkeypatch.setattr(torchvision.models, "get_model_weights", lambda model: weights)
    return name


def test_a_cached_torchvision_file_with_the_right_hash_loads_as_tensors_only(hub, hostile, tmp_path, monkeypatch):
    reference = torchvision.models.resnet18().state_dict()
    good = tmp_path / "good.pth"
    torch.save(reference, good)
    (hub / publish(monkeypatch, good.read_bytes())).write_bytes(good.read_bytes())
    model = create_model("resnet18", stem="imagenet", num_classes=1000)
    skipped = load_pretrained(model, "torchvision:resnet18")
    assert set(skipped) == set(model.step_keys())
    assert torch.equal(model.state_dict()["layer4.1.conv2.weight"], reference["layer4.1.conv2.weight"])

    path, marker = hostile  # the right hash does not make a pickle safe
    (hub / publish(monkeypatch, path.read_bytes())).write_bytes(path.read_bytes())
    with pytest.raises(PretrainedError, match="refused"):
        load_pretrained(model, "torchvision:resnet18")
    assert not marker.exists()


def test_an_absent_torchvision_file_without_a_network_is_one_line(hub, monkeypatch):
    publish(monkeypatch, b"x")

    def offline(url, dst, hash_prefix=None, progress=True):
        assert hash_prefix == hashlib.sha256(b"x").hexdigest()[:8]  # the download is hash-checked too
        raise OSError("network unreachable")

    monkeypatch.setattr(torch.hub, "download_url_to_file", offline)
    with pytest.raises(PretrainedError, match=r"torchvision:resnet18: cannot download .* \(network unreachable\); without a network, put the file at"):
        load_pretrained(create_model("resnet18", stem="imagenet", num_classes=1000), "torchvision:resnet18")


def plant_hf(cache: pathlib.Path, repo: str, data: bytes, blob: str) -> None:
    """The Hugging Face cache layout: refs/main -> a snapshot whose file links to blobs/BLOB."""
    folder = cache / f"models--{repo.replace('/', '--')}"
    (folder / "blobs").mkdir(parents=True)
    (folder / "blobs" / blob).write_bytes(data)
    (folder / "refs").mkdir()
    (folder / "refs" / "main").write_text("0" * 40)
    snapshot = folder / "snapshots" / ("0" * 40)
    snapshot.mkdir(parents=True)
    (snapshot / "model.safetensors").symlink_to(f"../../blobs/{blob}")


def test_timm_weights_come_from_the_hub_cache_checked_against_the_blob_hash(tmp_path, monkeypatch):
    import huggingface_hub.constants
    import timm

    repo = timm.models.get_pretrained_cfg("vit_tiny_patch16_224").hf_hub_id
    path = tmp_path / "w.safetensors"
    save_file({"cls_token": torch.ones(1, 1, 4)}, str(path))
    data = path.read_bytes()

    good = tmp_path / "good"
    plant_hf(good, repo, data, hashlib.sha256(data).hexdigest())
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(good))
    from nefl_zoo.models.pretrained import _read_state_dict

    assert torch.equal(_read_state_dict("timm:vit_tiny_patch16_224")["cls_token"], torch.ones(1, 1, 4))

    tampered = tmp_path / "tampered"
    plant_hf(tampered, repo, data, hashlib.sha256(b"the file that was published").hexdigest())
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tampered))
    with pytest.raises(PretrainedError, match="does not match the published"):
        _read_state_dict("timm:vit_tiny_patch16_224")


def test_unknown_hub_names_are_one_line():
    with pytest.raises(PretrainedError, match="torchvision:nope: no torchvision weights"):
        load_pretrained(create_model("resnet20"), "torchvision:nope")
    with pytest.raises(PretrainedError, match="timm:nope_x: no timm weights"):
        load_pretrained(create_model("resnet20"), "timm:nope_x")


def test_refusals_name_what_torch_refused(hostile, tmp_path):
    path, _ = hostile
    with pytest.raises(PretrainedError) as refused:
        read_weights(path)
    assert str(refused.value) == (f"{path}: refused: it holds Python objects besides tensors (it names getattr); "  # how a
                                  "give a state dict of tensors (.pth saved from model.state_dict(), or .safetensors)")  # method pickles
    odd = tmp_path / "odd.pt"  # a bare pickle with an opcode the weights-only unpickler does not take (INST)
    odd.write_bytes(b"\x80\x02(i__builtin__\nlist\n.")
    with pytest.raises(PretrainedError, match=r"^.*odd.pt: not a readable PyTorch weights file \(Unsupported operand 105\)$"):
        read_weights(odd)


def test_a_file_source_is_named_in_load_errors(tmp_path):
    path = tmp_path / "partial.pth"
    torch.save({"conv1.weight": torch.zeros(16, 3, 3, 3)}, path)
    with pytest.raises(PretrainedError, match=rf"^{path}: pretrained weights lack 'bn1.weight' \(is this the right model\?\)$"):
        load_pretrained(create_model("resnet20"), path)


def test_a_torchvision_name_is_everything_after_the_prefix():
    with pytest.raises(PretrainedError, match=r"^torchvision:resnet18:v2: no torchvision weights for 'resnet18:v2' "):
        load_pretrained(create_model("resnet20"), "torchvision:resnet18:v2")


def test_an_absent_torchvision_file_is_downloaded_into_the_hub_cache(hub, tmp_path, monkeypatch):
    reference = torchvision.models.resnet18().state_dict()
    good = tmp_path / "good.pth"
    torch.save(reference, good)
    name = publish(monkeypatch, good.read_bytes())
    monkeypatch.setattr(torch.hub, "download_url_to_file", lambda url, dst, hash_prefix=None, progress=True:
                        pathlib.Path(dst).write_bytes(good.read_bytes()))
    model = create_model("resnet18", stem="imagenet", num_classes=1000)
    load_pretrained(model, "torchvision:resnet18")
    assert (hub / name).read_bytes() == good.read_bytes()
    assert torch.equal(model.state_dict()["fc.weight"], reference["fc.weight"])


def test_timm_weights_stored_outside_lfs_are_checked_against_their_git_blob_hash(tmp_path, monkeypatch):
    import huggingface_hub.constants
    import timm

    from nefl_zoo.models.pretrained import _read_state_dict

    repo = timm.models.get_pretrained_cfg("vit_tiny_patch16_224").hf_hub_id
    path = tmp_path / "w.safetensors"
    save_file({"cls_token": torch.ones(1, 1, 4)}, str(path))
    data = path.read_bytes()
    for folder, blob_of in [("good", data), ("tampered", b"the file that was published")]:
        plant_hf(tmp_path / folder, repo, data, hashlib.sha1(b"blob %d\0" % len(blob_of) + blob_of).hexdigest())
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "good"))
    assert torch.equal(_read_state_dict("timm:vit_tiny_patch16_224")["cls_token"], torch.ones(1, 1, 4))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "tampered"))
    with pytest.raises(PretrainedError, match=r"git-blob [0-9a-f]{40} does not match the published"):
        _read_state_dict("timm:vit_tiny_patch16_224")


def test_timm_weights_without_a_network_name_the_problem(tmp_path, monkeypatch):
    import huggingface_hub
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "empty"))

    def offline(repo, filename, revision=None):
        raise OSError("no network here\nsecond line")

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", offline)
    with pytest.raises(PretrainedError, match=r"^timm:vit_tiny_patch16_224: cannot get timm/vit_tiny_patch16_224\.\S+ from "
                                             r"the Hugging Face hub \(no network here\); give a local file$"):
        load_pretrained(create_model("resnet20"), "timm:vit_tiny_patch16_224")
