"""End to end against the real flashsamplerd (CPU backend, synthetic weights)
over loopback: the Python client and flashsampler-cli (the C++ client) get
identical tokens for the same hidden states and seeds; model info, health
and error mapping; the metric names the alert rules and dashboard use exist;
fs_load (unary, --stream and --shared_memory) and plot_latency.py work
against it; hidden states by shared memory get the tokens of their bytes;
SIGTERM stops it with exit 0.

Environment (set by tests/client/CMakeLists.txt): FLASHSAMPLERD,
FLASHSAMPLER_CLI, FS_LOAD (paths of the built binaries), PYTHONPATH with
<build>/python and client/python.
"""

import json
import os
import re
import subprocess
import tempfile
import unittest
import urllib.request

import grpc
import numpy as np

import flashsampler_client
from daemon import Daemon, free_port

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..",
                                    ".."))
VOCAB, HIDDEN = 1000, 64


def parse_cli_sample(stdout):
    """'row i: t0 t1 ...' lines and the 'seeds: ...' line of the CLI."""
    rows, seeds = {}, None
    for line in stdout.splitlines():
        match = re.fullmatch(r"row (\d+): ([\d ]+)", line)
        if match:
            rows[int(match.group(1))] = [int(t) for t in match.group(2).split()]
        elif line.startswith("seeds:"):
            seeds = [int(s) for s in line.split()[1:]]
    tokens = np.array([rows[i] for i in range(len(rows))], dtype=np.int32)
    return tokens, np.array(seeds, dtype=np.uint64)


