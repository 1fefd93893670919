#!/usr/bin/env bash
# Download the optional peers' wheels (Liger-Kernel, Cut Cross-Entropy, tokamax and the
# packages tokamax needs beyond JAX/flax) into bench/.wheels, for a GPU machine that has
# PyTorch and JAX but no network. There: pip install --no-deps bench/.wheels/*.whl
# PY: the GPU machine's Python version (default 3.12). None of these is a jaxce dependency.
set -euo pipefail
cd "$(dirname "$0")"
python3 -m pip download -q --no-deps --only-binary=:all: --python-version "${PY:-3.12}" \
  --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux_2_28_x86_64 -d .wheels \
  liger-kernel==0.8.5 cut-cross-entropy==25.1.1 \
  tokamax==0.0.12 qwix==0.1.8 jaxtyping==0.3.11 wadler_lindig==0.1.8 typeguard==2.13.3 \
  einshape==1.0 immutabledict==4.3.1 pydantic==2.14.3 pydantic_core==2.50.4 \
  annotated-types==0.8.0 typing-inspection==0.4.5 tensorboardX==2.6.5
ls .wheels
