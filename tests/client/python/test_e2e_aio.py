"""The asyncio client and SampleStream against the real flashsamplerd (CPU
backend, synthetic weights): 256 concurrent calls through one grpc.aio
channel while the event loop keeps running, and SampleStream from the
synchronous and the asyncio client answering in order, a refused request in
the middle answered with its error and the stream going on.

Environment (tests/client/CMakeLists.txt): FLASHSAMPLERD, PYTHONPATH with
<build>/python and client/python.
"""

import asyncio
import time
import unittest

import numpy as np

import flashsampler_client
from daemon import Daemon
from flashsampler_client import check_response
from flashsampler_client.aio import AsyncFlashSamplerClient

VOCAB, HIDDEN = 1000, 64
CONCURRENT = 256
STREAMED = 40


class AsyncDaemonTest(unittest.TestCase):

    @classmethod
    def setUpClass(cls):
        cls.daemon = Daemon(VOCAB, HIDDEN)
        cls.client = flashsampler_client.FlashSamplerClient(
            cls.daemon.target, timeout=60.0)
        rng = np.random.default_rng(11)
        cls.hidden = rng.standard_normal(
            (CONCURRENT, 2, HIDDEN)).astype(np.float32)

    @classmethod
    def tearDownClass(cls):
        cls.client.close()
        code = cls.daemon.stop()
        if code != 0:
            raise AssertionError(f"flashsamplerd exit status {code} after "
                                 "SIGTERM; log:\n" + "".join(cls.daemon.log))

    def expected(self, i, step=0):
        """The synchronous client's unary answer for request i."""
        tokens, _ = self.client.sample(self.hidden[i], seeds=[i, i + 1000],
                                       steps=step)
        return tokens

    def test_256_concurrent_calls_on_one_channel(self):
        ticks = []

        async def ticker(stop):
            while not stop.is_set():
                ticks.append(time.monotonic())
                await asyncio.sleep(0.005)

        async def run():
            async with AsyncFlashSamplerClient(self.daemon.target,
                                               timeout=60.0) as client:
                stop = asyncio.Event()
                tick_task = asyncio.create_task(ticker(stop))
                start = time.monotonic()
                results = await asyncio.gather(*(
                    client.sample(self.hidden[i], seeds=[i, i + 1000])
                    for i in range(CONCURRENT)))
                elapsed = time.monotonic() - start
                stop.set()
                await tick_task
                self.assertEqual(await client.health(), "SERVING")
                return results, elapsed

        results, elapsed = asyncio.run(run())
        self.assertEqual(len(results), CONCURRENT)
        for i, (tokens, seeds) in enumerate(results):
            self.assertEqual(tokens.shape, (2, 1))
            self.assertEqual(seeds.tolist(), [i, i + 1000])
        # Same tokens as the blocking client for a sample of the requests.
        for i in (0, 1, 77, CONCURRENT - 1):
            np.testing.assert_array_equal(results[i][0], self.expected(i))
        # The loop kept running while the calls were in flight: a blocking
        # client would have let the ticker run only before and after.
        self.assertGreaterEqual(len(ticks), 3, (len(ticks), elapsed))

    def stream_requests(self):
        """STREAMED requests, request 5 refused (wrong hidden size)."""
        requests = []
        for i in range(STREAMED):
            hidden = (np.ones((1, HIDDEN - 1), np.float32) if i == 5
                      else self.hidden[i])
            requests.append(self.client.build_request(
                hidden, seeds=[i, i + 1000][:hidden.shape[0]], steps=i % 3,
                request_id=f"r{i}"))
        return requests

    def check_stream(self, responses):
        self.assertEqual([r.request_id for r in responses],
                         [f"r{i}" for i in range(STREAMED)])
        for i, response in enumerate(responses):
            if i == 5:
                self.assertEqual(response.error.code, 3)  # INVALID_ARGUMENT
                with self.assertRaises(
                        flashsampler_client.InvalidArgumentError):
                    check_response(response)
                continue
            check_response(response)
            tokens = np.asarray(response.token_ids).reshape(-1, 1)
            np.testing.assert_array_equal(tokens, self.expected(i, i % 3))

    def test_sync_sample_stream_in_order(self):
        self.check_stream(list(self.client.sample_stream(
            self.stream_requests(), timeout=60)))

    def test_sync_open_stream_pipelined(self):
        requests = self.stream_requests()
        with self.client.open_stream(timeout=60) as stream:
            for request in requests:  # all in flight before the first recv
                stream.send(request)
            stream.close()
            responses = list(stream)
        self.check_stream(responses)

    def test_aio_sample_stream_in_order(self):
        requests = self.stream_requests()

        async def produce():
            for request in requests:
                await asyncio.sleep(0)
                yield request

        async def run():
            async with AsyncFlashSamplerClient(self.daemon.target) as client:
                from_list = [r async for r in client.sample_stream(requests)]
                from_gen = [r async for r in client.sample_stream(produce())]
                stepped = []
                async with client.open_stream(timeout=60) as stream:
                    for request in requests:
                        stepped.append(await stream.sample(request))
                return from_list, from_gen, stepped

        for responses in asyncio.run(run()):
            self.check_stream(responses)


if __name__ == "__main__":
    unittest.main()
