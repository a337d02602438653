"""The argument parser every ``pdllm`` command line uses.

- ``--help`` shows each flag's default (unless its help already says what the default is), in the argument
  groups the command declares.
- Flags are never abbreviated (``--top`` is not ``--top-k``), and an unknown flag is named in the error
  before anything else is checked (argparse would first complain about a required flag the mistyped one
  was meant to be), with the flags it may have meant.
- Errors are one line: ``pdllm ask: error: ...; see pdllm ask --help`` (not the whole usage).
"""

from __future__ import annotations

import argparse
import difflib
import re
import sys
from collections.abc import Sequence
from typing import Any, NoReturn

_NUMBER = re.compile(r"^-\d+$|^-\d*\.\d+$")


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Adds ``(default: X)`` to a flag's help unless the help already speaks of its default, the default
    is None (the help says what unset means) or the flag is a switch."""

    def __init__(self, prog: str) -> None:
        super().__init__(prog, max_help_position=32)

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        quiet = (
            "default" in text.lower()
            or action.default is None
            or action.default is argparse.SUPPRESS
            or action.nargs == 0  # store_true / store_false / help
            or not action.option_strings
        )
        if quiet:
            return text
        return f'{text} (default: "")' if action.default == "" else f"{text} (default: %(default)s)"


def known_flags(parser: argparse.ArgumentParser) -> list[str]:
    return sorted(parser._option_string_actions)  # noqa: SLF001 - argparse has no public accessor


def suggestions(flag: str, known: Sequence[str]) -> list[str]:
    """Flags ``flag`` may have meant: those it abbreviates, then those with all its words in them, then
    close spellings (at most three)."""
    words = [w for w in flag.lstrip("-").split("-") if w]
    longer = sorted(k for k in known if k.startswith(flag + "-"))
    with_words = sorted(k for k in known if k.startswith("--") and words and set(words) <= set(k.split("-")))
    close = difflib.get_close_matches(flag, known, n=3, cutoff=0.8)
    return list(dict.fromkeys([*longer, *with_words, *close]))[:3]


def unknown_flag(parser: argparse.ArgumentParser, argv: Sequence[str]) -> str | None:
    """The first token of ``argv`` that looks like a flag ``parser`` does not have (None: none). Scanning
    stops at ``--`` and, in a parser with subcommands, at the subcommand's name (its parser checks the
    rest)."""
    known = set(parser._option_string_actions)  # noqa: SLF001
    commands: set[str] = set()
    for action in parser._actions:  # noqa: SLF001
        if isinstance(action, argparse._SubParsersAction):  # noqa: SLF001
            commands |= set(action.choices)
    for token in argv:
        if token == "--" or (commands and not token.startswith("-")):
            return None  # the subcommand (or a name argparse will call an invalid choice)
        if not token.startswith("-") or token == "-" or _NUMBER.match(token):
            continue
        name = token.split("=", 1)[0] if token.startswith("--") else token[:2]
        if name not in known:
            return name
    return None


class Parser(argparse.ArgumentParser):
    """``argparse.ArgumentParser`` with the behaviour of the module docstring."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)

    def parse_known_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> tuple[argparse.Namespace, list[str]]:
        argv = list(sys.argv[1:] if args is None else args)
        flag = unknown_flag(self, argv)
        if flag is not None:
            near = suggestions(flag, known_flags(self))
            hint = f" (did you mean {' or '.join(near)}?)" if near else ""
            self.error(f"unknown flag {flag}{hint}")
        return super().parse_known_args(argv, namespace)

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}; see {self.prog} --help\n")
