"""What the synchronous and the asyncio clients share: errors, the request
builder (numpy arrays and torch tensors), shared-memory regions for hidden
states, channel settings, method paths and the dependency-free
grpc.health.v1 codec.
"""

import itertools
import random
import sys
from multiprocessing import shared_memory
from typing import (TYPE_CHECKING, Any, Dict, Iterator, List, NamedTuple,
                    Optional, Sequence, Tuple, Type, Union)

import grpc
import numpy as np
import numpy.typing as npt

from flashsampler.v1 import sampler_pb2

if TYPE_CHECKING:
    import torch

# Anything `sample` takes as hidden states: a numpy array (or nested
# sequences) [B, D] or [D], or a torch.Tensor (bf16/fp16/fp32, CPU or CUDA).
HiddenStates = Union[npt.ArrayLike, "torch.Tensor"]
# None, one integer, or one per row.
RowValues = Optional[Union[int, Sequence[int], npt.NDArray[np.uint64]]]
PemSource = Optional[Union[bytes, str]]
Tokens = npt.NDArray[np.int32]
Seeds = npt.NDArray[np.uint64]

SAMPLE = "/flashsampler.v1.Sampler/Sample"
SAMPLE_STREAM = "/flashsampler.v1.Sampler/SampleStream"
GET_MODEL_INFO = "/flashsampler.v1.Sampler/GetModelInfo"
REGISTER_SHARED_MEMORY = "/flashsampler.v1.Sampler/RegisterSharedMemory"
UNREGISTER_SHARED_MEMORY = "/flashsampler.v1.Sampler/UnregisterSharedMemory"
HEALTH_CHECK = "/grpc.health.v1.Health/Check"

# The `connections` bound: each is a socket and a share of a server thread.
MAX_CONNECTIONS = 64

# Trailer holding a serialized google.rpc.Status (gRPC's rich error model).
STATUS_DETAILS_KEY = "grpc-status-details-bin"


class FieldViolation(NamedTuple):
    """One invalid request field (google.rpc.BadRequest.FieldViolation):
    `field` as the request spells it ("row_params[3].top_p"), `description`
    what is wrong with it."""
    field: str
    description: str


class FlashSamplerError(Exception):
    """A call failed; `code` is the grpc.StatusCode, `message` the server's.
    For an invalid request, `field_violations` names the fields at fault and
    `reason` is the server's machine-readable reason
    ("INVALID_SAMPLING_PARAMS", "INVALID_HIDDEN_STATES", ...; "" if none),
    both read from the google.rpc.Status in grpc-status-details-bin."""

    def __init__(self, code: grpc.StatusCode, message: str,
                 field_violations: Sequence[FieldViolation] = (),
                 reason: str = "") -> None:
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.message = message
        self.field_violations: List[FieldViolation] = list(field_violations)
        self.reason = reason


class InvalidArgumentError(FlashSamplerError, ValueError):
    """The server refused the request (shape, dtype, parameter ranges)."""


class UnavailableError(FlashSamplerError, ConnectionError):
    """Unreachable, loading or draining, after every retry."""


class ResourceExhaustedError(FlashSamplerError):
    """The server's queue is full: back off or add replicas."""


class DeadlineExceededError(FlashSamplerError, TimeoutError):
    """The deadline passed before an answer arrived."""


class UnimplementedError(FlashSamplerError, NotImplementedError):
    """A sampling control this server's backend does not implement."""


