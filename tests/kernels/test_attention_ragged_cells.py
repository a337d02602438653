"""``benchmarks/attention_ragged.py``: the SDPA baseline of a ragged cell attends to exactly the keys the
ragged entry point reads (an oracle here walks each entry's page list slot by slot), and the entry point's
torch path agrees with both.

Planted by hand and seen failing (reverted): the gathered keys taken from the next page
(``pg + 1`` in ``RaggedCase``) and the entry's own rows left out of its keys."""

from __future__ import annotations

import math

import torch

from benchmarks.attention_ragged import SMOKE_CELLS, RaggedCase, ragged_cell

HQ, HKV, D, PAGE = 4, 2, 8, 16


def oracle(case: RaggedCase) -> torch.Tensor:
    """Float64 attention per entry and row over its KV slots (``pages[j // PAGE]``, offset ``j % PAGE``)
    and its own rows' K/V, query head h reading KV head h // (HQ // HKV)."""
    out = torch.zeros(case.q.shape, dtype=torch.float64)
    row = 0
    for g in case.batch.groups:
        table, lens, offs = g.page_table.tolist(), g.kv_lens.tolist(), g.q_offsets.tolist()
        for e in range(len(lens)):
            rows = range(row + offs[e], row + offs[e + 1])
            ks = [case.k_pages[table[e][j // PAGE], :, j % PAGE] for j in range(lens[e])]
            vs = [case.v_pages[table[e][j // PAGE], :, j % PAGE] for j in range(lens[e])]
            ks += [case.k[r] for r in rows]
            vs += [case.v[r] for r in rows]
            k, v = torch.stack(ks).double(), torch.stack(vs).double()  # [keys, HKV, D]
            for r in rows:
                for h in range(HQ):
                    kv_h = h // (HQ // HKV)
                    s = k[:, kv_h] @ case.q[r, h].double() / math.sqrt(D)
                    out[r, h] = torch.softmax(s, 0) @ v[:, kv_h]
        row += g.rows
    return out


def test_sdpa_baseline_and_entry_point_read_the_same_keys() -> None:
    for cell in [*SMOKE_CELLS, ragged_cell(5, (1, 12), (1, 90), 7)]:
        case = RaggedCase(cell, HQ, HKV, D, torch.float32, "cpu", PAGE)
        want = oracle(case)
        assert torch.allclose(case.sdpa(torch.float32).double(), want, atol=1e-5), cell.name
        assert torch.allclose(case.ragged("torch").double(), want, atol=1e-5), cell.name
        nbytes, flops = case.cost(D)
        keys = [k + r for k, r in zip(cell.kv, cell.rows, strict=True)]
        assert flops == 4 * sum(r * k for r, k in zip(cell.rows, keys, strict=True)) * HQ * D
        assert nbytes == (sum(keys) * HKV * D * 2 + 2 * sum(cell.rows) * HQ * D) * 4


def test_profile_driver_runs_the_entry_point_on_cpu(capsys) -> None:
    """``benchmarks/attention_profile.py`` (the ncu driver) runs the entry point's torch path once on CPU
    and reports its error against SDPA."""
    from benchmarks.attention_profile import main

    assert main([]) == 0
    line = capsys.readouterr().out.strip()
    assert line.startswith("smoke: 2 entries, 8 rows")
    assert float(line.rsplit(" ", 1)[1]) < 1e-5
