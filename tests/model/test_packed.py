"""Packed projections (one q/k/v GEMM, one gate/up GEMM) compute what the separate linears compute."""

from __future__ import annotations

import pytest
import torch

from pdllm.shared.model.loader import load_model, save_checkpoint
from pdllm.shared.model.transformer import Packed

from .helpers import tiny_model


@pytest.mark.parametrize("family", ["dream", "llada", "sdar"])
def test_packed_logits_equal_unpacked(family: str) -> None:
    model = tiny_model(family, seed=4)
    ids = torch.randint(3, 90, (2, 33), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        before = model(ids)
        model.pack_projections()
        model.pack_projections()  # idempotent
        after = model(ids)
    torch.testing.assert_close(after, before, atol=1e-5, rtol=1e-5)
    attn = model.model.layers[0].self_attn
    assert attn.qkv is not None and attn.q_proj.weight.data_ptr() == attn.qkv.weight.data_ptr()
    assert sum(p.numel() for p in model.parameters()) == tiny_model(family).num_parameters()


def test_packed_model_saves_and_reloads(tmp_path) -> None:
    model = tiny_model("dream", seed=5)
    ids = torch.randint(3, 90, (1, 20), generator=torch.Generator().manual_seed(1))
    model.pack_projections()
    with torch.no_grad():
        want = model(ids)
    save_checkpoint(model, tmp_path)  # views of one tensor must not trip safetensors' shared-memory check
    loaded = load_model(tmp_path, load_tokenizer=False, pack=True).model
    assert loaded.model.layers[1].mlp.gate_up is not None
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids), want, atol=1e-5, rtol=1e-5)
    assert (
        load_model(tmp_path, load_tokenizer=False).model.model.layers[0].self_attn.qkv is None
    )  # CPU default


def test_pack_refuses_mixed_bias() -> None:
    with_bias, without = torch.nn.Linear(4, 3), torch.nn.Linear(4, 2, bias=False)
    with pytest.raises(ValueError, match="only some have a bias"):
        Packed([with_bias, without])


def test_set_fused_off_is_the_eager_model_on_cpu() -> None:
    model = tiny_model("llada", seed=6)
    ids = torch.randint(3, 90, (1, 17), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        on = model(ids)
        model.set_fused(False)
        off = model(ids)
    assert all(not m.fused for m in model.modules() if hasattr(m, "fused"))
    torch.testing.assert_close(on, off, atol=0, rtol=0)  # CPU never takes the fused route
