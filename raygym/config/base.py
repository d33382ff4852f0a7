"""What every config model shares: the pydantic base (strict, unknown fields refused, errors as
ConfigError naming field, value and fix), the checks the models run, and the field helpers. Pure."""

from __future__ import annotations

import difflib
import json
import math
import re
from collections.abc import Callable, Sequence
from typing import Any, Self

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from raygym.callables import IMPORT_PATH
from raygym.errors import ConfigError

MiB = 1024 * 1024


def megatron_installed() -> bool:
    """Whether megatron-core can be imported in this environment (looked up, not imported)."""
    import importlib.util

    return importlib.util.find_spec("megatron") is not None and importlib.util.find_spec("megatron.core") is not None


# A user function: the callable itself, or its import path "pkg.module:function" (or "pkg.module.function").
CustomFunction = Callable[..., Any] | str | None
# Environment keys that look like credentials: secrets come from the process environment, never the config.
SECRET_KEY = re.compile(r"(API_KEY|TOKEN|SECRET|PASSWORD|PASSWD|CREDENTIAL)", re.IGNORECASE)


def flag_name(field: str) -> str:
    return "--" + field.replace("_", "-")


def type_name(annotation: Any) -> str:
    text = str(annotation) if not isinstance(annotation, type) else annotation.__name__
    return text.replace("typing.", "").replace("collections.abc.", "")


def config_error_from(exc: ValidationError, model: type[BaseModel]) -> ConfigError:
    """One ConfigError for a pydantic ValidationError: our own message when a rule raised it."""
    messages: list[str] = []
    for err in exc.errors():
        inner = (err.get("ctx") or {}).get("error")
        if isinstance(inner, ConfigError):
            return inner
        loc = [part for part in err["loc"] if isinstance(part, str)]
        owner: type[BaseModel] = model
        path: list[str] = []
        for part in loc:
            if part not in owner.model_fields:
                break
            path.append(part)
            annotation = owner.model_fields[part].annotation
            if isinstance(annotation, type) and issubclass(annotation, BaseModel):
                owner = annotation
            else:
                break
        name = path[-1] if path else (loc[0] if loc else model.__name__)
        dotted = ".".join(path) or name
        if err["type"] == "extra_forbidden":
            close = difflib.get_close_matches(name, list(owner.model_fields), n=3)
            hint = f"did you mean {', '.join(close)}?" if close else f"see the fields of {owner.__name__}"
            messages.append(f"{dotted}: unknown field of {owner.__name__}; {hint}")
        elif err["type"] == "missing" and name == "model":
            messages.append("model: required; pass model=ModelConfig(hf_checkpoint=...) (--hf-checkpoint)")
        elif err["type"] == "missing":
            messages.append(f"{dotted}: required; set it (e.g. {flag_name(name)} VALUE)")
        else:
            expected = type_name(owner.model_fields[name].annotation) if name in owner.model_fields else "?"
            messages.append(
                f"{dotted}={err.get('input')!r}: {err['msg']} (expected {expected}); "
                f"set {flag_name(name)} to a value of that type"
            )
    return ConfigError("; ".join(messages))


class Section(BaseModel):
    """Base of the config models: strict types, no unknown fields, ConfigError on bad input."""

    model_config = ConfigDict(
        extra="forbid", strict=True, arbitrary_types_allowed=True, validate_assignment=False
    )

    def __init__(self, **data: Any) -> None:
        try:
            super().__init__(**data)
        except ValidationError as exc:
            raise config_error_from(exc, type(self)) from None

    @classmethod
    def model_validate(cls, obj: Any, *args: Any, **kwargs: Any) -> Self:
        try:
            return super().model_validate(obj, *args, **kwargs)
        except ValidationError as exc:
            raise config_error_from(exc, cls) from None

    def field_values(self) -> dict[str, Any]:
        """Every field's current value, by name (no copies, callables kept)."""
        return {name: getattr(self, name) for name in type(self).model_fields}

    def replace(self, **changes: Any) -> Self:
        """A validated copy with ``changes`` applied (``model_copy`` would skip validation)."""
        return type(self)(**{**self.field_values(), **changes})


def check_choice(field: str, value: Any, choices: Sequence[Any]) -> None:
    if value not in choices:
        raise ConfigError(f"{field}={value!r}: must be one of {', '.join(repr(c) for c in choices)}")


def check_int(field: str, value: int | None, minimum: int, *, optional: bool = False) -> None:
    if value is None:
        if optional:
            return
        raise ConfigError(f"{field}=None: must be an int >= {minimum}; set {flag_name(field)}")
    if value < minimum:
        raise ConfigError(f"{field}={value!r}: must be >= {minimum}; set {flag_name(field)} to {minimum} or more")


def check_range(
    field: str,
    value: float | None,
    low: float,
    high: float,
    *,
    low_open: bool = False,
    high_open: bool = False,
) -> None:
    """``value`` within [low, high] (with open ends as asked); NaN is always out of range."""
    if value is None:
        return
    ok = not math.isnan(value)
    ok = ok and (value > low if low_open else value >= low) and (value < high if high_open else value <= high)
    if not ok:
        interval = f"{'(' if low_open else '['}{low}, {high}{')' if high_open else ']'}"
        raise ConfigError(f"{field}={value!r}: must lie in {interval}; set {flag_name(field)} inside that range")


def check_no_secrets(field: str, env: Any) -> None:
    if isinstance(env, dict):
        for key in env:
            if SECRET_KEY.search(str(key)):
                raise ConfigError(
                    f"{field}[{key!r}]: looks like a credential; configs are written to disk and passed on "
                    f"command lines, so export {key} in the environment of the driver instead"
                )


def check_unsupported(values: dict[str, Any], reasons: dict[str, str]) -> None:
    """ConfigError for a field of ``reasons`` (name -> why raygym does not run it) set to a non-empty value
    (every such field defaults to an empty one)."""
    for field, reason in reasons.items():
        if values[field]:
            raise ConfigError(
                f"{field}={values[field]!r}: not supported by raygym ({reason}); remove {flag_name(field)} from the config"
            )


def check_import_path(field: str, value: Any) -> None:
    if isinstance(value, str) and (not IMPORT_PATH.match(value) or ("." not in value and ":" not in value)):
        raise ConfigError(f"{field}={value!r}: not an import path; write it as 'pkg.module:function'")


def parse_json_object(field: str, text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(
            f'{field}={text!r}: not valid JSON ({exc}); pass a JSON object like \'{{"k": "v"}}\''
        ) from None
    if not isinstance(value, dict):
        raise ConfigError(f'{field}={text!r}: must be a JSON object, like \'{{"k": "v"}}\'')
    return value


def option(default: Any, doc: str) -> Any:
    return Field(default, description=doc)


def option_factory(factory: Callable[[], Any], doc: str) -> Any:
    return Field(default_factory=factory, description=doc)
