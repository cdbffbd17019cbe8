"""flashsampler_client.aio and the SampleStream helpers against the scripted
in-process server of test_client: the asyncio client has the blocking
client's API (names, arguments, defaults), encodes, retries and maps errors
the same way; streams answer in order with refused requests in place; torch
tensors go on the wire as their own bytes (a stand-in torch module when torch
is not installed) without the client ever importing torch.

Run: PYTHONPATH=<build>/python:client/python /usr/bin/python3 -m unittest
"""

import asyncio
import importlib.util
import inspect
import sys
import types
import unittest

import grpc
import numpy as np

import flashsampler_client
from flashsampler.v1 import sampler_pb2
from flashsampler_client import check_response
from flashsampler_client.aio import AsyncFlashSamplerClient, AsyncSampleStream
from test_client import FakeServerCase

PUBLIC = ("sample", "sample_response", "sample_stream", "open_stream",
          "model_info", "health", "build_request", "close")


class ApiParityTest(unittest.TestCase):

    def test_async_client_has_the_blocking_clients_api(self):
        sync = flashsampler_client.FlashSamplerClient
        for name in PUBLIC + ("__init__",):
            with self.subTest(method=name):
                ours = inspect.signature(getattr(AsyncFlashSamplerClient,
                                                 name))
                theirs = inspect.signature(getattr(sync, name))
                self.assertEqual(
                    [(p.name, p.default) for p in ours.parameters.values()],
                    [(p.name, p.default) for p in theirs.parameters.values()])
        for name in ("sample", "sample_response", "model_info", "health",
                     "close"):
            self.assertTrue(inspect.iscoroutinefunction(
                getattr(AsyncFlashSamplerClient, name)), name)
        self.assertTrue(inspect.isasyncgenfunction(
            AsyncFlashSamplerClient.sample_stream))
        for name in ("send", "recv", "sample", "close", "cancel"):
            self.assertTrue(hasattr(AsyncSampleStream, name))
            self.assertTrue(hasattr(flashsampler_client.SampleStream, name))

    def test_package_is_typed(self):
        spec = importlib.util.find_spec("flashsampler_client")
        marker = spec.submodule_search_locations[0] + "/py.typed"
        with open(marker):
            pass


