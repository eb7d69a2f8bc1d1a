"""Reading a DeepSpeed config file (layer ``config``): JSON, strictly (duplicate keys are an error)."""
from __future__ import annotations

import copy
import json
import os
from typing import Any, Union

from ..errors import ConfigError

__all__ = ["load_ds_config"]


def _no_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict:
    out: dict = {}
    for key, value in pairs:
        if key in out:
            raise ConfigError(f"duplicate key {key!r} in the DeepSpeed config; JSON would silently keep only "
                              f"the last value, so remove one")
        out[key] = value
    return out


def load_ds_config(path_or_dict: Union[str, os.PathLike, dict]) -> dict:
    """Return the DeepSpeed config as a dict: a deep copy of a dict, or the parsed JSON file at a path.

    Raises:
        ConfigError: the file does not exist, is not valid JSON (naming line and column), is not an object,
            or repeats a key (plain ``json`` would keep the last one silently).
    """
    if isinstance(path_or_dict, dict):
        return copy.deepcopy(path_or_dict)
    if not isinstance(path_or_dict, (str, os.PathLike)):
        raise ConfigError(f"DeepSpeed config: {path_or_dict!r} is invalid: pass a dict or the path of a JSON file")
    path = os.fspath(path_or_dict)
    try:
        with open(path, encoding="utf-8") as fh:
            data = json.load(fh, object_pairs_hook=_no_duplicate_keys)
    except FileNotFoundError:
        raise ConfigError(f"DeepSpeed config: file {path!r} does not exist") from None
    except json.JSONDecodeError as err:
        raise ConfigError(f"DeepSpeed config: {path!r} is not valid JSON: {err.msg} at line {err.lineno}, "
                          f"column {err.colno}") from None
    except ConfigError as err:
        raise ConfigError(f"DeepSpeed config {path!r}: {err}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"DeepSpeed config: {path!r} holds a JSON {type(data).__name__}, not an object")
    return data
