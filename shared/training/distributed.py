"""Data-parallel training over the GPUs of one host (``torchrun --nproc_per_node N``).

Without torchrun's environment (or with ``WORLD_SIZE`` 1) every helper is a no-op and training runs as a
single process, exactly as before. Control messages (stop, schedule length, token counts, weight digests)
travel over a gloo group on the CPU, so that agreeing on them each step never waits on the GPU stream.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class DistEnv:
    """This process's place in the job; ``control`` is the CPU (gloo) group for control messages."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    control: Any = None

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def setup(device_name: str) -> tuple[DistEnv, str]:
    """Read torchrun's RANK / WORLD_SIZE / LOCAL_RANK and join the process group: nccl on CUDA (each rank
    on ``cuda:LOCAL_RANK``), gloo on the CPU. Returns the env and the device this rank trains on."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return DistEnv(), device_name
    rank, local = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
    cuda = device_name.startswith("cuda")
    if cuda:
        device_name = f"cuda:{local}"
        torch.cuda.set_device(local)
    dist.init_process_group(backend="nccl" if cuda else "gloo")
    control = dist.new_group(backend="gloo") if cuda else dist.group.WORLD
    return DistEnv(rank=rank, world_size=world, local_rank=local, control=control), device_name


def shutdown(env: DistEnv) -> None:
    """Leave the process group once every rank got here (rank 0 may still be writing its files)."""
    if env.enabled:
        dist.barrier(group=env.control)
        dist.destroy_process_group()


def agree(env: DistEnv, values: list[int]) -> list[int]:
    """Rank 0's values on every rank: decisions taken from rank 0's clock (stop, schedule length) must be
    the same everywhere, or one rank would wait forever in a collective the others never join."""
    if not env.enabled:
        return values
    t = torch.tensor(values, dtype=torch.int64)
    dist.broadcast(t, src=0, group=env.control)
    return t.tolist()


def global_sum(env: DistEnv, value: int) -> int:
    """``value`` summed over all ranks (their batches need not hold the same number of tokens)."""
    if not env.enabled:
        return value
    t = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(t, group=env.control)
    return int(t.item())


def gather(env: DistEnv, obj: Any) -> list[Any]:
    """Every rank's ``obj``, in rank order (on every rank)."""
    if not env.enabled:
        return [obj]
    out: list[Any] = [None] * env.world_size
    dist.all_gather_object(out, obj, group=env.control)
    return out


def data_seed(seed: int, rank: int) -> int:
    """The batch-stream seed of ``rank``: ``seed + rank``. Rank 0 keeps the single-process stream byte for
    byte; ``BatchStream`` seeds worker ``w`` with ``seed * 1000 + w``, so the ranks' streams stay distinct
    for fewer than 1000 workers. (A per-rank stride over one stream would build N batches to use one.)"""
    return seed + rank


def weight_digest(model: torch.nn.Module) -> str:
    """SHA-256 of the parameters' bytes (CPU, float32): equal on every rank iff DDP kept them in sync."""
    h = hashlib.sha256()
    for name, p in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(p.detach().to("cpu", torch.float32).contiguous().numpy().tobytes())
    return h.hexdigest()
