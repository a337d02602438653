"""Bad-input cases shared by the validation unit tests and the over-the-wire tests.

Each case is (kind, edit, phrase): `edit` breaks one thing in an otherwise valid request, `kind` is the
InvalidRequestError.kind the validator must report and `phrase` must appear in the message.
"""

from __future__ import annotations

from collections.abc import Callable

from pdllm.protos.pdllm.v1 import generation_pb2 as pb
from tests.rpc.fake_generation import MODEL

Edit = Callable[[pb.GenerateRequest], None]


def valid_request() -> pb.GenerateRequest:
    return pb.GenerateRequest(
        request_id="req-1",
        model=MODEL,
        context="The access code of Mira Halden is 4711. " * 20,
        question="What is the access code of Mira Halden?",
        generation=pb.GenerationParams(gen_length=32, steps=16, block_length=8),
        method=pb.MethodParams(method="pdllm", chunk_size=64, top_k=2),
    )


def _set(path: str, value: object) -> Edit:
    def edit(req: pb.GenerateRequest) -> None:
        target = req
        *parents, leaf = path.split(".")
        for name in parents:
            target = getattr(target, name)
        setattr(target, leaf, value)

    return edit


def _both(*edits: Edit) -> Edit:
    def edit(req: pb.GenerateRequest) -> None:
        for e in edits:
            e(req)

    return edit


SPARSE = _set("decode_policy.decode_policy", "sparse-dllm")

