"""The ragged-chunk-without-copy helpers shared by the kernels (the planner sizes chunks).

A scan over ``n = ceil(T / C)`` chunks reads chunk ``i`` at rows
``[start_i, start_i + C)`` with ``start_i = min(i * C, T - C)``: the last chunk is
clamped back so it overlaps the one before instead of running past the end. Nothing is
padded or copied; overlapping rows are computed twice and give identical values.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
from jax import lax


def num_chunks(total: int, size: int) -> int:
  return math.ceil(total / size)


def chunk_start(i, total: int, size: int):
  """First row of chunk ``i`` (traced int32), clamped so the chunk ends inside."""
  return jnp.minimum(i * size, total - size)


def fresh_rows(i, start, size: int):
  """``[size]`` bool: rows of chunk ``i`` no earlier chunk has produced."""
  return start + lax.iota(jnp.int32, size) >= i * size


def write_fresh(buffer, rows, start, fresh, old=None):
  """``buffer`` with a chunk's ``rows`` written at ``start``, except where ``fresh`` (its
  ``fresh_rows``) is False: rows an earlier chunk already produced (a clamped last chunk's
  overlap) keep ``old`` (``buffer``'s rows there unless given)."""
  if rows.ndim > 1:
    fresh = fresh[(slice(None),) + (None,) * (rows.ndim - 1)]
  rows = rows.astype(buffer.dtype)
  if old is None:
    old = lax.dynamic_slice_in_dim(buffer, start, rows.shape[0], 0)
  return lax.dynamic_update_slice_in_dim(buffer, jnp.where(fresh, rows, old), start, 0)


def pad_tokens(total: int, hidden, labels, inv_temp, valid, kept, token_args=()):
  """The per-token arrays (``[T, ...]``; ``kept`` may be None) with rows appended up to
  ``total``: zeros, temperature 1 and ``valid`` False, so the padded tokens are ignored. A
  batch-invariant plan's matmul keeps its shape when a call has fewer tokens than its
  rows. Returns ``(hidden, labels, inv_temp, valid, kept, token_args)``."""
  def pad(a, value=0):
    if a is None or a.shape[0] >= total:
      return a
    return jnp.pad(a, [(0, total - a.shape[0])] + [(0, 0)] * (a.ndim - 1),
                   constant_values=value)
  return (pad(hidden), pad(labels), pad(inv_temp, 1), pad(valid, False), pad(kept),
          tuple(pad(a) for a in token_args))


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
