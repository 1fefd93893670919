"""Per-token outputs from per-tile softmax statistics, merged in one fixed order, as a
Pallas (Triton) kernel on GPUs.

It keeps the merge contract (``merge``: the maths, the order, the outputs).

One program per ``ROWS`` tokens (one lane each) and, with many tiles, per group of
``GROUP`` consecutive tiles, whose partial sums a second call merges in the groups' order
(still one order, fixed by the number of tiles); each step loads ``UNROLL`` tiles before
folding them, so the loads overlap. Off GPUs it runs in Pallas' interpreter (tests).
"""

from __future__ import annotations

from functools import partial

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from jaxce._kernels import merge as merge_contract
from jaxce._kernels import plumbing, softmax

plgpu = plumbing.lazy_module("jax.experimental.pallas.triton")

ROWS = 128  # tokens per program
GROUP = 64  # tiles per program of the first of two stages (more tiles than this)
UNROLL = 8  # tiles loaded per loop step
NUM_WARPS = 4


def _merge_kernel(tiles_ref, *out_refs, num_tiles, group, with_entropy, finish):
  """Program ``(i, j)``: tiles ``[j * group, (j + 1) * group)`` (those below ``num_tiles``)
  of ``tiles_ref [num_tiles, 4, ROWS]`` merged in order, into ``(m, s, q, picked)``
  ``[ROWS]`` each (relative to the group's max; ``q`` 0 without ``with_entropy``), or,
  with ``finish``, into ``(logp before masking, m, log s, entropy)``."""
  first = pl.program_id(1) * group
  ragged = num_tiles % group != 0

  def load(k, j):
    """Statistic ``j`` of the group's tile ``k`` (a neutral tile past the last)."""
    g = first + k
    value = tiles_ref[jnp.minimum(g, num_tiles - 1) if ragged else g, j, :]
    if not ragged:
      return value
    return jnp.where(g < num_tiles, value, softmax.FLOOR if j == 0 else 0.0)

  steps, rest = divmod(group, UNROLL)

  def max_of(base, count, m):
    for m_g in [load(base + k, 0) for k in range(count)]:
      m = jnp.maximum(m, m_g)
    return m

  m = jnp.full((ROWS,), softmax.FLOOR, jnp.float32)
  m = lax.fori_loop(0, steps, lambda i, m: max_of(i * UNROLL, UNROLL, m), m)
  m = max_of(steps * UNROLL, rest, m)

  stats = (1, 2, 3) if with_entropy else (1, 3)

  def sums_of(base, count, carry):
    loaded = [(load(base + k, 0),) + tuple(load(base + k, j) for j in stats)
              for k in range(count)]
    for tile in loaded:  # in the tiles' order
      s, q, picked = carry
      m_g, s_g, *rest_g = tile
      q_g, picked_g = rest_g if with_entropy else (None, rest_g[0])
      scale = jnp.exp(m_g - m)
      if with_entropy:
        q = q + scale * (q_g + (m_g - m) * s_g)
      carry = s + scale * s_g, q, picked + picked_g
    return carry

  zero = jnp.zeros((ROWS,), jnp.float32)
  carry = lax.fori_loop(0, steps, lambda i, c: sums_of(i * UNROLL, UNROLL, c),
                        (zero, zero, zero))
  s, q, picked = sums_of(steps * UNROLL, rest, carry)
  if not finish:
    for ref, value in zip(out_refs, (m, s, q, picked)):
      ref[...] = value
    return
  logp_ref, m_ref, log_s_ref, entropy_ref = out_refs
  log_s = jnp.log(s)
  logp_ref[...] = (picked - m) - log_s
  m_ref[...] = m
  log_s_ref[...] = log_s
  entropy_ref[...] = log_s - q / s if with_entropy else zero


def _stage(tiles, *, group, with_entropy, finish, interpret):
  """One ``pallas_call`` over ``tiles [G, 4, C]`` (``C`` a multiple of ``ROWS``): four
  ``[ceil(G / group), C]`` arrays (``finish``: ``group >= G``, four ``[C]`` arrays)."""
  num_tiles, _, num_rows = tiles.shape
  num_groups = -(-num_tiles // group)
  if finish:
    out = plumbing.shape_dtype_like(tiles, (num_rows,), jnp.float32)
    out_spec = pl.BlockSpec((ROWS,), lambda i, j: (i,))
  else:
    out = plumbing.shape_dtype_like(tiles, (num_groups, num_rows), jnp.float32)
    out_spec = pl.BlockSpec((None, ROWS), lambda i, j: (j, i))
  return pl.pallas_call(
      partial(_merge_kernel, num_tiles=num_tiles, group=group, with_entropy=with_entropy,
              finish=finish),
      out_shape=(out,) * 4,
      grid=(num_rows // ROWS, num_groups),
      in_specs=[pl.BlockSpec((num_tiles, 4, ROWS), lambda i, j: (0, 0, i))],
      out_specs=(out_spec,) * 4,
      compiler_params=plgpu.CompilerParams(num_warps=NUM_WARPS, num_stages=1),
      interpret=interpret,
      name="jaxce_merge_tiles",
  )(tiles)


def merge(tiles, *, with_entropy, interpret):
  """A token's log-prob and entropy from its tiles' statistics ``[G, 4, C]``, in the
  tiles' order, as the contract says (``merge``); ``interpret``: run in Pallas'
  interpreter (off GPUs: tests). With more than ``GROUP`` tiles, two stages: groups of
    ``GROUP`` consecutive tiles in parallel, then the groups in order (an order fixed by
    ``G`` alone). Memory: the outputs, ``[G / GROUP, 4, C]`` partial sums (and, when ``C``
    is not a multiple of ``ROWS``, one padded copy of ``tiles``).
  """
  num_tiles, _, num_rows = tiles.shape
  tiles = merge_contract.padded_tiles(tiles, ROWS)
  if num_tiles > GROUP:
    tiles = jnp.stack(_stage(tiles, group=GROUP, with_entropy=with_entropy, finish=False,
                             interpret=interpret), axis=1)
  logp, m, log_s, entropy = (a[:num_rows] for a in _stage(
      tiles, group=tiles.shape[0], with_entropy=with_entropy, finish=True,
      interpret=interpret))
  return logp, m, log_s, (entropy if with_entropy else None)
