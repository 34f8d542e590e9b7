"""One parser for every subcommand (sim.cli), with help on every option."""

from __future__ import annotations

import argparse

from sim.cli import ROUTER_CHOICES, build_parser
from sim.loop.feed import ROUTERS


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    (action,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(action.choices)


def test_every_option_of_every_subcommand_has_help() -> None:
    subs = _subparsers(build_parser())
    assert set(subs) == {"run", "sweep", "plan", "report", "schema", "calibrate", "validate"}
    missing = [f"sim {name} {'/'.join(a.option_strings) or a.dest}"
               for name, sub in subs.items() for a in sub._actions
               if not isinstance(a, argparse._HelpAction) and not a.help]
    assert missing == []


def test_fixed_values_are_choices() -> None:
    subs = _subparsers(build_parser())
    by_dest = {(name, a.dest): a for name, sub in subs.items() for a in sub._actions}
    assert tuple(by_dest[("run", "router")].choices) == ROUTERS == ROUTER_CHOICES
    for cmd in ("calibrate", "validate"):
        assert set(by_dest[(cmd, "dtype")].choices) == {"float32", "bfloat16", "float16"}
        assert set(by_dest[(cmd, "device")].choices) == {"cpu", "cuda"}
