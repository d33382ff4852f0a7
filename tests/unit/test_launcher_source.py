"""raygym.launchers.source: a checkout is told from an installed package, and the requirements of raygym's extras are
read from the checkout's pyproject.toml or from an installed distribution's metadata (a real dist-info here)."""

from __future__ import annotations

from pathlib import Path

import pytest
from packaging.requirements import Requirement

from raygym.errors import ConfigError
from raygym.launchers import source

REPO = Path(__file__).resolve().parents[2]


def test_this_checkout_is_a_checkout_and_site_packages_is_not(tmp_path: Path) -> None:
    assert source.CHECKOUT_ROOT == REPO and source.checkout_root(REPO / "raygym") == REPO
    assert source.default_working_dir() == str(REPO)
    package = tmp_path / "site-packages" / "raygym"
    package.mkdir(parents=True)
    assert source.checkout_root(package) is None
    (package.parent / "pyproject.toml").write_text('[project]\nname = "someone-else"\n')
    assert source.checkout_root(package) is None  # a pyproject.toml of another project is no raygym checkout
    (package.parent / "pyproject.toml").write_text("not toml [")
    assert source.checkout_root(package) is None


def test_an_installed_raygym_works_in_the_callers_directory(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(source, "CHECKOUT_ROOT", None)
    monkeypatch.chdir(tmp_path)
    assert source.default_working_dir() == str(tmp_path)


@pytest.fixture
def installed_dist(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """A distribution installed on sys.path (its dist-info), with a base requirement, a marker and two extras."""
    info = tmp_path / "fakegym-1.0.dist-info"
    info.mkdir()
    info.joinpath("METADATA").write_text(
        "Metadata-Version: 2.1\nName: fakegym\nVersion: 1.0\n"
        "Requires-Dist: ray[default,serve]>=2.40\n"
        "Requires-Dist: tomli>=2.0; python_version < \"3.11\"\n"
        "Provides-Extra: sglang\nRequires-Dist: sglang<=0.5.23,>=0.5.6; extra == \"sglang\"\n"
        "Provides-Extra: data\nRequires-Dist: datasets>=2.18; extra == \"data\"\n"
        "Requires-Dist: pyarrow>=15; extra == \"data\"\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    return "fakegym"


def test_requirements_from_an_installed_distributions_metadata(installed_dist: str) -> None:
    assert source._installed_extras(installed_dist) == {
        "sglang": ["sglang<=0.5.23,>=0.5.6"], "data": ["datasets>=2.18", "pyarrow>=15"]}
    assert source.base_requirements(installed_dist) == ["ray[default,serve]>=2.40",
                                                        'tomli>=2.0; python_version < "3.11"']


def test_extra_requirements_from_the_checkout_and_from_an_install(monkeypatch: pytest.MonkeyPatch) -> None:
    from_checkout = source.extra_requirements(["wandb", "data", "parquet"])
    assert from_checkout == ["wandb>=0.19", "datasets>=2.18", "pyarrow>=15"]  # each once, in order
    assert source.extra_requirements([]) == []
    with pytest.raises(ConfigError, match="pip_extras='nope'.*known: .*wandb"):
        source.extra_requirements(["nope"])
    monkeypatch.setattr(source, "CHECKOUT_ROOT", None)  # as from an install: raygym's own metadata
    from_install = source.extra_requirements(["wandb", "modal"])
    assert [Requirement(r) for r in from_install] == [Requirement("wandb>=0.19"), Requirement("modal>=1.0")]
    with pytest.raises(ConfigError, match="pip_extras='nope'"):
        source.extra_requirements(["nope"])
