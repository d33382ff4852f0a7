"""The engine API key: a per-run secret every engine requires on every route but its health checks.

The driver mints it (:func:`new_engine_api_key`) and puts it in the environment of the processes that
talk to engines and of the engines themselves, as :data:`ENGINE_API_KEY_ENV`; it never goes on a command
line or into a log. raygym's server reads it from that variable; SGLang, which has no such variable,
reads it from a config file only its owner can read (:func:`raygym.engines.launch.sglang.render_sglang_config`).
Clients send it as ``Authorization: Bearer <key>``, as SGLang expects.

>>> import os
>>> os.environ[ENGINE_API_KEY_ENV] = "k"; auth_headers()
{'Authorization': 'Bearer k'}
>>> del os.environ[ENGINE_API_KEY_ENV]; auth_headers()
{}
"""

from __future__ import annotations

import hmac
import os
import secrets

ENGINE_API_KEY_ENV = "RAYGYM_ENGINE_API_KEY"


def new_engine_api_key() -> str:
    """A fresh random key (256 bits, URL-safe text). It starts with a letter: SGLang turns its config file into
    command-line arguments, where a value starting with ``-`` (one URL-safe key in 64) reads as an option.

    >>> key = new_engine_api_key(); key[:3], len(key) > 40
    ('rgk', True)
    """
    return "rgk" + secrets.token_urlsafe(32)


def engine_api_key() -> str | None:
    """This process's engine API key, or None when the run uses none."""
    return os.environ.get(ENGINE_API_KEY_ENV) or None


def use_engine_api_key(key: str) -> None:
    """Adopt the run's key in this process (actors receive it by a method call: a call's arguments are
    not kept where Ray shows actor options and environments)."""
    os.environ[ENGINE_API_KEY_ENV] = key


def auth_headers() -> dict[str, str]:
    """The ``Authorization`` header for engine requests (empty without a key)."""
    key = engine_api_key()
    return {"Authorization": f"Bearer {key}"} if key else {}


def authorized(header: str | None, key: str) -> bool:
    """Whether an ``Authorization`` header carries ``key`` (constant-time comparison)."""
    if not header:
        return False
    scheme, _, token = header.partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), key.encode())
