"""The compute-skipping decode policies' (``dyllm``, ``focus``) reference loops behind one entry point.

They are not ``CachePolicy``\\ s (a cache policy plans which local rows a step forwards; these skip work
*inside* the forward: DyLLM per layer and row, FOCUS past layer 1), so ``make_policy`` returns None for
them and their one-request loops are built here (``vanilla.py``, ``static_kv.py`` and ``sdar.py`` call
them):

- :func:`compute_skip_logits`: Dream/LLaDA: DyLLM's logits function over any method's local rows and
  attention backend ``inner`` (vanilla: dense over prompt + response, :func:`vanilla_compute_skip_logits`;
  pdllm: the static chunk KV backend, ``static_kv.static_compute_skip_logits``); FOCUS is refused there
  (SDAR only, ``policies/focus.ONLY_SDAR``);
- :func:`run_compute_skip`: that loop to the end (``generate_vanilla``);
- :func:`compute_skip_sdar_session`: SDAR (block diffusion): FOCUS block by block over the exact cache, over
  the whole prompt (vanilla; :func:`generate_compute_skip_sdar` runs it to the end) or over pdllm's
  block-causal prefix (``sdar.py``); DyLLM is refused (its caches assume full bidirectional
  attention over every local row).

These are the policies' reference loops (one request). The decode worker and the engine run both in the
batched rounds instead (``decode_service/dyllm_rounds.py``, ``sdar_focus_rounds.py``), equal to these loops
token for token.
"""

from __future__ import annotations

import torch

from pdllm.decode_service.block_diffusion import BlockKVCache
from pdllm.decode_service.policies.focus import ONLY_SDAR
from pdllm.shared.decode_policy import DecodePolicyConfig
from pdllm.shared.generation.sampler import GenerationConfig, GenerationResult
from pdllm.shared.model.attention import AttentionBackend, DenseAttention
from pdllm.shared.model.transformer import DiffusionLM
from tests.reference.block_diffusion import BlockDiffusionSession, run_to_end
from tests.reference.dyllm import DyLLMBase, DyLLMLogits
from tests.reference.focus import FocusBlockSession
from tests.reference.policy import run_policy, vanilla_local_rows

ComputeSkipLogits = DyLLMBase


def compute_skip_logits(
    model: DiffusionLM,
    local: torch.Tensor,
    positions: torch.Tensor,
    response_start: int,
    gen: GenerationConfig,
    config: DecodePolicyConfig,
    inner: AttentionBackend,
) -> ComputeSkipLogits:
    """The logits function of ``config``'s compute-skipping policy over the local rows (``PolicyLogits``'s
    contract: ``local`` [N] owned, ``positions`` [1, N], the response the last ``gen_length`` rows).
    """
    config.validate()
    if config.name == "dyllm":
        dyllm = config.dyllm_config()
        return DyLLMLogits(model, local, positions, response_start, gen, dyllm, inner)
    if config.name == "focus":
        raise ValueError(ONLY_SDAR)
    raise ValueError(f"decode policy {config.name!r} is not a compute-skipping policy (dyllm, focus)")


def vanilla_compute_skip_logits(
    model: DiffusionLM,
    prompt: torch.Tensor,
    gen: GenerationConfig,
    config: DecodePolicyConfig,
) -> ComputeSkipLogits:
    """The vanilla step under DyLLM: local rows prompt + response, dense attention over them."""
    local, positions = vanilla_local_rows(model.config.mask_token_id, prompt, gen)
    return compute_skip_logits(model, local, positions, prompt.numel(), gen, config, DenseAttention())


@torch.inference_mode()
def run_compute_skip(logits_fn: ComputeSkipLogits, progress: bool = False) -> GenerationResult:
    """The policy's loop to the end; the result's ``cache`` holds its name and counters."""
    return run_policy(logits_fn, progress)


def compute_skip_sdar_session(
    model: DiffusionLM,
    prompt: torch.Tensor,
    gen: GenerationConfig,
    config: DecodePolicyConfig,
    prefix: BlockKVCache | None = None,
) -> BlockDiffusionSession:
    """SDAR (block diffusion) under a compute-skipping policy, one denoising step per ``step()``: FOCUS over
    each block's window (:class:`~tests.reference.focus.FocusBlockSession`; ``prefix``: pdllm's block-causal
    cache of the selected chunks, ``sdar.py``); DyLLM is refused with a clear error."""
    config.validate()
    if config.name == "focus":
        return FocusBlockSession(model, prompt, gen, config.focus_config(), prefix=prefix)
    raise ValueError(
        f"decode policy {config.name!r} runs on Dream and LLaDA only, not on {model.config.family!r} "
        "(block diffusion): its caches assume full bidirectional attention over every row; use "
        "--decode-policy focus or none"
    )


def generate_compute_skip_sdar(
    model: DiffusionLM,
    prompt: torch.Tensor,
    gen: GenerationConfig,
    config: DecodePolicyConfig,
    progress: bool = False,
) -> GenerationResult:
    """Vanilla SDAR under a compute-skipping policy: :func:`compute_skip_sdar_session` to the end."""
    return run_to_end(compute_skip_sdar_session(model, prompt, gen, config), gen, progress)
