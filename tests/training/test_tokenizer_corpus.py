from __future__ import annotations

import random

import pytest
from transformers import AutoTokenizer

from pdllm.shared.training.corpus import (
    HAYSTACK_PATH,
    read_haystack,
    sentence_texts,
    split_train_eval,
    tokenize_haystack,
)
from pdllm.shared.training.tokenizer import SPECIAL_TOKENS, TOKENIZER_DIR, VOCAB_SIZE


def test_committed_tokenizer_loads_with_specials():
    tok = AutoTokenizer.from_pretrained(str(TOKENIZER_DIR))
    assert len(tok) == VOCAB_SIZE
    assert tok.convert_ids_to_tokens([0, 1, 2, 3]) == SPECIAL_TOKENS
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id, tok.mask_token_id) == (0, 1, 2, 3)


def test_digits_are_single_tokens(tokenizer):
    ids = tokenizer(" is 9081726354.", add_special_tokens=False)["input_ids"]
    pieces = tokenizer.convert_ids_to_tokens(ids)
    assert pieces[-11:-1] == list("9081726354")
    assert tokenizer.decode(ids) == " is 9081726354."


def test_sentence_ids_concatenate_to_text_ids(tokenizer):
    """The splicing pipeline relies on tokens(a + b) == tokens(a) + tokens(b) for sentence pieces."""
    sentences = sentence_texts(read_haystack())
    rng = random.Random(0)
    for _ in range(20):
        i = rng.randrange(len(sentences) - 8)
        chunk = sentences[i : i + 8]
        joined = tokenizer("".join(chunk), add_special_tokens=False)["input_ids"]
        parts = [t for s in chunk for t in tokenizer(s, add_special_tokens=False)["input_ids"]]
        assert joined == parts


def test_haystack_file_and_split(tokenizer):
    assert HAYSTACK_PATH.is_file()
    paragraphs = read_haystack()
    assert len(paragraphs) > 5000
    hay = tokenize_haystack(tokenizer, sentence_texts(paragraphs[:50]))
    train, held = split_train_eval(hay, 0.2)
    assert train.num_sentences + held.num_sentences == hay.num_sentences
    assert train.num_tokens + held.num_tokens == hay.num_tokens
    assert held.offsets[0] == 0 and held.offsets[-1] == held.num_tokens
    first = tokenizer(held.sentences[0], add_special_tokens=False)["input_ids"]
    assert held.ids[: len(first)].tolist() == first


def test_missing_haystack_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="haystack corpus missing"):
        read_haystack(tmp_path / "nope.txt.gz")
