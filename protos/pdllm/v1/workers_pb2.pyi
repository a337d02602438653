from . import generation_pb2 as _generation_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class KvSpec(_message.Message):
    __slots__ = ("model_id", "dtype", "num_layers", "num_kv_heads", "head_dim", "position_scheme", "chunk_size")
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    POSITION_SCHEME_FIELD_NUMBER: _ClassVar[int]
    CHUNK_SIZE_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    dtype: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    position_scheme: str
    chunk_size: int
    def __init__(self, model_id: _Optional[str] = ..., dtype: _Optional[str] = ..., num_layers: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., position_scheme: _Optional[str] = ..., chunk_size: _Optional[int] = ...) -> None: ...

class KvHandoff(_message.Message):
    __slots__ = ("transfer_id", "sender", "backend", "payload", "shape", "dtype", "nbytes", "segment_lens", "instruction_len", "kv_spec", "query_start", "host_id")
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    SENDER_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    SEGMENT_LENS_FIELD_NUMBER: _ClassVar[int]
    INSTRUCTION_LEN_FIELD_NUMBER: _ClassVar[int]
    KV_SPEC_FIELD_NUMBER: _ClassVar[int]
    QUERY_START_FIELD_NUMBER: _ClassVar[int]
    HOST_ID_FIELD_NUMBER: _ClassVar[int]
    transfer_id: str
    sender: str
    backend: str
    payload: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    dtype: str
    nbytes: int
    segment_lens: _containers.RepeatedScalarFieldContainer[int]
    instruction_len: int
    kv_spec: KvSpec
    query_start: int
    host_id: str
    def __init__(self, transfer_id: _Optional[str] = ..., sender: _Optional[str] = ..., backend: _Optional[str] = ..., payload: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., dtype: _Optional[str] = ..., nbytes: _Optional[int] = ..., segment_lens: _Optional[_Iterable[int]] = ..., instruction_len: _Optional[int] = ..., kv_spec: _Optional[_Union[KvSpec, _Mapping]] = ..., query_start: _Optional[int] = ..., host_id: _Optional[str] = ...) -> None: ...

class KvConnectRequest(_message.Message):
    __slots__ = ("receiver_id",)
    RECEIVER_ID_FIELD_NUMBER: _ClassVar[int]
    receiver_id: str
    def __init__(self, receiver_id: _Optional[str] = ...) -> None: ...

class KvConnectResponse(_message.Message):
    __slots__ = ("store_port", "epoch", "backend")
    STORE_PORT_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    store_port: int
    epoch: int
    backend: str
    def __init__(self, store_port: _Optional[int] = ..., epoch: _Optional[int] = ..., backend: _Optional[str] = ...) -> None: ...

class KvSendRequest(_message.Message):
    __slots__ = ("transfer_id", "receiver_id", "epoch", "cuda_ipc")
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    RECEIVER_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    CUDA_IPC_FIELD_NUMBER: _ClassVar[int]
    transfer_id: str
    receiver_id: str
    epoch: int
    cuda_ipc: bool
    def __init__(self, transfer_id: _Optional[str] = ..., receiver_id: _Optional[str] = ..., epoch: _Optional[int] = ..., cuda_ipc: _Optional[bool] = ...) -> None: ...

class CudaIpcHandle(_message.Message):
    __slots__ = ("handle", "storage_bytes", "storage_offset_bytes", "ref_counter_handle", "ref_counter_offset", "event_handle", "event_sync_required", "tensor_offset")
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    STORAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    STORAGE_OFFSET_BYTES_FIELD_NUMBER: _ClassVar[int]
    REF_COUNTER_HANDLE_FIELD_NUMBER: _ClassVar[int]
    REF_COUNTER_OFFSET_FIELD_NUMBER: _ClassVar[int]
    EVENT_HANDLE_FIELD_NUMBER: _ClassVar[int]
    EVENT_SYNC_REQUIRED_FIELD_NUMBER: _ClassVar[int]
    TENSOR_OFFSET_FIELD_NUMBER: _ClassVar[int]
    handle: bytes
    storage_bytes: int
    storage_offset_bytes: int
    ref_counter_handle: bytes
    ref_counter_offset: int
    event_handle: bytes
    event_sync_required: bool
    tensor_offset: int
    def __init__(self, handle: _Optional[bytes] = ..., storage_bytes: _Optional[int] = ..., storage_offset_bytes: _Optional[int] = ..., ref_counter_handle: _Optional[bytes] = ..., ref_counter_offset: _Optional[int] = ..., event_handle: _Optional[bytes] = ..., event_sync_required: _Optional[bool] = ..., tensor_offset: _Optional[int] = ...) -> None: ...

