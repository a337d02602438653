"""Every subcommand's `--help`: a one-line description, help for every flag, flags in named groups, defaults
shown; a mistyped or abbreviated flag is one line naming it (before argparse's required-flag error)."""

from __future__ import annotations

import argparse
import subprocess
import sys
from collections.abc import Callable

import pytest

from pdllm.shared.app import cli, demo, eval, serve_args
from pdllm.shared.cli_args import unknown_flag
from pdllm.shared.rpc import ask
from pdllm.shared.training import train


def _generate_parser() -> argparse.ArgumentParser:
    sub = next(a for a in cli.build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices["generate"]


PARSERS: dict[str, Callable[[], argparse.ArgumentParser]] = {
    "generate": _generate_parser,
    "serve": serve_args.build_parser,
    "ask": ask.build_parser,
    "demo": demo.build_parser,
    "eval": eval.build_parser,
    "train": train.build_parser,
}
# The flags each subcommand needs to get past argparse (a mistyped flag must be reported before them).
REQUIRED = {"generate": ["--context", "c", "--question", "q"], "ask": ["--context", "c", "--question", "q"]}


def test_every_subcommand_is_covered() -> None:
    assert set(PARSERS) == {"generate", *cli.DELEGATED}


def _flags(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    return [a for a in parser._actions if a.option_strings and a.dest != "help"]


@pytest.mark.parametrize("name", PARSERS)
def test_every_flag_has_help_and_a_group(name: str) -> None:
    parser = PARSERS[name]()
    assert parser.description and parser.description.startswith(f"pdllm {name}: "), parser.description
    flags = _flags(parser)
    assert flags
    missing = [a.option_strings[0] for a in flags if not (a.help or "").strip()]
    assert not missing, f"pdllm {name}: flags without help: {missing}"
    if name != "train":  # five flags: one group is enough
        grouped = {id(a) for g in parser._action_groups[2:] for a in g._group_actions}
        loose = [a.option_strings[0] for a in flags if id(a) not in grouped]
        assert not loose, f"pdllm {name}: flags outside a named group: {loose}"


@pytest.mark.parametrize("name", PARSERS)
def test_help_shows_every_default(name: str) -> None:
    parser = PARSERS[name]()
    formatter = parser._get_formatter()
    for action in _flags(parser):
        if action.default is None or action.nargs == 0:  # the help says what unset means; switches
            continue
        shown = formatter._expand_help(action)
        assert "default" in shown.lower(), f"pdllm {name} {action.option_strings[0]}: {shown!r}"


def test_help_groups_are_printed_and_one_line_descriptions_listed() -> None:
    res = subprocess.run(
        [sys.executable, "-m", "pdllm.shared.app.cli", "serve", "--help"], capture_output=True, text=True
    )
    assert res.returncode == 0, res.stderr
    for group in ("role and model:", "server:", "router:", "prefill:", "decode:", "KV tier:"):
        assert f"\n{group}\n" in res.stdout
    assert "--port PORT" in res.stdout and "default 50051" in res.stdout
    top = subprocess.run(
        [sys.executable, "-m", "pdllm.shared.app.cli", "--help"], capture_output=True, text=True
    )
    for name in PARSERS:
        line = next(x for x in top.stdout.splitlines() if x.strip().startswith(name + " "))
        assert len(line.split(None, 1)[1]) > 20, line  # a description, not just the name


@pytest.mark.parametrize("name", PARSERS)
def test_unknown_flag_is_one_line_naming_it(name: str, capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        PARSERS[name]().parse_args(["--no-such-flag", "1", *REQUIRED.get(name, [])])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "usage:" not in err, err
    assert err.startswith(f"pdllm {name}: error: unknown flag --no-such-flag")


def test_mistyped_flag_is_named_before_the_required_one(tmp_path) -> None:
    """The user's case: `ask --file doc.txt` named neither --file nor what was meant, and printed the usage."""
    doc = tmp_path / "doc.txt"
    doc.write_text("text")
    res = subprocess.run(
        [sys.executable, "-m", "pdllm.shared.app.cli", "ask", "--file", str(doc), "--question", "q?"],
        capture_output=True,
        text=True,
    )
    assert res.returncode == 2
    assert res.stderr == (
        "pdllm ask: error: unknown flag --file (did you mean --context-file or --token-file?); "
        "see pdllm ask --help\n"
    )


def test_abbreviations_are_refused(capsys) -> None:
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["generate", "--context", "c", "--question", "q", "--top", "2"])
    err = capsys.readouterr().err
    assert "unknown flag --top (did you mean --top-b or --top-k or --polestar-top-clusters?)" in err


def test_values_that_look_like_flags_are_values() -> None:
    parser = serve_args.build_parser()
    assert unknown_flag(parser, ["--metrics-port", "-1", "--port=0", "--role", "all"]) is None
    assert parser.parse_args(["--metrics-port", "-1", "--port=0"]).metrics_port == -1
    assert unknown_flag(parser, ["--port=5", "--prot=5"]) == "--prot"
    # The top-level parser leaves a subcommand's flags to the subcommand.
    assert unknown_flag(cli.build_parser(), ["generate", "--top-k", "3"]) is None