class AsyncClientTest(FakeServerCase):
    """Reuses test_client's server (setUp) with an asyncio client."""

    def run_async(self, make_coroutine, **client_args):
        async def run():
            args = dict(timeout=5.0, retries=3, backoff=0.04, jitter=0.25)
            args.update(client_args)
            async with AsyncFlashSamplerClient(f"127.0.0.1:{self.port}",
                                               **args) as client:
                return await make_coroutine(client), client
        return asyncio.run(run())

    def test_async_sample_matches_blocking_sample(self):
        hidden = np.arange(8, dtype=np.float32).reshape(2, 4)
        (tokens, seeds), _ = self.run_async(lambda c: c.sample(
            hidden, seeds=[7, 8], steps=3, temperature=0.5, n=2,
            request_id="r"))
        async_request = self.fake.requests[-1]
        sync_tokens, sync_seeds = self.client.sample(
            hidden, seeds=[7, 8], steps=3, temperature=0.5, n=2,
            request_id="r")
        self.assertEqual(async_request, self.fake.requests[-1])
        np.testing.assert_array_equal(tokens, sync_tokens)
        np.testing.assert_array_equal(seeds, sync_seeds)
        self.assertEqual(tokens.dtype, np.int32)
        self.assertEqual(seeds.dtype, np.uint64)

    def test_async_retries_unavailable_then_succeeds(self):
        self.fake.fail_first = 2
        (tokens, _), client = self.run_async(
            lambda c: c.sample(np.ones((1, 4), np.float32)))
        self.assertEqual(tokens.shape, (1, 1))
        self.assertEqual(client.attempts_retried, 2)
        self.assertEqual(len(self.fake.requests), 3)

    def test_async_calls_take_the_connections_in_turn(self):
        async def four_calls(client):
            for _ in range(4):
                await client.sample(np.ones((1, 4), np.float32))
        self.run_async(four_calls, connections=2)
        self.assertEqual(len(self.fake.peers), 2)

    def test_async_retries_cancelled_by_a_server_shutting_down(self):
        self.fake.fail_first = 1
        self.fake.fail_code = grpc.StatusCode.CANCELLED
        (tokens, _), client = self.run_async(
            lambda c: c.sample(np.ones((1, 4), np.float32)))
        self.assertEqual(tokens.shape, (1, 1))
        self.assertEqual(client.attempts_retried, 1)

    def test_async_errors_map_to_exceptions(self):
        self.fake.fail_first = 1
        self.fake.fail_code = grpc.StatusCode.INVALID_ARGUMENT
        with self.assertRaises(flashsampler_client.InvalidArgumentError):
            self.run_async(lambda c: c.sample(np.ones((1, 4), np.float32)))
        self.fake.fail_first = 100
        self.fake.fail_code = grpc.StatusCode.UNAVAILABLE
        with self.assertRaises(flashsampler_client.UnavailableError) as ctx:
            self.run_async(lambda c: c.sample(np.ones((1, 4), np.float32)),
                           retries=1)
        self.assertIn("gave up after 2 attempts", ctx.exception.message)

    def test_async_deadline(self):
        self.fake.delay = 1.0
        with self.assertRaises(flashsampler_client.DeadlineExceededError):
            self.run_async(lambda c: c.sample(np.ones((1, 4), np.float32),
                                              timeout=0.2))

    def test_async_model_info_and_health(self):
        async def both(client):
            return (await client.model_info(), await client.health(),
                    await client.health("flashsampler.v1.Sampler"),
                    await client.health("nope"))
        (info, whole, sampler, unknown), _ = self.run_async(both)
        self.assertEqual(info.backend, "fake")
        self.assertEqual((whole, sampler, unknown),
                         ("SERVING", "NOT_SERVING", "SERVICE_UNKNOWN"))

    def requests(self):
        ids = ["a", "b", "bad", "c", "d"]
        return [self.client.build_request(np.full((i + 1, 4), i, np.float32),
                                          seeds=list(range(i + 1)),
                                          request_id=rid)
                for i, rid in enumerate(ids)]

    def check_stream(self, responses):
        self.assertEqual([r.request_id for r in responses],
                         ["a", "b", "bad", "c", "d"])
        for i, response in enumerate(responses):
            if response.request_id == "bad":
                with self.assertRaises(
                        flashsampler_client.InvalidArgumentError) as ctx:
                    check_response(response)
                self.assertEqual(ctx.exception.message, "scripted refusal")
            else:
                self.assertIs(check_response(response), response)
                self.assertEqual(list(response.seeds), list(range(i + 1)))

    def test_sync_streams(self):
        self.check_stream(list(self.client.sample_stream(self.requests())))
        with self.client.open_stream() as stream:
            responses = [stream.sample(r) for r in self.requests()]
        self.check_stream(responses)
        with self.client.open_stream() as stream:
            for request in self.requests():
                stream.send(request)
            stream.close()
            self.check_stream(list(stream))
            with self.assertRaises(EOFError):
                stream.recv()
            with self.assertRaises(ValueError):
                stream.send(self.requests()[0])

    def test_async_streams(self):
        async def all_three(client):
            listed = [r async for r in client.sample_stream(self.requests())]
            async with client.open_stream() as stream:
                stepped = [await stream.sample(r) for r in self.requests()]
            stream = client.open_stream()

            async def writer():
                for request in self.requests():
                    await stream.send(request)
                await stream.close()
            task = asyncio.create_task(writer())
            piped = [r async for r in stream]
            await task
            return listed, stepped, piped
        for responses in self.run_async(all_three)[0]:
            self.check_stream(responses)

    def test_stream_failure_raises(self):
        self.server.stop(grace=None)
        with self.assertRaises(flashsampler_client.UnavailableError):
            list(self.client.sample_stream(self.requests()))
        with self.assertRaises(flashsampler_client.UnavailableError):
            self.run_async(lambda c: c.open_stream().sample(
                self.requests()[0]))


