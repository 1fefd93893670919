#!/usr/bin/env bash
# One GPU session of the bench, from the repository root, on a one-GPU H200 (or H100) with
# JAX 0.11.2 and PyTorch, Liger-Kernel installed beforehand (../shared/peers/README.md:
# install.sh a, then b) and tokamax 0.0.17 from bench/.wheels when carried (bench/get_peers.sh).
#
#   bash bench/gpu_session.sh              # main: the gpu and objective suites at T = 8192 and
#                                          # 32768 with every peer (fused and logits), the floors
#                                          # at the machine's best, the accuracy rows; < 9 min
#   bash bench/gpu_session.sh large        # T = 262144, then 1,048,576: one fresh process per row
#   bash bench/gpu_session.sh large 262144 # one T only (each T fits one 10-minute device call)
#
# Writes under $OUT (default bench/out/gpu-session): <mode>/<device>.json (rows, device,
# versions, git commit, floors, accuracy), .md, _memory.png, and session-<mode>.log; prints a
# summary. JAXCE_COMMIT names the commit the tree was sent from (default: git rev-parse HEAD).
# Time guard: no row starts after BUDGET_S seconds (those rows are "skipped: time budget").
set -euo pipefail
cd "$(dirname "$0")/.."
MODE=${1:-main}
shift || true
OUT=${OUT:-bench/out/gpu-session}
PY=${PYTHON:-python3}
export XLA_PYTHON_CLIENT_PREALLOCATE=false
export JAXCE_COMMIT=${JAXCE_COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}
mkdir -p "$OUT/$MODE"
LOG="$OUT/session-$MODE.log"
start=$(date +%s)

if ls bench/.wheels/*.whl >/dev/null 2>&1; then  # tokamax 0.0.17 and its pure-Python deps
  "$PY" -m pip install -q --no-index --no-deps bench/.wheels/*.whl 2>&1 | tail -2 || true
fi
"$PY" - <<'EOF' 2>&1 | tee "$LOG"
import importlib.metadata as m, jax
print("device:", jax.devices()[0].device_kind, "x", jax.device_count(), "| jax", jax.__version__)
for d in ("torch", "liger-kernel", "nvidia-cutlass-dsl", "tokamax", "cut-cross-entropy"):
  try:
    print(f"  {d} {m.version(d)}")
  except m.PackageNotFoundError:
    print(f"  {d}: not installed (its rows are skipped, saying how to install it)")
EOF

case "$MODE" in
  main)
    # Rows stop starting after BUDGET_S; the floors (~1.5 min) and accuracy (~1 min) run first.
    "$PY" -m bench --suite gpu,objective --machine-floors --accuracy --repeat-seconds 1 \
      --timeout 240 --budget-s "${BUDGET_S:-300}" --out "$OUT/main" 2>>"$LOG" | tee -a "$LOG"
    ;;
  large)
    # The suite runs every method at 262144 first; given Ts replace the suite's.
    Ts=()
    if [[ $# -gt 0 ]]; then Ts=(--T "$(IFS=,; echo "$*")"); fi
    "$PY" -m bench --suite gpu-large "${Ts[@]}" --fresh --repeats 1 --timeout 400 \
      --budget-s "${BUDGET_S:-420}" --out "$OUT/large" 2>>"$LOG" | tee -a "$LOG"
    ;;
  *)
    echo "usage: bash bench/gpu_session.sh [main | large [T ...]]" >&2
    exit 2
    ;;
esac
echo "session $MODE: $(( $(date +%s) - start )) s; files under $OUT/$MODE and $LOG" | tee -a "$LOG"
