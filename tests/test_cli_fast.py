"""`fedweigh --help`, `--version` and the light commands import neither torch, MONAI nor NVFlare."""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest

import fedweigh.cli as cli

HEAVY = ("torch", "monai", "nvflare", "numpy", "matplotlib")

_PROBE = """
import sys
from fedweigh.cli import main
try:
    main({argv!r})
except SystemExit:
    pass
print("LOADED", sorted(m for m in {heavy!r} if m in sys.modules))
"""


@pytest.mark.parametrize("argv", [["--help"], ["--version"], ["jobs", "--help"], ["site", "check", "--help"]])
def test_help_and_version_load_no_heavy_module(argv):
    out = subprocess.run(
        [sys.executable, "-c", _PROBE.format(argv=argv, heavy=HEAVY)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "LOADED []" in out, out


def _subcommand_helps(parser: argparse.ArgumentParser) -> dict[str, str]:
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return {c.dest: c.help for c in action._choices_actions}


def test_the_light_listing_names_the_heavy_commands_as_their_own_parsers_do():
    light = _subcommand_helps(cli.build_parser(["--help"]))
    full = _subcommand_helps(cli.build_parser())
    assert light == full
    assert set(cli.HEAVY_COMMANDS) <= set(light)


def test_a_heavy_command_named_gets_its_full_parser():
    args = cli.build_parser(["bench", "--out", "x"]).parse_args(["bench", "--out", "x"])
    assert args.out == "x" and args.func.__name__ == "main_bench"
    with pytest.raises(SystemExit):  # the listing-only parser knows no options
        cli.build_parser(["scenarios"]).parse_args(["bench", "--out", "x"])
