#!/usr/bin/env bash
# Wheels for running fd's cuda tests and benchmarks on a GPU host that reaches no package index
# but already has PyTorch, Triton, transformers, numpy, safetensors, tokenizers, sentencepiece,
# jinja2, httpx and huggingface_hub (as the project's lent GPU machines do).
#
#   backends/cuda/tools/offline_wheels.sh [DIR] [PYTHON_VERSION]     (here: DIR=.whl, 3.12)
#   then on the GPU host:
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site DIR/*.whl && export PYTHONPATH=/tmp/site
#
# fd-core and fd-backend-cuda are built from this tree; the rest are fd-core's other
# requirements, at the versions this machine's venv resolved (pip has no resolver offline:
# --no-deps, so every one is named, fastapi's opentelemetry-api included).
set -euo pipefail
cd "$(dirname "$0")/../../.."
dir=${1:-.whl}
py=${2:-3.12}
mkdir -p "$dir"
rm -f "$dir"/fd_core-*.whl "$dir"/fd_backend_cuda-*.whl
python -m build -q --wheel -o "$dir" . >/dev/null
python -m build -q --wheel -o "$dir" backends/cuda >/dev/null
names="annotated-doc annotated-types anyio click fastapi gguf h11 llguidance msgspec opentelemetry-api pluggy
prometheus_client pydantic pydantic_core pyzmq starlette typing_extensions typing-inspection uvicorn"
pins=""
for name in $names; do
    version=$(python -m pip show "$name" 2>/dev/null | sed -n 's/^Version: //p')
    [ -n "$version" ] || { echo "offline_wheels: $name is not installed here; install fd-core first" >&2; exit 1; }
    pins="$pins $name==$version"
done
platforms=""
for n in 17 24 26 27 28 31 34 35; do platforms="$platforms --platform manylinux_2_${n}_x86_64"; done
# shellcheck disable=SC2086
python -m pip download -q --no-deps --only-binary=:all: --python-version "$py" --implementation cp \
    --platform manylinux2014_x86_64 $platforms -d "$dir" $pins
ls "$dir"
