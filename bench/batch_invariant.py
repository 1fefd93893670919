"""Batch invariance on a GPU at real shapes: each probe token's ``logp`` and ``entropy``
bits (V = 151936, D = 4096, bf16, per-token temperature) compared across the calls a user
makes, on the fused path (with and without a softcap), the logits path and both objective
paths:

* alone (T = 1), inside the user's ``jit`` with the temperature an argument (the
  reference), and eagerly (no user ``jit``);
* among T = 7 and 8192 tokens at random positions (one the last row), forward only, the
  temperature closed over (a compile-time constant);
* among T = 8192 and the largest T inside ``jit(value_and_grad)``, the temperature a
  constant and an argument;
* alone, in a second process (XLA autotunes matmuls per process).

``batch_invariant=True`` everywhere, and the default mode where the plan says it holds
(``invariant_to``). One JSON line per check; a summary last; ``$OUT/batch_invariant.json``.

    python -m bench.batch_invariant                          # about 4 minutes on one H100
    python -m bench.batch_invariant --tokens 1024 --vocab 4096 --dim 256   # small

Exits 1 when any check differs.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

import jax
import jax.numpy as jnp
import numpy as np

import jaxce

PROBES = 8


def objective(logp, entropy, adv):
  return -adv * logp - 0.01 * entropy


def problem(tokens, vocab, dim):
  """Host arrays: bf16-valued hidden states and weight, labels, temperatures, advantages
  (the first ``PROBES`` rows are the probes)."""
  rng = np.random.default_rng(0)
  hidden = rng.normal(size=(tokens, dim)).astype(np.float32)
  weight = (rng.normal(size=(dim, vocab)) / np.sqrt(dim)).astype(np.float32)
  weight[:, rng.integers(0, vocab, 8)] *= 6  # a few peaked columns
  return dict(hidden=jnp.asarray(hidden, jnp.bfloat16), weight=jnp.asarray(weight, jnp.bfloat16),
              labels=rng.integers(0, vocab, tokens).astype(np.int32),
              temperature=rng.uniform(0.6, 1.4, tokens).astype(np.float32),
              adv=rng.normal(size=tokens).astype(np.float32))


def paths():
  """``{name: (fn(arrays, labels, temperature, adv, **kw) -> (logp, entropy), uses logits)}``."""
  fused = lambda softcap: lambda a, labels, t, adv, **kw: jaxce.linear_logprobs_and_entropy(
      a["hidden"], a["weight"], labels, temperature=t, logit_softcap=softcap, **kw)
  return {
      "fused": (fused(None), False),
      "fused_softcap": (fused(30.0), False),
      "logits": (lambda a, labels, t, adv, **kw: jaxce.logprobs_and_entropy(
          a["logits"], labels, temperature=t, **kw), True),
      "token_loss": (lambda a, labels, t, adv, **kw: jaxce.token_loss(
          objective, a["logits"], labels, adv, temperature=t, **kw)[1], True),
      "linear_token_loss": (lambda a, labels, t, adv, **kw: jaxce.linear_token_loss(
          objective, a["hidden"], a["weight"], labels, adv, temperature=t, logit_softcap=30.0,
          **kw)[1], False),
  }


class Runner:
  """Calls of one path over the rows ``rows`` of the problem, returning the probes' bits."""

  def __init__(self, p, logits):
    self.p, self.logits = p, logits

  def arrays(self, rows, uses_logits):
    idx = jnp.asarray(rows)
    if uses_logits:
      return dict(logits=jnp.take(self.logits, idx, axis=0))
    return dict(hidden=jnp.take(self.p["hidden"], idx, axis=0), weight=self.p["weight"])

  def call(self, fn, uses_logits, rows, *, how, **kw):
    """``how``: ``"arg"`` (jit, temperature an argument), ``"const"`` (jit, a constant),
    ``"eager"``, ``"grad_arg"`` / ``"grad_const"`` (inside ``jit(value_and_grad)``)."""
    a = self.arrays(rows, uses_logits)
    labels, t, adv = (self.p[k][rows] for k in ("labels", "temperature", "adv"))
    labels, adv = jnp.asarray(labels), jnp.asarray(adv)
    if how == "eager":
      return fn(a, labels, t, adv, **kw)
    if how == "arg":
      return jax.jit(lambda a, t: fn(a, labels, t, adv, **kw))(a, jnp.asarray(t))
    if how == "const":
      return jax.jit(lambda a: fn(a, labels, t, adv, **kw))(a)

    def loss(a, t):
      logp, ent = fn(a, labels, t, adv, **kw)
      return jnp.sum(adv * logp) + 0.01 * jnp.sum(ent), (logp, ent)
    if how == "grad_arg":
      step = jax.jit(jax.value_and_grad(loss, has_aux=True))
      return step(a, jnp.asarray(t))[0][1]
    step = jax.jit(jax.value_and_grad(lambda a: loss(a, t), has_aux=True))
    return step(a)[0][1]


