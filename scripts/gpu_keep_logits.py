"""The logits path's fwd+bwd with a ~5 % kept set (``keep=``) against the same call
without, in one process, each row printed as it is measured (JSON lines; also
``$OUT/keep_logits.jsonl``): ``_fused_rows.fwd_bwd_row``'s backend, median time and
temporary memory.

    python -m scripts.gpu_keep_logits [--tokens 32768 --vocab 151936 --kept 0.05]
"""

from __future__ import annotations

import argparse
import json
import os

import jax
import jax.numpy as jnp

import jaxce
from scripts import _fused_rows


def main():
  parser = argparse.ArgumentParser(description=__doc__)
  parser.add_argument("--tokens", type=int, default=32768)
  parser.add_argument("--vocab", type=int, default=151936)
  parser.add_argument("--kept", type=float, default=0.05)
  parser.add_argument("--repeats", type=int, default=10)
  args = parser.parse_args()
  t, v = args.tokens, args.vocab
  key = jax.random.key(0)
  logits = (jax.random.normal(key, (t, v), jnp.float32) * 3).astype(jnp.bfloat16)
  labels = jax.random.randint(key, (t,), 0, v)
  keep = jax.jit(lambda k: jaxce.keep.pack(
      (jax.random.uniform(k, (t, v)) < args.kept) | (jnp.arange(v) == labels[:, None])))(key)
  cot = jax.random.normal(key, (2, t))
  out = os.environ.get("OUT")
  rows = []

  def row(variant, **kw):
    r = dict(variant=variant, vocab=v, **_fused_rows.fwd_bwd_row(
        jaxce.logprobs_and_entropy, (logits,), labels, cot, args.repeats, **kw),
        device=jax.devices()[0].device_kind, jax=jax.__version__,
        commit=os.environ.get("JAXCE_COMMIT", "unknown"))
    rows.append(r)
    print(json.dumps(r), flush=True)
    if out:
      with open(os.path.join(out, "keep_logits.jsonl"), "a") as f:
        f.write(json.dumps(r) + "\n")

  row("default")
  row("keep", keep=keep)
  row("default")  # (again: the spread)
  row("keep_xla", keep=keep, implementation="xla")
  row("keep_invariant", keep=keep, batch_invariant=True)
  base = min(r["fwd_bwd_ms"] for r in rows if r["variant"] == "default")
  print(json.dumps({r["variant"]: round(r["fwd_bwd_ms"] / base, 3) for r in rows}))


if __name__ == "__main__":
  main()
