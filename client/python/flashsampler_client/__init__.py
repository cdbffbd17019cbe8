"""Python client of flashsamplerd: hidden states (numpy arrays or torch
tensors) in, token ids out. FlashSamplerClient blocks; AsyncFlashSamplerClient
(flashsampler_client.aio) has the same API for asyncio.

    from flashsampler_client import FlashSamplerClient
    client = FlashSamplerClient("localhost:50051")
    tokens, seeds = client.sample(hidden_f32_BxD, seeds=[1, 2])
"""

from flashsampler_client._common import (DeadlineExceededError,
                                         FieldViolation, FlashSamplerError,
                                         InvalidArgumentError,
                                         ResourceExhaustedError,
                                         SharedMemoryRegion,
                                         UnavailableError, UnimplementedError,
                                         check_response)
from flashsampler_client.client import (FlashSamplerClient, SampleStream,
                                        sampler_pb2)

__all__ = [
    "FlashSamplerClient",
    "SampleStream",
    "SharedMemoryRegion",
    "FlashSamplerError",
    "FieldViolation",
    "InvalidArgumentError",
    "UnavailableError",
    "ResourceExhaustedError",
    "DeadlineExceededError",
    "UnimplementedError",
    "check_response",
    "sampler_pb2",
]
__version__ = "0.2.0"
