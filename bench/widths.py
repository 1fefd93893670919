"""``python -m bench.widths``: the fused head's time per vocabulary column at the widths a
device holds when a real vocabulary is split over GPUs (not multiples of 128), against
the nearest multiple of 128 above, in one process on one GPU.

    python -m bench.widths                                  # the default widths and modes
    python -m bench.widths --V 37984,75968 --mode fwd --out bench/out/widths.json

A kernel sees only its shard: a local call at V = 37984 is what each GPU of a 4-way Qwen3
call runs. Each row: the median of ``--repeats`` timed calls (``bench.timing``), inputs
made on the host; ``per_column`` is the ragged width's time per column over its round
neighbour's, from the same process.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess

import numpy as np

# Qwen3's 151936 over 2, 4, 8 GPUs; Llama 3's 128256 over 4.
WIDTHS = (37984, 75968, 18992, 32064)


def _inputs(tokens, depth, columns, seed=0):
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  rng = np.random.default_rng(seed)
  hidden = (rng.normal(size=(tokens, depth)) * 0.5).astype(np.float32)
  weight = (rng.normal(size=(depth, columns)) * 2 / np.sqrt(depth)).astype(np.float32)
  labels = rng.integers(0, columns, tokens).astype(np.int32)
  cotangents = rng.normal(size=(2, tokens)).astype(np.float32)
  put = lambda a: jax.device_put(jnp.asarray(a, jnp.bfloat16))
  return put(hidden), put(weight), jax.device_put(labels), jax.device_put(cotangents)


def _call(mode):
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  import jaxce  # pylint: disable=import-outside-toplevel

  def run(hidden, weight, labels, cotangents):
    def loss(h, w):
      logp, entropy = jaxce.linear_logprobs_and_entropy(h, w, labels)
      return jnp.sum(logp * cotangents[0] + entropy * cotangents[1]), (logp, entropy)
    if mode == "fwd":
      return loss(hidden, weight)[1]
    return jax.grad(loss, (0, 1), has_aux=True)(hidden, weight)
  return jax.jit(run)


def measure(widths, modes, tokens, depth, repeats):
  """Rows ``{mode, V, V_round, ms, ms_round, per_column, backend}``."""
  import jax  # pylint: disable=import-outside-toplevel
  import jaxce  # pylint: disable=import-outside-toplevel
  from bench.timing import time_calls  # pylint: disable=import-outside-toplevel
  rows = []
  for mode in modes:
    for columns in widths:
      round_columns = -(-columns // 128) * 128
      ms, backend = {}, {}
      for width in (columns, round_columns):
        args = _inputs(tokens, depth, width)
        backend[width] = jaxce.plan.of(jaxce.linear_logprobs_and_entropy, *args[:3]).backend
        ms[width] = statistics.median(time_calls(_call(mode), args, repeats=repeats, warmup=2))
        del args
        jax.clear_caches()
      row = dict(mode=mode, V=columns, V_round=round_columns, T=tokens, D=depth,
                 ms=ms[columns], ms_round=ms[round_columns],
                 per_column=(ms[columns] / columns) / (ms[round_columns] / round_columns),
                 backend=backend[columns], backend_round=backend[round_columns])
      print(json.dumps(row), flush=True)
      rows.append(row)
  return rows


def main(argv=None):
  p = argparse.ArgumentParser(prog="python -m bench.widths", description=__doc__.splitlines()[0])
  p.add_argument("--V", default=",".join(map(str, WIDTHS)), help="comma list of widths")
  p.add_argument("--mode", default="fwd,fwd_bwd", help="comma list: fwd,fwd_bwd")
  p.add_argument("--T", type=int, default=32768)
  p.add_argument("--D", type=int, default=4096)
  p.add_argument("--repeats", type=int, default=7)
  p.add_argument("--out", help="write the rows here (json), with the device and versions")
  args = p.parse_args(argv)
  import jax  # pylint: disable=import-outside-toplevel
  rows = measure([int(v) for v in args.V.split(",")], args.mode.split(","), args.T, args.D,
                 args.repeats)
  if args.out:
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    commit = os.environ.get("JAXCE_COMMIT") or subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True,
        text=True).stdout.strip()
    with open(args.out, "w", encoding="utf-8") as f:
      json.dump(dict(device=jax.devices()[0].device_kind, jax=jax.__version__, commit=commit,
                     rows=rows), f, indent=1)


if __name__ == "__main__":
  main()
