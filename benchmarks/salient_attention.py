"""DyLLM's approximate context update at 7B attention shapes: one layer, the queried response rows of each
request over its paged context plus its own rows.

Rows per (context, salient fraction, batch), times in microseconds (CUDA events, median):

- ``attention_us``: the layer's attention over every key (split-S), which the rounds run in any case;
- ``attention_lse_us``: the same call also writing each row's log-sum-exp (``lse_out``), as the rounds
  run it when a DyLLM update asks for it (its cost over ``attention_us`` is what handing it over adds);
- ``two_pass_us``: the old update's extra pass, a second split-S attention with the cached values;
- ``salient_us``: the salient-column kernel, forming ``A_t``'s normalizer itself (K-only pass);
- ``salient_lse_us``: the same kernel given the attention's row log-sum-exp (the salient columns only:
  what DyLLM's rounds run);
- ``max_rel_err`` / ``lse_rel_err``: the salient kernel without / with the attention's LSE against
  ``attention - two_pass`` in float32.

``--smoke`` runs tiny shapes on the CPU under the Triton interpreter (set ``TRITON_INTERPRET=1``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pdllm.kernels.salient_attention import salient_attention, salient_columns  # noqa: E402
from pdllm.kernels.split_s_attention import split_s_attention  # noqa: E402


def problem(batch: int, rows: int, context: int, frac: float, hkv: int, group: int, d: int, dtype, device):
    """Random requests of ``rows`` queried rows over ``context`` paged keys each (pages of 16, shuffled)."""
    page = 16
    per = -(-context // page)
    gen = torch.Generator().manual_seed(0)
    order = torch.randperm(batch * per, generator=gen)
    rnd = lambda *s: torch.randn(*s, generator=gen).to(device, dtype)  # noqa: E731
    t = batch * rows
    mask = (torch.rand(t, generator=gen) < frac).to(device)
    v_old = rnd(t, hkv, d)
    return dict(
        q=rnd(t, hkv * group, d),
        k_pages=rnd(batch * per, hkv, page, d),
        v_pages=rnd(batch * per, hkv, page, d),
        page_table=order.view(batch, per).to(device, torch.int32),
        kv_lens=torch.full((batch,), context, dtype=torch.int32, device=device),
        q_offsets=torch.arange(0, t + 1, rows, dtype=torch.int32, device=device),
        k_local=rnd(t, hkv, d),
        v_old=v_old,
        v_new=torch.where(mask[:, None, None], rnd(t, hkv, d), v_old),
        mask=mask,
        member=torch.arange(batch, device=device).repeat_interleave(rows),
    )


def timed(fn, reps: int) -> float:
    """Median microseconds of ``fn`` over ``reps`` calls after three warm-ups."""
    for _ in range(3):
        fn()
    if not torch.cuda.is_available():
        return float("nan")
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times)


def run_cell(batch: int, rows: int, context: int, frac: float, args, dtype, device) -> dict:
    p = problem(batch, rows, context, frac, args.hkv, args.group, args.head_dim, dtype, device)
    pages = (p["q"], p["k_pages"], p["v_pages"], p["page_table"], p["kv_lens"], p["q_offsets"])
    kw = dict(max_q_len=rows, max_kv_len=context)
    columns, counts = salient_columns(p["mask"], p["member"], batch)
    dv = p["v_new"].float() - p["v_old"].float()
    sal = (
        p["q"],
        p["k_pages"],
        p["page_table"],
        p["kv_lens"],
        p["q_offsets"],
        p["k_local"],
        dv,
        columns,
        counts,
    )
    full = lambda: split_s_attention(*pages, k_local=p["k_local"], v_local=p["v_new"], **kw)  # noqa: E731
    second = lambda: split_s_attention(*pages, k_local=p["k_local"], v_local=p["v_old"], **kw)  # noqa: E731
    lse = torch.empty(p["q"].shape[:2], dtype=torch.float32, device=device)
    with_lse = lambda: split_s_attention(*pages, k_local=p["k_local"], v_local=p["v_new"], lse_out=lse, **kw)  # noqa: E731
    want = with_lse().float() - second().float()  # lse now holds the attention's row log-sum-exp
    rel = lambda got: ((got - want).norm() / want.norm().clamp_min(1e-30)).item()  # noqa: E731
    err = rel(salient_attention(*sal, max_q_len=rows))
    lse_err = rel(salient_attention(*sal, lse=lse, max_q_len=rows))
    return dict(
        batch=batch, rows=rows, context=context, salient_fraction=frac, salient_rows=int(p["mask"].sum()),
        attention_us=timed(full, args.reps), attention_lse_us=timed(with_lse, args.reps),
        two_pass_us=timed(second, args.reps),
        salient_us=timed(lambda: salient_attention(*sal, max_q_len=rows), args.reps),
        salient_lse_us=timed(lambda: salient_attention(*sal, lse=lse, max_q_len=rows), args.reps),
        max_rel_err=err, lse_rel_err=lse_err,
    )  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--contexts", default="1024,8192,32768")
    ap.add_argument("--fractions", default="0.02,0.1,0.25")
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--rows", type=int, default=256, help="queried rows per request (the response)")
    ap.add_argument("--hkv", type=int, default=4)
    ap.add_argument("--group", type=int, default=7)  # Dream-7B: 28 query heads over 4 KV heads
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = ap.parse_args()
    if args.smoke:
        args.contexts, args.fractions, args.batches, args.rows = "40", "0.3", "2", 8
        args.hkv, args.group, args.head_dim, args.reps = 1, 2, 16, 1
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    rows = []
    for batch in map(int, args.batches.split(",")):
        for context in map(int, args.contexts.split(",")):
            for frac in map(float, args.fractions.split(",")):
                rows.append(run_cell(batch, args.rows, context, frac, args, dtype, device))
                print(json.dumps(rows[-1]), flush=True)
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    date = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    command = "python " + " ".join(sys.argv)
    meta = dict(device=name, date=date, dtype=str(dtype), command=command, hkv=args.hkv, group=args.group,
                head_dim=args.head_dim)  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "salient_attention.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    cols = list(rows[0])
    lines = [f"# salient-column update vs second attention pass ({name}, {dtype})", "", f"{date}, `{command}`", "",
             "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]  # fmt: skip
    lines += ["| " + " | ".join(f"{r[c]:.4g}" if isinstance(r[c], float) else str(r[c]) for c in cols) + " |"
              for r in rows]  # fmt: skip
    (args.out / "salient_attention.md").write_text("\n".join(lines) + "\n")
    print("ok")


if __name__ == "__main__":
    main()
