"""Softmax statistics of logits rows ``[T, V_local]`` in one read, as a Pallas Mosaic GPU
kernel (Hopper): the logits path's forward (``logits_rows``), merged by ``mosaic_merge``.

Each CTA (one warpgroup) takes ``CONFIG.rows`` rows and one group of ``tiles_per_group(layout)``
consecutive ``[CONFIG.rows, TILE]`` tiles of columns of one segment (``mosaic_tile.Segments``:
fixed by the vocabulary alone, each tiled from its own first column; where a segment is
not whole tiles its last tile is partial, its columns past the segment's end read as
zeros and masked: several such segments are read as ``[T, segments, width]``,
``columns_view``, so TMA's bounds end each), streamed into shared memory by TMA,
``stages`` tiles ahead (``plgpu.emit_pipeline``). Each tile is folded in registers into
its rows' running statistics, in the columns' order (``mosaic_tile.fold``: an online
softmax).

Kept sets (``keep=``) are read with the tiles: each tile's ``[WORDS, CONFIG.rows]`` block of
the packed words (transposed to a row per word, so a word is a per-row vector, with the
label's bit set on the way: ``mosaic_tile.kept_words``) sets the columns outside the row's kept set
to -inf before the fold.

The group's ``(m, s, q, picked)`` is written to an f32 ``[groups, 4, T]`` array
(``picked``, the label's ``z``, gathered outside, goes to group 0). ``mosaic_merge``
merges the groups in their order. The groups depend on the vocabulary alone, so a row's
numbers depend on its own logits, label and temperature only (not on ``T``, its
neighbours, the program around the call or the shard count): batch-invariant by
construction.

Rows past a multiple of ``CONFIG.rows`` are covered by moving the last row block back inside
the array (its rows overlap the block before and are written twice, with the same
bits). TMA reads rows in tiles of 8: when ``T`` is not a multiple of 8, the kernel reads
the first ``T - T % 8`` rows where they lie and, in a second call, a padded copy of the
last ``T % 8`` (``CONFIG.rows`` rows; below ``CONFIG.rows`` rows, of the whole array). A row of
``V_local`` columns must take a multiple of 32 bytes (TMA tiles the rows as the tiles'
swizzle, ``mosaic_tile.array_swizzle``).
Off GPUs the kernel runs in JAX's GPU interpreter (tests).
"""

from __future__ import annotations

import dataclasses
from functools import partial
from typing import NamedTuple

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from jaxce._kernels import chunking, plumbing
from jaxce._kernels.mosaic import merge as mosaic_merge, tile as mosaic_tile

plgpu = plumbing.lazy_module("jax.experimental.pallas.mosaic_gpu")

TILE, WORDS = mosaic_tile.TILE, mosaic_tile.WORDS  # columns per pipeline step, their words
# Columns an untiled tile's box reads past the tile (``residues``): rows of ``TILE + 8``
# 16-bit columns lie 4 banks apart in shared memory, so the loads into the WGMMA layout
# meet no bank conflict.
UNTILED_PAD = 8


@dataclasses.dataclass(frozen=True, kw_only=True)
class Config:
  """The row statistics kernel's tiling: it reads ``CONFIG`` (tests swap in another with
  ``dataclasses.replace``).

  Attributes:
    rows: rows per CTA (one warpgroup).
    min_tiles_per_group: the fewest tiles a CTA folds (``tiles_per_group``).
    stage_bytes: shared memory of the pipeline's buffers, per CTA.
  """
  rows: int = 64
  min_tiles_per_group: int = 8
  stage_bytes: int = 96 * 2**10


CONFIG = Config()
# The operations whose outputs this kernel makes batch-invariant: those that read whole
# rows of logits (``linear_token_loss``'s rows come from XLA's matmuls).
INVARIANT_OPERATIONS = ("logprobs_and_entropy", "token_loss")


