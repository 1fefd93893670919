"""Per-token outputs from per-tile softmax statistics, merged in one fixed order, as a
Pallas Mosaic GPU kernel (the fused path's ``mosaic_head`` forward and the logits path's
``mosaic_rows`` hand it their tiles, through ``logits_rows.merge_tiles``).

It keeps the merge contract (``merge``: the maths, the order, the outputs).

One CTA (one warpgroup, a token per thread) per ``CONFIG.rows`` tokens and group of up to
``CONFIG.group`` consecutive tiles, copied into shared memory with one TMA copy. With more tiles
than ``CONFIG.group``, a stage merges each group into its ``(m, s, q, picked)`` and the next
stage merges the groups in their order (still one order, fixed by the number of tiles).
The last group's copy is moved back to end at the last tile (no copy leaves the array);
the tiles it shares with the group before are skipped. Likewise, when ``C`` is not a
multiple of ``CONFIG.rows`` (but of 8, at least ``CONFIG.rows``), the last CTA's tokens
are moved back to end at the last token: the tokens it shares with the CTA before get the
same numbers from both, written twice. Off GPUs it runs in JAX's GPU interpreter (tests).
"""

from __future__ import annotations

import dataclasses
from functools import partial

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from jaxce._kernels import merge as merge_contract
from jaxce._kernels import plumbing, softmax

plgpu = plumbing.lazy_module("jax.experimental.pallas.mosaic_gpu")

ROW_TILE = 8  # a moved-back CTA starts at a multiple of 8 tokens (32-byte aligned copies)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Config:
  """The merge kernel's tiling: it reads ``CONFIG`` (tests swap in another with
  ``dataclasses.replace``).

  Attributes:
    rows: tokens per CTA: one per thread of a warpgroup.
    group: tiles per CTA: 4 x 64 x 128 f32, 128 KiB of shared memory.
  """
  rows: int = 128
  group: int = 64


CONFIG = Config()


def _stage(tiles, *, group, with_entropy, finish, interpret, segments=1):
  """One kernel over ``tiles [G, 4, C]`` (``C >= CONFIG.rows`` a multiple of ``ROW_TILE``),
  ``segments`` equal runs of ``G / segments`` tiles (``group`` at most one run's tiles):
  each run's groups' ``(m, s, q, picked)``, ``[segments * ceil(G / segments / group), 4,
  C]`` in order, or with ``finish`` (``group == G``) ``(logp before masking, m, log s,
  entropy)``, ``[4, C]``."""
  num_tiles, _, num_rows = tiles.shape
  run = num_tiles // segments  # (a segment's tiles)
  per_run = -(-run // group)
  out_shape = (4, num_rows) if finish else (segments * per_run, 4, num_rows)

  def kernel(tiles_gmem, out_gmem):
    group_index = lax.axis_index("groups")
    # (the last CTA's tokens moved back to end at the last token)
    first_row = jnp.minimum(lax.axis_index("rows") * CONFIG.rows, num_rows - CONFIG.rows)
    row_slice = pl.ds(pl.multiple_of(first_row, ROW_TILE), CONFIG.rows)
    segment = group_index // per_run
    first = (group_index - segment * per_run) * group
    start = jnp.minimum(first, run - group)  # a run's last group's copy, moved back

    @partial(pl.run_scoped, tiles_smem=plgpu.SMEM((group, 4, CONFIG.rows), jnp.float32),
             out_smem=plgpu.SMEM((4, CONFIG.rows), jnp.float32), barrier=plgpu.Barrier())
    def _scope(tiles_smem, out_smem, barrier):
      plgpu.copy_gmem_to_smem(
          tiles_gmem.at[pl.ds(segment * run + start, group), :, row_slice], tiles_smem,
          barrier)
      plgpu.barrier_wait(barrier)
      skip = first - start  # tiles of the group before (the last group only)
      m = lax.fori_loop(skip, group, lambda k, m: jnp.maximum(m, tiles_smem[k, 0]),
                        jnp.full((CONFIG.rows,), softmax.FLOOR, jnp.float32))

      def fold(k, carry):  # tile k into the sums, in the tiles' order
        s, q, picked = carry
        m_k, s_k = tiles_smem[k, 0], tiles_smem[k, 1]
        scale = jnp.exp(m_k - m)
        if with_entropy:
          q = q + scale * (tiles_smem[k, 2] + (m_k - m) * s_k)
        return s + scale * s_k, q, picked + tiles_smem[k, 3]

      zero = jnp.zeros((CONFIG.rows,), jnp.float32)
      s, q, picked = lax.fori_loop(skip, group, fold, (zero, zero, zero))
      if finish:
        log_s = jnp.log(s)
        values = ((picked - m) - log_s, m, log_s, log_s - q / s if with_entropy else zero)
        out_rows = out_gmem.at[:, row_slice]
      else:
        values = (m, s, q, picked)
        out_rows = out_gmem.at[group_index, :, row_slice]
      for i, value in enumerate(values):
        out_smem[i] = value
      plgpu.commit_smem()
      plgpu.copy_smem_to_gmem(out_smem, out_rows)
      plgpu.wait_smem_to_gmem(0)

  return plgpu.kernel(
      kernel,
      out_type=plumbing.shape_dtype_like(tiles, out_shape, jnp.float32),
      grid=(-(-num_rows // CONFIG.rows), segments * per_run),
      grid_names=("rows", "groups"),
      interpret=plgpu.InterpretGPUParams() if interpret else None,
  )(tiles)


def merge(tiles, *, with_entropy, interpret):
  """A token's log-prob and entropy from its tiles' statistics ``[G, 4, C]``, in the
  tiles' order, as the contract says (``merge``); ``interpret``: run in JAX's GPU
  interpreter (off GPUs: tests). Memory: the outputs, ``[G / CONFIG.group, 4, C]`` partial sums
    per extra stage (and, when ``C`` is not a multiple of 8 or is below ``CONFIG.rows``, one
    padded copy of ``tiles``).
  """
  num_rows = tiles.shape[2]
  tiles = merge_contract.padded_tiles(tiles, ROW_TILE, CONFIG.rows)
  while tiles.shape[0] > CONFIG.group:
    tiles = _stage(tiles, group=CONFIG.group, with_entropy=with_entropy, finish=False,
                   interpret=interpret)
  merged = _stage(tiles, group=tiles.shape[0], with_entropy=with_entropy, finish=True,
                  interpret=interpret)
  logp, m, log_s, entropy = (merged[i, :num_rows] for i in range(4))
  return logp, m, log_s, (entropy if with_entropy else None)


def partial_sums(tiles, *, segments, with_entropy, interpret):
  """The first stage of ``merge`` within each of ``segments`` equal runs of ``tiles [G, 4,
  C]`` (a vocab shard's segments, ``merge``'s contract): each run's groups of up to
  ``CONFIG.group`` consecutive tiles merged into ``(m, s, q, picked)``, ``[P, 4, C]`` f32 in
  the tiles' order (``P``: ``segments`` times the groups of a run), to be gathered over the
  shards and merged. Memory: the outputs (and, as ``merge``, a padded copy of ``tiles``
  when ``C`` is not a multiple of 8 or is below ``CONFIG.rows``)."""
  num_rows = tiles.shape[2]
  padded = merge_contract.padded_tiles(tiles, ROW_TILE, CONFIG.rows)
  group = min(CONFIG.group, tiles.shape[0] // segments)
  sums = _stage(padded, group=group, with_entropy=with_entropy, finish=False,
                interpret=interpret, segments=segments)
  return sums if sums.shape[2] == num_rows else sums[:, :, :num_rows]
