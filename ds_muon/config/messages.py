"""Turning pydantic's validation errors into ds_muon's one-line-per-problem messages (layer ``config``).

Generic over the config models: a line names the key path (nested models and list items included),
the offending value and what is allowed, derived from the field's annotation and bounds, or from the
model's :data:`ALLOWED_TEXT` class attribute for the few fields whose type says too little (a pair of
betas, a mapping of splits). An unknown key gets "did you mean" from the keys of the model it was
given to. Imports neither torch nor deepspeed.
"""
from __future__ import annotations

import difflib
import types
import typing
from typing import Any, Literal, Optional, Union

import annotated_types
from pydantic import AliasChoices, BaseModel, ValidationError
from pydantic_core import PydanticCustomError

__all__ = ["AUTO_HINT", "ALLOWED_TEXT", "REFUSED_KEYS", "custom_error", "error_lines", "known_keys", "allowed_text"]

#: Class attribute of a config model: ``{field: what the field accepts}``, where the annotation alone does
#: not say it well.
ALLOWED_TEXT = "ALLOWED_TEXT"
#: Class attribute of a config model: ``{key: why it is refused and the fix}`` for keys people bring from
#: elsewhere (DeepSpeed's built-in Muon) that the model does not accept.
REFUSED_KEYS = "REFUSED_KEYS"

AUTO_HINT = (" ('auto' is a placeholder the Hugging Face DeepSpeed integration fills in; validate the "
             "config after it has done so, or write the number)")


def custom_error(reason: str, **ctx: Any) -> PydanticCustomError:
    """A pydantic error whose message is ``reason`` (taken literally); ``ctx`` may carry ``key`` (the key to
    name instead of the location), ``value`` and ``allowed``, which :func:`error_lines` uses."""
    ctx["reason"] = reason
    return PydanticCustomError("ds_muon", reason.replace("{", "{{").replace("}", "}}"), ctx)


def _fmt_num(x: Any) -> str:
    return f"{x:g}" if isinstance(x, float) else str(x)


def _aliases(field) -> list[str]:
    alias = field.validation_alias
    if isinstance(alias, AliasChoices):
        return [a for a in alias.choices if isinstance(a, str)]
    return [alias] if isinstance(alias, str) else []


def known_keys(model: type[BaseModel]) -> list[str]:
    """The keys ``model`` accepts: its fields, then the aliases that are not field names."""
    keys = list(model.model_fields)
    return keys + [a for f in model.model_fields.values() for a in _aliases(f) if a not in keys]


def _field_of(model: type[BaseModel], key: str) -> Optional[str]:
    """The field name ``key`` (a field or an alias) stands for in ``model``."""
    if key in model.model_fields:
        return key
    return next((n for n, f in model.model_fields.items() if key in _aliases(f)), None)


def _nested_model(annotation: Any) -> Optional[type[BaseModel]]:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    return None


def allowed_text(model: type[BaseModel], name: str) -> str:
    """What field ``name`` of ``model`` accepts, in words, from its annotation and bounds (or the model's
    :data:`ALLOWED_TEXT`); a nested model lists its keys with what each accepts."""
    override = getattr(model, ALLOWED_TEXT, {}).get(name)
    if override:
        return override
    field = model.model_fields.get(name)
    if field is None:
        return f"see the {model.__name__} documentation"
    ann = field.annotation
    nested = _nested_model(ann)
    if nested is not None:
        return "an object with keys " + ", ".join(f"{k} ({allowed_text(nested, k)})" for k in nested.model_fields)
    optional = False
    origin = typing.get_origin(ann)
    if origin is Union or origin is types.UnionType:
        args = [a for a in typing.get_args(ann) if a is not type(None)]
        optional = len(args) < len(typing.get_args(ann))
        ann = args[0] if len(args) == 1 else ann
    if typing.get_origin(ann) is Literal:
        text = "one of " + ", ".join(repr(v) for v in typing.get_args(ann))
    elif ann is bool:
        text = "true or false"
    elif ann in (int, float):
        lo = hi = None
        for m in field.metadata:
            if isinstance(m, annotated_types.Gt):
                lo = ("(", m.gt)
            elif isinstance(m, annotated_types.Ge):
                lo = ("[", m.ge)
            elif isinstance(m, annotated_types.Lt):
                hi = (")", m.lt)
            elif isinstance(m, annotated_types.Le):
                hi = ("]", m.le)
        kind = "an integer" if ann is int else "a number"
        if lo and hi:
            text = f"{kind} in {lo[0]}{_fmt_num(lo[1])}, {_fmt_num(hi[1])}{hi[0]}"
        elif lo:
            text = f"{kind} {'>' if lo[0] == '(' else '>='} {_fmt_num(lo[1])}"
        elif hi:
            text = f"{kind} {'<' if hi[0] == ')' else '<='} {_fmt_num(hi[1])}"
        else:
            text = kind
    elif typing.get_origin(ann) is list and typing.get_args(ann) == (str,):
        text = "a list of fnmatch glob pattern strings"
    else:
        text = f"see the {model.__name__} documentation"
    return text + (" or null" if optional else "")


