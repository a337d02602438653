"""Fixtures for the training tests: the committed tokenizer and a small tokenized haystack."""

from __future__ import annotations

import pytest

from pdllm.shared.eval.tasks import TaskFactory, split_train_eval_sentences
from pdllm.shared.training.corpus import tokenize_haystack
from pdllm.shared.training.tokenizer import load_tokenizer


@pytest.fixture(scope="session")
def tokenizer():
    return load_tokenizer()


@pytest.fixture(scope="session")
def factory(tokenizer) -> TaskFactory:
    train, _ = split_train_eval_sentences()
    # A slice of the training sentences keeps tokenization fast; still ~40K tokens.
    return TaskFactory(tokenizer, tokenize_haystack(tokenizer, train[:2000]))
