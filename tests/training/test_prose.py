"""The prose corpus builder on a small fixture directory: markup stripped, prose kept, deterministic split,
dedupe, manifest contents, byte-identical rebuilds, and the tokenized form the data pipeline reads."""

from __future__ import annotations

import gzip
import hashlib
import json
from pathlib import Path

import pytest

from pdllm.shared.training import prose
from pdllm.shared.training.prose import Source, build, is_held_out, is_prose, read_documents, select

SENTENCE = (
    "The archive keeps every letter that the society received in the years before the war, and each one "
    "is filed by the name of the person who wrote it."
)
SECOND = (
    "Visitors who want to read the letters should ask at the desk in the morning, because the reading room "
    "is closed to the public after four in the afternoon."
)
THIRD = "A copy of the catalogue can be sent by post to anyone who writes to the librarian and asks for it."
HTML = f"""<html><head><title>The archive and its letters</title><script>var x = 1;</script></head>
<body><div class="navheader"><a href="a.html">Prev</a> This navigation line is long enough to look like a
sentence but it sits in the header of the page.</div>
<h1>About the archive of the society and its many letters</h1>
<p>{SENTENCE.replace("letter", "<em>letter</em>", 1)}</p>
<pre>for letter in archive:
    print(letter)  # this code block is not prose and must not be kept in the corpus</pre>
<pre>The preformatted block reads like a sentence of English prose, but it is a listing of the manual.</pre>
<table><tr><td>The table cell holds a sentence that is long enough and would pass as prose otherwise.</td></tr>
</table>
<div class="para">{SECOND}</div>
<ul><li>{THIRD}</li><li>short item</li></ul>
<div class="navfooter">Next page of the documentation, which is about the reading room and its rules.</div>
</body></html>"""
TEXT = f"""{THIRD}

    if (x == 1) {{ return y; }} /* a code paragraph that must go */

{SENTENCE}
"""


@pytest.fixture()
def fixture_dir(tmp_path: Path) -> Path:
    root = tmp_path / "pkgs"
    (root / "a" / "html").mkdir(parents=True)
    (root / "a" / "html" / "letters.html").write_text(HTML)
    for i in range(40):  # many small documents, so that some fall into the held-out split
        words = f"Document number {i} describes the room where the society kept the maps of the coast."
        (root / "a" / "html" / f"room{i:02d}.html").write_text(
            f"<p>{words} {SECOND.replace('desk', f'desk {i}')}</p>"
        )
    (root / "b").mkdir()
    with gzip.open(root / "b" / "notes.txt.gz", "wt") as fh:
        fh.write(TEXT)
    return root


def sources(root: Path) -> list[tuple[Source, str, list[Path]]]:
    a = Source("pkg-a", "PSF-2.0", r"/a/html/.+\.html$")
    b = Source("pkg-b", "GPL-2+", r"/b/.+\.txt\.gz$")
    paths = [str(p) for p in sorted(root.rglob("*")) if p.is_file()]
    return [(a, "1.0", select(a, paths)), (b, "2.0", select(b, paths))]


def test_html_markup_navigation_code_and_tables_are_stripped() -> None:
    """Plant: dropping ``pre`` from the skipped elements keeps the preformatted sentence and fails here."""
    paras = [p for p in prose.html_paragraphs(HTML) if is_prose(prose.clean(p))]
    assert paras == [SENTENCE, SECOND, THIRD]


def test_prose_filter() -> None:
    assert is_prose(SENTENCE)
    assert not is_prose(
        "if (x == 1) { return y; } /* a code paragraph that is long enough to count */ x = y;"
    )
    assert not is_prose("About the archive of the society and its many letters")  # no sentence end
    assert not is_prose(
        "Archiv und Briefe: Die Gesellschaft bewahrt jeden Brief, den sie vor dem Krieg erhielt."
    )


