#!/usr/bin/env bash
# The wheels examples/tunix_grpo.py needs on the GPU machines (no package index there; their
# image has jax, flax, optax and the rest of Tunix's import-time needs), into .whl/:
#   bash examples/get_tunix_wheels.sh
# then, on the device:  python3 -m pip install -q --no-index --no-deps --target /tmp/site \
#   .whl/*.whl && PYTHONPATH=/tmp/site:. python -m examples.tunix_grpo --gpu --out r.json
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 -d .whl \
  google-tunix==0.1.7 google-metrax==0.2.4 clu==0.0.12 tensorboardX==2.6.5 perfetto==0.59.1
du -sh .whl
