"""``benchmarks/decode_engine.py --smoke`` on CPU (tiny models, the shipped one for TPF): every case's rows,
their baselines from the same run, forwards counted per round, TPF up to EOS, the time budget and
``--update``; ``--schedule``: rounds rows, and focus-batched's plain and FOCUS rows, at replayed unmask counts.

Planted and seen failing: a replayed row's tokens counted as one per request and round
(``n * rounds``) -> the replayed-rows test fails on ``tpf`` (1.0 against 4.0); the same in focus-batched
(``batch * rounds``) -> the replayed focus-batched test fails on ``tpf`` (1.0 against 3.2); FOCUS rows
replaying request i + 1's schedule while plain rows replay request i's -> it fails on ``forwards`` (8
against 5); FOCUS and plain schedules fitted to uniform blocks of 8 instead of the request's aligned
spans (7, 8, 1) -> it fails on ``rounds`` (6 against 5)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.decode_engine import CASES, ROW_KEYS, main
from benchmarks.e2e_speedup import QUERY_TOKENS

SCHEDULES = Path(__file__).resolve().parents[1] / "fixtures" / "unmask_schedules.json"
# recorded on a tiny random SDAR checkpoint at block length 4 (its model block); how: the file's header
SDAR_SCHEDULES = SCHEDULES.with_name("unmask_schedules_sdar.json")

LOOP_POLICIES = {"none", "dual-cache", "sparse-dllm", "prefix-cache", "polestar"}


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("decode_engine")
    # a generous budget: on a loaded machine the default (450 s) cuts the last cases
    assert main(["--smoke", "--cases", "all", "--round-check", "--budget-s", "1500", "--out", str(out)]) == 0
    return out, json.loads((out / "decode_engine.json").read_text())


def by_case(data: dict, case: str) -> list[dict]:
    return [r for r in data["rows"] if r["case"] == case]


def test_every_case_writes_rows_with_the_common_columns(report: tuple[Path, dict]) -> None:
    out, data = report
    assert (
        data["device"] == "cpu"
        and data["meta"]["smoke"]
        and data["meta"]["command"].endswith("--out " + str(out))
    )
    assert list(data["cases"]) == [c for c in CASES if c != "serve"]
    for case, info in data["cases"].items():
        assert info["errors"] == [], (case, info["errors"])
        assert by_case(data, case), case
    for r in data["rows"]:
        assert tuple(r)[: len(ROW_KEYS)] == ROW_KEYS
        assert r["batch"] >= 1 and r["round_ms"] > 0 and r["forwards_per_round"] >= 1
    md = (out / "decode_engine.md").read_text()
    assert "CPU SMOKE" in md and all(f"## {case}:" in md for case in data["cases"])


def test_loop_and_rounds_per_policy_with_same_run_baselines(report: tuple[Path, dict]) -> None:
    _, data = report
    loop = by_case(data, "loop")
    cells = {(r["method"], r["context_tokens"], r["gen_length"]) for r in loop}
    assert cells == {("vanilla", 48, 16), ("pdllm", 256, 16), ("vanilla", 256, 16)}
    for method, context, gen in cells:
        rows = {r["policy"]: r for r in loop if (r["method"], r["context_tokens"], r["gen_length"]) == (method, context, gen)}  # fmt: skip
        assert set(rows) == (
            {"none", "dual-cache"} if (method, context) == ("vanilla", 256) else LOOP_POLICIES
        )
        assert rows["dual-cache"]["speedup_vs_dual_cache"] == pytest.approx(1.0)
        vanilla = next(
            r for r in loop if (r["policy"], r["method"], r["context_tokens"]) == ("none", "vanilla", context)
        )
        for r in rows.values():
            assert r["speedup_vs_vanilla"] == pytest.approx(r["tokens_per_s"] / vanilla["tokens_per_s"])
            # one forward per step: pdllm's prefill and build are not the loop's
            assert (r["forwards_per_round"], r["tpf"], r["steps"]) == (1.0, 1.0, 16)
    assert [s["batch"] for s in data["cases"]["loop"]["skipped"]] == [16]
    rounds = by_case(data, "rounds")
    assert {(r["method"], r["batch"], r["policy"]) for r in rounds} == {
        (m, b, p) for m in ("vanilla", "pdllm") for b in (1, 16) for p in LOOP_POLICIES
    }
    # a round of 16 requests runs one packed forward
    assert all(r["forwards_per_round"] == 1.0 and r["forwards"] == r["rounds"] for r in rounds)
    assert all(r["replayed"] is False for r in rounds + by_case(data, "rounds-e2e"))
    # one request's pool pages: none for plain vanilla, fewer for Sparse-dLLM than for the dual cache
    for method in ("vanilla", "pdllm"):
        held = {(r["policy"], r["batch"]): (r["cache_bytes"], r["static_kv_bytes"]) for r in rounds if r["method"] == method}  # fmt: skip
        assert all(held[p, 1] == held[p, 16] for p in LOOP_POLICIES)  # per request, whatever the batch
        (none, static), (dual, _), (sparse, _) = (held[p, 1] for p in ("none", "dual-cache", "sparse-dllm"))
        assert held["prefix-cache", 1][0] == held["polestar", 1][0] == dual
        if method == "vanilla":
            assert none == static == 0 and 0 < sparse < dual
        else:
            assert 0 < static <= none <= sparse <= dual  # whole 64-slot pages: equal at these sizes
    assert data["cases"]["rounds"]["policy_rounds_equal_reference"] == "40/40"
    e2e = data["cases"]["rounds-e2e"]["e2e"]
    assert {(e["context_tokens"], e["pdllm_policy"]) for e in e2e} == {
        (c, p) for c in (128, 256) for p in ("none", "dual-cache")
    }


def test_compute_skip_and_polestar_reuse_the_loop_baselines(report: tuple[Path, dict]) -> None:
    _, data = report
    skip = {r["policy"]: r for r in by_case(data, "compute-skip")}
    assert set(skip) == {"none", "dual-cache", "dyllm"}
    assert not data["cases"]["compute-skip"].get("skipped")
    loop = {(r["policy"], r["context_tokens"]): r for r in by_case(data, "loop")}
    for name in ("none", "dual-cache"):  # the same run, not measured twice
        assert (
            skip[name]["measured_in"] == "loop"
            and skip[name]["tokens_per_s"] == loop[name, 48]["tokens_per_s"]
        )
    assert 0 < skip["dyllm"]["rows_frac"] < 1
    for r in skip.values():
        assert r["speedup_vs_dual_cache"] == pytest.approx(
            r["tokens_per_s"] / skip["dual-cache"]["tokens_per_s"]
        )
    polestar = by_case(data, "polestar")
    assert [r.get("knobs") for r in polestar] == [
        None, None, None, {"polestar_update_threshold": 0}, {"polestar_residual_format": "none"},
        {"polestar_recompute": "per-layer"},
    ]  # fmt: skip
    assert polestar[3]["updates"] > polestar[2]["updates"]  # an update at every cached step
    assert polestar[5]["rows_recomputed"] <= polestar[2]["rows_recomputed"]  # no union over layers
    focus = by_case(data, "focus-batched")
    assert {(r["policy"], r["batch"]) for r in focus} == {
        (p, b) for p in ("plain-rounds", "focus-rounds", "focus-rounds-eager-layers") for b in (1, 3)
    }
    for r in focus:
        assert r["forwards"] == r["rounds"]  # one forward per round (a finished block's record rides along)
        if r["policy"] == "plain-rounds":
            assert r["rows_frac"] is None and r["speedup_vs_plain_rounds"] is None
            continue
        plain = next(p for p in focus if p["policy"] == "plain-rounds" and p["batch"] == r["batch"])
        assert r["speedup_vs_plain_rounds"] == pytest.approx(r["tokens_per_s"] / plain["tokens_per_s"])
        assert 0 < r["rows_frac"] < 1.0  # FOCUS forwards fewer rows past layer 1


def test_tpf_counts_slots_up_to_eos(report: tuple[Path, dict]) -> None:
    _, data = report
    rows = by_case(data, "polestar-tpf")
    assert {(r["task"], r["method"], r["policy"]) for r in rows} == {
        (t, m, p) for t, m in (("needle", "vanilla"), ("needle", "pdllm"), ("long-answer", "vanilla"))
        for p in ("none", "dual-cache", "polestar", "polestar-per-layer")
    }  # fmt: skip
    for r in rows:
        assert r["forwards_counted"] == r["forwards"]  # one model forward per denoising step
        assert 0 < r["tpf"] <= r["block"] and r["tpf"] == pytest.approx(r["tokens"] / r["forwards"])
        frac = r["recomputed_frac"]  # only where a Polestar update ran
        assert frac is None or (r["policy"].startswith("polestar") and 0 <= frac <= 1)


def test_no_budget_skips_with_a_reason_and_update_keeps_other_cases(
    report: tuple[Path, dict], tmp_path: Path
) -> None:
    out, data = report
    (tmp_path / "decode_engine.json").write_text(json.dumps(data))
    argv = ["--smoke", "--cases", "polestar", "--budget-s", "0", "--update", "--out", str(tmp_path)]
    assert main(argv) == 0
    updated = json.loads((tmp_path / "decode_engine.json").read_text())
    assert by_case(updated, "polestar") == []
    assert all(s["reason"].startswith("time budget") for s in updated["cases"]["polestar"]["skipped"])
    others = [r for r in data["rows"] if r["case"] != "polestar"]
    assert [r for r in updated["rows"] if r["case"] != "polestar"] == others
    assert updated["cases"]["loop"] == data["cases"]["loop"]


def test_a_replayed_run_updates_beside_the_one_token_per_step_rows(
    report: tuple[Path, dict], tmp_path: Path
) -> None:
    """``--schedule --update`` adds ``rounds+replayed`` and keeps the unreplayed ``rounds`` rows whole."""
    _, data = report
    (tmp_path / "decode_engine.json").write_text(json.dumps(data))
    argv = ["--smoke", "--cases", "rounds", "--rounds-policies", "none", "--batches", "1", "--update"]
    assert main([*argv, "--schedule", str(SCHEDULES), "--out", str(tmp_path)]) == 0
    updated = json.loads((tmp_path / "decode_engine.json").read_text())
    assert by_case(updated, "rounds") == by_case(data, "rounds")
    assert updated["cases"]["rounds"] == data["cases"]["rounds"]
    replayed = by_case(updated, "rounds+replayed")
    assert {(r["method"], r["policy"], r["replayed"]) for r in replayed} == {
        ("vanilla", "none", True),
        ("pdllm", "none", True),
    }
    assert "## rounds+replayed:" in (tmp_path / "decode_engine.md").read_text()
    argv = ["--smoke", "--cases", "rounds", "--rounds-policies", "dual-cache", "--batches", "1", "--update"]
    assert main([*argv, "--tag", "2k", "--vanilla-context", "64", "--out", str(tmp_path)]) == 0
    tagged = json.loads((tmp_path / "decode_engine.json").read_text())
    assert by_case(tagged, "rounds") == by_case(data, "rounds")
    assert by_case(tagged, "rounds+replayed") == replayed
    assert {
        (r["context_tokens"], r["replayed"]) for r in by_case(tagged, "rounds+2k") if r["method"] == "vanilla"
    } == {(64, False)}
    keys = list(tagged["cases"])
    assert (
        keys.index("rounds")
        < keys.index("rounds+2k")
        < keys.index("rounds+replayed")
        < keys.index("rounds-e2e")
    )


def test_policy_knobs_reach_their_policy_only(report: tuple[Path, dict], tmp_path: Path) -> None:
    """``--policy-knobs sparse_delay_steps=0``: Sparse-dLLM takes its cache at a block's first step, so it
    forwards the dual cache's rows (with the paper's delay of 1 it forwards a second full step per block);
    the dual cache's rows carry no knobs. A value the settings refuse is a recorded error, not a crash."""
    _, data = report
    argv = ["--smoke", "--cases", "rounds", "--rounds-policies", "dual-cache,sparse-dllm", "--batches", "1"]
    assert main([*argv, "--policy-knobs", "sparse_delay_steps=0", "--out", str(tmp_path)]) == 0
    rows = {(r["policy"], r["method"]): r for r in by_case(json.loads((tmp_path / "decode_engine.json").read_text()), "rounds")}  # fmt: skip
    default = {(r["policy"], r["method"]): r for r in by_case(data, "rounds") if r["batch"] == 1}
    for method in ("vanilla", "pdllm"):
        sparse, dual = rows["sparse-dllm", method], rows["dual-cache", method]
        assert sparse["policy_knobs"] == {"sparse_delay_steps": 0} and "policy_knobs" not in dual
        assert sparse["cache"]["rows_forwarded"] == dual["cache"]["rows_forwarded"]
        assert default["sparse-dllm", method]["cache"]["rows_forwarded"] > dual["cache"]["rows_forwarded"]
        assert sparse["cache_bytes"] == default["sparse-dllm", method]["cache_bytes"]  # still keeps r = 0.5
    bad = tmp_path / "bad"
    assert main([*argv, "--policy-knobs", "sparse_delay_steps=-1", "--out", str(bad)]) == 0
    errors = json.loads((bad / "decode_engine.json").read_text())["cases"]["rounds"]["errors"]
    assert errors and all("sparse_delay_steps" in e["error"] for e in errors)
    with pytest.raises(SystemExit):  # a name no policy owns is refused, not dropped
        main([*argv, "--policy-knobs", "sparse_delay=0", "--out", str(bad)])


