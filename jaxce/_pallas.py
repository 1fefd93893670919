"""One-pass forward statistics for the logits path as a Pallas (Triton) kernel on GPUs.

XLA computes the row statistics in two passes over the logits (the max, then the sums
of exp); this kernel reads each row once. One program per token walks the row in blocks
of ``block`` columns with an online softmax: running ``m`` (max), ``s = sum exp(z - m)``
and ``q = sum exp(z - m) (z - m)``, rescaled when the max grows. The label's logit is
gathered outside (T elements) and shards combine ``(m, s, q)`` outside, exactly as the
fused linear path does, so the maths stays in ``_math``.

On other platforms the same kernel runs in Pallas interpret mode (for tests only).
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

# Columns loaded per step: 16 bf16 per thread with 8 warps. Measured on an H200 (T = 32768,
# V = 151936): 2048 -> 5.9 ms, 4096 -> 5.5 ms, 8192 -> 5.9 ms forward.
MAX_BLOCK = 4096


def _row_kernel(x_ref, inv_temp_ref, limit_ref, m_ref, s_ref, q_ref, *, block, with_entropy):
  """Statistics of one row ``x_ref [V_local]``; columns ``>= limit`` are excluded.

  One running state per row, updated once per block of columns (block max, then one
  exp per element). A variant with one state per lane (no cross-lane reductions in the
  loop) measured slower on an H200: 6.3 vs 5.5 ms at T = 32768 (bench/NOTES.md).
  """
  num_columns = x_ref.shape[0]
  inv_temp = inv_temp_ref[...]
  limit = limit_ref[...]
  lanes = lax.iota(jnp.int32, block)
  floor = jnp.finfo(jnp.float32).min

  def step(i, carry):
    m, s, q = carry
    # The last block is clamped back inside the row; columns an earlier block read are
    # masked, so nothing is read out of bounds and nothing counts twice.
    start = jnp.minimum(i * block, num_columns - block)
    columns = start + lanes
    keep = (columns >= i * block) & (columns < limit)
    x = plgpu.load(x_ref.at[pl.ds(start, block)])
    z = jnp.where(keep, x.astype(jnp.float32) * inv_temp, -jnp.inf)
    m_new = jnp.maximum(m, jnp.maximum(jnp.max(z), floor))
    shifted = z - m_new
    e = jnp.exp(shifted)
    scale = jnp.exp(m - m_new)
    s_new = s * scale + jnp.sum(e)
    if with_entropy:
      q = scale * (q + (m - m_new) * s) + jnp.sum(jnp.where(e > 0, e * shifted, 0.0))
    return m_new, s_new, q

  zero = jnp.float32(0)
  m, s, q = lax.fori_loop(0, pl.cdiv(num_columns, block), step, (floor, zero, zero))
  m_ref[...] = m
  s_ref[...] = s
  q_ref[...] = q


def _scalar_like(x):
  """A float32 scalar output that varies over the same shard_map axes as ``x``
  (``check_vma`` needs it spelled out: ``manual_axis_type`` in JAX >= 0.10, ``vma`` before)."""
  aval = jax.typeof(x)
  mat = getattr(aval, "mat", None)
  if mat is not None and mat.varying:
    return jax.ShapeDtypeStruct((), jnp.float32, manual_axis_type=mat)
  if getattr(aval, "vma", None):
    return jax.ShapeDtypeStruct((), jnp.float32, vma=aval.vma)
  return jax.ShapeDtypeStruct((), jnp.float32)


def row_statistics(x, inv_temp, limit, with_entropy):
  """Per-row ``(m, s, q)`` of ``z = x * inv_temp`` over the columns ``< limit``.

  Args:
    x: ``[T, V_local]`` logits, any float dtype; read once.
    inv_temp: ``[T]`` float32.
    limit: int32 scalar: columns at or beyond it are excluded (the padded vocabulary).
    with_entropy: compute ``q`` (else it is returned as zeros).

  Returns:
    ``(m, s, q)``, ``[T]`` float32 each. ``m`` starts at ``finfo.min``, so a row with
    no included column gives ``s = 0``. Memory: the three outputs only.
  """
  num_columns = x.shape[1]
  block = min(MAX_BLOCK, 1 << (num_columns.bit_length() - 1))
  scalar = _scalar_like(x)
  call = pl.pallas_call(
      partial(_row_kernel, block=block, with_entropy=with_entropy),
      out_shape=(scalar, scalar, scalar),
      grid=(),
      compiler_params=plgpu.CompilerParams(num_warps=8 if block >= 2048 else 4, num_stages=3),
      interpret=jax.default_backend() != "gpu",
      name="jaxce_row_statistics",
  )
  return jax.vmap(call, in_axes=(0, 0, None))(x, inv_temp.astype(jnp.float32),
                                              jnp.asarray(limit, jnp.int32))
