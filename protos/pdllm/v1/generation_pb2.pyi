from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class GenerationParams(_message.Message):
    __slots__ = ("gen_length", "steps", "block_length", "threshold", "temperature", "seed")
    GEN_LENGTH_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_LENGTH_FIELD_NUMBER: _ClassVar[int]
    THRESHOLD_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    gen_length: int
    steps: int
    block_length: int
    threshold: float
    temperature: float
    seed: int
    def __init__(self, gen_length: _Optional[int] = ..., steps: _Optional[int] = ..., block_length: _Optional[int] = ..., threshold: _Optional[float] = ..., temperature: _Optional[float] = ..., seed: _Optional[int] = ...) -> None: ...

class MethodParams(_message.Message):
    __slots__ = ("method", "chunk_size", "top_k", "top_b", "kv_mode", "score_mode", "pseudo_label_tokens", "pseudo_label_rounds", "retention_score", "query_window", "prefill_attention")
    METHOD_FIELD_NUMBER: _ClassVar[int]
    CHUNK_SIZE_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    TOP_B_FIELD_NUMBER: _ClassVar[int]
    KV_MODE_FIELD_NUMBER: _ClassVar[int]
    SCORE_MODE_FIELD_NUMBER: _ClassVar[int]
    PSEUDO_LABEL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PSEUDO_LABEL_ROUNDS_FIELD_NUMBER: _ClassVar[int]
    RETENTION_SCORE_FIELD_NUMBER: _ClassVar[int]
    QUERY_WINDOW_FIELD_NUMBER: _ClassVar[int]
    PREFILL_ATTENTION_FIELD_NUMBER: _ClassVar[int]
    method: str
    chunk_size: int
    top_k: int
    top_b: int
    kv_mode: str
    score_mode: str
    pseudo_label_tokens: int
    pseudo_label_rounds: int
    retention_score: str
    query_window: int
    prefill_attention: str
    def __init__(self, method: _Optional[str] = ..., chunk_size: _Optional[int] = ..., top_k: _Optional[int] = ..., top_b: _Optional[int] = ..., kv_mode: _Optional[str] = ..., score_mode: _Optional[str] = ..., pseudo_label_tokens: _Optional[int] = ..., pseudo_label_rounds: _Optional[int] = ..., retention_score: _Optional[str] = ..., query_window: _Optional[int] = ..., prefill_attention: _Optional[str] = ...) -> None: ...

