"""FlashSamplerClient: numpy hidden states in, numpy token ids out, over gRPC.

Deadlines cover every attempt; UNAVAILABLE is retried with exponential backoff
and jitter (the same policy as the C++ client in client/client.h).
"""

import random
import time

import grpc
import numpy as np

try:
    from flashsampler.v1 import sampler_pb2, sampler_pb2_grpc
except ImportError as error:  # pragma: no cover - depends on the install
    raise ImportError(
        "flashsampler_client needs the modules generated from "
        "proto/flashsampler/v1/sampler.proto (flashsampler.v1.sampler_pb2). "
        "From a build tree: PYTHONPATH=<build>/python:client/python; or "
        "`pip install client/python`, which generates them (see "
        "client/python/README.md).") from error

__all__ = [
    "FlashSamplerClient",
    "FlashSamplerError",
    "InvalidArgumentError",
    "UnavailableError",
    "ResourceExhaustedError",
    "DeadlineExceededError",
    "UnimplementedError",
    "sampler_pb2",
]


class FlashSamplerError(Exception):
    """A call failed; `code` is the grpc.StatusCode, `message` the server's."""

    def __init__(self, code, message):
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.message = message


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


_ERRORS = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidArgumentError,
    grpc.StatusCode.UNAVAILABLE: UnavailableError,
    grpc.StatusCode.RESOURCE_EXHAUSTED: ResourceExhaustedError,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceededError,
    grpc.StatusCode.UNIMPLEMENTED: UnimplementedError,
}


def _to_error(rpc_error, attempts):
    code = rpc_error.code()
    message = rpc_error.details() or ""
    if attempts > 1:
        message += f" (gave up after {attempts} attempts)"
    return _ERRORS.get(code, FlashSamplerError)(code, message)


# grpc.health.v1 in wire format, so that no grpcio-health-checking package is
# needed: HealthCheckRequest {string service = 1}, HealthCheckResponse
# {ServingStatus status = 1}.
_HEALTH_NAMES = {0: "UNKNOWN", 1: "SERVING", 2: "NOT_SERVING",
                 3: "SERVICE_UNKNOWN"}


def _varint(value):
    out = bytearray()
    while True:
        if value < 0x80:
            out.append(value)
            return bytes(out)
        out.append((value & 0x7F) | 0x80)
        value >>= 7


def _encode_health_request(service):
    data = service.encode("utf-8")
    return b"" if not data else b"\x0a" + _varint(len(data)) + data


