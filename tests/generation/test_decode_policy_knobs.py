"""Each decode-policy knob's default is declared once, in its settings field (``decode_policy_settings.knob``).

The help text shows it, and the runtime configs (``DecodePolicyConfig``'s accessors, ``DyLLMConfig``,
``FocusConfig``, the ``SparseDLLM`` and ``Polestar`` policies) read it from there: a literal default in
one of them, or a dict of defaults beside the field, fails here. The prose that cannot read it (the proto
comments, ``docs/decode-policies.md``) is checked against it.
"""

from __future__ import annotations

import ast
import inspect
import textwrap
from pathlib import Path
from typing import Any

import pytest

from pdllm.decode_service.policies.polestar import Polestar
from pdllm.decode_service.policies.sparse_dllm import SparseDLLM
from pdllm.shared.decode_policy import DecodePolicyConfig, DyLLMConfig, FocusConfig
from pdllm.shared.decode_policy_settings import (
    KNOB_GROUPS,
    PAPER_THRESHOLDS,
    DecodePolicySettings,
    paper_default,
)
from pdllm.shared.settings import choices

ROOT = Path(__file__).resolve().parents[2]
KNOBS = [(policy, name) for policy, names in KNOB_GROUPS.items() for name in names]
# Each runtime config: its class, and the prefix its fields lose from the knobs' names.
RUNTIME = {"sparse-dllm": (SparseDLLM, "sparse_"), "polestar": (Polestar, "polestar_")}
RUNTIME |= {"dyllm": (DyLLMConfig, "dyllm_"), "focus": (FocusConfig, "focus_")}


def _runtime(name: str, value: Any) -> Any:
    return value == "on" if choices(DecodePolicySettings, name) == ("on", "off") else value


def test_every_knob_group_is_a_policy_with_a_runtime_config() -> None:
    assert set(KNOB_GROUPS) == set(RUNTIME) and all(KNOB_GROUPS.values())
    assert DecodePolicyConfig.model_fields.keys() == DecodePolicySettings.model_fields.keys()
    assert issubclass(DecodePolicyConfig, DecodePolicySettings)  # the model itself, not a copy of it


@pytest.mark.parametrize(("policy", "name"), KNOBS)
def test_the_field_declares_the_default_and_its_help_shows_it(policy: str, name: str) -> None:
    field = DecodePolicySettings.model_fields[name]
    assert field.default is None  # unset: the paper's value, told apart from a set one
    assert field.description is not None and field.description.startswith(f"{policy}: ")
    paper = paper_default(name)
    if paper is not None:
        shown = paper if isinstance(paper, str) else f"{paper:g}"
        assert f"none: {shown}" in field.description


@pytest.mark.parametrize(("policy", "name"), KNOBS)
def test_runtime_configs_read_the_default_from_the_field(policy: str, name: str) -> None:
    cls, prefix = RUNTIME[policy]
    want = _runtime(name, paper_default(name))
    assert getattr(cls(), name.removeprefix(prefix)) == want
    config = DecodePolicyConfig(policy)
    held = {
        "sparse-dllm": lambda: dict(zip(KNOB_GROUPS["sparse-dllm"], config.sparse(), strict=True)),
        "polestar": config.polestar_knobs,
        "dyllm": lambda: {f"dyllm_{k}": v for k, v in vars(config.dyllm_config()).items()},
        "focus": lambda: {f"focus_{k}": v for k, v in vars(config.focus_config()).items()},
    }[policy]()
    assert held[name] == want


@pytest.mark.parametrize("policy", sorted(RUNTIME))
def test_runtime_dataclass_defaults_are_no_literals(policy: str) -> None:
    """A field of a runtime config named after a knob takes its default from the knob's field."""
    cls, prefix = RUNTIME[policy]
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    fields = {
        node.target.id: node.value
        for node in tree.body[0].body
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
    }
    for name in KNOB_GROUPS[policy]:
        value = fields[name.removeprefix(prefix)]
        assert isinstance(value, ast.Call) and ast.literal_eval(value.args[0]) == name, (
            f"{cls.__name__}.{name.removeprefix(prefix)} declares its own default: "
            f"{ast.unparse(value) if value is not None else 'none'}"
        )


def test_no_defaults_dict_beside_the_fields() -> None:
    """No code maps a knob's name to its default again (a ``{"sparse_retention": 0.5}`` table)."""
    knobs = {name for _, name in KNOBS}
    found = []
    for folder in ("shared", "decode_service", "prefill_service", "router"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if not isinstance(node, ast.Dict):
                    continue
                for key, value in zip(node.keys, node.values, strict=True):
                    if (
                        isinstance(key, ast.Constant)
                        and key.value in knobs
                        and isinstance(value, ast.Constant)
                        and value.value == paper_default(key.value)
                    ):
                        found.append(f"{path.relative_to(ROOT)}:{node.lineno} {key.value}")
    assert not found, found


def _unset_words(name: str) -> str | None:
    """How the proto comment and the docs state a knob's unset value (None: they state none)."""
    paper = paper_default(name)
    if name == "dyllm_threshold":  # per model family
        return f"{PAPER_THRESHOLDS['dream']:g} Dream, {PAPER_THRESHOLDS['llada']:g} LLaDA"
    if paper is None:
        return None
    return paper if isinstance(paper, str) else f"{paper:g}"


@pytest.mark.parametrize(("policy", "name"), KNOBS)
def test_proto_comment_and_docs_state_the_fields_default(policy: str, name: str) -> None:
    """The prose beside the wire field and the flag cannot read the field; it must agree with it."""
    words = _unset_words(name)
    if words is None:
        return
    proto = (ROOT / "protos/pdllm/v1/generation.proto").read_text()
    line = next(x for x in proto.splitlines() if f" {name} = " in x)
    assert line.rstrip().endswith(f"unset = {words}"), line
    docs = (ROOT / "docs/decode-policies.md").read_text()
    flag = "--" + name.replace("_", "-")
    after = docs.split(f"`{flag}", 1)[1]
    stated = " ".join(after.split("\n\n", 1)[0].split("`--", 1)[0].split())  # lines wrap anywhere
    assert f"default {words}" in stated, (flag, stated)
