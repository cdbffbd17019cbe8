"""AsyncFlashSamplerClient: FlashSamplerClient's API on grpc.aio, for asyncio
callers (an engine's event loop): every call is a coroutine and never blocks
the loop; any number of calls share one channel.

    async with AsyncFlashSamplerClient("localhost:50051") as client:
        tokens, seeds = await client.sample(hidden, seeds=[1, 2])

Create the client inside the running event loop that uses it (grpc.aio
channels belong to one loop).
"""

import asyncio
import time
from typing import (Any, AsyncIterable, AsyncIterator, Callable, Iterable,
                    Optional, Tuple, Union)

import grpc
import grpc.aio

from flashsampler.v1 import sampler_pb2
from flashsampler_client._common import (
    ClientConfig, DeadlineExceededError, FlashSamplerError, HiddenStates,
    RowValues, Seeds, Tokens, check_response, to_error, tokens_and_seeds)

# Codes retried with backoff: the call was not accepted by the server.
_RETRYABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)

__all__ = ["AsyncFlashSamplerClient", "AsyncSampleStream", "check_response"]

_Request = sampler_pb2.SampleRequest
_Response = sampler_pb2.SampleResponse


class AsyncSampleStream:
    """One open SampleStream call: `await send()` requests, `await recv()`
    their responses in the same order (SampleStream's API as coroutines).
    send() and recv() may run in different tasks, so that several requests
    are in flight.

    A response to a request the server refused has its `error` field set
    (check_response() raises it); the stream stays open. recv() raises
    FlashSamplerError when the stream itself fails, EOFError after the last
    response.
    """

    def __init__(self, call: Any) -> None:
        self._call = call
        self._closed = False

    async def send(self, request: _Request) -> None:
        if self._closed:
            raise ValueError("send() after close()")
        try:
            await self._call.write(request)
        except grpc.RpcError as error:
            raise to_error(error) from None

    async def recv(self) -> _Response:
        try:
            response = await self._call.read()
        except grpc.RpcError as error:
            raise to_error(error) from None
        if response is grpc.aio.EOF:
            raise EOFError("SampleStream: no more responses")
        result: _Response = response
        return result

    async def sample(self, request: _Request) -> _Response:
        """send() then recv(): the round trip of one request, with nothing
        else in flight."""
        await self.send(request)
        return await self.recv()

    async def close(self) -> None:
        """No more requests (responses to those sent still arrive)."""
        if not self._closed:
            self._closed = True
            await self._call.done_writing()

    def cancel(self) -> None:
        self._closed = True
        self._call.cancel()

    def __aiter__(self) -> AsyncIterator[_Response]:
        return self._responses()

    async def _responses(self) -> AsyncIterator[_Response]:
        while True:
            try:
                yield await self.recv()
            except EOFError:
                return

    async def __aenter__(self) -> "AsyncSampleStream":
        return self

    async def __aexit__(self, *exc: object) -> None:
        if exc[0] is None:
            await self.close()
        else:
            self.cancel()


class AsyncFlashSamplerClient(ClientConfig):
    """FlashSamplerClient for asyncio: the same constructor arguments, method
    names, arguments and return values, each call a coroutine (streams:
    async iterators). See flashsampler_client.FlashSamplerClient."""

    _grpc = grpc.aio

    async def close(self) -> None:
        for channel in self._channels:
            await channel.close()

    async def __aenter__(self) -> "AsyncFlashSamplerClient":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def _call(self, method: Callable[..., Any], request: Any,
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
                return await method(request, timeout=remaining,
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
                await asyncio.sleep(sleep)
                backoff = min(backoff * 2, self.max_backoff)

    async def sample_response(
            self, hidden: HiddenStates, timeout: Optional[float] = None,
            seeds: RowValues = None, steps: RowValues = None,
            temperature: float = 1.0, n: int = 1, top_k: int = 0,
            top_p: float = 1.0, min_p: float = 0.0,
            params: Optional[sampler_pb2.SamplingParams] = None,
            request_id: str = "") -> _Response:
        """Like sample(), but returns the whole SampleResponse message."""
        request = self.build_request(
            hidden, seeds=seeds, steps=steps, temperature=temperature, n=n,
            top_k=top_k, top_p=top_p, min_p=min_p, params=params,
            request_id=request_id)
        response: _Response = await self._call(self._sample, request, timeout)
        return response

    async def sample(self, hidden: HiddenStates, seeds: RowValues = None,
                     steps: RowValues = None, temperature: float = 1.0,
                     n: int = 1, top_k: int = 0, top_p: float = 1.0,
                     min_p: float = 0.0,
                     params: Optional[sampler_pb2.SamplingParams] = None,
                     request_id: str = "", timeout: Optional[float] = None
                     ) -> Tuple[Tokens, Seeds]:
        """Samples n tokens per row of `hidden`; see
        FlashSamplerClient.sample."""
        return tokens_and_seeds(await self.sample_response(
            hidden, timeout=timeout, seeds=seeds, steps=steps,
            temperature=temperature, n=n, top_k=top_k, top_p=top_p,
            min_p=min_p, params=params, request_id=request_id))

    async def sample_stream(
            self, requests: Union[Iterable[_Request], AsyncIterable[_Request]],
            timeout: Optional[float] = None) -> AsyncIterator[_Response]:
        """Sends `requests` (an iterable or async iterable) on one
        SampleStream and yields one response per request, in order. A
        refused request yields a response whose `error` is set.
        timeout: seconds for the whole stream; None = no deadline."""
        call = self._sample_stream(requests, timeout=timeout,
                                   wait_for_ready=self.wait_for_ready)
        try:
            async for response in call:
                yield response
        except grpc.RpcError as error:
            raise to_error(error) from None
        finally:
            call.cancel()  # a no-op once the stream has ended

    def open_stream(self,
                    timeout: Optional[float] = None) -> AsyncSampleStream:
        """An open SampleStream for a caller that sends requests as they
        come. timeout: seconds for the whole stream; None = no deadline."""
        return AsyncSampleStream(self._sample_stream(
            timeout=timeout, wait_for_ready=self.wait_for_ready))

    async def model_info(self, timeout: Optional[float] = None
                         ) -> sampler_pb2.ModelInfo:
        """The server's ModelInfo message (vocab_size, hidden_size, ...)."""
        info: sampler_pb2.ModelInfo = await self._call(
            self._model_info, sampler_pb2.GetModelInfoRequest(), timeout)
        return info

    async def register_shared_memory(self, name: str, key: str,
                                     byte_size: int,
                                     timeout: Optional[float] = None) -> None:
        """As FlashSamplerClient.register_shared_memory."""
        await self._call(self._register_shared_memory,
                         sampler_pb2.RegisterSharedMemoryRequest(
                             name=name, key=key, byte_size=byte_size),
                         timeout)

    async def unregister_shared_memory(
            self, name: str, timeout: Optional[float] = None) -> None:
        """As FlashSamplerClient.unregister_shared_memory."""
        await self._call(self._unregister_shared_memory,
                         sampler_pb2.UnregisterSharedMemoryRequest(name=name),
                         timeout)

    async def health(self, service: str = "",
                     timeout: Optional[float] = None) -> str:
        """grpc.health.v1 status, as FlashSamplerClient.health."""
        try:
            status: str = await self._call(self._health_check, service,
                                           timeout)
            return status
        except FlashSamplerError as error:
            if error.code == grpc.StatusCode.NOT_FOUND:
                return "SERVICE_UNKNOWN"
            raise
