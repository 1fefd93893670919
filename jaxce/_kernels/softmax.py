"""The per-tile maths shared by every kernel: statistics forward, logit gradient backward.

A *tile* is ``[C, V_tile]`` logits for C tokens and one contiguous block of vocabulary
columns (one vocab shard, or one block of it). Everything here is float32 (float64 when
the input is float64) and elementwise or a row reduction, so XLA fuses each function into
one pass over the tile; nothing here allocates more than the tile.

    z    = x * (1/T)                      excluded columns (id >= vocab_size) are -inf
    m    = pmax(stop_gradient(max_v z))
    s    = psum(sum_v exp(z - m))
    log p = (z - m) - log s               m and log s kept apart: z - m is exact where
    logp  = psum(z[label]) - m - log s    z is near m, so log p is as accurate as the
    H     = log s - psum(sum_v exp(z - m) * (z - m)) / s        plain log_softmax
    dz    = g_logp * (onehot(label) - p) - g_H * p * (log p + H)

Batch-invariant statistics (``exact_statistics``) take the same maths with sums that no
order can change: m is a max (exact in any order); each term exp(z - m) in [0, 1] and
-exp(z - m) (z - m) in [0, 1/e] is cut into ``LIMB_BITS``-bit integer limbs (exactly,
down to 2^-(mantissa + 24)), and the limbs are summed in int32 (exact in any order, on
any number of shards: ``psum``); only then are they turned back into one float. So a
row's ``m``, ``s``, ``q`` depend on its own logits alone: not on the other rows, the
chunk, the tile or the number of vocab shards.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax


def compute_dtype(*dtypes) -> jnp.dtype:
  """float32, or float64 when an input already is (used by f64 gradient checks): the
  common dtype of ``dtypes`` and float32."""
  return functools.reduce(jnp.promote_types, dtypes, jnp.dtype(jnp.float32))


def scaled_logits(x, inv_temp, column_start, vocab_size, first_column=None, kept=None):
  """Upcast, divide by the temperature and mask excluded columns.

  Args:
    x: ``[C, V_tile]`` logits of any float dtype.
    inv_temp: ``[C]`` 1 / temperature per token.
    column_start: global id of the tile's first column (int scalar, may be traced).
    vocab_size: logical vocabulary; columns with id >= it become -inf. ``None``: no mask.
    first_column: global ids below it become -inf too (a clamped last vocab block's
      columns that an earlier block already covered). ``None``: no mask.
    kept: ``[C, V_tile]`` bool, the token's kept set (``kept_columns``): columns outside
      it become -inf. ``None``: every column is kept.

  Returns:
    ``[C, V_tile]`` z in the compute dtype (fused; not materialized on its own).
  """
  z = x.astype(compute_dtype(x.dtype)) * inv_temp[:, None].astype(compute_dtype(x.dtype))
  return masked(z, column_start, vocab_size, first_column, kept)


def masked(z, column_start, vocab_size, first_column=None, kept=None):
  """``z [C, V_tile]`` with the excluded columns set to -inf (the arguments as in
  :func:`scaled_logits`)."""
  column_ids = column_start + lax.broadcasted_iota(jnp.int32, z.shape, 1)
  if vocab_size is not None:
    z = jnp.where(column_ids < vocab_size, z, -jnp.inf)
  if first_column is not None:
    z = jnp.where(column_ids >= first_column, z, -jnp.inf)
  if kept is not None:
    z = jnp.where(kept, z, -jnp.inf)
  return z


def kept_columns(words, start, width, label_column):
  """``[C, width]`` bool: the kept set of columns ``[start, start + width)`` of a packed
  ``uint32 [C, W]`` mask over this shard's columns (bit ``v % 32`` of word ``v // 32``),
  with each row's label column (``label_column [C]``, relative to ``start``; any int)
  always kept: a sampled token lies in its sampler's kept set, so a mask that leaves it
  out is a data error, and keeping it makes ``logp`` and every gradient finite.

  ``start == 0`` (a Python int) reads the words in order (a reshape); a traced ``start``
  gathers each column's word. Memory: the tile's bits, fused into their consumer.
  """
  num_rows = words.shape[0]
  if isinstance(start, int) and start == 0:
    shifts = lax.broadcasted_iota(jnp.uint32, (1, 1, 32), 2)
    bits = ((words[:, :, None] >> shifts) & 1).reshape(num_rows, words.shape[1] * 32)[:, :width]
  else:
    local = start + lax.broadcasted_iota(jnp.int32, (num_rows, width), 1)
    picked = jnp.take_along_axis(words, local // 32, axis=1, mode="clip")
    bits = (picked >> (local % 32).astype(jnp.uint32)) & 1
  label = lax.broadcasted_iota(jnp.int32, (num_rows, width), 1) == label_column[:, None]
  return (bits == 1) | label


def row_max(z, vocab_axis):
  """Global row maximum used as the shift; no derivative flows through it.

  Rows that are entirely -inf (or hold +inf/NaN) get a shift of 0 so that they stay
  contained: their own outputs become NaN/-inf, no other row is touched.
  """
  m = lax.stop_gradient(jnp.max(z, axis=-1))
  if vocab_axis is not None:
    m = lax.pmax(m, vocab_axis)
  return jnp.where(jnp.isfinite(m), m, jnp.zeros_like(m))


def tile_sums(z, m, with_entropy):
  """Row sums of exp(z - m) and, for the entropy, exp(z - m) * (z - m).

  Returns a tuple of ``[C]`` arrays (one or two) for the caller to all-reduce.
  """
  shifted = z - m[:, None]
  e = jnp.exp(shifted)
  sums = (jnp.sum(e, axis=-1),)
  if with_entropy:
    # exp(-inf) * -inf is NaN; such columns contribute exactly 0.
    sums += (jnp.sum(jnp.where(e > 0, e * shifted, 0), axis=-1),)
  return sums


# The kernels' constants: exp(x) is taken as exp2(x * LOG2_E) (one MUFU instruction on GPUs);
# FLOOR stands for -inf where a finite number is needed (a running max's start, a log p
# whose p is 0).
LOG2_E = 1.4426950408889634
FLOOR = float(jnp.finfo(jnp.float32).min)

# Bits per int32 limb of the exact sums: every limb of a term is < 2^(LIMB_BITS + 1), so
# 2^(30 - LIMB_BITS) = 2^20 columns (the whole vocabulary, all shards) sum without overflow.
LIMB_BITS = 10
MAX_EXACT_COLUMNS = 2 ** (30 - LIMB_BITS)


def _fraction_bits(dtype) -> int:
  """Bits kept below the binary point of each exact term: the dtype's mantissa and 24
  more, so the sum of up to 2^20 truncated terms is off by < 2^-(mantissa + 4) of
  ``s >= 1``."""
  return jnp.finfo(dtype).nmant + 1 + 24


def _limb_sums(t, dtype):
  """``[C, L]`` int32: row sums of the limbs of ``t [C, V]`` in ``[0, 1]`` (most significant
  first): ``t`` cut at ``_fraction_bits`` bits below the point, ``LIMB_BITS`` bits a limb
  (the first holds the integer part too). Each step is exact in floating point; each
  limb is its own row sum (one fused pass over ``t``, nothing ``[C, V, L]`` in memory)."""
  sums = []
  rest = t
  for _ in range(-(-_fraction_bits(dtype) // LIMB_BITS)):
    rest = rest * (2.0 ** LIMB_BITS)
    part = jnp.floor(rest)
    rest = rest - part
    sums.append(jnp.sum(part.astype(jnp.int32), axis=1, dtype=jnp.int32))
  return jnp.stack(sums, axis=-1)


def _from_limbs(limbs, dtype):
  """``[C]`` float from ``[C, L]`` summed limbs: least significant first, one fixed order."""
  value = jnp.zeros(limbs.shape[:-1], dtype)
  for k in range(limbs.shape[-1] - 1, -1, -1):
    value = (value + limbs[:, k].astype(dtype)) * (2.0 ** -LIMB_BITS)
  return value


def exact_statistics(x, labels, inv_temp, valid, column_start, vocab_size, mask_vocab,
                     vocab_axis, with_entropy, kept=None, softcap=None):
  """:func:`chunk_statistics` with batch-invariant sums (the module doc): each row's
  outputs depend on its own logits alone, whatever the chunk, tile or shard count.

  ``x`` is ``[C, V_local]``; with ``softcap`` (the fused paths) the logits before it, and
  the statistics are of ``softcap * tanh(x / softcap) * inv_temp``. Every product that
  feeds a sum is exact or reaches it through a function (exp), so no compiler's choice to
  fuse a multiply and an add (FMA) into one rounding can change a bit:

      u = x, or tanh(x / c);  scale = inv_temp, or c * inv_temp
      d = (u - max u) * scale     (<= 0)     the label's d is a one-hot sum, not a gather
      s = sum exp(d),  -q = sum -exp(d) d    exact sums (int32 limbs), then one float each

  Returns ``(logp, m, log s, entropy or None)`` as :func:`chunk_statistics`, with
  ``m = max u * scale`` (the backward's shift). One pmax, one psum over ``vocab_axis``.
  """
  dtype = compute_dtype(x.dtype)
  u, scale = x.astype(dtype), inv_temp.astype(dtype)
  if softcap is not None:
    u, scale = jnp.tanh(u / softcap), scale * softcap
  if kept is not None:
    kept = kept_columns(kept, 0, x.shape[1], labels - column_start)
  u = masked(u, column_start, mask_vocab, kept=kept)
  u_max = row_max(u, vocab_axis)
  d = (u - u_max[:, None]) * scale[:, None]
  e = jnp.exp(d)
  hit = column_start + lax.broadcasted_iota(jnp.int32, d.shape, 1) == labels[:, None]
  label_d = jnp.sum(jnp.where(hit, d, 0), axis=1)  # one term or none: exact
  sums = (_exact_sum(e), _exact_sum(jnp.where(e > 0, -(e * d), 0)) if with_entropy else None)
  if vocab_axis is not None:
    sums, label_d = lax.psum((sums, label_d), vocab_axis)
  total = lambda sums: _from_limbs(sums[0], dtype) + sums[1]
  s = total(sums[0])
  log_s, entropy = finish_statistics(s, None if sums[1] is None else -total(sums[1]))
  logp, entropy_out = finish_outputs(label_d - log_s, entropy, labels, valid, vocab_size)
  return logp, u_max * scale, log_s, entropy_out


def _exact_sum(terms):
  """``([C, L] int32 limb sums of the finite terms of each row, [C] float sum of the
  others)``: the finite terms lie in ``[0, 1]``; the others (a row with +inf or NaN logits)
  are only infinities and NaN, so their float sum is exact in any order too and the row
  stays inf / NaN as with float sums."""
  finite = jnp.isfinite(terms)
  limbs = _limb_sums(jnp.where(finite, terms, 0), terms.dtype)
  return limbs, jnp.sum(jnp.where(finite, 0, terms), axis=1)


def finish_statistics(sum_exp, sum_exp_shifted):
  """``(log s, entropy)`` from the all-reduced sums (``[C]`` each; entropy None if not
  asked). The log-normalizer is ``m + log s``; the two stay apart (see the module doc)."""
  log_s = jnp.log(sum_exp)
  entropy = None if sum_exp_shifted is None else log_s - sum_exp_shifted / sum_exp
  return log_s, entropy


def logit_grad(z, label_column, shift, log_sum, entropy, g_logp, g_entropy, valid):
  """d loss / d z for one tile, in the compute dtype.

  Args:
    z: ``[C, V_tile]`` scaled, masked logits.
    label_column: ``[C]`` label id minus the tile's first column id (any int; only
      values inside ``[0, V_tile)`` hit a column).
    shift, log_sum, entropy: ``[C]`` saved statistics ``m``, ``log s`` and H (H only
      needed when g_entropy is given).
    g_logp, g_entropy: ``[C]`` cotangents, or ``None`` for a symbolic zero.
    valid: ``[C]`` bool; rows that are False get an exactly zero gradient.
  """
  log_p = (z - shift[:, None]) - log_sum[:, None]
  p = jnp.exp(log_p)
  coef = jnp.zeros_like(shift) if g_logp is None else g_logp
  coef = coef[:, None]
  if g_entropy is not None:
    # -inf columns have p == 0: keep their log p out of the product.
    coef = coef + g_entropy[:, None] * (jnp.where(p > 0, log_p, 0) + entropy[:, None])
  dz = -p * coef
  if g_logp is not None:
    hit = lax.broadcasted_iota(jnp.int32, z.shape, 1) == label_column[:, None]
    dz = dz + jnp.where(hit, g_logp[:, None], 0)
  return jnp.where(valid[:, None], dz, 0)


def column_limit(mask_vocab, tile_start, width):
  """The first local column of a tile of ``width`` columns (global ids from ``tile_start``)
  that lies beyond the logical vocabulary: ``width`` when ``mask_vocab`` is ``None``."""
  return width if mask_vocab is None else jnp.clip(mask_vocab - tile_start, 0, width)


def kernel_limit(mask_vocab, tile_start, width):
  """``column_limit`` as the Mosaic kernels take it: None when ``mask_vocab`` is ``None``
  (no column is excluded, and the kernels mask none)."""
  return None if mask_vocab is None else column_limit(mask_vocab, tile_start, width)


def num_shards(vocab_axis) -> int:
  """The number of vocab shards (1 without ``vocab_axis``; a tuple of axes: their
  product)."""
  if vocab_axis is None:
    return 1
  axes = vocab_axis if isinstance(vocab_axis, tuple) else (vocab_axis,)
  count = 1
  for axis in axes:
    count *= lax.axis_size(axis)
  return count


def shard_column_start(num_columns, vocab_axis):
  """Global id of this shard's first column (0 without ``vocab_axis``)."""
  if vocab_axis is None:
    return jnp.int32(0)
  return lax.axis_index(vocab_axis).astype(jnp.int32) * num_columns