def test_e2e_against_vanilla_charges_gen_steps_at_the_timed_pace(report: tuple[Path, dict]) -> None:
    """rounds-e2e's vanilla baseline: one token per step without a cache, its step timed and charged gen
    times; pdllm's speedup over it counts pdllm's fixed phases."""
    _, data = report
    rows = by_case(data, "rounds-e2e")
    e2e = data["cases"]["rounds-e2e"]["e2e"]
    assert e2e
    for e in e2e:
        ctx, gen = e["context_tokens"], e["gen_length"]
        plain = next(r for r in rows if (r["method"], r["policy"], r["context_tokens"], r["gen_length"]) == ("vanilla", "none", ctx, gen))  # fmt: skip
        mine = next(r for r in rows if (r["method"], r["policy"], r["context_tokens"], r["gen_length"]) == ("pdllm", e["pdllm_policy"], ctx, gen))  # fmt: skip
        assert plain["tpf"] == 1.0 and plain["cache_bytes"] == 0 and plain["forwards"] == min(16, gen - 2)
        vanilla_s = gen * plain["round_ms"] / 1e3
        pdllm_s = data["cases"]["rounds-e2e"]["pdllm_fixed_phases_s"][str(ctx)] + gen / mine["tokens_per_s"]
        assert e["vanilla_s"] == pytest.approx(vanilla_s)
        assert e["speedup_vs_vanilla"] == pytest.approx(vanilla_s / pdllm_s)
        assert mine["speedup_vs_vanilla"] == pytest.approx(vanilla_s / pdllm_s)


