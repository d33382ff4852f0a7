"""Custom functions given as callables or import paths (``"pkg.module:function"``): one loader for all.

Pure (no torch, no ray). A path that does not import, or names no callable, is a ConfigError naming the
field it came from.

>>> load_callable("json:dumps", "custom_rm_function")([1])
'[1]'
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Callable
from typing import Any, cast

from raygym.errors import ConfigError

IMPORT_PATH = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*(:[A-Za-z_]\w*(\.[A-Za-z_]\w*)*)?$")


def load_callable(value: Callable[..., Any] | str | None, field: str) -> Callable[..., Any] | None:
    """Return ``value`` if it is callable, else import the path ``"pkg.module:function"`` (None or ""
    stays None: the field is unset).

    Raises ConfigError naming ``field`` when the path does not import or does not name a callable.

    >>> load_callable("json:dumps", "custom_rm_function")([1])
    '[1]'
    """
    if value is None or value == "":
        return None
    if callable(value):
        return value
    if not isinstance(value, str) or not IMPORT_PATH.match(value) or ("." not in value and ":" not in value):
        raise ConfigError(
            f"{field}={value!r}: not a callable or an import path; write it as 'pkg.module:function'"
        )
    module_name, _, attr_path = value.partition(":") if ":" in value else value.rpartition(".")
    try:
        obj: Any = importlib.import_module(module_name)
        for attr in attr_path.split("."):
            obj = getattr(obj, attr)
    except (ImportError, AttributeError) as exc:
        raise ConfigError(
            f"{field}={value!r}: cannot import it ({type(exc).__name__}: {exc}); check the module is on "
            "PYTHONPATH and the function name is right"
        ) from exc
    if not callable(obj):
        raise ConfigError(
            f"{field}={value!r}: names a {type(obj).__name__}, not a callable; point it at a function"
        )
    return cast(Callable[..., Any], obj)


def callable_import_path(fn: Callable[..., Any] | str, field: str) -> str:
    """The import path ``"module:qualname"`` that loads ``fn`` back; strings are returned unchanged.

    Lambdas, local functions and functions of ``__main__`` have no such path: ConfigError.
    """
    if isinstance(fn, str):
        return fn
    module = getattr(fn, "__module__", None)
    qualname = getattr(fn, "__qualname__", None)
    if not module or not qualname or "<lambda>" in qualname or "<locals>" in qualname or module == "__main__":
        raise ConfigError(
            f"{field}={fn!r}: a lambda, local function or __main__ function has no import path; define it "
            "at the top level of an importable module and pass it (or 'pkg.module:function')"
        )
    path = f"{module}:{qualname}"
    try:
        same = load_callable(path, field) is fn
    except ConfigError:
        same = False
    if not same:
        raise ConfigError(
            f"{field}={fn!r}: importing {path!r} gives a different object (decorated or shadowed); "
            "pass the import path of the function you mean"
        )
    return path


def callable_identity(value: Any) -> Any:
    """What equality compares for a custom function: its import path when it has one."""
    if value is None or isinstance(value, str):
        return value
    try:
        return callable_import_path(value, "function")
    except ConfigError:
        return value
