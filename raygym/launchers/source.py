"""Where the raygym a launcher ships comes from: a checkout of the repository, or an installed package.

From a checkout (a ``pyproject.toml`` naming the project ``raygym`` beside the package), a Ray job uploads the
checkout as its working_dir and the Modal image installs that checkout. From an installed raygym there is no
repository: a Ray job uploads the caller's current directory (their TOML files and data) and runs the raygym
installed on the cluster; the Modal image installs raygym's requirements, read from the installed package's
metadata, and gets the installed package's source.

Nothing here imports ``ray`` or ``modal``.
"""

from __future__ import annotations

import importlib.metadata
import os
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from raygym.errors import ConfigError

if TYPE_CHECKING:
    from packaging.requirements import Requirement

PACKAGE_DIR = Path(__file__).resolve().parent.parent  # the raygym package


def checkout_root(package_dir: Path = PACKAGE_DIR) -> Path | None:
    """The repository root when ``package_dir`` lies in a raygym checkout; None for an installed package.

    >>> checkout_root(Path("/nowhere/site-packages/raygym")) is None
    True
    """
    pyproject = package_dir.parent / "pyproject.toml"
    if not pyproject.is_file():
        return None
    try:
        name = _read_toml(pyproject)["project"]["name"]
    except (ValueError, KeyError, TypeError):  # tomllib.TOMLDecodeError is a ValueError
        return None
    return package_dir.parent if name == "raygym" else None


def _read_toml(path: Path) -> dict[str, Any]:
    try:
        import tomllib
    except ImportError:  # Python 3.10
        import tomli as tomllib  # type: ignore[no-redef]
    return tomllib.loads(path.read_text())


CHECKOUT_ROOT = checkout_root()


def default_working_dir() -> str:
    """A job's working_dir unless told otherwise: the checkout, or (installed raygym) the current directory."""
    return str(CHECKOUT_ROOT) if CHECKOUT_ROOT is not None else os.getcwd()


def _pyproject_extras(pyproject: Path) -> dict[str, list[str]]:
    table = _read_toml(pyproject)["project"].get("optional-dependencies", {})
    return {extra: list(reqs) for extra, reqs in table.items()}


def _installed_extras(distribution: str = "raygym") -> dict[str, list[str]]:
    """Extra -> its requirements, from the installed distribution's metadata (``Requires-Dist``)."""
    from packaging.requirements import Requirement

    meta = importlib.metadata.metadata(distribution)
    extras: dict[str, list[str]] = {extra: [] for extra in meta.get_all("Provides-Extra") or []}
    for line in importlib.metadata.requires(distribution) or []:
        req = Requirement(line)
        if not _of_an_extra(req):
            continue
        named = f"{req.name}[{','.join(sorted(req.extras))}]" if req.extras else req.name
        for extra in extras:
            if req.marker is not None and req.marker.evaluate({"extra": extra}):
                extras[extra].append(f"{named}{req.specifier}")
    return extras


def _of_an_extra(req: Requirement) -> bool:
    return req.marker is not None and "extra" in str(req.marker)


def base_requirements(distribution: str = "raygym") -> list[str]:
    """The installed distribution's own requirements (those of no extra), environment markers kept for pip."""
    from packaging.requirements import Requirement

    lines = importlib.metadata.requires(distribution) or []
    return [line for line in lines if not _of_an_extra(Requirement(line))]


def extra_requirements(extras: Iterable[str], pyproject: Path | None = None) -> list[str]:
    """The requirements of raygym's optional extras (``wandb`` -> ``["wandb>=0.19"]``), in order, each once.

    Read from ``pyproject`` (default: the checkout's), or from the installed package's metadata when raygym
    is not a checkout.
    """
    extras = list(extras)
    if not extras:
        return []
    if pyproject is None and CHECKOUT_ROOT is not None:
        pyproject = CHECKOUT_ROOT / "pyproject.toml"
    known = _pyproject_extras(pyproject) if pyproject is not None else _installed_extras()
    reqs: list[str] = []
    for extra in extras:
        if extra not in known:
            raise ConfigError(f"pip_extras={extra!r}: unknown raygym extra; known: {', '.join(sorted(known))}")
        reqs += [r for r in known[extra] if r not in reqs]
    return reqs