class FakeTensor:
    """The slice of torch.Tensor the client uses, recording the calls."""

    def __init__(self, torch, array, dtype, device, calls):
        self.torch, self.array, self.dtype = torch, array, dtype
        self.device = types.SimpleNamespace(type=device)
        self.calls = calls

    def _derive(self, name, array=None, dtype=None, device=None):
        self.calls.append(name)
        return FakeTensor(self.torch, self.array if array is None else array,
                          dtype or self.dtype, device or self.device.type,
                          self.calls)

    def detach(self):
        return self._derive("detach")

    def contiguous(self):
        return self._derive("contiguous",
                            array=np.ascontiguousarray(self.array))

    def cpu(self):
        return self._derive("cpu", array=self.array.copy(), device="cpu")

    def view(self, dtype):
        assert dtype is self.torch.int16
        return self._derive("view", array=self.array.view(np.int16),
                            dtype=dtype)

    def numpy(self):
        assert self.device.type == "cpu", "numpy() of a device tensor"
        self.calls.append("numpy")
        return self.array


def fake_torch_module():
    torch = types.ModuleType("torch")
    for name in ("float32", "float16", "bfloat16", "int16", "int64"):
        setattr(torch, name, type(name, (), {})())
    torch.Tensor = FakeTensor
    return torch


class TorchTensorTest(unittest.TestCase):

    def setUp(self):
        self.saved = sys.modules.get("torch")

    def tearDown(self):
        if self.saved is None:
            sys.modules.pop("torch", None)
        else:
            sys.modules["torch"] = self.saved

    def test_numpy_inputs_never_import_torch(self):
        sys.modules.pop("torch", None)
        flashsampler_client.FlashSamplerClient.build_request(
            None, np.ones((1, 4), np.float32))
        self.assertNotIn("torch", sys.modules)

    def test_fake_cuda_bf16_tensor_goes_to_the_host_once(self):
        torch = fake_torch_module()
        sys.modules["torch"] = torch
        bits = np.array([[0x3F80, 0x4000, 0xC040, 0x4080]], np.uint16)
        calls = []
        tensor = FakeTensor(torch, bits.view(np.int16).copy(), torch.bfloat16,
                            "cuda", calls)
        request = flashsampler_client.FlashSamplerClient.build_request(
            None, tensor, seeds=[3])
        self.assertEqual(calls, ["detach", "contiguous", "cpu", "view",
                                 "numpy"])
        self.assertEqual(request.hidden_states.dtype, sampler_pb2.DTYPE_BF16)
        self.assertEqual(list(request.hidden_states.shape), [1, 4])
        self.assertEqual(request.hidden_states.data, bits.tobytes())

    def test_fake_cpu_fp16_and_fp32_tensors(self):
        torch = fake_torch_module()
        sys.modules["torch"] = torch
        for dtype, np_dtype, wire in (
                (torch.float16, np.float16, sampler_pb2.DTYPE_FP16),
                (torch.float32, np.float32, sampler_pb2.DTYPE_FP32)):
            calls = []
            array = np.arange(6, dtype=np_dtype).reshape(2, 3)
            request = flashsampler_client.FlashSamplerClient.build_request(
                None, FakeTensor(torch, array, dtype, "cpu", calls))
            self.assertNotIn("cpu", calls)  # already on the host: no copy
            self.assertEqual(request.hidden_states.dtype, wire)
            self.assertEqual(request.hidden_states.data, array.tobytes())
        with self.assertRaises(TypeError):
            flashsampler_client.FlashSamplerClient.build_request(
                None, FakeTensor(torch, np.zeros((1, 2), np.int64),
                                 torch.int64, "cpu", []))

    @unittest.skipUnless(importlib.util.find_spec("torch"),
                         "torch is not installed: real torch tensors are "
                         "NOT tested here (only the stand-in module above)")
    def test_real_torch_tensors(self):
        import torch
        hidden = torch.randn(3, 8)
        for dtype, wire in ((torch.float32, sampler_pb2.DTYPE_FP32),
                            (torch.float16, sampler_pb2.DTYPE_FP16),
                            (torch.bfloat16, sampler_pb2.DTYPE_BF16)):
            cast = hidden.to(dtype)
            request = flashsampler_client.FlashSamplerClient.build_request(
                None, cast)
            self.assertEqual(request.hidden_states.dtype, wire)
            expected = (cast.view(torch.int16) if dtype == torch.bfloat16
                        else cast).numpy().tobytes()
            self.assertEqual(request.hidden_states.data, expected)


if __name__ == "__main__":
    unittest.main()
