"""The pip path of client/python. The generated flashsampler.v1 modules are
checked in and must match what generate_protos.sh makes from the .proto
today; a wheel builds offline with no protoc on PATH and nothing read from
outside client/python; a fresh virtual environment (system site packages
for grpcio, protobuf and numpy: this machine installs nothing from an index)
installs it and runs examples/asyncio_sample.py against the real
flashsamplerd. Builds from copies, so nothing is written into the source
tree.
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
PACKAGE = os.path.join(REPO, "client", "python")
GENERATED = ("sampler_pb2.py", "sampler_pb2.pyi", "sampler_pb2_grpc.py")

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


def copy_package(tmp):
    source = os.path.join(tmp, "src")
    shutil.copytree(PACKAGE, source, ignore=shutil.ignore_patterns(
        "build", "*.egg-info", "__pycache__", ".mypy_cache"))
    return source


def clean_env(**extra):
    """No PYTHONPATH, and a PATH without protoc or grpc_python_plugin."""
    env = dict(os.environ, PATH="/nonexistent", PYTHONDONTWRITEBYTECODE="1",
               **extra)
    env.pop("PYTHONPATH", None)
    env.pop("FLASHSAMPLER_PROTO_DIR", None)
    return env


class PackagingTest(unittest.TestCase):

    def test_generated_code_matches_the_proto(self):
        with tempfile.TemporaryDirectory(prefix="fs_gen_") as tmp:
            run = subprocess.run(
                [os.path.join(PACKAGE, "generate_protos.sh"), tmp],
                capture_output=True, text=True, timeout=60)
            self.assertEqual(run.returncode, 0, run.stdout + run.stderr)
            for name in GENERATED:
                with self.subTest(file=name):
                    with open(os.path.join(tmp, "flashsampler", "v1",
                                           name), "rb") as f:
                        fresh = f.read()
                    with open(os.path.join(PACKAGE, "flashsampler", "v1",
                                           name), "rb") as f:
                        checked_in = f.read()
                    self.assertTrue(
                        fresh == checked_in,
                        f"client/python/flashsampler/v1/{name} is stale: "
                        "run client/python/generate_protos.sh and commit")

    def test_wheel_is_self_contained(self):
        with tempfile.TemporaryDirectory(prefix="fs_wheel_") as tmp:
            source = copy_package(tmp)
            env = clean_env()
            build = subprocess.run(
                [sys.executable, "-m", "pip", "wheel", "--no-deps",
                 "--no-index", "--no-build-isolation", "--wheel-dir",
                 os.path.join(tmp, "dist"), source],
                capture_output=True, text=True, timeout=150, env=env,
                cwd=tmp)
            self.assertEqual(build.returncode, 0,
                             build.stdout + build.stderr)
            wheels = os.listdir(os.path.join(tmp, "dist"))
            self.assertEqual(len(wheels), 1, wheels)
            site = os.path.join(tmp, "site")
            with zipfile.ZipFile(os.path.join(tmp, "dist", wheels[0])) as whl:
                names = set(whl.namelist())
                for needed in ("flashsampler/v1/sampler_pb2.py",
                               "flashsampler/v1/sampler_pb2.pyi",
                               "flashsampler/v1/sampler_pb2_grpc.py",
                               "flashsampler/__init__.py",
                               "flashsampler/py.typed",
                               "flashsampler/v1/__init__.py",
                               "flashsampler_client/__init__.py",
                               "flashsampler_client/client.py",
                               "flashsampler_client/aio.py",
                               "flashsampler_client/py.typed"):
                    self.assertIn(needed, names)
                whl.extractall(site)
            run = subprocess.run(
                [sys.executable, "-c", CHECK, site],
                capture_output=True, text=True, timeout=60,
                env=dict(env, PYTHONPATH=site), cwd=tmp)
            self.assertEqual(run.returncode, 0, run.stdout + run.stderr)
            self.assertEqual(run.stdout.strip(), "ok")

    @unittest.skipUnless(os.environ.get("FLASHSAMPLERD"),
                         "FLASHSAMPLERD unset: flashsamplerd is not built, "
                         "the venv install + asyncio example is NOT run")
    def test_venv_install_runs_asyncio_example(self):
        from daemon import Daemon
        daemon = Daemon(vocab=500, hidden=32)
        try:
            with tempfile.TemporaryDirectory(prefix="fs_venv_") as tmp:
                source = copy_package(tmp)
                venv = os.path.join(tmp, "venv")
                subprocess.run([sys.executable, "-m", "venv",
                                "--system-site-packages", venv],
                               check=True, timeout=120)
                python = os.path.join(venv, "bin", "python")
                env = clean_env()
                install = subprocess.run(
                    [python, "-m", "pip", "install", "--no-index",
                     "--no-build-isolation", source],
                    capture_output=True, text=True, timeout=150, env=env,
                    cwd=tmp)
                self.assertEqual(install.returncode, 0,
                                 install.stdout + install.stderr)
                where = subprocess.run(
                    [python, "-c", "import flashsampler_client.aio as a, "
                     "flashsampler.v1.sampler_pb2 as p; print(a.__file__); "
                     "print(p.__file__)"],
                    capture_output=True, text=True, timeout=60, env=env,
                    cwd=tmp)
                self.assertEqual(where.returncode, 0, where.stderr)
                for path in where.stdout.split():
                    self.assertTrue(path.startswith(venv), path)
                example = subprocess.run(
                    [python, os.path.join(source, "examples",
                                          "asyncio_sample.py"),
                     daemon.target, "256"],
                    capture_output=True, text=True, timeout=120, env=env,
                    cwd=tmp)
                self.assertEqual(example.returncode, 0,
                                 example.stdout + example.stderr)
                self.assertEqual(example.stdout.splitlines()[-1], "ok")
        finally:
            code = daemon.stop()
        self.assertEqual(code, 0, "".join(daemon.log))


if __name__ == "__main__":
    unittest.main()
