"""Per-token outputs from per-tile softmax statistics, merged in one fixed order, as a
Pallas (Triton) kernel on GPUs.

The kernels that read logits (or form them, on the fused path) reduce each tile of
columns to per-token statistics ``(m, s, q, picked)``: the tile's max ``m``, ``s = Σ
exp(z - m)``, ``q = Σ exp(z - m)(z - m)`` and the label's ``z`` (0 when the label is not
in the tile). This kernel merges a token's tiles in the order they are given (the
columns' order: tile 0 first; over vocab shards, gathered in rank order) and finishes
its log-prob and entropy, with the same instructions whatever the call around it:

    m = max_g m_g                           (pass 1)
    s = Σ_g s_g e_g,  e_g = exp(m_g - m)    (pass 2, g = 0, 1, ... in order)
    q = Σ_g e_g (q_g + (m_g - m) s_g)
    log s = log(s);  entropy = log s - q / s;  logp = (Σ_g picked_g - m) - log s

So a token's outputs depend on its own tiles alone: not on the number of tokens, their
chunking or the program around the call (XLA decides per program how it fuses and
contracts the same maths; a Pallas kernel is one program wherever it is called).

One program per ``ROWS`` tokens (one lane each); each step loads ``UNROLL`` tiles before
folding them, so the loads overlap. Off GPUs it runs in Pallas' interpreter (tests).
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

ROWS = 128  # tokens per program
UNROLL = 8  # tiles loaded per loop step
NUM_WARPS = 4


def _merge_kernel(tiles_ref, logp_ref, m_ref, log_s_ref, entropy_ref, *, num_tiles,
                  with_entropy):
  """``tiles_ref [G, 4, ROWS]`` -> ``[ROWS]`` each of ``(logp before masking, m, log s,
  entropy)`` (the entropy 0 without ``with_entropy``)."""
  groups, rest = divmod(num_tiles, UNROLL)
  tail = groups * UNROLL
  load = lambda g, k: tiles_ref[g, k, :]

  def max_of(first, count, m):
    for g in [load(first + k, 0) for k in range(count)]:
      m = jnp.maximum(m, g)
    return m

  m = jnp.full((ROWS,), jnp.finfo(jnp.float32).min, jnp.float32)
  m = lax.fori_loop(0, groups, lambda i, m: max_of(i * UNROLL, UNROLL, m), m)
  m = max_of(tail, rest, m)

  stats = (0, 1, 2, 3) if with_entropy else (0, 1, 3)

  def sums_of(first, count, carry):
    loaded = [[load(first + k, j) for j in stats] for k in range(count)]
    for tile in loaded:  # in the tiles' order
      s, q, picked = carry
      if with_entropy:
        m_g, s_g, q_g, picked_g = tile
      else:
        (m_g, s_g, picked_g), q_g = tile, None
      scale = jnp.exp(m_g - m)
      if with_entropy:
        q = q + scale * (q_g + (m_g - m) * s_g)
      carry = s + scale * s_g, q, picked + picked_g
    return carry

  zero = jnp.zeros((ROWS,), jnp.float32)
  carry = lax.fori_loop(0, groups, lambda i, c: sums_of(i * UNROLL, UNROLL, c),
                        (zero, zero, zero))
  s, q, picked = sums_of(tail, rest, carry)
  log_s = jnp.log(s)
  logp_ref[...] = (picked - m) - log_s
  m_ref[...] = m
  log_s_ref[...] = log_s
  entropy_ref[...] = log_s - q / s if with_entropy else zero


def merge(tiles, *, with_entropy, interpret):
  """A token's log-prob and entropy from its tiles' statistics, in the tiles' order.

  Args:
    tiles: ``[G, 4, C]`` float32: ``(m, s, q, picked)`` of each token's ``G`` tiles of
      columns, in the columns' order (``q`` unused without ``with_entropy``).
    with_entropy: compute the entropy (else it is returned as None).
    interpret: run in Pallas' interpreter (off GPUs: tests).

  Returns:
    ``(logp, m, log s, entropy or None)``, ``[C]`` float32 each: the log-prob before
    ignored tokens and labels beyond the vocabulary are masked (``softmax.finish_outputs``),
    and the backward's residuals. Memory: the outputs (and, when ``C`` is not a multiple
    of ``ROWS``, one padded copy of ``tiles``).
  """
  num_tiles, _, num_rows = tiles.shape
  padded = -(-num_rows // ROWS) * ROWS
  if padded != num_rows:
    tiles = jnp.pad(tiles, [(0, 0), (0, 0), (0, padded - num_rows)])
  out = jax.ShapeDtypeStruct((padded,), jnp.float32)
  row_block = pl.BlockSpec((ROWS,), lambda i: (i,))
  call = pl.pallas_call(
      partial(_merge_kernel, num_tiles=num_tiles, with_entropy=with_entropy),
      out_shape=(out,) * 4,
      grid=(padded // ROWS,),
      in_specs=[pl.BlockSpec((num_tiles, 4, ROWS), lambda i: (0, 0, i))],
      out_specs=(row_block,) * 4,
      compiler_params=plgpu.CompilerParams(num_warps=NUM_WARPS, num_stages=1),
      interpret=interpret,
      name="jaxce_merge_tiles",
  )
  logp, m, log_s, entropy = (a[:num_rows] for a in call(tiles.astype(jnp.float32)))
  return logp, m, log_s, (entropy if with_entropy else None)

