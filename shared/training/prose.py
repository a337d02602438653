"""A prose corpus from documentation that Debian packages ship: English paragraphs for the judge models.

``python -m pdllm.shared.training.prose build [--out DIR]`` reads the installed files of the packages in
:data:`SOURCES` (install them first: ``apt-get install -y --no-install-recommends`` + :data:`APT_PACKAGES`;
``PROSE.md`` beside this file gives the line), turns HTML and text into plain paragraphs of English prose
and writes

- ``DIR/prose_train.txt.gz`` and ``DIR/prose_heldout.txt.gz``: one paragraph a line, documents (one
  installed file each) separated by a blank line, gzip with mtime 0 (the same packages give the same bytes);
- ``DIR/manifest.json``: per package its version, licence, files used, bytes, paragraphs and the sha256 of
  its text, and the sha256 of both output files.

What is kept: the text of HTML block elements (paragraphs, list items, definitions) outside navigation,
headers, footers, sidebars, tables, code blocks, scripts and headings; of text files, blank-line separated
paragraphs. A paragraph is kept when it reads as English sentences (:func:`is_prose`: long enough, ends a
sentence, mostly letters, few code characters, enough common English words); the first copy of a paragraph
wins (packages in :data:`SOURCES` order, files in path order). A document is held out when the stable hash
of its installed path (``usr/share/...``) falls under ``HELDOUT_PERCENT`` (:func:`is_held_out`), so adding or removing other
files never moves a document between the splits. The default output directory is ignored by git.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import re
import subprocess
import unicodedata
from dataclasses import dataclass
from html.parser import HTMLParser
from pathlib import Path

import torch

from .corpus import Haystack, tokenize_haystack

PROSE_DIR = Path(__file__).resolve().parent / "data" / "prose"
TRAIN_FILE, HELDOUT_FILE, MANIFEST_FILE = "prose_train.txt.gz", "prose_heldout.txt.gz", "manifest.json"
HELDOUT_PERCENT = 5.0


@dataclass(frozen=True)
class Source:
    package: str  # the Debian package whose installed files are read
    licence: str  # as its /usr/share/doc/<package>/copyright states it for the files used
    include: str  # regex over installed paths
    exclude: str = r"$^"  # regex over installed paths


_SPHINX_SKIP = r"/(_sources|_static|_images|genindex|py-modindex|search|objects)\b"
# Every source allows redistribution and modification (training included); share-alike licences (GPL,
# GFDL, CC-BY-SA) ask that derived works keep their notices: the model cards list them.
SOURCES: tuple[Source, ...] = (
    Source("python3.11-doc", "PSF-2.0", r"^/usr/share/doc/python3\.11/html/.+\.html$", _SPHINX_SKIP),
    Source("debian-reference-en", "GPL-2+", r"^/usr/share/debian-reference/.+\.en\.html$"),
    Source("debian-handbook", "GPL-2+ or CC-BY-SA-3.0", r"/html/en-US/[^/]+\.html$"),
    Source("gnu-standards", "GFDL-1.3+ (no invariant sections)", r"^/usr/share/doc/gnu-standards/.+\.html$"),
    Source(
        "doc-debian",
        "GPL (BTS documents); Open Publication License v1.0 (www.debian.org documents)",
        r"^/usr/share/doc/debian/(constitution\.txt|social-contract\.txt|debian-manifesto|bug-[a-z-]+\.txt"
        r"|mailing-lists\.txt|source-unpack\.txt)(\.gz)?$",
    ),
    Source("debian-policy", "GPL-2+ (FHS: its own permissive notice)", r"\.html$", _SPHINX_SKIP),
    Source("developers-reference", "GPL-2", r"\.html$", _SPHINX_SKIP),
    Source("maint-guide", "GPL-2+ or MIT", r"\.en\.html$"),
    Source("debian-faq", "verbatim and modified copies permitted (Debian FAQ notice)", r"\.en\.html$"),
    Source("sqlite3-doc", "public-domain", r"^/usr/share/doc/sqlite3/.+\.html$"),
    Source("postgresql-doc-15", "PostgreSQL", r"^/usr/share/doc/postgresql-doc-15/html/.+\.html$"),
    Source("git-doc", "GPL-2", r"^/usr/share/doc/git-doc/.+\.html$"),
    Source(
        "python-django-doc", "BSD-3-Clause", r"^/usr/share/doc/python-django-doc/html/.+\.html$", _SPHINX_SKIP
    ),
    Source("gimp-help-en", "GFDL-1.2+ (no invariant sections)", r"^/usr/share/gimp/2\.0/help/en/.+\.html$"),
    Source("debian-history", "GPL-2", r"^/usr/share/doc/debian-history/docs/.+\.en\.html$"),
)
APT_PACKAGES: tuple[str, ...] = tuple(s.package for s in SOURCES)

# Elements whose text is never prose, and class names of navigation and page furniture.
_SKIP_TAGS = {"script", "style", "pre", "table", "nav", "head", "title", "h1", "h2", "h3", "h4", "h5"}
_SKIP_TAGS |= {"h6", "header", "footer", "aside", "form", "button", "select", "svg", "math", "textarea"}
_SKIP_CLASS = re.compile(
    r"sphinxsidebar|related|footer|navheader|navfooter|header|toc|breadcrumb|highlight|synopsis|"
    r"programlisting|screen|literallayout|headerlink|menu|sidebar|copyright|legalnotice|example",
    re.I,
)
_BLOCK_TAGS = {
    "p",
    "div",
    "li",
    "dd",
    "dt",
    "blockquote",
    "section",
    "ul",
    "ol",
    "dl",
    "br",
    "hr",
    "tr",
    "td",
}
_BLOCK_TAGS |= {"article", "main", "body", "figure", "figcaption", "center"}
_VOID = {"br", "hr", "img", "meta", "link", "input", "col", "area", "base", "wbr", "source"}
_STOPWORD_TEXT = (
    "the of and to a in is that it for as be by this with are on or not an from can which if you at "
    "will its has have was they their when but all there one may any these only other more also than "
    "into each such so been should must would what who how does do"
)
_STOPWORDS = frozenset(_STOPWORD_TEXT.split(" "))
_CODE_CHARS = set("{}[]<>=;_$#|\\/*`^~@")


class _ParagraphParser(HTMLParser):
    """Collects the text of block elements outside skipped ones, one string per block."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.paragraphs: list[str] = []
        self._buf: list[str] = []
        self._skip: tuple[str, int] | None = None  # (tag, nesting depth) of the skipped element

    def _flush(self) -> None:
        text = " ".join("".join(self._buf).split())
        if text:
            self.paragraphs.append(text)
        self._buf = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if self._skip is not None:
            if tag == self._skip[0] and tag not in _VOID:
                self._skip = (tag, self._skip[1] + 1)
            return
        cls = " ".join(v or "" for k, v in attrs if k in ("class", "role", "id"))
        if tag in _SKIP_TAGS or (tag not in _VOID and cls and _SKIP_CLASS.search(cls)):
            if tag in _BLOCK_TAGS or tag in _SKIP_TAGS:
                self._flush()
            if tag not in _VOID:
                self._skip = (tag, 1)
        elif tag in _BLOCK_TAGS:
            self._flush()

    def handle_endtag(self, tag: str) -> None:
        if self._skip is not None:
            if tag == self._skip[0]:
                depth = self._skip[1] - 1
                self._skip = None if depth == 0 else (tag, depth)
            return
        if tag in _BLOCK_TAGS:
            self._flush()

    def handle_data(self, data: str) -> None:
        if self._skip is None:
            self._buf.append(data)

    def close(self) -> None:
        super().close()
        self._flush()


