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
last ``T % 8`` (``CONFIG.rows`` rows; below ``CONFIG.rows`` rows, of the whole array). TMA
tiles a row of ``V_local`` columns as the tiles' swizzle (``mosaic_tile.array_swizzle``),
so it streams rows of a multiple of 32 bytes; other rows (one segment of at least
``TILE`` columns: an odd width) the kernel loads itself, a column a load, the last tile
from the row's last ``TILE`` columns (``direct_columns``).
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


def tile_specs(group: Group, dtype, has_words, layout: mosaic_tile.Segments):
  """The pipeline's ``in_specs`` over ``group``'s tiles of ``segment_columns``: step
  ``k``'s ``[CONFIG.rows, TILE]`` tile of ``dtype`` (a partial one padded with zeros;
  none where the rows are not ``tiled``: the kernel loads them itself) and, with
  ``has_words``, its ``[WORDS, CONFIG.rows]`` block of the transposed kept-set words."""
  specs = []
  if tiled(layout, dtype):
    specs.append(plgpu.BlockSpec((CONFIG.rows, TILE),
                                 lambda k: (0, tile_index(group, k, layout)),
                                 transforms=tile_swizzle(dtype, row_width(layout))))
  if has_words:
    specs.append(plgpu.BlockSpec((WORDS, CONFIG.rows), lambda k: (group.tile + k, 0)))
  return specs


def tiled(layout: mosaic_tile.Segments, dtype) -> bool:
  """Whether TMA reads (and writes) the rows in the tiles' swizzle: a row of
  ``row_width(layout)`` columns a multiple of 32 bytes. Other rows (one segment of any
  width: Qwen's unpadded 151643, GPT-2's 50257; TMA reads only from 16-byte aligned
  addresses, and such rows start anywhere) the statistics kernel loads from device
  memory itself (``direct_columns``), a column a load."""
  return bool(mosaic_tile.array_swizzle(row_width(layout), dtype))


def tile_swizzle(dtype, num_columns: int):
  """The shared-memory transforms of a ``[CONFIG.rows, TILE]`` tile of ``dtype`` read from (or
  written to) a ``[rows, num_columns]`` array with TMA (``mosaic_tile.swizzle``, as wide
  as ``num_columns`` allows: ``mosaic_tile.array_swizzle``)."""
  return mosaic_tile.swizzle(TILE, dtype, mosaic_tile.array_swizzle(num_columns, dtype))


def direct_layout():
  """The registers of a tile the kernel loads itself (``direct_columns``): WGMMA's, a
  column a register (2-byte loads at any address; WGMMA's own layout loads two columns
  at once, 4 bytes that odd rows do not align)."""
  return plgpu.Layout._WGMMA_ACC_32BIT  # pylint: disable=protected-access


def direct_columns(x_gmem, rows, group: Group, k, layout: mosaic_tile.Segments):
  """``(tile, column, first)``: ``group``'s ``k``-th tile of ``x_gmem``'s ``rows`` (``[T,
  V_local]`` in device memory, one segment), loaded a column a load (any alignment) into
  ``direct_layout()``'s registers; ``column``, the first column it holds, and ``first``,
  its first column not in an earlier tile. A partial last tile is loaded as the row's
  last ``TILE`` columns (``column = V_local - TILE``), the columns before ``first``
  masked: the loads stay in the row, and the columns land where they do for every token
  (a function of the width alone), so a token's sums round alike in every row."""
  first = (group.first + k) * TILE
  column = first
  if layout.partial:
    column = jnp.where(group.first + k == layout.tiles_per_segment - 1, layout.width - TILE,
                       first)
  tile = plgpu.load(x_gmem.at[rows, pl.ds(column, TILE)], layout=direct_layout(),
                    optimized=False)  # (2-byte loads: no "optimized" plan takes them)
  return tile, column, first


