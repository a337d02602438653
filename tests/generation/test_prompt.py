"""Prompt encoding: user text stays text, whatever special-token spellings it contains."""

from __future__ import annotations

import pytest

from pdllm.shared.model.loader import load_tokenizer, resolve_model_dir
from pdllm.shared.prompt import encode_prompt


@pytest.fixture(scope="module")
def tokenizer():  # type: ignore[no-untyped-def]
    return load_tokenizer(resolve_model_dir(None))  # the shipped model's tokenizer


def test_special_token_spellings_in_user_text_are_not_control_tokens(tokenizer) -> None:  # type: ignore[no-untyped-def]
    specials = set(tokenizer.convert_tokens_to_ids(tokenizer.all_special_tokens))
    text = " ".join(tokenizer.all_special_tokens) + " [MASK][MASK]"
    ids = encode_prompt(
        tokenizer, context=f"The code is 42. {text}", question=f"{text} code?", instruction=text
    )
    for part in (ids.instruction, ids.context, ids.query):
        assert part and not specials & set(part)
    assert tokenizer.decode(ids.query) == f"\nQuestion: {text} code?\nAnswer:"


def test_plain_text_encodes_as_before(tokenizer) -> None:  # type: ignore[no-untyped-def]
    ids = encode_prompt(tokenizer, context="The code is 42.", question="What is the code?")
    assert ids.context == list(tokenizer.encode("The code is 42.", add_special_tokens=False))
