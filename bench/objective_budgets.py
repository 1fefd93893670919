"""The fused objective path's memory against its time in the GRPO example
(``examples.gpu_run``'s small default: D = 1024, 8 x 1024 tokens, V = 151936): the
objective step at other sizes of its group (``jaxce.plan.LINEAR_OBJECTIVE_GRAD_PER_SUM``:
a group's ``d`` against the f32 ``d W`` sum's bytes, within ``LINEAR_OBJECTIVE_GRAD_BYTES``),
beside plain JAX's step, each setting in a fresh process (its own peak). One JSON line per
setting: the planned ``(chunk, group)``, the median step time and the peak bytes in use.

    python -m bench.objective_budgets > OUT.jsonl     # on one GPU, about 3 minutes

Smaller groups hold less ``d``, at one more pass over the f32 ``d W`` sum per group
(bench/NOTES.md, entries 36 and 39).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

# LINEAR_OBJECTIVE_GRAD_PER_SUM on GPUs: the default, then larger and smaller groups.
SETTINGS = (1.0, 2.0, 0.5)


def measure(path: str, per_sum: float = 0.0) -> dict:
  """One path's step in this process, the objective's group budget set first."""
  import jax  # pylint: disable=import-outside-toplevel
  import jaxce  # pylint: disable=import-outside-toplevel
  from examples import gpu_run  # pylint: disable=import-outside-toplevel
  tiles = None
  args = gpu_run.parse_args(["--out", "unused.json", "--warmup", "2", "--steps", "7"])
  if path == "objective":
    jaxce.plan.LINEAR_OBJECTIVE_GRAD_PER_SUM["gpu"] = per_sum
    tiles = jaxce.plan.linear_objective_kernel_tiles(8184, 151936, platform="gpu",
                                                     depth=args.d_model)
  result = gpu_run.measure(args, path)
  return dict(path=path, grad_per_sum=per_sum, chunk_group=tiles,
              step_ms=result["step_ms_median"], peak_bytes=result["peak_bytes_in_use"][0],
              peak_minus_before=result["peak_minus_before"][0],
              device=jax.devices()[0].device_kind, jax=jax.__version__)


def main():
  if len(sys.argv) > 1:  # a child: one setting
    path, *setting = sys.argv[1:]
    print(json.dumps(measure(path, *map(float, setting))), flush=True)
    return
  runs = [("plain",)] + [("objective", str(s)) for s in SETTINGS] + [
      ("objective", str(SETTINGS[0])), ("plain",)]  # (the ends: the run's drift)
  for run in runs:
    out = subprocess.run([sys.executable, "-m", "bench.objective_budgets", *run],
                         capture_output=True, text=True, check=False,
                         env={**os.environ, "XLA_PYTHON_CLIENT_PREALLOCATE": "false"})
    lines = [line for line in out.stdout.splitlines() if line.startswith("{")]
    print(lines[-1] if lines else json.dumps(dict(run=run, error=out.stderr[-2000:])),
          flush=True)


if __name__ == "__main__":
  main()
