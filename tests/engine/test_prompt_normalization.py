"""User text is normalized before tokenizing (NFKC, format characters removed): a question whose name carries
zero-width characters gets the same tokens, hence the same answer, as the plain one, on the shipped model.

Planted: ``normalize_text`` returning its input -> both tests fail (with the token check skipped, the shipped
model answers "5571" for the question with zero-width characters, "5571034" without)."""

from __future__ import annotations

import pytest
import torch

from pdllm.shared.app.engine import PrefillingEngine
from pdllm.shared.config import EngineConfig
from pdllm.shared.generation.sampler import GenerationConfig
from pdllm.shared.model.loader import DEFAULT_MODEL_DIR, load_model
from pdllm.shared.prompt import encode_prompt, normalize_text

ZW = "\u200b\u200c\u200d\u2060\ufeff\u00ad"  # zero-width space / non-joiner / joiner, word joiner, BOM, soft hyphen


def test_normalize_text_removes_format_characters_and_folds_compatibility_forms() -> None:
    assert normalize_text("Mi\u200bra Hal\u2060den\ufeff") == "Mira Halden"
    assert normalize_text("ｆｕｌｌ　ｗｉｄｔｈ ① ﬁ") == "full width 1 fi"
    assert normalize_text("e\u0301") == "\u00e9"  # composed
    assert normalize_text("plain text, kept.\n") == "plain text, kept.\n"
    assert all(normalize_text(c) == "" for c in ZW)


@pytest.fixture(scope="module")
def shipped():  # type: ignore[no-untyped-def]
    torch.manual_seed(0)
    return load_model(DEFAULT_MODEL_DIR, dtype="float32", device="cpu")


def test_a_name_with_zero_width_characters_gets_the_same_tokens_and_answer(shipped) -> None:  # type: ignore[no-untyped-def]
    tok = shipped.tokenizer
    name = "Corvin Ashdale"
    hidden = "Cor\u200bvin Ash\u200dda\u2060le"
    context = (
        "The archive lists many people. " * 20
        + f"The access code of {name} is 5571034. "
        + "Other entries follow in the ledger. " * 20
    )
    plain = encode_prompt(tok, context, f"What is the access code of {name}?")
    marked = encode_prompt(tok, context, f"What is the access code of {hidden}?")
    assert marked == plain
    engine = PrefillingEngine(shipped.model, tok, EngineConfig(chunk_size=128, top_k=3), reuse_chunks=False)
    gen = GenerationConfig(gen_length=8, steps=8, block_length=8)
    answers = [
        tok.decode(
            engine.generate(ids.context, ids.query, gen, ids.instruction)[0].token_ids,
            skip_special_tokens=True,
        )
        for ids in (plain, marked)
    ]
    assert answers[0].strip() == answers[1].strip() == "5571034"
