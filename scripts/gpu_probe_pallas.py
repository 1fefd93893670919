"""Development probe: the Pallas one-pass forward vs XLA on the logits path (GPU)."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import jax
import jax.numpy as jnp
import numpy as np

import jaxce
from _timing import bench, emit
from jaxce import _pallas, reference


rng = np.random.default_rng(0)
V, T = 151936, 32768
x = jax.device_put((rng.standard_normal((T, V), np.float32) * 2).astype(jnp.bfloat16))
labels = jax.device_put(rng.integers(0, V, T).astype(np.int32))
adv = jax.device_put(rng.standard_normal(T).astype(np.float32))
emit(what="row_max", ms=bench(jax.jit(lambda x: jnp.max(x, axis=-1)), x))
for block in [2048, 4096, 8192]:
  _pallas.MAX_BLOCK = block
  for impl in ["pallas", "xla"] if block == 4096 else ["pallas"]:
    fwd = jax.jit(lambda x: jaxce.logprobs_and_entropy(x, labels, implementation=impl))
    fwd_lp = jax.jit(lambda x: jaxce.logprobs_and_entropy(x, labels, implementation=impl,
                                                          return_entropy=False))
    def loss(x):
      lp, en = jaxce.logprobs_and_entropy(x, labels, implementation=impl)
      return jnp.sum(adv * lp) + 0.01 * jnp.sum(en)
    g = jax.jit(jax.grad(loss))
    lp, en = jaxce.logprobs_and_entropy(x[:64], labels[:64], implementation=impl)
    lr, er = reference.logprobs_and_entropy(x[:64], labels[:64])
    emit(impl=impl, block=block, fwd_ms=bench(fwd, x), fwd_logp_only_ms=bench(fwd_lp, x),
         fwd_bwd_ms=bench(g, x), logp_err=float(jnp.abs(lp - lr).max()),
         ent_err=float(jnp.abs(en - er).max()))
