from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Iterable as _Iterable, Mapping as _Mapping, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor
DTYPE_BF16: DType
DTYPE_FP16: DType
DTYPE_FP32: DType
DTYPE_UNSPECIFIED: DType

class Error(_message.Message):
    __slots__ = ["code", "message"]
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    code: int
    message: str
    def __init__(self, code: _Optional[int] = ..., message: _Optional[str] = ...) -> None: ...

class GetModelInfoRequest(_message.Message):
    __slots__ = []
    def __init__(self) -> None: ...

class LogprobOptions(_message.Message):
    __slots__ = ["row_logsumexp", "sampled_logprob", "sampled_rank", "space", "top_logprobs"]
    class Space(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = []
    PROCESSED: LogprobOptions.Space
    RAW: LogprobOptions.Space
    ROW_LOGSUMEXP_FIELD_NUMBER: _ClassVar[int]
    SAMPLED_LOGPROB_FIELD_NUMBER: _ClassVar[int]
    SAMPLED_RANK_FIELD_NUMBER: _ClassVar[int]
    SPACE_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    row_logsumexp: bool
    sampled_logprob: bool
    sampled_rank: bool
    space: LogprobOptions.Space
    top_logprobs: int
    def __init__(self, sampled_logprob: bool = ..., row_logsumexp: bool = ..., top_logprobs: _Optional[int] = ..., space: _Optional[_Union[LogprobOptions.Space, str]] = ..., sampled_rank: bool = ...) -> None: ...

class ModelInfo(_message.Message):
    __slots__ = ["backend", "git_revision", "hidden_size", "max_batch_rows", "max_shared_memory_regions", "shards", "supported_features", "tp_degree", "version", "vocab_size", "weight_dtype", "weights_sha256", "weights_source", "weights_tensor"]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    GIT_REVISION_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCH_ROWS_FIELD_NUMBER: _ClassVar[int]
    MAX_SHARED_MEMORY_REGIONS_FIELD_NUMBER: _ClassVar[int]
    SHARDS_FIELD_NUMBER: _ClassVar[int]
    SUPPORTED_FEATURES_FIELD_NUMBER: _ClassVar[int]
    TP_DEGREE_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_SHA256_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_SOURCE_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_TENSOR_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_DTYPE_FIELD_NUMBER: _ClassVar[int]
    backend: str
    git_revision: str
    hidden_size: int
    max_batch_rows: int
    max_shared_memory_regions: int
    shards: _containers.RepeatedCompositeFieldContainer[ShardRange]
    supported_features: _containers.RepeatedScalarFieldContainer[str]
    tp_degree: int
    version: str
    vocab_size: int
    weight_dtype: DType
    weights_sha256: str
    weights_source: str
    weights_tensor: str
    def __init__(self, vocab_size: _Optional[int] = ..., hidden_size: _Optional[int] = ..., weight_dtype: _Optional[_Union[DType, str]] = ..., backend: _Optional[str] = ..., tp_degree: _Optional[int] = ..., shards: _Optional[_Iterable[_Union[ShardRange, _Mapping]]] = ..., max_batch_rows: _Optional[int] = ..., version: _Optional[str] = ..., weights_source: _Optional[str] = ..., supported_features: _Optional[_Iterable[str]] = ..., weights_tensor: _Optional[str] = ..., weights_sha256: _Optional[str] = ..., git_revision: _Optional[str] = ..., max_shared_memory_regions: _Optional[int] = ...) -> None: ...

class RegisterSharedMemoryRequest(_message.Message):
    __slots__ = ["byte_size", "key", "name"]
    BYTE_SIZE_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    byte_size: int
    key: str
    name: str
    def __init__(self, name: _Optional[str] = ..., key: _Optional[str] = ..., byte_size: _Optional[int] = ...) -> None: ...

class RegisterSharedMemoryResponse(_message.Message):
    __slots__ = []
    def __init__(self) -> None: ...

class SampleRequest(_message.Message):
    __slots__ = ["hidden_states", "params", "request_id", "row_params", "seeds", "steps"]
    HIDDEN_STATES_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    ROW_PARAMS_FIELD_NUMBER: _ClassVar[int]
    SEEDS_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    hidden_states: Tensor
    params: SamplingParams
    request_id: str
    row_params: _containers.RepeatedCompositeFieldContainer[SamplingParams]
    seeds: _containers.RepeatedScalarFieldContainer[int]
    steps: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, request_id: _Optional[str] = ..., hidden_states: _Optional[_Union[Tensor, _Mapping]] = ..., params: _Optional[_Union[SamplingParams, _Mapping]] = ..., row_params: _Optional[_Iterable[_Union[SamplingParams, _Mapping]]] = ..., seeds: _Optional[_Iterable[int]] = ..., steps: _Optional[_Iterable[int]] = ...) -> None: ...

