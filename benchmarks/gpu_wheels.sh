#!/usr/bin/env bash
# Download, on a machine with package access, the wheels the GPU suite needs that a bare GPU machine
# (Python 3.12, CUDA PyTorch, no package index) lacks, into .whl/ (ignored by git). Then, on the GPU
# machine, from the repository root with .whl/ beside it:
#
#   python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
#   PYTHONPATH=/tmp/site python3 benchmarks/gpu_suite.py --device cuda --out gpu-suite-out
#
# Usage: bash benchmarks/gpu_wheels.sh [PYTHON_VERSION]   (default 3.12)
set -euo pipefail
cd "$(dirname "$0")/.."
pyver="${1:-3.12}"
wheels=(
  "transitions==0.9.3"        # hybridmem's state machine
  "megatron-core==0.16.1"     # the Megatron adapter's CUDA tests and the demo's --trainer megatron
  "torch_memory_saver==0.0.10"  # the peer the suite compares against (KV and training state)
)
platforms=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64 \
         manylinux2014_x86_64 manylinux1_x86_64 any; do
  platforms+=(--platform "$p")
done
mkdir -p .whl
python3 -m pip download --no-deps --only-binary=:all: --python-version "$pyver" --implementation cp \
  "${platforms[@]}" -d .whl "${wheels[@]}"
ls -l .whl
