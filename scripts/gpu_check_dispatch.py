"""GPU check of the one dispatcher: the default fused call compiles to the same kernels
locally and through ``sharded_*`` (a one-device mesh), and runs in the same time.

For each of the four operations (fwd+bwd with per-token cotangents, default options,
bf16): the plan (``jaxce.plan.of``), the custom calls of the compiled program (Mosaic GPU
and Triton kernels counted by their targets), and, for the fused per-token path, the
median time of the local and the sharded call in the same process.

    python -m scripts.gpu_check_dispatch                 # on a GPU: JSON lines, and $OUT/dispatch.json
    python -m scripts.gpu_check_dispatch --tokens 1024   # smaller
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

import jaxce
from bench.timing import time_ms


def _custom_calls(compiled_text):
  """``{target: count}`` of the custom calls in an optimized HLO module's text."""
  return dict(collections.Counter(re.findall(r'custom_call_target="([^"]+)"', compiled_text)))


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--tokens", type=int, default=32768)
  parser.add_argument("--dim", type=int, default=4096)
  parser.add_argument("--vocab", type=int, default=151936)
  parser.add_argument("--repeats", type=int, default=10)
  args = parser.parse_args(argv)
  rng = np.random.default_rng(0)
  t, d, v = args.tokens, args.dim, args.vocab
  hidden = jnp.asarray(rng.normal(size=(t, d)), jnp.bfloat16)
  weight = jnp.asarray(rng.normal(size=(d, v)) / np.sqrt(d), jnp.bfloat16)
  logits_shape = (min(t, 8192), v)  # the logits paths at a size that fits beside the rest
  logits = jnp.asarray(rng.normal(size=logits_shape) * 3, jnp.bfloat16)
  labels = jnp.asarray(rng.integers(0, v, t), jnp.int32)
  cot = jnp.asarray(rng.normal(size=(2, t)), jnp.float32)
  mesh = Mesh(np.array(jax.devices()[:1]), ("vocab",))
  sharded = dict(mesh=mesh, vocab_axis="vocab")
  objective = lambda logp, entropy, adv: -adv * logp - 0.01 * entropy

  def per_token(fn, n, **kw):
    def loss(*a):
      logp, ent = fn(*a, labels[:n], **kw)
      return jnp.sum(cot[0, :n] * logp) + jnp.sum(cot[1, :n] * ent)
    return loss

  def objective_loss(fn, n, **kw):
    return lambda *a: fn(objective, *a, labels[:n], cot[0, :n], **kw)[0]

  n_logits = logits_shape[0]
  cases = {
      "linear_logprobs_and_entropy": (
          jaxce.linear_logprobs_and_entropy, jaxce.sharded_linear_logprobs_and_entropy,
          per_token, (hidden, weight), t),
      "logprobs_and_entropy": (jaxce.logprobs_and_entropy, jaxce.sharded_logprobs_and_entropy,
                               per_token, (logits,), n_logits),
      "linear_token_loss": (jaxce.linear_token_loss, jaxce.sharded_linear_token_loss,
                            objective_loss, (hidden, weight), t),
      "token_loss": (jaxce.token_loss, jaxce.sharded_token_loss, objective_loss, (logits,),
                     n_logits),
  }
  rows = []
  for name, (local_fn, sharded_fn, make_loss, arrays, n) in cases.items():
    for way, fn, kw in (("local", local_fn, {}), ("sharded", sharded_fn, sharded)):
      loss = make_loss(fn, n, **kw)
      call = (lambda *a: fn(objective, *a, labels[:n], cot[0, :n], **kw) if "token_loss" in name
              else fn(*a, labels[:n], **kw))
      step = jax.jit(jax.value_and_grad(loss, argnums=tuple(range(len(arrays)))))
      row = dict(operation=name, way=way, tokens=n,
                 plan=dataclasses.asdict(jaxce.plan.of(call, *arrays)),
                 custom_calls=_custom_calls(step.lower(*arrays).compile().as_text()))
      if name == "linear_logprobs_and_entropy":
        row["fwd_bwd_ms"] = time_ms(step, arrays, args.repeats)
      rows.append(row)
      print(json.dumps(row), flush=True)
  local, shard = (r for r in rows if r["operation"] == "linear_logprobs_and_entropy")
  summary = dict(
      device=jax.devices()[0].device_kind, jax=jax.__version__,
      same_kernels_everywhere=all(
          a["custom_calls"] == b["custom_calls"] and a["plan"] == b["plan"]
          for a, b in zip(rows[::2], rows[1::2])),
      fused_default_backend=local["plan"]["backend"],
      sharded_over_local_time=shard["fwd_bwd_ms"] / local["fwd_bwd_ms"])
  print(json.dumps(summary), flush=True)
  out = os.environ.get("OUT")
  if out:
    with open(os.path.join(out, "dispatch.json"), "w") as f:
      json.dump(dict(summary=summary, rows=rows), f, indent=1)


if __name__ == "__main__":
  main()