def label_logit(x, labels, inv_temp, column_start, first_column=None):
  """``[C]`` z at each row's label when this tile owns it, else 0.

  Gathered from ``x`` (C elements, no pass over the tile). Labels below
  ``first_column`` belong to an earlier block and are not owned here.
  """
  dtype = compute_dtype(x.dtype)
  label_column = labels - column_start
  owned = (label_column >= 0) & (label_column < x.shape[1])
  if first_column is not None:
    owned = owned & (labels >= first_column)
  safe_column = jnp.clip(label_column, 0, x.shape[1] - 1)[:, None]
  picked = jnp.take_along_axis(x, safe_column, axis=1)[:, 0].astype(dtype)
  return jnp.where(owned, picked * inv_temp.astype(dtype), 0)


def finish_outputs(logp_unmasked, entropy, labels, valid, vocab_size):
  """Outputs as returned: in the compute dtype (float32; float64 for float64 inputs),
  0 at ignored rows, NaN log-prob for a kept label ``>= vocab_size`` (never a finite
  wrong number)."""
  logp = jnp.where(labels >= vocab_size, jnp.nan, logp_unmasked)
  logp = jnp.where(valid, logp, 0)
  if entropy is not None:
    entropy = jnp.where(valid, entropy, 0)
  return logp, entropy


def chunk_statistics(x, labels, inv_temp, valid, column_start, vocab_size, mask_vocab,
                     vocab_axis, with_entropy, kept=None):
  """Forward statistics of one chunk of tokens over this shard's columns.

  Args:
    x: ``[C, V_local]`` logits (any float dtype; the matmul output on the fused path).
    labels: ``[C]`` int32 global ids; inv_temp ``[C]``; valid ``[C]`` bool.
    column_start: global id of ``x``'s first column.
    vocab_size: logical vocabulary (kept labels at or above it give NaN).
    mask_vocab: ``vocab_size`` when some columns must be masked, else ``None``.
    kept: ``[C, V_local / 32]`` uint32, the rows' kept sets (``kept_columns``), or None.

  Returns:
    ``(logp, m, log s, entropy or None)``, ``[C]`` each in the compute dtype; logp and
    entropy are 0 at ignored rows. One pmax and one psum over ``vocab_axis``.
  """
  if kept is not None:
    kept = kept_columns(kept, 0, x.shape[1], labels - column_start)
  z = scaled_logits(x, inv_temp, column_start, mask_vocab, kept=kept)
  picked = label_logit(x, labels, inv_temp, column_start)
  m = row_max(z, vocab_axis)
  sums = tile_sums(z, m, with_entropy)
  reduced = jnp.stack(sums + (picked,))
  if vocab_axis is not None:
    reduced = lax.psum(reduced, vocab_axis)
  log_s, entropy = finish_statistics(reduced[0], reduced[1] if with_entropy else None)
  logp, entropy_out = finish_outputs((reduced[-1] - m) - log_s, entropy, labels, valid,
                                     vocab_size)
  return logp, m, log_s, entropy_out