def bits(out, positions):
  return np.stack([np.asarray(o)[positions].view(np.uint32) for o in out])


def alone(runner, fn, uses_logits, how="arg", **kw):
  """``[2, PROBES]`` bits: each probe alone (T = 1)."""
  return np.concatenate([bits(runner.call(fn, uses_logits, np.array([i]), how=how, **kw), [0])
                         for i in range(PROBES)], axis=1)


def among(runner, fn, uses_logits, tokens, how, seed, **kw):
  """``[2, k]`` bits: the first ``k = min(PROBES, tokens)`` probes among ``tokens`` tokens
  at random positions (one of them the last)."""
  rng = np.random.default_rng(seed)
  total = runner.logits.shape[0] if uses_logits else runner.p["labels"].shape[0]
  at = rng.permutation(tokens)[:PROBES]
  if tokens - 1 not in at:
    at[0] = tokens - 1
  rows = rng.integers(PROBES, total, tokens)
  rows[at] = np.arange(len(at))
  return bits(runner.call(fn, uses_logits, rows, how=how, **kw), at)


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--tokens", type=int, default=32768)
  parser.add_argument("--dim", type=int, default=4096)
  parser.add_argument("--vocab", type=int, default=151936)
  parser.add_argument("--logits-tokens", type=int, default=32768)
  parser.add_argument("--only", help="comma-separated paths")
  parser.add_argument("--probe-only", help="write the probes' bits alone (.npz) here and stop")
  args = parser.parse_args()
  p = problem(args.tokens, args.vocab, args.dim)
  n = min(args.logits_tokens, args.tokens)
  logits = (p["hidden"][:n] @ p["weight"]).astype(jnp.bfloat16)
  runner = Runner(p, logits)
  chosen = {k: v for k, v in paths().items()
            if not args.only or k in args.only.split(",")}
  if args.probe_only:
    np.savez(args.probe_only, **{k: alone(runner, fn, logits_, batch_invariant=True)
                                 for k, (fn, logits_) in chosen.items()})
    return
  with tempfile.TemporaryDirectory() as tmp:  # the same calls in a fresh process
    other_file = os.path.join(tmp, "probes.npz")
    subprocess.run([sys.executable, "-m", "bench.batch_invariant", *sys.argv[1:],
                    "--probe-only", other_file], check=True)
    other = dict(np.load(other_file))
  checks = []
  for name, (fn, uses_logits) in chosen.items():
    largest = n if uses_logits else args.tokens
    modes = {"batch_invariant": dict(batch_invariant=True)}
    plan_row = lambda **kw: jaxce.plan.of(
        lambda a, labels: fn(a, labels, p["temperature"][:8], jnp.zeros(8), **kw),
        runner.arrays(np.arange(8), uses_logits), jnp.asarray(p["labels"][:8]))
    default_plan = plan_row()
    if default_plan.invariant_to:
      modes["default"] = {}
    for mode, kw in modes.items():
      plan = plan_row(**kw)
      want = alone(runner, fn, uses_logits, **kw)
      contexts = [("alone, eager", lambda: alone(runner, fn, uses_logits, "eager", **kw)),
                  ("T = 7, constant", lambda: among(runner, fn, uses_logits, 7, "const", 1, **kw)),
                  ("T = 8192, constant", lambda: among(runner, fn, uses_logits, min(8192, largest),
                                                       "const", 2, **kw)),
                  ("T = 8192, value_and_grad, argument",
                   lambda: among(runner, fn, uses_logits, min(8192, largest), "grad_arg", 3, **kw)),
                  (f"T = {largest}, value_and_grad, constant",
                   lambda: among(runner, fn, uses_logits, largest, "grad_const", 4, **kw))]
      if mode == "batch_invariant":
        contexts.append(("alone, another process", lambda: other[name]))
      for what, got_fn in contexts:
        got = got_fn()
        differ = (got != want[:, :got.shape[1]])
        row = dict(path=name, mode=mode, backend=plan.backend, invariant_to=plan.invariant_to,
                   context=what, logp_differ=int(differ[0].sum()),
                   entropy_differ=int(differ[1].sum()), probes=got.shape[1])
        checks.append(row)
        print(json.dumps(row), flush=True)
  failed = [c for c in checks if c["logp_differ"] or c["entropy_differ"]]
  summary = dict(device=jax.devices()[0].device_kind, jax=jax.__version__,
                 commit=os.environ.get("JAXCE_COMMIT", "unknown"), checks=len(checks),
                 failed=len(failed), shapes=dict(tokens=args.tokens, logits_tokens=n,
                                                 vocab=args.vocab, dim=args.dim))
  print(json.dumps(summary), flush=True)
  out = os.environ.get("OUT")
  if out:
    with open(os.path.join(out, "batch_invariant.json"), "w") as f:
      json.dump(dict(summary=summary, checks=checks), f, indent=1)
  sys.exit(1 if failed else 0)


if __name__ == "__main__":
  main()