_ERRORS: Dict[Any, Type[FlashSamplerError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidArgumentError,
    grpc.StatusCode.UNAVAILABLE: UnavailableError,
    grpc.StatusCode.RESOURCE_EXHAUSTED: ResourceExhaustedError,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceededError,
    grpc.StatusCode.UNIMPLEMENTED: UnimplementedError,
}
_CODES_BY_NUMBER = {code.value[0]: code for code in grpc.StatusCode}


def make_error(code: grpc.StatusCode, message: str,
               field_violations: Sequence[FieldViolation] = (),
               reason: str = "") -> FlashSamplerError:
    return _ERRORS.get(code, FlashSamplerError)(code, message,
                                                field_violations, reason)


def to_error(rpc_error: grpc.RpcError, attempts: int = 1) -> FlashSamplerError:
    code = rpc_error.code()
    message = rpc_error.details() or ""
    if attempts > 1:
        message += f" (gave up after {attempts} attempts)"
    violations: List[FieldViolation] = []
    reason = ""
    try:
        trailing = rpc_error.trailing_metadata() or ()
    except Exception:  # an error raised before any trailer arrived
        trailing = ()
    for key, value in trailing:
        if key == STATUS_DETAILS_KEY and isinstance(value, bytes):
            try:
                violations, reason = decode_status_details(value)
            except ValueError:
                pass  # unreadable details: code and message still stand
    return make_error(code, message, violations, reason)


def check_response(
        response: sampler_pb2.SampleResponse) -> sampler_pb2.SampleResponse:
    """Returns `response`, or raises the FlashSamplerError its `error` field
    carries (set on SampleStream answers to requests that failed)."""
    if response.HasField("error") and response.error.code != 0:
        code = _CODES_BY_NUMBER.get(response.error.code,
                                    grpc.StatusCode.UNKNOWN)
        raise make_error(code, response.error.message)
    return response


# grpc.health.v1 in wire format, so that no grpcio-health-checking package is
# needed: HealthCheckRequest {string service = 1}, HealthCheckResponse
# {ServingStatus status = 1}.
_HEALTH_NAMES = {0: "UNKNOWN", 1: "SERVING", 2: "NOT_SERVING",
                 3: "SERVICE_UNKNOWN"}


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        if value < 0x80:
            out.append(value)
            return bytes(out)
        out.append((value & 0x7F) | 0x80)
        value >>= 7


def encode_health_request(service: str) -> bytes:
    data = service.encode("utf-8")
    return b"" if not data else b"\x0a" + _varint(len(data)) + data


def _read_varint(data: bytes, pos: int) -> Tuple[int, int]:
    value, shift = 0, 0
    while True:
        if pos >= len(data) or shift > 63:
            raise ValueError("malformed protobuf message")
        byte = data[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, pos
        shift += 7


def _fields(data: bytes) -> Iterator[Tuple[int, Union[int, bytes]]]:
    """(field number, value) of every varint and length-delimited field of
    one protobuf message; fixed-width fields are skipped."""
    pos = 0
    while pos < len(data):
        tag, pos = _read_varint(data, pos)
        wire_type = tag & 7
        if wire_type == 0:
            value, pos = _read_varint(data, pos)
            yield tag >> 3, value
        elif wire_type == 2:
            length, pos = _read_varint(data, pos)
            if pos + length > len(data):
                raise ValueError("malformed protobuf message")
            yield tag >> 3, data[pos:pos + length]
            pos += length
        elif wire_type == 1:
            pos += 8
        elif wire_type == 5:
            pos += 4
        else:
            raise ValueError("malformed protobuf message")


def _text(value: Union[int, bytes]) -> str:
    return value.decode("utf-8") if isinstance(value, bytes) else ""


_BAD_REQUEST_URL = "type.googleapis.com/google.rpc.BadRequest"
_ERROR_INFO_URL = "type.googleapis.com/google.rpc.ErrorInfo"


def decode_status_details(
        data: bytes) -> Tuple[List[FieldViolation], str]:
    """The field violations and the ErrorInfo reason of a serialized
    google.rpc.Status, read from the wire format so that no
    googleapis-common-protos package is needed: Status {details = 3: Any},
    Any {type_url = 1, value = 2}, BadRequest {field_violations = 1:
    {field = 1, description = 2}}, ErrorInfo {reason = 1}."""
    violations: List[FieldViolation] = []
    reason = ""
    for number, detail in _fields(data):
        if number != 3 or not isinstance(detail, bytes):
            continue
        any_fields = dict(_fields(detail))
        type_url = _text(any_fields.get(1, b""))
        value = any_fields.get(2, b"")
        if not isinstance(value, bytes):
            continue
        if type_url == _BAD_REQUEST_URL:
            for n, violation in _fields(value):
                if n == 1 and isinstance(violation, bytes):
                    v = dict(_fields(violation))
                    violations.append(FieldViolation(
                        _text(v.get(1, b"")), _text(v.get(2, b""))))
        elif type_url == _ERROR_INFO_URL and not reason:
            reason = _text(dict(_fields(value)).get(1, b""))
    return violations, reason


def decode_health_response(data: bytes) -> str:
    status, pos = 0, 0
    while pos < len(data):
        tag, pos = _read_varint(data, pos)
        wire_type = tag & 7
        if wire_type == 0:
            value, pos = _read_varint(data, pos)
            if tag >> 3 == 1:
                status = value
        elif wire_type == 2:
            length, pos = _read_varint(data, pos)
            pos += length
        elif wire_type == 1:
            pos += 8
        elif wire_type == 5:
            pos += 4
        else:
            raise ValueError("malformed protobuf message")
    return _HEALTH_NAMES.get(status, "UNKNOWN")


def _read(path_or_bytes: PemSource) -> Optional[bytes]:
    if path_or_bytes is None or isinstance(path_or_bytes, bytes):
        return path_or_bytes
    with open(path_or_bytes, "rb") as f:
        return f.read()


def _torch_to_numpy(tensor: "torch.Tensor") -> npt.NDArray[Any]:
    """A CPU numpy view of `tensor`'s bytes: one device-to-host copy for a
    CUDA tensor (none on the CPU), bf16 as its int16 bit patterns."""
    torch = sys.modules["torch"]
    wire = {torch.float32: "float32", torch.float16: "float16",
            torch.bfloat16: "bfloat16"}.get(tensor.dtype)
    if wire is None:
        raise TypeError(
            f"hidden: torch dtype {tensor.dtype} is not sent as is; pass "
            "torch.float32, torch.float16 or torch.bfloat16")
    # contiguous() on the tensor's own device (a no-op when it already is),
    # so that the host gets exactly one copy of the rows.
    tensor = tensor.detach().contiguous()
    if tensor.device.type != "cpu":
        tensor = tensor.cpu()
    if wire == "bfloat16":
        bits: npt.NDArray[Any] = tensor.view(torch.int16).numpy()
        return bits.view(np.uint16)
    array: npt.NDArray[Any] = tensor.numpy()
    return array


def _is_torch_tensor(value: object) -> bool:
    # A caller can hold a tensor only if torch is imported already, so this
    # never imports torch itself.
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(value, torch.Tensor)


def _wire_array(hidden: HiddenStates) -> Tuple[int, npt.NDArray[Any]]:
    """[B, D] (or [D]) hidden states -> (wire dtype, contiguous
    little-endian [B, D] array)."""
    if _is_torch_tensor(hidden):
        array = _torch_to_numpy(hidden)
    else:
        array = np.asarray(hidden)
    if array.ndim == 1:
        array = array[np.newaxis, :]
    if array.ndim != 2 or array.shape[0] < 1 or array.shape[1] < 1:
        raise ValueError(
            f"hidden: expected shape [B, D] with B, D >= 1, got {array.shape}")
    if array.dtype.name == "bfloat16":  # ml_dtypes / jax bf16
        array = array.view(np.uint16)
    wire = {
        "float32": sampler_pb2.DTYPE_FP32,
        "float16": sampler_pb2.DTYPE_FP16,
        "uint16": sampler_pb2.DTYPE_BF16,  # bfloat16 bit patterns
    }.get(array.dtype.name)
    if wire is None:
        raise TypeError(
            f"hidden: dtype {array.dtype} is not sent as is; pass float32, "
            "float16, or bfloat16 bit patterns as uint16 (convert with "
            ".astype(np.float32) first), or a torch tensor")
    data = np.ascontiguousarray(array, dtype=array.dtype.newbyteorder("<"))
    return wire, data


def hidden_tensor(hidden: HiddenStates) -> sampler_pb2.Tensor:
    """[B, D] (or [D]) hidden states -> Tensor; the dtype decides the wire
    dtype. The bytes are copied once, into the message. A Tensor (from
    SharedMemoryRegion.tensor()) is returned as it is."""
    if isinstance(hidden, sampler_pb2.Tensor):
        return hidden
    wire, data = _wire_array(hidden)
    return sampler_pb2.Tensor(dtype=wire, shape=list(data.shape),
                              data=data.tobytes())


class SharedMemoryRegion:
    """A POSIX shared-memory object (mode 0600) that this process creates,
    for hidden states passed by reference to a flashsamplerd on the same
    host, started with --max_shared_memory_regions >= 1:

        region = SharedMemoryRegion(256 * 4096 * 2)
        client.register_shared_memory("engine-0", region.key, region.size)
        tokens, seeds = client.sample(region.tensor(hidden, "engine-0"))

    The daemon copies a request's bytes while it validates it: the region
    may be rewritten once the response (or error) has arrived. close()
    unlinks the object; unregister it from the daemon too.
    """

    def __init__(self, byte_size: int, name: Optional[str] = None) -> None:
        if byte_size < 1:
            raise ValueError("byte_size: must be >= 1")
        self._shm = shared_memory.SharedMemory(name=name, create=True,
                                               size=byte_size)
        self.size = int(byte_size)

    @property
    def key(self) -> str:
        """The shm_open() name RegisterSharedMemory takes."""
        return "/" + self._shm.name

    def tensor(self, hidden: HiddenStates, region: str,
               offset: int = 0) -> sampler_pb2.Tensor:
        """Writes `hidden` (as sample() takes it) at `offset` and returns
        the Tensor that names those bytes in the region registered as
        `region`."""
        wire, data = _wire_array(hidden)
        raw = data.view(np.uint8).reshape(-1)
        if offset < 0 or offset + raw.size > self.size:
            raise ValueError(f"hidden: {raw.size} bytes at offset {offset} "
                             f"do not fit the region's {self.size}")
        buffer = self._shm.buf
        assert buffer is not None
        np.frombuffer(buffer, dtype=np.uint8, count=raw.size,
                      offset=offset)[:] = raw
        return sampler_pb2.Tensor(
            dtype=wire, shape=list(data.shape),
            shared_memory=sampler_pb2.SharedMemoryRef(region=region,
                                                      offset=offset))

    def close(self) -> None:
        self._shm.close()
        self._shm.unlink()

    def __enter__(self) -> "SharedMemoryRegion":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def build_request(hidden: HiddenStates, seeds: RowValues = None,
                  steps: RowValues = None, temperature: float = 1.0,
                  n: int = 1, top_k: int = 0, top_p: float = 1.0,
                  min_p: float = 0.0,
                  params: Optional[sampler_pb2.SamplingParams] = None,
                  request_id: str = "") -> sampler_pb2.SampleRequest:
    tensor = hidden_tensor(hidden)
    rows = tensor.shape[0]
    request = sampler_pb2.SampleRequest(request_id=request_id,
                                        hidden_states=tensor)
    if params is not None:
        request.params.CopyFrom(params)
    else:
        request.params.temperature = temperature
        request.params.top_k = top_k
        if top_p != 1.0:
            request.params.top_p = top_p
        request.params.min_p = min_p
        if n != 1:
            request.params.n = n
    for name, values in (("seeds", seeds), ("steps", steps)):
        if values is None:
            continue
        array = np.atleast_1d(np.asarray(values, dtype=np.uint64))
        if array.size == 1 and rows > 1 and name == "steps":
            array = np.repeat(array, rows)
        if array.size != rows:
            raise ValueError(f"{name}: expected {rows} values (one per "
                             f"row), got {array.size}")
        getattr(request, name).extend(int(v) for v in array)
    return request


def tokens_and_seeds(
        response: sampler_pb2.SampleResponse) -> Tuple[Tokens, Seeds]:
    per_row = max(response.n, 1)
    tokens = np.asarray(response.token_ids, dtype=np.int32)
    return (tokens.reshape(-1, per_row),
            np.asarray(response.seeds, dtype=np.uint64))


class _MethodHandles:
    """The service's methods on one channel (one connection)."""

    def __init__(self, channel: Any) -> None:
        self.sample = channel.unary_unary(
            SAMPLE,
            request_serializer=sampler_pb2.SampleRequest.SerializeToString,
            response_deserializer=sampler_pb2.SampleResponse.FromString)
        self.sample_stream = channel.stream_stream(
            SAMPLE_STREAM,
            request_serializer=sampler_pb2.SampleRequest.SerializeToString,
            response_deserializer=sampler_pb2.SampleResponse.FromString)
        self.model_info = channel.unary_unary(
            GET_MODEL_INFO,
            request_serializer=sampler_pb2.GetModelInfoRequest
            .SerializeToString,
            response_deserializer=sampler_pb2.ModelInfo.FromString)
        self.register_shared_memory = channel.unary_unary(
            REGISTER_SHARED_MEMORY,
            request_serializer=sampler_pb2.RegisterSharedMemoryRequest
            .SerializeToString,
            response_deserializer=sampler_pb2.RegisterSharedMemoryResponse
            .FromString)
        self.unregister_shared_memory = channel.unary_unary(
            UNREGISTER_SHARED_MEMORY,
            request_serializer=sampler_pb2.UnregisterSharedMemoryRequest
            .SerializeToString,
            response_deserializer=sampler_pb2.UnregisterSharedMemoryResponse
            .FromString)
        self.health_check = channel.unary_unary(
            HEALTH_CHECK, request_serializer=encode_health_request,
            response_deserializer=decode_health_response)


class _OnNextConnection:
    """A ClientConfig attribute whose every read is the named method (of
    _MethodHandles) on the connection the next call takes."""

    def __init__(self, name: str) -> None:
        self._name = name

    def __get__(self, config: Optional["ClientConfig"], owner: Any) -> Any:
        if config is None:
            return self
        return getattr(config._next_handles(), self._name)


class ClientConfig:
    """Settings both clients validate and hold the same way (see
    FlashSamplerClient for their meaning), and the channel and method
    handles they open the same way from their gRPC module."""

    # The module whose channels a client opens: grpc for the blocking
    # client, grpc.aio for the asyncio one.
    _grpc: Any = grpc

    def __init__(self, target: str, timeout: float = 10.0, retries: int = 3,
                 backoff: float = 0.05, max_backoff: float = 2.0,
                 jitter: float = 0.2, root_certificates: PemSource = None,
                 private_key: PemSource = None,
                 certificate_chain: PemSource = None, tls: bool = False,
                 server_name_override: Optional[str] = None,
                 lb_policy: str = "round_robin",
                 max_message_bytes: int = 256 << 20,
                 wait_for_ready: bool = False,
                 connections: int = 1) -> None:
        if timeout <= 0:
            raise ValueError("timeout: must be > 0")
        if retries < 0:
            raise ValueError("retries: must be >= 0")
        if not 0 <= jitter < 1:
            raise ValueError("jitter: must be in [0, 1)")
        if not 1 <= connections <= MAX_CONNECTIONS:
            raise ValueError(f"connections: must be in [1, {MAX_CONNECTIONS}]"
                             f", got {connections}")
        self.target = target
        self.timeout = float(timeout)
        self.retries = int(retries)
        self.backoff = float(backoff)
        self.max_backoff = float(max_backoff)
        self.jitter = float(jitter)
        self.wait_for_ready = wait_for_ready
        self.attempts_retried = 0  # retried attempts over the client's life
        self._rng = random.Random()
        self._options: List[Tuple[str, Any]] = [
            ("grpc.lb_policy_name", lb_policy),
            ("grpc.max_send_message_length", max_message_bytes),
            ("grpc.max_receive_message_length", max_message_bytes),
            # Each channel its own connections: gRPC otherwise shares one
            # among every channel of the process with the same target.
            ("grpc.use_local_subchannel_pool", 1),
        ]
        if server_name_override:
            self._options.append(("grpc.ssl_target_name_override",
                                  server_name_override))
        self._credentials: Optional[grpc.ChannelCredentials] = None
        if tls or root_certificates or certificate_chain or private_key:
            if (private_key is None) != (certificate_chain is None):
                raise ValueError("private_key and certificate_chain go "
                                 "together (mutual TLS needs both)")
            self._credentials = grpc.ssl_channel_credentials(
                root_certificates=_read(root_certificates),
                private_key=_read(private_key),
                certificate_chain=_read(certificate_chain))
        self._channels = [self._open_channel(target)
                          for _ in range(connections)]
        self._handles = [_MethodHandles(channel)
                         for channel in self._channels]
        self._turn = itertools.count()

    def _open_channel(self, target: str) -> Any:
        if self._credentials is not None:
            return self._grpc.secure_channel(target, self._credentials,
                                             self._options)
        return self._grpc.insecure_channel(target, self._options)

    def _next_handles(self) -> "_MethodHandles":
        """The method handles of the connection the next call takes."""
        return self._handles[next(self._turn) % len(self._handles)]

    # Each read is the method on the connection the next call takes
    # (`connections`).
    _sample = _OnNextConnection("sample")
    _sample_stream = _OnNextConnection("sample_stream")
    _model_info = _OnNextConnection("model_info")
    _register_shared_memory = _OnNextConnection("register_shared_memory")
    _unregister_shared_memory = _OnNextConnection("unregister_shared_memory")
    _health_check = _OnNextConnection("health_check")

    def _deadline_budget(self, timeout: Optional[float]) -> float:
        return self.timeout if timeout is None else float(timeout)

    def _jittered(self, backoff: float) -> float:
        return backoff * self._rng.uniform(1 - self.jitter, 1 + self.jitter)

    def build_request(self, hidden: HiddenStates, seeds: RowValues = None,
                      steps: RowValues = None, temperature: float = 1.0,
                      n: int = 1, top_k: int = 0, top_p: float = 1.0,
                      min_p: float = 0.0,
                      params: Optional[sampler_pb2.SamplingParams] = None,
                      request_id: str = "") -> sampler_pb2.SampleRequest:
        """The SampleRequest that sample() sends (for streams and tests)."""
        return build_request(hidden, seeds=seeds, steps=steps,
                             temperature=temperature, n=n, top_k=top_k,
                             top_p=top_p, min_p=min_p, params=params,
                             request_id=request_id)