def html_paragraphs(html: str) -> list[str]:
    parser = _ParagraphParser()
    parser.feed(html)
    parser.close()
    return parser.paragraphs


def text_paragraphs(text: str) -> list[str]:
    """Blank-line separated paragraphs of a text file, whitespace collapsed."""
    return [" ".join(p.split()) for p in re.split(r"\n\s*\n", text) if p.strip()]


def clean(paragraph: str) -> str:
    text = unicodedata.normalize("NFKC", paragraph).replace("\u00b6", "")
    return " ".join("".join(c for c in text if unicodedata.category(c) != "Cf").split())


def is_prose(paragraph: str) -> bool:
    """English sentences, not code, a table row, a heading or a list of names."""
    words = paragraph.split()
    if len(paragraph) < 60 or len(words) < 10 or paragraph[-1] not in ".!?:)\"'":
        return False
    if not re.search(r"[a-z]{2,}[,;]? [a-z]{2,} [a-z]{2,}", paragraph):  # a run of lower-case words
        return False
    letters = sum(c.isalpha() for c in paragraph)
    visible = sum(not c.isspace() for c in paragraph)
    if letters < 0.75 * visible or sum(c in _CODE_CHARS for c in paragraph) > 0.02 * len(paragraph):
        return False
    if sum(not c.isascii() for c in paragraph) > 0.02 * len(paragraph):
        return False
    common = sum(w.lower().strip(".,;:()\"'") in _STOPWORDS for w in words)
    return common >= 0.2 * len(words)


