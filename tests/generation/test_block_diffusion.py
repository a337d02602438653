"""SDAR block-by-block decoding over the exact cache of finished blocks (tiny random fp32 models, CPU).

The reference is written out here independently of the library's loop: every step runs the FULL
block-causal forward over prompt + answer so far (no cache) and unmasks by the same rule as the sampler.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from pdllm.decode_service.block_diffusion import answer_spans
from pdllm.shared.app.cli import main
from pdllm.shared.decode_policy import DecodePolicyConfig
from pdllm.shared.generation.sampler import DenoiseState, GenerationConfig
from pdllm.shared.model.loader import load_model
from pdllm.shared.model.transformer import DiffusionLM
from pdllm.shared.prompt import encode_prompt
from tests.reference.block_diffusion import generate_block_diffusion
from tests.reference.vanilla import generate_vanilla

from ..model.helpers import tiny_model
from ..model.tiny_checkpoint import make_tiny_checkpoint

PROMPT_9 = [1, 17, 33, 8, 61, 5, 40, 22, 9]  # 9 = two blocks of 4 and one token: a partial last block


def _reference(
    model: DiffusionLM,
    prompt: list[int],
    gen: int,
    steps_per_block: int,
    block: int,
    threshold: float | None = None,
    stop_at_eos: bool = False,
) -> list[int]:
    mask, eos = model.config.mask_token_id, model.config.eos_token_id
    p = len(prompt)
    x = torch.tensor(prompt + [mask] * gen)
    lo = p
    while lo < p + gen:
        hi = min(p + gen, (lo // block + 1) * block)  # generation blocks aligned to absolute position 0
        n = min(steps_per_block, hi - lo)
        counts = [(hi - lo) // n + (1 if i < (hi - lo) % n else 0) for i in range(n)]
        step = 0
        while bool((x[lo:hi] == mask).any()):
            with torch.no_grad():
                logits = model(x[None, :hi])[0]  # the model's own block-causal attention, no cache
            logits[:, mask] = float("-inf")
            conf, pred = torch.softmax(logits, -1).max(-1)
            idx = (x[lo:hi] == mask).nonzero().flatten() + lo
            c = conf[idx]
            if threshold is None:
                k = len(idx) if step == n - 1 else min(counts[step], len(idx))
                chosen = torch.sort(c, descending=True, stable=True).indices[:k]
            else:
                chosen = (c > threshold).nonzero().flatten()
                if chosen.numel() == 0:
                    chosen = c.argmax().view(1)
            x[idx[chosen]] = pred[idx[chosen]]
            step += 1
        if stop_at_eos and bool((x[p:hi] == eos).any()):
            break
        lo = hi
    return x[p:].tolist()


CASES = [
    # (prompt length, gen_length, steps, block_length)
    (9, 16, 16, 4),
    (9, 16, 8, 8),  # generation block = 2 model blocks; 3 spans: 7, 8 and 1 answer tokens
    (8, 16, 8, 8),  # prompt on a block boundary: nothing of it is decoded again
    (3, 12, 6, 4),  # prompt shorter than a block: no prefill cache at all
    (21, 8, 8, 4),
]


@pytest.mark.parametrize(("plen", "gen", "steps", "block"), CASES)
@pytest.mark.parametrize("kv_heads", [2, 1])
def test_cached_blocks_equal_full_forward_reference(
    plen: int, gen: int, steps: int, block: int, kv_heads: int
):
    model = tiny_model("sdar", num_kv_heads=kv_heads, seed=4)
    prompt = torch.randint(3, 90, (plen,), generator=torch.Generator().manual_seed(plen)).tolist()
    cfg = GenerationConfig(gen_length=gen, steps=steps, block_length=block, stop_at_eos=False)
    out = generate_vanilla(model, prompt, cfg)
    expected = _reference(model, prompt, gen, steps // (gen // block), block)
    assert out.raw_tokens == expected
    assert model.config.mask_token_id not in out.raw_tokens
    # Prefilling the prompt in pieces (whole blocks each) changes nothing.
    assert generate_block_diffusion(model, torch.tensor(prompt), cfg, prefill_piece=1).raw_tokens == expected


@pytest.mark.parametrize("block", [4, 8])
def test_threshold_matches_reference(block: int) -> None:
    model = tiny_model("sdar", seed=5)
    cfg = GenerationConfig(gen_length=16, steps=16, block_length=block, threshold=0.05, stop_at_eos=False)
    out = generate_vanilla(model, PROMPT_9, cfg)
    assert out.raw_tokens == _reference(model, PROMPT_9, 16, 16, block, threshold=0.05)
    assert out.steps < 16  # the threshold unmasked several tokens in some step


def test_stops_after_the_block_with_eos() -> None:
    model = tiny_model("sdar", seed=4)
    cfg = GenerationConfig(gen_length=16, steps=16, block_length=4, stop_at_eos=False)
    free = generate_vanilla(model, PROMPT_9, cfg).raw_tokens
    # Make the token produced at answer slot 5 (second block: answer slots 3..6) the EOS.
    model.config = model.config.replace(eos_token_id=free[5])
    first = free.index(free[5])
    out = generate_vanilla(model, PROMPT_9, GenerationConfig(gen_length=16, steps=16, block_length=4))
    expected = _reference(model, PROMPT_9, 16, 4, 4, stop_at_eos=True)
    assert out.raw_tokens == expected
    end = next(hi for lo, hi in answer_spans(9, 16, 4) if lo <= first < hi)
    assert out.raw_tokens[:end] == free[:end] and set(out.raw_tokens[end:]) == {model.config.mask_token_id}
    assert out.token_ids == free[:first] and out.steps == end


@pytest.mark.parametrize(
    ("gen", "block", "match"),
    [
        (12, 6, r"block_length is 6, but this SDAR .* block size 4: .* multiple of 4"),
        (8, 2, r"block_length is 2, .* multiple of 4"),
        (6, None, r"block_length \(unset: gen_length\) is 6"),
    ],
)
def test_generation_block_must_hold_whole_model_blocks(gen: int, block: int | None, match: str) -> None:
    model = tiny_model("sdar")
    with pytest.raises(ValueError, match=match):
        generate_vanilla(model, PROMPT_9, GenerationConfig(gen_length=gen, steps=gen, block_length=block))


def test_decode_policies_are_refused_on_sdar() -> None:
    cfg = GenerationConfig(gen_length=8, steps=8, block_length=4)
    with pytest.raises(ValueError, match="'dual-cache' does not run on SDAR"):
        generate_vanilla(tiny_model("sdar"), PROMPT_9, cfg, policy=DecodePolicyConfig(name="dual-cache"))
    plain = generate_vanilla(tiny_model("sdar"), PROMPT_9, cfg, policy=DecodePolicyConfig(name="none"))
    assert plain.raw_tokens == generate_vanilla(tiny_model("sdar"), PROMPT_9, cfg).raw_tokens


def test_answer_spans_and_state_spans() -> None:
    assert answer_spans(9, 16, 8) == [(0, 7), (7, 15), (15, 16)]
    assert answer_spans(8, 8, 4) == [(0, 4), (4, 8)]
    assert answer_spans(3, 2, 4) == [(0, 1), (1, 2)]
    cfg = GenerationConfig(gen_length=8, steps=8)
    with pytest.raises(ValueError, match="do not tile"):
        DenoiseState(cfg, 96, None, spans=[(0, 3), (4, 8)])
    with pytest.raises(ValueError, match="do not tile"):
        DenoiseState(cfg, 96, None, spans=[(0, 7)])


def test_sampled_generation_is_reproducible() -> None:
    model = tiny_model("sdar", seed=6)
    cfg = GenerationConfig(gen_length=8, steps=8, block_length=4, temperature=0.9, seed=3, stop_at_eos=False)
    a, b = (generate_vanilla(model, PROMPT_9, cfg).raw_tokens for _ in range(2))
    assert a == b and model.config.mask_token_id not in a


CONTEXT = "The archive reopened after a two-year renovation. The access code of Mira Halden is 4821. "
QUESTION = "What is the access code of Mira Halden?"


@pytest.fixture(scope="module")
def sdar_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("ckpt") / "sdar", family="sdar")


def test_cli_generate_vanilla_on_sdar(sdar_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = ["generate", "--model", str(sdar_dir), "--context", CONTEXT, "--question", QUESTION]
    rc = main(
        [*args, "--method", "vanilla", "--gen-length", "8", "--steps", "8", "--block-length", "4", "--json"]
    )
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    out = json.loads(captured.out)
    loaded = load_model(sdar_dir)
    assert loaded.config.family == "sdar"
    prompt = encode_prompt(loaded.tokenizer, CONTEXT, QUESTION).vanilla(loaded.config.bos_token_id)
    expected = generate_vanilla(loaded.model, prompt, GenerationConfig(gen_length=8, steps=8, block_length=4))
    assert out["text"] == loaded.tokenizer.decode(expected.token_ids, skip_special_tokens=True).strip()
    assert out["trace"]["timings"]["prefill_s"] > 0 and out["trace"]["timings"]["decode_s"] > 0

    rc = main([*args, "--method", "vanilla", "--gen-length", "12", "--block-length", "6"])
    assert rc == 2 and "multiple of 4" in capsys.readouterr().err
    # --method pdllm on SDAR runs in process: tests/cli/test_generate_sdar_pdllm.py.
