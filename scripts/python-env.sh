#!/usr/bin/env bash
# Creates (idempotently) the Python reference environment at <repo>/.venv:
# llama-cpp-python (compiled from source: llama.cpp with GGML_NATIVE, i.e. -march=native,
# the same code-generation level as our `-C target-cpu=native` Rust build), jinja2, numpy, gguf.
# Used by scripts/gen-fixtures.py and scripts/bench_llamacpp.py.
#
# Usage: scripts/python-env.sh            # then: source .venv/bin/activate
# Env:   PYTHON=python3.11   LLAMA_CPP_PYTHON_VERSION=0.3.36   CMAKE_ARGS=... (override flags)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
ROOT="$(pwd)"

LLAMA_CPP_PYTHON_VERSION="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
PYTHON="${PYTHON:-python3}"
VENV="$ROOT/.venv"

if [ ! -x "$VENV/bin/python" ]; then
  echo "python-env: creating $VENV with $($PYTHON --version 2>&1)"
  "$PYTHON" -m venv "$VENV"
  "$VENV/bin/python" -m pip install --quiet --upgrade pip
else
  echo "python-env: reusing $VENV"
fi

PY="$VENV/bin/python"

have_llama() {
  "$PY" - "$LLAMA_CPP_PYTHON_VERSION" <<'PYEOF' 2>/dev/null
import sys, llama_cpp
sys.exit(0 if llama_cpp.__version__ == sys.argv[1] else 1)
PYEOF
}

if have_llama; then
  echo "python-env: llama-cpp-python==$LLAMA_CPP_PYTHON_VERSION already installed"
else
  echo "python-env: building llama-cpp-python==$LLAMA_CPP_PYTHON_VERSION from source (several minutes on 2 cores)"
  # CPU only, native ISA (AVX-512 where the machine has it). No OpenMP-free/BLAS tricks:
  # this is llama.cpp's stock CPU backend, the baseline we compare against. Without AMX:
  # on these VMs' Sapphire Rapids CPUs, -march=native builds ggml's AMX kernels, and every
  # decode then crashes with SIGSEGV (seen 2026-12-03); GCC keeps an explicit -mno-* over
  # what -march=native implies.
  NO_AMX="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
  export CMAKE_ARGS="${CMAKE_ARGS:--DGGML_NATIVE=ON -DCMAKE_C_FLAGS='$NO_AMX' -DCMAKE_CXX_FLAGS='$NO_AMX' -DGGML_CUDA=OFF -DGGML_METAL=OFF -DGGML_BLAS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TESTS=OFF}"
  export MAKEFLAGS="${MAKEFLAGS:--j2}"
  export CMAKE_BUILD_PARALLEL_LEVEL="${CMAKE_BUILD_PARALLEL_LEVEL:-2}"
  echo "python-env: CMAKE_ARGS=$CMAKE_ARGS"
  "$PY" -m pip install --no-cache-dir --no-binary llama-cpp-python \
    "llama-cpp-python==$LLAMA_CPP_PYTHON_VERSION"
fi

"$PY" -m pip install --quiet "jinja2>=3.1" "numpy" "gguf"

"$PY" - <<'PYEOF'
import llama_cpp, jinja2, numpy
print(f"python-env: llama-cpp-python {llama_cpp.__version__}, jinja2 {jinja2.__version__}, numpy {numpy.__version__}")
PYEOF
echo "python-env: ready. Activate with:"
echo "  source $VENV/bin/activate"
