"""Engine arguments as command-line flags, shared by `pagoda serve|generate|chat` and `pagoda bench`."""

from __future__ import annotations

import argparse
import dataclasses
import json


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """Every `EngineArgs` field as a --flag (vLLM's spelling), defaults from the dataclass."""
    from pagoda.engine_args import EngineArgs

    defaults = EngineArgs()
    for f in dataclasses.fields(EngineArgs):
        if f.name == "model":
            continue
        flag = "--" + f.name.replace("_", "-")
        default = getattr(defaults, f.name)
        if f.name in (
            "speculative_config",
            "limit_mm_per_prompt",
            "hf_overrides",
            "kv_transfer_config",
        ):  # JSON, as vLLM's
            parser.add_argument(flag, type=json.loads, default=default)
        elif isinstance(default, bool) or f.type == "bool | None":
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=default)
        elif isinstance(default, tuple):  # a list of strings; repeating the flag adds more
            parser.add_argument(flag, nargs="+", action="extend", default=None)
        elif f.type == "str | None":
            parser.add_argument(flag, default=default)
        elif f.type == "float | None":
            parser.add_argument(flag, type=float, default=default)
        elif default is None:  # optional integers
            parser.add_argument(flag, type=int, default=default)
        else:
            parser.add_argument(flag, type=type(default), default=default)


def engine_args_from(ns: argparse.Namespace):
    from pagoda.engine_args import EngineArgs

    kwargs = {}
    for f in dataclasses.fields(EngineArgs):
        value = getattr(ns, f.name, None)
        # A list flag not given is None: the field's own default.
        if hasattr(ns, f.name) and not (value is None and isinstance(f.default, tuple)):
            kwargs[f.name] = value
    return EngineArgs(**kwargs)
