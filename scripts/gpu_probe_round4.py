"""Development probe (GPU), round 4: at which T the training step's gradient stops
reusing the logits' buffer in XLA's GPU memory plan (compile only), and more lane-sum
Pallas forward configurations. Prints JSON lines.

    python scripts/gpu_probe_round4.py
"""

import os
import sys
from functools import partial

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import jax
import jax.numpy as jnp
import numpy as np

import jaxce
from _timing import bench, emit
from gpu_probe_round3 import _toy_logp, _toy_logp_loop, lane_stats

V, D = 151936, 4096


def _toy_halves(x):
  """The toy backward's formula on two row halves, concatenated."""
  return _toy_logp_halves(x)


@jax.custom_vjp
def _toy_logp_halves(x):
  return jnp.max(x.astype(jnp.float32), axis=1)


def _halves_bwd(x, g):
  half = x.shape[0] // 2
  f = lambda rows, gr: (jnp.exp(rows.astype(jnp.float32) - 3.0) * gr[:, None]).astype(x.dtype)
  return (jnp.concatenate([f(x[:half], g[:half]), f(x[half:], g[half:])]),)


_toy_logp_halves.defvjp(lambda x: (_toy_logp_halves(x), x), _halves_bwd)


def sharing():
  for T in (8192, 14080, 14208, 16384, 32768):
    h = jax.ShapeDtypeStruct((T, D), jnp.bfloat16)
    w = jax.ShapeDtypeStruct((D, V), jnp.bfloat16)
    labels = jnp.zeros((T,), jnp.int32)
    cases = {
        "jaxce_xla": lambda h, w: jaxce.logprobs_and_entropy(h @ w, labels, implementation="xla")[0],
        "toy_from_gemm": lambda h, w: _toy_logp(h @ w),
        "toy_loop_from_gemm": lambda h, w: _toy_logp_loop(h @ w),
        "toy_halves_from_gemm": lambda h, w: _toy_halves(h @ w),
        "toy_from_param": None,
    }
    for name, f in cases.items():
      try:
        if f is None:  # the logits as a (non-donated) argument: the gradient is the output
          x = jax.ShapeDtypeStruct((T, V), jnp.bfloat16)
          c = jax.jit(jax.grad(lambda x: jnp.sum(_toy_logp_loop(x)))).lower(x).compile()
        else:
          c = jax.jit(jax.grad(lambda h, w: jnp.sum(f(h, w)), (0, 1))).lower(h, w).compile()
        emit(part="sharing", T=T, elements_over_2_31=T * V / 2**31, case=name,
             temp_over_logits=c.memory_analysis().temp_size_in_bytes / (T * V * 2))
      except Exception as ex:  # noqa: BLE001
        emit(part="sharing", T=T, case=name, error=str(ex)[:300])


def pallas():
  T = 32768
  rng = np.random.default_rng(0)
  x = jax.device_put((rng.standard_normal((T, V), np.float32) * 2).astype(jnp.bfloat16))
  for block, warps, prefetch in [(2048, 4, True), (2048, 4, False), (2048, 2, True),
                                 (1024, 2, True), (4096, 4, True), (1024, 1, True)]:
    f = jax.jit(partial(lane_stats, block=block, warps=warps, prefetch=prefetch))
    emit(part="pallas", variant="lane_sums", block=block, warps=warps, prefetch=prefetch,
         ms=bench(f, x))
  emit(part="pallas", variant="row_max_xla", ms=bench(jax.jit(lambda x: jnp.max(x, axis=1)), x))
  emit(part="pallas", variant="copy_bf16", ms=bench(jax.jit(lambda x: x * 2), x),
       note="read + write: 2 x T V 2 bytes")


if __name__ == "__main__":
  sharing()
  pallas()
