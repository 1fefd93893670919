#!/usr/bin/env bash
# One GPU session of the bench, from the repository root, on a one-GPU H200 (or H100) with
# JAX 0.11.2 and PyTorch, Liger-Kernel installed beforehand (pip install liger-kernel==0.8.5
# nvidia-cutlass-dsl==4.8.1) and tokamax 0.0.17 from bench/.wheels when present
# (bench/get_peers.sh).
#
#   bash bench/gpu_session.sh              # main: the gpu and objective suites at T = 8192 and
#                                          # 32768 with every peer (fused and logits), the floors
#                                          # at the machine's best, the accuracy rows
#   bash bench/gpu_session.sh resume       # what main had no time for (same files, merged)
#   bash bench/gpu_session.sh large        # T = 262144, then 1,048,576: one fresh process per row
#   bash bench/gpu_session.sh large 262144 # one T only (each T ends within 10 minutes)
#   bash bench/gpu_session.sh shards       # a host of several GPUs: the gpu-shards suite (1, 2,
#                                          # 4 GPUs), one process per GPU against one process
#   bash bench/gpu_session.sh shards-more  # 4 GPUs: gpu-shards-more (V = 248320, T = 262144,
#                                          # the 2 x 2 data x vocab mesh)
#   bash bench/gpu_session.sh grpo-meshes [small|medium]  # the GRPO step on 1 x 1, 2 x n/2
#                                          # (2 x 1 on 2 GPUs) and 1 x n meshes, the last two
#                                          # also sequence parallel (":sp"; MESHES=... picks
#                                          # others, merged into the file of the calls before;
#                                          # ATTENTION=cudnn: the model's attention on cuDNN)
#   bash bench/gpu_session.sh profile-shards  # a host of several GPUs: each sharded path's
#                                          # GPU time by kind of kernel at 1, 2, 4 GPUs
#
# Writes bench/out/gpu-session/<main|large|shards|...>/<device>.json (<device>-shards.json
# and <device>-shards_more.json for the two sharded suites: rows, device, versions, git
# commit, floors, accuracy), .md, _memory.png, and session-<mode>.log (kept on a warm
# machine, so `resume` finds them; copy bench/out/gpu-session along to resume on another), then copies
# them under $OUT when it is set; prints a summary. JAXCE_COMMIT names the commit the tree was sent from (default: git rev-parse HEAD).
# Time guard: nothing starts after DEADLINE_S seconds from the script's start (default 500,
# large 380: the command ends within 9 minutes); rows not started are "skipped: time budget", and
# `resume` runs them (on an H200, 2026-11-25: floors ~1 min, accuracy ~3 min, rows ~6.5 min).
set -euo pipefail
cd "$(dirname "$0")/.."
MODE=${1:-main}
shift || true
RUN=bench/out/gpu-session
PY=${PYTHON:-python3}
export XLA_PYTHON_CLIENT_PREALLOCATE=false
export JAXCE_COMMIT=${JAXCE_COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}
DIR=$RUN/$(case $MODE in large|shards|shards-more|grpo-meshes|profile-shards) echo "$MODE" ;; *) echo main ;; esac)
mkdir -p "$DIR"
LOG="$RUN/session-$MODE.log"
start=$(date +%s)
# large: a 1,048,576-token row of Liger's GRPO loss takes ~3 min, so it starts no later than 380 s
DEADLINE_S=${DEADLINE_S:-$([[ $MODE == large ]] && echo 380 || echo 500)}
left() { echo $(( DEADLINE_S - ($(date +%s) - start) )); }

if ls bench/.wheels/*.whl >/dev/null 2>&1 && ! "$PY" -c "import tokamax" 2>/dev/null; then  # tokamax 0.0.17 and its pure-Python deps
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
  main|resume)
    "$PY" -m bench --suite gpu,objective --machine-floors --accuracy --repeat-seconds 1 \
      --timeout 240 --budget-s "$(left)" --out "$DIR" $([[ $MODE == resume ]] && echo --resume) \
      2>>"$LOG" | tee -a "$LOG"
    ;;
  large)
    # The suite runs every method at 262144 first; given Ts replace the suite's.
    Ts=()
    if [[ $# -gt 0 ]]; then Ts=(--T "$(IFS=,; echo "$*")"); fi
    "$PY" -m bench --suite gpu-large "${Ts[@]}" --fresh --repeats 1 --timeout 400 \
      --budget-s "$(left)" --out "$DIR" 2>>"$LOG" | tee -a "$LOG"
    ;;
  shards)
    # NVLink multicast off in every process this starts (NCCL's NVLS can take a shared host
    # down); each step's rows are written as they finish, so a step cut short keeps its rows.
    export NCCL_NVLS_ENABLE=0
    n=$(nvidia-smi -L | grep -c "^GPU ")
    "$PY" -m bench --suite gpu-shards --repeat-seconds 1 --timeout 150 \
      --budget-s "$(( $(left) - 120 ))" --out "$DIR" 2>>"$LOG" | tee -a "$LOG"
    "$PY" -m scripts.gpu_check_multiprocess --timeout 120 2>>"$LOG" | tee -a "$LOG" || true
    cp bench/out/multiprocess.json "$DIR"/ 2>/dev/null || true
    ;;
  shards-more)
    export NCCL_NVLS_ENABLE=0
    "$PY" -m bench --suite gpu-shards-more --repeat-seconds 1 --timeout 150 \
      --budget-s "$(left)" --out "$DIR" 2>>"$LOG" | tee -a "$LOG"
    ;;
  grpo-meshes)
    # The GRPO step on 1 x 1, 2 x n/2 and 1 x n meshes (four paths' compiles per mesh).
    export NCCL_NVLS_ENABLE=0
    n=$(nvidia-smi -L | grep -c "^GPU ")
    case $n in
      1) meshes="1x1" ;;
      2) meshes="1x1,2x1,1x2,1x2:sp" ;;
      *) meshes="1x1,2x$(( n / 2 )),2x$(( n / 2 )):sp,1x$n,1x$n:sp" ;;
    esac
    meshes=${MESHES:-$meshes}
    # (--merge: calls of one machine session, a size or some meshes each, fill one file;
    # another attention's rows go to a folder of their own)
    "$PY" -m bench.grpo_step --sizes "${1:-small}" --meshes "$meshes" --merge \
      ${ATTENTION:+--attention "$ATTENTION"} --timeout "$(left)" \
      --out "$DIR${ATTENTION:+-$ATTENTION}" 2>>"$LOG" | tee -a "$LOG"
    ;;
  profile-shards)
    # GPU 0's kernels by kind (NCCL, cuBLAS, XLA, jaxce's) and its idle time, per path and n.
    export NCCL_NVLS_ENABLE=0
    n=$(nvidia-smi -L | grep -c "^GPU ")
    counts=$(for k in 1 2 4 8; do if [ "$k" -le "$n" ]; then printf '%s,' "$k"; fi; done)
    OUT="$DIR" timeout "$(left)" "$PY" -m bench.head_profile --sections shards-trace \
      --shards "${counts%,}" 2>>"$LOG" | tee -a "$LOG" || true
    ;;
  *)
    echo "usage: bash bench/gpu_session.sh [main | resume | large [T ...] | shards | shards-more | grpo-meshes [SIZE] | profile-shards]" >&2
    exit 2
    ;;
esac
echo "session $MODE: $(( $(date +%s) - start )) s; files under $DIR and $LOG" | tee -a "$LOG"
if [[ -n ${OUT:-} ]]; then cp -r "$RUN"/. "$OUT"/ && echo "copied to $OUT"; fi