class KvSendResponse(_message.Message):
    __slots__ = ("cuda_ipc",)
    CUDA_IPC_FIELD_NUMBER: _ClassVar[int]
    cuda_ipc: CudaIpcHandle
    def __init__(self, cuda_ipc: _Optional[_Union[CudaIpcHandle, _Mapping]] = ...) -> None: ...

class KvReleaseRequest(_message.Message):
    __slots__ = ("transfer_id",)
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    transfer_id: str
    def __init__(self, transfer_id: _Optional[str] = ...) -> None: ...

class KvReleaseResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ChunkHandle(_message.Message):
    __slots__ = ("key", "chunk_id", "token_ids", "positions")
    KEY_FIELD_NUMBER: _ClassVar[int]
    CHUNK_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    POSITIONS_FIELD_NUMBER: _ClassVar[int]
    key: str
    chunk_id: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    positions: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, key: _Optional[str] = ..., chunk_id: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., positions: _Optional[_Iterable[int]] = ...) -> None: ...

class PrefillRequest(_message.Message):
    __slots__ = ("request_id", "instruction_ids", "context_ids", "question_ids", "method", "generation", "offer_handoff")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    INSTRUCTION_IDS_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_IDS_FIELD_NUMBER: _ClassVar[int]
    QUESTION_IDS_FIELD_NUMBER: _ClassVar[int]
    METHOD_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    OFFER_HANDOFF_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    instruction_ids: _containers.RepeatedScalarFieldContainer[int]
    context_ids: _containers.RepeatedScalarFieldContainer[int]
    question_ids: _containers.RepeatedScalarFieldContainer[int]
    method: _generation_pb2.MethodParams
    generation: _generation_pb2.GenerationParams
    offer_handoff: bool
    def __init__(self, request_id: _Optional[str] = ..., instruction_ids: _Optional[_Iterable[int]] = ..., context_ids: _Optional[_Iterable[int]] = ..., question_ids: _Optional[_Iterable[int]] = ..., method: _Optional[_Union[_generation_pb2.MethodParams, _Mapping]] = ..., generation: _Optional[_Union[_generation_pb2.GenerationParams, _Mapping]] = ..., offer_handoff: _Optional[bool] = ...) -> None: ...

class PrefillResponse(_message.Message):
    __slots__ = ("kv_spec", "selected", "chunk_scores", "timings", "cache_hits", "cache_misses", "peak_memory_bytes", "memory_kind", "handoff")
    KV_SPEC_FIELD_NUMBER: _ClassVar[int]
    SELECTED_FIELD_NUMBER: _ClassVar[int]
    CHUNK_SCORES_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    CACHE_HITS_FIELD_NUMBER: _ClassVar[int]
    CACHE_MISSES_FIELD_NUMBER: _ClassVar[int]
    PEAK_MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    MEMORY_KIND_FIELD_NUMBER: _ClassVar[int]
    HANDOFF_FIELD_NUMBER: _ClassVar[int]
    kv_spec: KvSpec
    selected: _containers.RepeatedCompositeFieldContainer[ChunkHandle]
    chunk_scores: _containers.RepeatedCompositeFieldContainer[_generation_pb2.ChunkScore]
    timings: _generation_pb2.PhaseTimings
    cache_hits: int
    cache_misses: int
    peak_memory_bytes: int
    memory_kind: str
    handoff: KvHandoff
    def __init__(self, kv_spec: _Optional[_Union[KvSpec, _Mapping]] = ..., selected: _Optional[_Iterable[_Union[ChunkHandle, _Mapping]]] = ..., chunk_scores: _Optional[_Iterable[_Union[_generation_pb2.ChunkScore, _Mapping]]] = ..., timings: _Optional[_Union[_generation_pb2.PhaseTimings, _Mapping]] = ..., cache_hits: _Optional[int] = ..., cache_misses: _Optional[int] = ..., peak_memory_bytes: _Optional[int] = ..., memory_kind: _Optional[str] = ..., handoff: _Optional[_Union[KvHandoff, _Mapping]] = ...) -> None: ...