def read_file(path: Path) -> str:
    data = path.read_bytes()
    if path.suffix == ".gz":
        data = gzip.decompress(data)
    return data.decode("utf-8", errors="replace")


def document_paragraphs(path: Path) -> list[str]:
    text = read_file(path)
    is_html = ".htm" in path.name
    raw = html_paragraphs(text) if is_html else text_paragraphs(text)
    return [c for p in raw if is_prose(c := clean(p))]


def is_held_out(doc: str, percent: float = HELDOUT_PERCENT) -> bool:
    """Stable in the document's path alone (sha256), independent of every other document."""
    return int(hashlib.sha256(doc.encode()).hexdigest()[:8], 16) % 10000 < percent * 100


def installed_files(source: Source) -> tuple[str, list[Path]]:
    """(version, regular files matching the source) of an installed package; dpkg lists them."""
    version = subprocess.run(
        ["dpkg-query", "-W", "-f", "${Version}", source.package], capture_output=True, text=True, check=True
    ).stdout.strip()
    listed = subprocess.run(["dpkg", "-L", source.package], capture_output=True, text=True, check=True)
    return version, select(source, listed.stdout.splitlines())


def select(source: Source, paths: list[str]) -> list[Path]:
    inc, exc = re.compile(source.include), re.compile(source.exclude)
    out = [Path(p) for p in paths if inc.search(p) and not exc.search(p)]
    return sorted(p for p in out if p.is_file() and not p.is_symlink())


def _write_gz(path: Path, docs: list[list[str]]) -> str:
    body = ("\n\n".join("\n".join(d) for d in docs) + "\n").encode() if docs else b""
    with open(path, "wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", mtime=0) as fh:
        fh.write(body)
    return hashlib.sha256(path.read_bytes()).hexdigest()