def _statistics(x, row_inputs, words, *, layout, masked, with_entropy, stages, interpret):
  """``[groups, row blocks, 4, CONFIG.rows]`` f32 group statistics of each block of rows of ``x
  [T, V_local]`` (``T >= CONFIG.rows``, a multiple of 8: TMA's row tiling; the last block moved
  back inside), its columns tiled as ``layout`` says; ``row_inputs [row blocks, 3,
  CONFIG.rows]`` f32: each block's rows' (``block_rows``) ``mosaic_tile.RowsStatisticsInputs``;
  ``words``: uint32 ``[tiles * WORDS, T]`` kept sets of ``mosaic_tile.kept_words`` (read
  with the tiles), or None. Where the last tile is partial (and no limit masks every
  tile), the last group takes a call of its own, the only one that masks its columns:
  a mask in every tile's fold cost 1.27x the time per column (bench/NOTES.md, entry 50).
  The same groups (a function of the width alone), the statistics concatenated (16 bytes
  per row per group); a whole tile's sums may round otherwise than under a mask that
  excludes none of its columns."""
  groups, per_segment = num_groups(layout), groups_per_segment(layout)
  call = partial(_group_statistics, columns_view(x, layout), row_inputs, words,
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
  the ``columns_view``; ``masked``: every tile's fold applies the rows' limit, and a
  partial last tile's columns past its segment's end; ``tiled_rows``: TMA streams the
  tiles in, else the kernel loads them, ``direct_columns``)."""
  num_rows = x.shape[0]
  row_blocks = -(-num_rows // CONFIG.rows)
  has_words = words is not None

  def kernel(x_gmem, rows_gmem, *refs):
    *words_gmem, out_gmem = refs
    block, local_group = lax.axis_index("rows"), lax.axis_index("groups")
    group_index = group_of(local_group)
    first_row = pl.multiple_of(jnp.minimum(block * CONFIG.rows, num_rows - CONFIG.rows), 8)
    rows = pl.ds(first_row, CONFIG.rows)
    inputs = mosaic_tile.load(mosaic_tile.RowsStatisticsInputs, rows_gmem, block,
                              optimized=False)
    group = group_at(group_index, layout)
    if layout.partial and masked:  # (a partial last tile's columns past the segment read zeros)
      end = ((group.segment + 1) * layout.width).astype(jnp.float32)
      inputs = inputs._replace(limit=jnp.minimum(inputs.limit, end))

    def fold(k, x_tile, words_smem, carry):
      column, first, tile_layout = group_column(group, k, layout), None, None
      if x_tile is None:  # (loaded here: a partial last tile ends at the row's end)
        x_tile, column, first = direct_columns(x_gmem, rows, group, k, layout)
        tile_layout = direct_layout()
      kept = mosaic_tile.kept_columns(words_smem, tile_layout) if has_words else None
      return mosaic_tile.fold(x_tile, carry, inputs, column, kept, masked=masked,
                              with_entropy=with_entropy, first=first if masked else None,
                              layout=tile_layout)

    def body(indices, *smem):
      (k,) = indices
      *smem, carry = smem
      x_tile = plgpu.load(smem.pop(0), layout=plgpu.Layout.WGMMA) if tiled_rows else None
      return fold(k, x_tile, smem[0] if has_words else None, carry)

    zero = jnp.zeros((CONFIG.rows,), jnp.float32)
    init = (jnp.full((CONFIG.rows,), mosaic_tile.FLOOR, jnp.float32), zero, zero)
    streams = ((segment_columns(x_gmem, rows, group, layout),) if tiled_rows else ()) + tuple(
        w.at[:, rows] for w in words_gmem)
    if streams:
      pipeline = plgpu.emit_pipeline(body, grid=(group.count,),
                                     in_specs=tile_specs(group, x.dtype, has_words, layout),
                                     max_concurrent_steps=stages, init_carry=init)
      m, s, q = pipeline(*streams)
    else:
      m, s, q = lax.fori_loop(0, group.count, lambda k, c: fold(k, None, None, c), init)

    @partial(pl.run_scoped, out_smem=plgpu.SMEM((4, CONFIG.rows), jnp.float32))
    def _store(out_smem):
      none = s * 0.0  # (s >= 0 is finite; a splat of zeros cannot be stored)
      for i, value in enumerate((m, s, q if with_entropy else none, none)):
        out_smem[i] = value

      @pl.when(group_index == 0)
      def _label():
        out_smem[3] = inputs.picked

      plgpu.commit_smem()
      plgpu.copy_smem_to_gmem(out_smem, out_gmem.at[local_group, block])
      plgpu.wait_smem_to_gmem(0)

  return plgpu.kernel(
      kernel,
      out_type=plumbing.shape_dtype_like(x, (groups, row_blocks, 4, CONFIG.rows), jnp.float32),
      grid=(row_blocks, groups),
      grid_names=("rows", "groups"),
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
    x: ``[T, V_local]`` logits, bf16, f16 or f32, a row a multiple of 32 bytes (TMA
      streams the tiles in) or at least ``TILE`` columns in one segment (the kernel
      loads them, ``direct_columns``: any width); read once.
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
    (XLA's slice) and then a padded copy of the last ``T % 8`` (``CONFIG.rows`` rows); below
    ``CONFIG.rows`` rows, a padded copy of ``x``.
  """
  num_rows, num_columns = x.shape
  if num_columns != layout.count * layout.width or not (
      tiled(layout, x.dtype) or (layout.count == 1 and num_columns >= TILE)):
    raise ValueError(f"{num_columns} columns: the layout's ({layout}), a row a multiple of "
                     f"32 bytes or one segment of at least {TILE} columns expected")
  if kept is not None and kept.shape != (num_rows, -(-num_columns // 32)):
    raise ValueError(f"kept: {kept.shape}, ({num_rows}, {-(-num_columns // 32)}) expected")
  if stages is None:
    stages = max(2, CONFIG.stage_bytes // (CONFIG.rows * TILE * jnp.dtype(x.dtype).itemsize))
  bound = jnp.float32(num_columns) if limit is None else jnp.asarray(limit, jnp.float32)
  part = partial(_part_statistics, layout=layout, bound=bound, masked=limit is not None,
                 with_entropy=with_entropy, stages=stages, interpret=interpret)
  aligned = num_rows // 8 * 8
  if aligned == num_rows or aligned < CONFIG.rows:
    return part(x, inv_temp, picked, kept, label_column)
  # (Each row's numbers depend on its own inputs alone: the same bits in either part.)
  rows = lambda v, start, stop: None if v is None else v[start:stop]
  return jnp.concatenate(
      [part(*(rows(v, start, stop) for v in (x, inv_temp, picked, kept, label_column)))
       for start, stop in ((0, aligned), (aligned, num_rows))], axis=2)


def _part_statistics(x, inv_temp, picked, kept, label_column, *, layout, bound, masked,
                     with_entropy, stages, interpret):
  """``statistics`` of rows ``x [T, V_local]`` in one kernel call: a padded copy of ``x``
  (and of the rows' inputs) when ``T`` is not a multiple of 8 or is below ``CONFIG.rows``;
  ``bound`` is the limit as f32."""
  num_rows = x.shape[0]
  padded = max(-(-num_rows // 8) * 8, CONFIG.rows)  # (TMA reads rows in tiles of 8)
  x = chunking.pad_rows(x, padded)  # (a copy when padded)
  if kept is not None:
    kept = (mosaic_tile.segment_kept_words(kept, label_column, padded, layout)
            if tiled(layout, x.dtype) else
            mosaic_tile.row_end_kept_words(kept, label_column, padded, layout.width))
  pad = lambda v, fill: chunking.pad_rows(v.astype(jnp.float32), padded, fill)
  row_inputs = mosaic_tile.stack(mosaic_tile.RowsStatisticsInputs(
      inv_temp=pad(inv_temp, 1.0), picked=pad(picked, 0.0),
      limit=jnp.broadcast_to(bound, (padded,))))
  row_inputs = row_inputs[:, block_rows(padded)].transpose(1, 0, 2)
  tiles = _statistics(x, row_inputs, kept, layout=layout, masked=masked,
                      with_entropy=with_entropy, stages=stages, interpret=interpret)
  num_groups, row_blocks = tiles.shape[:2]
  tiles = tiles.transpose(0, 2, 1, 3)  # [groups, 4, row blocks, CONFIG.rows]
  whole = tiles[:, :, :-1].reshape(num_groups, 4, (row_blocks - 1) * CONFIG.rows)
  last = tiles[:, :, -1, (row_blocks - 1) * CONFIG.rows - (padded - CONFIG.rows):]
  return jnp.concatenate([whole, last], axis=2)[:, :, :num_rows]


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
  if num_columns < TILE and num_columns * jnp.dtype(dtypes[-1]).itemsize % 32:
    return (f"the vocabulary (per device) is {num_columns} columns: below {TILE} a row "
            "must be a multiple of 32 bytes (TMA's rows)")
  return None