class DecodeRequest(_message.Message):
    __slots__ = ("request_id", "kv_spec", "chunks", "instruction_ids", "question_ids", "generation", "method", "stream_partials", "context_ids", "handoff", "decode_policy")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    KV_SPEC_FIELD_NUMBER: _ClassVar[int]
    CHUNKS_FIELD_NUMBER: _ClassVar[int]
    INSTRUCTION_IDS_FIELD_NUMBER: _ClassVar[int]
    QUESTION_IDS_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    METHOD_FIELD_NUMBER: _ClassVar[int]
    STREAM_PARTIALS_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_IDS_FIELD_NUMBER: _ClassVar[int]
    HANDOFF_FIELD_NUMBER: _ClassVar[int]
    DECODE_POLICY_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    kv_spec: KvSpec
    chunks: _containers.RepeatedCompositeFieldContainer[ChunkHandle]
    instruction_ids: _containers.RepeatedScalarFieldContainer[int]
    question_ids: _containers.RepeatedScalarFieldContainer[int]
    generation: _generation_pb2.GenerationParams
    method: _generation_pb2.MethodParams
    stream_partials: bool
    context_ids: _containers.RepeatedScalarFieldContainer[int]
    handoff: KvHandoff
    decode_policy: _generation_pb2.DecodePolicyParams
    def __init__(self, request_id: _Optional[str] = ..., kv_spec: _Optional[_Union[KvSpec, _Mapping]] = ..., chunks: _Optional[_Iterable[_Union[ChunkHandle, _Mapping]]] = ..., instruction_ids: _Optional[_Iterable[int]] = ..., question_ids: _Optional[_Iterable[int]] = ..., generation: _Optional[_Union[_generation_pb2.GenerationParams, _Mapping]] = ..., method: _Optional[_Union[_generation_pb2.MethodParams, _Mapping]] = ..., stream_partials: _Optional[bool] = ..., context_ids: _Optional[_Iterable[int]] = ..., handoff: _Optional[_Union[KvHandoff, _Mapping]] = ..., decode_policy: _Optional[_Union[_generation_pb2.DecodePolicyParams, _Mapping]] = ...) -> None: ...

class DecodeResult(_message.Message):
    __slots__ = ("token_ids", "finish_reason", "steps", "timings", "cache_hits", "cache_misses", "peak_memory_bytes", "memory_kind", "kv_source", "handoff_s", "decode_policy")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    CACHE_HITS_FIELD_NUMBER: _ClassVar[int]
    CACHE_MISSES_FIELD_NUMBER: _ClassVar[int]
    PEAK_MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    MEMORY_KIND_FIELD_NUMBER: _ClassVar[int]
    KV_SOURCE_FIELD_NUMBER: _ClassVar[int]
    HANDOFF_S_FIELD_NUMBER: _ClassVar[int]
    DECODE_POLICY_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    finish_reason: str
    steps: int
    timings: _generation_pb2.PhaseTimings
    cache_hits: int
    cache_misses: int
    peak_memory_bytes: int
    memory_kind: str
    kv_source: str
    handoff_s: float
    decode_policy: _generation_pb2.DecodePolicyTrace
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., finish_reason: _Optional[str] = ..., steps: _Optional[int] = ..., timings: _Optional[_Union[_generation_pb2.PhaseTimings, _Mapping]] = ..., cache_hits: _Optional[int] = ..., cache_misses: _Optional[int] = ..., peak_memory_bytes: _Optional[int] = ..., memory_kind: _Optional[str] = ..., kv_source: _Optional[str] = ..., handoff_s: _Optional[float] = ..., decode_policy: _Optional[_Union[_generation_pb2.DecodePolicyTrace, _Mapping]] = ...) -> None: ...

class DecodeResponse(_message.Message):
    __slots__ = ("partial", "final")
    PARTIAL_FIELD_NUMBER: _ClassVar[int]
    FINAL_FIELD_NUMBER: _ClassVar[int]
    partial: _generation_pb2.PartialOutput
    final: DecodeResult
    def __init__(self, partial: _Optional[_Union[_generation_pb2.PartialOutput, _Mapping]] = ..., final: _Optional[_Union[DecodeResult, _Mapping]] = ...) -> None: ...