class SampleResponse(_message.Message):
    __slots__ = ["error", "n", "request_id", "row_logsumexp", "sampled_logprobs", "sampled_ranks", "seeds", "timing", "token_ids", "top_logprobs"]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    N_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    ROW_LOGSUMEXP_FIELD_NUMBER: _ClassVar[int]
    SAMPLED_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    SAMPLED_RANKS_FIELD_NUMBER: _ClassVar[int]
    SEEDS_FIELD_NUMBER: _ClassVar[int]
    TIMING_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    error: Error
    n: int
    request_id: str
    row_logsumexp: _containers.RepeatedScalarFieldContainer[float]
    sampled_logprobs: _containers.RepeatedScalarFieldContainer[float]
    sampled_ranks: _containers.RepeatedScalarFieldContainer[int]
    seeds: _containers.RepeatedScalarFieldContainer[int]
    timing: Timing
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    top_logprobs: _containers.RepeatedCompositeFieldContainer[TopLogprobs]
    def __init__(self, request_id: _Optional[str] = ..., n: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., seeds: _Optional[_Iterable[int]] = ..., sampled_logprobs: _Optional[_Iterable[float]] = ..., row_logsumexp: _Optional[_Iterable[float]] = ..., top_logprobs: _Optional[_Iterable[_Union[TopLogprobs, _Mapping]]] = ..., timing: _Optional[_Union[Timing, _Mapping]] = ..., error: _Optional[_Union[Error, _Mapping]] = ..., sampled_ranks: _Optional[_Iterable[int]] = ...) -> None: ...

class SamplingParams(_message.Message):
    __slots__ = ["allowed_token_bitmask", "allowed_token_bitmask_bytes", "banned_token_ids", "frequency_penalty", "logit_bias", "logprobs", "min_p", "n", "output_token_counts", "presence_penalty", "prompt_token_ids", "repetition_penalty", "temperature", "top_k", "top_p"]
    ALLOWED_TOKEN_BITMASK_BYTES_FIELD_NUMBER: _ClassVar[int]
    ALLOWED_TOKEN_BITMASK_FIELD_NUMBER: _ClassVar[int]
    BANNED_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    N_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_TOKEN_COUNTS_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    allowed_token_bitmask: _containers.RepeatedScalarFieldContainer[int]
    allowed_token_bitmask_bytes: bytes
    banned_token_ids: _containers.RepeatedScalarFieldContainer[int]
    frequency_penalty: float
    logit_bias: _containers.RepeatedCompositeFieldContainer[TokenBias]
    logprobs: LogprobOptions
    min_p: float
    n: int
    output_token_counts: _containers.RepeatedCompositeFieldContainer[TokenCount]
    presence_penalty: float
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    repetition_penalty: float
    temperature: float
    top_k: int
    top_p: float
    def __init__(self, temperature: _Optional[float] = ..., top_k: _Optional[int] = ..., top_p: _Optional[float] = ..., min_p: _Optional[float] = ..., logit_bias: _Optional[_Iterable[_Union[TokenBias, _Mapping]]] = ..., banned_token_ids: _Optional[_Iterable[int]] = ..., allowed_token_bitmask: _Optional[_Iterable[int]] = ..., repetition_penalty: _Optional[float] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., output_token_counts: _Optional[_Iterable[_Union[TokenCount, _Mapping]]] = ..., n: _Optional[int] = ..., logprobs: _Optional[_Union[LogprobOptions, _Mapping]] = ..., allowed_token_bitmask_bytes: _Optional[bytes] = ...) -> None: ...

class ShardRange(_message.Message):
    __slots__ = ["device", "rank", "vocab_begin", "vocab_end"]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    VOCAB_BEGIN_FIELD_NUMBER: _ClassVar[int]
    VOCAB_END_FIELD_NUMBER: _ClassVar[int]
    device: int
    rank: int
    vocab_begin: int
    vocab_end: int
    def __init__(self, rank: _Optional[int] = ..., device: _Optional[int] = ..., vocab_begin: _Optional[int] = ..., vocab_end: _Optional[int] = ...) -> None: ...

class SharedMemoryRef(_message.Message):
    __slots__ = ["offset", "region"]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    REGION_FIELD_NUMBER: _ClassVar[int]
    offset: int
    region: str
    def __init__(self, region: _Optional[str] = ..., offset: _Optional[int] = ...) -> None: ...

class Tensor(_message.Message):
    __slots__ = ["data", "dtype", "shape", "shared_memory"]
    DATA_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    SHARED_MEMORY_FIELD_NUMBER: _ClassVar[int]
    data: bytes
    dtype: DType
    shape: _containers.RepeatedScalarFieldContainer[int]
    shared_memory: SharedMemoryRef
    def __init__(self, dtype: _Optional[_Union[DType, str]] = ..., shape: _Optional[_Iterable[int]] = ..., data: _Optional[bytes] = ..., shared_memory: _Optional[_Union[SharedMemoryRef, _Mapping]] = ...) -> None: ...

class Timing(_message.Message):
    __slots__ = ["batch_rows", "execute_seconds", "queue_seconds"]
    BATCH_ROWS_FIELD_NUMBER: _ClassVar[int]
    EXECUTE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    QUEUE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    batch_rows: int
    execute_seconds: float
    queue_seconds: float
    def __init__(self, queue_seconds: _Optional[float] = ..., execute_seconds: _Optional[float] = ..., batch_rows: _Optional[int] = ...) -> None: ...

class TokenBias(_message.Message):
    __slots__ = ["bias", "token_id"]
    BIAS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    bias: float
    token_id: int
    def __init__(self, token_id: _Optional[int] = ..., bias: _Optional[float] = ...) -> None: ...

class TokenCount(_message.Message):
    __slots__ = ["count", "token_id"]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    count: int
    token_id: int
    def __init__(self, token_id: _Optional[int] = ..., count: _Optional[int] = ...) -> None: ...

class TopLogprobs(_message.Message):
    __slots__ = ["logprobs", "token_ids"]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[float]] = ...) -> None: ...

class UnregisterSharedMemoryRequest(_message.Message):
    __slots__ = ["name"]
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class UnregisterSharedMemoryResponse(_message.Message):
    __slots__ = []
    def __init__(self) -> None: ...

class DType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = []
