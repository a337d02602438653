"""The offline sm_90 compile study (benchmarks/aot_sm90.py): its smoke run writes both files, with each
row compiled or recorded as a failure; a Triton that cannot be imported fails every row, not the run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import aot_sm90
from benchmarks.aot_sm90_cases import build_cases


def _sm90_compiler_available() -> bool:
    try:
        from triton.backends.nvidia import compiler

        return Path(compiler.get_ptxas(90).path).exists()
    except Exception:  # noqa: BLE001 - no Triton, no NVIDIA backend, no ptxas: all mean "cannot compile"
        return False


def test_occupancy_math() -> None:
    # 255 registers round up to 256: 65536 / (256 * 32) = 8 warps, so 2 four-warp programs.
    assert aot_sm90.occupancy(255, 4, 50_000)["progs_by_regs"] == 2
    assert aot_sm90.occupancy(168, 4, 50_000)["progs_by_regs"] == 3
    assert aot_sm90.occupancy(169, 4, 50_000)["progs_by_regs"] == 2
    assert aot_sm90.occupancy(128, 8, 50_000)["progs_by_regs"] == 2
    occ = aot_sm90.occupancy(64, 4, 100 * 1024)
    assert (occ["progs_by_regs"], occ["progs_by_smem"], occ["progs_per_sm"]) == (8, 2, 2)
    assert aot_sm90.occupancy(64, 4, 240 * 1024)["progs_per_sm"] == 0  # over the 227 KB per program


def test_smoke_writes_the_table(tmp_path: Path) -> None:
    assert aot_sm90.main(["--smoke", "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "aot_sm90.json").read_text())
    md = (tmp_path / "aot_sm90.md").read_text()
    assert data["meta"]["target"] == "cuda:90" and "--smoke" in data["meta"]["command"]
    assert [r["kernel"] for r in data["rows"]] == ["merge", "split_s"]
    if _sm90_compiler_available():
        for r in data["rows"]:
            assert r["ok"], r
            assert r["regs"] > 0 and r["progs_per_sm"] >= 1 and r["triton"]
            assert r["spill_stores"] is not None
    else:  # this machine cannot compile for sm_90: each row says why
        assert all(not r["ok"] and r["error"] for r in data["rows"])
    assert md.count("\n| smoke |") == 2


def test_a_triton_that_cannot_load_is_a_recorded_failure(tmp_path: Path) -> None:
    fake = tmp_path / "fake_triton"
    (fake / "triton").mkdir(parents=True)
    (fake / "triton" / "__init__.py").write_text("raise ImportError('planted: not a real Triton')\n")
    out = tmp_path / "out"
    assert aot_sm90.main(["--smoke", "--triton-path", str(fake), "--out", str(out)]) == 0
    rows = json.loads((out / "aot_sm90.json").read_text())["rows"]
    assert len(rows) == 2
    assert all(not r["ok"] and "planted" in r["error"] for r in rows)
    assert "FAILED" in (out / "aot_sm90.md").read_text()


def test_a_crashing_worker_loses_only_its_case(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    worker = tmp_path / "worker.py"
    # Aborts (as an MLIR assertion would) on the first case, answers the rest.
    worker.write_text(
        "import json, os, sys\n"
        "cases = json.load(sys.stdin)\n"
        "for c in cases:\n"
        "    print('START ' + c['id'], flush=True)\n"
        "    if c['id'].endswith('000'):\n"
        "        sys.stderr.write('Assertion failed\\n'); os.abort()\n"
        "    print('RESULT ' + json.dumps({'id': c['id'], 'ok': False, 'error': 'x', 'triton': 't'}), flush=True)\n"
    )
    monkeypatch.setattr(aot_sm90, "WORKER", worker)
    cases = build_cases(["smoke"])
    res = aot_sm90.run_cases(cases, None)
    first, second = (res[c["id"]] for c in cases)
    assert not first["ok"] and "Assertion failed" in first["error"]
    assert second["error"] == "x"


@pytest.mark.skipif(not _sm90_compiler_available(), reason="this Triton cannot compile for sm_90 here")
def test_every_split_s_variant_compiles_for_sm90(tmp_path: Path) -> None:
    """The kernel's constexpr branches the interpreter cannot type-check compile for the GPU: the fused merge,
    one split, holed pages and the row LSE. (Found by this check: the fused merge rebinding the int key
    count `total` to the merged fp32 LSE, which Triton refuses, so every fused-merge launch fell back.)"""
    from benchmarks.aot_sm90_cases import main_case

    cases = [main_case("check", 64, 64, 4, 2, fused=True, note="fused merge")]
    cases.append(main_case("check", 64, 64, 4, 2, fused=True, fill=True, note="fused merge, holed pages"))
    lse = main_case("check", 64, 64, 4, 2, fused=True, note="fused merge, row LSE")
    lse["constexprs"]["ROW_LSE"] = True
    cases.append(lse)
    for i, c in enumerate(cases):
        c["id"] = f"check-{i}"
    (tmp_path / "cases.json").write_text(json.dumps(cases))
    assert aot_sm90.main(["--configs", str(tmp_path / "cases.json"), "--out", str(tmp_path / "out")]) == 0
    rows = json.loads((tmp_path / "out" / "aot_sm90.json").read_text())["rows"]
    assert len(rows) == 3
    assert all(r["ok"] for r in rows), [r.get("error", "")[:300] for r in rows if not r["ok"]]


def _hopper_cases() -> list[dict]:
    return [c for c in build_cases(["hopper"]) if c["kernel"] != "split_s"]


def test_hopper_preset_matches_the_kernels_signatures() -> None:
    """Each Hopper case names every constexpr of the kernel it builds and nothing else, and the worker types
    every other argument (descriptors as the launcher's host TensorDescriptors), so the preset cannot drift
    from the kernels."""
    pytest.importorskip("triton")
    import inspect

    from benchmarks import aot_sm90_worker as worker

    cases = _hopper_cases()
    assert {c["note"].split()[0] for c in cases} == {"auto", "tma", "plain"}
    assert {c["num_stages"] for c in cases} == {1, 2, 3}
    for c in cases:
        fn = worker._kernel(c["kernel"])
        params = inspect.signature(fn.fn).parameters
        constexprs = {n for n, p in params.items() if "constexpr" in str(p.annotation)}
        assert set(c["constexprs"]) == constexprs, (c["id"], c["note"])
        sig, const, attrs = worker._signature(fn, c)
        assert list(sig) == list(params) and const == c["constexprs"]
        descs = [n for n, t in sig.items() if t.startswith("tensordesc")]
        if c["kernel"] == "hopper_ws":
            assert descs == ["QD", "KD", "VD", "KLD", "VLD"]
            assert sig["QD"] == "tensordesc<bf16[8, 8, 128]>" and sig["KLD"] == "tensordesc<bf16[64, 1, 128]>"
        else:
            assert descs == (["KD", "VD"] if c["constexprs"]["USE_TMA"] else [])
        hinted = {fn.arg_names[i] for (i,) in attrs}
        assert not hinted & set(descs) and "s_lst" not in hinted and {"PT", "split_size"} <= hinted


@pytest.mark.skipif(not _sm90_compiler_available(), reason="this Triton cannot compile for sm_90 here")
def test_a_hopper_case_compiles_for_sm90(tmp_path: Path) -> None:
    """Mode ``auto``'s kernel at 64x64, 4 warps, 2 stages compiles with the launch's hints."""
    case = next(c for c in _hopper_cases() if c["kernel"] == "hopper_ws" and c["num_stages"] == 2)
    case["id"] = "check-ws"
    (tmp_path / "cases.json").write_text(json.dumps([case]))
    assert aot_sm90.main(["--configs", str(tmp_path / "cases.json"), "--out", str(tmp_path / "out")]) == 0
    (row,) = json.loads((tmp_path / "out" / "aot_sm90.json").read_text())["rows"]
    assert row["ok"], row.get("error", "")[:300]
    assert row["regs"] > 0 and row["kernel"] == "hopper_ws"
