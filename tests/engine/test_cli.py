"""The command line's shape: every flag that takes a list can be repeated, adding to
it (a plain nargs="+" keeps only the last: `--backend A --backend B` lost A)."""

from __future__ import annotations

import argparse

from pagoda.entrypoints.arg_utils import engine_args_from
from pagoda.entrypoints.cli import build_parser


def _subparsers(parser: argparse.ArgumentParser):
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            yield from action.choices.items()


def test_every_list_flag_repeats():
    lists = []
    for name, sub in _subparsers(build_parser()):
        for action in sub._actions:
            if action.option_strings and action.nargs in ("+", "*"):
                lists.append(f"{name} {action.option_strings[0]}")
                assert isinstance(action, argparse._ExtendAction), lists[-1]
    assert "router --backend" in lists and "serve --served-model-name" in lists


def test_repeated_list_flags_add_up():
    ns = build_parser().parse_args(
        ["serve", "--served-model-name", "a", "--served-model-name", "b", "c",
         "--keep-full-precision", "lm_head", "--keep-full-precision", "embed"]
    )  # fmt: skip
    assert ns.served_model_name == ["a", "b", "c"]
    assert engine_args_from(ns).keep_full_precision == ["lm_head", "embed"]
    # Not given: the engine's default.
    assert engine_args_from(build_parser().parse_args(["serve"])).keep_full_precision == ()
    ns = build_parser().parse_args(["router", "--backend", "http://a", "--backend", "http://b"])
    assert ns.backend == ["http://a", "http://b"]
