"""Environments from other projects, named by a string: ``verifiers:...`` and ``openenv:...`` (pure, no imports of
those packages here).

- ``verifiers:<env id or module>[:<attr>][?<arg>=<value>&...]``: a ``verifiers`` environment. An env id
  (``reverse-text``, ``owner/vf-gsm8k``) or a module path names the installed module whose
  ``load_environment(**args)`` builds it (verifiers' own loader); ``module:attr`` names a factory (called with
  the args) or an environment object. As prompt data, ``verifiers:<...>`` is the environment's dataset and
  ``verifiers:<...>#eval`` its eval dataset.
- ``openenv:<module>[:<attr>][?<option>=<value>&...]``: an OpenEnv environment served locally. ``attr``
  (default ``app``) is the server's FastAPI app (``create_app(...)``), or an OpenEnv ``Environment`` class or
  factory that raygym serves itself. Options: ``action`` (the action field that gets the model's text),
  ``observation`` (the observation field shown to the model), ``sessions`` (concurrent episodes per server),
  ``servers`` (server processes), ``stop`` (a string that ends a model turn).

Values in the query are read as JSON where they parse (``max_turns=3`` is an int), else as text.

>>> parse_env_spec("verifiers:owner/vf-gsm8k?num_train_examples=64")
EnvSpec(scheme='verifiers', target='owner/vf-gsm8k', attr=None, options={'num_train_examples': 64}, split='train')
>>> parse_env_spec("openenv:my_envs.echo.server.app:app?action=message").attr
'app'
>>> parse_env_spec("pkg.module:MyEnv") is None
True
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qsl

from raygym.errors import ConfigError

SCHEMES = ("verifiers", "openenv")
OPENENV_OPTIONS = ("action", "observation", "sessions", "servers", "stop")
_MODULE = r"[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*"
_ATTR = r"[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*"
_ENV_ID = r"(?:[\w.-]+/)?[A-Za-z_][\w.-]*"
SPLITS = ("train", "eval")


@dataclass(frozen=True)
class EnvSpec:
    """An environment named by ``<scheme>:<target>[:<attr>][?options][#split]`` (see the module docstring)."""

    scheme: str
    target: str
    attr: str | None = None
    options: dict[str, Any] = field(default_factory=dict)
    split: str = "train"

    @property
    def module(self) -> str:
        """The module to import: an env id's module name (verifiers' rule: the part after ``/``, ``-`` as ``_``)."""
        return self.target.split("/")[-1].replace("-", "_")


def scheme_of(value: Any) -> str | None:
    """``"verifiers"`` or ``"openenv"`` for a string naming an environment of that project, else None."""
    if isinstance(value, str):
        head = value.split(":", 1)[0]
        if head in SCHEMES and ":" in value:
            return head
    return None


def _json_or_text(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def parse_env_spec(value: Any, field_name: str = "rollout_env") -> EnvSpec | None:
    """The :class:`EnvSpec` of a ``verifiers:`` / ``openenv:`` string; None for anything else (an import path,
    a callable). ConfigError naming ``field_name`` for a malformed one."""
    scheme = scheme_of(value)
    if scheme is None:
        return None
    assert isinstance(value, str)
    body = value[len(scheme) + 1:]
    body, _, split = body.partition("#")
    body, _, query = body.partition("?")
    target_pattern = _ENV_ID if scheme == "verifiers" else _MODULE
    found = re.fullmatch(rf"({target_pattern})(?::({_ATTR}))?", body)
    example = ("'verifiers:reverse-text', 'verifiers:my_pkg.my_env' or 'verifiers:my_pkg.my_env:load_environment'"
               if scheme == "verifiers" else "'openenv:my_env.server.app' or 'openenv:my_env.server.app:app'")
    if found is None:
        raise ConfigError(f"{field_name}={value!r}: not a {scheme} environment; write it as {example}")
    try:
        pairs = parse_qsl(query, keep_blank_values=True, strict_parsing=True) if query else []
    except ValueError:
        raise ConfigError(f"{field_name}={value!r}: the part after '?' must be key=value pairs joined by '&'") from None
    options = {k: _json_or_text(v) for k, v in pairs}
    split = split or "train"
    if split not in SPLITS:
        raise ConfigError(f"{field_name}={value!r}: '#{split}' is no dataset split; use '#train' or '#eval'")
    if scheme == "openenv":
        unknown = sorted(set(options) - set(OPENENV_OPTIONS))
        if unknown:
            raise ConfigError(f"{field_name}={value!r}: unknown option {', '.join(map(repr, unknown))}; the options "
                              f"are {', '.join(OPENENV_OPTIONS)}")
        for name in ("sessions", "servers"):
            if name in options and (not isinstance(options[name], int) or options[name] < 1):
                raise ConfigError(f"{field_name}={value!r}: {name}={options[name]!r} must be a whole number >= 1")
    return EnvSpec(scheme, found.group(1), found.group(2), options, split)
