#!/usr/bin/env bash
# Download the optional JAX peers' wheels (tokamax 0.0.17 and the pure-Python packages it
# needs beyond JAX, flax and PyTorch; Cut Cross-Entropy) into bench/.wheels, for a GPU machine
# with no network (Python 3.12). There: pip install --no-index --no-deps bench/.wheels/*.whl
# (bench/gpu_session.sh does it). Liger-Kernel and the CUTLASS DSL install with pip on a
# CUDA machine: pip install liger-kernel==0.8.5 nvidia-cutlass-dsl==4.8.1. xprof, which only tokamax's own benchmarking imports, is left out
# (bench/impls.py stands a stub in for it). None of these is a jaxce dependency.
set -euo pipefail
cd "$(dirname "$0")"
python3 -m pip download -q --no-deps --only-binary=:all: --python-version "${PY:-3.12}" \
  --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux_2_28_x86_64 -d .wheels \
  tokamax==0.0.17 qwix==0.1.8 jaxtyping==0.3.11 wadler_lindig==0.1.8 einshape==1.0 \
  immutabledict==4.3.1 pydantic==2.14.3 pydantic_core==2.50.4 annotated-types==0.8.0 \
  typing-inspection==0.4.5 tensorboardX==2.6.5 cut-cross-entropy==25.1.1
ls .wheels
