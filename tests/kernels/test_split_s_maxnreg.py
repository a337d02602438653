"""The split-S config's ptxas register cap (``maxnreg``): table and candidates (de)serialisation, the
committed table (no cap anywhere), the launcher's Triton launch kwargs and its refused-launch key.

A capped config whose launch Triton refused must not send the uncapped config of the same tiles to the torch
reference: with ``maxnreg`` dropped from :func:`~pdllm.kernels.split_s_attention.launch_key` the two share
one key, and ``test_a_refused_capped_launch_leaves_the_uncapped_one_alone`` fails.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from pdllm.kernels import resources
from pdllm.kernels import split_s_tuner as tuner
from pdllm.kernels import split_s_tuning as st
from pdllm.kernels.split_s_reference import SplitSConfig

from .helpers import Problem, make_problem

CAPPED = SplitSConfig(block_n=32, num_stages=3, programs_per_sm=3.0, maxnreg=168)
UNCAPPED = dataclasses.replace(CAPPED, maxnreg=None)
BUCKET = st.ShapeBucket(rows=256, kv=4096, bh=16, head_dim=128, page=64, dtype="bfloat16")
H100 = "NVIDIA H100 80GB HBM3"


@pytest.fixture(autouse=True)
def _fresh(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.delenv(st.TABLE_ENV, raising=False)
    st.clear_caches()
    resources.reset()
    yield
    st.clear_caches()
    resources.reset()


def test_config_round_trips_through_the_table_json_with_and_without_a_cap(tmp_path: Path) -> None:
    assert "maxnreg" not in st.config_to_dict(UNCAPPED)  # absent, not null: old tables stay byte-identical
    assert st.config_to_dict(CAPPED)["maxnreg"] == 168
    for cfg in (CAPPED, UNCAPPED):
        assert st.config_from_dict(json.loads(json.dumps(st.config_to_dict(cfg)))) == cfg
    assert st.config_from_dict({"maxnreg": None}) == SplitSConfig()
    entries = [{"device": dev, "bucket": dataclasses.asdict(BUCKET), "config": st.config_to_dict(cfg)}
               for dev, cfg in ((H100, CAPPED), ("NVIDIA H200", UNCAPPED))]  # fmt: skip
    path = tmp_path / "table.json"
    tuner.write_table(path, entries)
    assert st.load_table(path).entries == {(H100, BUCKET): CAPPED, ("NVIDIA H200", BUCKET): UNCAPPED}


@pytest.mark.parametrize("bad", ["168", True, 0, 256, 168.0])
def test_a_bad_cap_is_refused(bad: object) -> None:
    with pytest.raises(ValueError, match="maxnreg"):
        st.config_from_dict({"maxnreg": bad})


def test_the_committed_table_loads_with_its_caps() -> None:
    """A capped entry (the H100's Lq-96 64x32 tiles run at 128 registers) loads capped, the rest uncapped."""
    table = st.load_table(st.DEFAULT_TABLE)
    raw = json.loads(st.DEFAULT_TABLE.read_text())
    assert table.entries and len(table.entries) == len(raw["entries"])
    for e in raw["entries"]:
        bucket = st.ShapeBucket(**e["bucket"])
        assert table.entries[(e["device"], bucket)].maxnreg == e["config"].get("maxnreg")
    assert any(cfg.maxnreg == 128 for cfg in table.entries.values())


def test_candidates_file_parses_capped_candidates(tmp_path: Path) -> None:
    path = tmp_path / "cands.json"
    path.write_text(json.dumps([{"block_n": 32, "num_stages": 3, "programs_per_sm": 3.0, "maxnreg": 168}]))
    assert tuner.load_candidates(path) == [SplitSConfig(), CAPPED]
    with pytest.raises(SystemExit, match="CUDA"):  # parsed; then the tuner wants a GPU
        tuner.main(["--candidates", str(path), "--out", str(tmp_path / "out.json")])
    path.write_text('[{"maxnreg": "168"}]')
    with pytest.raises(ValueError, match="maxnreg"):
        tuner.main(["--candidates", str(path), "--out", str(tmp_path / "out.json")])
    study = Path(__file__).resolve().parents[2] / "benchmarks/results/aot_sm90_candidates.json"
    caps = {
        (c.block_m, c.block_n, c.num_warps, c.num_stages, c.maxnreg) for c in tuner.load_candidates(study)
    }
    assert {(64, 64, 4, 2, 168), (64, 64, 8, 2, 128), (64, 32, 4, 2, 128)} <= caps


def _problem() -> Problem:
    return make_problem(torch.Generator().manual_seed(0), [30, 12], [[64, 64], [100]], 2, 7, 32, 64)


def _spy(monkeypatch: pytest.MonkeyPatch, refuse: SplitSConfig | None = None) -> list[dict]:
    """Replace the jitted kernels' ``run`` (what ``kernel[grid](...)`` calls) with a recorder; a main-kernel
    launch whose cap and tiles are ``refuse``'s raises Triton's OutOfResources."""
    pytest.importorskip("triton")
    from triton.runtime.errors import OutOfResources

    from pdllm.kernels import split_s_attention as sa

    launches: list[dict] = []

    def run(*_args: object, grid: tuple, warmup: bool, **kw: object) -> None:
        if refuse is not None and (kw["maxnreg"], kw["BLOCK_N"]) == (refuse.maxnreg, refuse.block_n):
            raise OutOfResources(300, 255, "registers")
        launches.append(kw)

    monkeypatch.setattr(sa._split_s_kernel, "run", run)
    monkeypatch.setattr(sa._merge_kernel, "run", lambda *a, grid, warmup, **kw: None)
    return launches


def test_launcher_passes_the_cap_to_the_triton_launch(monkeypatch: pytest.MonkeyPatch) -> None:
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import CUDABackend

    from pdllm.kernels import split_s_attention as sa

    launches = _spy(monkeypatch)
    p = _problem()
    for cfg in (CAPPED, UNCAPPED):
        sa.split_s_attention(*p.args(), config=cfg, max_q_len=30, max_kv_len=int(p.kv_lens.max()))
    assert [kw["maxnreg"] for kw in launches] == [168, None]
    assert [kw["num_stages"] for kw in launches] == [3, 3]
    # Triton's NVIDIA backend reads the launch kwargs as compile options: the cap reaches ptxas.
    backend = CUDABackend(GPUTarget("cuda", 90, 32))
    assert [backend.parse_options(dict(kw)).maxnreg for kw in launches] == [168, None]


def test_a_refused_capped_launch_leaves_the_uncapped_one_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    from pdllm.kernels import split_s_attention as sa

    assert sa.launch_key(torch.bfloat16, 128, 64, CAPPED) != sa.launch_key(torch.bfloat16, 128, 64, UNCAPPED)
    launches = _spy(monkeypatch, refuse=CAPPED)
    chosen = [CAPPED]
    monkeypatch.setattr(
        sa, "select_config", lambda *_a, **_k: st.Selection(chosen[0], "table", "cpu", BUCKET)
    )
    p = _problem()
    lens = dict(max_q_len=30, max_kv_len=int(p.kv_lens.max()))
    want = sa.split_s_attention_reference(*p.args())
    torch.testing.assert_close(sa.split_s_attention(*p.args(), **lens), want)  # refused: the reference
    assert launches == []
    chosen[0] = UNCAPPED
    sa.split_s_attention(*p.args(), **lens)
    assert [kw["maxnreg"] for kw in launches] == [None], "the uncapped config went to the reference"
