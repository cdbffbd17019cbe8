"""flashsampler_client against scripted in-process gRPC servers: request
encoding (dtypes, shapes, seeds, steps, params), response decoding, retries
with backoff, deadlines, error mapping, several connections and the
hand-encoded health protocol.

Run: PYTHONPATH=<build>/python:client/python /usr/bin/python3 -m unittest
"""

import os
import threading
import time
import unittest
from concurrent import futures

import grpc
import numpy as np

from flashsampler.v1 import sampler_pb2, sampler_pb2_grpc
import flashsampler_client
from flashsampler_client import _common
from flashsampler_client import _common


def _pb_bytes(number: int, payload: bytes) -> bytes:
    """A length-delimited protobuf field, written by hand (no
    googleapis-common-protos here either)."""
    return (_common._varint(number << 3 | 2) + _common._varint(len(payload))
            + payload)


def status_details(code, message, violations, reason):
    """A serialized google.rpc.Status with a BadRequest and an ErrorInfo."""
    bad_request = b"".join(
        _pb_bytes(1, _pb_bytes(1, f.encode()) + _pb_bytes(2, d.encode()))
        for f, d in violations)
    info = _pb_bytes(1, reason.encode()) + _pb_bytes(2, b"flashsampler")
    details = b""
    for url, value in (("google.rpc.BadRequest", bad_request),
                       ("google.rpc.ErrorInfo", info)):
        details += _pb_bytes(3, _pb_bytes(
            1, ("type.googleapis.com/" + url).encode()) + _pb_bytes(2, value))
    return (_common._varint(1 << 3) + _common._varint(code)
            + _pb_bytes(2, message.encode()) + details)


class FakeSampler(sampler_pb2_grpc.SamplerServicer):
    """Fails the first `fail_first` calls with `fail_code`, records requests
    and arrival times, answers token = 100 * row + sample."""

    def __init__(self):
        self.fail_first = 0
        self.fail_code = grpc.StatusCode.UNAVAILABLE
        self.fail_message = "scripted failure"
        self.fail_details = b""  # grpc-status-details-bin of the failures
        self.delay = 0.0
        self.requests = []
        self.arrivals = []
        self.peers = set()  # the connections Sample calls came on
        self.lock = threading.Lock()

    def Sample(self, request, context):
        with self.lock:
            self.requests.append(request)
            self.arrivals.append(time.monotonic())
            self.peers.add(context.peer())
            call = len(self.requests)
        if call <= self.fail_first:
            if self.fail_details:
                context.set_trailing_metadata(
                    (("grpc-status-details-bin", self.fail_details),))
            context.abort(self.fail_code, f"{self.fail_message} {call}")
        if self.delay:
            time.sleep(self.delay)
        rows = request.hidden_states.shape[0]
        n = request.params.n if request.params.HasField("n") else 1
        response = sampler_pb2.SampleResponse(request_id=request.request_id,
                                              n=n)
        for row in range(rows):
            response.token_ids.extend(100 * row + j for j in range(n))
            response.seeds.append(request.seeds[row] if request.seeds
                                  else 5000 + row)
        return response

    def SampleStream(self, request_iterator, context):
        """One answer per request in order; a request whose request_id is
        "bad" gets an INVALID_ARGUMENT error response."""
        for request in request_iterator:
            if request.request_id == "bad":
                yield sampler_pb2.SampleResponse(
                    request_id="bad", error=sampler_pb2.Error(
                        code=grpc.StatusCode.INVALID_ARGUMENT.value[0],
                        message="scripted refusal"))
                continue
            yield self.Sample(request, context)

    def GetModelInfo(self, request, context):
        return sampler_pb2.ModelInfo(vocab_size=1000, hidden_size=4,
                                     backend="fake")


def _health_handler(statuses):
    """grpc.health.v1.Health/Check over raw bytes, decoded here with the
    generated descriptor-free logic of a real server: field 1 = service."""

    def check(request_bytes, context):
        service = ""
        if request_bytes:
            # 0x0a, length, bytes: one length-delimited field 1.
            length = request_bytes[1]
            service = request_bytes[2:2 + length].decode()
        if service not in statuses:
            context.abort(grpc.StatusCode.NOT_FOUND, "unknown service")
        return bytes([0x08, statuses[service]])

    return grpc.method_handlers_generic_handler(
        "grpc.health.v1.Health",
        {"Check": grpc.unary_unary_rpc_method_handler(
            check, request_deserializer=None, response_serializer=None)})


