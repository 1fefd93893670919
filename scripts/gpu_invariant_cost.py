"""The cost of ``batch_invariant=True`` against the default, fwd+bwd of ``sum(c0 logp) +
sum(c1 entropy)`` in one jit (per-token cotangents and temperature), bf16, on the fused
path (T = 32768, D = 4096, V = 151936) and the logits path (T = 32768): the planner's
backend, the median time and XLA's planned temporary memory, one row per variant, and
the ratios. Also the exact-sum XLA path (``implementation="xla"``) for scale.

    python -m scripts.gpu_invariant_cost --label main          # $OUT/cost_main.json
    PYTHONPATH=<an older checkout> python scripts/gpu_invariant_cost.py --label base

(Run by path it takes jaxce and bench from ``PYTHONPATH``: an older checkout's rows in
the same machine session.)
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
  parser.add_argument("--repeats", type=int, default=5)
  parser.add_argument("--label", default="main")
  parser.add_argument("--skip-exact", action="store_true")
  args = parser.parse_args()
  t, d, v = args.tokens, args.dim, args.vocab
  k1, k2, k3, k4, k5 = jax.random.split(jax.random.key(0), 5)
  hidden = jax.random.normal(k1, (t, d), jnp.bfloat16)
  weight = (jax.random.normal(k2, (d, v), jnp.float32) / np.sqrt(d)).astype(jnp.bfloat16)
  labels = jax.random.randint(k3, (t,), 0, v)
  cot = jax.random.normal(k4, (2, t), jnp.float32)
  temperature = jax.random.uniform(k5, (t,), jnp.float32, 0.6, 1.4)
  fused = lambda h, w, **kw: jaxce.linear_logprobs_and_entropy(h, w, labels,
                                                               temperature=temperature, **kw)
  per_token = lambda x, **kw: jaxce.logprobs_and_entropy(x, labels, temperature=temperature,
                                                         **kw)
  variants = [("default", {}), ("batch_invariant", dict(batch_invariant=True))]
  if not args.skip_exact:
    variants.append(("exact_xla", dict(batch_invariant=True, implementation="xla")))
  rows = []
  for path in ("fused", "logits"):
    if path == "fused":
      fn, arrays = fused, (hidden, weight)
    else:
      fn, arrays = per_token, ((hidden @ weight).astype(jnp.bfloat16),)
    for variant, kw in variants:
      def loss(*a, kw=kw):
        logp, ent = fn(*a, **kw)
        return jnp.sum(cot[0] * logp) + jnp.sum(cot[1] * ent)
      step = jax.jit(jax.value_and_grad(loss, argnums=tuple(range(len(arrays)))))
      compiled = step.lower(*arrays).compile()
      plan = jaxce.plan.of(fn, *arrays, **kw)
      row = dict(label=args.label, path=path, variant=variant, tokens=t, backend=plan.backend,
                 fwd_bwd_ms=time_ms(compiled, arrays, args.repeats),
                 temp_gib=compiled.memory_analysis().temp_size_in_bytes / 2**30)
      rows.append(row)
      print(json.dumps(row), flush=True)
    del arrays
  by = {(r["path"], r["variant"]): r for r in rows}
  summary = dict(label=args.label, device=jax.devices()[0].device_kind, jax=jax.__version__,
                 commit=os.environ.get("JAXCE_COMMIT", "unknown"))
  for path in ("fused", "logits"):
    inv, default = by[(path, "batch_invariant")], by[(path, "default")]
    summary[f"{path}_invariant_over_default"] = inv["fwd_bwd_ms"] / default["fwd_bwd_ms"]
    summary[f"{path}_invariant_extra_temp_gib"] = inv["temp_gib"] - default["temp_gib"]
  print(json.dumps(summary), flush=True)
  out = os.environ.get("OUT")
  if out:
    with open(os.path.join(out, f"cost_{args.label}.json"), "w") as f:
      json.dump(dict(summary=summary, rows=rows), f, indent=1)


if __name__ == "__main__":
  main()
