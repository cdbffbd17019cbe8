"""The pip path of client/python: `pip wheel` (offline, no build isolation,
Debian's setuptools) runs protoc + grpc_python_plugin, the wheel carries
flashsampler/v1/sampler_pb2*.py, and the unpacked wheel alone (no
<build>/python on the path) samples against an in-process server.
Builds from a copy, so nothing is written into the source tree.
"""

import os
import shutil
import subprocess
import sys
import tempfile
import unittest
import zipfile

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..",
                                    ".."))

CHECK = r"""
import sys
from concurrent import futures
import grpc, numpy as np
import flashsampler_client
from flashsampler.v1 import sampler_pb2, sampler_pb2_grpc
site = sys.argv[1]
assert sampler_pb2.__file__.startswith(site), sampler_pb2.__file__
assert flashsampler_client.__file__.startswith(site)

class Echo(sampler_pb2_grpc.SamplerServicer):
    def Sample(self, request, context):
        rows = request.hidden_states.shape[0]
        return sampler_pb2.SampleResponse(n=1, token_ids=range(rows),
                                          seeds=request.seeds)

server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
sampler_pb2_grpc.add_SamplerServicer_to_server(Echo(), server)
port = server.add_insecure_port("127.0.0.1:0")
server.start()
client = flashsampler_client.FlashSamplerClient(f"127.0.0.1:{port}")
tokens, seeds = client.sample(np.zeros((3, 4), np.float32), seeds=[4, 5, 6])
assert tokens.tolist() == [[0], [1], [2]], tokens
assert seeds.tolist() == [4, 5, 6], seeds
server.stop(None)
print("ok")
"""


class PackagingTest(unittest.TestCase):

    def test_wheel_is_self_contained(self):
        with tempfile.TemporaryDirectory(prefix="fs_wheel_") as tmp:
            source = os.path.join(tmp, "src")
            shutil.copytree(os.path.join(REPO, "client", "python"), source,
                            ignore=shutil.ignore_patterns(
                                "build", "*.egg-info", "__pycache__"))
            env = dict(os.environ,
                       FLASHSAMPLER_PROTO_DIR=os.path.join(REPO, "proto"))
            env.pop("PYTHONPATH", None)
            build = subprocess.run(
                [sys.executable, "-m", "pip", "wheel", "--no-deps",
                 "--no-index", "--no-build-isolation", "--wheel-dir",
                 os.path.join(tmp, "dist"), source],
                capture_output=True, text=True, timeout=150, env=env)
            self.assertEqual(build.returncode, 0,
                             build.stdout + build.stderr)
            wheels = os.listdir(os.path.join(tmp, "dist"))
            self.assertEqual(len(wheels), 1, wheels)
            site = os.path.join(tmp, "site")
            with zipfile.ZipFile(os.path.join(tmp, "dist", wheels[0])) as whl:
                names = set(whl.namelist())
                for needed in ("flashsampler/v1/sampler_pb2.py",
                               "flashsampler/v1/sampler_pb2_grpc.py",
                               "flashsampler/__init__.py",
                               "flashsampler/v1/__init__.py",
                               "flashsampler_client/__init__.py",
                               "flashsampler_client/client.py"):
                    self.assertIn(needed, names)
                whl.extractall(site)
            run = subprocess.run(
                [sys.executable, "-c", CHECK, site],
                capture_output=True, text=True, timeout=60,
                env=dict(env, PYTHONPATH=site, PYTHONDONTWRITEBYTECODE="1"))
            self.assertEqual(run.returncode, 0, run.stdout + run.stderr)
            self.assertEqual(run.stdout.strip(), "ok")


if __name__ == "__main__":
    unittest.main()
