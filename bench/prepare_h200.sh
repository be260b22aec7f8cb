#!/bin/bash
# Builds, in this checkout, the three git-ignored folders that `bench/h200.sh` runs carry to the H200
# (device tool, carry [".gpu-vllm", ".whl", ".whl-sync"]; together ~63.8 of the 64 MiB a run carries):
#   .gpu-vllm  the slimmed CUDA vLLM 0.26.0 (../shared/gpu-vllm/prepare.sh, ~5 min the first time)
#   .whl       the peer kernel of the linear benchmarks (humming-kernels 0.1.19)
#   .whl-sync  packages the device image lacks for vLLM's OpenAI server, the sidecar and the openai client
# Idempotent: a folder already there is kept (delete it to rebuild). Python 3.12 wheels: the image's Python.
set -eu
cd "$(git rev-parse --show-toplevel)"
mkdir -p .git/info
for d in /.gpu-vllm/ /.whl/ /.whl-sync/; do grep -qxF "$d" .git/info/exclude 2>/dev/null || echo "$d" >> .git/info/exclude; done
download() {   # download FOLDER PACKAGE...: binary wheels for CPython 3.12 on manylinux x86-64, no dependencies
    local d=$1; shift
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        -d "$d" "$@"
}
[ -d .gpu-vllm ] || bash ../shared/gpu-vllm/prepare.sh
[ -d .whl ] || download .whl humming-kernels==0.1.19
[ -d .whl-sync ] || download .whl-sync xxhash prometheus-client watchfiles python-multipart pydantic-extra-types \
    model-hosting-container-standards jmespath prometheus-fastapi-instrumentator httpcore2 truststore
du -sc --apparent-size --block-size=1K .gpu-vllm .whl .whl-sync | awk '{printf "%s %.1f MiB\n", $2, $1 / 1024}'
