"""One-pass forward statistics of logits rows as a Pallas (Triton) kernel on GPUs.

XLA computes the row statistics in two passes over the logits (the max, then the sums
of exp); this kernel reads each row once. One program per token walks the row in blocks
of ``block`` columns with an online softmax: running ``m`` (max), ``s = sum exp(z - m)``
and ``q = sum exp(z - m) (z - m)``, rescaled when the max grows. The label's logit is
gathered outside (T elements) and shards (or, on the fused path, vocab blocks) combine
``(m, s, q)`` outside with ``softmax``'s functions, so the maths stays there.

On other platforms the same kernel runs in Pallas interpret mode (for tests only).
"""

from __future__ import annotations

import dataclasses
from functools import partial

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from jaxce._kernels import plumbing, softmax

plgpu = plumbing.lazy_module("jax.experimental.pallas.triton")

# The operations whose outputs this kernel makes batch-invariant: those that read whole
# rows (their statistics merged by ``triton_merge``). The fused path merges its vocab
# blocks' statistics in XLA and its objective path's logits come from XLA's matmuls.
INVARIANT_OPERATIONS = ("logprobs_and_entropy", "token_loss")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Config:
  """The Triton rows kernel's tiling (``CONFIG``; bench/NOTES.md, entries 3, 9 and 13).

  Attributes:
    max_block: columns loaded per step, at most.
    num_warps: warps per program.
  """
  max_block: int = 2048
  num_warps: int = 4


CONFIG = Config()


