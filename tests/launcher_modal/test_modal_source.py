"""Offline: where the Modal containers' raygym comes from. From a checkout the image installs a copy of it; from an
installed raygym (``modal run -m raygym.launchers.modal_app``) the image installs raygym's requirements and gets the
installed package's source; run as a file, an installed launcher is refused with the module form.

The image's public build methods are recorded (each still runs and builds the real, lazy Modal image)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from packaging.requirements import Requirement

modal = pytest.importorskip("modal", reason="modal is not installed (pip install modal); it is not a dev dependency")

from raygym.errors import ConfigError  # noqa: E402
from raygym.launchers import modal_app, source  # noqa: E402
from raygym.launchers.modal_config import ModalConfig  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
SHA = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture
def steps(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, tuple[Any, ...], dict[str, Any]]]:
    """The Image and App.function calls the launcher makes, in order: (method, args, kwargs)."""
    seen: list[tuple[str, tuple[Any, ...], dict[str, Any]]] = []
    for cls, name in [(modal.Image, "add_local_dir"), (modal.Image, "pip_install"), (modal.Image, "run_commands"),
                      (modal.Image, "add_local_python_source"), (modal.App, "function")]:
        def spy(self: Any, *args: Any, _real: Any = getattr(cls, name), _name: str = name, **kwargs: Any) -> Any:
            seen.append((_name, args, kwargs))
            return _real(self, *args, **kwargs)

        monkeypatch.setattr(cls, name, spy)
    return seen


def called(steps: list[tuple[str, tuple[Any, ...], dict[str, Any]]], name: str) -> list[tuple[Any, ...]]:
    return [args for method, args, _ in steps if method == name]


def test_from_a_checkout_the_image_installs_the_checkout(steps) -> None:
    run = modal_app.build_app(["--preset", "tiny"])
    assert [args[0] for args in called(steps, "add_local_dir")] == [REPO]
    assert called(steps, "run_commands")[0] == ("pip install '/root/raygym-src[sglang,megatron]'",)
    assert called(steps, "pip_install") == [] and called(steps, "add_local_python_source") == []
    assert [kw["include_source"] for m, _, kw in steps if m == "function"] == [False]  # raygym is the image's
    assert run.launch.train_args == ["--preset", "tiny"]


def test_from_an_install_the_image_gets_the_requirements_and_the_installed_source(steps, monkeypatch) -> None:
    monkeypatch.setattr(source, "CHECKOUT_ROOT", None)
    modal_app.build_app(["--preset", "tiny"])
    assert called(steps, "add_local_dir") == []  # no directory of the install is copied
    (requirements,) = called(steps, "pip_install")
    names = {Requirement(r).name for r in requirements}
    assert {"ray", "torch", "pydantic", "sglang", "megatron-core"} <= names
    assert called(steps, "add_local_python_source") == [("raygym",)]


def test_an_overlay_replaces_the_installed_source(steps, monkeypatch) -> None:
    monkeypatch.setattr(source, "CHECKOUT_ROOT", None)
    modal_app.build_image(ModalConfig(git_repository="https://github.com/x/raygym", git_revision=SHA))
    modal_app.build_image(ModalConfig(local_raygym=str(REPO)))
    assert called(steps, "add_local_python_source") == []
    assert any(f"git+https://github.com/x/raygym@{SHA}" in args[0] for args in called(steps, "run_commands"))


def test_an_installed_launcher_run_as_a_file_is_told_the_module_form(monkeypatch) -> None:
    monkeypatch.setattr(source, "CHECKOUT_ROOT", None)
    monkeypatch.setattr(modal_app, "_RUN_AS_FILE", True)
    with pytest.raises(ConfigError, match="modal run -m raygym.launchers.modal_app"):
        modal_app.build_app(["--preset", "tiny"])
