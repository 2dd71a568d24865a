"""What a regular (non-editable) ``pip install .`` ships: every package, py.typed and the specs;
one version, a license and a changelog that agree with it; no dependency's private modules.
(``.ci/install-check`` builds the wheel and runs it from an empty folder at both ends of the
dependency ranges.)"""

import json
import re
import tomllib
from importlib.metadata import version
from pathlib import Path

import nefl_zoo
from nefl_zoo.spec import resolve_spec_path, shipped_specs_dir

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
SETUPTOOLS = PYPROJECT["tool"]["setuptools"]


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
    assert SETUPTOOLS["package-data"]["nefl_zoo_cli"] == ["web/**/*"]  # the serve page (setup.py)


def test_shipped_specs_come_from_the_installed_package(monkeypatch, tmp_path):
    monkeypatch.delenv("NEFL_ZOO_SPECS", raising=False)
    root = shipped_specs_dir()
    assert (root / "__init__.py").is_file() and (root / "resnet110" / "nefl-wd.yaml").is_file()
    assert resolve_spec_path("resnet110/nefl-wd") == root / "resnet110" / "nefl-wd.yaml"
    monkeypatch.setenv("NEFL_ZOO_SPECS", str(tmp_path))
    assert shipped_specs_dir() == tmp_path


def test_one_version_everywhere():
    """The version is written once (``nefl_zoo/version.py``, read by pyproject.toml, re-exported
    as ``nefl_zoo.__version__``); the installed metadata, ``--version``, the npm package and the
    changelog agree with it."""
    from typer.testing import CliRunner

    from nefl_zoo_cli.app import app

    assert PYPROJECT["project"]["dynamic"] == ["version"] and "version" not in PYPROJECT["project"]
    assert PYPROJECT["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "nefl_zoo.version.__version__"}
    assert nefl_zoo.__version__ is nefl_zoo.version.__version__
    assert version("nefl-zoo") == nefl_zoo.__version__
    shown = CliRunner().invoke(app, ["--version"])
    assert shown.exit_code == 0 and shown.stdout == f"nefl-zoo {nefl_zoo.__version__}\n"
    assert json.loads((ROOT / "web" / "package.json").read_text())["version"] == nefl_zoo.__version__
    assert re.search(rf"^## {re.escape(nefl_zoo.__version__)} - \d{{4}}-\d{{2}}-\d{{2}}$", (ROOT / "CHANGELOG.md").read_text(), re.M)


def test_the_license_file_is_the_declared_license():
    assert PYPROJECT["project"]["license"] == "Apache-2.0" and PYPROJECT["project"]["license-files"] == ["LICENSE"]
    text = (ROOT / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text and "END OF TERMS AND CONDITIONS" in text
    assert json.loads((ROOT / "web" / "package.json").read_text())["license"] == "Apache-2.0"


def test_every_dependency_has_a_floor_and_no_private_module_is_imported():
    """Each requirement names the oldest release ``.ci/install-check lowest`` installs; an import
    of a dependency's private module (``typer._types``) breaks with its next release."""
    for requirement in PYPROJECT["project"]["dependencies"]:
        assert ">=" in requirement, f"{requirement}: no floor"
    names = {re.split(r"[<>=!~\[ ]", r)[0].replace("-", "_") for r in PYPROJECT["project"]["dependencies"]}
    names |= {"click", "flwr", "ray"}
    private = re.compile(rf"^\s*(from|import)\s+({'|'.join(sorted(names))})\._", re.M)
    for path in [*(ROOT / "nefl_zoo").rglob("*.py"), *(ROOT / "cli").rglob("*.py")]:
        found = private.search(path.read_text(encoding="utf-8"))
        assert found is None, f"{path.relative_to(ROOT)}: imports a private module: {found.group(0).strip()}"
