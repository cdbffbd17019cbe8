"""FlashSamplerClient: hidden states (numpy or torch) in, numpy token ids out,
over a blocking gRPC channel. flashsampler_client.aio has the same API for
asyncio callers.

Deadlines cover every attempt; UNAVAILABLE and CANCELLED are retried with exponential backoff
and jitter (the same policy as the C++ client in client/client.h). Streams are
never retried: after a broken stream the caller cannot tell which requests
were sampled.
"""

import queue
import time
from typing import Any, Callable, Iterable, Iterator, Optional, Tuple

import grpc

from flashsampler.v1 import sampler_pb2
from flashsampler_client._common import (
    ClientConfig, DeadlineExceededError, FlashSamplerError, HiddenStates,
    RowValues, Seeds, Tokens, check_response, to_error, tokens_and_seeds)

__all__ = ["FlashSamplerClient", "SampleStream", "check_response",
           "sampler_pb2"]

_Request = sampler_pb2.SampleRequest
_Response = sampler_pb2.SampleResponse

# Codes retried with backoff: the call was not accepted by the server.
_RETRYABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)


class SampleStream:
    """One open SampleStream call: send() requests, recv() their responses in
    the same order. send() never blocks (requests queue until gRPC takes
    them), so a caller may keep several requests in flight.

    A response to a request the server refused has its `error` field set
    (check_response() raises it); the stream stays open. recv() raises
    FlashSamplerError when the stream itself fails (server draining,
    deadline, cancel), EOFError after the last response.
    """

    def __init__(self, multicallable: Any, timeout: Optional[float],
                 wait_for_ready: bool) -> None:
        self._requests: "queue.SimpleQueue[Optional[_Request]]" = (
            queue.SimpleQueue())
        self._closed = False
        self._call = multicallable(iter(self._requests.get, None),
                                   timeout=timeout,
                                   wait_for_ready=wait_for_ready)

    def send(self, request: _Request) -> None:
        if self._closed:
            raise ValueError("send() after close()")
        self._requests.put(request)

    def recv(self) -> _Response:
        try:
            response: _Response = next(self._call)
            return response
        except StopIteration:
            raise EOFError("SampleStream: no more responses") from None
        except grpc.RpcError as error:
            raise to_error(error) from None

    def sample(self, request: _Request) -> _Response:
        """send() then recv(): the round trip of one request, with nothing
        else in flight."""
        self.send(request)
        return self.recv()

    def close(self) -> None:
        """No more requests (responses to those sent still arrive)."""
        if not self._closed:
            self._closed = True
            self._requests.put(None)

    def cancel(self) -> None:
        self.close()
        self._call.cancel()

    def __iter__(self) -> Iterator[_Response]:
        while True:
            try:
                yield self.recv()
            except EOFError:
                return

    def __enter__(self) -> "SampleStream":
        return self

    def __exit__(self, *exc: object) -> None:
        if exc[0] is None:
            self.close()
        else:
            self.cancel()


