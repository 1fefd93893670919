"""One-pass forward statistics of logits rows as a Pallas (Triton) kernel on GPUs.

XLA computes the row statistics in two passes over the logits (the max, then the sums
of exp); this kernel reads each row once. One program per token walks the row in blocks
of ``block`` columns with an online softmax: running ``m`` (max), ``s = sum exp(z - m)``
and ``q = sum exp(z - m) (z - m)``, rescaled when the max grows. The label's logit is
gathered outside (T elements) and shards (or, on the fused path, vocab blocks) combine
``(m, s, q)`` outside with ``_math``'s functions, so the maths stays there.

On other platforms the same kernel runs in Pallas interpret mode (for tests only).
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jaxce import _math

# Columns loaded per step and warps per program. Measured on an H200 (T = 32768,
# V = 151936, bf16, forward statistics alone; scripts/gpu_probe_round{3,4}.py): 2048
# columns with 4 warps 4.61 ms; 4096 with 8 warps 4.95 ms; 8192 with 16 warps 6.04 ms;
# the earlier kernel (three cross-lane reductions per block) 5.54 ms.
MAX_BLOCK = 2048
NUM_WARPS = 4


def _row_kernel(x_ref, inv_temp_ref, start_ref, limit_ref, m_ref, s_ref, q_ref, *, block,
                with_entropy):
  """Statistics of one row ``x_ref [V_local]`` over the columns in ``[start, limit)``.

  The running max ``m`` is one number per row (one cross-lane max per block); the sums
  ``s`` and ``q`` are kept per lane, rescaled by the same ``exp(m_old - m_new)``, and
  reduced across lanes once at the end. The next block is loaded before the current one
  is processed, so a load is always in flight. (A variant with a max per lane needs a
  second exp per element and measured slower: 6.3 vs 5.5 ms, bench/NOTES.md.)
  """
  num_columns = x_ref.shape[0]
  inv_temp = inv_temp_ref[...]
  start = start_ref[...]
  limit = limit_ref[...]
  lanes = lax.iota(jnp.int32, block)
  floor = jnp.finfo(jnp.float32).min
  num_blocks = pl.cdiv(num_columns, block)

  def load(i):
    # The last block is clamped back inside the row; columns an earlier block read are
    # masked in ``step``, so nothing is read out of bounds and nothing counts twice.
    return plgpu.load(x_ref.at[pl.ds(jnp.minimum(i * block, num_columns - block), block)])

  def step(i, carry):
    m, s, q, x = carry
    x_next = load(jnp.minimum(i + 1, num_blocks - 1))
    columns = jnp.minimum(i * block, num_columns - block) + lanes
    keep = (columns >= jnp.maximum(i * block, start)) & (columns < limit)
    z = jnp.where(keep, x.astype(jnp.float32) * inv_temp, -jnp.inf)
    m_new = jnp.maximum(m, jnp.maximum(jnp.max(z), floor))
    scale = jnp.exp(m - m_new)
    shifted = z - m_new
    e = jnp.exp(shifted)
    if with_entropy:
      q = scale * (q + (m - m_new) * s) + jnp.where(e > 0, e * shifted, 0.0)
    return m_new, s * scale + e, q, x_next

  zero = jnp.zeros((block,), jnp.float32)
  m, s, q, _ = lax.fori_loop(0, num_blocks, step, (floor, zero, zero, load(0)))
  m_ref[...] = m
  s_ref[...] = jnp.sum(s)
  q_ref[...] = jnp.sum(q)


def resolve_implementation(implementation, x):
  """``"pallas"`` or ``"xla"`` for statistics of rows like ``x``; ``None`` picks the kernel
  on GPUs for bf16/f16/f32 outside ``shard_map`` (inside it the kernel lowers on GPUs,
  checked by scripts/gpu_probe_pallas.py on a one-GPU mesh, but JAX's Pallas interpreter
  cannot run it there, so CI could not test it)."""
  if implementation is None:
    return "pallas" if (jax.default_backend() == "gpu" and x.dtype != jnp.float64
                        and not _math.varying_axes(x)) else "xla"
  if implementation not in ("xla", "pallas"):
    raise ValueError(f'implementation must be None, "xla" or "pallas", got {implementation=!r}')
  return implementation


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


def row_statistics(x, inv_temp, limit, with_entropy, start=0):
  """Per-row ``(m, s, q)`` of ``z = x * inv_temp`` over the columns in ``[start, limit)``.

  Args:
    x: ``[T, V_local]`` logits, any float dtype; read once.
    inv_temp: ``[T]`` float32.
    limit: int32 scalar: columns at or beyond it are excluded (the padded vocabulary).
    with_entropy: compute ``q`` (else it is returned as zeros).
    start: int32 scalar: columns below it are excluded (on the fused path, the columns of
      a clamped last vocab block that an earlier block already covered).

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
      compiler_params=plgpu.CompilerParams(num_warps=NUM_WARPS if block >= 1024 else 2,
                                           num_stages=1),
      interpret=jax.default_backend() != "gpu",
      name="jaxce_row_statistics",
  )
  return jax.vmap(call, in_axes=(0, 0, None, None))(
      x, inv_temp.astype(jnp.float32), jnp.asarray(start, jnp.int32),
      jnp.asarray(limit, jnp.int32))
