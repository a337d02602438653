"""Chunk prefill attention and retention-score references against dense masked attention, and their wiring:
``chunk_prefill(kernel="varlen")`` equals the default path, ``build_static(retention="triton")`` equals the
torch probe (under Triton's interpreter: this file doubles as the case script, see the bottom)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # as a script: `tests` importable

from pdllm.kernels.chunk_prefill_attention import (  # noqa: E402
    chunk_prefill_attention,
    chunk_prefill_attention_reference,
)
from pdllm.kernels.retention_scores import retention_scores_reference  # noqa: E402
from pdllm.shared.chunk_prefill import chunk_prefill  # noqa: E402
from pdllm.shared.model.attention import DenseAttention, VarlenAttention  # noqa: E402
from tests.engine.helpers import model, tokens  # noqa: E402
from tests.interpreter import run_under_interpreter  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


def _pack(gen: torch.Generator, lens: list[int], hq: int, hkv: int, d: int) -> tuple[torch.Tensor, ...]:
    total = sum(lens)
    q = torch.randn(total, hq, d, generator=gen)
    k = torch.randn(total, hkv, d, generator=gen)
    v = torch.randn(total, hkv, d, generator=gen)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    return q, k, v, cu


def _dense_probs(q: torch.Tensor, k: torch.Tensor, cu: torch.Tensor, causal: bool) -> torch.Tensor:
    """Softmax over the whole pack with a block-diagonal (optionally causal) mask, float64: [Hq, T, T]."""
    total = q.shape[0]
    seq = torch.repeat_interleave(torch.arange(cu.numel() - 1), (cu[1:] - cu[:-1]).long())
    allowed = seq[:, None] == seq[None, :]
    if causal:
        allowed &= torch.ones(total, total, dtype=torch.bool).tril()
    kk = k.double().repeat_interleave(q.shape[1] // k.shape[1], 1)
    s = torch.einsum("qhd,khd->hqk", q.double(), kk) * q.shape[2] ** -0.5
    return torch.softmax(s.masked_fill(~allowed, float("-inf")), -1)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("hq,hkv", [(4, 4), (8, 2), (7, 1)])
def test_chunk_prefill_matches_dense_block_diagonal(causal: bool, hq: int, hkv: int) -> None:
    gen = torch.Generator().manual_seed(hq * 10 + causal)
    q, k, v, cu = _pack(gen, [5, 17, 1, 9], hq, hkv, 16)
    p = _dense_probs(q, k, cu, causal)
    want = torch.einsum("hqk,khd->qhd", p, v.double().repeat_interleave(hq // hkv, 1))
    ref, lse = chunk_prefill_attention_reference(q, k, v, cu, causal=causal, return_lse=True)
    torch.testing.assert_close(ref.double(), want, rtol=1e-5, atol=1e-5)
    fast = chunk_prefill_attention(q, k, v, cu, causal=causal)
    torch.testing.assert_close(fast.double(), want, rtol=1e-5, atol=1e-5)
    # LSE: exp(s - lse) must reproduce the probabilities of a row.
    kk = k.double().repeat_interleave(hq // hkv, 1)
    s = torch.einsum("hd,khd->hk", q[6].double(), kk[5:22]) * 0.25
    if causal:
        s[:, 2:] = float("-inf")
    torch.testing.assert_close(torch.exp(s - lse[6].double()[:, None]), p[:, 6, 5:22], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("causal", [False, True])
def test_chunk_prefill_equal_lengths_batched_path(causal: bool) -> None:
    gen = torch.Generator().manual_seed(9)
    q, k, v, cu = _pack(gen, [6, 6, 6], 8, 2, 16)
    want = chunk_prefill_attention_reference(q, k, v, cu, causal=causal)
    got = chunk_prefill_attention(q, k, v, cu, causal=causal, max_seqlen=6)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_chunk_prefill_errors() -> None:
    gen = torch.Generator().manual_seed(0)
    q, k, v, cu = _pack(gen, [4], 3, 2, 16)
    with pytest.raises(ValueError, match="multiple of KV heads"):
        chunk_prefill_attention(q, k, v, cu)
    with pytest.raises(ValueError, match="int32"):
        chunk_prefill_attention(q[:, :2], k, v, cu.long())


@pytest.mark.parametrize("causal", [False, True])
def test_retention_reference_matches_dense(causal: bool) -> None:
    gen = torch.Generator().manual_seed(5)
    lens, qlens = [12, 20, 6], [3, 5, 6]
    q, k, _, cu = _pack(gen, lens, 8, 2, 16)
    p = _dense_probs(q, k, cu, causal)
    want = torch.zeros(q.shape[0], dtype=torch.float64)
    for i, lq in enumerate(qlens):
        a, b = int(cu[i]), int(cu[i + 1])
        c = b - a - lq
        for j in range(a, a + c):
            want[j] = p[:, b - lq : b, j].sum() + p[:, j, b - lq : b].sum()
    got = retention_scores_reference(q, k, cu, torch.tensor(qlens, dtype=torch.int32), causal=causal)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-6)
    if causal:
        # Chunk tokens cannot see the query: only the query->chunk direction remains, at most Hq*lq each.
        assert float(got.max()) <= 8 * max(qlens)


def test_retention_errors() -> None:
    gen = torch.Generator().manual_seed(0)
    q, k, _, cu = _pack(gen, [4], 4, 2, 16)
    with pytest.raises(ValueError, match="query tokens"):
        retention_scores_reference(q, k, cu, torch.tensor([5], dtype=torch.int32))
    with pytest.raises(ValueError, match="query_lens"):
        retention_scores_reference(q, k, cu, torch.tensor([1, 1], dtype=torch.int32))


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("lens", [[9, 9, 9], [9, 4, 1, 7]])
def test_varlen_attention_matches_padded_dense(causal: bool, lens: list[int]) -> None:
    gen = torch.Generator().manual_seed(len(lens) + causal)
    b, t = len(lens), max(lens)
    # Token-major memory seen as [B, H, T, D], as the model hands q/k/v over.
    q, k, v = (torch.randn(b, t, h, 16, generator=gen).transpose(1, 2) for h in (8, 2, 2))
    valid = torch.arange(t)[None] < torch.tensor(lens)[:, None]
    dense = DenseAttention(causal=True) if causal else DenseAttention(mask=valid[:, None, None, :])
    want = dense(0, q, k, v)
    got = VarlenAttention(lens, t, causal, q.device)(0, q, k, v)
    assert got.shape == want.shape
    real = valid[:, None, :, None]
    torch.testing.assert_close(got * real, want * real, rtol=1e-5, atol=1e-5)
    assert bool((got * ~real == 0).all())  # padding rows: zeros, never NaN
    with pytest.raises(ValueError, match="lens"):
        VarlenAttention([t + 1], t, causal, q.device)


@pytest.mark.parametrize("attention", ["causal", "bidirectional"])
def test_chunk_prefill_varlen_kernel_equals_default(attention: str) -> None:
    m = model("dream")
    chunks = [[1, *tokens(n, seed)] for seed, n in enumerate([12, 12, 5, 12, 3, 9])]
    for batch in (1, 3, 64):  # 3: groups with and without a padded chunk; 64: one group, three lengths
        want, _ = chunk_prefill(m, chunks, attention, 12, batch)
        got, _ = chunk_prefill(m, chunks, attention, 12, batch, kernel="varlen")
        assert got.lens == want.lens
        for i in range(len(chunks)):
            torch.testing.assert_close(got.segment(i), want.segment(i), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="kernel"):
        chunk_prefill(m, chunks, attention, 12, 2, kernel="flash")  # type: ignore[arg-type]


def test_kernel_retention_probe_under_interpreter() -> None:
    run_under_interpreter(Path(__file__), "retention_build", timeout_s=300)


def test_prefill_kernels_benchmark_smoke(tmp_path: Path) -> None:
    pytest.importorskip("triton", reason="the smoke run needs Triton's interpreter")
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "prefill_kernels.py"), "--smoke", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=300, cwd=ROOT,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    rows = json.loads((tmp_path / "prefill_kernels.json").read_text())["rows"]
    assert {r["kind"] for r in rows} == {"chunk_prefill", "retention", "worker"}
    for r in rows:
        assert r["latency_us"] > 0 and r.get("max_abs_diff", 0.0) < 1e-4, r
        assert r.get("top_b_agree", 1.0) == 1.0, r
    assert "| worker |" in (tmp_path / "prefill_kernels.md").read_text()


def _case_retention_build() -> None:
    """``KernelRetentionProbe`` sums the probe's scores (fp32 Triton vs fp64 torch) and ``build_static`` keeps
    the same tokens with it, for every kv_mode with a build forward and both retention scores."""
    from pdllm.decode_service.build import KernelRetentionProbe, RetentionProbe, build_static
    from pdllm.shared.config import EngineConfig
    from pdllm.shared.layout import decode_layout, make_request

    m = model("dream")
    for kv_mode in ("full-mask", "chunk-query"):
        for score in ("bidirectional", "query-to-chunk"):
            cfg = EngineConfig(chunk_size=24, top_k=3, top_b=7, kv_mode=kv_mode, retention_score=score)
            request = make_request(tokens(100, 1), tokens(6, 2), 1, cfg, 97, tokens(5, 3))
            layout = decode_layout(request, [0, 2, 4], 8)
            ids = list(request.instruction)
            for i in layout.chunk_ids:
                ids += request.chunks[i]
            ids += request.query + ([m.config.mask_token_id] * 8 if kv_mode == "full-mask" else [])
            s, both = layout.static_len, score == "bidirectional"
            masses = [torch.zeros(len(ids), dtype=torch.float64) for _ in range(2)]
            query = slice(s, s + layout.query_len)
            for probe in (
                RetentionProbe(query, both, 16, masses[0]),
                KernelRetentionProbe(query, both, masses[1]),
            ):
                m.hidden_states(torch.tensor([ids]), attention=probe)
            torch.testing.assert_close(masses[1][:s], masses[0][:s], rtol=1e-5, atol=1e-6)
            want = build_static(m, request, layout, cfg)
            got = build_static(m, request, layout, cfg, retention="triton")
            assert got.kept_tokens == want.kept_tokens, (kv_mode, score)
            assert sum(want.kept_tokens) < sum(layout.chunk_lens)  # top-B did drop tokens
            for a, b in zip(got.segments, want.segments, strict=True):
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


if __name__ == "__main__":  # run_under_interpreter: TRITON_INTERPRET=1 python <this file> CASE
    {"retention_build": _case_retention_build}[sys.argv[1]]()
    print("ok")
