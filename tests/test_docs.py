"""The README and docs/: a short README that points into docs/, links that resolve, no project-history
vocabulary, the serve flags documented in the groups `serve --help` shows, one section per decode policy."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from pdllm.shared import settings
from pdllm.shared.app.serve_args import build_parser

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
# Words that only mean something to the people who wrote the code: numbered issues, sessions, rounds of
# work, file names tagged with them, and goals nobody outside the project set.
HISTORY = re.compile(r"\bissues? #?\d+|\bsessions? \d+|_s\d+\.(md|json)|\bour targets?\b|\bwaves? \d+", re.I)
CODE_FOLDERS = ("shared", "router", "prefill_service", "decode_service", "kernels", "protos", "benchmarks")


def test_readme_is_short_and_points_into_docs() -> None:
    text = README.read_text()
    assert len(text.splitlines()) <= 150
    assert DOCS, "docs/ holds what the README does not"
    for doc in DOCS:
        assert f"(docs/{doc.name})" in text, f"the README's table of docs misses {doc.name}"


def test_readme_keeps_the_two_commands() -> None:
    text = README.read_text()
    assert "bash .ci/setup.sh --runtime && pdllm demo" in text
    assert "bash .ci/test.sh" in text
    assert "exec bash .ci/test.sh" in (ROOT / ".ci" / "run").read_text()


def test_paper_is_cited_by_title_and_arxiv_id() -> None:
    text = " ".join(README.read_text().split())  # the title may wrap
    assert (
        "Prefilling-dLLM: Predictive Prefilling for Long-Context Inference in Diffusion Language Models"
        in text
    )
    assert re.search(r"arXiv:\d{4}\.\d{5}", text)


@pytest.mark.parametrize("path", [README, *DOCS], ids=lambda p: p.name)
def test_links_resolve_inside_the_repository(path: Path) -> None:
    text = path.read_text()
    for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text):
        if re.match(r"[a-z]+://", target):
            continue
        resolved = (path.parent / target).resolve()
        assert resolved.is_relative_to(ROOT), f"{path.name}: {target} points outside the repository"
        assert resolved.exists(), f"{path.name}: {target} does not exist"
    for cited in re.findall(r"`(benchmarks/results/[^`*]+)`", text):
        assert (ROOT / cited).exists(), f"{path.name}: {cited} does not exist"


def test_no_project_history_vocabulary() -> None:
    texts = [README, *DOCS, ROOT / "deploy" / "README.md"]
    texts += [p for folder in CODE_FOLDERS for p in (ROOT / folder).rglob("*.py")]
    found = []
    for path in texts:
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if HISTORY.search(line):
                found.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert not found, "\n".join(found)


def test_serving_doc_lists_every_serve_flag_in_its_help_group() -> None:
    sections = re.split(r"^### ", (ROOT / "docs" / "serving.md").read_text(), flags=re.M)
    by_title = {s.split("\n", 1)[0].strip(): s for s in sections[1:]}
    parser = build_parser()
    for group in parser._action_groups[2:]:
        assert group.title in by_title, f"docs/serving.md has no section for the group {group.title!r}"
        body = by_title[group.title]
        for action in group._group_actions:
            flag = action.option_strings[0]
            if group.title.startswith("decode policy") and flag != "--decode-policy":
                flag = "--" + flag[2:].split("-")[0]  # the knobs by family: `--sparse-*`, `--polestar-*`, ...
            assert f"`{flag}" in body, f"docs/serving.md, {group.title}: {flag} missing"


def test_decode_policies_doc_has_a_section_per_policy() -> None:
    text = (ROOT / "docs" / "decode-policies.md").read_text()
    sections = dict(re.findall(r"^## (\S+)\n(.*?)(?=^## |\Z)", text, re.M | re.S))
    policies = settings.choices(settings.DecodePolicySettings, "decode_policy")
    assert set(sections) == set(policies)
    for name, body in sections.items():
        for part in ("**What it does.**", "**When to pick it.**", "**Knobs.**", "**Measured cost.**"):
            assert part in body, f"{name}: {part}"
