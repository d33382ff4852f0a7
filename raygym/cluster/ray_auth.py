"""Token authentication for the private local Ray cluster a run starts for itself.

Ray 2.5x+ turns token auth on for a new local cluster and, unless told otherwise, writes a token to
``~/.ray/auth_token`` and prints a warning about it. For the cluster raygym starts itself (no
``RAY_ADDRESS``, no Ray running in the process) :func:`private_cluster_auth` keeps auth on with a fresh
random token that only this process and its children know (``RAY_AUTH_TOKEN`` in their environment,
never on a command line or in a log), so nothing is written to the home directory and nothing is
printed. It does nothing when ``RAY_AUTH_MODE`` is set (the user chose) and never touches clusters
the user runs (``RAY_ADDRESS``): those keep their own settings.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Iterator
from contextlib import contextmanager

_MODE, _TOKEN = "RAY_AUTH_MODE", "RAY_AUTH_TOKEN"


def _reload_ray_auth_settings() -> None:
    """Make this process's Ray read the auth variables again (they are cached on first use)."""
    from ray._raylet import AuthenticationTokenLoader, Config  # type: ignore[attr-defined]  # absent from ray's stub

    Config.initialize("")
    AuthenticationTokenLoader.instance().reset_cache()


@contextmanager
def private_cluster_auth() -> Iterator[bool]:
    """Around starting (and using) a private local cluster: token auth with a fresh token, then the
    environment as it was. Yields whether it set anything."""
    if os.environ.get(_MODE) is not None or os.environ.get(_TOKEN) is not None:
        yield False
        return
    os.environ[_MODE] = "token"
    os.environ[_TOKEN] = secrets.token_hex(32)
    try:
        _reload_ray_auth_settings()
    except Exception:  # a Ray without these hooks: leave auth to Ray's defaults
        os.environ.pop(_MODE, None)
        os.environ.pop(_TOKEN, None)
        yield False
        return
    try:
        yield True
    finally:
        os.environ.pop(_MODE, None)
        os.environ.pop(_TOKEN, None)
        try:
            _reload_ray_auth_settings()
        except Exception:  # best effort: the cluster is gone either way
            pass
