"""Kept sets: the per-token subset of the vocabulary a sampler draws from (top-k, top-p,
min-p), packed 32 columns a word, for the ``keep=`` option of every jaxce function.

A kept set is a ``uint32 [..., ceil(V / 32)]`` array over global column ids: bit
``v % 32`` of word ``v // 32`` is 1 when column ``v`` is kept. With ``keep=`` the
log-prob and entropy are those of the softmax renormalized over the kept columns, as the
sampler's policy is.

    keep = jaxce.keep.from_logits(sampler_logits, temperature=0.7, top_p=0.95)
    logp, ent = jaxce.linear_logprobs_and_entropy(hidden, kernel, tokens, keep=keep)

These helpers expand a ``[..., V]`` boolean mask: use them where the sampler's logits
already exist (the sampler), not inside a memory-bound training step.

Example:
  >>> import jax.numpy as jnp
  >>> import jaxce
  >>> logits = jnp.array([[2.0, 1.0, 0.5, -3.0], [0.0, 0.0, 0.0, 0.0]])
  >>> keep = jaxce.keep.from_logits(logits, top_k=2)
  >>> keep.shape, keep.dtype
  ((2, 1), dtype('uint32'))
  >>> jaxce.keep.unpack(keep, 4)[0]
  Array([ True,  True, False, False], dtype=bool)
  >>> jaxce.keep.check(keep, jnp.array([1, -100]))  # an ignored label is never outside
  >>> jaxce.keep.check(keep, jnp.array([3, -100]))
  Traceback (most recent call last):
  ...
  ValueError: labels[(0,)] = 3 is not in its kept set (1 such position(s))
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxce import _checks

__all__ = ["check", "from_logits", "from_top_k", "pack", "unpack"]


def pack(mask):
  """``bool [..., V]`` -> ``uint32 [..., ceil(V / 32)]``: bit ``v % 32`` of word
  ``v // 32`` is ``mask[..., v]``."""
  mask = jnp.asarray(mask, jnp.bool_)
  num_columns = mask.shape[-1]
  words = -(-num_columns // 32)
  padded = jnp.pad(mask, [(0, 0)] * (mask.ndim - 1) + [(0, 32 * words - num_columns)])
  bits = padded.reshape(*mask.shape[:-1], words, 32).astype(jnp.uint32)
  # The 32 bits of a word are distinct powers of two: their sum is their OR.
  return jnp.sum(bits << lax.iota(jnp.uint32, 32), axis=-1, dtype=jnp.uint32)


def unpack(keep, num_columns: int):
  """``uint32 [..., W]`` -> ``bool [..., num_columns]`` (the inverse of :func:`pack`)."""
  keep = jnp.asarray(keep, jnp.uint32)
  bits = (keep[..., None] >> lax.iota(jnp.uint32, 32)) & 1
  return bits.reshape(*keep.shape[:-1], keep.shape[-1] * 32)[..., :num_columns] == 1


def from_top_k(ids, num_columns: int):
  """The kept sets of ``ids`` (``int [..., k]``, the kept columns of each token) over
  ``num_columns`` columns: ``uint32 [..., ceil(num_columns / 32)]``.

  Raises:
    ValueError: with concrete ids, an id outside ``[0, num_columns)`` (under ``jit`` such
      an id keeps nothing).
  """
  ids = _checks.as_array("ids", ids)
  if not jnp.issubdtype(ids.dtype, jnp.integer):
    raise TypeError(f"ids must be an integer array of column ids, got {ids.dtype=}")
  if _checks.is_concrete(ids):
    host = np.asarray(ids)
    bad = np.argwhere((host < 0) | (host >= num_columns))
    if bad.size:
      position = tuple(int(i) for i in bad[0])
      raise ValueError(f"ids[{position}] = {int(host[position])} is out of range for "
                       f"{num_columns} columns ({len(bad)} such id(s))")
  columns = jnp.arange(num_columns)
  mask = jnp.any(ids[..., :, None] == columns, axis=-2) if ids.shape[-1] else jnp.zeros(
      ids.shape[:-1] + (num_columns,), jnp.bool_)
  return pack(mask)


def from_logits(logits, *, temperature=1.0, top_k=None, top_p=None, min_p=None):
  """The kept sets a sampler draws from, from its own logits ``[..., V]``: after dividing
  by ``temperature``, the ``top_k`` largest (ties at the k-th value kept), then the
  smallest set of those whose renormalized probability reaches ``top_p`` (in order of
  probability; ties at the last value kept), then those with probability at least
  ``min_p`` times the largest. ``None`` skips a step (all ``None``: every column).

  Returns:
    ``uint32 [..., ceil(V / 32)]``. Memory: a few ``[..., V]`` arrays (a sort for top-p).
  """
  logits = _checks.as_array("logits", logits)
  _checks.check_float("logits", logits)
  z = logits.astype(jnp.promote_types(logits.dtype, jnp.float32)) / jnp.asarray(temperature)
  mask = z > -jnp.inf
  if top_k is not None:
    if not isinstance(top_k, (int, np.integer)) or top_k < 1:
      raise ValueError(f"top_k must be None or an int >= 1, got {top_k=!r}")
    kth = lax.top_k(z, min(int(top_k), z.shape[-1]))[0][..., -1:]
    mask &= z >= kth
  if top_p is not None:
    if not 0 < top_p <= 1:
      raise ValueError(f"top_p must be None or in (0, 1], got {top_p=!r}")
    p = jax.nn.softmax(jnp.where(mask, z, -jnp.inf), axis=-1)
    ordered = -jnp.sort(-p, axis=-1)
    before = jnp.cumsum(ordered, axis=-1) - ordered  # mass of the larger ones
    last = jnp.min(jnp.where(before < top_p, ordered, jnp.inf), axis=-1, keepdims=True)
    mask &= p >= last
  if min_p is not None:
    if not 0 <= min_p <= 1:
      raise ValueError(f"min_p must be None or in [0, 1], got {min_p=!r}")
    masked = jnp.where(mask, z, -jnp.inf)
    mask &= masked >= jnp.max(masked, axis=-1, keepdims=True) + jnp.log(min_p)
  return pack(mask)


def check(keep, labels):
  """Raise when a kept (``label >= 0``) label lies outside its token's kept set (a data
  error: jaxce then counts the label's column as kept). Reads both arrays on the host.

  Raises:
    ValueError: naming the first such position and how many there are.
  """
  keep, labels = np.asarray(keep), np.asarray(labels)
  safe = np.clip(labels, 0, keep.shape[-1] * 32 - 1)
  word = np.take_along_axis(keep, (safe // 32)[..., None], axis=-1)[..., 0]
  kept = (word >> (safe % 32).astype(np.uint32)) & 1
  bad = np.argwhere((labels >= 0) & (kept == 0))
  if bad.size:
    position = tuple(int(i) for i in bad[0])
    raise ValueError(f"labels[{position}] = {int(labels[position])} is not in its kept set "
                     f"({len(bad)} such position(s))")