def test_mixed_policies_ride_in_one_forward_per_round(report: tuple[Path, dict]) -> None:
    """16 pdllm requests cycling none, dual-cache, sparse-dllm, polestar and dyllm: one model forward per
    round, as for 16 dual-cache ones."""
    _, data = report
    rows = {r["policy"]: r for r in by_case(data, "mixed")}
    assert set(rows) == {"dual-cache", "none", "mixed", "mixed-eager-layers"}
    assert rows["mixed-eager-layers"]["policies"] == rows["mixed"]["policies"]
    assert set(rows["mixed"]["policies"].split(",")) == {
        "none",
        "dual-cache",
        "sparse-dllm",
        "polestar",
        "dyllm",
    }
    for r in rows.values():
        assert r["batch"] == 16 and r["forwards_per_round"] == 1.0 and r["forwards"] == r["rounds"]
    assert rows["mixed"]["rows_per_round"] > rows["dual-cache"]["rows_per_round"]  # "none" forwards every row


def test_serve_rows_pair_each_policy_with_the_nearest_no_policy_run(tmp_path: Path) -> None:
    """``--cases serve`` reads serving.py files: one ``serve:<policy>`` row each, from its most concurrent
    cell, its throughput against the no-policy file nearest in time."""

    def cell(concurrency: int, rps: float) -> dict:
        return {"layout": "all-in-one", "concurrency": concurrency, "context_tokens": 16384, "requests": 16,
                "failed": 0, "requests_per_s": rps, "step_p50_ms": 40.0, "step_p99_ms": 80.0,
                "unloaded_step_ms": 10.0}  # fmt: skip

    runs = [("none", [], "2026-01-01T10:00:00+00:00", 1.0), ("none", [], "2026-01-01T12:00:00+00:00", 2.0),
            ("dyllm", ["--decode-policy", "dyllm"], "2026-01-01T11:50:00+00:00", 1.5)]  # fmt: skip
    files = []
    for i, (_, flags, date, rps) in enumerate(runs):
        path = tmp_path / f"serving_{i}.json"
        data = {
            "device": "gpu",
            "date": date,
            "rows": [cell(1, 0.5), cell(16, rps)],
            "meta": {"serve_flags": flags},
        }
        path.write_text(json.dumps(data))
        files.append(str(path))
    assert main(["--cases", "serve", "--serving-files", *files, "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "decode_engine.json").read_text())["rows"]
    assert [r["case"] for r in rows] == ["serve:none", "serve:none", "serve:dyllm"]
    dyllm = rows[2]
    assert dyllm["concurrency"] == 16 and dyllm["vs_none"] == 0.75 and dyllm["none_file"] == "serving_1.json"
    assert dyllm["p99_over_unloaded"] == 8.0


def _fitted(steps: list[list[int]], gen: int, block: int) -> list[int]:
    """A recorded schedule as replayed at ``gen`` / ``block``, flat: block b replays recorded block
    b mod (recorded blocks), its counts cycled until they cover the block, the last cut."""
    out = []
    for b in range(gen // block):
        counts, left, i = steps[b % len(steps)], block, 0
        while left:
            out.append(min(counts[i % len(counts)], left))
            left -= out[-1]
            i += 1
    return out


def test_replayed_rounds_unmask_the_recorded_counts(tmp_path: Path) -> None:
    """``--schedule``: request i of a cell replays the file's sample i mod N; tokens and TPF are what those
    schedules unmask in the rounds timed, and each row names the recorded TPF of its samples."""
    argv = [
        "--smoke",
        "--cases",
        "rounds,rounds-e2e",
        "--batches",
        "1,3",
        "--rounds-policies",
        "none,dual-cache",
    ]
    assert main([*argv, "--schedule", str(SCHEDULES), "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "decode_engine.json").read_text())
    samples = json.loads(SCHEDULES.read_text())["samples"]
    assert list(data["cases"]) == ["rounds+replayed", "rounds-e2e+replayed"]  # beside unreplayed rows
    e2e = by_case(data, "rounds-e2e+replayed")
    vanilla = [r for r in e2e if (r["method"], r["policy"]) == ("vanilla", "none")]
    # the vanilla baseline is never replayed: one token per step
    assert vanilla and all(r["replayed"] is False and r["tpf"] == 1.0 for r in vanilla)
    rows = by_case(data, "rounds+replayed") + [
        r for r in by_case(data, "rounds-e2e+replayed") if r not in vanilla
    ]
    assert {(r["case"], r["batch"]) for r in rows} == {
        ("rounds+replayed", 1),
        ("rounds+replayed", 3),
        ("rounds-e2e+replayed", 1),
    }
    for r in rows:
        used = [samples[i % len(samples)] for i in range(r["batch"])]
        flat = [_fitted(s["steps"], r["gen_length"], 8) for s in used]  # smoke: block 8
        tokens = sum(sum(f[: r["rounds"]]) for f in flat)
        assert r["replayed"] is True and r["forwards"] == r["rounds"] <= max(map(len, flat))
        assert r["tpf"] == pytest.approx(tokens / r["batch"] / r["forwards"])
        assert r["recorded_tpf"] == round(
            sum(s["tokens"] for s in used) / sum(s["forwards"] for s in used), 4
        )
        assert r["schedule_samples"] == r["batch"] and r["timed_blocks"] == f"{r['rounds']} rounds"
    assert any(r["tpf"] > 1.5 for r in rows)  # several tokens per forward, as recorded
    for case in ("rounds+replayed", "rounds-e2e+replayed"):
        assert "Replayed schedules: unmask_schedules.json (4 samples" in data["cases"][case]["setup"]
    assert "| yes (" in (tmp_path / "decode_engine.md").read_text()


def _pieces_fitted(steps: list[list[int]], prompt: int, gen: int, unit: int) -> list[int]:
    """A recorded SDAR schedule as a block diffusion request replays it, flat: its answer (at absolute
    positions ``prompt`` onwards) cut at absolute multiples of ``unit``, piece g replaying recorded block
    g mod (recorded blocks), its counts cycled until they cover the piece, the last cut."""
    cuts = [0, *(r for r in range(1, gen) if (prompt + r) % unit == 0), gen]
    out = []
    for g, (a, b) in enumerate(zip(cuts, cuts[1:])):
        counts, left, i = steps[g % len(steps)], b - a, 0
        while left:
            out.append(min(counts[i % len(counts)], left))
            left -= out[-1]
            i += 1
    return out


def test_replayed_focus_batched_runs_plain_and_focus_at_one_schedule(tmp_path: Path) -> None:
    """``--schedule`` on focus-batched: request i replays the file's sample i mod N in the plain and the FOCUS
    runs alike, per recorded 4-token block (the schedule was recorded at block length 4; the smoke cells
    decode in generation blocks of 8); tokens are what those schedules unmask in the rounds run, and
    ``rows_frac`` is still FOCUS's rows past layer 1 over plain's."""
    argv = ["--smoke", "--cases", "focus-batched", "--schedule", str(SDAR_SCHEDULES), "--out", str(tmp_path)]
    assert main(argv) == 0
    data = json.loads((tmp_path / "decode_engine.json").read_text())
    assert data["cases"]["focus-batched+replayed"]["errors"] == []
    samples = json.loads(SDAR_SCHEDULES.read_text())["samples"]
    rows = by_case(data, "focus-batched+replayed")
    assert {(r["policy"], r["batch"]) for r in rows} == {
        (p, b) for p in ("plain-rounds", "focus-rounds", "focus-rounds-eager-layers") for b in (1, 3)
    }
    prompt = 1 + 48 + QUERY_TOKENS  # BOS + the smoke context + the question
    for r in rows:
        used = [samples[i % len(samples)] for i in range(r["batch"])]
        flat = [_pieces_fitted(s["steps"], prompt, r["gen_length"], 4) for s in used]
        tokens = sum(sum(f[: r["rounds"]]) for f in flat)
        assert tokens == r["batch"] * r["gen_length"]  # every slot unmasked, each by its schedule
        # one step per request and round, all admitted at once: the longest schedule's rounds
        assert r["replayed"] is True and r["forwards"] == r["rounds"] == max(map(len, flat))
        assert r["tpf"] == pytest.approx(tokens / r["batch"] / r["forwards"])
        assert r["tokens_per_s"] * r["seconds"] == pytest.approx(tokens)
        assert r["schedule_tpf"] == round(sum(map(sum, flat)) / sum(map(len, flat)), 4)
        assert r["recorded_tpf"] == round(
            sum(s["tokens"] for s in used) / sum(s["forwards"] for s in used), 4
        )
        plain = next(p for p in rows if p["policy"] == "plain-rounds" and p["batch"] == r["batch"])
        assert r["schedule_tpf"] == plain["schedule_tpf"]
        if r is not plain:
            assert 0 < r["rows_frac"] < 1.0
            assert r["speedup_vs_plain_rounds"] == pytest.approx(r["tokens_per_s"] / plain["tokens_per_s"])
    assert any(r["tpf"] > 2 for r in rows)  # several tokens per forward, as recorded
    assert (
        "Replayed schedules: unmask_schedules_sdar.json (4 samples"
        in data["cases"]["focus-batched+replayed"]["setup"]
    )
    assert "| yes (" in (tmp_path / "decode_engine.md").read_text()
