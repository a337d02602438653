"""The training log's two ends: :class:`Meter` keeps each batch mode's loss, cross-entropy and answer accuracy
as running sums on the device between log lines (so logging costs one sync per line, not one per step), and
:func:`plot_curve` draws ``train_log.jsonl``'s per-mode cross-entropy and answer accuracy into
``loss_curve.png`` at the end of a run.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .data import MODES
from .objective import LossOutput


@dataclass
class Meter:
    """Per-mode running sums kept on the device, read (one sync) only when a log line is written."""

    sums: dict[str, list[torch.Tensor]] = field(default_factory=dict)
    counts: dict[str, int] = field(default_factory=dict)

    def add(self, mode: str, res: LossOutput) -> None:
        vals = torch.stack([res.loss.detach(), res.ce, res.answer_correct.float(), res.answer_total.float()])
        self.sums[mode] = self.sums[mode] + vals if mode in self.sums else vals
        self.counts[mode] = self.counts.get(mode, 0) + 1

    def flush(self) -> dict[str, dict[str, float]]:
        out = {}
        for mode, vals in self.sums.items():
            loss, ce, correct, total = vals.tolist()
            n = self.counts[mode]
            out[mode] = {"loss": loss / n, "ce": ce / n, "batches": n}
            if total:
                out[mode]["answer_acc"] = correct / total
        self.sums.clear()
        self.counts.clear()
        return out


def plot_curve(log_path: Path, png_path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = [json.loads(line) for line in log_path.read_text().splitlines() if line.strip()]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    for mode in MODES:
        pts = [(r["step"], r["modes"][mode]) for r in records if mode in r.get("modes", {})]
        if not pts:
            continue
        ax1.plot([s for s, _ in pts], [m["ce"] for _, m in pts], label=mode)
        acc = [(s, m["answer_acc"]) for s, m in pts if "answer_acc" in m]
        if acc:
            ax2.plot([s for s, _ in acc], [a for _, a in acc], label=mode)
    ax1.set(
        xlabel="step", ylabel="cross-entropy (predicted tokens)", yscale="log", title="loss by batch mode"
    )
    ax2.set(xlabel="step", ylabel="answer-token accuracy (masked)", ylim=(0, 1.02), title="answer accuracy")
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(png_path, dpi=110)
    plt.close(fig)
