"""The CPU tier's size: ``serve --kv-cpu-bytes`` takes a byte count with a binary suffix or ``auto`` (a share
of the host's available memory at startup, the default); a bad value is a one-line error naming the flag."""

from __future__ import annotations

import pytest

from pdllm.shared.app.serve_args import build_parser
from pdllm.shared.host_memory import AUTO_FLOOR, AUTO_SHARE, auto_bytes, available_bytes, parse_bytes

GIB = 1 << 30


def test_sizes_with_suffixes_and_auto() -> None:
    assert parse_bytes("2147483648") == 2 * GIB
    assert (
        parse_bytes("512M") == 512 << 20
        and parse_bytes("64g") == 64 * GIB
        and parse_bytes("1.5GiB") == 3 << 29
    )
    assert parse_bytes("0") == 0
    assert parse_bytes("auto", available=100 * GIB) == int(100 * GIB * AUTO_SHARE) >> 20 << 20
    for bad in ("", "-1", "2 parsecs", "1e9", "auto2"):
        with pytest.raises(ValueError, match="expected 'auto' or a size"):
            parse_bytes(bad)


def test_auto_keeps_a_floor_never_exceeds_the_host_and_defaults_without_meminfo() -> None:
    assert auto_bytes(1 * GIB) == AUTO_FLOOR  # 40% of 1 GiB is below the floor
    assert auto_bytes(512 << 20) == 512 << 20  # never more than the host has
    assert auto_bytes(None) == 2 * GIB
    assert auto_bytes(128 * GIB) > 32 * GIB  # a GPU host's default holds dozens of 16K documents


def test_available_bytes_reads_meminfo(tmp_path) -> None:  # type: ignore[no-untyped-def]
    meminfo = tmp_path / "meminfo"
    meminfo.write_text(
        "MemTotal:       263845192 kB\nMemFree:         1000 kB\nMemAvailable:   200000000 kB\n"
    )
    assert available_bytes(meminfo) == 200000000 * 1024
    assert available_bytes(tmp_path / "missing") is None
    meminfo.write_text("MemTotal: 1 kB\n")
    assert available_bytes(meminfo) is None


def test_serve_flag_defaults_to_auto_and_parses_sizes(capsys: pytest.CaptureFixture[str]) -> None:
    parser = build_parser()
    assert parser.parse_args([]).kv_cpu_bytes == auto_bytes(available_bytes())
    assert parser.parse_args(["--kv-cpu-bytes", "512M"]).kv_cpu_bytes == 512 << 20
    with pytest.raises(SystemExit):
        parser.parse_args(["--kv-cpu-bytes", "lots"])
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--kv-cpu-bytes" in err[0] and "expected 'auto' or a size" in err[0]
