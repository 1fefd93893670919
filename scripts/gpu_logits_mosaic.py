"""The logits path's Mosaic GPU forward (``mosaic_rows``) on a Hopper GPU: values against
float64 on peaked and shifted logits at awkward sizes, a token's bits alone and among
others and with its temperature a constant or an argument, then the forward and fwd+bwd
times of every backend at ``--tokens`` x ``--vocab`` bf16 next to one copy of the logits,
and the kernel's settings swept (pipeline bytes, tiles per group).

    python -m scripts.gpu_logits_mosaic                # prints JSON lines and a table
    python -m scripts.gpu_logits_mosaic --skip-sweep   # correctness and the backends only

Writes ``$OUT/logits_mosaic.jsonl`` when ``OUT`` is set. Exits 1 when a check fails.
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
from jaxce import reference
from jaxce._kernels import mosaic_rows

ROWS = []


def emit(**row):
  row.update(device=jax.devices()[0].device_kind, jax=jax.__version__,
             commit=os.environ.get("JAXCE_COMMIT", "unknown"))
  ROWS.append(row)
  print(json.dumps(row), flush=True)


def adversarial(rng, t, v, dtype):
  """Peaked and shifted rows (drawn on the device): a per-row offset of +-200, a spike
  of +40 per row, a -inf column in every 7th row."""
  k1, k2 = jax.random.split(jax.random.key(int(rng.integers(2**31))))
  x = jax.random.normal(k1, (t, v), jnp.float32) * 3 + jax.random.uniform(
      k2, (t, 1), jnp.float32, -200, 200)
  x = x.at[jnp.arange(t), jnp.asarray(rng.integers(0, v, t))].add(40)
  x = x.at[::7, 1].set(-jnp.inf)
  return x.astype(dtype)


def reference64(x, labels, temperature, vocab_size):
  """``(logp, entropy)`` in float64 (NumPy), row by row."""
  x = np.asarray(x.astype(jnp.float32), np.float64)
  labels, t = np.asarray(labels), np.asarray(temperature, np.float64)
  logp, ent = np.zeros(len(labels)), np.zeros(len(labels))
  for i in range(len(labels)):
    z = x[i] / t[i]
    if vocab_size is not None:
      z[vocab_size:] = -np.inf
    m = np.max(z)
    log_p = z - (m + np.log(np.sum(np.exp(z - m))))
    p = np.exp(log_p)
    logp[i], ent[i] = log_p[labels[i]], -np.sum(np.where(p > 0, p * log_p, 0))
  return logp, ent


def check_values(rng, small):
  failed = 0
  cases = [(4096, 151936, jnp.bfloat16, None), (300, 1024, jnp.bfloat16, None),
           (13, 32000, jnp.float32, 31900), (1, 2048, jnp.float16, None),
           (777, 4096, jnp.bfloat16, 4000)]
  if small:  # (a smoke test off GPUs, in the interpreter)
    cases = [(70, 256, jnp.bfloat16, 250), (13, 384, jnp.float32, None)]
  for t, v, dtype, vocab_size in cases:
    x = adversarial(rng, t, v, dtype)
    labels = jnp.asarray(rng.integers(0, vocab_size or v, t), jnp.int32)
    temperature = jnp.asarray(rng.uniform(0.5, 1.5, t), jnp.float32)
    cot = [jnp.asarray(rng.standard_normal(t), jnp.float32) for _ in range(2)]
    kw = dict(temperature=temperature, vocab_size=vocab_size)

    def loss(x, implementation):
      logp, ent = jaxce.logprobs_and_entropy(x, labels, implementation=implementation, **kw)
      return jnp.sum(cot[0] * logp) + jnp.sum(cot[1] * ent), (logp, ent)

    (_, (logp, ent)), grad = jax.jit(jax.value_and_grad(loss, has_aux=True),
                                     static_argnums=1)(x, "mosaic")
    want_logp, want_ent = reference64(x, labels, temperature, vocab_size)
    err = lambda a, b: float(np.max(np.abs(np.asarray(a, np.float64) - b) / (1 + np.abs(b)),
                                    initial=0.0, where=np.isfinite(b)))
    (_, _), grad_xla = jax.jit(jax.value_and_grad(loss, has_aux=True), static_argnums=1)(
        x, "xla")
    g, gx = np.asarray(grad.astype(jnp.float32)), np.asarray(grad_xla.astype(jnp.float32))
    row = dict(check="values", tokens=t, vocab=v, dtype=jnp.dtype(dtype).name,
               vocab_size=vocab_size, logp_err=err(logp, want_logp), ent_err=err(ent, want_ent),
               grad_vs_xla=float(np.max(np.abs(g - gx)) / (np.max(np.abs(gx)) + 1e-30)),
               finite=bool(np.isfinite(np.asarray(logp)).all() and np.isfinite(g).all()))
    row["ok"] = (row["logp_err"] < 5e-6 and row["ent_err"] < 5e-6 and row["finite"]
                 and row["grad_vs_xla"] < 2e-2)
    failed += not row["ok"]
    emit(**row)
  return failed


def check_bits(rng, t, v):
  """A token's bits: alone, among 4095 others, among ``t - 1``, with its temperature
  passed or closed over, forward only or under grad; with ``batch_invariant`` False and
  True (checked where the plan is Mosaic's)."""
  failed = 0
  x = adversarial(rng, t, v, jnp.bfloat16)
  labels = jnp.asarray(rng.integers(0, v, t), jnp.int32)
  temperature = jnp.asarray(rng.uniform(0.5, 1.5, t), jnp.float32)
  probe = [0, 1, 777, 4095]
  for invariant in (False, True):
    call = lambda x, lab, t: jaxce.logprobs_and_entropy(x, lab, temperature=t,
                                                        batch_invariant=invariant)
    outs = {}
    for n in (1, 4096, t):
      rows = slice(0, n)
      outs[f"among {n}"] = jax.jit(call)(x[rows], labels[rows], temperature[rows])
      outs[f"constant {n}"] = jax.jit(lambda x, lab: call(x, lab, temperature[rows]))(
          x[rows], labels[rows])
      grad = jax.jit(jax.grad(lambda x, lab, t: (jnp.sum(call(x, lab, t)[0]), call(x, lab, t)),
                              has_aux=True))
      outs[f"under grad {n}"] = grad(x[rows], labels[rows], temperature[rows])[1]
    base = np.stack([np.asarray(a) for a in outs["among 4096"]])
    mismatches = {}
    for name, out in outs.items():
      out = np.stack([np.asarray(a) for a in out])
      idx = [i for i in probe if i < out.shape[1]]
      mismatches[name] = int(np.sum(out[:, idx].view(np.uint32) != base[:, idx].view(np.uint32)))
    plan = jaxce.plan.of(jaxce.logprobs_and_entropy, x[:4096], labels[:4096],
                         batch_invariant=invariant)
    ok = plan.backend != "mosaic" or all(m == 0 for m in mismatches.values())
    failed += not ok
    emit(check="bits", batch_invariant=invariant, backend=plan.backend,
         invariant_to=plan.invariant_to, mismatches=mismatches, ok=ok)
  return failed


def time_backends(rng, t, v, repeats):
  x = adversarial(rng, t, v, jnp.bfloat16)
  labels = jnp.asarray(rng.integers(0, v, t), jnp.int32)
  temperature = jnp.asarray(rng.uniform(0.5, 1.5, t), jnp.float32)
  cot = [jnp.asarray(rng.standard_normal(t), jnp.float32) for _ in range(2)]
  copy_ms = time_ms(jax.jit(jnp.copy), (x,), repeats)
  logits_gib = x.size * 2 / 2**30
  emit(kind="copy", tokens=t, vocab=v, ms=copy_ms, logits_gib=logits_gib,
       read_ms=copy_ms / 2, GBps=2 * x.size * 2 / copy_ms / 1e6)
  variants = [("mosaic", {}), ("triton", {}), ("xla", {}),
              ("default invariant", dict(batch_invariant=True))]
  for name, kw in variants:
    impl = None if name.startswith("default") else name
    kw = dict(kw, temperature=temperature, implementation=impl)
    fwd = jax.jit(lambda x, lab: jaxce.logprobs_and_entropy(x, lab, **kw))

    def loss(x, lab):
      logp, ent = jaxce.logprobs_and_entropy(x, lab, **kw)
      return jnp.sum(cot[0] * logp) + jnp.sum(cot[1] * ent)

    step = jax.jit(jax.value_and_grad(loss))
    try:
      fwd_ms = time_ms(fwd, (x, labels), repeats)
      both_ms = time_ms(step, (x, labels), repeats)
      temp = step.lower(x, labels).compile().memory_analysis().temp_size_in_bytes / 2**30
      plan = jaxce.plan.of(jaxce.logprobs_and_entropy, x, labels, **kw)
      emit(kind="backend", variant=name, backend=plan.backend, tokens=t, vocab=v,
           fwd_ms=fwd_ms, fwd_bwd_ms=both_ms, temp_gib=temp,
           fwd_over_read=fwd_ms / (copy_ms / 2), fwd_bwd_over_3_passes=both_ms / (1.5 * copy_ms))
    except Exception as e:  # (a backend that cannot run: recorded, the rest goes on)
      emit(kind="backend", variant=name, error=f"{type(e).__name__}: {e}"[:400])
  return x, labels, temperature, copy_ms


def sweep(x, labels, temperature, copy_ms, repeats):
  base = (mosaic_rows.STAGE_BYTES, mosaic_rows.MIN_TILES_PER_GROUP)
  for stage_kib in (64, 96, 160):
    for min_tiles in (8, 32, 128):
      mosaic_rows.STAGE_BYTES, mosaic_rows.MIN_TILES_PER_GROUP = stage_kib * 2**10, min_tiles
      jax.clear_caches()
      fwd = jax.jit(lambda x, lab: jaxce.logprobs_and_entropy(
          x, lab, temperature=temperature, implementation="mosaic"))
      try:
        ms = time_ms(fwd, (x, labels), repeats)
        emit(kind="sweep", stage_kib=stage_kib, min_tiles_per_group=min_tiles,
             tiles_per_group=mosaic_rows.tiles_per_group(x.shape[1]), fwd_ms=ms,
             fwd_over_read=ms / (copy_ms / 2))
      except Exception as e:
        emit(kind="sweep", stage_kib=stage_kib, min_tiles_per_group=min_tiles,
             error=f"{type(e).__name__}: {e}"[:400])
  mosaic_rows.STAGE_BYTES, mosaic_rows.MIN_TILES_PER_GROUP = base
  jax.clear_caches()


def main():
  parser = argparse.ArgumentParser(description=__doc__)
  parser.add_argument("--tokens", type=int, default=32768)
  parser.add_argument("--vocab", type=int, default=151936)
  parser.add_argument("--repeats", type=int, default=10)
  parser.add_argument("--skip-sweep", action="store_true")
  parser.add_argument("--small", action="store_true", help="small value checks (off GPUs)")
  args = parser.parse_args()
  rng = np.random.default_rng(0)
  failed = check_values(rng, args.small)
  failed += check_bits(rng, args.tokens, args.vocab)
  x, labels, temperature, copy_ms = time_backends(rng, args.tokens, args.vocab, args.repeats)
  if not args.skip_sweep:
    sweep(x, labels, temperature, copy_ms, args.repeats)
  out = os.environ.get("OUT")
  if out:
    with open(os.path.join(out, "logits_mosaic.jsonl"), "w") as f:
      f.writelines(json.dumps(r) + "\n" for r in ROWS)
  for r in ROWS:
    print({k: (float(f"{v:.4g}") if isinstance(v, float) else v) for k, v in r.items()
           if k not in ("device", "jax", "commit", "reason")})
  print("FAILED" if failed else "all checks passed", failed)
  raise SystemExit(1 if failed else 0)


if __name__ == "__main__":
  main()