class FlashSamplerClient(ClientConfig):
    """A client of one flashsamplerd target (or many, via dns:///).

    target: "host:port", "dns:///name:port" (round robin over every address:
        a headless Kubernetes Service), "ipv4:a:p,b:q".
    timeout: seconds per call, every retry included.
    retries: extra attempts after an UNAVAILABLE or CANCELLED answer (0 =
        none).
    backoff, max_backoff, jitter: sleep before retry k is
        min(backoff * 2**(k-1), max_backoff) * uniform(1 - jitter, 1 + jitter).
    root_certificates, private_key, certificate_chain: PEM bytes or file
        paths; any of them turns TLS on (the key and chain: mutual TLS).
    tls: TLS with the system's root certificates.
    server_name_override: name expected in the server certificate.
    connections: HTTP/2 connections to each address (1 to 64), every call
        and stream on the next in turn. A connection carries one request's
        bytes at a time: callers of many rows in one process want one each.
    Thread-safe: one client serves every thread.
    """

    def close(self) -> None:
        for channel in self._channels:
            channel.close()

    def __enter__(self) -> "FlashSamplerClient":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _call(self, method: Callable[..., Any], request: Any,
              timeout: Optional[float] = None) -> Any:
        deadline = time.monotonic() + self._deadline_budget(timeout)
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
                # CANCELLED too: this client never cancels a call itself
                # (asyncio cancellation raises CancelledError instead), so
                # it is gRPC dropping a call the server had not accepted yet
                # while it shut down.
                if (error.code() not in _RETRYABLE or
                        attempts > self.retries):
                    raise to_error(error, attempts) from None
                sleep = self._jittered(backoff)
                if time.monotonic() + sleep >= deadline:
                    raise to_error(error, attempts) from None
                self.attempts_retried += 1
                time.sleep(sleep)
                backoff = min(backoff * 2, self.max_backoff)

    def sample_response(self, hidden: HiddenStates,
                        timeout: Optional[float] = None,
                        seeds: RowValues = None, steps: RowValues = None,
                        temperature: float = 1.0, n: int = 1, top_k: int = 0,
                        top_p: float = 1.0, min_p: float = 0.0,
                        params: Optional[sampler_pb2.SamplingParams] = None,
                        request_id: str = "") -> _Response:
        """Like sample(), but returns the whole SampleResponse message
        (logprobs, timing)."""
        request = self.build_request(
            hidden, seeds=seeds, steps=steps, temperature=temperature, n=n,
            top_k=top_k, top_p=top_p, min_p=min_p, params=params,
            request_id=request_id)
        response: _Response = self._call(self._sample, request, timeout)
        return response

    def sample(self, hidden: HiddenStates, seeds: RowValues = None,
               steps: RowValues = None, temperature: float = 1.0, n: int = 1,
               top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0,
               params: Optional[sampler_pb2.SamplingParams] = None,
               request_id: str = "",
               timeout: Optional[float] = None) -> Tuple[Tokens, Seeds]:
        """Samples n tokens per row of `hidden`.

        hidden: [B, D] (or [D]) float32, float16, or bfloat16 bit patterns
            as uint16 (an ml_dtypes bfloat16 array works too); or a
            torch.Tensor of bfloat16, float16 or float32, on the CPU or a GPU
            (copied to the host once).
        seeds: None (the server draws one per row) or B unsigned ints.
        steps: None (step 0), one int for every row, or B ints.
        params: a sampler_pb2.SamplingParams that replaces temperature, n,
            top_k, top_p and min_p (for bias, masks, penalties, logprobs).
        Returns (tokens: int32 [B, n], seeds: uint64 [B]), the seeds the
        server used, so that any sample can be replayed.
        Raises FlashSamplerError (subclassed by code) when the call fails.
        """
        return tokens_and_seeds(self.sample_response(
            hidden, timeout=timeout, seeds=seeds, steps=steps,
            temperature=temperature, n=n, top_k=top_k, top_p=top_p,
            min_p=min_p, params=params, request_id=request_id))

    def sample_stream(self, requests: Iterable[_Request],
                      timeout: Optional[float] = None) -> Iterator[_Response]:
        """Sends `requests` (build them with build_request()) on one
        SampleStream and yields one response per request, in order.

        A refused request yields a response whose `error` is set
        (check_response() turns it into an exception) and the stream goes
        on. timeout: seconds for the whole stream; None = no deadline.
        Raises FlashSamplerError when the stream itself fails.
        """
        call = self._sample_stream(iter(requests), timeout=timeout,
                                   wait_for_ready=self.wait_for_ready)
        try:
            for response in call:
                yield response
        except grpc.RpcError as error:
            raise to_error(error) from None
        finally:
            call.cancel()  # a no-op once the stream has ended

    def open_stream(self, timeout: Optional[float] = None) -> SampleStream:
        """An open SampleStream for a caller that sends requests as they
        come (an engine's decode loop). timeout: seconds for the whole
        stream; None = no deadline."""
        return SampleStream(self._sample_stream, timeout, self.wait_for_ready)

    def model_info(self, timeout: Optional[float] = None
                   ) -> sampler_pb2.ModelInfo:
        """The server's ModelInfo message (vocab_size, hidden_size, ...)."""
        info: sampler_pb2.ModelInfo = self._call(
            self._model_info, sampler_pb2.GetModelInfoRequest(), timeout)
        return info

    def register_shared_memory(self, name: str, key: str, byte_size: int,
                               timeout: Optional[float] = None) -> None:
        """Lets requests name the shared-memory object `key` (see
        SharedMemoryRegion) as region `name`; the daemon maps its first
        `byte_size` bytes read-only. FailedPrecondition when the daemon
        serves no shared memory."""
        self._call(self._register_shared_memory,
                   sampler_pb2.RegisterSharedMemoryRequest(
                       name=name, key=key, byte_size=byte_size), timeout)

    def unregister_shared_memory(self, name: str,
                                 timeout: Optional[float] = None) -> None:
        """Forgets region `name`."""
        self._call(self._unregister_shared_memory,
                   sampler_pb2.UnregisterSharedMemoryRequest(name=name),
                   timeout)

    def health(self, service: str = "",
               timeout: Optional[float] = None) -> str:
        """grpc.health.v1 status: "SERVING", "NOT_SERVING", "UNKNOWN" or
        "SERVICE_UNKNOWN" (a service name the server does not know)."""
        try:
            status: str = self._call(self._health_check, service, timeout)
            return status
        except FlashSamplerError as error:
            if error.code == grpc.StatusCode.NOT_FOUND:
                return "SERVICE_UNKNOWN"
            raise

