#!/bin/sh
# Regenerates flashsampler/v1/sampler_pb2{.py,.pyi,_grpc.py} from the wire
# contract in ../../proto. The generated modules are checked in so that
# `pip install` needs only Python; tests/client/python/test_packaging.py fails
# when they fall behind the .proto. Needs Debian's protobuf-compiler and
# protobuf-compiler-grpc (protoc 3.21, grpc_python_plugin 1.51): the runtime
# ranges in pyproject.toml are those this generated code works with.
set -eu
here=$(cd "$(dirname "$0")" && pwd)
out=${1:-$here}
plugin=${GRPC_PYTHON_PLUGIN:-$(command -v grpc_python_plugin)}
protoc --proto_path="$here/../../proto" --python_out="$out" --pyi_out="$out" \
  --grpc_python_out="$out" --plugin=protoc-gen-grpc_python="$plugin" \
  flashsampler/v1/sampler.proto
