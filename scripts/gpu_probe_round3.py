"""Development probe (GPU), round 3: (1) the bf16 matmul rate with all-ones vs random
operands, single vs back-to-back GEMMs; (2) a Pallas forward that keeps per-lane sums
(one cross-lane reduction per block instead of three), with and without prefetching the
next block; (3) which training-step formulations let the gradient reuse the logits'
buffer in XLA's GPU memory plan (compile only). Prints JSON lines.

    python scripts/gpu_probe_round3.py
"""

import os
import sys
from functools import partial

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

import jaxce
from _timing import bench, emit

rng = np.random.default_rng(0)
V = 151936


def rates():
  n = 8192
  for name, a in [("ones", jnp.ones((n, n), jnp.bfloat16)),
                  ("normal", jax.device_put(rng.standard_normal((n, n), np.float32).astype(jnp.bfloat16)))]:
    t = bench(jax.jit(jnp.matmul), a, a, repeats=20)
    emit(part="rate", data=name, gemms=1, tflops=2 * n**3 / t / 1e9)
    for k in (16, 64):
      chain = jax.jit(lambda a, b: lax.fori_loop(0, k, lambda i, x: (x @ b) * (1 / 90.5), a))
      t = bench(chain, a, a, repeats=10)
      emit(part="rate", data=name, gemms=k, tflops=k * 2 * n**3 / t / 1e9)


def _lane_kernel(x_ref, m_ref, s_ref, q_ref, *, block, prefetch):
  n_cols = x_ref.shape[0]
  lanes = lax.iota(jnp.int32, block)
  floor = jnp.finfo(jnp.float32).min
  n = pl.cdiv(n_cols, block)

  def load(i):
    return plgpu.load(x_ref.at[pl.ds(jnp.minimum(i * block, n_cols - block), block)])

  def step(i, carry):
    m, s, q, x = carry
    x_next = load(jnp.minimum(i + 1, n - 1)) if prefetch else None
    x = x if prefetch else load(i)
    start = jnp.minimum(i * block, n_cols - block)
    z = jnp.where(start + lanes >= i * block, x.astype(jnp.float32), -jnp.inf)
    m_new = jnp.maximum(m, jnp.maximum(jnp.max(z), floor))
    scale = jnp.exp(m - m_new)
    shifted = z - m_new
    e = jnp.exp(shifted)
    q = scale * (q + (m - m_new) * s) + jnp.where(e > 0, e * shifted, 0.0)
    s = s * scale + e
    return m_new, s, q, x_next

  zero = jnp.zeros((block,), jnp.float32)
  m, s, q, _ = lax.fori_loop(0, n, step, (floor, zero, zero, load(0) if prefetch else None))
  m_ref[...] = m
  s_ref[...] = jnp.sum(s)
  q_ref[...] = jnp.sum(q)


def lane_stats(x, block, warps, prefetch):
  scalar = jax.ShapeDtypeStruct((), jnp.float32)
  call = pl.pallas_call(partial(_lane_kernel, block=block, prefetch=prefetch),
                        out_shape=(scalar,) * 3, grid=(),
                        compiler_params=plgpu.CompilerParams(num_warps=warps, num_stages=1),
                        interpret=jax.default_backend() != "gpu")
  return jax.vmap(call)(x)


def pallas():
  T = 32768
  x = jax.device_put((rng.standard_normal((T, V), np.float32) * 2).astype(jnp.bfloat16))
  labels = jax.device_put(rng.integers(0, V, T).astype(np.int32))
  emit(part="pallas", variant="jaxce_main", ms=bench(jax.jit(
      lambda x: jaxce.logprobs_and_entropy(x, labels, implementation="pallas")), x))
  xs = x[:256].astype(jnp.float32)
  rm = jnp.max(xs, 1)
  e = jnp.exp(xs - rm[:, None])
  rs, rq = e.sum(1), (e * (xs - rm[:, None])).sum(1)
  for block, warps, prefetch in [(4096, 8, False), (4096, 8, True), (2048, 8, True),
                                 (2048, 4, True), (8192, 8, True), (8192, 16, True),
                                 (4096, 16, True), (1024, 4, True)]:
    try:
      f = jax.jit(partial(lane_stats, block=block, warps=warps, prefetch=prefetch))
      m, s, q = f(x[:256])
      err = float(jnp.max(jnp.abs(m - rm) + jnp.abs(s / rs - 1) + jnp.abs(q / rq - 1)))
      emit(part="pallas", variant="lane_sums", block=block, warps=warps, prefetch=prefetch,
           ms=bench(f, x), err=err)
    except Exception as ex:  # noqa: BLE001
      emit(part="pallas", block=block, warps=warps, prefetch=prefetch, error=str(ex)[:300])


@jax.custom_vjp
def _toy_logp(x):
  """A stand-in with jaxce's structure: row statistics forward, one elementwise backward."""
  return jnp.max(x.astype(jnp.float32), axis=1)


def _toy_fwd(x):
  return _toy_logp(x), x


def _toy_bwd(x, g):
  return ((jnp.exp(x.astype(jnp.float32) - 3.0) * g[:, None]).astype(x.dtype),)


_toy_logp.defvjp(_toy_fwd, _toy_bwd)


@jax.custom_vjp
def _toy_logp_loop(x):
  return jnp.max(x.astype(jnp.float32), axis=1)


def _toy_bwd_loop(x, g):
  chunk = x.shape[0] // 4

  def step(i, buf):
    rows = lax.dynamic_slice_in_dim(buf, i * chunk, chunk, 0)
    gr = lax.dynamic_slice_in_dim(g, i * chunk, chunk, 0)
    d = (jnp.exp(rows.astype(jnp.float32) - 3.0) * gr[:, None]).astype(x.dtype)
    return lax.dynamic_update_slice_in_dim(buf, d, i * chunk, 0)

  return (lax.fori_loop(0, 4, step, x),)


_toy_logp_loop.defvjp(lambda x: (_toy_logp_loop(x), x), _toy_bwd_loop)


def sharing():
  T, D = 4096, 4096
  h = jnp.zeros((T, D), jnp.bfloat16)
  w = jnp.zeros((D, V), jnp.bfloat16)
  labels = jnp.zeros((T,), jnp.int32)
  logits_gib = T * V * 2 / 2**30
  cases = {
      "jaxce_pallas": lambda h, w: jaxce.logprobs_and_entropy(h @ w, labels, implementation="pallas")[0],
      "jaxce_xla": lambda h, w: jaxce.logprobs_and_entropy(h @ w, labels, implementation="xla")[0],
      "toy_from_gemm": lambda h, w: _toy_logp(h @ w),
      "toy_from_fusion": lambda h, w: _toy_logp(jnp.tanh(h @ w)),
      "toy_loop_from_gemm": lambda h, w: _toy_logp_loop(h @ w),
      "jaxce_from_fusion": lambda h, w: jaxce.logprobs_and_entropy(jnp.tanh(h @ w), labels)[0],
  }
  for name, f in cases.items():
    g = jax.jit(jax.grad(lambda h, w: jnp.sum(f(h, w)), (0, 1)))
    try:
      c = g.lower(h, w).compile()
      emit(part="sharing", case=name,
           temp_over_logits=c.memory_analysis().temp_size_in_bytes / 2**30 / logits_gib)
    except Exception as ex:  # noqa: BLE001
      emit(part="sharing", case=name, error=str(ex)[:300])


if __name__ == "__main__":
  emit(part="device", device=jax.devices()[0].device_kind, jax=jax.__version__)
  sharing()
  rates()
  pallas()
