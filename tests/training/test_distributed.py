"""Data-parallel training (``torchrun``, gloo on the CPU): ranks draw their own batches, stay in sync, stop
together, and rank 0 writes one run whose token count covers every rank."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

from pdllm.shared.model.loader import load_model
from pdllm.shared.training import train as train_mod
from pdllm.shared.training.config import CONFIG_DIR, load_config
from pdllm.shared.training.data import BatchBuilder, BatchStream
from pdllm.shared.training.distributed import data_seed, weight_digest

STEPS = 6
TIMEOUT_S = 240  # a rank left waiting in a collective must fail the test, not hang it


def _first_batch(builder: BatchBuilder, seed: int) -> torch.Tensor:
    return next(iter(BatchStream(builder, seed))).ids


def test_ranks_draw_different_batches(factory, tokenizer):
    """Rank 0 draws the single-process stream, rank 1 another one. Planted and caught: ``data_seed``
    returning ``seed`` for every rank (both ranks train on the same batches)."""
    cfg = load_config(CONFIG_DIR / "smoke.json")
    builder = BatchBuilder(cfg.data, factory, tokenizer.bos_token_id, tokenizer.eos_token_id)
    rank0 = _first_batch(builder, data_seed(cfg.seed, 0))
    assert torch.equal(rank0, _first_batch(builder, cfg.seed))
    rank1 = _first_batch(builder, data_seed(cfg.seed, 1))
    assert rank0.shape != rank1.shape or not torch.equal(rank0, rank1)


def _torchrun(out: Path, nproc: int) -> tuple[int, str]:
    """Run the smoke config on ``nproc`` CPU ranks under torchrun; (exit status, output)."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    cmd += ["-m", "pdllm.shared.training.train", "--smoke", "--max-steps", str(STEPS), "--no-progress"]
    log = out.parent / f"torchrun_{nproc}.log"
    # Output to a file, not a pipe: a rank left behind would hold a pipe open and block the reader.
    with log.open("w") as fh:
        proc = subprocess.Popen([*cmd, "--out", str(out)], env=env, stdout=fh, stderr=subprocess.STDOUT)
        try:
            rc = proc.wait(timeout=TIMEOUT_S)
        except subprocess.TimeoutExpired:
            # torchrun's ranks run in their own sessions; on SIGTERM it stops and reaps them itself.
            proc.terminate()
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            raise AssertionError(f"the {nproc}-rank run hung past {TIMEOUT_S} s") from None
    return rc, log.read_text()


def test_two_ranks_train_one_model_in_sync(tmp_path):
    """Two CPU ranks finish together and write one run: ``world_size`` 2, every rank's tokens counted,
    equal weight digests on both ranks, matching the checkpoint; and the model differs from a
    single-process run of the same steps (rank 1's batches reached the gradient). Planted and caught: the
    loss not wrapped in DDP (the digests differ); ``data_seed`` returning ``seed`` for every rank (the
    weights equal the single-process run's); rank 1 stopping one step before rank 0 (rank 0 waits in a
    collective: the timeout fails the test, it does not hang)."""
    out = tmp_path / "ddp"
    rc, output = _torchrun(out, 2)
    assert rc == 0, output[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    cfg = load_config(CONFIG_DIR / "smoke.json")
    assert summary["world_size"] == 2 and summary["steps"] == STEPS
    # Every smoke batch holds tokens_per_batch tokens (8 rows of 256 or 16 of 128): one rank's step.
    assert summary["tokens"] == 2 * STEPS * cfg.data.tokens_per_batch
    records = [json.loads(x) for x in (out / "train_log.jsonl").read_text().splitlines()]
    assert records[-1]["step"] == STEPS - 1 and records[-1]["tokens"] == summary["tokens"]
    digests = summary["rank_weight_digests"]
    assert len(digests) == 2 and digests[0] == digests[1]
    saved = load_model(out / "checkpoint", dtype="float32", device="cpu", load_tokenizer=False, pack=False)
    assert weight_digest(saved.model) == digests[0]
    assert list((out).glob("checkpoint*")) == [out / "checkpoint"]

    single = tmp_path / "single"
    assert train_mod.main(["--smoke", "--max-steps", str(STEPS), "--out", str(single), "--no-progress"]) == 0
    one = json.loads((single / "summary.json").read_text())
    assert one["world_size"] == 1 and one["tokens"] * 2 == summary["tokens"]
    alone = load_model(single / "checkpoint", dtype="float32", device="cpu", load_tokenizer=False, pack=False)
    assert weight_digest(alone.model) != digests[0]
