"""The command-line flags and environment variables of the settings in ``settings``.

Every setting of a group is a flag named after it (``top_k`` is ``--top-k``) whose default comes from its
``PDLLM_<FLAG>`` variable (``PDLLM_TOP_K``), else from the schema; precedence is flag, then variable, then
default. ``env_name`` / ``env_value`` are that convention on its own, for flags that are no setting (the
server's ``--port``, ``--tls-cert``); ``flag_label`` names a setting as the command line spells it, so a
:class:`~pdllm.shared.settings.SettingError` says ``--top-k`` (and its variable, where set) rather than
``top_k``. Parsed values are checked with :func:`pdllm.shared.settings.validate`, like any other.
"""

import argparse
import os
from collections.abc import Callable, Iterable, Mapping
from typing import Any, TypeVar

from pdllm.shared.settings import Label, Settings, choices, value_type

T = TypeVar("T")


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def env_name(flag: str) -> str:
    return "PDLLM_" + flag.lstrip("-").replace("-", "_").upper()


def env_value(flag: str, convert: Callable[[str], T], default: T, environ: Mapping[str, str]) -> T:
    """``flag``'s environment variable converted, else ``default``; a bad value names the variable."""
    raw = environ.get(env_name(flag))
    if raw is None or raw == "":
        return default
    try:
        return convert(raw)
    except ValueError:
        raise ValueError(f"${env_name(flag)}={raw!r} is not a valid value for {flag}") from None


def flag_label(environ: Mapping[str, str] | None = None) -> Label:
    """Names a setting as its flag, and its variable too where that is set (the value may come from it)."""
    env = os.environ if environ is None else environ
    return lambda name: flag(name) + (f" (${var})" if env.get(var := env_name(flag(name))) else "")


def add_arguments(
    group: Any,
    cls: type[Settings],
    environ: Mapping[str, str] | None = None,
    *,
    unset: str = "",
    names: Iterable[str] | None = None,
) -> None:
    """A flag per setting of ``cls`` (or of ``names``; dest = the setting's name) whose default is its
    ``PDLLM_<FLAG>`` variable, else the schema's default, or None when ``unset`` says what None means then
    (e.g. "the server's"; ``{default}`` in it: the schema's). Check what was parsed with :func:`validate`."""
    env = os.environ if environ is None else environ
    for name in cls.model_fields if names is None else names:
        field = cls.model_fields[name]
        option, convert = flag(name), value_type(cls, name)
        default = None if unset else field.default
        schema_default = "none" if field.default is None else field.default
        shown = unset.format(default=schema_default) if unset else schema_default
        group.add_argument(
            option,
            type=convert,
            choices=choices(cls, name) or None,
            default=env_value(option, convert, default, env),
            help=f"{field.description} (env {env_name(option)}; default {shown})".replace("%", "%%"),
        )


def from_args(args: argparse.Namespace, cls: type[Settings]) -> dict[str, Any]:
    """The settings of ``cls`` that ``args`` has a value for (None = unset)."""
    return {n: v for n in cls.model_fields if (v := getattr(args, n, None)) is not None}
