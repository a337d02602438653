"""The router simulation behind ``benchmarks/prefill_decode_ratio.py``: queueing cases with known answers
(M/D/1, saturation at the slower side's capacity), least-loaded routing, batched rounds, determinism; and
the script end to end on the committed measurements (few requests)."""

from __future__ import annotations

import json

import pytest

from benchmarks.prefill_decode_ratio import Costs, capacities, main
from benchmarks.router_sim import RoundCurve, SimConfig, simulate


def _cfg(**kw) -> SimConfig:  # type: ignore[no-untyped-def]
    """Prefill 1 s, a decode side that costs (almost) nothing, unless overridden."""
    base = dict(prefill_workers=1, decode_workers=1, prefill_s=1.0, build_s=0.0, handoff_s=0.0, steps=1,
                round_s=lambda n: 1e-6, placement="prefill")  # fmt: skip
    return SimConfig(**{**base, **kw})  # type: ignore[arg-type]


def test_one_prefill_worker_is_an_md1_queue() -> None:
    # M/D/1 with service S = 1 s at rate 0.5: mean time in system S + rho S / (2 (1 - rho)) = 1.5 s.
    out = simulate(_cfg(rate=0.5, requests=40000, warmup=2000, seed=1))
    assert out["latency_mean_s"] == pytest.approx(1.5, rel=0.04)
    assert out["throughput_req_s"] == pytest.approx(0.5, rel=0.03)
    assert out["prefill_util"] == pytest.approx(0.5, rel=0.03)


@pytest.mark.parametrize(("prefill_workers", "decode_workers"), [(2, 1), (1, 3), (3, 2)])
def test_overloaded_throughput_is_the_slower_sides_capacity(
    prefill_workers: int, decode_workers: int
) -> None:
    # Prefill 0.5 s/req per worker; decode: 20 rounds of 0.1 s, at most 4 sessions -> 2 req/s per worker.
    cfg = _cfg(prefill_workers=prefill_workers, decode_workers=decode_workers, prefill_s=0.5, steps=20,
               round_s=lambda n: 0.1, max_active=4, rate=20.0, requests=3000)  # fmt: skip
    expected = min(prefill_workers * 2.0, decode_workers * 2.0)
    assert simulate(cfg)["throughput_req_s"] == pytest.approx(expected, rel=0.03)


def test_saturation_matches_the_analytic_capacity_of_measured_shaped_costs() -> None:
    curve = RoundCurve((1, 4, 16, 64), (0.008, 0.0105, 0.030, 0.108))
    c = Costs(16384, 0.46, 0.1, 0.0035, 32, curve)
    for placement, (p, d) in (("decode", (6, 2)), ("prefill", (7, 1)), ("decode", (7, 1))):
        mu_p, mu_d, _ = capacities(c, placement)
        cfg = SimConfig(p, d, c.prefill_s, c.build_s, c.handoff_s, c.steps, curve, placement, rate=25.0)
        assert simulate(cfg)["throughput_req_s"] == pytest.approx(min(p * mu_p, d * mu_d), rel=0.03), (
            placement
        )


def test_the_router_spreads_a_burst_over_the_least_loaded_workers() -> None:
    one = simulate(_cfg(concurrency=4, requests=4, warmup=0))
    two = simulate(_cfg(prefill_workers=2, concurrency=4, requests=4, warmup=0))
    assert one["latency_p99_s"] == pytest.approx(4.0, rel=1e-6)  # FIFO on one worker: the last waits 3 s
    assert two["latency_p99_s"] == pytest.approx(2.0, rel=1e-6)  # two each on two workers


def test_a_round_advances_every_active_session() -> None:
    # 8 requests reach the decode worker together; 10 rounds of 0.1 s each, all batched: done at ~1 s.
    out = simulate(_cfg(prefill_s=1e-9, steps=10, round_s=lambda n: 0.1, concurrency=8, requests=8, warmup=0))
    assert out["latency_p99_s"] == pytest.approx(1.0, abs=0.11)
    assert out["step_p50_ms"] == pytest.approx(100.0)


def test_a_build_on_the_decode_side_stretches_the_step_it_runs_beside() -> None:
    cfg = dict(prefill_s=0.05, steps=10, round_s=lambda n: 0.01, concurrency=4, requests=400, warmup=40)
    on_decode = simulate(_cfg(build_s=0.1, placement="decode", **cfg))
    on_prefill = simulate(_cfg(build_s=0.1, placement="prefill", **cfg))
    assert on_decode["step_p99_ms"] == pytest.approx(110.0) and on_prefill["step_p99_ms"] == pytest.approx(
        10.0
    )


def test_runs_are_deterministic_per_seed() -> None:
    cfg = dict(prefill_workers=2, decode_workers=2, rate=3.0, requests=500, warmup=50, steps=5,
               round_s=lambda n: 0.02 * n, placement="decode", build_s=0.05)  # fmt: skip
    assert simulate(_cfg(seed=3, **cfg)) == simulate(_cfg(seed=3, **cfg))
    assert simulate(_cfg(seed=3, **cfg)) != simulate(_cfg(seed=4, **cfg))


def test_the_script_reads_the_committed_results_and_writes_its_report(tmp_path) -> None:
    assert main(["--out", str(tmp_path), "--requests", "300"]) == 0
    report = json.loads((tmp_path / "prefill_decode_ratio.json").read_text())
    assert {s["context_tokens"] for s in report["studies"]} == {16384, 32768}
    for s in report["studies"]:
        assert [(r["prefill"], r["decode"]) for r in s["ratios"]] == [(p, 8 - p) for p in range(1, 8)] * 2
    assert all(
        src["file"].startswith("benchmarks/results/") and src["device"] for src in report["sources"].values()
    )
    assert set(report["choice"]) == {"16384", "32768"}
    md = (tmp_path / "prefill_decode_ratio.md").read_text()
    assert "## Choice" in md and "e2e_speedup.json" in md and "decode_rounds.json" in md
    assert (tmp_path / "prefill_decode_ratio.png").stat().st_size > 0