def test_build_writes_split_documents_and_manifest(fixture_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    manifest = build(out, sources(fixture_dir), fixture_dir)
    train = read_documents(out / prose.TRAIN_FILE)
    held = read_documents(out / prose.HELDOUT_FILE)
    everything = [p for d in train + held for p in d]
    text = "\n".join(everything)
    assert "<" not in text and "print(" not in text and "navigation" not in text and "table cell" not in text
    assert "preformatted" not in text
    assert everything.count(SENTENCE) == 1 and everything.count(THIRD) == 1  # deduplicated across packages
    # The text file's only new paragraph was deduplicated away: pkg-b used no file.
    a, b = manifest["packages"]
    assert (a["package"], a["version"], a["licence"], a["files_listed"]) == ("pkg-a", "1.0", "PSF-2.0", 41)
    assert a["files_used"] == 41 and a["paragraphs"] == 3 + 40 and a["bytes"] > 0
    assert (b["package"], b["files_used"], b["paragraphs"], b["bytes"]) == ("pkg-b", 0, 0, 0)
    assert 0 < len(held) < len(train)
    assert a["heldout_paragraphs"] == sum(map(len, held))
    for name in (prose.TRAIN_FILE, prose.HELDOUT_FILE):
        digest = hashlib.sha256((out / name).read_bytes()).hexdigest()
        assert manifest["outputs"][name]["sha256"] == digest
    assert json.loads((out / prose.MANIFEST_FILE).read_text()) == manifest


def test_split_is_stable_per_document(fixture_dir: Path, tmp_path: Path) -> None:
    """The split depends on a document's path alone. Plant: hashing with Python's ``hash`` (salted per
    process) or splitting by position in the file list makes this fail."""
    inputs = sources(fixture_dir)
    first = build(tmp_path / "one", inputs, fixture_dir)
    held = {tuple(d) for d in read_documents(tmp_path / "one" / prose.HELDOUT_FILE)}
    # The same documents without every third one: the remaining ones stay on their side.
    (a, version, files), rest = inputs[0], inputs[1:]
    build(tmp_path / "two", [(a, version, files[::3]), *rest], fixture_dir)
    held2 = {tuple(d) for d in read_documents(tmp_path / "two" / prose.HELDOUT_FILE)}
    kept = {tuple(prose.document_paragraphs(f)) for f in files[::3]}
    assert held2 == held & kept
    keys = [f.relative_to(fixture_dir).as_posix() for f in files]
    assert [is_held_out(k) for k in keys] == [
        int(hashlib.sha256(k.encode()).hexdigest()[:8], 16) % 10000 < 500 for k in keys
    ]
    assert [k for k in keys if is_held_out(k)] == [
        "a/html/room05.html",
        "a/html/room07.html",
        "a/html/room39.html",
    ]
    # Rebuilt from the same inputs: the same bytes (gzip without a time stamp).
    again = build(tmp_path / "three", inputs, fixture_dir)
    assert again["outputs"] == first["outputs"]


def test_tokenized_units_concatenate_to_the_text(fixture_dir: Path, tmp_path: Path, tokenizer) -> None:
    build(tmp_path, sources(fixture_dir), fixture_dir)
    docs = read_documents(tmp_path / prose.TRAIN_FILE)[:5]
    corpus = prose.tokenize_prose(tokenizer, docs)
    assert corpus.num_documents == 5
    whole = "".join("\n\n" + "\n".join(d) for d in docs)
    assert corpus.hay.ids.tolist() == tokenizer(whole, add_special_tokens=False)["input_ids"]
    a, b = corpus.doc_tokens(1)
    assert tokenizer.decode(corpus.hay.ids[a:b]) == "\n\n" + "\n".join(docs[1])


def test_missing_corpus_names_the_build_command(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="prose build"):
        read_documents(tmp_path / "nothing.txt.gz")


def test_package_list_is_one_constant() -> None:
    assert tuple(s.package for s in prose.SOURCES) == prose.APT_PACKAGES
    assert len(set(prose.APT_PACKAGES)) == len(prose.APT_PACKAGES)
    card = (Path(prose.__file__).parent / "PROSE.md").read_text()
    assert " ".join(prose.APT_PACKAGES) in card  # the install line
    manifest = json.loads((Path(prose.__file__).parent / "prose_manifest.json").read_text())
    assert [p["package"] for p in manifest["packages"]] == list(prose.APT_PACKAGES)
    assert all(p["licence"] and p["version"] and p["files_used"] > 0 for p in manifest["packages"])
