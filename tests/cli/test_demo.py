"""The README's run command, `pdllm demo`, end to end (all-in-one deployment, bundled 12K-token document)."""

from __future__ import annotations

import json
import re
import subprocess
import sys

from pdllm.shared.app.demo import DATA


def test_demo_answers_bundled_question_with_trace() -> None:
    res = subprocess.run(
        [sys.executable, "-m", "pdllm.shared.app.cli", "demo", "--gen-length", "8"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    out = res.stdout
    bundled = json.loads((DATA / "demo_question.json").read_text())
    assert f"question: {bundled['question']}" in out
    assert re.search(r"^answer: '.*'$", out, re.M)
    assert re.search(r"^planted fact: .* -> (correct|wrong)$", out, re.M)
    prompt_tokens = int(re.search(r"prompt tokens: (\d+)", out).group(1))
    assert prompt_tokens >= 12000  # the document is a real long context
    selected = re.search(r"selected chunks: \[([\d, ]+)\]", out).group(1).split(",")
    assert len(selected) == 3  # --top-k default
    assert "Traceback" not in res.stderr
