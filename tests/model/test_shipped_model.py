"""The shipped checkpoint answers the fixed CI retrieval set: vanilla and pdllm, exact match.

This is the quality floor every change to the runtime, sampler or engine must keep: the model was
trained to retrieve these needles, so a regression in any of them shows up here as wrong answers.
"""

from __future__ import annotations

import pytest
import torch

from pdllm.shared.app.eval_grid import make_decoder
from pdllm.shared.app.eval_settings import EvalSettings, exact_match, generation
from pdllm.shared.eval.tasks import ci_samples
from pdllm.shared.model.loader import DEFAULT_MODEL_DIR, load_model

TRAIN_LENGTH = 1024


def make_answerer(loaded, method, settings, train_length):
    """A function sample -> decoded answer text for ``method`` on ``loaded`` (under the settings' policy)."""
    decode = make_decoder(loaded, method, settings, train_length)  # settings are checked per sample

    def answer(sample):
        gen = generation(settings, loaded.tokenizer, sample)
        return loaded.tokenizer.decode(decode(sample, gen, settings.decode_policy), skip_special_tokens=True)

    return answer


@pytest.fixture(scope="module")
def shipped():
    torch.manual_seed(0)
    return load_model(DEFAULT_MODEL_DIR, dtype="float32", device="cpu")


@pytest.fixture(scope="module")
def samples(shipped):
    return ci_samples(shipped.tokenizer, n=10, context_tokens=512)


def test_checkpoint_is_small_and_complete(shipped):
    files = {p.name for p in DEFAULT_MODEL_DIR.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "README.md"} <= files
    assert (DEFAULT_MODEL_DIR / "model.safetensors").stat().st_size < 25 * 2**20
    assert sum(p.numel() for p in shipped.model.parameters()) <= 10_000_000
    assert shipped.config.family == "dream"


@pytest.mark.parametrize(
    "method,settings",
    [
        ("vanilla", EvalSettings()),
        # 512 tokens in chunks of 128 -> 4 chunks, 3 kept: the scorer has to find the needle's chunk.
        ("pdllm", EvalSettings(chunk_size=128, top_k=3)),
    ],
)
def test_ci_retrieval_set(shipped, samples, method, settings):
    answer = make_answerer(shipped, method, settings, TRAIN_LENGTH)
    got = [answer(s) for s in samples]
    hits = sum(exact_match(g, s.answer) for g, s in zip(got, samples))
    wrong = [(s.answer, g) for g, s in zip(got, samples) if not exact_match(g, s.answer)]
    assert hits >= 9, f"{method}: {hits}/10 exact, wrong (expected, got): {wrong}"
