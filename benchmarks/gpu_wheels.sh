#!/usr/bin/env bash
# Download, on a machine with package access, the wheels the GPU suite needs that a bare GPU machine
# (Python 3.12, CUDA PyTorch, no package index) lacks, into .whl/ (ignored by git). Then, on the GPU
# machine, from the repository root with .whl/ beside it:
#
#   python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
#   PYTHONPATH=/tmp/site python3 benchmarks/gpu_suite.py --device cuda --out gpu-suite-out
#
# Usage: bash benchmarks/gpu_wheels.sh [-h|--help] [PYTHON_VERSION]   (MAJOR.MINOR, default 3.12)
set -euo pipefail

usage() {
  cat <<'USAGE'
Usage: bash benchmarks/gpu_wheels.sh [-h|--help] [PYTHON_VERSION]

Download into .whl/ (in the repository root) the wheels the GPU suite needs that a bare GPU machine
lacks: transitions, megatron-core and torch_memory_saver, built for CPython PYTHON_VERSION on x86_64
Linux.

  PYTHON_VERSION  the GPU machine's Python as MAJOR.MINOR, e.g. 3.12 (the default)
  -h, --help      print this help and exit
USAGE
}

# Check every argument before touching the file system: a mistyped option must not leave a .whl/ behind
# (nor hand pip a version it would fail on after creating it).
die() {
  echo "gpu_wheels.sh: $1 (see --help)" >&2
  exit 2
}
pyver=""
only_positional=0
for arg in "$@"; do
  if [[ $only_positional -eq 0 ]]; then
    case "$arg" in
      -h|--help) usage; exit 0 ;;
      --) only_positional=1; continue ;;
      -*) die "unknown option '$arg'" ;;
    esac
  fi
  [[ -z "$pyver" ]] || die "unexpected argument '$arg': takes one PYTHON_VERSION, got '$pyver' already"
  [[ "$arg" =~ ^[0-9]+\.[0-9]+$ ]] || die "malformed PYTHON_VERSION '$arg': expected MAJOR.MINOR, e.g. 3.12"
  pyver="$arg"
done
pyver="${pyver:-3.12}"

cd "$(dirname "$0")/.."
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
