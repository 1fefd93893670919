"""The fused LM-head path's tiles as a Pallas Mosaic GPU kernel (sm90), with two epilogues:
the forward's softmax statistics (``statistics``; for the fused objective path, with the
``exp(z - m)`` terms they were formed from) and the backward's ``d logits``
(``logits_grad``).

``hidden @ weight`` is computed tile by tile on the tensor cores (wgmma, bf16/f16
operands, f32 accumulation) and each ``[256, 128]`` tile is finished in registers before
the next one starts: the forward folds it into its rows' softmax statistics, so the
logits never reach device memory; the backward forms its ``d logits`` from the saved
statistics and writes them once, in the operand dtype. Layout of one CTA (three
warpgroups):

* a memory warpgroup streams ``[256, 64]`` hidden and ``[64, 128]`` weight blocks into
  shared memory with TMA, ``CONFIG.stages`` steps ahead (``emit_pipeline_warp_specialized``);
* two compute warpgroups, 128 rows each, accumulate the tile over the hidden dim, then
  (forward epilogue) apply the softcap and the per-row temperature, mask columns outside
  ``[tile start, limit)`` (none without a limit: no padded vocabulary), and
  reduce the tile to per-row ``(m, s, q, picked)``: its max,
  ``Σ exp(z - m)``, ``Σ exp(z - m)(z - m)`` and the label's ``z`` (0 when the label is
  not in the tile), with the tile's ``exp(z - m)`` terms stored too, in the operand
  dtype, when the caller keeps them (the fused objective path's rows, from which it
  forms ``d logits`` once the rows' statistics are merged: its per-token outputs are
  then the per-token path's bits); or (backward epilogue) ``softmax.logit_grad`` and
  the softcap's and temperature's factors. Tiles go out through shared memory with TMA,
  in pieces 128 bytes wide, two slots a warpgroup (``_store_pieces``). With kept sets, each
  warpgroup's ``[4, 128]`` block of the transposed words comes in by TMA beside its row
  inputs (the label's bit set in XLA: ``mosaic_tile.kept_words``), and columns outside a
  row's kept set are masked too (``mosaic_tile.kept_columns``).

The grid is persistent (one CTA per SM) over (row blocks × vocab tiles), walked in
``planar_snake`` order 8 row blocks wide, so that the CTAs running together share 8
hidden blocks and a few weight tiles through L2. Each tile writes its 4 statistics to
an f32 ``[vocab tiles, 4, C]`` array, which ``mosaic_merge`` merges over the tiles in
the columns' order: 16 bytes per row per 128 columns (about 0.5% of the logits' bytes in
bf16, written and read once).

Any ``C >= 256`` rows that is a multiple of 8 (TMA reads rows in tiles of 8; callers pad
other counts, ``padded_rows``) is covered by ``ceil(C / 256)`` row blocks, the last one
moved back inside the array: a ragged ``C`` costs the rows of its last block, never a
chunk done twice. The rows two blocks share get the same numbers from both (a row's
results depend on its own inputs alone) and are written twice, with the same bits.
``V_local`` is any width. Where it is not a multiple of 128 (a vocabulary split over
shards that are not whole tiles: Qwen3's 151936 columns over 4 devices give 37984; an
unpadded vocabulary, 151643), the last tile is partial: it reads zeros past the array's
end (TMA's bounds) or zeros the caller padded it with, its statistics mask those columns
(that tile alone: the others keep the epilogue without masks) and its stores past the end
are dropped. No column is read from another shard, computed twice or written twice. TMA
tiles the arrays whose rows are the vocabulary as the tiles' swizzle (a row a multiple
of 32 to 128 bytes, ``mosaic_tile.array_swizzle``; a narrower swizzle costs 1.43x the
forward's time per column, bench/NOTES.md entry 43) and a ``[V_local, D]`` weight in
tiles of 8 rows. So the forward (``statistics``) reads a weight whose last tile is
partial in more than one call: its whole tiles, in place where TMA reads it at the
128-byte swizzle (a lone segment: 31040 columns) and else in vocab blocks copied out
(``column_blocks``: at most ``CONFIG.block_bytes`` each, sized to fill the persistent
grid's waves; 37984, 151643 columns), then the columns left copied out and zero-padded to
whole tiles: the same tiles, statistics and bits as one call over the whole array, and no
tile of a call runs the masked epilogue for a partial tile's sake (entry 49). Each call
writes its statistics in place into one array (a ``jax.Ref``) from its first tile on:
nothing is concatenated after them. The objective path's forward reads the
weight the same way, each call writing its ``exp`` terms in place into one ``[C,
V_local]`` array from the call's first column on; at an odd width, whose rows TMA cannot
write, ``[C, exp_width(V_local)]`` (the next multiple of 128 bytes), the padding's terms
zeros. The backward's vocab blocks are copies already (``linear``); a ragged last one is
zero-padded to whole tiles the same way.

Over a vocabulary cut into segments that are not whole tiles (``mosaic_tile.segments``:
Qwen3's 151936 columns are 8 segments of 18992, a shard of 2 or 4 devices holds 4 or 2),
the forward tiles each segment from its own first column, as a weight of that segment's
columns alone (``_segment_statistics``: every segment's whole tiles side by side in vocab
blocks copied out, a block's tiles from one segment or two; the segments' columns left in
one call, not a call a segment), so a token's tiles and bits do not depend on the shard
count; the backward's ``d logits`` do not depend on the tiles.

Off GPUs the kernel runs in Pallas' GPU interpreter (tests only).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from jaxce._kernels import head, plumbing
from jaxce._kernels.mosaic import tile as mosaic_tile

plgpu = plumbing.lazy_module("jax.experimental.pallas.mosaic_gpu")

TILE_N = mosaic_tile.TILE  # vocabulary columns per tile (the grid the statistics merge on)
ROW_TILE = 8  # TMA reads rows in tiles of 8: a call's rows are a multiple of it
# The operations whose outputs these kernels make batch-invariant (all they run: fixed
# tiles, no split-K, tiles merged in the columns' order by ``mosaic_merge``).
INVARIANT_OPERATIONS = ("linear_logprobs_and_entropy", "linear_token_loss")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Config:
  """The head kernels' tiling and buffers: the kernels read ``CONFIG`` (tests swap in
  another with ``dataclasses.replace``).

  Attributes:
    tile_m: rows per compute warpgroup; a CTA holds two.
    tile_k: hidden dims per pipeline step.
    stages: the forward's pipeline depth: 4 x 48 KiB of shared memory.
    grad_stages: the backward's: 3 x 48 KiB, next to the ``d logits`` pieces being stored.
    exp_stages: the forward that also stores its ``exp(z - m)`` terms.
    piece_bytes: a tile goes out in pieces of its rows x this many bytes (16 KiB).
    snake_width: row blocks walked together (L2 reuse of the hidden blocks).
    block_bytes: the most bytes of weight one of the forward's vocab blocks copies out
      (a weight TMA cannot read in place: ``column_blocks``).
    min_block_tiles: fewer whole tiles than this: no block, one padded copy of the
      whole weight.
    call_waves: what ``column_blocks`` counts a kernel call as, in waves of tiles on
      every SM, against the SMs a call's last wave leaves idle (its launch and the first
      tiles' pipeline fill; a wave is about 50 us at D = 4096 on an H200).
  """
  tile_m: int = 128
  tile_k: int = 64
  stages: int = 4
  grad_stages: int = 3
  exp_stages: int = 3
  piece_bytes: int = 128
  snake_width: int = 8
  block_bytes: int = 96 * 2**20
  min_block_tiles: int = 8
  call_waves: float = 0.25

  @property
  def min_rows(self) -> int:
    """Rows per CTA: the least a call takes (fewer are padded)."""
    return 2 * self.tile_m


CONFIG = Config()


def unsupported(*, platform, capability, hidden_dtype, weight_dtype, has_bias, depth,
                num_columns) -> str | None:
  """Why the kernels cannot run a fused call (a sentence), or None when they can.

  Args:
    platform, capability: the call's platform and its GPUs' compute capability.
    hidden_dtype, weight_dtype, has_bias: the operands.
    depth, num_columns: ``D`` and this device's ``V_local``, any width, with the
      ``exp(z - m)`` terms or without (the objective path's terms take ``exp_width``
      columns). Any number of tokens runs too: the caller pads it to ``padded_rows``.
  """
  platform_reason = plumbing.mosaic_gpu_unsupported(plgpu, platform, capability)
  if platform_reason:
    return platform_reason
  if hidden_dtype != weight_dtype or hidden_dtype not in (jnp.bfloat16, jnp.float16):
    return (f"hidden and weight must share a 16-bit float dtype, got {hidden_dtype} and "
            f"{weight_dtype}")
  if has_bias:
    return "a bias is not supported"
  if depth % CONFIG.tile_k:
    return f"the hidden dim must be a multiple of {CONFIG.tile_k}, got {depth}"
  return None


def exp_width(num_columns: int, dtype) -> int:
  """The columns of the ``exp(z - m)`` terms ``statistics(with_exp=True)`` returns for a
  weight of ``num_columns`` columns: ``num_columns`` where TMA can write rows of that
  many (a multiple of ``mosaic_tile.MIN_ALIGN``, 32 bytes in a 16-bit dtype), else the
  next multiple of a 128-byte row (an odd width: 151643 -> 151680), the columns past
  ``num_columns`` holding zeros (the objective path's matmuls read them against a weight
  zero-padded as wide)."""
  if not num_columns % mosaic_tile.MIN_ALIGN:
    return num_columns
  row = 128 // jnp.dtype(dtype).itemsize
  return -(-num_columns // row) * row


def padded_rows(num_rows: int) -> int:
  """The rows a call of ``num_rows`` tokens runs the kernels on: ``num_rows`` rounded up
  to a multiple of ``ROW_TILE``, at least ``CONFIG.min_rows`` (the caller pads with ignored
  rows)."""
  return max(-(-num_rows // ROW_TILE) * ROW_TILE, CONFIG.min_rows)


def num_tiles(num_columns: int) -> int:
  """The ``[rows, TILE_N]`` tiles of ``num_columns`` columns, the last one partial when
  ``TILE_N`` does not divide them."""
  return -(-num_columns // TILE_N)


def row_blocks(num_rows: int) -> int:
  """The CTA row blocks of a kernel call on ``num_rows`` rows (``CONFIG.min_rows`` each, the last
  moved back inside): ``row_blocks(C) * CONFIG.min_rows`` rows of matmul work."""
  return -(-num_rows // CONFIG.min_rows)


def _tiles(hidden, weight, row_inputs, words, *, inputs_type, vocab_dim, stages, finish,
           out_type, scratch, interpret, num_cores, tiles=None, operands=()):
  """The kernel skeleton: every ``[CONFIG.tile_m, TILE_N]`` tile of ``hidden @ weight`` (f32
  accumulation) handed to ``finish`` in registers, which writes what it makes of it.

  ``hidden [C, D]``, ``weight [D, V]`` (``vocab_dim`` 1) or ``[V, D]`` (0), 16-bit, in
  ``ceil(V / TILE_N)`` tiles (a partial last tile reads zeros past ``V``, and its stores
  past ``V`` are dropped);
  ``row_inputs [R, C]`` f32: the rows' record of ``inputs_type`` (``mosaic_tile.stack``),
  handed to ``finish`` as that record of ``[CONFIG.tile_m]`` vectors; ``words``: uint32 ``[tiles
  * WORDS, C]`` kept sets, a row per word (``mosaic_tile.kept_words``), or None.
  ``finish(x, inputs, column, kept, scratch, outs, n_idx, row_slice)`` (``column``: the
  tile's first column; ``kept``: its kept
  columns, ``mosaic_tile.kept_columns``, or None) writes into ``outs``, the outputs (of the tuple
  of types ``out_type``), directly or with TMA through ``scratch``, this warpgroup's part
  of a shared-memory buffer of type ``scratch`` (leading dim 2; or a dict of them, handed
  on as a dict), once the warpgroup's last copy has read it (``_copy_out``,
  ``_store_pieces``). ``interpret``: run in JAX's GPU interpreter;
  ``num_cores``: the persistent grid's size (one CTA per SM); ``tiles``: the tiles visited,
  the first ones (default: all); ``operands``: more of the kernel's operands (a
  ``jax.Ref`` it writes in place, an int32 array it reads as scalars), handed to
  ``finish`` after the outputs in ``outs``.
  """
  num_rows, depth = hidden.shape
  num_columns = weight.shape[vocab_dim]
  cta_rows = CONFIG.min_rows
  # (TMA reads and writes rows of whole swizzles: a [D, V] weight's, a [C, V] output's)
  strided = vocab_dim or any(len(t.shape) == 2 for t in out_type)
  if num_rows < cta_rows or num_rows % ROW_TILE or (strided and
                                                     num_columns % mosaic_tile.MIN_ALIGN):
    raise ValueError(f"{num_rows} rows, {num_columns} columns: at least {cta_rows} rows, a "
                     f"multiple of {ROW_TILE}, and a multiple of {mosaic_tile.MIN_ALIGN} "
                     "columns expected")
  m_iters, n_iters = row_blocks(num_rows), tiles or num_tiles(num_columns)
  k_iters = depth // CONFIG.tile_k
  stages = min(stages, k_iters)
  num_row_inputs = row_inputs.shape[0]
  has_words = words is not None
  words_per_tile = TILE_N // 32
  # (hidden and weight blocks share wgmma's swizzle: a [D, V] weight's, as V allows)
  transforms = mosaic_tile.swizzle(
      CONFIG.tile_k, hidden.dtype,
      mosaic_tile.array_swizzle(num_columns, hidden.dtype) if vocab_dim else 128)
  if vocab_dim:
    weight_spec = plgpu.BlockSpec((CONFIG.tile_k, TILE_N), lambda k: (k, 0), transforms=transforms,
                                  memory_space=plgpu.SMEM)
  else:
    weight_spec = plgpu.BlockSpec((TILE_N, CONFIG.tile_k), lambda k: (0, k), transforms=transforms,
                                  memory_space=plgpu.SMEM)

  def get_pipeline(body, compute_context):
    return plgpu.emit_pipeline_warp_specialized(
        body,
        grid=(k_iters,),
        memory_registers=40,
        in_specs=[plgpu.BlockSpec((cta_rows, CONFIG.tile_k), lambda k: (0, k),
                                  transforms=transforms, memory_space=plgpu.SMEM),
                  weight_spec],
        wg_axis="wg",
        num_compute_wgs=2,
        max_concurrent_steps=stages,
        compute_context=compute_context,
    )

  def kernel(hidden_gmem, weight_gmem, rows_gmem, *refs):
    words_gmem, refs = refs[:has_words], refs[has_words:]
    operand_gmems, out_gmems = refs[:len(operands)], refs[len(operands):]
    ignore = lambda *_, **__: None
    words_scratch = dict(
        words_smem=plgpu.SMEM((2, words_per_tile, CONFIG.tile_m), jnp.uint32),
        words_barrier=plgpu.Barrier(num_barriers=2)) if has_words else {}

    @functools.partial(
        pl.run_scoped,
        allocations=get_pipeline(ignore, ignore).get_allocations(hidden_gmem, weight_gmem),
        rows_smem=plgpu.SMEM((2, num_row_inputs, CONFIG.tile_m), jnp.float32),
        out_smem=scratch,
        rows_barrier=plgpu.Barrier(num_barriers=2),
        collective_axes="wg",
        **words_scratch,
    )
    def _scope(allocations, rows_smem, out_smem, rows_barrier, words_smem=None,
               words_barrier=None):
      wg = lax.axis_index("wg")

      @plgpu.nd_loop((m_iters * n_iters,), collective_axes="sm")
      def _tile_loop(loop_info):
        (index,) = loop_info.index
        m_idx, n_idx = plgpu.planar_snake(index, (m_iters, n_iters), 0, CONFIG.snake_width)
        # (the last row block moved back inside the array: its rows shared with the block
        # before get the same numbers from both)
        cta_row = pl.multiple_of(jnp.minimum(m_idx * cta_rows, num_rows - cta_rows), ROW_TILE)
        column = pl.multiple_of(n_idx * TILE_N, TILE_N)
        wg_row = pl.multiple_of(wg * CONFIG.tile_m, CONFIG.tile_m)
        row_slice = pl.ds(pl.multiple_of(cta_row + wg_row, ROW_TILE), CONFIG.tile_m)

        def compute_context(eval_pipeline):
          plgpu.copy_gmem_to_smem(rows_gmem.at[:, row_slice], rows_smem.at[wg],
                                  rows_barrier.at[wg])
          if has_words:
            tile_words = pl.ds(pl.multiple_of(n_idx * words_per_tile, words_per_tile),
                               words_per_tile)
            plgpu.copy_gmem_to_smem(words_gmem[0].at[tile_words, row_slice],
                                    words_smem.at[wg], words_barrier.at[wg])

          @functools.partial(pl.run_scoped, acc_ref=plgpu.ACC((CONFIG.tile_m, TILE_N), jnp.float32))
          def _acc_scope(acc_ref):
            eval_pipeline(acc_ref)
            x = acc_ref[...]
            plgpu.barrier_wait(rows_barrier.at[wg])
            inputs = mosaic_tile.load(inputs_type, rows_smem, wg)
            kept = None
            if has_words:
              plgpu.barrier_wait(words_barrier.at[wg])
              kept = mosaic_tile.kept_columns(words_smem.at[wg])
            wg_smem = ({name: ref.at[wg] for name, ref in out_smem.items()}
                       if isinstance(out_smem, dict) else out_smem.at[wg])
            finish(x, inputs, column, kept, wg_smem, (*out_gmems, *operand_gmems), n_idx,
                   row_slice)

        def mma_body(_, hidden_smem, weight_smem, acc_ref):
          rhs = weight_smem if vocab_dim else weight_smem.transpose((1, 0))
          plgpu.wgmma(acc_ref, hidden_smem.at[pl.ds(wg_row, CONFIG.tile_m)], rhs)
          plgpu.wgmma_wait(0)
          return acc_ref

        if vocab_dim:
          weight_cols = weight_gmem.at[:, pl.ds(column, TILE_N)]
        else:
          weight_cols = weight_gmem.at[pl.ds(column, TILE_N), :]
        get_pipeline(mma_body, compute_context)(
            hidden_gmem.at[pl.ds(cta_row, cta_rows), :], weight_cols, allocations=allocations)

      plgpu.wait_smem_to_gmem(0, wait_read_only=True)

  call = plgpu.kernel(
      kernel,
      out_type=out_type,
      grid=(min(num_cores, m_iters * n_iters),),
      grid_names=("sm",),
      num_threads=3,
      thread_name="wg",
      interpret=plgpu.InterpretGPUParams() if interpret else None,
  )
  return call(hidden, weight, row_inputs, *([words] if has_words else []), *operands)


def _piece_slots(dtype, num_columns):
  """Shared memory for two warpgroups' two slots of ``[CONFIG.tile_m,
  CONFIG.piece_bytes]`` pieces of a tile of ``dtype`` (``_store_pieces``), swizzled as an
  output of ``num_columns`` columns allows (``mosaic_tile.array_swizzle``)."""
  columns = CONFIG.piece_bytes // jnp.dtype(dtype).itemsize
  return plgpu.SMEM((2, 2, CONFIG.tile_m, columns), dtype, transforms=mosaic_tile.swizzle(
      columns, dtype, mosaic_tile.array_swizzle(num_columns, dtype)))


def _store_pieces(slots, value, out_ref, num_columns):
  """Writes the register tile ``value [R, N]`` to the device-memory ``out_ref`` (``[R, N]``
  from a tile's first column in an array of ``num_columns`` columns) through this
  warpgroup's two shared-memory ``slots`` (``[2, R, n]``) with TMA, an ``[R, n]`` piece at
  a time: a slot is written once the copy that last read it is done (the copy from the
  other slot, or any later one, may still be reading).

  A piece past the array's end is not issued where the array is narrower than a tile (its
  one tile starts at column 0): TMA drops such a piece at a partial last tile, but not in
  an array one 128-byte piece wide, whose unit dimension Mosaic leaves out of the TMA
  descriptor, so the piece landed on columns 0 to 63 (wrong ``d logits`` on GPUs in a
  fused backward's last vocab block of 64 columns; bench/NOTES.md, entry 45)."""
  columns = slots.shape[2]
  for index, j in enumerate(range(0, min(value.shape[1], num_columns), columns)):
    slot = slots.at[index % 2]
    plgpu.wait_smem_to_gmem(1, wait_read_only=True)
    slot[...] = value[:, j:j + columns]
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(slot, out_ref.at[:, pl.ds(j, columns)])


def _copy_out(scratch, value, out_slice):
  """Writes ``value`` (an array, or a tuple of ``scratch``'s rows) to the device-memory
  ``out_slice`` through ``scratch`` with TMA, once the warpgroup's last copy has read
  ``scratch``."""
  plgpu.wait_smem_to_gmem(0, wait_read_only=True)
  if isinstance(value, tuple):
    for i, row in enumerate(value):
      scratch[i] = row
  else:
    scratch[...] = value
  plgpu.commit_smem()
  plgpu.copy_smem_to_gmem(scratch, out_slice)


class _Into(NamedTuple):
  """Where one of several calls over a weight's columns writes in place (``jax.Ref``s
  shared by the calls, so nothing is concatenated after them): ``stats``, the f32 ``[tiles
  of the whole weight, 4, C]`` statistics; ``terms``, the ``exp`` terms in hidden's dtype,
  ``[C, segments, width]`` (``_segment_statistics``), or None (the call returns its own);
  ``offset``, int32 ``[1]``: the call's first tile in ``stats``, or for a call over
  segments' pieces (``_Span``, the only calls that write ``terms`` in place) in the
  pieces' sequence, each tile finding its segment and columns from it (read in the
  kernel: one lowering for every offset)."""
  stats: Any
  terms: Any
  offset: Any


def _offset(first_tile: int):
  """``_Into.offset`` of a call whose first tile is ``first_tile``."""
  return jnp.asarray([first_tile], jnp.int32)


def _tile_statistics(hidden, weight, row_inputs, words, *, num_columns, vocab_dim, softcap,
                     with_entropy, with_exp, masked, interpret, num_cores, into=None,
                     span=None):
  """``(statistics, terms)``, each returned or written in place: ``statistics``, ``[vocab
  tiles, 4, C]`` f32, ``(m, s, q, picked)`` of every ``[row, tile]`` of the weight's first
  ``num_columns`` columns (``V``: the array's, or its last tile's zero padding left out,
  or its whole tiles); with ``with_exp`` the ``exp(z - m)`` terms in hidden's dtype, ``[C,
  weight's width]`` (the columns from ``V`` on not written). With ``into`` (an ``_Into``)
  the statistics, and the terms where it holds them, are written there in place and not
  returned. ``row_inputs [3, C]``: the rows' ``mosaic_tile.HeadStatisticsInputs``,
  stacked; ``words`` as ``_tiles``; ``masked``: apply the rows' ``limit``
  (``mosaic_tile.tile_statistics``; a partial last tile also stops at ``V``). With
  ``span`` (a ``_Span``) the weight is pieces of several segments side by side, each
  zero-padded to whole tiles, from the sequence's tile ``into.offset[0]`` on: a tile's
  statistics (and terms) go to its segment's tiles (and columns) in ``into``, and its
  columns are masked as that segment's own call masks them."""
  num_rows = hidden.shape[0]
  terms_into = into is not None and into.terms is not None
  returned = ("stats",) * (into is None) + ("exp",) * (with_exp and not terms_into)
  passed = () if into is None else ("stats", "offset") + ("exp",) * terms_into

  def tile_finish(x, inputs, column, kept, scratch, outs, n_idx, row_slice, masked):
    outs = dict(zip(returned + passed, outs))
    out = mosaic_tile.tile_statistics(mosaic_tile.cap(x, softcap), inputs, column, kept,
                                      with_entropy, masked, with_exp)
    first_tile = 0 if into is None else outs["offset"][0]
    if span is None:
      stats_tile = first_tile + n_idx
    else:
      segment, within = span.locate(first_tile, n_idx)
      stats_tile = segment * span.tiles_per_segment + span.skip + within
    if with_exp:
      out, e = out
      terms = outs["exp"]
      start = column
      if terms_into:  # (a span's tiles, into their segments' ``[C, segments, width]`` terms)
        # (a multiple of TILE_N: Mosaic infers the stores' layouts only when told so)
        start = pl.multiple_of((span.skip + within) * TILE_N, TILE_N)
        terms = terms.at[:, segment]
      _store_pieces(scratch["exp"], e.astype(hidden.dtype),
                    terms.at[row_slice, pl.ds(start, TILE_N)], num_columns)
    _copy_out(scratch["stats"], out, outs["stats"].at[stats_tile, :, row_slice])

  def finish(x, inputs, column, kept, scratch, outs, n_idx, row_slice):
    args = (x, inputs, column, kept, scratch, outs, n_idx, row_slice)
    if span is not None:
      first = dict(zip(returned + passed, outs))["offset"][0]
      return span.finish(tile_finish, masked, first, *args)
    if not num_columns % TILE_N:
      return tile_finish(*args, masked)
    # The partial last tile reads zeros past V: its columns there are masked, in that tile
    # alone (the others keep the epilogue without column masks).
    partial = n_idx == n_iters - 1

    @pl.when(partial)
    def _partial():
      limit = jnp.minimum(inputs.limit, jnp.float32(num_columns))
      tile_finish(x, inputs._replace(limit=limit), *args[2:], True)

    @pl.when(jnp.logical_not(partial))
    def _whole():
      tile_finish(*args, masked)

  n_iters = num_tiles(num_columns)
  exp_columns = into.terms.shape[-1] if terms_into else weight.shape[vocab_dim]
  stats_type = jax.ShapeDtypeStruct((n_iters, 4, num_rows), jnp.float32)
  exp_type = jax.ShapeDtypeStruct((num_rows, exp_columns), hidden.dtype)
  scratch = dict(stats=plgpu.SMEM((2, 4, CONFIG.tile_m), jnp.float32))
  if with_exp:
    scratch["exp"] = _piece_slots(hidden.dtype, exp_columns)
  return _tiles(hidden, weight, row_inputs, words,
                inputs_type=mosaic_tile.HeadStatisticsInputs, vocab_dim=vocab_dim,
                stages=CONFIG.exp_stages if with_exp else CONFIG.stages, finish=finish,
                out_type=tuple(dict(stats=stats_type, exp=exp_type)[name]
                               for name in returned),
                scratch=scratch, interpret=interpret, num_cores=num_cores, tiles=n_iters,
                operands=() if into is None else (into.stats, into.offset) + (
                    (into.terms,) if terms_into else ()))


def _tile_logits_grad(hidden, weight, row_inputs, words, *, vocab_dim, softcap, masked,
                      interpret, num_cores):
  """``[C, V]`` ``d loss / d (hidden @ weight)`` in hidden's dtype; ``row_inputs [10, C]``:
  the rows' ``mosaic_tile.HeadGradientInputs``, stacked; ``words`` as ``_tiles`` (a
  partial tile's columns past ``V`` are stored nowhere: no mask needed);
  ``masked``: apply the rows' ``[first_kept, limit)`` (``mosaic_tile.head_gradient``)."""
  num_rows, dtype = hidden.shape[0], hidden.dtype
  num_columns = weight.shape[vocab_dim]

  def finish(x, inputs, column, kept, scratch, outs, n_idx, row_slice):
    del n_idx
    d = mosaic_tile.head_gradient(x, inputs, column, kept, softcap, masked).astype(dtype)
    _store_pieces(scratch, d, outs[0].at[row_slice, pl.ds(column, TILE_N)], num_columns)

  return _tiles(hidden, weight, row_inputs, words,
                inputs_type=mosaic_tile.HeadGradientInputs, vocab_dim=vocab_dim,
                stages=CONFIG.grad_stages, finish=finish,
                out_type=(jax.ShapeDtypeStruct((num_rows, num_columns), dtype),),
                scratch=_piece_slots(dtype, num_columns),
                interpret=interpret, num_cores=num_cores)[0]


def statistics(hidden, weight, labels, inv_temp, limit, kept=None, *, column_start,
               vocab_dim, softcap, with_entropy, interpret, num_cores, with_exp=False,
               layout=None, blocks=None):
  """Per-tile ``(m, s, q, picked)`` of ``z = softcap(hidden @ weight) * inv_temp`` over
  this weight's columns below ``limit``, for ``mosaic_merge.merge`` to merge in the
  columns' order; with ``with_exp`` also the ``exp(z - m)`` terms of ``s`` (the fused
  objective path's rows, from which ``mosaic_rows_grad.exp_overwrite`` forms the
  gradient in place).

  Args:
    hidden: ``[C, D]`` bf16 or f16, ``C >= 256`` a multiple of 8, ``D`` of 64.
    weight: ``[D, V_local]`` (``vocab_dim`` 1) or ``[V_local, D]`` (0), hidden's dtype,
      ``V_local`` any width.
    labels: int32 ``[C]`` global label ids; ``column_start`` is this weight's first id.
    inv_temp: ``[C]`` float32.
    limit: int32 scalar: local columns at or beyond it are excluded (padded vocabulary);
      or None: none is, and the tiles are not masked (as ``mosaic_rows.statistics``).
    kept: uint32 ``[C, ceil(V_local / 32)]``, the rows' kept sets over this weight's columns,
      read with the tiles (the label's column always kept); or None.
    with_entropy: compute ``q`` (else zeros).
    interpret, num_cores: as the plan says (``_tiles``).
    with_exp: also return the ``exp(z - m)`` terms.
    layout: the columns' segments (``mosaic_tile.segments`` of ``V_local`` and the shard
      count; default: one device's). Where their last tiles are partial (``split``),
      each segment is tiled from its own first column (``_segment_statistics``).
    blocks: for a weight read in blocks (``reads_in_blocks``), its ``weight_blocks`` for
      ``C`` rows, made once for several calls; or None: the call copies its own.

  Returns:
    ``[layout.num_tiles, 4, C]`` float32: ``(m, s, q, picked)`` of each row over each
    tile of 128 columns (a segment's last tile's columns past its end excluded), in the
    columns' order. A row's numbers depend on its own hidden state,
    label, temperature and the tile's columns alone (one wgmma sequence over the whole
    hidden dim, no split-K; the epilogue's instructions are the same for every row).
    With ``with_exp``, ``(that array, e)``: ``e [C, exp_width(V_local)]`` in hidden's
    dtype, each column's ``exp(z - m)`` with ``m`` its row's max over the column's tile (0
    at excluded columns, and at the columns past ``V_local`` of an odd width), the terms
    of ``s`` rounded once; the statistics' bits are the same either way. Memory: that
    array, 1/32 of the bytes of the chunk's f32 logits (and ``e``); with ``kept``, its
    ``mosaic_tile.kept_words`` copy. A weight whose last tile is partial:
    that tile's copy (the calls write their statistics into one array); where TMA cannot read
    it in place at the 128-byte swizzle, one vocab block's copy too (``column_blocks``: at
    most ``CONFIG.block_bytes``), none with ``blocks``.
  """
  num_columns = weight.shape[vocab_dim]
  options = dict(column_start=column_start, vocab_dim=vocab_dim, softcap=softcap,
                 with_entropy=with_entropy, interpret=interpret, num_cores=num_cores)
  layout = mosaic_tile.segments(num_columns) if layout is None else layout
  if layout.count * layout.width != num_columns:
    raise ValueError(f"{num_columns} columns: the layout's ({layout}) expected")
  in_blocks = reads_in_blocks(num_columns, hidden.dtype, vocab_dim, layout)
  if blocks is not None and not in_blocks:
    raise ValueError(f"blocks: none expected, TMA reads a weight of {num_columns} columns "
                     f"({layout}) in place")
  if in_blocks:
    out = _segment_statistics(layout, hidden, weight, labels, inv_temp, limit, kept,
                              with_exp=with_exp, blocks=blocks, **options)
  elif num_columns % TILE_N and num_columns > TILE_N and _reads_in_place(
      num_columns, hidden.dtype, vocab_dim):
    out = _whole_tiles_then_rest(hidden, weight, labels, inv_temp, limit, kept,
                                 with_exp=with_exp, **options)
  else:
    out = _statistics(hidden, weight, labels, inv_temp, limit, kept, num_columns=num_columns,
                      with_exp=with_exp, **options)
  return out if with_exp else out[0]


def _reads_in_place(num_columns, dtype, vocab_dim) -> bool:
  """TMA reads the weight where it lies at the 128-byte swizzle: a ``[D, V]`` one's rows
  are whole 128-byte swizzles, a ``[V, D]`` one is whole tiles of 8 rows."""
  return (mosaic_tile.array_swizzle(num_columns, dtype) == 128 if vocab_dim
          else not num_columns % ROW_TILE)


def reads_in_blocks(num_columns: int, dtype, vocab_dim: int,
                    layout: mosaic_tile.Segments | None = None) -> bool:
  """``statistics`` copies a weight of ``num_columns`` columns out
  in ``column_blocks``' vocab blocks, once per call (a width TMA cannot read in place whose
  last tile is partial: 37984 columns of a ``[D, V]`` weight, any odd width): a chunk's
  call costs a pass over the weight's bytes besides its matmul, which the planner weighs
  (``jaxce.plan.linear_kernel_chunk``). So does a weight of segments whose last tiles are
  partial (``_segment_statistics``): ``layout``, the shard's segments (default: those of
  ``num_columns`` on one device; a shard of 124160 columns of Qwen3.5's 248320 is 2
  segments of whole tiles, where the same width on one device is 8 of 15520)."""
  if (mosaic_tile.segments(num_columns) if layout is None else layout).split:
    return True
  return bool(num_columns % TILE_N) and not (num_columns > TILE_N and _reads_in_place(
      num_columns, dtype, vocab_dim))


def _statistics(hidden, weight, labels, inv_temp, limit, kept, *, num_columns, column_start,
                vocab_dim, **options):
  """``_tile_statistics`` of the weight's first ``num_columns`` columns (the columns past
  them, zeros that pad the last tile, are masked as a partial tile's are); ``options``
  as ``_tile_statistics``'s."""
  label_column = labels - column_start
  label_column = jnp.where((label_column >= 0) & (label_column < num_columns), label_column, -1)
  row_inputs = _statistics_inputs(inv_temp, label_column,
                                  num_columns if limit is None else limit)
  return _tile_statistics(hidden, weight, row_inputs,
                          _words(kept, label_column, hidden.shape[0], num_columns),
                          num_columns=num_columns, vocab_dim=vocab_dim,
                          masked=limit is not None, **options)


def _statistics_inputs(inv_temp, label_column, limit):
  """f32 ``[3, C]``: the rows' ``mosaic_tile.HeadStatisticsInputs`` stacked, from
  ``inv_temp [C]``, ``label_column [C]`` (the label's column in the call, -1: not there)
  and ``limit`` (a scalar: the call's columns at or past it are excluded)."""
  return mosaic_tile.stack(mosaic_tile.HeadStatisticsInputs(
      inv_temp=inv_temp.astype(jnp.float32), label=label_column.astype(jnp.float32),
      limit=jnp.broadcast_to(jnp.asarray(limit, jnp.float32), inv_temp.shape)))


def _whole_tiles_then_rest(hidden, weight, labels, inv_temp, limit, kept, *, column_start,
                           vocab_dim, with_exp, **options):
  """``statistics`` (with its ``exp`` terms when ``with_exp``) of a weight that TMA reads in
  place at the 128-byte swizzle but whose last tile is partial (Qwen3's 151936 columns
  over 2 GPUs: 75968): one call over its whole tiles, reading the array where it lies, with
  the epilogue that masks no column (a partial tile under a ``pl.when`` slows every tile
  of the call: bench/NOTES.md, entry 49), then the columns left copied out and
  zero-padded to one tile (``_rest_statistics``). The same tiles, statistics and bits as one
  call over the whole array. Both calls write their statistics in place into one array
  (``_Into``); the ``exp`` terms of the columns left are written into the first call's
  ``[C, V_local]`` array (XLA's update in place). Memory: one tile's copy of the weight."""
  num_columns = weight.shape[vocab_dim]
  whole = num_columns // TILE_N * TILE_N
  stats = _statistics_ref(num_columns, hidden.shape[0])
  into = lambda start: _Into(stats, None, _offset(start // TILE_N))
  first = _statistics(hidden, weight, labels, inv_temp, limit,
                      None if kept is None else kept[:, :whole // 32], num_columns=whole,
                      column_start=column_start, vocab_dim=vocab_dim, with_exp=with_exp,
                      into=into(0), **options)
  rest = _rest_statistics(whole, hidden, weight, labels, inv_temp, limit, kept,
                          column_start=column_start, vocab_dim=vocab_dim, with_exp=with_exp,
                          into=into(whole), **options)
  if not with_exp:
    return (stats[...],)
  return stats[...], lax.dynamic_update_slice_in_dim(first[0], rest[0][:, :num_columns - whole],
                                                     whole, 1)


def _statistics_ref(num_columns, num_rows):
  """An uninitialized ``jax.Ref`` for the f32 ``[tiles, 4, C]`` statistics of a weight of
  ``num_columns`` columns, which several calls write in place (``_Into``)."""
  return jax.new_ref(lax.empty((num_tiles(num_columns), 4, num_rows), jnp.float32))


def _rest_statistics(start, hidden, weight, labels, inv_temp, limit, kept, *, column_start,
                     vocab_dim, with_exp=False, **options):
  """``_statistics`` of the weight's columns from ``start`` (a multiple of ``TILE_N``) on,
  copied out and zero-padded to whole tiles: the padding is masked as a partial tile's
  columns past the array are. With ``with_exp``, their ``exp`` terms ``[C, padded
  width]`` (the padding's not written)."""
  num_columns = weight.shape[vocab_dim]
  rest_columns = num_columns - start
  columns = head.pad_columns(lax.slice_in_dim(weight, start, num_columns, axis=vocab_dim),
                             num_tiles(rest_columns) * TILE_N, vocab_dim)
  return _statistics(hidden, columns, labels, inv_temp, None if limit is None else limit - start,
                     None if kept is None else kept[:, start // 32:],
                     num_columns=rest_columns, column_start=column_start + start,
                     vocab_dim=vocab_dim, with_exp=with_exp, **options)


def column_blocks(tiles: int, *, depth: int, dtype, num_rows: int,
                  num_cores: int) -> tuple[int, ...]:
  """The vocab blocks, in whole tiles each, of the ``tiles`` whole tiles of a weight that
  TMA cannot read in place at the 128-byte swizzle (``_segment_statistics``: a segment's
  columns; a ``V_local`` that is not a multiple of 64, as GPT-2's 50257), every segment's
  whole tiles side by side: each block is copied out (at most ``CONFIG.block_bytes`` of a
  ``[D, V_local]`` weight) and is one kernel call, whose tiles ``row_blocks(num_rows) *
  block`` run on ``num_cores`` SMs in waves, the last one partial. Of the fewest blocks
  (as equal as tiles allow), one more, and blocks that fill whole waves (the widest such
  width, the tiles over in one block), the one that leaves the fewest SMs idle, each
  call counting ``CONFIG.call_waves``: a shard of Llama 3's 128256 over 4 GPUs is 2
  segments of 125 whole tiles, once read a segment's block of 62 or 63 tiles at a time
  (61 waves a call at T = 32768 on 132 SMs, 0.9 of the last idle; 1.041x the forward's
  time per column of a width read in place, on an H200), now in blocks of 66 tiles (64
  waves each) and one of the 52 over (1.021x; bench/NOTES.md entry 74). None where there
  are fewer than ``CONFIG.min_block_tiles`` (the columns left's call reads them all). At
  most two widths (each lowered once)."""
  max_tiles = max(CONFIG.block_bytes // (depth * jnp.dtype(dtype).itemsize * TILE_N), 1)
  if tiles < min(CONFIG.min_block_tiles, max_tiles):
    return ()
  rows = row_blocks(num_rows)

  def cost(blocks):  # (idle SMs of each call's last wave, and the calls, in waves)
    return sum(-(rows * b) % num_cores for b in blocks) / num_cores + CONFIG.call_waves * len(
        blocks)

  def equal(count):
    narrow, wider = divmod(tiles, count)
    return (narrow + 1,) * wider + (narrow,) * (count - wider)

  fewest = -(-tiles // max_tiles)
  candidates = [equal(count) for count in (fewest, fewest + 1) if count <= tiles]
  whole_waves = next((b for b in range(max_tiles, 0, -1) if not rows * b % num_cores), None)
  if whole_waves:
    count, over = divmod(tiles, whole_waves)
    candidates.append((whole_waves,) * count + ((over,) if over else ()))
  return min(candidates, key=lambda blocks: (cost(blocks), len(blocks)))


class _Span(NamedTuple):
  """A kernel call over a piece of each of a weight's ``count`` segments of ``width``
  columns (``_span_statistics``): a segment's tiles ``skip`` to ``skip + piece`` (its
  columns from ``skip * TILE_N``, the last piece's last tile partial where ``width``
  ends it), the segments' pieces side by side, zero-padded to whole tiles, the call's
  ``tiles`` of them from the first tile ``_Into.offset[0]`` of that sequence on;
  ``tiles_per_segment``: a segment's tiles in the statistics."""
  width: int
  count: int
  skip: int
  piece: int
  tiles: int
  tiles_per_segment: int

  @property
  def columns(self) -> int:
    """A segment's columns in its piece (fewer than ``piece * TILE_N`` where it ends
    the segment at a partial tile)."""
    return min(self.width - self.skip * TILE_N, self.piece * TILE_N)

  @property
  def partial(self) -> bool:
    return self.columns < self.piece * TILE_N

  def locate(self, first, n_idx):
    """``(segment, within)`` of the call's tile ``n_idx``: its segment and its tile in the
    segment's piece."""
    index = first + n_idx
    return index // self.piece, index % self.piece

  def finish(self, tile_finish, masked, first, x, inputs, column, kept, scratch, outs, n_idx,
             row_slice):
    """``tile_finish`` of the call's tile ``n_idx``, its columns masked as its segment's
    own call masks them: the partial last tile of a segment always, at the segment's end
    and the rows' limit; a whole tile where ``masked``, at the rows' limit (``inputs.limit``
    counts from the segment's column ``skip * TILE_N``)."""
    segment, within = self.locate(first, n_idx)
    limit = (n_idx - within).astype(jnp.float32) * TILE_N + jnp.clip(
        inputs.limit - segment.astype(jnp.float32) * self.width, 0.0, float(self.columns))
    args = (x, inputs._replace(limit=limit), column, kept, scratch, outs, n_idx, row_slice)
    if not self.partial:
      return tile_finish(*args, masked)
    if self.piece == 1:
      return tile_finish(*args, True)
    partial = within == self.piece - 1

    @pl.when(partial)
    def _partial():
      tile_finish(*args, True)

    @pl.when(jnp.logical_not(partial))
    def _whole():
      tile_finish(*args, masked)


def _segment_statistics(layout, hidden, weight, labels, inv_temp, limit, kept, *,
                        column_start, vocab_dim, with_exp, blocks=None, **options):
  """``statistics`` (with ``with_exp`` its ``exp`` terms) of a weight that TMA cannot read
  where it lies: cut into ``layout``'s segments whose last tiles are partial
  (``layout.split``: Qwen3's 151936 columns are 8 segments of 18992, and a shard of 2 or 4
  devices holds 4 or 2 of them), or one segment not read in place (a ``[D, V_local]``
  weight whose rows are not whole 128-byte swizzles, 50257; a ``[V_local, D]`` one that
  is not whole tiles of 8 rows). Each segment is tiled from its own first column, its
  statistics those of a weight of that segment's columns alone, so a token's tiles, and
  its bits, are the same on every device count whose shards hold whole segments.

  Every segment's whole tiles, side by side, are read in ``column_blocks``' vocab blocks,
  each copied out and read at the 128-byte swizzle by one call (a block may hold the end
  of one segment and the start of the next); then every segment's columns left in one
  call, zero-padded to whole tiles, the padding masked (``_span_statistics``). The
  segments' statistics go in order into one ``[segments * tiles per segment, 4, C]``
  array; with ``with_exp`` their terms into one ``[C, segments, width]`` array (``[C, 1,
  exp_width(V_local)]`` for one segment, the padding's terms zeros), returned as ``[C,
  V_local]`` (``exp_width``). ``blocks``: the calls' copies made before (``weight_blocks``
  for these rows), or None: each call makes its own, once the call before has returned
  (``_after_the_call_before``). Memory: one block's copy (none with ``blocks``), with
  ``with_exp`` the columns left's terms twice."""
  width, count = layout.width, layout.count
  num_rows, depth = hidden.shape
  stats = jax.new_ref(lax.empty((layout.num_tiles, 4, num_rows), jnp.float32))
  terms_width = width if count > 1 else exp_width(width, hidden.dtype)
  terms = (jax.new_ref(lax.empty((num_rows, count, terms_width), hidden.dtype)) if with_exp
           else None)
  calls = _segment_calls(layout, num_rows, depth, hidden.dtype, options["num_cores"])
  if blocks is not None and [b.shape for b in blocks] != [
      _block_shape(span, depth, vocab_dim) for span, _ in calls]:
    raise ValueError(f"blocks of shapes {[b.shape for b in blocks]}: weight_blocks' for "
                     f"{num_rows} rows expected")
  span_statistics = functools.partial(
      _span_statistics, hidden=hidden, labels=labels, inv_temp=inv_temp, limit=limit,
      kept=kept, column_start=column_start, vocab_dim=vocab_dim, with_exp=with_exp,
      stats=stats, terms=terms, **options)
  for i, (span, first) in enumerate(calls):
    if blocks is None:
      weight = _after_the_call_before(weight, stats) if i else weight
      columns = _span_columns(span, first, weight, vocab_dim)
    else:
      columns = blocks[i]
    left = span_statistics(span, first, columns)
  if not with_exp:
    return (stats[...],)
  # (the columns left's terms, the last call's: their zero padding fills an odd width's
  # last columns)
  rest, _ = calls[-1]
  terms[:, :, rest.skip * TILE_N:] = left.reshape(num_rows, count, rest.piece * TILE_N)[
      :, :, :terms_width - rest.skip * TILE_N]
  return stats[...], terms[...].reshape(num_rows, count * terms_width)


def weight_blocks(weight, *, num_rows, vocab_dim, num_cores, layout=None):
  """The vocab blocks ``statistics`` copies out of a weight TMA cannot read in place
  (``reads_in_blocks``), made once for several calls of ``num_rows`` rows each (the
  fused objective path's groups): ``statistics(..., blocks=...)`` reads them instead of
  copying its own, so the weight is copied once a call of the path, not once a group
  (bench/NOTES.md entry 81). ``layout`` as ``statistics``'. Returns a tuple of ``[D,
  columns]`` (``vocab_dim`` 1) or ``[columns, D]`` arrays in the weight's dtype, one a
  kernel call: every segment's whole tiles in ``column_blocks``' blocks, then their
  columns left, zero-padded to whole tiles. Memory: about the weight's bytes (its
  segments' partial tiles padded to whole ones), alive while the calls run."""
  num_columns = weight.shape[vocab_dim]
  layout = mosaic_tile.segments(num_columns) if layout is None else layout
  if not reads_in_blocks(num_columns, weight.dtype, vocab_dim, layout):
    raise ValueError(f"a weight of {num_columns} columns ({layout}) is read in place: "
                     "no blocks to copy")
  depth = weight.shape[1 - vocab_dim]
  return tuple(_span_columns(span, first, weight, vocab_dim) for span, first in
               _segment_calls(layout, num_rows, depth, weight.dtype, num_cores))


def weight_blocks_bytes(layout: mosaic_tile.Segments, depth: int, dtype) -> int:
  """The bytes of ``weight_blocks``' copy of a ``[D, V_local]`` (or ``[V_local, D]``)
  weight of ``layout``'s segments, ``depth`` ``D`` and ``dtype``: its segments in whole
  tiles."""
  return layout.num_tiles * TILE_N * depth * jnp.dtype(dtype).itemsize


def _segment_calls(layout, num_rows, depth, dtype, num_cores):
  """``[(span, first tile)]``: ``_segment_statistics``' kernel calls in order, every
  segment's whole tiles in ``column_blocks``' blocks, then their columns left."""
  width, count = layout.width, layout.count
  whole = width // TILE_N
  blocks = column_blocks(count * whole, depth=depth, dtype=dtype, num_rows=num_rows,
                         num_cores=num_cores)
  calls, first = [], 0
  for tiles in blocks:
    calls.append((_Span(width, count, 0, whole, tiles, layout.tiles_per_segment), first))
    first += tiles
  skip = whole if blocks else 0
  rest = num_tiles(width - skip * TILE_N)
  calls.append((_Span(width, count, skip, rest, count * rest, layout.tiles_per_segment), 0))
  return calls


def _pieces(span, first):
  """The call's part of each segment's piece: ``[(first column, columns, the tiles'
  columns they are padded to)]``."""
  pieces = []
  for s in range(first // span.piece, -(-(first + span.tiles) // span.piece)):
    a = max(first - s * span.piece, 0)
    b = min(first + span.tiles - s * span.piece, span.piece)
    pieces.append((s * span.width + span.skip * TILE_N + a * TILE_N,
                   min((b - a) * TILE_N, span.columns - a * TILE_N), (b - a) * TILE_N))
  return pieces


def _block_shape(span, depth, vocab_dim):
  """The shape of ``_span_columns``' copy for ``span``."""
  return (depth, span.tiles * TILE_N) if vocab_dim else (span.tiles * TILE_N, depth)


def _after_the_call_before(weight, stats):
  """``weight``, held by an optimization barrier until the kernel call that last wrote
  ``stats`` (the ``jax.Ref`` every call of ``_segment_statistics`` writes in place) has
  returned: a block copied out of what this returns is made after that call, whose own
  copy is then dead. The statistics go through the barrier too, and the next call
  writes into what comes out of it, so XLA keeps both of its operands (a barrier output
  that nothing reads is dropped, and the copy with it). Without it XLA's schedule made
  every block's copy before the first call, all alive at once: the fused fwd+bwd at
  151936 columns (T = 16192, D = 4096, one H200) planned 1.30 GiB of temporaries, 17
  copies of 66 MiB side by side, where its backward needs 0.89 (bench/NOTES.md entry
  83); so did the forward over several devices (entry 75)."""
  weight, written = lax.optimization_barrier((weight, stats[...]))
  stats[...] = written
  return weight


def _span_columns(span, first, weight, vocab_dim):
  """``span``'s tiles from ``first`` on, copied out of ``weight``: its segments' pieces side
  by side, each zero-padded to whole tiles."""
  return jnp.concatenate([
      head.pad_columns(lax.slice_in_dim(weight, begin, begin + size, axis=vocab_dim), tiled,
                       vocab_dim) for begin, size, tiled in _pieces(span, first)],
      axis=vocab_dim)


def _span_statistics(span, first, columns, *, hidden, labels, inv_temp, limit, kept,
                     column_start, vocab_dim, with_exp, stats, terms, **options):
  """``terms`` or None: the statistics of ``span``'s tiles from ``first`` on, read
  from ``columns`` (``_span_columns``' copy: their segments' pieces side by side,
  zero-padded to whole tiles), in one kernel call written into the segments' ``stats``
  (``[segments * tiles per segment, 4, C]``, a ``jax.Ref``); with ``with_exp`` their
  ``exp`` terms, written in place into ``terms`` (``[C, segments, width]``) where the span
  is whole tiles, else returned (``[C, span.tiles * TILE_N]``). A tile's columns, rows
  and masks are those of its segment's own call: the same statistics and terms, bit for
  bit. The columns left of all segments are one call: a call a segment read all of hidden
  again for a tile's columns (8 of them cost 3 % of the forward's time at 151936 columns,
  T = 32768, D = 4096 on an H200, bench/NOTES.md entry 73)."""
  num_rows, width, padded = hidden.shape[0], span.width, span.piece * TILE_N
  start = span.skip * TILE_N
  pieces = _pieces(span, first)
  column = labels.astype(jnp.int32) - column_start
  segment = column // width
  within = column - segment * width - start
  flat = segment * padded + within - first * TILE_N
  here = ((column >= 0) & (column < span.count * width) & (within >= 0)
          & (within < span.columns) & (flat >= 0) & (flat < span.tiles * TILE_N))
  row_inputs = _statistics_inputs(inv_temp, jnp.where(here, flat, -1),
                                  (span.count * width if limit is None else limit) - start)
  words = None if kept is None else jnp.concatenate([
      _words(mosaic_tile.segment_words(kept, begin, size), column - begin, num_rows, size)
      for begin, size, _ in pieces])
  in_place = terms is not None and not span.partial
  call = _span_call(span, vocab_dim, with_exp, limit is not None, in_place,
                    tuple(sorted(options.items())))
  return call(hidden, columns, row_inputs, words,
              _Into(stats, terms if in_place else None, _offset(first)))


@functools.lru_cache(maxsize=None)
def _span_call(span, vocab_dim, with_exp, masked, terms_in_place, options):
  """The jitted kernel call of ``_span_statistics``: one function, lowered once, for every
  call of ``span``'s shape (its first tile is read in the kernel, ``_Into.offset``)."""

  @jax.jit
  def vocab_block(hidden, columns, row_inputs, words, into):
    out = _tile_statistics(hidden, columns, row_inputs, words,
                           num_columns=span.tiles * TILE_N, vocab_dim=vocab_dim,
                           with_exp=with_exp, masked=masked, into=into, span=span,
                           **dict(options))
    return out[0] if with_exp and not terms_in_place else None

  return vocab_block


def _words(kept, label_column, num_rows, num_columns):
  """uint32 ``[tiles * WORDS, C]``: the kept sets ``[C, >= ceil(V_local / 32)]``'s words
  of each tile with each row's label column's bit set, a row per word
  (``mosaic_tile.kept_words``, read by ``_tiles``); or None."""
  if kept is None:
    return None
  return mosaic_tile.kept_words(kept, label_column, num_rows, num_columns)


def logits_grad(hidden, weight, label_column, inv_temp, saved, cotangents, row_mask,
                kept=None, *, limit, first_kept, vocab_dim, softcap, interpret, num_cores):
  """``d loss / d (hidden @ weight)`` of one ``[C, Vb]`` tile of the fused backward, formed
  in the matmul's epilogue and written once, in hidden's dtype (the operand of the two
  gradient matmuls): no f32 tile reaches device memory.

  Args:
    hidden: ``[C, D]`` bf16 or f16, ``C >= 256`` a multiple of 8, ``D`` of 64.
    weight: the block's ``[D, Vb]`` (``vocab_dim`` 1) or ``[Vb, D]`` (0), ``Vb`` a
      multiple of 16 (a partial last tile: its stores past ``Vb`` are dropped).
    label_column: int32 ``[C]``: the label's column in this block, -1 when the label is
      not this block's (below ``first_kept`` too: an earlier block owns it); a column at or
      past ``Vb`` (a later block's or shard's label) counts as none, as in
      ``statistics``: a partial last tile's padding columns must not take it.
    inv_temp: ``[C]`` f32.
    saved: ``(shift, log_sum, entropy)``, the forward's statistics, and ``cotangents``:
      ``(g_logp, g_entropy)``, ``[C]`` f32 each (``entropy``, ``g_logp`` and
      ``g_entropy`` may be None: zeros).
    row_mask: bool ``[C]``: rows that are False get exactly 0.
    kept: uint32 ``[C, ceil(Vb / 32)]``, the rows' kept sets over the block's columns (the
      label's column always kept), or None.
    limit, first_kept: int32 scalars: the block's columns outside ``[first_kept, limit)``
      are excluded (padded vocabulary; a clamped last block's overlap); or None: no column
      below (``first_kept``) or past (``limit``) is, and with both None the tiles are not
      masked (as ``statistics``).
    interpret, num_cores: as the plan says (``_tiles``).

  Returns:
    ``[C, Vb]`` in hidden's dtype. Memory: that array only.
  """
  as_row = lambda v: jnp.zeros_like(inv_temp, jnp.float32) if v is None else v.astype(
      jnp.float32)
  scalar = lambda v: jnp.broadcast_to(jnp.asarray(v, jnp.float32), inv_temp.shape)
  (shift, log_sum, entropy), (g_logp, g_entropy) = saved, cotangents
  num_columns = weight.shape[vocab_dim]
  label_column = jnp.where(label_column < num_columns, label_column, -1)
  row_inputs = mosaic_tile.stack(mosaic_tile.HeadGradientInputs(
      inv_temp=as_row(inv_temp), label=label_column.astype(jnp.float32),
      limit=scalar(num_columns if limit is None else limit),
      first_kept=scalar(0 if first_kept is None else first_kept),
      shift=as_row(shift), log_sum=as_row(log_sum),
      entropy=as_row(entropy), g_logp=as_row(g_logp), g_entropy=as_row(g_entropy),
      row_mask=row_mask.astype(jnp.float32)))
  return _tile_logits_grad(hidden, weight, row_inputs,
                           _words(kept, label_column, hidden.shape[0], num_columns),
                           vocab_dim=vocab_dim,
                           softcap=softcap, masked=limit is not None or first_kept is not None,
                           interpret=interpret, num_cores=num_cores)
