"""`serve` workers with PDLLM_CHUNK_BOUNDARY=sentence: prefill lays out sentence chunks, decode builds over
the same chunks (it takes their token ids from prefill), and the answer equals the in-process engine's."""

from __future__ import annotations

import pytest

from pdllm.shared.app.engine import PrefillingEngine
from pdllm.shared.app.serve import build_parser, start
from pdllm.shared.config import EngineConfig
from pdllm.shared.generation.sampler import GenerationConfig
from pdllm.shared.model.loader import load_model
from pdllm.shared.prompt import encode_prompt
from pdllm.shared.rpc.client import PdllmClient

from ..model.tiny_checkpoint import make_tiny_checkpoint
from .test_all_in_one import CONTEXT, QUESTION


def test_env_sets_the_worker_chunk_boundary(monkeypatch) -> None:
    assert build_parser().parse_args([]).chunk_boundary is None  # the checkpoint's pdllm.json, else fixed
    monkeypatch.setenv("PDLLM_CHUNK_BOUNDARY", "sentence")
    assert build_parser().parse_args([]).chunk_boundary == "sentence"


def test_sentence_chunks_served_equal_engine(tmp_path, monkeypatch) -> None:
    tiny_dir = make_tiny_checkpoint(tmp_path / "tiny")
    monkeypatch.setenv("PDLLM_CHUNK_BOUNDARY", "sentence")
    args = build_parser().parse_args(
        ["--role", "all", "--model", str(tiny_dir), "--port", "0", "--metrics-port", "-1"]
    )
    deployment = start(args)
    try:
        with PdllmClient(deployment.address) as client:
            response = client.generate(
                context=CONTEXT, question=QUESTION, gen_length=8, steps=8, chunk_size=32, top_k=2
            )
    finally:
        deployment.stop()
    loaded = load_model(tiny_dir)
    ids = encode_prompt(loaded.tokenizer, CONTEXT, QUESTION)
    cfg = EngineConfig(chunk_size=32, top_k=2, chunk_boundary="sentence")
    engine = PrefillingEngine(loaded.model, loaded.tokenizer, cfg)
    sel = engine.prefill(ids.context, ids.query, GenerationConfig(gen_length=8, steps=8))
    expected = engine.decode(sel, GenerationConfig(gen_length=8, steps=8)).token_ids
    assert list(response.token_ids) == expected
    sizes = [s.num_tokens for s in response.trace.chunk_scores]
    assert sizes == [len(c) for c in sel.request.chunks]
    assert max(sizes) <= 33 and any(n < 33 for n in sizes[:-1])  # sentence cuts, not every 32 tokens


def test_bad_env_value_fails_at_startup(tmp_path, monkeypatch) -> None:
    tiny_dir = make_tiny_checkpoint(tmp_path / "tiny")
    monkeypatch.setenv("PDLLM_CHUNK_BOUNDARY", "paragraph")
    args = build_parser().parse_args(["--role", "prefill", "--model", str(tiny_dir), "--port", "0"])
    # Checked before the model loads, named as the operator wrote it (the flag and the variable it came from).
    expected = (
        r"--chunk-boundary \(\$PDLLM_CHUNK_BOUNDARY\) must be one of fixed, sentence \(got 'paragraph'\)"
    )
    with pytest.raises(ValueError, match=expected):
        start(args)


def test_chunk_boundary_flag_is_the_schemas() -> None:
    """serve's engine flags are derived from the settings schema, like generate's: same flag, choices, help."""
    from pdllm.shared import settings

    action = next(a for a in build_parser()._actions if a.dest == "chunk_boundary")
    assert action.option_strings == ["--chunk-boundary"]
    assert tuple(action.choices) == settings.choices(settings.EngineOnlySettings, "chunk_boundary")
    description = settings.EngineOnlySettings.model_fields["chunk_boundary"].description
    assert description in action.help and "PDLLM_CHUNK_BOUNDARY" in action.help
