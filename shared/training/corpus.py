"""The haystack: English prose from Python's own documentation, split into sentences.

The text comes from ``pydoc_data.topics`` and the standard library's docstrings, both present on every
Python install. It is extracted once (``python -m pdllm.shared.training.corpus build``) and committed as
``data/haystack.txt.gz`` so that every machine (and every Python version) sees the same sentences; the
training run and the evaluation tasks both read that file.

Sentences are the unit of the haystack: each one starts with a separator (" " inside a paragraph, "\\n"
at a paragraph start), so tokenizing sentences one by one and concatenating the ids gives exactly the
ids of the concatenated text. That is what lets the data pipeline splice pre-tokenized pieces instead of
tokenizing every training example.
"""

from __future__ import annotations

import argparse
import ast
import gzip
import os
import re
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import torch

HAYSTACK_PATH = Path(__file__).resolve().parent / "data" / "haystack.txt.gz"
# Paragraphs are separated by a blank line in the file; sentences by a newline.
_SKIP_DIRS = {
    "test",
    "tests",
    "idlelib",
    "site-packages",
    "lib2to3",
    "turtledemo",
    "__pycache__",
    "ensurepip",
}
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z(\"'])")
_MAX_WORDS = 40


def _paragraphs_from_text(text: str) -> list[str]:
    out = []
    for para in re.split(r"\n\s*\n", text):
        flat = " ".join(para.split())
        flat = flat.encode("ascii", "ignore").decode()
        if len(flat) >= 40 and sum(c.isalpha() for c in flat) > 0.6 * len(flat):
            out.append(flat)
    return out


def _split_sentences(paragraph: str) -> list[str]:
    sentences = []
    for s in _SENTENCE_END.split(paragraph):
        words = s.split()
        # Long code-like runs are cut so that needles can be placed at a fine granularity.
        for i in range(0, len(words), _MAX_WORDS):
            sentences.append(" ".join(words[i : i + _MAX_WORDS]))
    return sentences


def extract_stdlib_text() -> list[list[str]]:
    """Paragraphs (each a list of sentences) from pydoc topics and stdlib docstrings, deduplicated."""
    import pydoc_data.topics as topics

    texts = [topics.topics[k] for k in sorted(topics.topics)]
    root = sysconfig.get_paths()["stdlib"]
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS)
        for name in sorted(filenames):
            if not name.endswith(".py"):
                continue
            try:
                tree = ast.parse(Path(dirpath, name).read_text(encoding="utf-8"))
            except (SyntaxError, UnicodeDecodeError, ValueError):
                continue
            for node in ast.walk(tree):
                if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
                    doc = ast.get_docstring(node)
                    if doc and len(doc) > 80:
                        texts.append(doc)
    seen: set[str] = set()
    paragraphs = []
    for text in texts:
        for para in _paragraphs_from_text(text):
            if para not in seen:
                seen.add(para)
                paragraphs.append(_split_sentences(para))
    return paragraphs


def write_haystack(paragraphs: list[list[str]], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    body = "\n\n".join("\n".join(p) for p in paragraphs) + "\n"
    # mtime=0 keeps the committed file byte-identical when rebuilt from the same text.
    with open(path, "wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", mtime=0) as fh:
        fh.write(body.encode())


def read_haystack(path: Path = HAYSTACK_PATH) -> list[list[str]]:
    if not path.is_file():
        raise FileNotFoundError(
            f"{path}: haystack corpus missing (rebuild with `python -m pdllm.shared.training.corpus build`)"
        )
    with gzip.open(path, "rt") as fh:
        body = fh.read()
    return [p.split("\n") for p in body.strip("\n").split("\n\n") if p]


def sentence_texts(paragraphs: list[list[str]]) -> list[str]:
    """Sentences with their leading separator: "\\n" opens a paragraph, " " continues one."""
    out = []
    for para in paragraphs:
        for i, s in enumerate(para):
            out.append(("\n" if i == 0 else " ") + s)
    return out


@dataclass
class Haystack:
    """Pre-tokenized sentences: ``ids[offsets[i]:offsets[i+1]]`` are sentence i's tokens."""

    sentences: list[str]
    ids: torch.Tensor  # int32 [N]
    offsets: torch.Tensor  # int64 [S + 1]

    @property
    def num_sentences(self) -> int:
        return len(self.sentences)

    @property
    def num_tokens(self) -> int:
        return int(self.ids.numel())

    def lengths(self) -> torch.Tensor:
        return self.offsets[1:] - self.offsets[:-1]

    def subset(self, start: int, stop: int) -> Haystack:
        base = int(self.offsets[start])
        return Haystack(
            sentences=self.sentences[start:stop],
            ids=self.ids[base : int(self.offsets[stop])],
            offsets=self.offsets[start : stop + 1] - base,
        )


def tokenize_haystack(tokenizer, sentences: list[str], batch: int = 4096) -> Haystack:
    ids: list[int] = []
    offsets = [0]
    for i in range(0, len(sentences), batch):
        enc = tokenizer(sentences[i : i + batch], add_special_tokens=False)["input_ids"]
        for seq in enc:
            ids.extend(seq)
            offsets.append(len(ids))
    return Haystack(
        sentences=list(sentences),
        ids=torch.tensor(ids, dtype=torch.int32),
        offsets=torch.tensor(offsets, dtype=torch.int64),
    )


def split_train_eval(haystack: Haystack, eval_fraction: float = 0.1) -> tuple[Haystack, Haystack]:
    """Held-out tail of the corpus for evaluation contexts (the model never trains on those sentences)."""
    cut = int(haystack.num_sentences * (1.0 - eval_fraction))
    return haystack.subset(0, cut), haystack.subset(cut, haystack.num_sentences)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Build the committed haystack corpus from the stdlib")
    parser.add_argument("command", choices=["build", "stats"])
    parser.add_argument("--out", type=Path, default=HAYSTACK_PATH)
    args = parser.parse_args(argv)
    if args.command == "build":
        paragraphs = extract_stdlib_text()
        write_haystack(paragraphs, args.out)
    paragraphs = read_haystack(args.out)
    n_sent = sum(len(p) for p in paragraphs)
    n_chars = sum(len(s) for p in paragraphs for s in p)
    print(f"{args.out}: {len(paragraphs)} paragraphs, {n_sent} sentences, {n_chars} characters")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