class FakeServerCase(unittest.TestCase):
    """A FakeSampler with health on 127.0.0.1 and a blocking client."""

    def setUp(self):
        self.fake = FakeSampler()
        self.statuses = {"": 1, "flashsampler.v1.Sampler": 2}
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        sampler_pb2_grpc.add_SamplerServicer_to_server(self.fake, self.server)
        self.server.add_generic_rpc_handlers(
            (_health_handler(self.statuses),))
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.server.start()
        self.client = flashsampler_client.FlashSamplerClient(
            f"127.0.0.1:{self.port}", timeout=5.0, retries=3, backoff=0.04,
            jitter=0.25)

    def tearDown(self):
        self.client.close()
        self.server.stop(grace=None)


class ClientTest(FakeServerCase):

    def test_float32_request_and_tokens(self):
        hidden = np.arange(8, dtype=np.float32).reshape(2, 4)
        tokens, seeds = self.client.sample(hidden, seeds=[7, 8], steps=3,
                                           temperature=0.5, n=2,
                                           request_id="r")
        np.testing.assert_array_equal(tokens, [[0, 1], [100, 101]])
        self.assertEqual(tokens.dtype, np.int32)
        np.testing.assert_array_equal(seeds, [7, 8])
        self.assertEqual(seeds.dtype, np.uint64)
        request = self.fake.requests[-1]
        self.assertEqual(request.hidden_states.dtype, sampler_pb2.DTYPE_FP32)
        self.assertEqual(list(request.hidden_states.shape), [2, 4])
        self.assertEqual(request.hidden_states.data, hidden.tobytes())
        self.assertEqual(list(request.seeds), [7, 8])
        self.assertEqual(list(request.steps), [3, 3])
        self.assertAlmostEqual(request.params.temperature, 0.5)
        self.assertEqual(request.params.n, 2)
        self.assertFalse(request.params.HasField("top_p"))
        self.assertEqual(request.request_id, "r")

    def test_server_drawn_seeds_are_returned(self):
        tokens, seeds = self.client.sample(np.ones((3, 4), np.float32))
        self.assertEqual(tokens.shape, (3, 1))
        np.testing.assert_array_equal(seeds, [5000, 5001, 5002])
        self.assertEqual(len(self.fake.requests[-1].seeds), 0)

    def test_dtypes_map_to_wire_dtypes(self):
        bf16_bits = np.array([[0x3F80, 0x4000, 0x4040, 0x4080]], np.uint16)
        self.client.sample(bf16_bits)
        request = self.fake.requests[-1]
        self.assertEqual(request.hidden_states.dtype, sampler_pb2.DTYPE_BF16)
        self.assertEqual(request.hidden_states.data, bf16_bits.tobytes())

        half = np.array([1, 2, 3, 4], np.float16)  # 1-D: one row
        self.client.sample(half)
        request = self.fake.requests[-1]
        self.assertEqual(request.hidden_states.dtype, sampler_pb2.DTYPE_FP16)
        self.assertEqual(list(request.hidden_states.shape), [1, 4])

        big_endian = np.arange(4, dtype=">f4").reshape(1, 4)
        self.client.sample(big_endian)
        self.assertEqual(self.fake.requests[-1].hidden_states.data,
                         big_endian.astype("<f4").tobytes())

        with self.assertRaisesRegex(TypeError, "float64"):
            self.client.sample(np.ones((1, 4)))
        with self.assertRaisesRegex(ValueError, "shape"):
            self.client.sample(np.ones((1, 2, 2), np.float32))
        with self.assertRaisesRegex(ValueError, "seeds"):
            self.client.sample(np.ones((2, 4), np.float32), seeds=[1])

    def test_params_message_replaces_keyword_controls(self):
        params = sampler_pb2.SamplingParams(temperature=0.0, top_k=5)
        params.logit_bias.add(token_id=3, bias=1.5)
        self.client.sample(np.ones((1, 4), np.float32), params=params,
                           temperature=0.9)
        sent = self.fake.requests[-1].params
        self.assertEqual(sent.temperature, 0.0)
        self.assertEqual(sent.top_k, 5)
        self.assertEqual(sent.logit_bias[0].token_id, 3)

    def test_retries_unavailable_with_backoff(self):
        self.fake.fail_first = 3
        tokens, _ = self.client.sample(np.ones((1, 4), np.float32))
        self.assertEqual(tokens.shape, (1, 1))
        self.assertEqual(len(self.fake.requests), 4)
        self.assertEqual(self.client.attempts_retried, 3)
        gaps = np.diff(self.fake.arrivals)
        for k, base in enumerate([0.04, 0.08, 0.16]):
            self.assertGreaterEqual(gaps[k], base * 0.75, f"retry {k + 1}")
            self.assertLess(gaps[k], base * 1.25 + 1.0, f"retry {k + 1}")

    def test_cancelled_by_a_server_shutting_down_was_not_retried(self):
        # gRPC drops calls a shutting-down server had not accepted with
        # CANCELLED; the client never cancels its own calls, so it retries.
        self.fake.fail_first = 1
        self.fake.fail_code = grpc.StatusCode.CANCELLED
        tokens, _ = self.client.sample(np.ones((1, 4), np.float32))
        self.assertEqual(tokens.shape, (1, 1))
        self.assertEqual(self.client.attempts_retried, 1)

    def test_gives_up_after_retries_with_unavailable_error(self):
        self.fake.fail_first = 100
        with self.assertRaises(flashsampler_client.UnavailableError) as ctx:
            self.client.sample(np.ones((1, 4), np.float32))
        self.assertEqual(ctx.exception.code, grpc.StatusCode.UNAVAILABLE)
        self.assertIn("scripted failure 4", ctx.exception.message)
        self.assertIn("after 4 attempts", ctx.exception.message)
        self.assertIsInstance(ctx.exception, ConnectionError)
        self.assertEqual(len(self.fake.requests), 4)

    def test_invalid_argument_maps_to_exception_with_message(self):
        self.fake.fail_first = 1
        self.fake.fail_code = grpc.StatusCode.INVALID_ARGUMENT
        self.fake.fail_message = "hidden_states.shape[1]: expected 4"
        with self.assertRaises(flashsampler_client.InvalidArgumentError) as ctx:
            self.client.sample(np.ones((1, 4), np.float32))
        self.assertIn("hidden_states.shape[1]: expected 4",
                      ctx.exception.message)
        self.assertIsInstance(ctx.exception, ValueError)
        self.assertEqual(len(self.fake.requests), 1)  # not retried

    def test_invalid_argument_carries_field_violations(self):
        self.fake.fail_first = 1
        self.fake.fail_code = grpc.StatusCode.INVALID_ARGUMENT
        self.fake.fail_message = "row_params[3].top_p: must be in (0, 1]"
        self.fake.fail_details = status_details(
            3, "row_params[3].top_p: must be in (0, 1]",
            [("row_params[3].top_p", "must be in (0, 1]")],
            "INVALID_SAMPLING_PARAMS")
        with self.assertRaises(flashsampler_client.InvalidArgumentError) as ctx:
            self.client.sample(np.ones((1, 4), np.float32))
        self.assertEqual(ctx.exception.field_violations, [
            flashsampler_client.FieldViolation("row_params[3].top_p",
                                               "must be in (0, 1]")])
        self.assertEqual(ctx.exception.field_violations[0].field,
                         "row_params[3].top_p")
        self.assertEqual(ctx.exception.reason, "INVALID_SAMPLING_PARAMS")

    def test_errors_without_details_have_no_violations(self):
        self.fake.fail_first = 1
        self.fake.fail_code = grpc.StatusCode.INVALID_ARGUMENT
        with self.assertRaises(flashsampler_client.InvalidArgumentError) as ctx:
            self.client.sample(np.ones((1, 4), np.float32))
        self.assertEqual(ctx.exception.field_violations, [])
        self.assertEqual(ctx.exception.reason, "")

    def test_other_codes_map_to_their_exceptions(self):
        cases = [
            (grpc.StatusCode.RESOURCE_EXHAUSTED,
             flashsampler_client.ResourceExhaustedError),
            (grpc.StatusCode.UNIMPLEMENTED,
             flashsampler_client.UnimplementedError),
            (grpc.StatusCode.INTERNAL, flashsampler_client.FlashSamplerError),
        ]
        for code, error in cases:
            self.fake.requests.clear()
            self.fake.fail_first = 1
            self.fake.fail_code = code
            with self.assertRaises(error) as ctx:
                self.client.sample(np.ones((1, 4), np.float32))
            self.assertEqual(ctx.exception.code, code)
            self.assertEqual(len(self.fake.requests), 1)

    def test_deadline_exceeded(self):
        self.fake.delay = 2.0
        start = time.monotonic()
        with self.assertRaises(flashsampler_client.DeadlineExceededError):
            self.client.sample(np.ones((1, 4), np.float32), timeout=0.2)
        self.assertLess(time.monotonic() - start, 1.5)

    def test_model_info(self):
        info = self.client.model_info()
        self.assertEqual(info.vocab_size, 1000)
        self.assertEqual(info.hidden_size, 4)

    def test_health(self):
        self.assertEqual(self.client.health(), "SERVING")
        self.assertEqual(self.client.health("flashsampler.v1.Sampler"),
                         "NOT_SERVING")
        self.assertEqual(self.client.health("no.such.Service"),
                         "SERVICE_UNKNOWN")

    def test_calls_take_the_connections_in_turn(self):
        for connections in (1, 3):
            with self.subTest(connections=connections):
                with self.fake.lock:
                    self.fake.peers.clear()
                with flashsampler_client.FlashSamplerClient(
                        f"127.0.0.1:{self.port}", timeout=5.0,
                        connections=connections) as client:
                    for _ in range(6):
                        tokens, _ = client.sample(np.ones((2, 4), np.float32),
                                                  seeds=[1, 2])
                        np.testing.assert_array_equal(tokens, [[0], [100]])
                self.assertEqual(len(self.fake.peers), connections)

    def test_connections_out_of_range_are_refused(self):
        for connections in (0, 65):
            with self.assertRaisesRegex(ValueError, "connections"):
                flashsampler_client.FlashSamplerClient(
                    f"127.0.0.1:{self.port}", connections=connections)

    def test_unreachable_target(self):
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=1))
        port = server.add_insecure_port("127.0.0.1:0")
        server.start()
        server.stop(grace=None)  # nothing listens on `port` now
        with flashsampler_client.FlashSamplerClient(
                f"127.0.0.1:{port}", timeout=3.0, retries=1,
                backoff=0.01) as dead:
            with self.assertRaises(flashsampler_client.UnavailableError):
                dead.model_info()
            self.assertEqual(dead.attempts_retried, 1)


TESTDATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..",
                        "testdata")


def _pem(name):
    with open(os.path.join(TESTDATA, name), "rb") as f:
        return f.read()


class MutualTlsTest(unittest.TestCase):
    """The test CA and certificates of tests/client/testdata (README there)."""

    def setUp(self):
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        sampler_pb2_grpc.add_SamplerServicer_to_server(FakeSampler(),
                                                       self.server)
        credentials = grpc.ssl_server_credentials(
            [(_pem("server.key"), _pem("server.pem"))],
            root_certificates=_pem("ca.pem"), require_client_auth=True)
        self.port = self.server.add_secure_port("127.0.0.1:0", credentials)
        self.server.start()

    def tearDown(self):
        self.server.stop(grace=None)

    def client(self, **tls):
        return flashsampler_client.FlashSamplerClient(
            f"127.0.0.1:{self.port}", timeout=5.0, retries=0,
            server_name_override="localhost", **tls)

    def test_client_certificate_from_paths_is_accepted(self):
        with self.client(
                root_certificates=os.path.join(TESTDATA, "ca.pem"),
                private_key=os.path.join(TESTDATA, "client.key"),
                certificate_chain=os.path.join(TESTDATA, "client.pem")) as c:
            self.assertEqual(c.model_info().vocab_size, 1000)

    def test_missing_or_foreign_client_certificate_is_refused(self):
        with self.client(root_certificates=_pem("ca.pem")) as c:
            with self.assertRaises(flashsampler_client.UnavailableError):
                c.model_info()
        with self.client(root_certificates=_pem("ca.pem"),
                         private_key=_pem("other_client.key"),
                         certificate_chain=_pem("other_client.pem")) as c:
            with self.assertRaises(flashsampler_client.UnavailableError):
                c.model_info()
        with self.assertRaisesRegex(ValueError, "go together"):
            self.client(root_certificates=_pem("ca.pem"),
                        private_key=_pem("client.key"))


class HealthCodecTest(unittest.TestCase):

    def test_round_trip(self):
        self.assertEqual(_common.encode_health_request(""), b"")
        self.assertEqual(_common.encode_health_request("ab"),
                         b"\x0a\x02ab")
        long_name = "x" * 200
        encoded = _common.encode_health_request(long_name)
        self.assertEqual(encoded[:3], b"\x0a\xc8\x01")
        self.assertEqual(_common.decode_health_response(b""), "UNKNOWN")
        self.assertEqual(_common.decode_health_response(b"\x08\x01"),
                         "SERVING")
        # Unknown fields are skipped.
        self.assertEqual(
            _common.decode_health_response(b"\x12\x01z\x08\x02"),
            "NOT_SERVING")


if __name__ == "__main__":
    unittest.main()
