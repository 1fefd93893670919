"""What the GPU row scripts (``gpu_keep_rows``, ``gpu_invariant_cost``, ``gpu_kept_ids_*``)
share: the command line, the problem (bf16 ``hidden [T, D]``, ``weight [D, V] / sqrt(D)``,
labels, per-token cotangents ``[2, T]``, and bf16 logits of the first ``--logits-tokens``
rows), one fwd+bwd row (the planner's backend, the median time, the plan's temporary
memory; also ``gpu_keep_logits``'s rows) and the JSON they leave in ``$OUT``."""

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
  """The shared options; a script adds its own."""
  p = argparse.ArgumentParser(description=doc.splitlines()[0])
  p.add_argument("--tokens", type=int, default=32768)
  p.add_argument("--dim", type=int, default=4096)
  p.add_argument("--vocab", type=int, default=151936)
  p.add_argument("--logits-tokens", type=int, default=8192)
  p.add_argument("--repeats", type=int, default=5)
  return p


def problem(args) -> dict:
  """``hidden``, ``weight``, ``labels``, ``cot``, ``logits`` and ``key`` (one key left for
  the script), the same for every script and run."""
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


def kept_ids(ids, sizes, labels):
  """The CSR kept ids (``jaxce.keep.from_csr``) of sets of ``sizes`` (host arrays): each
  set's first id its token's label, then ``ids`` in order."""
  offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int32)
  ids = np.asarray(ids, np.int32).copy()
  ids[offsets[:-1]] = np.asarray(labels)
  return jaxce.keep.from_csr(jnp.asarray(ids), jnp.asarray(offsets))


def save(name: str, summary: dict, rows: list) -> None:
  """``{"summary": ..., "rows": ...}`` to ``$OUT/name`` when ``$OUT`` is set."""
  out = os.environ.get("OUT")
  if out:
    with open(os.path.join(out, name), "w") as f:
      json.dump(dict(summary=summary, rows=rows), f, indent=1)
