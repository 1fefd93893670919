"""Kept sets: the per-token subset of the vocabulary a sampler draws from (top-k, top-p,
min-p), packed 32 columns a word, for the ``keep=`` option of every jaxce function.

A kept set is a ``uint32 [..., ceil(V / 32)]`` array over global column ids: bit
``v % 32`` of word ``v // 32`` is 1 when column ``v`` is kept. With ``keep=`` the
log-prob and entropy are those of the softmax renormalized over the kept columns, as the
sampler's policy is.

    keep = jaxce.keep.from_logits(sampler_logits, temperature=0.7, top_p=0.95)
    logp, ent = jaxce.linear_logprobs_and_entropy(hidden, kernel, tokens, keep=keep)

:func:`from_logits` expands a ``[..., V]`` boolean mask: use it where the sampler's logits
already exist (the sampler), not inside a memory-bound training step. :func:`from_top_k`
takes kept ids and writes the words directly (memory: the words and a few arrays like the
ids).

A sampler's kept sets are small (a few ids per token): :func:`from_csr` takes them as
kept ids (vLLM's sampling masks) and ``keep=`` takes the :class:`KeptIds` it returns as
they are. Every function then computes only the kept columns' logits (on the fused head a
fraction of its cost), unless the sets are large or the call batch-invariant: then they
are packed into words first (:func:`pack_ids`; ``jaxce.plan.of`` says which).

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
from jaxce._kernels.config import KeptIds

__all__ = ["KeptIds", "check", "from_csr", "from_logits", "from_top_k", "pack", "pack_ids",
           "unpack"]


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
  ``num_columns`` columns: ``uint32 [..., ceil(num_columns / 32)]``. A repeated id counts
  once.

  Raises:
    ValueError: with concrete ids, an id outside ``[0, num_columns)`` (under ``jit`` such
      an id keeps nothing).
  """
  ids = _integer_array("ids", ids)
  if _checks.is_concrete(ids):
    host = np.asarray(ids)
    bad = np.argwhere((host < 0) | (host >= num_columns))
    if bad.size:
      position = tuple(int(i) for i in bad[0])
      raise ValueError(f"ids[{position}] = {int(host[position])} is out of range for "
                       f"{num_columns} columns ({len(bad)} such id(s))")
  tokens = ids.shape[:-1]
  num_tokens = int(np.prod(tokens, dtype=np.int64))
  token = jnp.repeat(jnp.arange(num_tokens, dtype=jnp.int32), ids.shape[-1])
  return _pack_ids(token, ids.reshape(-1), num_tokens, num_columns).reshape(*tokens, -1)


def from_csr(token_ids, offsets) -> KeptIds:
  """The kept sets of a sampler's kept ids in CSR form, as vLLM's sampling masks
  (``SamplingMask(token_ids, offsets)``) hand them over: the kept ids of token ``t`` are
  ``token_ids[offsets[t]:offsets[t + 1]]``, tokens in the order of the flattened labels.

  Args:
    token_ids: ``int [N]``: every token's kept ids, one token after another. Entries past
      ``offsets[-1]`` are unused, so a buffer of a fixed capacity can be passed as it is
      (under ``jit``, ``N`` is static: pad the ids to a fixed capacity so that calls do
      not recompile). A repeated id counts once; a negative id keeps nothing.
    offsets: ``int [T + 1]``, nondecreasing from 0.

  Returns:
    A :class:`KeptIds` for ``keep=`` (every function, which then computes only the kept
    columns' logits) or for :func:`pack_ids`. Memory: ``[N]``
    arrays.

  Raises:
    ValueError: with concrete arrays, offsets that do not start at 0, decrease or run past
      ``token_ids``.
  """
  token_ids = _integer_array("token_ids", token_ids)
  offsets = _integer_array("offsets", offsets)
  if token_ids.ndim != 1 or offsets.ndim != 1 or offsets.shape[0] < 1:
    raise ValueError(f"token_ids and offsets must be 1-D (offsets with T + 1 >= 1 entries), "
                     f"got {token_ids.shape=} and {offsets.shape=}")
  if _checks.is_concrete(offsets):
    host = np.asarray(offsets)
    if host[0] != 0 or np.any(np.diff(host) < 0) or host[-1] > token_ids.shape[0]:
      raise ValueError(f"offsets must rise from 0 to at most len(token_ids) = "
                       f"{token_ids.shape[0]}, got {host[:4]}...{host[-2:]}")
  num_tokens = offsets.shape[0] - 1
  # Each id's token: how many of offsets[1:] are at or before its position (one count a
  # position, summed along: O(N), where a binary search per id costs a loop of steps).
  starts = jnp.zeros(token_ids.shape[0], jnp.int32).at[offsets[1:]].add(1, mode="drop")
  token = jnp.cumsum(starts, dtype=jnp.int32)
  ids = jnp.where(token < num_tokens, token_ids.astype(jnp.int32), -1)
  return _normalized(token, ids, num_tokens)


