"""Every command's --help gives every flag a help text and shows its default."""

from __future__ import annotations

import argparse
import importlib

import pytest

from stepserve.cli import COMMANDS

PARSERS = {  # command: module with build_parser()
    **{name: module for name, (module, _) in COMMANDS.items() if name != "export"},
    "export onnx": "stepserve.commands.export_onnx",
    "export triton": "stepserve.commands.export_triton",
    "export tensorrt": "stepserve.commands.export_tensorrt",
}


def parser_of(command: str) -> argparse.ArgumentParser:
    module = importlib.import_module(PARSERS[command])
    if command == "simulate":
        return module.build_parser("stepserve simulate", module.__doc__)
    return module.build_parser()


@pytest.mark.parametrize("command", sorted(PARSERS))
def test_every_flag_has_help_and_shows_its_default(command):
    parser = parser_of(command)
    formatter = parser._get_formatter()
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction) or action.help == argparse.SUPPRESS:
            continue
        flag = "/".join(action.option_strings) or action.dest
        assert action.help, f"{command} {flag}: no help text"
        shown = formatter._expand_help(action)
        if action.default not in (None, False, [], argparse.SUPPRESS):
            assert "default" in shown.lower(), f"{command} {flag}: default {action.default!r} not shown: {shown!r}"
    parser.format_help()  # renders without error (a bad %-format in a help text would raise here)


def test_a_default_is_shown_once_and_as_set():
    from stepserve.commands.serve import build_parser

    text = " ".join(build_parser().format_help().split())
    assert "--port PORT" in text and "(default: 8000)" in text
    assert "(default slo:" in text  # --strategy, in its own words
    assert "(default: None)" not in text and "(default: False)" not in text


def test_bench_says_what_it_will_do_before_loading_the_model():
    from stepserve.commands.bench import config_from_args, start_line

    line = start_line(config_from_args(["--model", "embedded", "--strategies", "slo,none", "--duration", "10",
                                        "--warmup", "5", "--repeats", "3"]))
    assert line == "loading model embedded; 2 contenders x 3 repeats; each run 5 s warm-up + 10 s measured, then a drain"


def test_no_documented_command_needs_a_bare_python():
    """`python` is not on PATH on many machines (only python3): documented commands use `stepserve ...`,
    `.venv/bin/python` (after `make`) or `python3`."""
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    bare = re.compile(r"(^|[`|(]\s*|^\s+)python (-[mc] |\S+\.py)")
    found = [f"{path.name}:{n}: {line.strip()}" for path in [root / "README.md", *sorted((root / "docs").glob("*.md"))]
             for n, line in enumerate(path.read_text().splitlines(), 1) if bare.search(line)]
    assert not found, "\n".join(found)