class DaemonTest(unittest.TestCase):

    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.TemporaryDirectory(prefix="fs_e2e_")
        cls.metrics_port = free_port()
        cls.daemon = Daemon(VOCAB, HIDDEN, [
            f"--metrics_port={cls.metrics_port}",
            "--metrics_address=127.0.0.1", "--max_shared_memory_regions=4"])
        cls.target = cls.daemon.target
        cls.client = flashsampler_client.FlashSamplerClient(
            cls.target, timeout=20.0, retries=3)

    @classmethod
    def tearDownClass(cls):
        cls.client.close()
        code = cls.daemon.stop()
        cls.tmp.cleanup()
        if code != 0:
            raise AssertionError(f"flashsamplerd exit status {code} after "
                                 "SIGTERM; log:\n" + "".join(cls.daemon.log))

    def cli(self, *args, check=True):
        result = subprocess.run(
            [os.environ["FLASHSAMPLER_CLI"], *args, f"--target={self.target}",
             "--timeout=20s"],
            capture_output=True, text=True, timeout=60)
        if check:
            self.assertEqual(result.returncode, 0, result.stderr)
        return result

    def save(self, name, array):
        path = os.path.join(self.tmp.name, name)
        np.save(path, array)
        return path

    def test_health_is_serving(self):
        self.assertEqual(self.client.health(), "SERVING")
        self.assertEqual(self.client.health("flashsampler.v1.Sampler"),
                         "SERVING")
        self.assertEqual(self.cli("health").stdout.strip(), "SERVING")

    def test_model_info_from_both_clients(self):
        info = self.client.model_info()
        self.assertEqual(info.vocab_size, VOCAB)
        self.assertEqual(info.hidden_size, HIDDEN)
        self.assertEqual(info.backend, "cpu")
        cli_info = json.loads(self.cli("info", "--json").stdout)
        self.assertEqual(int(cli_info["vocab_size"]), VOCAB)
        self.assertEqual(int(cli_info["hidden_size"]), HIDDEN)
        self.assertEqual(cli_info["backend"], "cpu")

    def test_python_and_cli_sample_identical_tokens(self):
        rng = np.random.default_rng(123)
        hidden = rng.standard_normal((6, HIDDEN)).astype(np.float32) * 4
        path = self.save("h32.npy", hidden)
        cases = [
            dict(py={}, cli=[]),
            dict(py=dict(n=3, steps=7, temperature=0.7),
                 cli=["--n=3", "--step=7", "--temperature=0.7"]),
            dict(py=dict(temperature=0.0), cli=["--temperature=0"]),
            dict(py=dict(top_k=20, top_p=0.9),
                 cli=["--top_k=20", "--top_p=0.9"]),
        ]
        seeds = np.arange(11, 17, dtype=np.uint64)
        for case in cases:
            with self.subTest(case=case["cli"]):
                py_tokens, py_seeds = self.client.sample(hidden, seeds=seeds,
                                                         **case["py"])
                out = self.cli("sample", f"--hidden_file={path}", "--seed=11",
                               *case["cli"]).stdout
                cli_tokens, cli_seeds = parse_cli_sample(out)
                np.testing.assert_array_equal(py_seeds, seeds)
                np.testing.assert_array_equal(cli_seeds, seeds)
                np.testing.assert_array_equal(py_tokens, cli_tokens)
                self.assertEqual(py_tokens.shape[0], 6)
                self.assertTrue(((py_tokens >= 0) & (py_tokens < VOCAB)).all())

    def test_bf16_and_fp16_inputs_agree_across_clients(self):
        rng = np.random.default_rng(7)
        hidden = rng.standard_normal((3, HIDDEN)).astype(np.float32)
        bf16_bits = (hidden.view(np.uint32) >> 16).astype(np.uint16)
        for name, array in (("bf16.npy", bf16_bits),
                            ("fp16.npy", hidden.astype(np.float16))):
            with self.subTest(dtype=name):
                py_tokens, _ = self.client.sample(array, seeds=[1, 2, 3])
                out = self.cli("sample",
                               f"--hidden_file={self.save(name, array)}",
                               "--seed=1,2,3").stdout
                np.testing.assert_array_equal(py_tokens,
                                              parse_cli_sample(out)[0])

    def test_hidden_states_by_shared_memory_get_the_same_tokens(self):
        rng = np.random.default_rng(9)
        hidden = rng.standard_normal((5, HIDDEN)).astype(np.float32) * 3
        bf16_bits = (hidden.view(np.uint32) >> 16).astype(np.uint16)
        seeds = [3, 4, 5, 6, 7]
        with flashsampler_client.SharedMemoryRegion(1 << 16) as region:
            self.client.register_shared_memory("e2e", region.key, region.size)
            try:
                for array, offset in ((hidden, 0), (bf16_bits, 4096)):
                    with self.subTest(dtype=array.dtype.name):
                        inline, _ = self.client.sample(array, seeds=seeds,
                                                       top_k=50)
                        tensor = region.tensor(array, "e2e", offset)
                        self.assertEqual(tensor.data, b"")
                        by_ref, _ = self.client.sample(tensor, seeds=seeds,
                                                       top_k=50)
                        np.testing.assert_array_equal(inline, by_ref)
                info = self.client.model_info()
                self.assertEqual(info.max_shared_memory_regions, 4)
            finally:
                self.client.unregister_shared_memory("e2e")
            with self.assertRaises(flashsampler_client.FlashSamplerError) as ctx:
                self.client.sample(region.tensor(hidden, "e2e"))
            self.assertEqual(ctx.exception.code, grpc.StatusCode.NOT_FOUND)
            self.assertIn("hidden_states.shared_memory.region",
                          ctx.exception.message)
        # fs_load sends its hidden states by reference too.
        out = subprocess.run(
            [os.environ["FS_LOAD"], f"--target={self.target}",
             "--concurrency=2", "--rows=8", "--duration=0.3s",
             "--warmup=0s", "--shared_memory"],
            capture_output=True, text=True, timeout=60)
        self.assertEqual(out.returncode, 0, out.stderr)
        self.assertIn("hidden states in shared memory", out.stdout)

    def test_server_drawn_seeds_replay(self):
        hidden = np.random.default_rng(5).standard_normal(
            (4, HIDDEN)).astype(np.float32)
        tokens, seeds = self.client.sample(hidden, n=2)
        self.assertEqual(seeds.shape, (4,))
        replay, _ = self.client.sample(hidden, seeds=seeds, n=2)
        np.testing.assert_array_equal(tokens, replay)

    def test_sampled_ranks_and_logprobs_match_the_top_list(self):
        # top_k 5 keeps the five listed tokens (processed space): each
        # sample's rank is 1 + its place in the top list, and its logprob
        # the listed one (float logits: no ties).
        hidden = np.random.default_rng(9).standard_normal(
            (3, HIDDEN)).astype(np.float32)
        params = flashsampler_client.sampler_pb2.SamplingParams(
            top_k=5, n=4)
        params.logprobs.sampled_logprob = True
        params.logprobs.sampled_rank = True
        params.logprobs.top_logprobs = 5
        params.logprobs.space = (
            flashsampler_client.sampler_pb2.LogprobOptions.PROCESSED)
        response = self.client.sample_response(hidden, params=params,
                                               seeds=[1, 2, 3])
        self.assertEqual(len(response.sampled_ranks), 12)
        for row in range(3):
            listed = list(response.top_logprobs[row].token_ids)
            self.assertEqual(len(listed), 5)
            for j in range(4):
                token = response.token_ids[row * 4 + j]
                place = listed.index(token)
                self.assertEqual(response.sampled_ranks[row * 4 + j],
                                 place + 1)
                self.assertAlmostEqual(
                    response.sampled_logprobs[row * 4 + j],
                    response.top_logprobs[row].logprobs[place], places=6)
        # Without the option the field stays empty; the CLI's --logprobs
        # asks for ranks and prints them.
        params.logprobs.sampled_rank = False
        response = self.client.sample_response(hidden, params=params)
        self.assertEqual(len(response.sampled_ranks), 0)
        cli = self.cli("sample", "--hidden_file=" + self.save(
            "ranks.npy", hidden), "--logprobs", "--top_k=1", "--seed=4")
        ranks = [line for line in cli.stdout.splitlines()
                 if line.startswith("ranks ")]
        self.assertEqual(ranks, [f"ranks {row}: 1" for row in range(3)])

    def test_wrong_hidden_size_is_invalid_argument(self):
        with self.assertRaises(flashsampler_client.InvalidArgumentError) as ctx:
            self.client.sample(np.ones((2, HIDDEN - 1), np.float32))
        self.assertIn("hidden", ctx.exception.message)
        self.assertIn(str(HIDDEN), ctx.exception.message)
        self.assertTrue(ctx.exception.field_violations[0].field.startswith(
            "hidden_states"), ctx.exception.field_violations)
        self.assertEqual(ctx.exception.reason, "INVALID_HIDDEN_STATES")
        bad = self.cli("sample", "--hidden_file=" + self.save(
            "bad.npy", np.ones((2, HIDDEN + 1), np.float32)), check=False)
        self.assertEqual(bad.returncode, 1)
        self.assertIn("INVALID_ARGUMENT", bad.stderr)
        with self.assertRaises(flashsampler_client.InvalidArgumentError) as ctx:
            self.client.sample(np.ones((1, HIDDEN), np.float32),
                               temperature=-1.0)
        # The daemon sends google.rpc.BadRequest + ErrorInfo details.
        self.assertEqual(len(ctx.exception.field_violations), 1)
        self.assertEqual(ctx.exception.field_violations[0].field,
                         "params.temperature")
        self.assertIn("got -1", ctx.exception.field_violations[0].description)
        self.assertEqual(ctx.exception.reason, "INVALID_SAMPLING_PARAMS")
        # The server still serves the next request.
        tokens, _ = self.client.sample(np.ones((1, HIDDEN), np.float32))
        self.assertEqual(tokens.shape, (1, 1))

    def test_rules_and_dashboard_use_exported_metrics(self):
        self.client.sample(np.ones((1, HIDDEN), np.float32))
        url = f"http://127.0.0.1:{self.metrics_port}/metrics"
        with urllib.request.urlopen(url, timeout=10) as response:
            exposition = response.read().decode()
        exported = set(re.findall(r"^# TYPE (\S+) ", exposition, re.MULTILINE))
        self.assertIn("flashsampler_request_duration_seconds", exported)
        # A family without series yet (no exact fallback so far, no CUDA
        # device on the CPU backend) is not in the exposition; the names
        # service/serving/metrics.cc registers count as well.
        with open(os.path.join(REPO, "service", "serving", "metrics.cc")) as f:
            declared = set(re.findall(r'\.Name\("(flashsampler_\w+)"\)',
                                      f.read()))
        self.assertLessEqual(
            {n for n in exported if n.startswith("flashsampler_")}, declared)
        known = exported | declared
        texts = []
        for path in ("deploy/prometheus/rules.yml",
                     "deploy/grafana/flashsampler-dashboard.json",
                     "docs/operations.md"):
            with open(os.path.join(REPO, path)) as f:
                texts.append((path, f.read()))
        for path, text in texts:
            # Recording rules (level:metric:operation) and the Python
            # package are not metrics.
            used = set(re.findall(r"(?<![\w:])flashsampler_[a-z_]*[a-z](?![\w:])",
                                  text))
            used = {re.sub(r"_(bucket|sum|count)$", "", name) for name in used}
            used.discard("flashsampler_client")
            self.assertTrue(used, path)
            self.assertEqual(used - known, set(),
                             f"{path} uses metrics the daemon does not export")

    def test_load_generator_and_plots(self):
        calls = os.path.join(self.tmp.name, "calls.csv")
        open_calls = os.path.join(self.tmp.name, "open.csv")
        summary = os.path.join(self.tmp.name, "summary.csv")
        base = [os.environ["FS_LOAD"], f"--target={self.target}",
                "--duration=1s", "--warmup=200ms", "--rows=2",
                f"--summary_csv={summary}"]
        closed = subprocess.run(base + ["--mode=closed", "--concurrency=4",
                                        f"--csv={calls}", "--label=c4"],
                                capture_output=True, text=True, timeout=60)
        self.assertEqual(closed.returncode, 0, closed.stdout + closed.stderr)
        self.assertIn("p99", closed.stdout)
        streamed = subprocess.run(base + ["--mode=closed", "--concurrency=4",
                                          "--stream", "--label=s4"],
                                  capture_output=True, text=True, timeout=60)
        self.assertEqual(streamed.returncode, 0,
                         streamed.stdout + streamed.stderr)
        self.assertIn("one SampleStream each", streamed.stdout)
        opened = subprocess.run(base + ["--mode=open", "--rate=50",
                                        f"--csv={open_calls}"],
                                capture_output=True, text=True, timeout=60)
        self.assertEqual(opened.returncode, 0, opened.stdout + opened.stderr)
        with open(calls) as f:
            lines = f.read().splitlines()
        self.assertEqual(lines[0], "start_s,latency_s,code,rows")
        self.assertGreater(len(lines), 5)
        self.assertTrue(all(line.endswith(",OK,2") for line in lines[1:]))
        with open(summary) as f:
            self.assertEqual(len(f.read().splitlines()), 4)  # header + 3 runs

        plot = os.path.join(REPO, "load", "plot_latency.py")
        env = dict(os.environ, MPLBACKEND="Agg",
                   MPLCONFIGDIR=os.path.join(self.tmp.name, "mpl"))
        for args, png in (([calls, open_calls], "calls.png"),
                          (["--summary", summary], "curve.png")):
            out = os.path.join(self.tmp.name, png)
            result = subprocess.run(
                ["/usr/bin/python3", plot, *args, "-o", out],
                capture_output=True, text=True, timeout=120, env=env)
            self.assertEqual(result.returncode, 0, result.stderr)
            with open(out, "rb") as f:
                self.assertEqual(f.read(8), b"\x89PNG\r\n\x1a\n")


if __name__ == "__main__":
    unittest.main()
