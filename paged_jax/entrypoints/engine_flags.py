"""absl flags for every EngineConfig field, generated from the dataclass itself.

A field added to EngineConfig becomes a flag with no change here: its type picks the
flag kind, its default is the flag's default, and the comment after the field (the
DESIGN rule: a comment per field) is the help text. A field of a type this module does
not know fails loudly at start-up rather than being silently left out.
"""

from __future__ import annotations

import dataclasses
import inspect
import re
import types
import typing

from absl import flags

from paged_jax.config.engine_config import EngineConfig


def _field_comments() -> dict[str, str]:
    source = inspect.getsource(EngineConfig)
    return {m.group(1): m.group(2).strip()
            for m in re.finditer(r"^\s+(\w+):[^#\n]*#\s*(.*)$", source, flags=re.MULTILINE)}


def _base_type(hint):
    """(type, optional) from `int`, `int | None`, `tuple[int, ...] | None`, ..."""
    args = typing.get_args(hint)
    if typing.get_origin(hint) in (typing.Union, types.UnionType) and type(None) in args:
        [inner] = [a for a in args if a is not type(None)]
        return inner, True
    return hint, False


def define_engine_flags(skip: tuple[str, ...] = (), flag_values=flags.FLAGS) -> list[str]:
    """Define one flag per EngineConfig field (except `skip`); returns their names."""
    hints = typing.get_type_hints(EngineConfig)
    comments = _field_comments()
    names = []
    for field in dataclasses.fields(EngineConfig):
        if field.name in skip:
            continue
        kind, _ = _base_type(hints[field.name])
        default = field.default if field.default is not dataclasses.MISSING else None
        help_text = f"EngineConfig.{field.name}: {comments.get(field.name, 'see paged_jax/config/engine_config.py')}"
        if kind is bool:
            flags.DEFINE_bool(field.name, default, help_text, flag_values=flag_values)
        elif kind is int:
            flags.DEFINE_integer(field.name, default, help_text, flag_values=flag_values)
        elif kind is float:
            flags.DEFINE_float(field.name, default, help_text, flag_values=flag_values)
        elif kind is str:
            flags.DEFINE_string(field.name, default, help_text, flag_values=flag_values)
        elif typing.get_origin(kind) is tuple and typing.get_args(kind)[:1] == (int,):
            flags.DEFINE_list(field.name, None if default is None else [str(v) for v in default],
                              help_text + " (comma-separated)", flag_values=flag_values)
        else:
            raise TypeError(f"EngineConfig.{field.name} has type {hints[field.name]!r}, which "
                            "paged_jax/entrypoints/engine_flags.py cannot turn into a flag; add a case there")
        names.append(field.name)
    return names


def engine_config_from_flags(flag_values=flags.FLAGS, **overrides) -> EngineConfig:
    """EngineConfig from the flags defined by define_engine_flags (plus `overrides`).
    Raises ValueError with EngineConfig's message on bad values."""
    hints = typing.get_type_hints(EngineConfig)
    settings = {}
    for field in dataclasses.fields(EngineConfig):
        if field.name in overrides or field.name not in flag_values:
            continue
        value = flag_values[field.name].value
        kind, _ = _base_type(hints[field.name])
        if value is not None and typing.get_origin(kind) is tuple:
            value = tuple(int(v) for v in value)
        settings[field.name] = value
    settings.update(overrides)
    return EngineConfig(**settings)
