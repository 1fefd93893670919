"""Development probe: forward and fwd+bwd time of the logits path by chunk size, and the
achievable single-pass XLA speeds (copy, row max) on the same device. Prints JSON lines.

(The one-pass variadic-reduction variant it once compared lives at commit "math: one-pass
online-softmax statistics", see bench/NOTES.md.)"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import jax
import jax.numpy as jnp
import numpy as np

import jaxce
from _timing import bench, emit


rng = np.random.default_rng(0)
V = 151936
T = 32768
x = jax.device_put((rng.standard_normal((T, V), np.float32) * 2).astype(jnp.bfloat16))
nbytes = x.size * 2
for name, f in [("scale_copy", lambda x: x * 2), ("row_max", lambda x: jnp.max(x, axis=-1)),
                ("row_max_f32", lambda x: jnp.max(x.astype(jnp.float32), axis=-1)),
                ("row_sum_exp", lambda x: jnp.sum(jnp.exp(x.astype(jnp.float32)), axis=-1))]:
  ms = bench(jax.jit(f), x)
  moved = nbytes * (2 if name == "scale_copy" else 1)
  emit(what=name, ms=ms, GBps=moved / ms / 1e6)
labels = jax.device_put(rng.integers(0, V, T).astype(np.int32))
adv = jax.device_put(rng.standard_normal(T).astype(np.float32))
for one_pass in [False]:
  for cs in [1024, 2048, 8192, T]:
    fwd = jax.jit(lambda x: jaxce.logprobs_and_entropy(x, labels, chunk_size=cs))
    def loss(x):
      lp, en = jaxce.logprobs_and_entropy(x, labels, chunk_size=cs)
      return jnp.sum(adv * lp) + 0.01 * jnp.sum(en)
    g = jax.jit(jax.grad(loss))
    emit(chunk=cs, fwd_ms=bench(fwd, x), fwd_bwd_ms=bench(g, x),
         fwd_temp=fwd.lower(x).compile().memory_analysis().temp_size_in_bytes / nbytes,
         fwd_bwd_temp=g.lower(x).compile().memory_analysis().temp_size_in_bytes / nbytes)
a = jax.device_put(rng.standard_normal((8192, 8192), np.float32).astype(jnp.bfloat16))
for _ in range(2):
  ms = bench(jax.jit(lambda a: a @ a), a, repeats=30)
  emit(what="matmul_8192", ms=ms, tflops=2 * 8192**3 / ms / 1e9)
b = jax.device_put(rng.standard_normal((8192, 4096), np.float32).astype(jnp.bfloat16))
w = jax.device_put(rng.standard_normal((4096, 16384), np.float32).astype(jnp.bfloat16))
ms = bench(jax.jit(lambda b, w: jnp.matmul(b, w, preferred_element_type=jnp.float32)), b, w, repeats=30)
emit(what="matmul_tile_8192x4096x16384_f32out", ms=ms, tflops=2 * 8192 * 4096 * 16384 / ms / 1e9)
