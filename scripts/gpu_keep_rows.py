"""Kept-set rows (``keep=``) on a GPU: the fused and logits paths' fwd+bwd with a
top-p-like mask (about 5 % of the vocabulary kept per token, random per token) against the
same call without ``keep`` in the same process, with XLA's compiled memory plan.

    python -m scripts.gpu_keep_rows                      # JSON lines, and $OUT/keep_rows.json
    python -m scripts.gpu_keep_rows --tokens 1024 --vocab 4096 --dim 256   # small

Each row: the backend the planner chose (``jaxce.plan.of``), the median fwd+bwd time, and
the plan's temporary bytes (``memory_analysis``) beyond the inputs and outputs.
"""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp

import jaxce
from scripts import _fused_rows


def main():
  parser = _fused_rows.parser(__doc__)
  parser.add_argument("--kept", type=float, default=0.05)
  args = parser.parse_args()
  p = _fused_rows.problem(args)
  hidden, weight, labels, cot, logits = (p[k] for k in ("hidden", "weight", "labels", "cot",
                                                         "logits"))
  v, n = args.vocab, args.logits_tokens

  @jax.jit
  def make_keep(key, labels):  # ~kept of the columns per token, and the label
    mask = jax.random.uniform(key, (labels.shape[0], v)) < args.kept
    return jaxce.keep.pack(mask | (jnp.arange(v) == labels[:, None]))

  keep = make_keep(p["key"], labels)
  rows = []

  def row(path, variant, fn, arrays, labels, cot, **kw):
    r = dict(path=path, variant=variant,
             **_fused_rows.fwd_bwd_row(fn, arrays, labels, cot, args.repeats, **kw),
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
