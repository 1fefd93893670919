"""The cost of ``batch_invariant=True`` against the default, fwd+bwd of ``sum(c0 logp) +
sum(c1 entropy)`` in one jit (per-token cotangents and temperature), bf16, on the fused
path (T = 32768, D = 4096, V = 151936) and the logits path (T = 32768): the planner's
backend, the median time and XLA's planned temporary memory, one row per variant, and
the ratios. Also the exact-sum XLA path (``implementation="xla"``) for scale.

    python -m scripts.gpu_invariant_cost --label main          # $OUT/cost_main.json
    PYTHONPATH=<old checkout>:. python scripts/gpu_invariant_cost.py --label base

(Run by path it takes jaxce and bench from ``PYTHONPATH``: an older checkout's rows in
the same machine session. The problem and the row are ``_fused_rows``', the temperature
per token from its spare key.)
"""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp

import jaxce
from scripts import _fused_rows


def main():
  parser = _fused_rows.parser(__doc__)
  parser.set_defaults(logits_tokens=32768)
  parser.add_argument("--label", default="main")
  parser.add_argument("--skip-exact", action="store_true")
  args = parser.parse_args()
  p = _fused_rows.problem(args)
  t, n = args.tokens, min(args.logits_tokens, args.tokens)
  temperature = jax.random.uniform(p["key"], (t,), jnp.float32, 0.6, 1.4)
  fused = lambda h, w, labels, **kw: jaxce.linear_logprobs_and_entropy(
      h, w, labels, temperature=temperature, **kw)
  per_token = lambda x, labels, **kw: jaxce.logprobs_and_entropy(
      x, labels, temperature=temperature[:n], **kw)
  variants = [("default", {}), ("batch_invariant", dict(batch_invariant=True))]
  if not args.skip_exact:
    variants.append(("exact_xla", dict(batch_invariant=True, implementation="xla")))
  rows = []
  for path, fn, arrays, count in (("fused", fused, (p["hidden"], p["weight"]), t),
                                  ("logits", per_token, (p["logits"],), n)):
    for variant, kw in variants:
      rows.append(dict(label=args.label, path=path, variant=variant, **_fused_rows.fwd_bwd_row(
          fn, arrays, p["labels"][:count], p["cot"][:, :count], args.repeats, **kw)))
      print(json.dumps(rows[-1]), flush=True)
  by = {(r["path"], r["variant"]): r for r in rows}
  summary = dict(label=args.label, **_fused_rows.run_info())
  for path in ("fused", "logits"):
    inv, default = by[(path, "batch_invariant")], by[(path, "default")]
    summary[f"{path}_invariant_over_default"] = inv["fwd_bwd_ms"] / default["fwd_bwd_ms"]
    summary[f"{path}_invariant_extra_temp_gib"] = inv["temp_gib"] - default["temp_gib"]
  print(json.dumps(summary), flush=True)
  _fused_rows.save(f"cost_{args.label}.json", summary, rows)


if __name__ == "__main__":
  main()