def _suggest(key: str, model: type[BaseModel]) -> list[str]:
    candidates = known_keys(model)
    norm = key.strip().lower().replace("-", "_").replace(" ", "_")
    if norm in candidates and norm != key:
        return [norm]
    return difflib.get_close_matches(norm, candidates, n=2, cutoff=0.6)


def _loc_path(path: str, loc: tuple) -> str:
    out = path
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def _unknown_key_line(where: str, key: str, value: Any, model: type[BaseModel]) -> str:
    refused = getattr(model, REFUSED_KEYS, {})
    if key in refused:
        return f"{where}: {value!r} is not accepted: '{key}' {refused[key]}"
    line = f"{where}: unknown key (value {value!r})"
    suggestions = _suggest(key, model)
    if suggestions:
        line += "; did you mean " + " or ".join(repr(s) for s in suggestions) + "?"
    return line + (" Known keys: " if suggestions else "; known keys: ") + ", ".join(known_keys(model))


def _owner(model: type[BaseModel], loc: tuple) -> tuple[type[BaseModel], tuple, Optional[str]]:
    """Walk ``loc`` through nested models: ``(the innermost model, the rest of loc inside it, its field)``."""
    current, rest = model, tuple(loc)
    while rest and isinstance(rest[0], str):
        name = _field_of(current, rest[0])
        nested = _nested_model(current.model_fields[name].annotation) if name else None
        if nested is None or len(rest) == 1:
            return current, rest, name
        current, rest = nested, rest[1:]
    return current, rest, None


def error_lines(err: ValidationError, path: str, model: type[BaseModel]) -> list[str]:
    """One line per problem of ``err`` (raised by ``model.model_validate`` of the value at ``path``)."""
    lines = []
    for e in err.errors(include_url=False):
        loc = tuple(e.get("loc", ()))
        ctx = e.get("ctx") or {}
        if "key" in ctx:  # a model-level ds_muon check (loc: its model) that names its key
            loc = loc + (ctx["key"],)
        value = ctx["value"] if "value" in ctx else e.get("input")
        if e["type"] == "model_type" and not loc:
            lines.append(f"{path}: {value!r} is invalid: must be an object (a dict of optimizer settings)")
            continue
        owner, rest, name = _owner(model, loc)
        if e["type"] == "extra_forbidden" and len(rest) == 1:
            lines.append(_unknown_key_line(_loc_path(path, loc), str(rest[0]), e.get("input"), owner))
            continue
        reason = ctx.get("reason", e.get("msg", "invalid"))
        allowed = ctx.get("allowed") or (allowed_text(owner, name) if name else f"see the {owner.__name__} documentation")
        line = f"{_loc_path(path, loc)}: {value!r} is invalid: {reason}; allowed: {allowed}"
        if value == "auto" and "auto" not in allowed:
            line += AUTO_HINT
        lines.append(line)
    return lines

