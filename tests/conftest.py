import pytest
import torch

from nefl_zoo.spec import parse_spec

TINY_VIT = dict(img_size=32, patch_size=8, embed_dim=64, depth=2, num_heads=4, num_classes=10)


@pytest.fixture(autouse=True, scope="session")
def _macs_cache(tmp_path_factory):
    """The MACs cache of the whole run in a temporary folder, never the user's."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("NEFL_ZOO_CACHE_DIR", str(tmp_path_factory.mktemp("cache")))
        yield


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture
def resnet20_spec():
    """Three tiers of resnet20: narrow with skipped blocks (one a projection block), medium, full."""
    return parse_spec(
        {
            "model": "resnet20",
            "tiers": [
                {"name": "small", "gamma_w": 0.25, "steps": [[1, 0, 1], [0, 1, 1], [2, 1, 0]]},
                {"name": "medium", "gamma_w": 0.5, "steps": [[1, 1, 0], [1, 1, 1], [1, 1, 1]]},
                {"name": "full"},
            ],
        }
    )


@pytest.fixture
def vit_spec():
    return parse_spec(
        {
            "model": "vit_b_16",
            "model_args": TINY_VIT,
            "inconsistent": ["steps"],
            "tiers": [
                {"name": "half", "gamma_w": 0.5, "steps": [[1, 0]]},
                {"name": "full"},
            ],
        }
    )