def tiles_per_group(layout: mosaic_tile.Segments) -> int:
  """Tiles of ``TILE`` columns per CTA, all of one segment: at least
  ``CONFIG.min_tiles_per_group``, few enough that the groups of a row fit one ``mosaic_merge``
  stage. A function of the vocabulary's tiling only: a row's groups (and so its bits) do
  not depend on the number of rows or of shards."""
  per_segment = layout.tiles_per_segment
  all_tiles = layout.total * per_segment
  return min(per_segment, max(CONFIG.min_tiles_per_group,
                              -(-all_tiles // mosaic_merge.CONFIG.group)))


class Group(NamedTuple):
  """A CTA's group of tiles: its first tile in the tiles' order (the words' and shifts'
  block too), its count of tiles, its segment and its first tile within the segment."""
  tile: jnp.ndarray
  count: jnp.ndarray
  segment: jnp.ndarray
  first: jnp.ndarray


def num_groups(layout: mosaic_tile.Segments) -> int:
  """The groups of ``layout``'s tiles (``tiles_per_group`` a CTA, each within a segment)."""
  return layout.count * groups_per_segment(layout)


def groups_per_segment(layout: mosaic_tile.Segments) -> int:
  """The groups of one segment's tiles."""
  return -(-layout.tiles_per_segment // tiles_per_group(layout))


def group_at(index, layout: mosaic_tile.Segments) -> Group:
  """The ``index``-th group of tiles of ``layout`` (in the columns' order)."""
  group = tiles_per_group(layout)
  per_segment = groups_per_segment(layout)
  segment = index // per_segment
  first = (index - segment * per_segment) * group
  return Group(tile=segment * layout.tiles_per_segment + first,
               count=jnp.minimum(group, layout.tiles_per_segment - first),
               segment=segment, first=first)


def group_column(group: Group, k, layout: mosaic_tile.Segments):
  """The first column (of this device's) of ``group``'s ``k``-th tile."""
  return group.segment * layout.width + (group.first + k) * TILE


def columns_view(x, layout: mosaic_tile.Segments):
  """``x [rows, V_local]`` as the kernels read and write it: ``[rows, count, width]``
  where ``layout.split`` (TMA's bounds then end each segment's partial last tile), else
  itself (a free reshape)."""
  if not layout.split:
    return x
  return x.reshape(x.shape[0], layout.count, layout.width)


def segment_columns(ref, rows, group: Group, layout: mosaic_tile.Segments):
  """``ref``'s (``columns_view``) ``rows`` of ``group``'s segment: ``[rows, width]``
  where ``layout.split``, else ``[rows, V_local]``; a tile's index in it is
  ``tile_index(group, k, layout)``."""
  return ref.at[rows, group.segment] if layout.split else ref.at[rows]


def tile_index(group: Group, k, layout: mosaic_tile.Segments):
  """The index, in tiles, of ``group``'s ``k``-th tile in ``segment_columns``."""
  return group.first + k if layout.split else group.tile + k


def row_width(layout: mosaic_tile.Segments) -> int:
  """The columns of a row of ``columns_view`` (what TMA tiles)."""
  return layout.width if layout.split else layout.count * layout.width


def residues(layout: mosaic_tile.Segments, dtype) -> int:
  """How many rows of ``[T, V_local]`` the kernels read as one row of a ``[T / R, R *
  V_local]`` view (``residue_view``): 1 where TMA tiles the rows as the tiles' swizzle
  (a row a multiple of 32 bytes, ``mosaic_tile.array_swizzle``), and 1, 2, 4 or 8 for
  the rest (one segment of any width: Qwen's unpadded 151643, GPT-2's 50257), the fewest
  rows that make a multiple of 16 bytes, TMA's stride between rows. Those are read
  untiled: a tile's ``[CONFIG.rows, TILE]`` box starts at any column, its rows
  ``R`` tokens apart; 0 when neither fits (several segments of an unaligned width)."""
  row_bytes = row_width(layout) * jnp.dtype(dtype).itemsize
  if mosaic_tile.array_swizzle(row_width(layout), dtype):
    return 1
  if layout.split:
    return 0
  return next(r for r in (1, 2, 4, 8) if not r * row_bytes % 16)


def residue_view(x, num_residues: int):
  """``x [T, V_local]`` (``T`` a multiple of ``num_residues``) as ``[T / R, R * V_local]``
  (a free reshape): row ``t`` is row ``t // R``'s columns from ``(t % R) * V_local``."""
  return x.reshape(x.shape[0] // num_residues, num_residues * x.shape[1])


def by_residue(a, num_residues: int):
  """``a [..., T]`` -> ``[R, ..., T / R]``: each residue's rows (``residue_view``'s row
  order), in order."""
  a = a.reshape(*a.shape[:-1], a.shape[-1] // num_residues, num_residues)
  return jnp.moveaxis(a, -1, 0)


def tile_specs(group: Group, dtype, has_words, layout: mosaic_tile.Segments, residue=None):
  """The pipeline's ``in_specs`` over ``group``'s tiles of ``segment_columns``: step
  ``k``'s ``[CONFIG.rows, TILE]`` tile of ``dtype`` (a partial one padded with zeros, or,
  read untiled, with the columns that follow) and, with ``has_words``, its ``[WORDS,
  CONFIG.rows]`` block of the transposed kept-set words. ``residue``: None where TMA
  tiles the rows (``tiled``), else the rows' residue in ``residue_view``, whose tiles
  are read untiled from column ``residue * V_local``."""
  if residue is None:
    tile = plgpu.BlockSpec((CONFIG.rows, TILE), lambda k: (0, tile_index(group, k, layout)),
                           transforms=tile_swizzle(dtype, row_width(layout)))
  else:
    tile = plgpu.BlockSpec((CONFIG.rows, pl.Element(TILE + UNTILED_PAD)),
                           lambda k: (0, residue * layout.width + (group.first + k) * TILE))
  specs = [tile]
  if has_words:
    specs.append(plgpu.BlockSpec((WORDS, CONFIG.rows), lambda k: (group.tile + k, 0)))
  return specs


def tiled(layout: mosaic_tile.Segments, dtype) -> bool:
  """Whether TMA reads (and writes) the rows in the tiles' swizzle: a row of
  ``row_width(layout)`` columns a multiple of 32 bytes (else the statistics read them
  untiled, ``residues``)."""
  return bool(mosaic_tile.array_swizzle(row_width(layout), dtype))


def tile_swizzle(dtype, num_columns: int):
  """The shared-memory transforms of a ``[CONFIG.rows, TILE]`` tile of ``dtype`` read from (or
  written to) a ``[rows, num_columns]`` array with TMA (``mosaic_tile.swizzle``, as wide
  as ``num_columns`` allows: ``mosaic_tile.array_swizzle``)."""
  return mosaic_tile.swizzle(TILE, dtype, mosaic_tile.array_swizzle(num_columns, dtype))


def _statistics(x, row_inputs, words, *, layout, masked, with_entropy, stages, interpret):
  """``[groups, R, row blocks, 4, CONFIG.rows]`` f32 group statistics of each block of rows
  of each residue (``residues``: ``R``) of ``x [T, V_local]`` (``T`` a multiple of 8, TMA's
  row tiling, and at least ``R * CONFIG.rows``; each residue's last block moved back
  inside), its columns tiled as ``layout`` says; ``row_inputs [R, row blocks, 3,
  CONFIG.rows]`` f32: each block's rows' (``block_rows`` of ``by_residue``)
  ``mosaic_tile.RowsStatisticsInputs``; ``words``: uint32 ``[R, tiles * WORDS, T / R]``
  kept sets of ``mosaic_tile.kept_words`` (``by_residue``; read with the tiles), or None. Where the last tile is partial (and no limit masks every
  tile), the last group takes a call of its own, the only one that masks its columns:
  a mask in every tile's fold cost 1.27x the time per column (bench/NOTES.md, entry 50).
  The same groups (a function of the width alone), the statistics concatenated (16 bytes
  per row per group); a whole tile's sums may round otherwise than under a mask that
  excludes none of its columns."""
  groups, per_segment = num_groups(layout), groups_per_segment(layout)
  num_residues = row_inputs.shape[0]
  view = (columns_view(x, layout) if tiled(layout, x.dtype) else
          residue_view(x, num_residues))
  call = partial(_group_statistics, view, row_inputs, words,
                 layout=layout, tiled_rows=tiled(layout, x.dtype), with_entropy=with_entropy,
                 stages=stages, interpret=interpret)
  if masked or not layout.partial or per_segment == 1:
    return call(lambda i: i, groups, masked=masked or layout.partial)
  # (each segment's last group in the second call: the i-th of the first call's is group
  # i + its segment)
  whole = call(lambda i: i + i // (per_segment - 1), groups - layout.count, masked=False)
  last = call(lambda i: (i + 1) * per_segment - 1, layout.count, masked=True)
  per = lambda a, n: a.reshape((layout.count, n) + a.shape[1:])
  return jnp.concatenate([per(whole, per_segment - 1), per(last, 1)],
                         axis=1).reshape((groups,) + whole.shape[1:])


def _group_statistics(x, row_inputs, words, group_of, groups, *, layout, tiled_rows, masked,
                      with_entropy, stages, interpret):
  """``_statistics`` of the groups ``group_of(i)``, ``i < groups``, in one kernel call (``x``:
  the ``columns_view``, or with ``tiled_rows`` False the ``residue_view``; ``masked``:
  every tile's fold applies the rows' limit, and a partial last tile's columns past its
  segment's end)."""
  num_rows = x.shape[0]
  num_residues = row_inputs.shape[0]
  row_blocks = -(-num_rows // CONFIG.rows)
  has_words = words is not None

  def kernel(x_gmem, rows_gmem, *refs):
    *words_gmem, out_gmem = refs
    block, local_group = lax.axis_index("rows"), lax.axis_index("groups")
    residue = lax.axis_index("residues")
    group_index = group_of(local_group)
    first_row = jnp.minimum(block * CONFIG.rows, num_rows - CONFIG.rows)
    rows = pl.ds(pl.multiple_of(first_row, 8) if tiled_rows else first_row, CONFIG.rows)
    inputs = mosaic_tile.load(mosaic_tile.RowsStatisticsInputs, rows_gmem.at[residue], block,
                              optimized=False)
    group = group_at(group_index, layout)
    if layout.partial and masked:  # (a partial last tile's columns past the segment are
      # zeros, or read untiled the next row's: masked)
      end = ((group.segment + 1) * layout.width).astype(jnp.float32)
      inputs = inputs._replace(limit=jnp.minimum(inputs.limit, end))

    def body(indices, x_smem, *smem):
      (k,) = indices
      *words_smem, carry = smem
      column = group_column(group, k, layout)
      kept = mosaic_tile.kept_columns(words_smem[0]) if has_words else None
      tile = plgpu.load(x_smem, layout=plgpu.Layout.WGMMA)
      if not tiled_rows:  # (the box's last columns are the next tile's)
        tile = tile[:, :TILE]
      return mosaic_tile.fold(tile, carry, inputs, column, kept, masked=masked,
                              with_entropy=with_entropy)

    zero = jnp.zeros((CONFIG.rows,), jnp.float32)
    init = (jnp.full((CONFIG.rows,), mosaic_tile.FLOOR, jnp.float32), zero, zero)
    specs = tile_specs(group, x.dtype, has_words, layout,
                       residue=None if tiled_rows else residue)
    pipeline = plgpu.emit_pipeline(body, grid=(group.count,), in_specs=specs,
                                   max_concurrent_steps=stages, init_carry=init)
    columns = (segment_columns(x_gmem, rows, group, layout) if tiled_rows else
               x_gmem.at[rows])
    m, s, q = pipeline(columns, *(w.at[residue, :, rows] for w in words_gmem))

    @partial(pl.run_scoped, out_smem=plgpu.SMEM((4, CONFIG.rows), jnp.float32))
    def _store(out_smem):
      none = s * 0.0  # (s >= 0 is finite; a splat of zeros cannot be stored)
      for i, value in enumerate((m, s, q if with_entropy else none, none)):
        out_smem[i] = value

      @pl.when(group_index == 0)
      def _label():
        out_smem[3] = inputs.picked

      plgpu.commit_smem()
      plgpu.copy_smem_to_gmem(out_smem, out_gmem.at[local_group, residue, block])
      plgpu.wait_smem_to_gmem(0)

  return plgpu.kernel(
      kernel,
      out_type=plumbing.shape_dtype_like(
          x, (groups, num_residues, row_blocks, 4, CONFIG.rows), jnp.float32),
      grid=(row_blocks, groups, num_residues),
      grid_names=("rows", "groups", "residues"),
      interpret=plgpu.InterpretGPUParams() if interpret else None,
  )(x, row_inputs, *([words] if has_words else []))


def block_rows(num_rows):
  """``[row blocks, CONFIG.rows]`` int32: the rows of each CTA (the last block moved back inside
  ``num_rows >= CONFIG.rows``)."""
  rows = CONFIG.rows
  starts = jnp.minimum(jnp.arange(-(-num_rows // rows)) * rows, num_rows - rows)
  return starts[:, None] + jnp.arange(rows)[None, :]


def statistics(x, inv_temp, picked, limit, kept=None, label_column=None, *, layout,
               with_entropy, interpret, stages=None):
  """Per-row softmax statistics of ``z = x * inv_temp`` over the columns below ``limit``
  (and in the row's kept set), by groups of columns, for ``mosaic_merge.merge`` to merge
  in the columns' order.

  Args:
    x: ``[T, V_local]`` logits, bf16, f16 or f32; read once (a row a multiple of 32
      bytes, or of any width in one segment: ``residues``).
    inv_temp: ``[T]`` f32.
    picked: ``[T]`` f32: the label's ``z`` (0 when this shard does not own the label),
      carried into group 0.
    limit: int32 scalar: local columns at or beyond it are excluded (padded vocabulary),
      or None.
    kept: uint32 ``[T, ceil(V_local / 32)]``, the rows' kept sets over the local columns
      (bit ``v % 32`` of word ``v // 32``), read with the tiles; or None (every column
      kept).
    label_column: ``[T]`` int, each row's label column relative to ``x``'s first
      (always kept; any value when the label lies elsewhere); with ``kept`` only.
    layout: the tiling of the columns (``mosaic_tile.segments`` of ``V_local`` and the
      shard count).
    with_entropy: compute ``q`` (else zeros).
    interpret: run in JAX's GPU interpreter (off GPUs: tests).
    stages: tiles in flight per CTA (default: ``CONFIG.stage_bytes`` of them).

  Returns:
    ``[groups, 4, T]`` float32 ``(m, s, q, picked)`` per group of
    ``tiles_per_group(layout)`` tiles (``num_groups(layout)``). Memory: that array (16
    bytes per row per group) and its blocked form; with ``kept``, its
    ``mosaic_tile.kept_words`` copy (``T * V_local / 8`` bytes). TMA reads rows in tiles
    of 8: when ``T`` is not a multiple of 8, the kernel reads the first ``T - T % 8`` rows
    (XLA's slice) and then a padded copy of the last ``T % 8`` (``CONFIG.rows`` rows). Rows
    read untiled (``residues``: ``R`` > 1) go in parts of ``T - T % 8R`` and ``T % 8R``,
    the last padded to ``R * CONFIG.rows`` rows; below that many, a padded copy of ``x``.
  """
  num_rows, num_columns = x.shape
  if num_columns != layout.count * layout.width or not residues(layout, x.dtype):
    raise ValueError(f"{num_columns} columns: the layout's ({layout}), a row a multiple of "
                     "32 bytes or one segment expected")
  if kept is not None and kept.shape != (num_rows, -(-num_columns // 32)):
    raise ValueError(f"kept: {kept.shape}, ({num_rows}, {-(-num_columns // 32)}) expected")
  if stages is None:
    stages = max(2, CONFIG.stage_bytes // (CONFIG.rows * TILE * jnp.dtype(x.dtype).itemsize))
  bound = jnp.float32(num_columns) if limit is None else jnp.asarray(limit, jnp.float32)
  part = partial(_part_statistics, layout=layout, bound=bound, masked=limit is not None,
                 with_entropy=with_entropy, stages=stages, interpret=interpret)
  whole = 8 * residues(layout, x.dtype)  # (TMA's row tiles; the words' rows, 32 bytes)
  aligned = num_rows // whole * whole
  if aligned == num_rows or aligned < whole * CONFIG.rows // 8:
    return part(x, inv_temp, picked, kept, label_column)
  # (Each row's numbers depend on its own inputs alone: the same bits in either part.)
  rows = lambda v, start, stop: None if v is None else v[start:stop]
  return jnp.concatenate(
      [part(*(rows(v, start, stop) for v in (x, inv_temp, picked, kept, label_column)))
       for start, stop in ((0, aligned), (aligned, num_rows))], axis=2)


def _part_statistics(x, inv_temp, picked, kept, label_column, *, layout, bound, masked,
                     with_entropy, stages, interpret):
  """``statistics`` of rows ``x [T, V_local]`` in one kernel call: a padded copy of ``x``
  (and of the rows' inputs) when ``T`` is not a multiple of 8 or is below ``R *
  CONFIG.rows`` (``residues``); ``bound`` is the limit as f32."""
  num_rows = x.shape[0]
  num_residues = residues(layout, x.dtype)
  # (TMA reads rows in tiles of 8, and each residue's kept words in rows of 32 bytes; each
  # residue's rows at least a block)
  whole = 8 * num_residues
  padded = max(-(-num_rows // whole) * whole, num_residues * CONFIG.rows)
  x = chunking.pad_rows(x, padded)  # (a copy when padded)
  if kept is not None:
    kept = by_residue(mosaic_tile.segment_kept_words(kept, label_column, padded, layout),
                      num_residues)
  pad = lambda v, fill: chunking.pad_rows(v.astype(jnp.float32), padded, fill)
  row_inputs = mosaic_tile.stack(mosaic_tile.RowsStatisticsInputs(
      inv_temp=pad(inv_temp, 1.0), picked=pad(picked, 0.0),
      limit=jnp.broadcast_to(bound, (padded,))))
  per_residue = padded // num_residues
  row_inputs = by_residue(row_inputs, num_residues)[:, :, block_rows(per_residue)]
  row_inputs = row_inputs.transpose(0, 2, 1, 3)  # [R, row blocks, 3, CONFIG.rows]
  tiles = _statistics(x, row_inputs, kept, layout=layout, masked=masked,
                      with_entropy=with_entropy, stages=stages, interpret=interpret)
  num_groups, _, row_blocks = tiles.shape[:3]
  tiles = tiles.transpose(0, 3, 1, 2, 4)  # [groups, 4, R, row blocks, CONFIG.rows]
  whole = tiles[:, :, :, :-1].reshape(num_groups, 4, num_residues,
                                      (row_blocks - 1) * CONFIG.rows)
  last = tiles[:, :, :, -1, (row_blocks - 1) * CONFIG.rows - (per_residue - CONFIG.rows):]
  tiles = jnp.concatenate([whole, last], axis=3)  # [groups, 4, R, T / R]
  return jnp.swapaxes(tiles, 2, 3).reshape(num_groups, 4, padded)[:, :, :num_rows]


def unsupported(*, operation, platform, capability, dtypes, num_columns,
                batch_invariant=False) -> str | None:
  """Why the kernel cannot run the row statistics of a call of ``operation`` (a public
  function's name; a sentence), or None when it can.

  Args:
    platform, capability: the call's platform and its GPUs' compute capability.
    dtypes: the operands' dtypes, the rows' last (for ``linear_token_loss``, float32).
    num_columns: this device's ``V_local``.
    batch_invariant: ``batch_invariant=True``.
  """
  platform_reason = plumbing.mosaic_gpu_unsupported(plgpu, platform, capability)
  if platform_reason:
    return platform_reason
  if batch_invariant and operation not in INVARIANT_OPERATIONS:
    return ("batch_invariant=True: this path's logits come from XLA's matmuls, whose "
            "rounding depends on the program; XLA's exact sums hold the option")
  if any(jnp.dtype(d) == jnp.float64 for d in dtypes):
    return "it computes in float32 and the inputs are float64"
  if jnp.dtype(dtypes[-1]) not in (jnp.bfloat16, jnp.float16, jnp.float32):
    return f"it reads bfloat16, float16 or float32 logits, got {jnp.dtype(dtypes[-1])}"
  return None