def _read_varint(data, pos):
    value, shift = 0, 0
    while True:
        if pos >= len(data) or shift > 63:
            raise ValueError("malformed HealthCheckResponse")
        byte = data[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, pos
        shift += 7


def _decode_health_response(data):
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
            raise ValueError("malformed HealthCheckResponse")
    return _HEALTH_NAMES.get(status, "UNKNOWN")


def _read(path_or_bytes):
    if path_or_bytes is None or isinstance(path_or_bytes, bytes):
        return path_or_bytes
    with open(path_or_bytes, "rb") as f:
        return f.read()


def _hidden_tensor(hidden):
    """numpy [B, D] (or [D]) -> Tensor; dtype decides the wire dtype."""
    hidden = np.asarray(hidden)
    if hidden.ndim == 1:
        hidden = hidden[np.newaxis, :]
    if hidden.ndim != 2 or hidden.shape[0] < 1 or hidden.shape[1] < 1:
        raise ValueError(
            f"hidden: expected shape [B, D] with B, D >= 1, got {hidden.shape}")
    if hidden.dtype.name == "bfloat16":  # ml_dtypes / jax / torch-numpy bf16
        hidden = hidden.view(np.uint16)
    wire = {
        "float32": sampler_pb2.DTYPE_FP32,
        "float16": sampler_pb2.DTYPE_FP16,
        "uint16": sampler_pb2.DTYPE_BF16,  # bfloat16 bit patterns
    }.get(hidden.dtype.name)
    if wire is None:
        raise TypeError(
            f"hidden: dtype {hidden.dtype} is not sent as is; pass float32, "
            "float16, or bfloat16 bit patterns as uint16 (convert with "
            ".astype(np.float32) first)")
    data = np.ascontiguousarray(hidden, dtype=hidden.dtype.newbyteorder("<"))
    return sampler_pb2.Tensor(dtype=wire, shape=list(hidden.shape),
                              data=data.tobytes())


class FlashSamplerClient:
    """A client of one flashsamplerd target (or many, via dns:///).

    target: "host:port", "dns:///name:port" (round robin over every address:
        a headless Kubernetes Service), "ipv4:a:p,b:q".
    timeout: seconds per call, every retry included.
    retries: extra attempts after an UNAVAILABLE answer (0 = none).
    backoff, max_backoff, jitter: sleep before retry k is
        min(backoff * 2**(k-1), max_backoff) * uniform(1 - jitter, 1 + jitter).
    root_certificates, private_key, certificate_chain: PEM bytes or file
        paths; any of them turns TLS on (the key and chain: mutual TLS).
    tls: TLS with the system's root certificates.
    server_name_override: name expected in the server certificate.
    """

    def __init__(self, target, timeout=10.0, retries=3, backoff=0.05,
                 max_backoff=2.0, jitter=0.2, root_certificates=None,
                 private_key=None, certificate_chain=None, tls=False,
                 server_name_override=None, lb_policy="round_robin",
                 max_message_bytes=256 << 20, wait_for_ready=False):
        if timeout <= 0:
            raise ValueError("timeout: must be > 0")
        if retries < 0:
            raise ValueError("retries: must be >= 0")
        if not 0 <= jitter < 1:
            raise ValueError("jitter: must be in [0, 1)")
        self.target = target
        self.timeout = float(timeout)
        self.retries = int(retries)
        self.backoff = float(backoff)
        self.max_backoff = float(max_backoff)
        self.jitter = float(jitter)
        self.wait_for_ready = wait_for_ready
        self.attempts_retried = 0  # retried attempts over the client's life
        self._rng = random.Random()
        options = [
            ("grpc.lb_policy_name", lb_policy),
            ("grpc.max_send_message_length", max_message_bytes),
            ("grpc.max_receive_message_length", max_message_bytes),
        ]
        if server_name_override:
            options.append(("grpc.ssl_target_name_override",
                            server_name_override))
        if tls or root_certificates or certificate_chain or private_key:
            if (private_key is None) != (certificate_chain is None):
                raise ValueError("private_key and certificate_chain go "
                                 "together (mutual TLS needs both)")
            credentials = grpc.ssl_channel_credentials(
                root_certificates=_read(root_certificates),
                private_key=_read(private_key),
                certificate_chain=_read(certificate_chain))
            self._channel = grpc.secure_channel(target, credentials, options)
        else:
            self._channel = grpc.insecure_channel(target, options)
        self._stub = sampler_pb2_grpc.SamplerStub(self._channel)
        self._health_check = self._channel.unary_unary(
            "/grpc.health.v1.Health/Check",
            request_serializer=_encode_health_request,
            response_deserializer=_decode_health_response)

    def close(self):
        self._channel.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _call(self, method, request, timeout=None):
        deadline = time.monotonic() + (self.timeout if timeout is None
                                       else float(timeout))
        backoff = self.backoff
        attempts = 0
        while True:
            attempts += 1
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise DeadlineExceededError(
                    grpc.StatusCode.DEADLINE_EXCEEDED,
                    f"deadline passed before attempt {attempts}")
            try:
                return method(request, timeout=remaining,
                              wait_for_ready=self.wait_for_ready)
            except grpc.RpcError as error:
                if (error.code() != grpc.StatusCode.UNAVAILABLE or
                        attempts > self.retries):
                    raise _to_error(error, attempts) from None
                sleep = backoff * self._rng.uniform(1 - self.jitter,
                                                    1 + self.jitter)
                if time.monotonic() + sleep >= deadline:
                    raise _to_error(error, attempts) from None
                self.attempts_retried += 1
                time.sleep(sleep)
                backoff = min(backoff * 2, self.max_backoff)

    def build_request(self, hidden, seeds=None, steps=None, temperature=1.0,
                      n=1, top_k=0, top_p=1.0, min_p=0.0, params=None,
                      request_id=""):
        """The SampleRequest that sample() sends (for streams and tests)."""
        tensor = _hidden_tensor(hidden)
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
            values = np.atleast_1d(np.asarray(values, dtype=np.uint64))
            if values.size == 1 and rows > 1 and name == "steps":
                values = np.repeat(values, rows)
            if values.size != rows:
                raise ValueError(f"{name}: expected {rows} values (one per "
                                 f"row), got {values.size}")
            getattr(request, name).extend(int(v) for v in values)
        return request

    def sample_response(self, hidden, timeout=None, **kwargs):
        """Like sample(), but returns the whole SampleResponse message
        (logprobs, timing)."""
        return self._call(self._stub.Sample,
                          self.build_request(hidden, **kwargs), timeout)

    def sample(self, hidden, seeds=None, steps=None, temperature=1.0, n=1,
               top_k=0, top_p=1.0, min_p=0.0, params=None, request_id="",
               timeout=None):
        """Samples n tokens per row of `hidden`.

        hidden: [B, D] (or [D]) float32, float16, or bfloat16 bit patterns
            as uint16 (an ml_dtypes bfloat16 array works too).
        seeds: None (the server draws one per row) or B unsigned ints.
        steps: None (step 0), one int for every row, or B ints.
        params: a sampler_pb2.SamplingParams that replaces temperature, n,
            top_k, top_p and min_p (for bias, masks, penalties, logprobs).
        Returns (tokens: int32 [B, n], seeds: uint64 [B]), the seeds the
        server used, so that any sample can be replayed.
        Raises FlashSamplerError (subclassed by code) when the call fails.
        """
        response = self.sample_response(
            hidden, timeout=timeout, seeds=seeds, steps=steps,
            temperature=temperature, n=n, top_k=top_k, top_p=top_p,
            min_p=min_p, params=params, request_id=request_id)
        per_row = max(response.n, 1)
        tokens = np.asarray(response.token_ids, dtype=np.int32)
        return (tokens.reshape(-1, per_row),
                np.asarray(response.seeds, dtype=np.uint64))

    def model_info(self, timeout=None):
        """The server's ModelInfo message (vocab_size, hidden_size, ...)."""
        return self._call(self._stub.GetModelInfo,
                          sampler_pb2.GetModelInfoRequest(), timeout)

    def health(self, service="", timeout=None):
        """grpc.health.v1 status: "SERVING", "NOT_SERVING", "UNKNOWN" or
        "SERVICE_UNKNOWN" (a service name the server does not know)."""
        try:
            return self._call(self._health_check, service, timeout)
        except FlashSamplerError as error:
            if error.code == grpc.StatusCode.NOT_FOUND:
                return "SERVICE_UNKNOWN"
            raise
