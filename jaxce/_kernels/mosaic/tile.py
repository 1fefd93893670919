"""The tile maths of the Hopper (Pallas Mosaic GPU) kernels, in one place: what each
kernel does to a ``[rows, 128]`` tile held in registers (WGMMA layout), the tile's
shared-memory swizzle, the kept-set words, and the records of per-row inputs.

The kernels only move data (``mosaic_rows``: statistics of logits rows; ``mosaic_rows_grad``:
their gradient; ``mosaic_head``: the fused head's matmul tiles, finished in registers);
what they compute on a tile is here:

* ``fold``: a tile folded into its rows' running statistics (an online softmax over the
  tiles of a group, ``mosaic_rows``);
* ``tile_statistics``: a tile's own ``(m, s, q, picked)`` (``mosaic_head``'s forward;
  ``mosaic_merge`` merges them over the tiles), and its ``exp(z - m)`` terms for the fused
  objective path;
* ``rows_gradient`` and ``head_gradient``: the tile's ``d logits``. Both are
  ``softmax.logit_grad``'s maths (``log p = (z - m) - log s``, the rows masked after every
  factor); they guard ``log p`` of an excluded column in two ways (a floor, a select) and
  take ``exp`` in two ways (``exp2`` of a product, ``exp``), and each path's gradients keep
  the bits they were released with;
* ``exp_gradient``: the same gradient from a tile's ``exp(z - m_tile)`` terms
  (``mosaic_rows_grad.exp_overwrite``, the fused objective path's ``d``).

Per-row inputs reach a kernel as one f32 ``[fields, rows]`` array, stacked from a record
by its fields' order (``stack``) and loaded back into the same record (``load``), so a
kernel reads them by name.
"""

from __future__ import annotations

from typing import NamedTuple

import jax.numpy as jnp
from jax import lax

from jaxce._kernels import chunking, plumbing, softmax

plgpu = plumbing.lazy_module("jax.experimental.pallas.mosaic_gpu")

TILE = 128  # columns of a tile
WORDS = TILE // 32  # kept-set words per tile row
LOG2_E, FLOOR = softmax.LOG2_E, softmax.FLOOR


