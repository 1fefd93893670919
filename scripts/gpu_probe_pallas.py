"""Development probe: the Pallas one-pass forward vs XLA on the logits path (GPU)."""

import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

import jaxce
from jaxce import _pallas, reference


def bench(f, *args, repeats=15):
  out = f(*args)
  jax.block_until_ready(out)
  del out
  times = []
  for _ in range(repeats):
    t = time.perf_counter()
    out = f(*args)
    jax.block_until_ready(out)
    times.append(time.perf_counter() - t)
    del out
  return float(np.median(times) * 1e3)


def emit(**row):
  print(json.dumps(row), flush=True)


rng = np.random.default_rng(0)
# Correctness on the GPU against the float32 reference (small, awkward sizes).
for T, V, vs in [(37, 1009, 1000), (5, 151936, 151665), (64, 4099, 4099)]:
  x = (rng.standard_normal((T, V)) * 3).astype(np.float32)
  x[:, 3] += 25
  x[0] -= 300
  lab = rng.integers(0, vs, T)
  lab[1] = -100
  a, b = rng.standard_normal(T), rng.standard_normal(T)
  for impl in ["xla", "pallas"]:
    f = lambda x: jaxce.logprobs_and_entropy(x, lab, vocab_size=vs, temperature=0.7, implementation=impl)
    lp, en = f(x)
    lr, er = reference.logprobs_and_entropy(jnp.asarray(x, jnp.float64) if False else x, lab, vocab_size=vs, temperature=0.7)
    emit(check=impl, T=T, V=V, logp_err=float(jnp.abs(lp - lr).max()), ent_err=float(jnp.abs(en - er).max()))
  for blk in [None]:
    try:
      mesh = Mesh(np.array(jax.devices()[:1]), ("vocab",))
      lp, en = jax.jit(lambda x: jaxce.sharded_logprobs_and_entropy(
          x, lab, mesh=mesh, vocab_axis="vocab", vocab_size=vs, temperature=0.7, implementation="pallas"))(x)
      emit(check="pallas_in_shard_map", T=T, logp_err=float(jnp.abs(lp - lr).max()))
    except Exception as e:  # noqa: BLE001
      emit(check="pallas_in_shard_map", error=str(e)[:200])

V, T = 151936, 32768
x = jax.device_put((rng.standard_normal((T, V), np.float32) * 2).astype(jnp.bfloat16))
labels = jax.device_put(rng.integers(0, V, T).astype(np.int32))
adv = jax.device_put(rng.standard_normal(T).astype(np.float32))
emit(what="row_max", ms=bench(jax.jit(lambda x: jnp.max(x, axis=-1)), x))
for block in [2048, 4096, 8192]:
  _pallas.MAX_BLOCK = block
  for impl in ["pallas", "xla"] if block == 4096 else ["pallas"]:
    fwd = jax.jit(lambda x: jaxce.logprobs_and_entropy(x, labels, implementation=impl))
    fwd_lp = jax.jit(lambda x: jaxce.logprobs_and_entropy(x, labels, implementation=impl, return_entropy=False))
    def loss(x):
      lp, en = jaxce.logprobs_and_entropy(x, labels, implementation=impl)
      return jnp.sum(adv * lp) + 0.01 * jnp.sum(en)
    g = jax.jit(jax.grad(loss))
    emit(impl=impl, block=block, fwd_ms=bench(fwd, x), fwd_logp_only_ms=bench(fwd_lp, x),
         fwd_bwd_ms=bench(g, x))
