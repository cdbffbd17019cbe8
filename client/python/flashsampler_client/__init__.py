"""Python client of flashsamplerd: numpy hidden states in, token ids out.

    from flashsampler_client import FlashSamplerClient
    client = FlashSamplerClient("localhost:50051")
    tokens, seeds = client.sample(hidden_f32_BxD, seeds=[1, 2])
"""

from flashsampler_client.client import (DeadlineExceededError,
                                        FlashSamplerClient, FlashSamplerError,
                                        InvalidArgumentError,
                                        ResourceExhaustedError,
                                        UnavailableError, UnimplementedError,
                                        sampler_pb2)

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
__version__ = "0.1.0"