def _row_kernel(x_ref, inv_temp_ref, start_ref, limit_ref, m_ref, s_ref, q_ref, *, block,
                with_entropy):
  """Statistics of one row ``x_ref [V_local]`` over the columns in ``[start, limit)``.

  ``exp(d)`` is computed as ``exp2(d * log2(e))`` on the shifted logit ``d = z - m``
  (``exp2`` is one hardware instruction, ``exp`` a longer libdevice routine); scaling
  ``d`` rather than the logits keeps the rounding relative to ``|z - m|``, not ``|z|``.

  The running max ``m`` is one number per row (one cross-lane max per block); the sums
  ``s`` and ``q`` are kept per lane, rescaled by the same ``exp(m_old - m_new)``, and
  reduced across lanes once at the end. Aligned blocks that lie wholly inside
  ``[start, limit)`` are read without a mask, the next one loaded before the current
  one is processed; the at most two partial blocks at the ends are masked. (A variant
  with a max per lane needs a second exp per element and measured slower: bench/NOTES.md,
  entry 3.)
  """
  num_columns = x_ref.shape[0]
  inv_temp = inv_temp_ref[...]
  start = start_ref[...]
  limit = limit_ref[...]
  lanes = lax.iota(jnp.int32, block)
  floor = jnp.finfo(jnp.float32).min

  def load(offset):
    return plgpu.load(x_ref.at[pl.ds(offset, block)]).astype(jnp.float32) * inv_temp

  def add(carry, z):
    """Fold one block ``z [block]`` (scaled logits, -inf where excluded) into carry."""
    m, s, q = carry
    m_new = jnp.maximum(m, jnp.max(z))  # m starts at floor: never -inf
    rescale = jnp.exp2((m - m_new) * softmax.LOG2_E)
    shifted = z - m_new
    e = jnp.exp2(shifted * softmax.LOG2_E)
    if with_entropy:
      q = rescale * (q + (m - m_new) * s) + jnp.where(e > 0, e * shifted, 0.0)
    return m_new, s * rescale + e, q

  def add_masked(carry, first, end):
    """Fold columns ``[first, end)``, which lie inside one aligned block. A block past
    the last full window is clamped back inside the row: nothing is read out of
    bounds, and the mask keeps the columns outside ``[first, end)`` out."""
    offset = jnp.minimum(first - first % block, num_columns - block)
    columns = offset + lanes
    return add(carry, jnp.where((columns >= first) & (columns < end), load(offset), -jnp.inf))

  # Whole blocks [lo, hi); a partial head [start, lo * block) and tail [hi * block, limit).
  lo = (start + block - 1) // block
  hi = jnp.maximum(limit // block, lo)
  last_whole = limit // block - 1  # an aligned block that ends inside the row, or -1

  def interior(i, state):
    # Offsets are multiples of ``block`` (aligned, vectorized loads) inside the row;
    # the last step reloads its own block instead of reading past ``hi``.
    carry, y = state
    return add(carry, y), load(jnp.minimum(i + 1, hi - 1) * block)

  zero = jnp.zeros((block,), jnp.float32)
  carry = (floor, zero, zero)
  carry = lax.fori_loop(0, (start % block != 0).astype(jnp.int32),
                        lambda _, c: add_masked(c, start, jnp.minimum(lo * block, limit)),
                        carry)
  first = load(jnp.maximum(jnp.minimum(lo, last_whole), 0) * block)
  carry, _ = lax.fori_loop(lo, hi, interior, (carry, first))
  carry = lax.fori_loop(0, (hi * block < limit).astype(jnp.int32),
                        lambda _, c: add_masked(c, hi * block, limit), carry)
  m, s, q = carry
  m_ref[...] = m
  s_ref[...] = jnp.sum(s)
  q_ref[...] = jnp.sum(q)


def row_statistics(x, inv_temp, limit, with_entropy, start=0, *, interpret):
  """Per-row ``(m, s, q)`` of ``z = x * inv_temp`` over the columns in ``[start, limit)``.

  Args:
    x: ``[T, V_local]`` logits, any float dtype; read once.
    inv_temp: ``[T]`` float32.
    limit: int32 scalar: columns at or beyond it are excluded (the padded vocabulary).
    with_entropy: compute ``q`` (else it is returned as zeros).
    start: int32 scalar: columns below it are excluded (on the fused path, the columns of
      a clamped last vocab block that an earlier block already covered).
    interpret: run in Pallas' interpreter (off GPUs: tests).

  Returns:
    ``(m, s, q)``, ``[T]`` float32 each. ``m`` starts at ``finfo.min``, so a row with
    no included column gives ``s = 0``. Memory: the three outputs only.
  """
  num_columns = x.shape[1]
  block = min(CONFIG.max_block, 1 << (num_columns.bit_length() - 1))
  scalar = plumbing.shape_dtype_like(x, (), jnp.float32)
  call = pl.pallas_call(
      partial(_row_kernel, block=block, with_entropy=with_entropy),
      out_shape=(scalar, scalar, scalar),
      grid=(),
      compiler_params=plgpu.CompilerParams(num_warps=CONFIG.num_warps if block >= 1024 else 2,
                                           num_stages=1),
      interpret=interpret,
      name="jaxce_row_statistics",
  )
  return jax.vmap(call, in_axes=(0, 0, None, None))(
      x, inv_temp.astype(jnp.float32), jnp.asarray(start, jnp.int32),
      jnp.asarray(limit, jnp.int32))


def unsupported(*, operation, dtypes, has_keep=False, batch_invariant=False) -> str | None:
  """Why the kernel cannot run a call of ``operation`` (a public function's name) over
  arrays of ``dtypes`` (with a kept set when ``has_keep``; batch-invariant when
  ``batch_invariant``), a sentence, or None. It runs on GPUs and, interpreted, anywhere
  (tests)."""
  if plgpu is None:
    return f"this JAX ({jax.__version__}) has no Pallas Triton backend"
  if batch_invariant and operation not in INVARIANT_OPERATIONS:
    return ("batch_invariant=True: this path merges the kernel's statistics in XLA, whose "
            "rounding depends on the program; XLA's exact sums hold the option")
  if any(jnp.dtype(d) == jnp.float64 for d in dtypes):
    return "it computes in float32 and the inputs are float64"
  if has_keep:
    return "it does not take a kept set (keep=) yet"
  return None
