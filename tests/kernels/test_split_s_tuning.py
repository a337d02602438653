"""Split-S config selection: shape buckets, the tuned table (lookup, validation, merge), the heuristic
fallback, and the launcher's use of them. The kernel numerics per config run under the interpreter
(interpreter_cases.case_split_s_configs)."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from pdllm.kernels import split_s_tuner as tuner
from pdllm.kernels import split_s_tuning as st
from pdllm.kernels.split_s_reference import SplitSConfig
from tests.kernels.interpreter_cases import kernel_variants

H100 = "NVIDIA H100 80GB HBM3"
BF16 = torch.bfloat16
# Dream-7B decode: 28/4 heads (G = 7), d = 128, page 64.
DREAM_B4_LQ32 = dict(rows=32 * 7, kv=4096 + 32, batch_heads=4 * 4, head_dim=128, page=64)
CFG_A = SplitSConfig(block_m=128, block_n=32, num_warps=8, num_stages=3, programs_per_sm=1.0)
CFG_B = SplitSConfig(block_n=128, fused_merge=True)
CFG_C = SplitSConfig(min_split_tokens=256, programs_per_sm=1.0)


@pytest.fixture(autouse=True)
def _fresh_caches(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.delenv(st.TABLE_ENV, raising=False)
    st.clear_caches()
    yield
    st.clear_caches()


def _bucket(**over: object) -> st.ShapeBucket:
    shape = {**DREAM_B4_LQ32, **over}
    return st.ShapeBucket.of(dtype=BF16, **shape)


def _entry(device: str, bucket: st.ShapeBucket, cfg: SplitSConfig) -> dict:
    return {"device": device, "bucket": dataclasses.asdict(bucket), "config": st.config_to_dict(cfg)}


def _write(tmp_path: Path, entries: list[dict], name: str = "table.json") -> Path:
    path = tmp_path / name
    path.write_text(json.dumps({"version": 1, "entries": entries}))
    return path


def _select(device: str, monkeypatch: pytest.MonkeyPatch, **over: object) -> st.Selection:
    monkeypatch.setattr(st, "device_name", lambda _dev: device)
    return st.select_config(torch.device("cpu"), BF16, **{**DREAM_B4_LQ32, **over})


def test_bucket_key() -> None:
    b = _bucket()
    assert b == st.ShapeBucket(rows=256, kv=4096, bh=16, head_dim=128, page=64, dtype="bfloat16")
    # S*C + Lq stays in the S*C bucket; the 1024/2048 boundary is 1024 * sqrt(2); batch buckets: powers of 4.
    assert _bucket(kv=16384 + 96).kv == 16384 and _bucket(kv=1449).kv == 2048 and _bucket(kv=1448).kv == 1024
    assert _bucket(rows=96 * 7).rows == 512 and _bucket(rows=256 * 7).rows == 2048
    assert [_bucket(batch_heads=b * 4).bh for b in (1, 2, 4, 8, 16, 32, 64)] == [4, 16, 16, 64, 64, 256, 256]
    assert _bucket(kv=0).kv == 1
    for field, bad in (("rows", 200), ("bh", 8), ("page", 24), ("dtype", "int8")):
        with pytest.raises(ValueError, match=field):
            dataclasses.replace(b, **{field: bad}).check()


def _expect_lookups(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The lookup contract: an entry answers only its own device + bucket; all else gets the heuristic."""
    near = _bucket(kv=8192)
    path = _write(
        tmp_path,
        [_entry(H100, _bucket(), CFG_A), _entry("NVIDIA H200", _bucket(), CFG_B), _entry(H100, near, CFG_C)],
    )
    monkeypatch.setenv(st.TABLE_ENV, str(path))
    got = _select(H100, monkeypatch)
    assert (got.config, got.source) == (CFG_A, "table")
    assert _select(H100, monkeypatch, kv=4096 + 96, batch_heads=2 * 4).config == CFG_A  # same bucket
    assert _select("NVIDIA H200", monkeypatch).config == CFG_B
    assert _select(H100, monkeypatch, kv=8192 + 32).config == CFG_C
    for other in (
        {"page": 16},  # page size is part of the key
        {"rows": 96 * 7},
        {"batch_heads": 64 * 4},
        {"head_dim": 64},
    ):
        sel = _select(H100, monkeypatch, **other)
        assert (sel.source, sel.config) == ("heuristic", st.heuristic_config(sel.bucket)), other
    sel = _select("NVIDIA A100-SXM4-80GB", monkeypatch)
    assert (sel.source, sel.config) == ("heuristic", SplitSConfig())


