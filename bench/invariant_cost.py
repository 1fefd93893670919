"""The cost of ``batch_invariant=True`` against the default, fwd+bwd of ``sum(c0 logp) +
sum(c1 entropy)`` in one jit (per-token cotangents and temperature), bf16, on the fused
path (T = 32768, D = 4096, V = 151936) and the logits path (T = 32768): the planner's
backend, the median time and XLA's planned temporary memory, one row per variant, and
the ratios. Also the exact-sum XLA path (``implementation="xla"``) for scale.

    python -m bench.invariant_cost --label main          # $OUT/cost_main.json
    PYTHONPATH=<old checkout>:. python bench/invariant_cost.py --label base

(Run by path it takes jaxce and ``bench.timing`` from ``PYTHONPATH``: an older checkout's
rows in the same machine session. The problem: bf16 ``hidden [T, D]``, ``weight [D, V] /
sqrt(D)``, labels, per-token cotangents ``[2, T]``, bf16 logits of the first
``--logits-tokens`` rows, and the temperature per token from the problem's spare key.)
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


def parser(doc: str) -> argparse.ArgumentParser:
  """The problem's options; ``main`` adds its own."""
  p = argparse.ArgumentParser(description=doc.splitlines()[0])
  p.add_argument("--tokens", type=int, default=32768)
  p.add_argument("--dim", type=int, default=4096)
  p.add_argument("--vocab", type=int, default=151936)
  p.add_argument("--logits-tokens", type=int, default=8192)
  p.add_argument("--repeats", type=int, default=5)
  return p


def problem(args) -> dict:
  """``hidden``, ``weight``, ``labels``, ``cot``, ``logits`` and ``key`` (one key left, for
  the temperature), the same for every run."""
  k1, k2, k3, k4, key = jax.random.split(jax.random.key(0), 5)
  t, d, v = args.tokens, args.dim, args.vocab
  hidden = jax.random.normal(k1, (t, d), jnp.bfloat16)
  weight = (jax.random.normal(k2, (d, v), jnp.float32) / np.sqrt(d)).astype(jnp.bfloat16)
  return dict(hidden=hidden, weight=weight, labels=jax.random.randint(k3, (t,), 0, v),
              cot=jax.random.normal(k4, (2, t), jnp.float32),
              logits=(hidden[:args.logits_tokens] @ weight).astype(jnp.bfloat16), key=key)


def fwd_bwd_row(fn, arrays, labels, cot, repeats, **kw) -> dict:
  """``fn(*arrays, labels, **kw)``'s ``sum(cot[0] logp) + sum(cot[1] entropy)`` and its
  gradient (for ``arrays``) in one jit, which takes ``arrays``, the labels and the
  keyword arrays of ``kw`` (``keep``, a temperature) as its arguments, as a training
  step does, and closes over the other options: ``tokens``, ``backend`` and ``reason``
  (``jaxce.plan.of``), ``fwd_bwd_ms`` (median) and ``temp_gib`` (``memory_analysis``)."""
  is_array = lambda v: bool(jax.tree.leaves(v)) and all(
      isinstance(leaf, jax.Array) for leaf in jax.tree.leaves(v))
  arguments = {k: v for k, v in kw.items() if is_array(v)}
  kw = {k: v for k, v in kw.items() if k not in arguments}

  def loss(a, lab, named):
    logp, ent = fn(*a, lab, **named, **kw)
    return jnp.sum(cot[0] * logp) + jnp.sum(cot[1] * ent)
  step = jax.jit(jax.value_and_grad(loss))
  inputs = (tuple(arrays), labels, arguments)
  compiled = step.lower(*inputs).compile()
  plan = jaxce.plan.of(fn, *arrays, labels, **arguments, **kw)
  return dict(tokens=labels.shape[0], backend=plan.backend, reason=plan.reason,
              fwd_bwd_ms=time_ms(step, inputs, repeats),
              temp_gib=compiled.memory_analysis().temp_size_in_bytes / 2**30)


def run_info(**extra) -> dict:
  """What a run's summary starts with: the device, JAX's version and the commit
  (``$JAXCE_COMMIT``), then ``extra``."""
  return dict(device=jax.devices()[0].device_kind, jax=jax.__version__,
              commit=os.environ.get("JAXCE_COMMIT", "unknown"), **extra)


def save(name: str, summary: dict, rows: list) -> None:
  """``{"summary": ..., "rows": ...}`` to ``$OUT/name`` when ``$OUT`` is set."""
  out = os.environ.get("OUT")
  if out:
    with open(os.path.join(out, name), "w") as f:
      json.dump(dict(summary=summary, rows=rows), f, indent=1)


def main():
  cli = parser(__doc__)
  cli.set_defaults(logits_tokens=32768)
  cli.add_argument("--label", default="main")
  cli.add_argument("--skip-exact", action="store_true")
  args = cli.parse_args()
  p = problem(args)
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
      rows.append(dict(label=args.label, path=path, variant=variant, **fwd_bwd_row(
          fn, arrays, p["labels"][:count], p["cot"][:, :count], args.repeats, **kw)))
      print(json.dumps(rows[-1]), flush=True)
  by = {(r["path"], r["variant"]): r for r in rows}
  summary = dict(label=args.label, **run_info())
  for path in ("fused", "logits"):
    inv, default = by[(path, "batch_invariant")], by[(path, "default")]
    summary[f"{path}_invariant_over_default"] = inv["fwd_bwd_ms"] / default["fwd_bwd_ms"]
    summary[f"{path}_invariant_extra_temp_gib"] = inv["temp_gib"] - default["temp_gib"]
  print(json.dumps(summary), flush=True)
  save(f"cost_{args.label}.json", summary, rows)


if __name__ == "__main__":
  main()