BAD_INPUTS: list[tuple[str, Edit, str]] = [
    ("empty_context", _set("context", ""), "context must not be empty"),
    ("empty_context", _set("context", " \n\t "), "context must not be empty"),
    ("empty_question", _set("question", ""), "question must not be empty"),
    # only zero-width space / non-joiner / joiner, word joiner, BOM: nothing visible
    ("empty_question", _set("question", "\u200b\u200c\u200d\u2060\ufeff"), "question must not be empty"),
    ("empty_context", _set("context", " \u200b\n\ufeff "), "context must not be empty"),
    ("prompt_too_large", _set("context", "x" * 70_000), "limit is 65536"),
    ("nul_character", _set("question", "what\x00is"), "NUL"),
    ("request_id_too_long", _set("request_id", "r" * 129), "at most 128"),
    ("request_id_chars", _set("request_id", "bad id!"), "request_id may only contain"),
    ("unknown_model", _set("model", "gpt-17"), "'gpt-17' is not served here"),
    ("gen_length_nonpositive", _set("generation.gen_length", 0), "gen_length must be in [1, 4096] (got 0)"),
    ("gen_length_nonpositive", _set("generation.gen_length", -8), "gen_length must be in [1, 4096]"),
    ("gen_length_too_large", _set("generation.gen_length", 1 << 20), "gen_length must be in [1, 4096]"),
    ("block_length_nonpositive", _set("generation.block_length", 0), "block_length must be > 0"),
    ("block_not_divisor", _set("generation.block_length", 12), "divisible by generation.block_length (12)"),
    ("steps_nonpositive", _set("generation.steps", -1), "generation.steps must be in [1, 32]"),
    ("steps_too_many", _set("generation.steps", 64), "in [1, 32], at most generation.gen_length (got 64)"),
    ("steps_not_multiple_of_blocks", _set("generation.steps", 6), "multiple of the number of blocks (4"),
    ("threshold_range", _set("generation.threshold", 0.0), "threshold must be in (0, 1]"),
    ("threshold_range", _set("generation.threshold", 1.5), "threshold must be in (0, 1]"),
    ("threshold_range", _set("generation.threshold", float("nan")), "threshold must be in (0, 1]"),
    (
        "temperature_range",
        _set("generation.temperature", -0.1),
        "temperature must be 0 (greedy) or in [0.0001, 10000]",
    ),
    (
        "temperature_range",
        _set("generation.temperature", float("inf")),
        "temperature must be 0 (greedy) or in",
    ),
    # finite but extreme: logits / temperature would leave float32 (these reached the device as INTERNAL)
    ("temperature_range", _set("generation.temperature", 1e308), "temperature must be 0 (greedy) or in"),
    ("temperature_range", _set("generation.temperature", 3.5e38), "temperature must be 0 (greedy) or in"),
    ("temperature_range", _set("generation.temperature", 5e-324), "temperature must be 0 (greedy) or in"),
    ("seed_negative", _set("generation.seed", -3), "seed must be >= 0"),
    (
        "unknown_method",
        _set("method.method", "beam"),
        "method.method must be one of vanilla, pdllm (got 'beam')",
    ),
    ("unknown_kv_mode", _set("method.kv_mode", "half-mask"), "must be one of full-mask, chunk-query"),
    ("unknown_score_mode", _set("method.score_mode", "bm25"), "method.score_mode must be one of"),
    ("unknown_retention_score", _set("method.retention_score", "random"), "method.retention_score"),
    ("top_k_range", _set("method.top_k", 0), "method.top_k must be in [1, 1024]"),
    ("chunk_size_range", _set("method.chunk_size", 4), "method.chunk_size must be in [16, 16384]"),
    ("chunk_size_range", _set("method.chunk_size", 1 << 20), "method.chunk_size must be in [16, 16384]"),
    ("top_b_range", _set("method.top_b", 66), "method.top_b must be in [1, 65]"),
    ("top_b_range", _set("method.top_b", 0), "method.top_b must be in [1, 65]"),
    ("pseudo_label_tokens_range", _set("method.pseudo_label_tokens", 65), "pseudo_label_tokens must be in"),
    (
        "pseudo_label_tokens_range",
        _set("method.pseudo_label_tokens", 0),
        "pseudo_label_tokens must be in [1, 64]",
    ),
    (
        "pseudo_label_rounds_range",
        _set("method.pseudo_label_rounds", 0),
        "pseudo_label_rounds must be in [1, 4]",
    ),
    (
        "pseudo_label_rounds_range",
        _set("method.pseudo_label_rounds", 5),
        "pseudo_label_rounds must be in [1, 4]",
    ),
    ("query_window_range", _set("method.query_window", 0), "method.query_window must be in [1, 4096]"),
    (
        "unknown_prefill_attention",
        _set("method.prefill_attention", "sparse"),
        "must be one of causal, bidirec",
    ),
    # Decode policies: a policy that does not exist, knobs out
    # of range, a knob the policy does not have, an even pooling kernel.
    (
        "unknown_decode_policy",
        _set("decode_policy.decode_policy", "lru-cache"),
        "decode_policy.decode_policy must be one of none, prefix-cache, dual-cache, sparse-dllm, polestar, dyllm, focus (got 'lru-cache')",
    ),
    (
        "sparse_retention_range",
        _both(SPARSE, _set("decode_policy.sparse_retention", 0.0)),
        "decode_policy.sparse_retention must be in (0, 1] (got 0.0)",
    ),
    (
        "sparse_retention_range",
        _both(SPARSE, _set("decode_policy.sparse_retention", 1.5)),
        "decode_policy.sparse_retention must be in (0, 1] (got 1.5)",
    ),
    (
        "sparse_retention_range",
        _both(SPARSE, _set("decode_policy.sparse_retention", float("nan"))),
        "decode_policy.sparse_retention must be in (0, 1]",
    ),
    (
        "sparse_pool_kernel_range",
        _both(SPARSE, _set("decode_policy.sparse_pool_kernel", 0)),
        "decode_policy.sparse_pool_kernel must be in [1, 255] (got 0)",
    ),
    (
        "sparse_pool_kernel_even",
        _both(SPARSE, _set("decode_policy.sparse_pool_kernel", 4)),
        "decode_policy.sparse_pool_kernel must be odd (got 4)",
    ),
    (
        "sparse_delay_steps_range",
        _both(SPARSE, _set("decode_policy.sparse_delay_steps", -1)),
        "decode_policy.sparse_delay_steps must be in [0, 4096] (got -1)",
    ),
    (
        "cache_refresh_steps_range",
        _both(
            _set("decode_policy.decode_policy", "dual-cache"), _set("decode_policy.cache_refresh_steps", 0)
        ),
        "decode_policy.cache_refresh_steps must be in [1, 4096] (got 0)",
    ),
    (
        "sparse_retention_without_sparse_dllm",
        _both(_set("decode_policy.decode_policy", "dual-cache"), _set("decode_policy.sparse_retention", 0.5)),
        "decode_policy.sparse_retention needs decode_policy.decode_policy sparse-dllm, not dual-cache",
    ),
    (
        "sparse_pool_kernel_without_sparse_dllm",
        _set("decode_policy.sparse_pool_kernel", 3),  # no policy named: the server's default, none
        "decode_policy.sparse_pool_kernel needs decode_policy.decode_policy sparse-dllm, not none",
    ),
    (
        "dyllm_threshold_range",
        _both(_set("decode_policy.decode_policy", "dyllm"), _set("decode_policy.dyllm_threshold", 1.5)),
        "decode_policy.dyllm_threshold must be in (0, 1] (got 1.5)",
    ),
    (
        "focus_pool_kernel_even",
        _both(_set("decode_policy.decode_policy", "focus"), _set("decode_policy.focus_pool_kernel", 4)),
        "decode_policy.focus_pool_kernel must be odd (got 4)",
    ),
    (
        "focus_budget_without_focus",
        _both(_set("decode_policy.decode_policy", "dyllm"), _set("decode_policy.focus_budget", 4)),
        "decode_policy.focus_budget needs decode_policy.decode_policy focus, not dyllm",
    ),
    (
        "dyllm_approximate_attention_without_dyllm",
        _set("decode_policy.dyllm_approximate_attention", "off"),
        "decode_policy.dyllm_approximate_attention needs decode_policy.decode_policy dyllm, not none",
    ),
    (
        "cache_refresh_steps_without_policy",
        _set("decode_policy.cache_refresh_steps", 2),
        "decode_policy.cache_refresh_steps needs a caching decode_policy.decode_policy",
    ),
]
