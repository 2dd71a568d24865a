"""What a regular (non-editable) ``pip install .`` ships: every package, py.typed and the specs."""

import tomllib
from pathlib import Path

import nefl_zoo
from nefl_zoo.spec import resolve_spec_path, shipped_specs_dir

ROOT = Path(__file__).resolve().parents[1]
SETUPTOOLS = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]


def test_every_package_is_listed_in_pyproject():
    """setuptools installs only the listed packages; a new subpackage must be added there."""
    on_disk = {
        ".".join(init.parent.relative_to(ROOT).parts)
        for init in (ROOT / "nefl_zoo").rglob("__init__.py")
        if "__pycache__" not in init.parts
    }
    assert on_disk <= set(SETUPTOOLS["packages"])
    assert SETUPTOOLS["package-dir"]["nefl_zoo_specs"] == "specs" and "nefl_zoo_specs" in SETUPTOOLS["packages"]


def test_package_data_is_declared_and_present():
    assert (Path(nefl_zoo.__file__).parent / "py.typed").is_file()
    assert SETUPTOOLS["package-data"]["nefl_zoo"] == ["py.typed"]
    assert SETUPTOOLS["package-data"]["nefl_zoo_specs"] == ["**/*.yaml"]


def test_shipped_specs_come_from_the_installed_package(monkeypatch, tmp_path):
    monkeypatch.delenv("NEFL_ZOO_SPECS", raising=False)
    root = shipped_specs_dir()
    assert (root / "__init__.py").is_file() and (root / "resnet110" / "nefl-wd.yaml").is_file()
    assert resolve_spec_path("resnet110/nefl-wd") == root / "resnet110" / "nefl-wd.yaml"
    monkeypatch.setenv("NEFL_ZOO_SPECS", str(tmp_path))
    assert shipped_specs_dir() == tmp_path
