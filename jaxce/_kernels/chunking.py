"""The ragged-chunk-without-copy helpers shared by the kernels (the planner sizes chunks).

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


def take_rows(arrays, start, size: int):
  """Rows ``[start, start + size)`` of every ``[T, ...]`` array of a pytree (``start`` may
  be traced; ``None`` leaves stay None): the one slicer of per-token arrays."""
  return jax.tree.map(lambda a: lax.dynamic_slice_in_dim(a, start, size, 0), arrays)


def pad_rows(a, total: int, value=0):
  """``[T, ...]`` ``a`` with rows of ``value`` appended up to ``total`` (None stays None;
  no copy when ``T >= total``)."""
  if a is None or a.shape[0] >= total:
    return a
  return jnp.pad(a, [(0, total - a.shape[0])] + [(0, 0)] * (a.ndim - 1),
                 constant_values=value)


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