def swizzle(minor_dim: int, dtype, max_bytes: int = 128):
  """Shared-memory tiling and swizzle of a tile whose minor dim holds ``minor_dim``
  elements of ``dtype`` (the widest swizzle that fits, up to ``max_bytes``: what wgmma and
  TMA expect, and conflict-free loads into the WGMMA register layout). TMA tiles the
  array in device memory the same way: its minor dim must be a multiple of the swizzle's
  width (``array_swizzle``)."""
  itemsize = jnp.dtype(dtype).itemsize
  width = min(plgpu.find_swizzle(minor_dim * itemsize * 8), max_bytes)
  return plgpu.TilingTransform((8, width // itemsize)), plgpu.SwizzleTransform(width)


def stack(record) -> jnp.ndarray:
  """``[fields, rows]`` f32: a record of ``[rows]`` per-row inputs, in its fields' order."""
  return jnp.stack([jnp.asarray(v).astype(jnp.float32) for v in record])


def load(record_type, ref, index, **load_options):
  """The record ``record_type`` of ``[rows]`` f32 vectors (WGMMA row layout) loaded from
  ``ref.at[index, field]``, a ``[rows]`` slice of what ``stack`` made per field."""
  layout = plgpu.Layout.WGMMA.reduce(1)  # one number per row of a tile
  return record_type(*(plgpu.load(ref.at[index, i], layout=layout, **load_options)
                       for i in range(len(record_type._fields))))


def _per_row(v, shape):
  return lax.broadcast_in_dim(v, shape, [0])


def _columns(shape, column, layout=None):
  """f32 ``shape``: each element's column, the tile's first being ``column`` (exact below
  2**24); ``layout``: the tile's (default WGMMA)."""
  layout = plgpu.Layout.WGMMA if layout is None else layout
  local = plgpu.broadcasted_iota(jnp.int32, shape, 1, layout=layout)
  return (local + column).astype(jnp.float32)


# The kernels cut a device's columns into segments fixed by V alone: up to MAX_SHARDS
# equal segments, each tiled from its own first column (its last tile partial where the
# width is not whole tiles: Qwen3's 151936 columns are 8 segments of 18992), so every
# power-of-two shard count whose shards are whole segments sees the same tiles and
# groups, and a token the same bits (docs/guides/reproducible.md).
MAX_SHARDS = 8
# TMA tiles an array in device memory as the tile's shared memory is tiled (its swizzle's
# width): a [.., V_local] array of 16-bit values whose V_local is not a multiple of 64
# takes a narrower swizzle (64 or 32 bytes), and below 16 columns none fits.
MIN_ALIGN = 16


class Segments(NamedTuple):
  """How the kernels tile this device's ``V_local = count * width`` columns: ``count``
  segments of ``width`` columns, each tiled in ``TILE`` columns from its own first
  column. Where ``width`` is not a multiple of ``TILE`` each segment's last tile is
  partial: it reads zeros past the segment's end (TMA's bounds: the kernels read the
  columns as ``[rows, count, width]``, ``split``), the statistics mask those columns, and
  its stores past the end are dropped, so no column is read from another segment or
  shard, computed twice or written twice. ``total``: the segments over every shard
  (``count`` times the shard count)."""
  width: int
  count: int
  total: int

  @property
  def tiles_per_segment(self) -> int:
    return -(-self.width // TILE)

  @property
  def num_tiles(self) -> int:
    """This device's tiles: ``count * tiles_per_segment``."""
    return self.count * self.tiles_per_segment

  @property
  def partial(self) -> bool:
    """Whether each segment's last tile is partial (its columns past the segment's end
    masked)."""
    return self.width % TILE != 0

  @property
  def split(self) -> bool:
    """Whether the kernels read (and write) the columns as ``[rows, count, width]``:
    several segments whose last tiles are partial."""
    return self.count > 1 and self.partial


def segments(num_columns: int, num_shards: int = 1) -> Segments:
  """The segments of a device's ``num_columns`` columns when the vocabulary is split over
  ``num_shards`` devices: ``V = num_columns * num_shards`` cut into 8 or 4 equal segments of
  whole tiles where it can be (Qwen3.5's 248320: 4 of 62080; the kernels then read the
  columns where they lie), else into the most equal segments (at most ``MAX_SHARDS``, a
  power of two) whose width is a multiple of ``MIN_ALIGN`` (TMA's rows) and at least a
  tile (Qwen3's 151936: 8 of 18992, each's last tile partial; 64 columns stay one
  segment: segments narrower than a tile would each cost a whole tile's work). A
  function of ``V`` alone whenever each shard holds whole segments, so a token's tiles
  and groups, and its bits, are the same at every power-of-two shard count up to
  ``count`` (times the shard count) whose shards are whole segments; a shard that is not
  is one segment of its own."""
  vocab = num_columns * num_shards
  count = next((c for c in (MAX_SHARDS, MAX_SHARDS // 2)
                if not vocab % c and not (vocab // c) % TILE), None)
  if count is None:
    count = MAX_SHARDS
    while count > 1 and (vocab % count or (vocab // count) % MIN_ALIGN
                         or vocab // count < TILE):
      count //= 2
  width = vocab // count
  if num_columns % width:
    return Segments(num_columns, 1, num_shards)
  return Segments(width, num_columns // width, count)


def array_swizzle(num_columns: int, dtype) -> int:
  """The widest swizzle, in bytes (128, 64 or 32), of tiles read from or written to a
  ``[.., num_columns]`` array of ``dtype`` with TMA: a row must be a multiple of the
  swizzle's width (TMA tiles the array as the tile's shared memory is tiled); 0 when
  none fits. (The narrower swizzles cost time: bench/NOTES.md, entry 43.)"""
  row_bytes = num_columns * jnp.dtype(dtype).itemsize
  return next((b for b in (128, 64, 32) if row_bytes % b == 0), 0)


def kept_words(kept, label_column, num_rows, num_columns):
  """uint32 ``[tiles * WORDS, num_rows]``: the kept sets ``kept [T, >= ceil(num_columns /
  32)]`` (bit ``v % 32`` of word ``v // 32``) of each tile of ``TILE`` of the
  ``num_columns`` columns, with each row's label column's bit set (``label_column [T]``
  int; none outside ``[0, num_columns)``: the label lies elsewhere), zero words past the
  last word and zero rows past ``T``, transposed so that a word is a per-row vector
  (``kept_columns``). One XLA fusion; memory: ``num_rows * tiles * WORDS * 4`` bytes
  (about ``num_rows * num_columns / 8``)."""
  num_words = -(-num_columns // TILE) * WORDS
  words = kept.astype(jnp.uint32)[:, :-(-num_columns // 32)]
  words = jnp.pad(words, [(0, 0), (0, num_words - words.shape[1])])
  label_column = label_column.astype(jnp.int32)[:, None]
  label_column = jnp.where((label_column >= 0) & (label_column < num_columns), label_column,
                           -32)
  label_bit = jnp.left_shift(jnp.uint32(1), (label_column % 32).astype(jnp.uint32))
  index = lax.broadcasted_iota(jnp.int32, words.shape, 1)
  words = jnp.where(index == label_column // 32, words | label_bit, words)
  return chunking.pad_rows(words, num_rows).T


def segment_words(kept, start: int, width: int):
  """uint32 ``[T, ceil(width / 32)]``: the kept sets ``kept [T, words]`` (bit ``v % 32`` of
  word ``v // 32``) of the ``width`` columns from column ``start``, bit ``v`` being column
  ``start + v`` (shifted out of two words where ``start`` is not a multiple of 32), no
  bit set past ``width``. One XLA fusion."""
  num_words = -(-width // 32)
  word, bit = divmod(start, 32)
  words = kept.astype(jnp.uint32)[:, word:word + num_words + 1]
  words = jnp.pad(words, [(0, 0), (0, num_words + 1 - words.shape[1])])
  low = words[:, :num_words]
  if bit:
    low = (low >> jnp.uint32(bit)) | (words[:, 1:] << jnp.uint32(32 - bit))
  if width % 32:
    low = low.at[:, -1].set(low[:, -1] & jnp.uint32((1 << (width % 32)) - 1))
  return low


def segment_kept_words(kept, label_column, num_rows, layout: Segments):
  """``kept_words`` of the tiles of ``layout``: each segment's tiles from its own first
  column (``segment_words``), the segments' words in order; ``label_column [T]`` as
  ``kept_words``, over this device's columns. Without ``layout.split``, ``kept_words``
  itself. One XLA fusion; memory: ``num_rows * layout.num_tiles * WORDS * 4`` bytes."""
  num_columns = layout.count * layout.width
  if not layout.split:
    return kept_words(kept, label_column, num_rows, num_columns)
  width = layout.width
  return jnp.concatenate([
      kept_words(segment_words(kept, segment * width, width),
                 label_column - segment * width, num_rows, width)
      for segment in range(layout.count)])


def row_end_kept_words(kept, label_column, num_rows, num_columns: int):
  """``kept_words`` of the tiles ``mosaic_rows.direct_columns`` loads from one segment of
  ``num_columns`` (at least ``TILE``): its whole tiles from column 0, and a partial last
  tile as the row's last ``TILE`` columns (``segment_words`` from ``num_columns - TILE``);
  ``label_column [T]`` as ``kept_words``. One XLA fusion; memory: ``num_rows * tiles *
  WORDS * 4`` bytes."""
  whole = num_columns // TILE * TILE
  if whole == num_columns:
    return kept_words(kept, label_column, num_rows, num_columns)
  end = num_columns - TILE
  return jnp.concatenate([
      kept_words(segment_words(kept, 0, whole), label_column, num_rows, whole),
      kept_words(segment_words(kept, end, TILE), label_column - end, num_rows, TILE)])


def kept_columns(words_smem, layout=None):
  """``bool [R, TILE]`` (WGMMA layout): the kept columns of a tile of ``R`` rows, from
  its rows' words (``words_smem``, ``[WORDS, R]`` uint32 of ``kept_words``: bit ``v % 32``
  of word ``v // 32`` for the tile's column ``v``); ``layout``: the tile's (default
  WGMMA)."""
  layout = plgpu.Layout.WGMMA if layout is None else layout
  shape = (words_smem.shape[1], TILE)
  row_layout = plgpu.Layout.WGMMA.reduce(1)
  words = [plgpu.load(words_smem.at[j], layout=row_layout, optimized=False)
           for j in range(WORDS)]
  per_row = lambda v: _per_row(v, shape)
  local = plgpu.broadcasted_iota(jnp.int32, shape, 1, layout=layout)
  low, high = (jnp.where(local < 32 * (2 * i + 1), per_row(words[2 * i]),
                         per_row(words[2 * i + 1])) for i in range(2))
  word = jnp.where(local < 64, low, high)
  return ((word >> (local & 31).astype(jnp.uint32)) & jnp.uint32(1)) == 1


def cap(x, softcap):
  """``softcap * tanh(x / softcap)``, or ``x`` without a softcap."""
  return x if softcap is None else softcap * jnp.tanh(x / softcap)


# -- logits rows (mosaic_rows, mosaic_rows_grad) ------------------------------------------

class RowsStatisticsInputs(NamedTuple):
  """Per-row inputs of ``mosaic_rows``' statistics."""
  inv_temp: jnp.ndarray
  picked: jnp.ndarray  # the label's z (0 where this shard does not own the label)
  limit: jnp.ndarray  # the first excluded column


def fold(x, carry, inputs: RowsStatisticsInputs, column, kept, *, masked, with_entropy,
         first=None, layout=None):
  """``(m, s, q)`` ``[R]`` f32 with the tile ``x [R, TILE]`` (WGMMA layout), whose first
  column is ``column``, folded in (``mosaic_rows``' online softmax)::

      m' = max(m, max_v z_v)              z = x * inv_temp (-inf beyond ``limit``)
      s' = s e + Σ_v exp(z_v - m'),       e = exp(m - m')
      q' = e (q + (m - m') s) + Σ_v exp(z_v - m') (z_v - m')

  ``masked``: apply ``limit``, and with ``first`` exclude the columns before it (a
  tile loaded over columns an earlier tile folded); ``kept``: the tile's kept columns
  (``kept_columns``) or None; ``layout``: ``x``'s (default WGMMA)."""
  m, s, q = carry
  per_row = lambda v: _per_row(v, x.shape)
  z = x.astype(jnp.float32) * per_row(inputs.inv_temp)
  if masked:
    columns = _columns(x.shape, column, layout)
    live = columns < per_row(inputs.limit)
    if first is not None:
      live = live & (columns >= jnp.asarray(first).astype(jnp.float32))
    z = jnp.where(live, z, -jnp.inf)
  if kept is not None:
    z = jnp.where(kept, z, -jnp.inf)
  m_new = jnp.maximum(m, jnp.max(z, axis=1))  # m starts at the floor: never -inf
  shifted = z - per_row(m_new)
  e = jnp.exp2(shifted * LOG2_E)
  step = m - m_new
  rescale = jnp.exp2(step * LOG2_E)
  if with_entropy:  # (max: an excluded column's 0 * -inf is 0 * floor)
    q = rescale * (q + step * s) + jnp.sum(e * jnp.maximum(shifted, FLOOR), axis=1)
  return m_new, s * rescale + jnp.sum(e, axis=1), q


class RowsGradientInputs(NamedTuple):
  """Per-row inputs of ``mosaic_rows_grad``'s kernel (``rows_gradient``)."""
  inv_temp: jnp.ndarray
  shift: jnp.ndarray  # the forward's m
  log_sum: jnp.ndarray  # and log s, apart: z - m is exact where z is near m
  coef: jnp.ndarray  # g_logp + g_entropy H
  g_entropy: jnp.ndarray
  g_logp: jnp.ndarray
  label_column: jnp.ndarray
  limit: jnp.ndarray  # the first excluded column
  row_mask: jnp.ndarray  # 1 or 0


def rows_gradient(x, inputs: RowsGradientInputs, column, kept, *, masked):
  """``d x`` ``[R, TILE]`` f32 (WGMMA layout) of the tile ``x`` whose first column is
  ``column``::

      z = x * inv_temp     (-inf beyond the vocabulary or outside the row's kept set)
      log p = max((z - m) - log s, f32 min)             p = exp(log p)
      d x = inv_temp * (-p (g_logp + g_entropy (log p + H)) + g_logp [v == label])

  ``kept``: the tile's kept columns (``kept_columns``) or None. Exactly 0 at rows whose
  ``row_mask`` is 0 (after every factor: an ignored row's NaN or infinite logits)."""
  inv_temp, shift, log_sum, coef, g_entropy, g_logp, label_column, limit, row_mask = (
      _per_row(v, x.shape) for v in inputs)
  z = x.astype(jnp.float32) * inv_temp
  columns = _columns(x.shape, column)
  if masked:
    z = jnp.where(columns < limit, z, -jnp.inf)
  if kept is not None:
    z = jnp.where(kept, z, -jnp.inf)
  log_p = jnp.maximum((z - shift) - log_sum, FLOOR)  # (an excluded column: p = 0, finite)
  p = jnp.exp2(log_p * LOG2_E)
  dz = -(p * coef + (p * log_p) * g_entropy)  # (p log p: 0 there, never 0 * inf)
  dz = jnp.where(columns == label_column, dz + g_logp, dz)
  return jnp.where(row_mask > 0, dz * inv_temp, 0.0)


# -- the fused head's tiles (mosaic_head) -------------------------------------------------

class HeadStatisticsInputs(NamedTuple):
  """Per-row inputs of ``mosaic_head``'s forward epilogue (``tile_statistics``)."""
  inv_temp: jnp.ndarray
  label: jnp.ndarray  # the label's column in this weight (-1: not here)
  limit: jnp.ndarray  # the first excluded column


def tile_statistics(x, inputs: HeadStatisticsInputs, column, kept_set, with_entropy,
                    masked=True, with_exp=False):
  """``(m, s, q, picked)`` ``[R]`` f32 of one tile of logits ``x [R, TILE]`` (after the
  softcap; WGMMA layout) whose first column is ``column``: its max, ``Σ exp(z - m)``,
  ``Σ exp(z - m)(z - m)`` (zeros without ``with_entropy``) and the label's ``z`` (0 when
  the label is not in the tile); ``kept_set``: the tile's kept columns or None;
  ``masked``: exclude the columns at or past ``inputs.limit`` (without it and without a
  kept set no column is excluded, and the guards for excluded columns are left out: the
  same numbers for finite logits). With ``with_exp``, ``((m, s, q, picked), e)``: also the
  terms of ``s``, ``e = exp(z - m)`` ``[R, TILE]`` f32 (0 at excluded columns;
  ``exp_gradient`` takes them back)."""
  per_row = lambda v: _per_row(v, x.shape)
  global_column = _columns(x.shape, column)
  kept = global_column < per_row(inputs.limit) if masked else None
  if kept_set is not None:
    kept = kept_set if kept is None else kept & kept_set
  z = x * per_row(inputs.inv_temp)
  label = global_column == per_row(inputs.label)
  if kept is not None:
    z = jnp.where(kept, z, -jnp.inf)
    label = kept & label
  m = jnp.maximum(jnp.max(z, axis=1), FLOOR)
  shifted = z - per_row(m)
  e = jnp.exp2(shifted * LOG2_E)
  s = jnp.sum(e, axis=1)
  if not with_entropy:
    q = s * 0
  elif kept is None:  # (e = 0 only where exp underflows: 0 * finite, as the guard gives)
    q = jnp.sum(e * shifted, axis=1)
  else:  # (an excluded column: 0 * -inf)
    q = jnp.sum(jnp.where(e > 0, e * shifted, 0.0), axis=1)
  picked = jnp.sum(jnp.where(label, z, 0.0), axis=1)
  return ((m, s, q, picked), e) if with_exp else (m, s, q, picked)


class HeadGradientInputs(NamedTuple):
  """Per-row inputs of ``mosaic_head``'s backward epilogue (``head_gradient``)."""
  inv_temp: jnp.ndarray
  label: jnp.ndarray  # the label's column in this block (-1: not here)
  limit: jnp.ndarray  # columns outside [first_kept, limit) are excluded
  first_kept: jnp.ndarray
  shift: jnp.ndarray  # the forward's m
  log_sum: jnp.ndarray  # and log s
  entropy: jnp.ndarray
  g_logp: jnp.ndarray
  g_entropy: jnp.ndarray
  row_mask: jnp.ndarray  # 1 or 0


def head_gradient(x, inputs: HeadGradientInputs, column, kept_set, softcap, masked=True):
  """``softmax.logit_grad`` then ``head.logits_input_grad`` of one accumulator tile
  ``x [R, TILE]`` (WGMMA layout, before the softcap) whose first column is ``column``;
  ``kept_set``: the tile's kept columns or None; ``masked``: exclude the columns outside
  ``[inputs.first_kept, inputs.limit)`` (without it and without a kept set no column is
  excluded, and the guard for excluded columns is left out: the same numbers for finite
  logits)."""
  per_row = lambda v: _per_row(v, x.shape)
  capped = cap(x, softcap)
  global_column = _columns(x.shape, column)
  kept = ((global_column >= per_row(inputs.first_kept))
          & (global_column < per_row(inputs.limit))) if masked else None
  if kept_set is not None:
    kept = kept_set if kept is None else kept & kept_set
  z = capped * per_row(inputs.inv_temp)
  if kept is not None:
    z = jnp.where(kept, z, -jnp.inf)
  log_p = (z - per_row(inputs.shift)) - per_row(inputs.log_sum)
  p = jnp.exp(log_p)
  if kept is not None:  # (an excluded column: 0 * -inf)
    log_p = jnp.where(p > 0, log_p, 0.0)
  coef = per_row(inputs.g_logp) + per_row(inputs.g_entropy) * (log_p + per_row(inputs.entropy))
  dz = jnp.where(global_column == per_row(inputs.label), per_row(inputs.g_logp), 0.0) - p * coef
  dx = dz * per_row(inputs.inv_temp)
  if softcap is not None:
    dx = dx * (1 - jnp.square(capped / softcap))
  # (after every factor: a dropped row's NaN)
  return jnp.where(per_row(inputs.row_mask) > 0, dx, 0.0)


class ExpGradientInputs(NamedTuple):
  """Per-row inputs of ``mosaic_rows_grad``'s kernel over the fused head's ``exp(z - m)``
  terms (``exp_gradient``)."""
  inv_temp: jnp.ndarray
  log_norm: jnp.ndarray  # m + log s
  coef: jnp.ndarray  # g_logp + g_entropy H
  g_entropy: jnp.ndarray
  g_logp: jnp.ndarray
  label_column: jnp.ndarray
  label_capped: jnp.ndarray  # the label's logit after the softcap (its z / inv_temp)
  row_mask: jnp.ndarray  # 1 or 0


def exp_gradient(e, inputs: ExpGradientInputs, tile_shift, column, *, softcap,
                 with_log_p):
  """``d x`` ``[R, TILE]`` f32 (WGMMA layout) of a tile of the fused head's rows held as
  their ``e = exp(z - m_tile)`` terms (``tile_statistics`` with ``with_exp``, rounded to
  16 bits; 0 at excluded columns), ``x`` before the softcap, the tile's first column
  ``column`` and ``tile_shift [R]`` f32 each row's ``(m_tile - m) - log s``::

      p = e exp(tile_shift)                     log p = max(log e + tile_shift, f32 min)
      d x = inv_temp (-p (coef + g_entropy log p) + g_logp [v == label])

  and with a softcap, times ``1 - min((c / softcap)², 1)``: ``c`` the column's logit
  after the softcap, ``(log p + m + log s) / inv_temp`` (the label's own, which its term
  may have underflowed, from ``label_capped``; the bound keeps an underflowed column's
  factor finite, where ``d z`` is 0). Exactly 0 at rows whose ``row_mask`` is 0 (after
  every factor). ``with_log_p``: False when no term needs ``log p`` (no entropy
  cotangent, no softcap), which is then not formed. The 16-bit ``e`` carries ``p`` to
  2⁻⁹ relative and ``log p`` to 2⁻⁹ absolute: the operand dtype's own rounding of
  ``d x``."""
  per_row = lambda v: _per_row(v, e.shape)
  inv_temp, log_norm, coef, g_entropy, g_logp, label_column, label_capped, row_mask = (
      per_row(v) for v in inputs)
  e = e.astype(jnp.float32)
  p = e * per_row(jnp.exp2(tile_shift * LOG2_E))
  dz = -(p * coef)
  if with_log_p:  # (an excluded column: log e = -inf, floored; p log p = 0 there)
    log_p = jnp.maximum(jnp.log2(e) * (1 / LOG2_E) + per_row(tile_shift), FLOOR)
    dz = dz - (p * log_p) * g_entropy
  label = _columns(e.shape, column) == label_column
  dz = jnp.where(label, dz + g_logp, dz)
  dx = dz * inv_temp
  if softcap is not None:
    capped = jnp.where(label, label_capped, (log_p + log_norm) / inv_temp)
    dx = dx * (1 - jnp.minimum(jnp.square(capped / softcap), 1.0))
  return jnp.where(row_mask > 0, dx, 0.0)