class DecodePolicyParams(_message.Message):
    __slots__ = ("decode_policy", "cache_refresh_steps", "sparse_retention", "sparse_pool_kernel", "sparse_delay_steps", "polestar_clusters", "polestar_top_clusters", "polestar_update_threshold", "polestar_drift_threshold", "polestar_residual_format", "dyllm_threshold", "dyllm_full_steps", "dyllm_full_sequence_interval", "dyllm_approximate_attention", "focus_alpha", "focus_pool_kernel", "focus_budget", "focus_delayed_cache", "polestar_recompute")
    DECODE_POLICY_FIELD_NUMBER: _ClassVar[int]
    CACHE_REFRESH_STEPS_FIELD_NUMBER: _ClassVar[int]
    SPARSE_RETENTION_FIELD_NUMBER: _ClassVar[int]
    SPARSE_POOL_KERNEL_FIELD_NUMBER: _ClassVar[int]
    SPARSE_DELAY_STEPS_FIELD_NUMBER: _ClassVar[int]
    POLESTAR_CLUSTERS_FIELD_NUMBER: _ClassVar[int]
    POLESTAR_TOP_CLUSTERS_FIELD_NUMBER: _ClassVar[int]
    POLESTAR_UPDATE_THRESHOLD_FIELD_NUMBER: _ClassVar[int]
    POLESTAR_DRIFT_THRESHOLD_FIELD_NUMBER: _ClassVar[int]
    POLESTAR_RESIDUAL_FORMAT_FIELD_NUMBER: _ClassVar[int]
    DYLLM_THRESHOLD_FIELD_NUMBER: _ClassVar[int]
    DYLLM_FULL_STEPS_FIELD_NUMBER: _ClassVar[int]
    DYLLM_FULL_SEQUENCE_INTERVAL_FIELD_NUMBER: _ClassVar[int]
    DYLLM_APPROXIMATE_ATTENTION_FIELD_NUMBER: _ClassVar[int]
    FOCUS_ALPHA_FIELD_NUMBER: _ClassVar[int]
    FOCUS_POOL_KERNEL_FIELD_NUMBER: _ClassVar[int]
    FOCUS_BUDGET_FIELD_NUMBER: _ClassVar[int]
    FOCUS_DELAYED_CACHE_FIELD_NUMBER: _ClassVar[int]
    POLESTAR_RECOMPUTE_FIELD_NUMBER: _ClassVar[int]
    decode_policy: str
    cache_refresh_steps: int
    sparse_retention: float
    sparse_pool_kernel: int
    sparse_delay_steps: int
    polestar_clusters: int
    polestar_top_clusters: int
    polestar_update_threshold: int
    polestar_drift_threshold: float
    polestar_residual_format: str
    dyllm_threshold: float
    dyllm_full_steps: int
    dyllm_full_sequence_interval: int
    dyllm_approximate_attention: str
    focus_alpha: float
    focus_pool_kernel: int
    focus_budget: int
    focus_delayed_cache: str
    polestar_recompute: str
    def __init__(self, decode_policy: _Optional[str] = ..., cache_refresh_steps: _Optional[int] = ..., sparse_retention: _Optional[float] = ..., sparse_pool_kernel: _Optional[int] = ..., sparse_delay_steps: _Optional[int] = ..., polestar_clusters: _Optional[int] = ..., polestar_top_clusters: _Optional[int] = ..., polestar_update_threshold: _Optional[int] = ..., polestar_drift_threshold: _Optional[float] = ..., polestar_residual_format: _Optional[str] = ..., dyllm_threshold: _Optional[float] = ..., dyllm_full_steps: _Optional[int] = ..., dyllm_full_sequence_interval: _Optional[int] = ..., dyllm_approximate_attention: _Optional[str] = ..., focus_alpha: _Optional[float] = ..., focus_pool_kernel: _Optional[int] = ..., focus_budget: _Optional[int] = ..., focus_delayed_cache: _Optional[str] = ..., polestar_recompute: _Optional[str] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "model", "context", "question", "instruction", "generation", "method", "decode_policy")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_FIELD_NUMBER: _ClassVar[int]
    QUESTION_FIELD_NUMBER: _ClassVar[int]
    INSTRUCTION_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    METHOD_FIELD_NUMBER: _ClassVar[int]
    DECODE_POLICY_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    model: str
    context: str
    question: str
    instruction: str
    generation: GenerationParams
    method: MethodParams
    decode_policy: DecodePolicyParams
    def __init__(self, request_id: _Optional[str] = ..., model: _Optional[str] = ..., context: _Optional[str] = ..., question: _Optional[str] = ..., instruction: _Optional[str] = ..., generation: _Optional[_Union[GenerationParams, _Mapping]] = ..., method: _Optional[_Union[MethodParams, _Mapping]] = ..., decode_policy: _Optional[_Union[DecodePolicyParams, _Mapping]] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("request_id", "model", "text", "token_ids", "finish_reason", "trace")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    TRACE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    model: str
    text: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    finish_reason: str
    trace: Trace
    def __init__(self, request_id: _Optional[str] = ..., model: _Optional[str] = ..., text: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., finish_reason: _Optional[str] = ..., trace: _Optional[_Union[Trace, _Mapping]] = ...) -> None: ...

class GenerateStreamResponse(_message.Message):
    __slots__ = ("partial", "final")
    PARTIAL_FIELD_NUMBER: _ClassVar[int]
    FINAL_FIELD_NUMBER: _ClassVar[int]
    partial: PartialOutput
    final: GenerateResponse
    def __init__(self, partial: _Optional[_Union[PartialOutput, _Mapping]] = ..., final: _Optional[_Union[GenerateResponse, _Mapping]] = ...) -> None: ...

class PartialOutput(_message.Message):
    __slots__ = ("request_id", "step", "total_steps", "block_index", "token_ids", "unmasked", "text")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    TOTAL_STEPS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_INDEX_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    UNMASKED_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    step: int
    total_steps: int
    block_index: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    unmasked: int
    text: str
    def __init__(self, request_id: _Optional[str] = ..., step: _Optional[int] = ..., total_steps: _Optional[int] = ..., block_index: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., unmasked: _Optional[int] = ..., text: _Optional[str] = ...) -> None: ...

class ChunkScore(_message.Message):
    __slots__ = ("chunk_id", "self_information", "pseudo_label", "total", "selected", "num_tokens", "kept_tokens")
    CHUNK_ID_FIELD_NUMBER: _ClassVar[int]
    SELF_INFORMATION_FIELD_NUMBER: _ClassVar[int]
    PSEUDO_LABEL_FIELD_NUMBER: _ClassVar[int]
    TOTAL_FIELD_NUMBER: _ClassVar[int]
    SELECTED_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KEPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    chunk_id: int
    self_information: float
    pseudo_label: float
    total: float
    selected: bool
    num_tokens: int
    kept_tokens: int
    def __init__(self, chunk_id: _Optional[int] = ..., self_information: _Optional[float] = ..., pseudo_label: _Optional[float] = ..., total: _Optional[float] = ..., selected: _Optional[bool] = ..., num_tokens: _Optional[int] = ..., kept_tokens: _Optional[int] = ...) -> None: ...

class PhaseTimings(_message.Message):
    __slots__ = ("queue_s", "prefill_s", "score_s", "select_s", "build_s", "decode_s", "ttft_s", "total_s", "handoff_s")
    QUEUE_S_FIELD_NUMBER: _ClassVar[int]
    PREFILL_S_FIELD_NUMBER: _ClassVar[int]
    SCORE_S_FIELD_NUMBER: _ClassVar[int]
    SELECT_S_FIELD_NUMBER: _ClassVar[int]
    BUILD_S_FIELD_NUMBER: _ClassVar[int]
    DECODE_S_FIELD_NUMBER: _ClassVar[int]
    TTFT_S_FIELD_NUMBER: _ClassVar[int]
    TOTAL_S_FIELD_NUMBER: _ClassVar[int]
    HANDOFF_S_FIELD_NUMBER: _ClassVar[int]
    queue_s: float
    prefill_s: float
    score_s: float
    select_s: float
    build_s: float
    decode_s: float
    ttft_s: float
    total_s: float
    handoff_s: float
    def __init__(self, queue_s: _Optional[float] = ..., prefill_s: _Optional[float] = ..., score_s: _Optional[float] = ..., select_s: _Optional[float] = ..., build_s: _Optional[float] = ..., decode_s: _Optional[float] = ..., ttft_s: _Optional[float] = ..., total_s: _Optional[float] = ..., handoff_s: _Optional[float] = ...) -> None: ...

class DecodePolicyTrace(_message.Message):
    __slots__ = ("policy", "forwards", "refreshes", "rows_forwarded", "cache_bytes", "updates", "rows_recomputed", "counters")
    class CountersEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    POLICY_FIELD_NUMBER: _ClassVar[int]
    FORWARDS_FIELD_NUMBER: _ClassVar[int]
    REFRESHES_FIELD_NUMBER: _ClassVar[int]
    ROWS_FORWARDED_FIELD_NUMBER: _ClassVar[int]
    CACHE_BYTES_FIELD_NUMBER: _ClassVar[int]
    UPDATES_FIELD_NUMBER: _ClassVar[int]
    ROWS_RECOMPUTED_FIELD_NUMBER: _ClassVar[int]
    COUNTERS_FIELD_NUMBER: _ClassVar[int]
    policy: str
    forwards: int
    refreshes: int
    rows_forwarded: int
    cache_bytes: int
    updates: int
    rows_recomputed: int
    counters: _containers.ScalarMap[str, int]
    def __init__(self, policy: _Optional[str] = ..., forwards: _Optional[int] = ..., refreshes: _Optional[int] = ..., rows_forwarded: _Optional[int] = ..., cache_bytes: _Optional[int] = ..., updates: _Optional[int] = ..., rows_recomputed: _Optional[int] = ..., counters: _Optional[_Mapping[str, int]] = ...) -> None: ...

class Trace(_message.Message):
    __slots__ = ("method", "kv_mode", "score_mode", "prompt_tokens", "context_tokens", "num_chunks", "selected_chunk_ids", "chunk_scores", "kept_tokens", "timings", "peak_memory_bytes", "cache_hits", "cache_misses", "steps", "prefill_worker", "decode_worker", "memory_kind", "prefill_skipped", "selected_kept_tokens", "kv_source", "decode_policy")
    METHOD_FIELD_NUMBER: _ClassVar[int]
    KV_MODE_FIELD_NUMBER: _ClassVar[int]
    SCORE_MODE_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_CHUNKS_FIELD_NUMBER: _ClassVar[int]
    SELECTED_CHUNK_IDS_FIELD_NUMBER: _ClassVar[int]
    CHUNK_SCORES_FIELD_NUMBER: _ClassVar[int]
    KEPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    PEAK_MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    CACHE_HITS_FIELD_NUMBER: _ClassVar[int]
    CACHE_MISSES_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_WORKER_FIELD_NUMBER: _ClassVar[int]
    DECODE_WORKER_FIELD_NUMBER: _ClassVar[int]
    MEMORY_KIND_FIELD_NUMBER: _ClassVar[int]
    PREFILL_SKIPPED_FIELD_NUMBER: _ClassVar[int]
    SELECTED_KEPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KV_SOURCE_FIELD_NUMBER: _ClassVar[int]
    DECODE_POLICY_FIELD_NUMBER: _ClassVar[int]
    method: str
    kv_mode: str
    score_mode: str
    prompt_tokens: int
    context_tokens: int
    num_chunks: int
    selected_chunk_ids: _containers.RepeatedScalarFieldContainer[int]
    chunk_scores: _containers.RepeatedCompositeFieldContainer[ChunkScore]
    kept_tokens: int
    timings: PhaseTimings
    peak_memory_bytes: int
    cache_hits: int
    cache_misses: int
    steps: int
    prefill_worker: str
    decode_worker: str
    memory_kind: str
    prefill_skipped: bool
    selected_kept_tokens: _containers.RepeatedScalarFieldContainer[int]
    kv_source: str
    decode_policy: DecodePolicyTrace
    def __init__(self, method: _Optional[str] = ..., kv_mode: _Optional[str] = ..., score_mode: _Optional[str] = ..., prompt_tokens: _Optional[int] = ..., context_tokens: _Optional[int] = ..., num_chunks: _Optional[int] = ..., selected_chunk_ids: _Optional[_Iterable[int]] = ..., chunk_scores: _Optional[_Iterable[_Union[ChunkScore, _Mapping]]] = ..., kept_tokens: _Optional[int] = ..., timings: _Optional[_Union[PhaseTimings, _Mapping]] = ..., peak_memory_bytes: _Optional[int] = ..., cache_hits: _Optional[int] = ..., cache_misses: _Optional[int] = ..., steps: _Optional[int] = ..., prefill_worker: _Optional[str] = ..., decode_worker: _Optional[str] = ..., memory_kind: _Optional[str] = ..., prefill_skipped: _Optional[bool] = ..., selected_kept_tokens: _Optional[_Iterable[int]] = ..., kv_source: _Optional[str] = ..., decode_policy: _Optional[_Union[DecodePolicyTrace, _Mapping]] = ...) -> None: ...
