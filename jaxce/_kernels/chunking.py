"""The ragged-chunk-without-copy helpers shared by the kernels (the planner sizes chunks).

Two ways to walk ``T`` rows in chunks of ``C``, neither of which pads or copies:

* clamped (``chunk_start``): a scan over ``n = ceil(T / C)`` chunks reads chunk ``i`` at
  rows ``[start_i, start_i + C)`` with ``start_i = min(i * C, T - C)``: the last chunk is
  clamped back so it overlaps the one before instead of running past the end; the
  overlapping rows are computed twice and give identical values. Cheap when ``C`` is
  small next to ``T``; up to twice the work when ``C`` is about ``T``.
* exact (``RowChunks``, ``scan_chunks``): a scan over ``count`` chunks of ``C`` rows, then
  one last call on the rows left (a static shape of its own): every row once.
"""

from __future__ import annotations

import math
from typing import NamedTuple

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


class RowChunks(NamedTuple):
  """``total`` rows as ``count`` chunks of ``size`` rows from row 0, then (when ``last``
  is not 0) one chunk of the ``last`` rows left: every row in one chunk, none twice."""
  total: int
  size: int
  count: int
  last: int

  @property
  def sizes(self) -> tuple[int, ...]:
    """The chunks' sizes in row order."""
    return (self.size,) * self.count + ((self.last,) if self.last else ())


def exact_chunks(total: int, size: int, min_last: int = 1) -> RowChunks:
  """The :class:`RowChunks` of ``total`` rows in chunks of ``size``, the last one holding
  at least ``min_last`` rows (at most ``size + min_last - 1``: rows short of ``min_last``
  join the chunk before); ``total >= min_last``."""
  size = min(size, total)
  count = (total - min_last) // size
  last = total - count * size
  if last == size:  # (an equal last chunk joins the scan)
    count, last = count + 1, 0
  return RowChunks(total, size, count, last)


def scan_chunks(step, carry, chunks: RowChunks, first: int = 0):
  """``step(carry, start, size) -> (carry, out)`` over ``chunks`` from chunk ``first``:
  a scan over the equal chunks (``start`` traced), then the last chunk (``start`` static).
  Returns the final carry and the outputs' ``[rows]`` pytrees concatenated in row order
  (None leaves stay None; a chunk's outputs must have its rows leading, or be None)."""
  outs = []
  if chunks.count > first:
    carry, stacked = lax.scan(lambda c, i: step(c, i * chunks.size, chunks.size), carry,
                              jnp.arange(first, chunks.count))
    outs.append(jax.tree.map(lambda s: s.reshape((-1,) + s.shape[2:]), stacked))
  if chunks.last and first <= chunks.count:
    carry, out = step(carry, chunks.total - chunks.last, chunks.last)
    outs.append(out)
  if not outs or outs[0] is None:
    return carry, None
  return carry, jax.tree.map(lambda *parts: jnp.concatenate(parts) if len(parts) > 1
                             else parts[0], *outs)
