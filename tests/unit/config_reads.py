"""Which config fields a module of raygym reads, from its source (``ast``), not from any string in it.

A read of field ``f`` is an attribute ``<expr>.f`` where ``<expr>`` is typed as a config model
(``Recipe``, ``ModelConfig``, ``DatasetConfig``, ``MetricsConfig``, ``TrainConfig`` and their bases) or a view
(a ``recipe_view`` class) that declares ``f``. Types come from what the source states: a parameter's or
variable's annotation, a class's annotated attributes (of any class the module defines or imports, e.g.
``RunGraph.recipe: Recipe``), ``self.x = <typed value>`` in a method, a local ``x = <typed value>``, and calls
that build a config or view: ``T(...)``, ``T.from_...(...)``, ``cls.from_...(...)``, ``build_view(T, ...)``,
``x.replace(...)``. Two dynamic forms count too, as they read the attribute of a typed config: ``getattr(cfg,
name)`` in a loop over a table of field names (``for name in TABLE`` / ``TABLE.items()``, the table imported or
defined by the module), and ``data["f"]`` / ``data.get("f")`` on the raw input of a config model's
``model_validator(mode="before")``. Any other string, a keyword argument or a bare ``getattr`` is no read.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import importlib
import re
import typing
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from raygym.config.recipe_fields import RecipeFields
from raygym.config.sections import DatasetConfig, MetricsConfig, ModelConfig, RunLocation
from raygym.config.views import view_extras

ROOT = Path(__file__).resolve().parents[2]
CONFIG_BASES: tuple[type, ...] = (RecipeFields, ModelConfig, DatasetConfig, MetricsConfig, RunLocation)


def view_classes() -> list[type]:
    """Every class of raygym decorated with ``recipe_view`` (found in the source, then imported)."""
    found = []
    for path in sorted((ROOT / "raygym").rglob("*.py")):
        if "recipe_view" not in path.read_text():
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and any(
                isinstance(d, ast.Call) and isinstance(d.func, ast.Name) and d.func.id == "recipe_view"
                for d in node.decorator_list
            ):
                module = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
                found.append(getattr(importlib.import_module(module), node.name))
    return found


VIEWS = tuple(view_classes())


def protocol_members(cls: type) -> set[str]:
    """The attributes a ``typing.Protocol`` declares (annotations and properties of its own body)."""
    if not getattr(cls, "_is_protocol", False):
        return set()
    return set(vars(cls).get("__annotations__", {})) | {n for n, v in vars(cls).items() if isinstance(v, property)}


def is_recipe_protocol(cls: type) -> bool:
    """A protocol that names recipe fields only (``raygym.lora.LoraFields``): a typed view of the recipe."""
    members = protocol_members(cls)
    return bool(members) and members <= set(RecipeFields.model_fields)


def is_config_type(cls: type) -> bool:
    return (isinstance(cls, type) and issubclass(cls, CONFIG_BASES)) or cls in VIEWS or is_recipe_protocol(cls)


def declared_fields(cls: type) -> set[str]:
    """The fields a config model, view or recipe protocol declares."""
    if isinstance(cls, type) and issubclass(cls, BaseModel):
        return set(cls.model_fields)
    if dataclasses.is_dataclass(cls):
        return {f.name for f in dataclasses.fields(cls)}
    return protocol_members(cls)


def _single_type_name(annotation: str) -> str | None:
    """``"Recipe"``, ``"Recipe | None"``, ``"Optional[Recipe]"``, ``"raygym.config.Recipe"`` -> the class name
    (None for anything else: a list of them, a union of two classes, a generic)."""
    text = annotation.strip().strip("\"'")
    text = re.sub(r"^(typing\.)?Optional\[(.*)\]$", r"\2", text)
    parts = [p.strip() for p in text.split("|") if p.strip() != "None"]
    if len(parts) != 1 or not re.fullmatch(r"[A-Za-z_][\w.]*", parts[0]):
        return None
    return parts[0]


class ModuleTypes:
    """The names a module can refer to as classes: what it defines, imports (also under ``TYPE_CHECKING``
    and inside functions), resolved by importing their modules."""

    def __init__(self, module: str, tree: ast.Module) -> None:
        self.module = module
        self.imported: dict[str, tuple[str, str | None]] = {}  # local name -> (module, attribute or None)
        package = module.rpartition(".")[0]
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(parts + ([base] if base else []))
                for alias in node.names:
                    self.imported[alias.asname or alias.name] = (base, alias.name)
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    self.imported[alias.asname or alias.name.split(".")[0]] = (alias.name, None)

    def resolve(self, dotted: str) -> Any:
        """The object ``dotted`` names in this module (None when it names nothing importable)."""
        head, *rest = dotted.split(".")
        try:
            if head in self.imported:
                mod, attr = self.imported[head]
                obj: Any = importlib.import_module(mod)
                if attr is not None:
                    obj = getattr(obj, attr, None) or importlib.import_module(f"{mod}.{attr}")
            else:
                obj = getattr(importlib.import_module(self.module), head)
            for name in rest:
                obj = getattr(obj, name)
        except (ImportError, AttributeError):
            return None
        return obj

    def resolve_class(self, annotation: str) -> type | None:
        name = _single_type_name(annotation)
        obj = self.resolve(name) if name else None
        return obj if isinstance(obj, type) else None


@functools.cache
def module_types(module: str) -> ModuleTypes:
    source = Path(typing.cast(str, importlib.import_module(module).__file__)).read_text()
    return ModuleTypes(module, ast.parse(source))


def attribute_type(cls: type, attr: str) -> type | None:
    """The class ``cls`` declares its attribute ``attr`` to be (annotations over its bases), if one class."""
    for klass in cls.__mro__:
        annotation = klass.__dict__.get("__annotations__", {}).get(attr)
        if annotation is None:
            continue
        if not isinstance(annotation, str):
            return annotation if isinstance(annotation, type) else None
        return module_types(klass.__module__).resolve_class(annotation)
    return None


class Reads(ast.NodeVisitor):
    """Collects ``(class, field)`` for every attribute read on an expression whose type is known."""

    def __init__(self, module: str, path: Path) -> None:
        self.tree = ast.parse(path.read_text(), str(path))
        self.types = ModuleTypes(module, self.tree)
        self.reads: set[tuple[type, str]] = set()
        self.scopes: list[dict[str, type]] = [{}]
        self.loop_names: dict[str, set[str]] = {}  # loop variable -> the field names of the table it runs over
        self.raw_input: dict[str, type] = {}  # a before-validator's raw input -> the config model it builds
        self.classes: list[tuple[str, dict[str, type]]] = []  # enclosing classes: name, ``self.x`` types
        self.self_attrs = self._self_attributes()

    # ---- what each class of the module assigns to self.x (in any method), by class name
    def _self_attributes(self) -> dict[str, dict[str, type]]:
        out: dict[str, dict[str, type]] = {}
        for cls in (n for n in ast.walk(self.tree) if isinstance(n, ast.ClassDef)):
            attrs: dict[str, type] = {}
            for item in cls.body:
                if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                    found = self.types.resolve_class(ast.unparse(item.annotation))
                    if found:
                        attrs[item.target.id] = found
            for method in (n for n in cls.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))):
                params = self._params(method)
                for node in ast.walk(method):
                    targets: list[tuple[ast.expr, ast.expr | None, ast.expr | None]] = []
                    if isinstance(node, ast.Assign):
                        targets = [(t, node.value, None) for t in node.targets]
                    elif isinstance(node, ast.AnnAssign):
                        targets = [(node.target, node.value, node.annotation)]
                    for target, value, annotation in targets:
                        if (isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name)
                                and target.value.id == "self"):
                            found = (self.types.resolve_class(ast.unparse(annotation)) if annotation is not None
                                     else self._type_of(value, [params]) if value is not None else None)
                            if found:
                                attrs.setdefault(target.attr, found)
            out[cls.name] = attrs
        return out

    def _params(self, fn: ast.FunctionDef | ast.AsyncFunctionDef) -> dict[str, type]:
        env: dict[str, type] = {}
        args = fn.args
        for arg in [*args.posonlyargs, *args.args, *args.kwonlyargs]:
            if arg.annotation is not None:
                found = self.types.resolve_class(ast.unparse(arg.annotation))
                if found:
                    env[arg.arg] = found
        return env

    # ---- types of expressions
    def _own_class(self) -> type | None:
        """The class whose body the walk is in (``self`` / ``cls``), when it is a module-level one."""
        own = self.types.resolve(self.classes[-1][0]) if self.classes else None
        return own if isinstance(own, type) else None

    def _class_ref(self, node: ast.expr) -> type | None:
        """The class an expression names (``Recipe``, ``config.Recipe``, ``cls``)."""
        if isinstance(node, ast.Name) and node.id == "cls":
            return self._own_class()
        if isinstance(node, (ast.Name, ast.Attribute)) and re.fullmatch(r"[\w.]+", ast.unparse(node)):
            obj = self.types.resolve(ast.unparse(node))
            return obj if isinstance(obj, type) else None
        return None

    def _type_of(self, node: ast.expr, scopes: list[dict[str, type]]) -> type | None:
        if isinstance(node, ast.Name):
            if node.id == "self":
                return self._own_class()
            for scope in reversed(scopes):
                if node.id in scope:
                    return scope[node.id]
            return None
        if isinstance(node, ast.Attribute):
            if isinstance(node.value, ast.Name) and node.value.id == "self" and self.classes:
                local = self.self_attrs.get(self.classes[-1][0], {}).get(node.attr)
                if local is not None:
                    return local
            owner = self._type_of(node.value, scopes)
            return attribute_type(owner, node.attr) if owner is not None else None
        if isinstance(node, ast.Call):
            func = node.func
            made = self._class_ref(func)
            if made is not None:
                return made
            if isinstance(func, ast.Attribute):
                if func.attr.startswith("from_"):
                    return self._class_ref(func.value)
                if func.attr in ("replace", "model_copy"):
                    return self._type_of(func.value, scopes)
            if isinstance(func, ast.Name) and func.id == "build_view" and node.args:
                return self._class_ref(node.args[0])
        return None

    # ---- the walk
    def _function(self, node: ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        self.scopes.append(self._params(node))
        own = self._own_class()
        before = any(isinstance(d, ast.Call) and ast.unparse(d.func).endswith("model_validator")
                     and any(k.arg == "mode" and ast.unparse(k.value) == "'before'" for k in d.keywords)
                     for d in node.decorator_list)
        raw = node.args.args[1].arg if before and own is not None and len(node.args.args) > 1 else None
        if raw is not None:
            self.raw_input[raw] = typing.cast(type, own)
        for stmt in node.body:
            self.visit(stmt)
        if raw is not None:
            del self.raw_input[raw]
        self.scopes.pop()

    def _table_names(self, node: ast.expr) -> set[str]:
        """The string keys of the table a loop runs over: ``T``, ``T.items()``, ``T.keys()``, ``sorted(T)``."""
        if isinstance(node, ast.Call) and not node.args and isinstance(node.func, ast.Attribute) \
                and node.func.attr in ("items", "keys"):
            node = node.func.value
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "sorted" and node.args:
            node = node.args[0]
        if not (isinstance(node, (ast.Name, ast.Attribute)) and re.fullmatch(r"[\w.]+", ast.unparse(node))):
            return set()
        table = self.types.resolve(ast.unparse(node))
        if not isinstance(table, (dict, tuple, list, set, frozenset)):
            return set()
        return {key for key in table if isinstance(key, str)}

    def visit_For(self, node: ast.For) -> None:
        target = node.target.elts[0] if isinstance(node.target, ast.Tuple) and node.target.elts else node.target
        names = self._table_names(node.iter)
        if isinstance(target, ast.Name) and names:
            self.loop_names[target.id] = names
        self.generic_visit(node)
        if isinstance(target, ast.Name):
            self.loop_names.pop(target.id, None)

    def visit_Call(self, node: ast.Call) -> None:
        self.generic_visit(node)
        func = node.func
        if isinstance(func, ast.Name) and func.id == "getattr" and len(node.args) >= 2 \
                and isinstance(node.args[1], ast.Name) and node.args[1].id in self.loop_names:
            owner = self._type_of(node.args[0], self.scopes)
            if owner is not None and is_config_type(owner):
                self.reads |= {(owner, name) for name in self.loop_names[node.args[1].id] & declared_fields(owner)}
        if isinstance(func, ast.Attribute) and func.attr == "get" and isinstance(func.value, ast.Name) \
                and func.value.id in self.raw_input and node.args and isinstance(node.args[0], ast.Constant):
            self._raw_read(func.value.id, node.args[0].value)

    def visit_Subscript(self, node: ast.Subscript) -> None:
        self.generic_visit(node)
        if isinstance(node.value, ast.Name) and node.value.id in self.raw_input and isinstance(node.slice, ast.Constant) \
                and isinstance(node.ctx, ast.Load):
            self._raw_read(node.value.id, node.slice.value)

    def _raw_read(self, raw: str, key: object) -> None:
        owner = self.raw_input[raw]
        if isinstance(key, str) and key in declared_fields(owner):
            self.reads.add((owner, key))

    visit_FunctionDef = _function
    visit_AsyncFunctionDef = _function

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        self.classes.append((node.name, self.self_attrs.get(node.name, {})))
        self.scopes.append({})  # the class body's names are no variables of the code around it
        self.generic_visit(node)
        self.scopes.pop()
        self.classes.pop()

    def _bind(self, target: ast.expr, value: ast.expr | None, annotation: ast.expr | None = None) -> None:
        if isinstance(target, ast.Name):
            found = (self.types.resolve_class(ast.unparse(annotation)) if annotation is not None
                     else self._type_of(value, self.scopes) if value is not None else None)
            if found:
                self.scopes[-1][target.id] = found
        elif isinstance(target, ast.Tuple) and isinstance(value, ast.Tuple) and len(target.elts) == len(value.elts):
            for t, v in zip(target.elts, value.elts, strict=True):
                self._bind(t, v)

    def visit_Assign(self, node: ast.Assign) -> None:
        self.generic_visit(node)
        for target in node.targets:
            self._bind(target, node.value)

    def visit_AnnAssign(self, node: ast.AnnAssign) -> None:
        self.generic_visit(node)
        self._bind(node.target, node.value, node.annotation)

    def visit_Attribute(self, node: ast.Attribute) -> None:
        self.generic_visit(node)
        if isinstance(node.ctx, ast.Load):
            owner = self._type_of(node.value, self.scopes)
            if owner is not None and is_config_type(owner) and node.attr in declared_fields(owner):
                self.reads.add((owner, node.attr))


def fields_read(path: str | Path) -> set[tuple[type, str]]:
    """``(config model or view, field)`` of every field the module at ``path`` (relative to the repository, or
    absolute) reads as an attribute of a typed config or view.

    >>> (ModelConfig, "hf_checkpoint") in fields_read("raygym/run/driver.py")
    True
    """
    full = ROOT / path
    parts = full.relative_to(ROOT).with_suffix("").parts if full.is_relative_to(ROOT) else (full.stem,)
    reads = Reads(".".join(parts).removesuffix(".__init__"), full)
    reads.visit(reads.tree)
    return reads.reads


def reads_field(path: str, model: type, field: str) -> bool:
    """Whether the module reads ``model``'s ``field``: from the model (or a subclass, or the base declaring it),
    or, for a recipe field, from a view that carries it under its own name (not one of the view's extras) or a
    protocol naming recipe fields."""
    for owner, name in fields_read(path):
        if name != field:
            continue
        if is_recipe_protocol(owner):
            if issubclass(model, RecipeFields):
                return True
        elif issubclass(owner, model) or issubclass(model, owner):
            return True
        elif owner in VIEWS and issubclass(model, RecipeFields) and name not in view_extras(owner):
            return True
    return False
