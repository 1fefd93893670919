"""Chunk planning and the ragged-chunk-without-copy helpers shared by the kernels.

A scan over ``n = ceil(T / C)`` chunks reads chunk ``i`` at rows
``[start_i, start_i + C)`` with ``start_i = min(i * C, T - C)``: the last chunk is
clamped back so it overlaps the one before instead of running past the end. Nothing is
padded or copied; overlapping rows are computed twice and give identical values.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax

# Bytes of one f32 [chunk, V_local] tile the default plan aims for. XLA fuses the upcast
# and scaling into the row reductions, so the tile is never materialized: the real working
# set is the reductions' partial sums, about 1% of it. Fewer, larger steps are faster:
# measured on an H200 (T = 32768, V = 151936, bf16, forward), 1024-token chunks take
# 8.1 ms, 8192 7.5 ms, one pass 7.2 ms; 110-token chunks 13.5 ms (bench/NOTES.md).
DEFAULT_TILE_BYTES = 4 * 2**30
# XLA's CPU backend does materialize the f32 tile (about four of them per step), so CPUs
# plan from a small budget, 16 MiB: fwd+bwd at T = 4096, V = 32768 on 2 EPYC cores (32 MiB
# L3) took 618 and 612 ms with 128-token chunks (16 MiB tiles) in two runs, 709 and 652 ms
# with 512 (64 MiB), 803 and 681 ms with 1024 (bench/NOTES.md, 17).
CPU_TILE_BYTES = 16 * 2**20


def plan_chunk_size(num_tokens: int, num_columns: int, chunk_size: int | None,
                    tile_bytes: int | None = None) -> int:
  """Tokens per scan step.

  Args:
    num_tokens: T (> 0).
    num_columns: columns each step holds for a token (V_local, or a vocab block).
    chunk_size: the user's choice, or ``None`` to plan from ``tile_bytes``.
    tile_bytes: working-set budget of one f32 ``[chunk, num_columns]`` tile; ``None``:
      ``CPU_TILE_BYTES`` on CPUs, ``DEFAULT_TILE_BYTES`` elsewhere.

  Returns:
    ``min(chunk_size, T)``; when planning, the largest chunk under the budget,
    moved down to a divisor of T if one lies within a factor 2 (a ragged last chunk
    then never happens).
  """
  if chunk_size is not None:
    return min(chunk_size, num_tokens)
  if tile_bytes is None:
    tile_bytes = CPU_TILE_BYTES if jax.default_backend() == "cpu" else DEFAULT_TILE_BYTES
  cap = max(1, min(num_tokens, tile_bytes // (4 * max(num_columns, 1))))
  if cap == num_tokens:
    return cap  # one chunk: rounding it down would only add a step
  if cap >= 8:
    cap -= cap % 8
  for size in range(cap, max(cap // 2, 1) - 1, -1):
    if num_tokens % size == 0:
      return size
  return cap


def num_chunks(total: int, size: int) -> int:
  return math.ceil(total / size)


def chunk_start(i, total: int, size: int):
  """First row of chunk ``i`` (traced int32), clamped so the chunk ends inside."""
  return jnp.minimum(i * size, total - size)


def fresh_rows(i, start, size: int):
  """``[size]`` bool: rows of chunk ``i`` no earlier chunk has produced."""
  return start + lax.iota(jnp.int32, size) >= i * size


def unchunk(stacked, total: int):
  """``[n, C, ...]`` per-chunk results -> ``[total, ...]``, dropping the overlap.

  A reshape (free) when C divides total; otherwise one O(total) concatenate.
  """
  n, size = stacked.shape[:2]
  flat = stacked.reshape((n * size,) + stacked.shape[2:])
  if n * size == total:
    return flat
  tail = total - (n - 1) * size
  return jnp.concatenate([flat[: (n - 1) * size], stacked[n - 1, size - tail:]])
