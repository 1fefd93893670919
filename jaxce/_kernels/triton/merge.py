"""Per-token outputs from per-tile softmax statistics, merged in one fixed order, as a
Pallas (Triton) kernel on GPUs.

It keeps the merge contract (``merge``: the maths, the order, the outputs).

One program per ``CONFIG.rows`` tokens (one lane each) and, with many tiles, per group of
``CONFIG.group`` consecutive tiles, whose partial sums a second call merges in the groups' order
(still one order, fixed by the number of tiles); each step loads ``CONFIG.unroll`` tiles before
folding them, so the loads overlap. Off GPUs it runs in Pallas' interpreter (tests).
"""

from __future__ import annotations

import dataclasses
from functools import partial

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from jaxce._kernels import merge as merge_contract
from jaxce._kernels import plumbing, softmax

plgpu = plumbing.lazy_module("jax.experimental.pallas.triton")



@dataclasses.dataclass(frozen=True, kw_only=True)
class Config:
  """The Triton merge kernel's tiling (``CONFIG``).

  Attributes:
    rows: tokens per program.
    group: tiles per program of the first of two stages (more tiles than this).
    unroll: tiles loaded per loop step.
    num_warps: warps per program.
  """
  rows: int = 128
  group: int = 64
  unroll: int = 8
  num_warps: int = 4


CONFIG = Config()


def _merge_kernel(tiles_ref, *out_refs, num_tiles, group, with_entropy, finish, segments):
  """Program ``(i, j)``: group ``j`` of ``group`` tiles, in order, of ``tiles_ref
  [num_tiles, 4, CONFIG.rows]`` cut into ``segments`` equal runs (a group's tiles all of one
  run, those past its run's end left out) merged into ``(m, s, q, picked)`` ``[CONFIG.rows]``
  each (relative to the group's max; ``q`` 0 without ``with_entropy``), or, with ``finish``,
  into ``(logp before masking, m, log s, entropy)``."""
  run = num_tiles // segments
  per_run = -(-run // group)
  segment = pl.program_id(1) // per_run
  first = (pl.program_id(1) - segment * per_run) * group
  ragged = run % group != 0

  def load(k, j):
    """Statistic ``j`` of the group's tile ``k`` (a neutral tile past its run's last)."""
    g = first + k
    value = tiles_ref[segment * run + (jnp.minimum(g, run - 1) if ragged else g), j, :]
    if not ragged:
      return value
    return jnp.where(g < run, value, softmax.FLOOR if j == 0 else 0.0)

  steps, rest = divmod(group, CONFIG.unroll)

  def max_of(base, count, m):
    for m_g in [load(base + k, 0) for k in range(count)]:
      m = jnp.maximum(m, m_g)
    return m

  m = jnp.full((CONFIG.rows,), softmax.FLOOR, jnp.float32)
  m = lax.fori_loop(0, steps, lambda i, m: max_of(i * CONFIG.unroll, CONFIG.unroll, m), m)
  m = max_of(steps * CONFIG.unroll, rest, m)

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

  zero = jnp.zeros((CONFIG.rows,), jnp.float32)
  carry = lax.fori_loop(0, steps, lambda i, c: sums_of(i * CONFIG.unroll, CONFIG.unroll, c),
                        (zero, zero, zero))
  s, q, picked = sums_of(steps * CONFIG.unroll, rest, carry)
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


def _stage(tiles, *, group, with_entropy, finish, interpret, segments=1):
  """One ``pallas_call`` over ``tiles [G, 4, C]`` (``C`` a multiple of ``CONFIG.rows``) in
  ``segments`` equal runs: four ``[segments * ceil(G / segments / group), C]`` arrays
  (``finish``: ``group >= G``, four ``[C]`` arrays)."""
  num_tiles, _, num_rows = tiles.shape
  num_groups = segments * -(-(num_tiles // segments) // group)
  if finish:
    out = plumbing.shape_dtype_like(tiles, (num_rows,), jnp.float32)
    out_spec = pl.BlockSpec((CONFIG.rows,), lambda i, j: (i,))
  else:
    out = plumbing.shape_dtype_like(tiles, (num_groups, num_rows), jnp.float32)
    out_spec = pl.BlockSpec((None, CONFIG.rows), lambda i, j: (j, i))
  return pl.pallas_call(
      partial(_merge_kernel, num_tiles=num_tiles, group=group, with_entropy=with_entropy,
              finish=finish, segments=segments),
      out_shape=(out,) * 4,
      grid=(num_rows // CONFIG.rows, num_groups),
      in_specs=[pl.BlockSpec((num_tiles, 4, CONFIG.rows), lambda i, j: (0, 0, i))],
      out_specs=(out_spec,) * 4,
      compiler_params=plgpu.CompilerParams(num_warps=CONFIG.num_warps, num_stages=1),
      interpret=interpret,
      name="jaxce_merge_tiles",
  )(tiles)


def merge(tiles, *, with_entropy, interpret):
  """A token's log-prob and entropy from its tiles' statistics ``[G, 4, C]``, in the
  tiles' order, as the contract says (``merge``); ``interpret``: run in Pallas'
  interpreter (off GPUs: tests). With more than ``CONFIG.group`` tiles, two stages: groups of
    ``CONFIG.group`` consecutive tiles in parallel, then the groups in order (an order fixed by
    ``G`` alone). Memory: the outputs, ``[G / CONFIG.group, 4, C]`` partial sums (and, when ``C``
    is not a multiple of ``CONFIG.rows``, one padded copy of ``tiles``).
  """
  num_tiles, _, num_rows = tiles.shape
  tiles = merge_contract.padded_tiles(tiles, CONFIG.rows)
  if num_tiles > CONFIG.group:
    tiles = jnp.stack(_stage(tiles, group=CONFIG.group, with_entropy=with_entropy, finish=False,
                             interpret=interpret), axis=1)
  logp, m, log_s, entropy = (a[:num_rows] for a in _stage(
      tiles, group=tiles.shape[0], with_entropy=with_entropy, finish=True,
      interpret=interpret))
  return logp, m, log_s, (entropy if with_entropy else None)


def partial_sums(tiles, *, segments, with_entropy, interpret):
  """The first stage of ``merge`` within each of ``segments`` equal runs of ``tiles [G, 4,
  C]`` (a vocab shard's segments, ``merge``'s contract): each run's groups of up to
  ``CONFIG.group`` consecutive tiles merged into ``(m, s, q, picked)``, ``[P, 4, C]`` f32 in
  the tiles' order, to be gathered over the shards and merged. Memory: the outputs (and,
  as ``merge``, a padded copy of ``tiles`` when ``C`` is not a multiple of
  ``CONFIG.rows``)."""
  num_rows = tiles.shape[2]
  padded = merge_contract.padded_tiles(tiles, CONFIG.rows)
  group = min(CONFIG.group, tiles.shape[0] // segments)
  sums = jnp.stack(_stage(padded, group=group, with_entropy=with_entropy, finish=False,
                          interpret=interpret, segments=segments), axis=1)
  return sums if sums.shape[2] == num_rows else sums[:, :, :num_rows]
