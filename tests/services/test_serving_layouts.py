"""``benchmarks/serving.py``'s layouts beyond two GPUs: the ``NpMd`` / ``replicasN`` names, the GPU each worker
is pinned to, the router simulator's prediction per row, and a ``2p1d`` smoke run with real serve processes
(every process on the CPU, ``--share-gpu``)."""

from __future__ import annotations

import json

import pytest

from benchmarks.serving import (
    LAYOUT_GPUS,
    Layout,
    assign_gpus,
    main,
    parse_layout,
    recommended_splits,
    simulated_req_s,
    simulator_costs,
    visible_devices,
)
from benchmarks.serving_report import targets_x4


@pytest.mark.parametrize(
    ("name", "layout", "gpus"),
    [
        ("all-in-one", Layout("all-in-one"), 1),
        ("replicas", Layout("replicas", 2, 2, "decode", True), 2),
        ("replicas4", Layout("replicas4", 4, 4, "decode", True), 4),
        ("1p1d-build-on-decode", Layout("1p1d-build-on-decode", 1, 1, "decode"), 2),
        ("1p1d-build-on-prefill", Layout("1p1d-build-on-prefill", 1, 1, "prefill"), 2),
        ("1p1d-auto", Layout("1p1d-auto", 1, 1, "auto"), 2),
        ("3p1d", Layout("3p1d", 3, 1, "decode"), 4),
        ("2p2d", Layout("2p2d", 2, 2, "decode"), 4),
        ("1p3d", Layout("1p3d", 1, 3, "decode"), 4),
        ("3p1d-build-on-prefill", Layout("3p1d-build-on-prefill", 3, 1, "prefill"), 4),
        ("7p1d-auto", Layout("7p1d-auto", 7, 1, "auto"), 8),
        ("all-in-one[--fused-prefill]", Layout("all-in-one[--fused-prefill]", flags=("--fused-prefill",)), 1),
        (
            "3p1d[--kv-gpu-bytes 24G]",
            Layout("3p1d[--kv-gpu-bytes 24G]", 3, 1, "decode", flags=("--kv-gpu-bytes", "24G")),
            4,
        ),
    ],
)
def test_layout_names_parse(name: str, layout: Layout, gpus: int) -> None:
    assert parse_layout(name) == layout and layout.gpus == gpus
    if name in LAYOUT_GPUS:  # the names of committed results keep their GPU count
        assert LAYOUT_GPUS[name] == gpus


@pytest.mark.parametrize(
    "bad",
    [
        "",
        "foo",
        "replicas0",
        "0p1d",
        "3p0d",
        "3p",
        "p1d",
        "3p1d-build-on-gpu",
        "3p1d-",
        "2p2d-auto-x",
        "x[--a]",
    ],
)
def test_bad_layout_names_are_refused_with_the_syntax(bad: str) -> None:
    with pytest.raises(ValueError, match="unknown layout .* expected all-in-one; replicasN .* NpMd"):
        parse_layout(bad)


def test_bad_layout_on_the_command_line_is_a_usage_error(capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["--smoke", "--layouts", "all-in-one,3p0d"])
    assert exc.value.code == 2 and "unknown layout '3p0d'" in capsys.readouterr().err


def test_gpu_assignment() -> None:
    assert assign_gpus(parse_layout("3p1d"), 4) == {"prefill": ["0", "1", "2"], "decode": ["3"]}
    assert assign_gpus(parse_layout("1p3d"), 8) == {"prefill": ["0"], "decode": ["1", "2", "3"]}
    assert assign_gpus(parse_layout("2p2d-build-on-prefill"), 4) == {
        "prefill": ["0", "1"],
        "decode": ["2", "3"],
    }
    assert assign_gpus(parse_layout("replicas4"), 4) == {"prefill": list("0123"), "decode": list("0123")}
    assert assign_gpus(parse_layout("replicas"), 2) == {"prefill": ["0", "1"], "decode": ["0", "1"]}
    assert assign_gpus(parse_layout("1p1d-auto"), 2) == {"prefill": ["0"], "decode": ["1"]}
    assert assign_gpus(parse_layout("all-in-one"), 4) == {"all": ["0"]}
    with pytest.raises(ValueError, match="3p1d needs 4 GPUs, 2 visible"):
        assign_gpus(parse_layout("3p1d"), 2)
    # --share-gpu: a layout wider than the GPUs visible goes on GPU 0 whole; one that fits keeps its GPUs
    assert assign_gpus(parse_layout("3p1d"), 2, share=True) == {"prefill": ["0"] * 3, "decode": ["0"]}
    assert assign_gpus(parse_layout("1p1d"), 4, share=True) == {"prefill": ["0"], "decode": ["1"]}


