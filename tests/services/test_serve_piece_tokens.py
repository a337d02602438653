"""`--prefill-piece-tokens`: a role's own default unless the flag or its variable says otherwise."""

from __future__ import annotations

import pytest

from pdllm.shared.app.serve_args import PIECE_TOKENS, build_parser, piece_tokens


@pytest.mark.parametrize("role", ["all", "prefill"])
def test_each_role_has_its_own_default(role: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PDLLM_PREFILL_PIECE_TOKENS", raising=False)
    args = build_parser().parse_args(["--role", role])
    assert piece_tokens(args, role) == PIECE_TOKENS[role]
    assert PIECE_TOKENS["all"] < PIECE_TOKENS["prefill"]  # decode rounds wait for --role all's pieces


def test_flag_and_variable_win_and_zero_is_whole_batches(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PDLLM_PREFILL_PIECE_TOKENS", "4096")
    assert piece_tokens(build_parser().parse_args(["--role", "prefill"]), "prefill") == 4096
    args = build_parser().parse_args(["--role", "prefill", "--prefill-piece-tokens", "0"])
    assert piece_tokens(args, "prefill") is None