def build(out: Path, inputs: list[tuple[Source, str, list[Path]]], root: Path = Path("/")) -> dict:
    """Extract, dedupe, split and write; ``inputs``: (source, version, files) in order; a document's key
    (split hash, files list) is its path relative to ``root``. Returns the manifest."""
    out.mkdir(parents=True, exist_ok=True)
    seen: set[str] = set()
    splits: dict[str, list[list[str]]] = {"train": [], "heldout": []}
    packages = []
    for source, version, files in inputs:
        used, pieces = [], []
        counts = {"train": 0, "heldout": 0}
        for path in files:
            doc = []
            for para in document_paragraphs(path):
                if para not in seen:
                    seen.add(para)
                    doc.append(para)
            if doc:
                key = path.relative_to(root).as_posix()
                split = "heldout" if is_held_out(key) else "train"
                splits[split].append(doc)
                counts[split] += len(doc)
                used.append(key)
                pieces.append("\n".join(doc))
        text = "\n\n".join(pieces).encode()
        packages.append(
            {
                "package": source.package,
                "version": version,
                "licence": source.licence,
                "include": source.include,
                "files_listed": len(files),
                "files_used": len(used),
                "files_used_sha256": hashlib.sha256("\n".join(used).encode()).hexdigest(),
                "bytes": len(text),
                "paragraphs": counts["train"] + counts["heldout"],
                "heldout_paragraphs": counts["heldout"],
                "sha256": hashlib.sha256(text).hexdigest(),
            }
        )
    outputs = {}
    for split, name in (("train", TRAIN_FILE), ("heldout", HELDOUT_FILE)):
        docs = splits[split]
        outputs[name] = {
            "documents": len(docs),
            "paragraphs": sum(map(len, docs)),
            "bytes": sum(len("\n".join(d).encode()) for d in docs),
            "sha256": _write_gz(out / name, docs),
        }
    manifest = {"heldout_percent": HELDOUT_PERCENT, "packages": packages, "outputs": outputs}
    (out / MANIFEST_FILE).write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest


def read_documents(path: Path) -> list[list[str]]:
    """Documents (lists of paragraphs) of a ``prose_*.txt.gz`` file."""
    if not path.is_file():
        raise FileNotFoundError(
            f"{path}: prose corpus missing (build it with `python -m pdllm.shared.training.prose build`; "
            "shared/training/PROSE.md lists the packages to install first)"
        )
    with gzip.open(path, "rt", encoding="utf-8") as fh:
        body = fh.read().strip("\n")
    return [d.split("\n") for d in body.split("\n\n") if d]


@dataclass
class ProseCorpus:
    """Tokenized documents: ``hay`` holds one unit per paragraph (a document's first led by a blank line,
    the others by a newline, so the units' ids concatenate to the ids of the whole text); document ``d`` is
    units ``doc_units[d]`` to ``doc_units[d + 1]``."""

    hay: Haystack
    doc_units: torch.Tensor  # int64 [D + 1]

    @property
    def num_documents(self) -> int:
        return self.doc_units.numel() - 1

    def doc_tokens(self, d: int) -> tuple[int, int]:
        """[start, end) of document ``d`` in ``hay.ids``."""
        return int(self.hay.offsets[self.doc_units[d]]), int(self.hay.offsets[self.doc_units[d + 1]])


def tokenize_prose(tokenizer, docs: list[list[str]]) -> ProseCorpus:
    units, starts = [], [0]
    for doc in docs:
        units += [("\n\n" if i == 0 else "\n") + p for i, p in enumerate(doc)]
        starts.append(len(units))
    return ProseCorpus(tokenize_haystack(tokenizer, units), torch.tensor(starts, dtype=torch.int64))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Build the prose corpus from installed Debian documentation")
    parser.add_argument("command", choices=["build", "packages"])
    parser.add_argument("--out", type=Path, default=PROSE_DIR, help="output directory")
    args = parser.parse_args(argv)
    if args.command == "packages":
        print(" ".join(APT_PACKAGES))
        return 0
    inputs = []
    for source in SOURCES:
        try:
            version, files = installed_files(source)
        except (OSError, subprocess.CalledProcessError) as exc:
            raise SystemExit(
                f"{source.package} is not installed ({exc}); install: apt-get install -y "
                f"--no-install-recommends {' '.join(APT_PACKAGES)}"
            ) from exc
        inputs.append((source, version, files))
    manifest = build(args.out, inputs)
    for p in manifest["packages"]:
        print(
            f"{p['package']:22} {p['files_used']:5} files {p['paragraphs']:7} paragraphs {p['bytes']:10} bytes"
        )
    for name, o in manifest["outputs"].items():
        print(
            f"{args.out / name}: {o['documents']} documents, {o['paragraphs']} paragraphs, {o['bytes']} bytes"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