def merge_running(m, s, q, m_new):
  """Rescale running sums from shift ``m`` to shift ``m_new`` (``[C]`` each).

  ``s = sum exp(z - m)`` and ``q = sum exp(z - m) * (z - m)`` become the same sums
  relative to ``m_new >= m``. ``m`` starts at ``finfo.min`` (never 0, never -inf), so an
  empty running sum stays exactly 0.
  """
  scale = jnp.exp(m - m_new)
  return s * scale, None if q is None else scale * (q + (m - m_new) * s)


def running_start(num_rows, dtype, with_entropy, like):
  """Initial ``(m, s, q)`` ``[num_rows]`` for an online softmax over vocab blocks;
  ``like`` (``[num_rows]``) lends its varying type inside shard_map."""
  zeros = jnp.zeros_like(like, dtype)
  return zeros + jnp.finfo(dtype).min, zeros, (zeros if with_entropy else None)


def accumulate_tile(m, s, q, z):
  """Fold one ``[C, V_tile]`` tile of z into the running ``(m, s, q)`` of its rows."""
  tile_max = lax.stop_gradient(jnp.max(z, axis=-1))
  m_new = jnp.maximum(m, jnp.maximum(tile_max, jnp.finfo(z.dtype).min))
  s, q = merge_running(m, s, q, m_new)
  sums = tile_sums(z, m_new, q is not None)
  return m_new, s + sums[0], (None if q is None else q + sums[1])


def merge_statistics(m, s, q, other_m, other_s, other_q):
  """One ``(m, s, q)`` from two of the same rows over disjoint columns (``[C]`` each;
  ``q`` and ``other_q`` both ``None`` without the entropy)."""
  m_new = jnp.maximum(m, other_m)
  s, q = merge_running(m, s, q, m_new)
  other_s, other_q = merge_running(other_m, other_s, other_q, m_new)
  return m_new, s + other_s, (None if q is None else q + other_q)


def combine_shards(m, s, q, picked, vocab_axis):
  """All-reduce running sums and the label logit over ``vocab_axis``: one pmax, one psum."""
  if vocab_axis is None:
    return m, s, q, picked
  m_all = lax.pmax(m, vocab_axis)
  s, q = merge_running(m, s, q, m_all)
  reduced = lax.psum(jnp.stack((s, picked) + (() if q is None else (q,))), vocab_axis)
  return m_all, reduced[0], (None if q is None else reduced[2]), reduced[1]