def pack_ids(kept: KeptIds, num_columns: int, *, shape, first_column=0):
  """The packed words of kept ids (the form :func:`pack` makes), over the columns
  ``[first_column, first_column + num_columns)``.

  Args:
    kept: a :class:`KeptIds` (:func:`from_csr`).
    num_columns: ``V`` (the columns the words cover).
    shape: the labels' shape (``T`` tokens in all).
    first_column: the id of the words' first column (a vocab shard's first).

  Returns:
    ``uint32 [*shape, ceil(num_columns / 32)]``; ids outside the columns keep nothing.
    Memory: the words and a few ``[N]`` arrays.
  """
  num_tokens = int(np.prod(shape, dtype=np.int64))
  words = _pack_ids(kept.token, kept.ids - first_column, num_tokens, num_columns)
  return words.reshape(*shape, -1)


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
  error: jaxce then counts the label's column as kept). ``keep``: packed words or a
  :class:`KeptIds`. Reads both arrays on the host.

  Raises:
    ValueError: naming the first such position and how many there are.
  """
  if isinstance(keep, KeptIds):
    labels = np.asarray(labels)
    keep = pack_ids(keep, max(int(labels.max(initial=0)) + 1, 1), shape=labels.shape)
  keep, labels = np.asarray(keep), np.asarray(labels)
  safe = np.clip(labels, 0, keep.shape[-1] * 32 - 1)
  word = np.take_along_axis(keep, (safe // 32)[..., None], axis=-1)[..., 0]
  kept = (word >> (safe % 32).astype(np.uint32)) & 1
  bad = np.argwhere((labels >= 0) & (kept == 0))
  if bad.size:
    position = tuple(int(i) for i in bad[0])
    raise ValueError(f"labels[{position}] = {int(labels[position])} is not in its kept set "
                     f"({len(bad)} such position(s))")


def _integer_array(name, a):
  a = _checks.as_array(name, a)
  if not jnp.issubdtype(a.dtype, jnp.integer):
    raise TypeError(f"{name} must be an integer array, got {a.dtype=}")
  return a


def _normalized(token, ids, num_tokens):
  """``KeptIds`` sorted by token, then id, with repeats and negative ids marked -1 (their
  token kept, so the order stays sorted)."""
  if not ids.shape[0]:
    return KeptIds(ids, token)
  order = jnp.lexsort((ids, token))
  token, ids = token[order], ids[order]
  same = (token[1:] == token[:-1]) & (ids[1:] == ids[:-1])
  unused = jnp.concatenate([jnp.zeros(1, bool), same]) | (ids < 0) | (token >= num_tokens)
  return KeptIds(jnp.where(unused, -1, ids), token)


def _pack_ids(token, ids, num_tokens, num_columns):
  """``uint32 [num_tokens, ceil(num_columns / 32)]``: bit ``v`` of row ``t`` set for each
  pair ``(token[i], ids[i])`` (``[N]`` each) with ``0 <= token < num_tokens`` and ``0 <=
  v < num_columns``. The pairs are sorted and repeats dropped, so the distinct bits of a
  word add up to their OR; the others go to a row that is cut off."""
  ids = ids.astype(jnp.int32)
  keep = (token >= 0) & (token < num_tokens) & (ids >= 0) & (ids < num_columns)
  ids, token = _normalized(jnp.where(keep, token, num_tokens).astype(jnp.int32),
                           jnp.where(keep, ids, -1), num_tokens)
  used = ids >= 0
  bits = jnp.where(used, jnp.uint32(1) << (jnp.maximum(ids, 0) % 32).astype(jnp.uint32), 0)
  words = jnp.zeros((num_tokens + 1, -(-num_columns // 32)), jnp.uint32)
  return words.at[jnp.where(used, token, num_tokens), jnp.maximum(ids, 0) // 32].add(
      bits)[:num_tokens]
