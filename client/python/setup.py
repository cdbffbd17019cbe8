"""Build step of flashsampler-client: generates flashsampler/v1/sampler_pb2.py
and sampler_pb2_grpc.py from the wire contract with protoc and
grpc_python_plugin (Debian's protobuf-compiler + protobuf-compiler-grpc, no
grpcio-tools needed) into the build tree, so that the wheel carries them.

The .proto is looked up in $FLASHSAMPLER_PROTO_DIR, else ../../proto (this
file's place in the repository).
"""

import os
import shutil
import subprocess

from setuptools import setup
from setuptools.command.build_py import build_py

HERE = os.path.dirname(os.path.abspath(__file__))
PROTO = "flashsampler/v1/sampler.proto"


class BuildPyWithProtos(build_py):
    def run(self):
        proto_dir = os.environ.get("FLASHSAMPLER_PROTO_DIR",
                                   os.path.join(HERE, "..", "..", "proto"))
        if not os.path.isfile(os.path.join(proto_dir, PROTO)):
            raise SystemExit(f"cannot find {PROTO} under {proto_dir}; set "
                             "FLASHSAMPLER_PROTO_DIR to the repository's proto/")
        protoc = shutil.which("protoc")
        plugin = shutil.which("grpc_python_plugin")
        if not protoc or not plugin:
            raise SystemExit("protoc and grpc_python_plugin must be on PATH "
                             "(apt-get install protobuf-compiler "
                             "protobuf-compiler-grpc)")
        out = os.path.join(self.build_lib)
        os.makedirs(os.path.join(out, "flashsampler", "v1"), exist_ok=True)
        subprocess.check_call([
            protoc, f"--proto_path={proto_dir}", f"--python_out={out}",
            f"--grpc_python_out={out}",
            f"--plugin=protoc-gen-grpc_python={plugin}", PROTO])
        for package in ("flashsampler", "flashsampler/v1"):
            open(os.path.join(out, package, "__init__.py"), "a").close()
        super().run()

    def find_package_modules(self, package, package_dir):
        # flashsampler and flashsampler.v1 exist only in the build tree.
        if package.startswith("flashsampler."):
            return []
        if package == "flashsampler":
            return []
        return super().find_package_modules(package, package_dir)

    def check_package(self, package, package_dir):
        if package == "flashsampler" or package.startswith("flashsampler."):
            return None
        return super().check_package(package, package_dir)


setup(cmdclass={"build_py": BuildPyWithProtos})
