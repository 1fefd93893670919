"""Kept-set rows (``keep=``) on a GPU: the fused and logits paths' fwd+bwd with a
top-p-like mask (about 5 % of the vocabulary kept per token, random per token) against the
same call without ``keep`` in the same process, with XLA's compiled memory plan.

    python -m scripts.gpu_keep_rows                      # JSON lines, and $OUT/keep_rows.json
    python -m scripts.gpu_keep_rows --tokens 1024 --vocab 4096 --dim 256   # small

Each row: the backend the planner chose (``jaxce.plan.of``), the median fwd+bwd time, and
the plan's temporary bytes (``memory_analysis``) beyond the inputs and outputs.
"""

from __future__ import annotations

import argparse
import json
import os

import jax
import jax.numpy as jnp
import numpy as np

import jaxce
from bench.timing import time_ms


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--tokens", type=int, default=32768)
  parser.add_argument("--dim", type=int, default=4096)
  parser.add_argument("--vocab", type=int, default=151936)
  parser.add_argument("--logits-tokens", type=int, default=8192)
  parser.add_argument("--kept", type=float, default=0.05)
  parser.add_argument("--repeats", type=int, default=5)
  args = parser.parse_args()
  key = jax.random.key(0)
  k1, k2, k3, k4, k5 = jax.random.split(key, 5)
  t, d, v = args.tokens, args.dim, args.vocab
  hidden = jax.random.normal(k1, (t, d), jnp.bfloat16)
  weight = (jax.random.normal(k2, (d, v), jnp.float32) / np.sqrt(d)).astype(jnp.bfloat16)
  labels = jax.random.randint(k3, (t,), 0, v)
  cot = jax.random.normal(k4, (2, t), jnp.float32)

  @jax.jit
  def make_keep(key, labels):  # ~kept of the columns per token, and the label
    mask = jax.random.uniform(key, (labels.shape[0], v)) < args.kept
    return jaxce.keep.pack(mask | (jnp.arange(v) == labels[:, None]))

  keep = make_keep(k5, labels)
  n = args.logits_tokens
  logits = (hidden[:n] @ weight).astype(jnp.bfloat16)
  rows = []

  def row(path, variant, fn, arrays, labels, cot, **kw):
    def loss(*a):
      logp, ent = fn(*a, labels, **kw)
      return jnp.sum(cot[0] * logp) + jnp.sum(cot[1] * ent)
    step = jax.jit(jax.value_and_grad(loss, argnums=tuple(range(len(arrays)))))
    compiled = step.lower(*arrays).compile()
    plan = jaxce.plan.of(fn, *arrays, labels, **kw)
    ms = time_ms(step, arrays, args.repeats)
    r = dict(path=path, variant=variant, tokens=labels.shape[0], backend=plan.backend,
             reason=plan.reason, fwd_bwd_ms=ms,
             temp_gib=compiled.memory_analysis().temp_size_in_bytes / 2**30,
             keep_gib=(0 if "keep" not in kw else kw["keep"].nbytes / 2**30))
    rows.append(r)
    print(json.dumps(r), flush=True)

  fused = jaxce.linear_logprobs_and_entropy
  row("fused", "default", fused, (hidden, weight), labels, cot)
  row("fused", "xla", fused, (hidden, weight), labels, cot, implementation="xla")
  row("fused", "keep", fused, (hidden, weight), labels, cot, keep=keep)
  per_token = jaxce.logprobs_and_entropy
  row("logits", "default", per_token, (logits,), labels[:n], cot[:, :n])
  row("logits", "xla", per_token, (logits,), labels[:n], cot[:, :n], implementation="xla")
  row("logits", "keep", per_token, (logits,), labels[:n], cot[:, :n], keep=keep[:n])
  by = {(r["path"], r["variant"]): r for r in rows}
  summary = dict(device=jax.devices()[0].device_kind, jax=jax.__version__,
                 commit=os.environ.get("JAXCE_COMMIT", "unknown"), kept_fraction=args.kept)
  for path in ("fused", "logits"):
    keep_row = by[(path, "keep")]
    summary[f"{path}_keep_over_default"] = keep_row["fwd_bwd_ms"] / by[(path, "default")][
        "fwd_bwd_ms"]
    summary[f"{path}_keep_over_xla"] = keep_row["fwd_bwd_ms"] / by[(path, "xla")]["fwd_bwd_ms"]
    summary[f"{path}_keep_extra_temp_gib"] = keep_row["temp_gib"] - by[(path, "xla")]["temp_gib"]
  print(json.dumps(summary), flush=True)
  out = os.environ.get("OUT")
  if out:
    with open(os.path.join(out, "keep_rows.json"), "w") as f:
      json.dump(dict(summary=summary, rows=rows), f, indent=1)


if __name__ == "__main__":
  main()
