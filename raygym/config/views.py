"""Typed, frozen views of a validated config: what one component reads, under the Recipe's own field
names, filled in one place (:func:`build_view`) so the :class:`~raygym.config.recipe.Recipe` stays the one
place a default lives. Pure.

A view is a frozen dataclass whose fields have NO defaults, marked with :func:`recipe_view`. Each field is
the same-named Recipe field, except the ``extras`` the view declares: values that come from elsewhere (the
model config, a resolved path, a derived count), which its builder passes by name.

>>> from dataclasses import dataclass
>>> @recipe_view(extras=("hf_checkpoint",))
... @dataclass(frozen=True)
... class Example:
...     lr: float
...     hf_checkpoint: str
>>> build_view(Example, Recipe(lr=0.1), hf_checkpoint="m")
Example(lr=0.1, hf_checkpoint='m')
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

from raygym.config.recipe import Recipe

V = TypeVar("V")


def view_problems(cls: type, extras: Iterable[str] = ()) -> list[str]:
    """Why ``cls`` is not a valid view (empty when it is): not a frozen dataclass, a field with a default,
    a field that is neither a Recipe field nor a declared extra, an extra that is not a field."""
    if not dataclasses.is_dataclass(cls):
        return [f"{cls.__name__}: not a dataclass"]
    problems = []
    if not cls.__dataclass_params__.frozen:  # type: ignore[attr-defined]
        problems.append(f"{cls.__name__}: not frozen")
    extras = set(extras)
    names = set()
    for f in dataclasses.fields(cls):
        names.add(f.name)
        if f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING:
            problems.append(f"{cls.__name__}.{f.name}: has a default (the Recipe holds the defaults)")
        if f.name not in extras and f.name not in Recipe.model_fields:
            problems.append(f"{cls.__name__}.{f.name}: neither a Recipe field nor a declared extra")
    problems += [f"{cls.__name__}: extra {name!r} is not a field" for name in sorted(extras - names)]
    return problems


def recipe_view(*, extras: Iterable[str] = ()) -> Callable[[type[V]], type[V]]:
    """Mark a frozen dataclass as a view of the Recipe; ``extras``: its fields that do not come from the
    Recipe (its builder passes them to :func:`build_view`). A malformed view fails at import."""
    declared = frozenset(extras)

    def mark(cls: type[V]) -> type[V]:
        problems = view_problems(cls, declared)
        if problems:
            raise TypeError("; ".join(problems))
        cls.__view_extras__ = declared  # type: ignore[attr-defined]
        return cls

    return mark


def view_extras(cls: type) -> frozenset[str]:
    """The extras a view declared (``recipe_view(extras=...)``)."""
    return cls.__view_extras__  # type: ignore[attr-defined,no-any-return]


def build_view(cls: type[V], recipe: Recipe | object, /, **extras: Any) -> V:
    """The view ``cls`` of ``recipe``: every field from the same-named Recipe field, the declared extras
    from ``extras`` (all of them, nothing else). ``recipe`` may also be a view that carries those fields (a
    narrower view built from a wider one, e.g. the Megatron options from the trainer's settings)."""
    declared = view_extras(cls)
    if set(extras) != declared:
        raise TypeError(
            f"{cls.__name__}: extras {sorted(extras)} given, {sorted(declared)} declared"
        )
    values = {f.name: getattr(recipe, f.name) for f in dataclasses.fields(cls)  # type: ignore[arg-type]
              if f.name not in declared}
    return cls(**values, **extras)