def test_worker_gpus_are_counted_among_the_visible_ones() -> None:
    """A benchmark started with CUDA_VISIBLE_DEVICES=2,3 puts worker GPU 0 on device 2, not on device 0 (a
    planted pass-through of the index would put it on a GPU another job holds)."""
    assert visible_devices("0", parent="2,3") == "2"
    assert visible_devices("1", parent="2,3") == "3"
    assert visible_devices("0,1", parent="5, 7") == "5,7"
    assert visible_devices("", parent="2,3") == ""  # the router: no GPU
    assert visible_devices("1", parent="") == "1"  # nothing set: indices are devices


def test_simulator_predicts_split_rows_only() -> None:
    """The committed costs give a prediction for NpMd at 16K/32K; none for shared-GPU layouts, -auto, or a
    context the costs never measured. The analytic 4-GPU recommendation is a 4-GPU split."""
    costs, meta = simulator_costs()
    assert {16384, 32768} <= set(costs) and "error" not in meta
    one, three = (simulated_req_s(parse_layout(x), 16384, 64, 64, 32, costs) for x in ("1p1d", "3p1d"))
    assert one is not None and three is not None and 0 < one < three
    for layout, ctx in (("replicas4", 16384), ("all-in-one", 16384), ("3p1d-auto", 16384), ("3p1d", 2048)):
        assert simulated_req_s(parse_layout(layout), ctx, 64, 64, 32, costs) is None
    for sides in recommended_splits(costs, 4).values():
        for name in sides.values():
            assert parse_layout(name).gpus == 4 and parse_layout(name).split


def test_two_prefill_one_decode_smoke_answers_every_request(tmp_path) -> None:
    """2p1d with every process on the CPU: a router over two prefill workers and one decode worker."""
    argv = ["--smoke", "--out", str(tmp_path), "--ckpt-dir", str(tmp_path / "ckpt"), "--budget-s", "60",
            "--layouts", "2p1d", "--share-gpu", "--concurrency", "4", "--warm-burst", "0",
            "--name", "x"]  # fmt: skip
    assert main(argv) == 0
    data = json.loads((tmp_path / "x.json").read_text())
    meta = data["meta"]
    assert meta["errors"] == [] and meta["skipped"] == [], meta
    assert meta["shared_gpu"] == ["2p1d"] and meta["placement"] == "every process on the CPU"
    (row,) = data["rows"]
    assert (row["layout"], row["gpus"], row["shared_gpu"]) == ("2p1d", 0, True)  # CPU: gpus 0
    assert (row["requests"], row["failed"]) == (4, 0) and row["requests_per_s"] > 0
    assert sum(row["kv_sources"].values()) == 4
    assert row["sim_req_s"] is None  # 2048 tokens: no committed costs at that length
    assert meta["simulator"]["recommended"]["3"]  # the analytic best 3-GPU split, per context
    assert "| 2p1d | unique | 0 | 4 | 2048 |" in (tmp_path / "x.md").read_text()


def _row(layout: str, gpus: int, rps: float, p99: float = 10.0, sim: float | None = None) -> dict:
    return {"layout": layout, "workload": "unique", "gpus": gpus, "concurrency": 64, "context_tokens": 16384,
            "failed": 0, "requests_per_s": rps, "step_p99_ms": p99, "unloaded_step_ms": 8.0,
            "shared_gpu": False, "sim_req_s": sim}  # fmt: skip


def test_four_gpu_targets_are_read_from_the_rows() -> None:
    rows = [_row("all-in-one", 1, 1.0), _row("replicas4", 4, 4.0, 400.0), _row("3p1d", 4, 3.7, 15.0, 4.0),
            _row("2p2d", 4, 3.0, 30.0, 3.0), _row("1p1d", 2, 1.5)]  # fmt: skip
    (t,) = targets_x4(rows)
    assert (t["best"], t["best_met"], t["best_split"]) == ("replicas4", True, "3p1d")
    assert abs(t["split_vs_replicas"] - 0.925) < 1e-9 and t["split_vs_replicas_met"] is True
    assert abs(t["split_step_p99_over_unloaded"] - 15 / 8) < 1e-9 and t["split_step_met"] is True
    assert set(t["sim_error"]) == {"3p1d", "2p2d"} and t["sim_met"] is True  # +8%, 0%
    assert targets_x4(rows[:1] + rows[-1:]) == []  # no 4-GPU rows: nothing to say
    (t,) = targets_x4([_row("all-in-one", 1, 1.0), _row("3p1d", 4, 3.0)])  # no replicas4, no simulation
    assert t["split_vs_replicas"] is None and t["sim_met"] is None and t["best_met"] is False
