"""Reading a study's configuration: a TOML file or a named preset (``presets/NAME.toml``), each resolving
its ``extends`` chain, then the command line's overrides -> a :class:`~lowbit.lab.study.config.StudyConfig`.

The keys, their defaults and their checks are :mod:`lowbit.lab.study.config`'s (its module doc shows a
file); here: the TOML parser (tomllib, or tomli on Python 3.10), the presets, ``extends`` (a preset's
keys under the file's, ``model_args`` / ``dataset_args`` merged per network / data set), unknown keys
refused with the file or preset named.
"""

from __future__ import annotations

import os
import sys
try:
    import tomllib  # novermin — Python 3.11+; tomli is the same parser for 3.10
except ImportError:  # pragma: no cover - exercised by a test that hides tomllib
    import tomli as tomllib
from collections.abc import Mapping
from importlib import resources
from pathlib import Path
from typing import Any

from lowbit.lab.study.config import PRESETS, StudyConfig, _field_names

__all__ = ["load_config", "preset_names"]


def preset_names() -> list[str]:
    return list(PRESETS)


def _read_toml_text(text: str, where: str) -> dict[str, Any]:
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"{where}: not valid TOML: {exc}") from None
    except RecursionError:  # tomllib recurses per level of nested arrays / inline tables
        raise ValueError(f"{where}: not valid TOML: arrays or inline tables nested too deeply to parse "
                         f"(over Python's recursion limit, {sys.getrecursionlimit()})") from None


def _preset_table(name: str, seen: tuple[str, ...] = ()) -> dict[str, Any]:
    if name not in PRESETS:
        raise ValueError(f"unknown study preset {name!r}; presets: {', '.join(PRESETS)}")
    text = resources.files("lowbit.lab.study").joinpath("presets", f"{name}.toml").read_text()
    return _resolve_extends(_read_toml_text(text, f"preset {name}"), f"preset {name}", seen + (name,))


def _resolve_extends(table: dict[str, Any], where: str, seen: tuple[str, ...] = ()) -> dict[str, Any]:
    parent = table.pop("extends", None)
    if parent is None:
        return table
    if not isinstance(parent, str):
        raise ValueError(f"{where}: 'extends' must be a preset name, got {parent!r}")
    if parent in seen:
        raise ValueError(f"{where}: 'extends' makes a cycle through preset {parent!r}")
    base = _preset_table(parent, seen)
    for key in ("model_args", "dataset_args"):  # tables merge per network / data set
        if key in table and isinstance(table[key], dict) and isinstance(base.get(key), dict):
            table[key] = {**base[key], **table[key]}
    return {**base, **table}


def _from_table(table: dict[str, Any], where: str) -> StudyConfig:
    known = set(_field_names())
    for key in table:
        if key not in known:
            raise ValueError(f"{where}: unknown key {key!r} (known keys: {', '.join(_field_names())})")
    return StudyConfig(**table)


def load_config(
    path: str | os.PathLike[str] | None = None,
    preset: str | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> StudyConfig:
    """The study config of a TOML file or a preset (default: the ``default`` preset), then ``overrides``.

    ``overrides`` are config keys (``{"epochs": 1, "codecs": [...]}``, as the command line's flags give
    them); ``None`` values are ignored. Raises ``ValueError`` naming the key for anything wrong.
    """
    if path is not None and preset is not None:
        raise ValueError("give a config file or a preset, not both")
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ValueError(f"study config file {str(p)!r} does not exist")
        table = _resolve_extends(_read_toml_text(p.read_text(), str(p)), str(p))
        where = str(p)
    else:
        name = preset or "default"
        table = _preset_table(name)
        where = f"preset {name}"
    cfg = _from_table(table, where)
    changes = {k: v for k, v in (overrides or {}).items() if v is not None}
    if changes:
        cfg = cfg.replace(**changes)
    return cfg
