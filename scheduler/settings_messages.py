"""Errors in trainyard.toml for people: one line per problem, with the key's path and the value."""

from __future__ import annotations

from typing import Annotated, Any, Union, get_args, get_origin

from pydantic import BaseModel, ValidationError

_EXPECTED = {
    "bool_type": "expected true or false",
    "int_type": "expected a whole number",
    "float_type": "expected a number",
    "finite_number": "expected a finite number",
    "string_type": "expected a string",
    "list_type": "expected a list",
    "dict_type": "expected a table",
    "model_type": "expected a table",
    "model_attributes_type": "expected a table",
}


def describe(error: ValidationError, root: type[BaseModel]) -> list[str]:
    """One line per problem: the key's path in trainyard.toml, what is wrong, and the value."""
    lines = []
    for e in error.errors(include_url=False):
        loc = [p for p in e["loc"] if p != "[key]"]
        path = _path(loc) or "trainyard.toml"
        kind, value, ctx = e["type"], e.get("input"), e.get("ctx") or {}
        if kind == "value_error":
            text = str(ctx.get("error", e["msg"]))
            # checks across tables name their keys themselves, one problem per line
            lines += [f"{path}: {text}"] if loc else text.splitlines()
            continue
        if kind == "extra_forbidden":
            what = "setting" if len(loc) > 1 else "table"
            known = _known_keys(root, loc[:-1])
            hint = f"; known {what}s: {', '.join(known)}" if known else ""
            lines.append(f"{path}: unknown {what} (value {short(value)}){hint}")
            continue
        if kind == "literal_error":
            text = f"expected one of {ctx.get('expected')}"
        elif kind in ("greater_than", "greater_than_equal", "less_than", "less_than_equal"):
            op = {"greater_than": ">", "greater_than_equal": ">=", "less_than": "<",
                  "less_than_equal": "<="}[kind]
            bound = next(iter(ctx.values()))
            text = f"must be {op} {bound:g}" if isinstance(bound, float) else f"must be {op} {bound}"
        else:
            text = _EXPECTED.get(kind, e["msg"])
        lines.append(f"{path}: {text}, got {short(value)}")
    return lines


def short(value: object, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _path(loc: list) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif out:
            out += f".{part}"
        else:
            out = str(part)
    return out


def _known_keys(root: type[BaseModel], loc: list) -> list[str]:
    """The keys the table at `loc` accepts, found by walking the models' annotations."""
    t: Any = root
    for part in loc:
        t = _model_or_container(t)
        if isinstance(t, type) and issubclass(t, BaseModel):
            field = t.model_fields.get(str(part))
            if field is None:
                return []
            t = field.annotation
        else:
            args = get_args(t)
            t = args[-1] if args else None
    t = _model_or_container(t)
    return sorted(t.model_fields) if isinstance(t, type) and issubclass(t, BaseModel) else []


def _model_or_container(t: Any) -> Any:
    while True:
        origin = get_origin(t)
        if origin is Annotated:
            t = get_args(t)[0]
        elif origin is Union or type(t).__name__ == "UnionType":
            t = next(a for a in get_args(t) if a is not type(None))
        else:
            return t
