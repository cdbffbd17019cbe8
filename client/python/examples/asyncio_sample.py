"""asyncio caller of flashsamplerd: many concurrent Sample calls on one
channel, then one decode loop on a SampleStream.

    python3 asyncio_sample.py localhost:50051 [concurrency]

Prints one line per phase and "ok" at the end; exits non-zero on failure.
"""

import asyncio
import sys

import numpy as np

from flashsampler_client import check_response
from flashsampler_client.aio import AsyncFlashSamplerClient


async def main(target: str, concurrency: int) -> None:
    async with AsyncFlashSamplerClient(target, timeout=30.0) as client:
        info = await client.model_info()
        rng = np.random.default_rng(0)
        hidden = rng.standard_normal(
            (concurrency, 2, info.hidden_size)).astype(np.float32)

        # Concurrent unary calls: the event loop stays free while they run.
        results = await asyncio.gather(*(
            client.sample(hidden[i], seeds=[2 * i, 2 * i + 1])
            for i in range(concurrency)))
        for tokens, seeds in results:
            assert tokens.shape == (2, 1) and seeds.shape == (2,)
            assert ((tokens >= 0) & (tokens < info.vocab_size)).all()
        print(f"{concurrency} concurrent calls: ok")

        # A decode loop: one stream, one request per step, seeds fixed and
        # the step advancing (replayable generation).
        async with client.open_stream() as stream:
            for step in range(8):
                request = client.build_request(hidden[0], seeds=[7, 8],
                                               steps=step,
                                               request_id=f"step-{step}")
                response = check_response(await stream.sample(request))
                assert response.request_id == f"step-{step}"
        print("stream of 8 steps: ok")
    print("ok")


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1],
                     int(sys.argv[2]) if len(sys.argv) > 2 else 64))
