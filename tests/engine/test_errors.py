"""Bad input gives a clear ValueError before any work is done."""

from __future__ import annotations

import pytest

from pdllm.shared.app.engine import PrefillingEngine
from pdllm.shared.config import EngineConfig
from pdllm.shared.generation.sampler import GenerationConfig
from tests.engine.helpers import model, tokens

GEN = GenerationConfig(gen_length=4, steps=2)


@pytest.mark.parametrize(
    ("context", "question", "message"),
    [
        ([5, 6, 7], [], "question is empty"),
        ([], [5, 6], "context is empty"),
        ([5, 200], [5], "vocab size"),
        ([5, -1], [5], "non-negative"),
    ],
)
def test_bad_requests(context: list[int], question: list[int], message: str) -> None:
    engine = PrefillingEngine(model("dream"), None, EngineConfig(chunk_size=4))
    with pytest.raises(ValueError, match=message):
        engine.generate(context, question, GEN)


def test_text_without_tokenizer() -> None:
    engine = PrefillingEngine(model("dream"), None, EngineConfig(chunk_size=4))
    with pytest.raises(ValueError, match="no tokenizer"):
        engine.generate("some context", [5], GEN)


def test_model_without_bos() -> None:
    from tests.model.helpers import tiny_model

    engine = PrefillingEngine(tiny_model("llada", 0, bos_token_id=None), None, EngineConfig(chunk_size=4))
    with pytest.raises(ValueError, match="BOS"):
        engine.generate(tokens(8, 1), [5], GEN)


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("chunk_size", 0, "chunk_size"),
        ("top_k", 0, "top_k"),
        ("top_b", 0, "top_b"),
        ("kv_mode", "full", "kv_mode must be one of"),
        ("score_mode", "nll", "score_mode must be one of"),
        ("prefill_attention", "sliding", "prefill_attention"),
        ("retention_score", "x", "retention_score"),
        ("pseudo_rounds", 5, "pseudo_rounds"),
        ("query_window", -2, "query_window"),
    ],
)
def test_invalid_config(field: str, value: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        EngineConfig(**{field: value})


def test_invalid_decode_attention_and_generation_config() -> None:
    with pytest.raises(ValueError, match="decode_attention"):
        PrefillingEngine(model("dream"), None, decode_attention="flash")
    engine = PrefillingEngine(model("dream"), None, EngineConfig(chunk_size=4))
    with pytest.raises(ValueError, match="gen_length"):
        engine.generate(tokens(8, 1), [5], GenerationConfig(gen_length=0))
