#!/usr/bin/env python3
"""Writes the seed corpus of tests/fuzz (corpus/<target>/*): small valid and
nearly valid inputs for each target. Run from the build tree's python path:
PYTHONPATH=<build>/python tests/fuzz/make_corpus.py"""
import json
import os
import struct

from flashsampler.v1 import sampler_pb2 as pb

HERE = os.path.dirname(os.path.abspath(__file__))
D = 8  # hidden size the codec targets use


def request(rows, dtype=pb.DTYPE_FP32, **kw):
    r = pb.SampleRequest(request_id="seed")
    r.hidden_states.dtype = dtype
    r.hidden_states.shape.extend([rows, D])
    fmt = {pb.DTYPE_FP32: "f", pb.DTYPE_BF16: "e", pb.DTYPE_FP16: "e"}[dtype]
    vals = [((i * 37) % 17 - 8) / 8.0 for i in range(rows * D)]
    if dtype == pb.DTYPE_BF16:
        data = b"".join(struct.pack("<f", v)[2:] for v in vals)
    else:
        data = struct.pack("<%d%s" % (len(vals), fmt), *vals)
    r.hidden_states.data = data
    for k, v in kw.items():
        if k == "params":
            r.params.CopyFrom(v)
        elif k == "row_params":
            r.row_params.extend(v)
        else:
            getattr(r, k).extend(v)
    return r


def requests():
    p = pb.SamplingParams
    yield "greedy", request(1, params=p(temperature=0.0))
    yield "plain_bf16", request(2, pb.DTYPE_BF16)
    yield "fp16_seeds_steps", request(3, pb.DTYPE_FP16, seeds=[1, 2, 3],
                                      steps=[0, 5, 9])
    yield "filters", request(2, params=p(temperature=0.7, top_k=5, top_p=0.9,
                                         min_p=0.05, n=3))
    lp = pb.LogprobOptions(sampled_logprob=True, row_logsumexp=True,
                           top_logprobs=4, space=pb.LogprobOptions.PROCESSED)
    yield "penalties_logprobs", request(1, params=p(
        repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.2,
        prompt_token_ids=[1, 2, 299], output_token_counts=[
            pb.TokenCount(token_id=3, count=2)],
        logit_bias=[pb.TokenBias(token_id=7, bias=5.0)],
        banned_token_ids=[0, 4], logprobs=lp))
    words = [0] * ((300 + 31) // 32)
    words[0] = 0x0000F00F
    yield "bitmask_rows", request(2, row_params=[
        p(allowed_token_bitmask=words), p(allowed_token_bitmask=words)])


def safetensors(tensors, pad=True):
    header, blob = {}, b""
    for name, dtype, shape, data in tensors:
        header[name] = {"dtype": dtype, "shape": shape,
                        "data_offsets": [len(blob), len(blob) + len(data)]}
        blob += data
    text = json.dumps(header).encode()
    if pad:
        text += b" " * ((8 - len(text) % 8) % 8)
    return struct.pack("<Q", len(text)) + text + blob


def weights():
    f32 = struct.pack("<6f", 0.5, -1, 2, 0.25, -0.125, 3)
    bf16 = b"".join(struct.pack("<f", v)[2:] for v in (1, -2, 0.5, 4))
    f16 = struct.pack("<4e", 1, -2, 0.5, 4)
    # First byte: bit 0 index layout, bit 1 name the index file, bit 2 tensor
    # "t", bit 3 expected dtype (bit 4: bf16, else F32).
    yield "single_f32", b"\x00" + safetensors(
        [("lm_head.weight", "F32", [2, 3], f32)])
    yield "single_bf16_named", b"\x04" + safetensors(
        [("t", "BF16", [2, 2], bf16), ("norm", "F32", [1, 3], f32[:12])])
    yield "tied_f16", b"\x00" + safetensors(
        [("model.embed_tokens.weight", "F16", [2, 2], f16)], pad=False)
    yield "expect_bf16", b"\x18" + safetensors(
        [("lm_head.weight", "BF16", [1, 4], bf16)])
    index = json.dumps({"metadata": {"total_size": 24}, "weight_map": {
        "lm_head.weight": "model-00001.safetensors"}}).encode()
    yield "index_dir", b"\x01" + index + b"\x00" + safetensors(
        [("lm_head.weight", "F32", [2, 3], f32)])
    yield "index_file", b"\x03" + index + b"\x00" + safetensors(
        [("lm_head.weight", "F32", [3, 2], f32)])


def frame(message):
    return b"\x00" + struct.pack(">I", len(message)) + message


def streams():
    reqs = [r.SerializeToString() for _, r in requests()]
    yield "one", frame(reqs[0])
    yield "three", b"".join(frame(m) for m in reqs[1:4])
    yield "bad_middle", frame(reqs[0]) + frame(b"\xff\xff\xff") + frame(reqs[2])
    yield "compressed", b"\x01" + struct.pack(">I", 2) + b"\x0a\x00" + frame(
        reqs[0])
    yield "truncated", frame(reqs[1]) + frame(reqs[2])[:-3]


def write(target, items):
    folder = os.path.join(HERE, "corpus", target)
    os.makedirs(folder, exist_ok=True)
    for name, data in items:
        with open(os.path.join(folder, name), "wb") as out:
            out.write(data)


write("request_codec", [(n, b"\x00" + r.SerializeToString())
                        for n, r in requests()] +
      [("cuda_controls_bf16", b"\x05" + request(2).SerializeToString())])
write("safetensors", weights())
write("stream_framing", streams())