def test_table_entry_for_matching_device_and_bucket_else_heuristic(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The configs must differ from each other and from the heuristic, or the checks below prove nothing.
    assert len({CFG_A, CFG_B, CFG_C, st.heuristic_config(_bucket())}) == 4
    _expect_lookups(tmp_path, monkeypatch)


@pytest.mark.parametrize(
    "wrong",
    [
        lambda table, device, bucket: st.Selection(st.heuristic_config(bucket), "heuristic", device, bucket),
        lambda table, device, bucket: next(  # ignores the device
            (st.Selection(c, "table", device, bucket) for (_, b), c in table.entries.items() if b == bucket),
            st.Selection(st.heuristic_config(bucket), "heuristic", device, bucket),
        ),
        lambda table, device, bucket: next(  # ignores the page size
            (
                st.Selection(c, "table", device, bucket)
                for (d, b), c in table.entries.items()
                if d == device and dataclasses.replace(b, page=bucket.page) == bucket
            ),
            st.Selection(st.heuristic_config(bucket), "heuristic", device, bucket),
        ),
    ],
    ids=["always-heuristic", "ignores-device", "ignores-page"],
)
def test_a_wrong_lookup_fails_the_lookup_checks(
    wrong: Callable, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(st, "_lookup", wrong)
    with pytest.raises(AssertionError):
        _expect_lookups(tmp_path, monkeypatch)


class _FakeKernel:
    """Stands in for the Triton kernel on CPU: records the launch instead of running it."""

    def __init__(self) -> None:
        self.launches: list[tuple[tuple, dict]] = []

    def __getitem__(self, grid: tuple) -> Callable[..., None]:
        return lambda *args, **kw: self.launches.append((grid, kw))


def test_launcher_uses_the_table_unless_given_a_config(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("triton")
    from pdllm.kernels import split_s_attention as sa

    from .helpers import make_problem

    p = make_problem(torch.Generator().manual_seed(0), [30, 12], [[64, 64], [100]], 2, 7, 32, 64)
    rows, kv = 30 * 7, int(p.kv_lens.max()) + 30
    bucket = st.ShapeBucket.of(rows, kv, 2 * 2, 32, 64, torch.float32)
    monkeypatch.setenv(st.TABLE_ENV, str(_write(tmp_path, [_entry("cpu", bucket, CFG_A)])))
    kernel, merge = _FakeKernel(), _FakeKernel()
    monkeypatch.setattr(sa, "_split_s_kernel", kernel)
    monkeypatch.setattr(sa, "_merge_kernel", merge)

    def launched() -> tuple:
        grid, kw = kernel.launches[-1]
        return grid[0], kw["BLOCK_M"], kw["BLOCK_N"], kw["num_warps"], kw["num_stages"], kw["FUSED"]

    sa.split_s_attention(*p.args(), max_q_len=30, max_kv_len=int(p.kv_lens.max()))
    assert launched() == (-(-rows // 128), 128, 32, 8, 3, False)
    explicit = SplitSConfig(block_m=16, block_n=16, num_warps=2, num_stages=1, fused_merge=True, num_splits=3)
    sa.split_s_attention(*p.args(), config=explicit)
    assert launched()[1:] == (16, 16, 2, 1, True) and launched()[0] == -(-rows // 16)
    # A shape in another bucket (one request fewer KV) gets the heuristic's tiles.
    sa.split_s_attention(*p.args(), max_q_len=30, max_kv_len=40)
    assert launched()[1:3] == (64, 64)


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("{not json", "cannot read"),
        ('{"version": 2, "entries": []}', "version 1"),
        ('{"version": 1, "entries": {}}', "'entries' list"),
        ('{"version": 1, "entries": [{"device": "x", "bucket": {}}]}', "entry 0: need an object with device"),
        ('{"version": 1, "entries": [{"device": "", "bucket": {}, "config": {}}]}', "non-empty string"),
    ],
)
def test_malformed_table_file_raises(
    text: str, match: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "bad.json"
    path.write_text(text)
    monkeypatch.setenv(st.TABLE_ENV, str(path))
    with pytest.raises(st.SplitSTableError, match=match) as err:
        _select(H100, monkeypatch)
    assert str(path) in str(err.value)


@pytest.mark.parametrize(
    ("bucket", "config", "match"),
    [
        ({}, {"block_k": 64}, "unknown config field"),
        ({}, {"block_m": 48}, "power of two"),
        ({}, {"block_m": 512}, "<= 256"),
        ({}, {"num_warps": 3}, "num_warps"),
        ({}, {"block_m": True}, "must be int"),
        ({}, {"fused_merge": 1}, "must be bool"),
        ({}, {"programs_per_sm": "2"}, "must be float"),
        ({"rows": 200}, {}, "rows=200 is not a bucket value"),
        ({"bh": 32}, {}, "bh=32 is not a bucket value"),
        ({"batch": 4}, {}, "unexpected keyword"),
    ],
)
def test_malformed_entry_raises(
    bucket: dict, config: dict, match: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    entry = _entry(H100, _bucket(), SplitSConfig())
    entry["bucket"].update(bucket)
    entry["config"] = config
    good = _entry(H100, _bucket(kv=8192), SplitSConfig())
    monkeypatch.setenv(st.TABLE_ENV, str(_write(tmp_path, [good, entry])))
    with pytest.raises(st.SplitSTableError, match=rf"entry 1: .*{match}"):
        _select(H100, monkeypatch)


def test_duplicate_entries_and_missing_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    dup = _write(tmp_path, [_entry(H100, _bucket(), CFG_A), _entry(H100, _bucket(), CFG_B)])
    monkeypatch.setenv(st.TABLE_ENV, str(dup))
    with pytest.raises(st.SplitSTableError, match="entry 1 repeats"):
        _select(H100, monkeypatch)
    monkeypatch.setenv(st.TABLE_ENV, str(tmp_path / "missing.json"))
    with pytest.raises(st.SplitSTableError, match="cannot read"):
        st.load_table()
    # No override and no committed file (e.g. a wheel without it): every bucket uses the heuristic.
    monkeypatch.delenv(st.TABLE_ENV)
    monkeypatch.setattr(st, "DEFAULT_TABLE", tmp_path / "absent.json")
    assert _select(H100, monkeypatch).source == "heuristic"


def test_lookup_is_memoised(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = _write(tmp_path, [_entry(H100, _bucket(), CFG_A)])
    monkeypatch.setenv(st.TABLE_ENV, str(path))
    first = _select(H100, monkeypatch)
    path.write_text("{broken")  # not re-read: the parsed table is cached per path
    assert _select(H100, monkeypatch) is first
    st.clear_caches()
    with pytest.raises(st.SplitSTableError):
        _select(H100, monkeypatch)


def test_heuristic() -> None:
    # Dream shapes keep the measured fixed default; only tiny row counts get smaller row blocks.
    for rows in (32 * 7, 96 * 7, 256 * 7):
        assert st.heuristic_config(_bucket(rows=rows)) == SplitSConfig()
    assert st.heuristic_config(_bucket(rows=16)).block_m == 16
    assert st.heuristic_config(_bucket(rows=30)).block_m == 32
    assert st.heuristic_config(_bucket(page=16)).block_n == 64
    assert st.heuristic_config(_bucket(head_dim=256)).programs_per_sm == 1.0


def test_every_pickable_config_is_checked_under_the_interpreter() -> None:
    """The committed table's configs are tuner candidates, and every (block_m, block_n, fused_merge) the
    tuner or heuristic can pick is one the interpreter case runs."""
    table = st.load_table(st.DEFAULT_TABLE)
    variants = set(kernel_variants())
    for (_, bucket), cfg in table.entries.items():
        assert cfg in tuner.candidates(bucket), (bucket, cfg)
    for rows in (8, 16, 32, 64, 256, 2048):
        for page in (16, 32, 64):
            b = _bucket(rows=rows, page=page)
            for cfg in [*tuner.candidates(b), st.heuristic_config(b)]:
                assert (cfg.block_m, cfg.block_n, cfg.fused_merge) in variants, (b, cfg)


def test_write_table_merges_and_refuses_a_malformed_target(tmp_path: Path) -> None:
    path = _write(tmp_path, [_entry(H100, _bucket(), CFG_A), _entry("NVIDIA H200", _bucket(), CFG_B)])
    tuner.write_table(path, [{**_entry(H100, _bucket(), CFG_C), "us": 1.0, "timings": []}])
    table = st.load_table(path)
    assert table.entries == {(H100, _bucket()): CFG_C, ("NVIDIA H200", _bucket()): CFG_B}
    bad = tmp_path / "bad.json"
    bad.write_text('{"version": 1, "entries": [{}]}')
    with pytest.raises(st.SplitSTableError):
        tuner.write_table(bad, [_entry(H100, _bucket(), CFG_C)])
    assert bad.read_text() == '{"version": 1, "entries": [{}]}'


def test_candidates_file_replaces_the_tuners_list_and_keeps_the_default_first(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "cands.json"
    path.write_text(json.dumps([st.config_to_dict(CFG_A), {"block_m": 128}]))
    cands = tuner.load_candidates(path)
    assert cands == [SplitSConfig(), CFG_A, SplitSConfig(block_m=128)]
    made: list[SplitSConfig] = []

    def runner(*_args: object) -> Callable[[SplitSConfig], Callable[[], list[torch.Tensor]]]:
        def make(cfg: SplitSConfig) -> Callable[[], list[torch.Tensor]]:
            made.append(cfg)
            return lambda: [torch.ones(4)]

        return make

    monkeypatch.setattr(tuner, "_runner", runner)
    monkeypatch.setattr(tuner, "graph_time_us", lambda fn: 50.0 if made[-1] == cands[2] else 100.0)
    shape = tuner.TuneShape(1, 32, 1024, 64)
    entry = tuner.tune_bucket(shape, _bucket(), BF16, torch.device("cpu"), cands=cands)
    assert made[1:] == cands  # made[0]: the reference output
    assert entry["config"] == st.config_to_dict(SplitSConfig(block_m=128))
    for bad in ("[]", '[{"block_q": 64}]'):
        path.write_text(bad)
        with pytest.raises(ValueError):
            tuner.load_candidates(path)
