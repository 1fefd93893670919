#!/usr/bin/env bash
# The GPU test tally: the whole test suite on one GPU (JAX_PLATFORMS=cuda, pytest-xdist
# workers sharing it) and the GPU checks (scripts/gpu_check_*.py at small shapes), then one line per part and a total. Exits 1 when anything failed.
#
#   bash scripts/gpu_tests.sh                 # everything (about 9 minutes on one H200)
#   WORKERS=4 bash scripts/gpu_tests.sh tests/test_batch_invariant.py   # some test files
#   CHECKS_ONLY=1 bash scripts/gpu_tests.sh   # the checks alone (when a call's time limit
#                                             # cut them after the tests)
#
# Logs go to $OUT (or bench/out/gpu-tests) as tests.log, checks.log and tally.txt.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-bench/out/gpu-tests}"
mkdir -p "$out"
# (NCCL_NVLS_ENABLE=0: no NVLink multicast, which can take a shared host down)
export JAX_PLATFORMS=cuda XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
targets=("${@:-tests}")
if [ -n "${CHECKS_ONLY:-}" ]; then
  tests_rc=0
  summary="not run (CHECKS_ONLY)"
else
  python -m pytest -q -n "${WORKERS:-6}" -p no:cacheprovider -rfEs "${targets[@]}" \
    2>&1 | tee "$out/tests.log"
  tests_rc=${PIPESTATUS[0]}
  summary=$(grep -E '^(=+ )?[0-9]+ (passed|failed)|[0-9]+ (passed|failed).* in [0-9.]+s' \
    "$out/tests.log" | tail -1)
fi
checks_failed=0
: > "$out/checks.log"
if [ "$#" -eq 0 ]; then
  checks=("gpu_check_dispatch --tokens 2048 --repeats 2" "gpu_check_mosaic_linear --tiny"
          "gpu_check_sharded_triton")
  if [ "$(nvidia-smi --list-gpus 2>/dev/null | wc -l)" -gt 1 ]; then
    checks+=("gpu_check_multiprocess --repeats 3")  # one process per GPU (several GPUs)
  fi
  for check in "${checks[@]}"; do
    # shellcheck disable=SC2086  # (the check's name, then its arguments)
    if python -m scripts.$check >> "$out/checks.log" 2>&1; then
      echo "check $check: passed" | tee -a "$out/tally.txt.part"
    else
      echo "check $check: FAILED (see checks.log)" | tee -a "$out/tally.txt.part"
      checks_failed=$((checks_failed + 1))
    fi
  done
fi
# The commit: JAXCE_COMMIT, else git's HEAD, said to differ where tracked files do (a copy
# of a working tree whose git metadata lags it names an older commit than the files').
commit="${JAXCE_COMMIT:-}"
if [ -z "$commit" ]; then
  commit=$(git rev-parse --short HEAD 2>/dev/null || echo unknown)
  changed=$(git status --porcelain --untracked-files=no 2>/dev/null | wc -l)
  if [ "$changed" -gt 0 ]; then
    commit="$commit, with $changed tracked files changed (set JAXCE_COMMIT to the tree's commit)"
  fi
fi
{
  echo "device: $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)"
  echo "jax: $(python -c 'import jax; print(jax.__version__)')"
  echo "commit: $commit"
  echo "tests: ${summary:-no summary (exit $tests_rc)}"
  cat "$out/tally.txt.part" 2>/dev/null
  echo "checks failed: $checks_failed"
} > "$out/tally.txt"
rm -f "$out/tally.txt.part"
cat "$out/tally.txt"
[ "$tests_rc" -eq 0 ] && [ "$checks_failed" -eq 0 ]
