"""Where the router has a pdllm request's decode KV built (``--build-on``)."""

from __future__ import annotations

import pytest

from pdllm.router.routing import build_on_prefill


@pytest.mark.parametrize(
    ("placement", "prefill_tokens", "decoding", "expected"),
    [
        ("auto", 0, 3, True),  # decode worker busy, prefill worker free: build on prefill
        ("auto", 4096, 3, False),  # the prefill worker has another prompt in flight
        ("auto", 0, 0, False),  # an idle decode worker builds without stalling anyone
        ("prefill", 4096, 0, True),
        ("decode", 0, 3, False),
    ],
)
def test_build_placement(placement: str, prefill_tokens: int, decoding: int, expected: bool) -> None:
    assert build_on_prefill(placement, prefill_tokens, decoding) is expected


def test_unknown_placement_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="build placement must be one of"):
        build_on_prefill("gpu0", 0, 0)
