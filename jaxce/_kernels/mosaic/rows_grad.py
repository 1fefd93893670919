"""The gradient of logits rows ``[T, V_local]`` as a Pallas Mosaic GPU kernel (Hopper):
written over the logits' own buffer (``overwrite``: the logits path's backward with
``backward_in_place=True``) or into a new array (``gradient``: the backward with a kept
set, whose bits XLA's fused pass unpacks slowly); and the fused objective path's
``d``, written over its rows' ``exp(z - m_tile)`` terms (``exp_overwrite``: the same
kernel with each tile's shift streamed beside it, ``mosaic_tile.exp_gradient``).

In place, the kernel writes into the logits through a mutable reference
(``jax.new_ref``), which reaches XLA as an output aliasing its input: XLA writes the
gradient into the logits' buffer when the logits are dead after the backward (donated, or
an intermediate of a jitted training step), and otherwise copies them first. Each CTA
(one warpgroup) takes ``CONFIG.rows`` rows and a group of ``[CONFIG.rows, TILE]`` tiles, as
``mosaic_rows``; TMA streams each tile in and its gradient back out, and every tile is
read before it is overwritten, by the CTA that owns it. Per element, with the row's
statistics and cotangents folded into per-row coefficients (``_row_inputs``), its
``mosaic_tile.rows_gradient``.

In place, rows are taken in whole blocks of ``CONFIG.rows`` (a moved-back block would read rows
that its neighbour has overwritten): the last ``T % CONFIG.rows`` rows are written by XLA in
place (``dynamic_update_slice``). Into a new array, the last block is moved back inside,
as in ``mosaic_rows``. ``T`` must be a multiple of 8 and a row a multiple of 32 bytes;
the columns are tiled as ``mosaic_rows`` tiles them (``mosaic_tile.Segments``): a partial
last tile's columns past its segment's end read as zeros and their stores are dropped.
Off GPUs the kernel runs in JAX's GPU interpreter (tests).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from jaxce._kernels import chunking, plumbing
from jaxce._kernels.mosaic import rows as mosaic_rows, tile as mosaic_tile
from jaxce._kernels.config import Tokens

plgpu = plumbing.lazy_module("jax.experimental.pallas.mosaic_gpu")

TILE, WORDS = mosaic_rows.TILE, mosaic_rows.WORDS
NUM_ROW_INPUTS = len(mosaic_tile.RowsGradientInputs._fields)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Config:
  """The gradient kernels' tiling: they read ``CONFIG`` (tests swap in another with
  ``dataclasses.replace``).

  Attributes:
    rows: rows per CTA (one warpgroup), as the statistics kernel's (``mosaic_rows``).
    stage_bytes: shared memory of the pipeline's buffers on the way in, per CTA.
  """
  rows: int = 64
  stage_bytes: int = 96 * 2**10


CONFIG = Config()


def _kernel(x, row_inputs, words, tile_shift=None, *, layout, in_place, masked, stages,
            interpret, softcap=None, with_log_p=True):
  """The gradient of ``x [R, V_local]`` (``R`` a multiple of 8, at least ``CONFIG.rows``): over
  the first ``row blocks * CONFIG.rows`` rows of ``x`` (``in_place``; the rest left as they
  were) or into a new array (the last row block moved back inside, as in
  ``mosaic_rows``); ``row_inputs [row blocks, fields, CONFIG.rows]`` f32: each block's rows'
  ``mosaic_tile.RowsGradientInputs``; ``words``: uint32 ``[tiles * WORDS, R]`` kept sets
  of ``mosaic_tile.kept_words``, or None; ``layout``: the columns' tiling
  (``mosaic_tile.Segments``). With ``tile_shift`` (f32 ``[row blocks, tiles, CONFIG.rows]``,
  each row's ``(m_tile - m) - log s`` per tile, streamed beside
  the tiles), ``x`` holds the fused head's ``exp(z - m_tile)`` terms, ``row_inputs`` the
  rows' ``mosaic_tile.ExpGradientInputs``, and each tile's gradient is
  ``mosaic_tile.exp_gradient`` (``softcap``, ``with_log_p``; no words, no mask)."""
  num_rows = x.shape[0]
  shape = x.shape
  x = mosaic_rows.columns_view(x, layout)
  transforms = mosaic_rows.tile_swizzle(x.dtype, mosaic_rows.row_width(layout))
  has_words, exp_rows = words is not None, tile_shift is not None
  inputs_type = mosaic_tile.ExpGradientInputs if exp_rows else mosaic_tile.RowsGradientInputs

  def kernel(x_gmem, rows_gmem, *refs):
    block, group_index = lax.axis_index("rows"), lax.axis_index("groups")
    if in_place:  # (whole blocks: a moved-back block would read overwritten rows)
      streams_gmem, out_gmem = refs, x_gmem
      first_row = pl.multiple_of(block * CONFIG.rows, CONFIG.rows)
    else:
      *streams_gmem, out_gmem = refs
      first_row = pl.multiple_of(jnp.minimum(block * CONFIG.rows, num_rows - CONFIG.rows), 8)
    rows = pl.ds(first_row, CONFIG.rows)
    inputs = mosaic_tile.load(inputs_type, rows_gmem, block, optimized=False)
    group = mosaic_rows.group_at(group_index, layout)
    in_specs = mosaic_rows.tile_specs(group, x.dtype, has_words, layout)
    streams = tuple(w.at[:, rows] for w in streams_gmem)
    if exp_rows:  # (the tile's shifts: one f32 per row, beside the tile)
      in_specs = in_specs + [plgpu.BlockSpec((1, CONFIG.rows), lambda k: (group.tile + k, 0))]
      streams = (streams_gmem[0].at[block],)

    @functools.partial(pl.run_scoped,
                       out_smem=plgpu.SMEM((2, CONFIG.rows, TILE), x.dtype, transforms=transforms))
    def _scoped(out_smem):
      def body(indices, x_smem, *stream_smem):
        (k,) = indices
        column = mosaic_rows.group_column(group, k, layout)
        tile = plgpu.load(x_smem, layout=plgpu.Layout.WGMMA)
        if exp_rows:
          shift = plgpu.load(stream_smem[0].at[0], layout=plgpu.Layout.WGMMA.reduce(1))
          grad = mosaic_tile.exp_gradient(tile, inputs, shift, column, softcap=softcap,
                                          with_log_p=with_log_p)
        else:
          kept = mosaic_tile.kept_columns(stream_smem[0]) if has_words else None
          grad = mosaic_tile.rows_gradient(tile, inputs, column, kept, masked=masked)
        # The store of tile k - 2 out of this slot has read it: reuse it.
        plgpu.wait_smem_to_gmem(1, wait_read_only=True)
        slot = out_smem.at[k % 2]
        slot[...] = grad.astype(x.dtype)
        plgpu.commit_smem()
        # (a partial last tile's columns past its segment: dropped by TMA's bounds)
        at = pl.multiple_of(mosaic_rows.tile_index(group, k, layout) * TILE, TILE)
        plgpu.copy_smem_to_gmem(
            slot, mosaic_rows.segment_columns(out_gmem, rows, group, layout).at[:, pl.ds(at, TILE)])

      pipeline = plgpu.emit_pipeline(
          body, grid=(group.count,), in_specs=in_specs, max_concurrent_steps=stages)
      pipeline(mosaic_rows.segment_columns(x_gmem, rows, group, layout), *streams)
      plgpu.wait_smem_to_gmem(0)

  call = functools.partial(
      plgpu.kernel, kernel, grid=(row_inputs.shape[0], mosaic_rows.num_groups(layout)),
      grid_names=("rows", "groups"),
      interpret=plgpu.InterpretGPUParams() if interpret else None)
  inputs = (row_inputs, *([words] if has_words else []), *([tile_shift] if exp_rows else []))
  if not in_place:
    grad = call(out_type=plumbing.shape_dtype_like(x, x.shape, x.dtype))(x, *inputs)
    # (The kernel's output type drops the shard_map axes x varies over: cast back.)
    return plumbing.unify_varying((grad, x), None)[0].reshape(shape)
  logits = jax.new_ref(x)  # (written in place: the kernel's output aliases x)
  call(out_type=())(logits, *inputs)
  return jax.freeze(logits).reshape(shape)


def _cotangent_fields(valid, saved, cotangents) -> dict:
  """The rows' ``coef = g_logp + g_entropy H``, ``g_entropy`` and ``g_logp``, f32 ``[T]``
  each, 0 at rows not ``valid`` and for a symbolic-zero cotangent (``None``)."""
  (shift, _, entropy), (g_logp, g_entropy) = saved, cotangents
  zeros = jnp.zeros_like(shift, jnp.float32)
  g_logp = zeros if g_logp is None else g_logp.astype(jnp.float32)
  g_entropy = zeros if g_entropy is None else g_entropy.astype(jnp.float32)
  coef = g_logp + (zeros if entropy is None else g_entropy * entropy.astype(jnp.float32))
  masked = lambda v: jnp.where(valid, v, 0)
  return dict(coef=masked(coef), g_entropy=masked(g_entropy), g_logp=masked(g_logp))


def _by_block(a, blocks):
  """``[fields, blocks * CONFIG.rows]`` -> ``[blocks, fields, CONFIG.rows]``: a kernel's
  per-row inputs, one slab per CTA's rows."""
  return a.reshape(a.shape[0], blocks, CONFIG.rows).transpose(1, 0, 2)


def _row_inputs(tokens: Tokens, saved, cotangents, column_start, limit):
  """``[NUM_ROW_INPUTS, T]`` f32: the rows' ``mosaic_tile.RowsGradientInputs``, stacked
  (an ignored row, or one with no cotangent, gets exactly zero gradient)."""
  shift, log_sum, _ = saved
  return mosaic_tile.stack(mosaic_tile.RowsGradientInputs(
      inv_temp=tokens.inv_temp, shift=shift, log_sum=log_sum,
      **_cotangent_fields(tokens.valid, saved, cotangents),
      label_column=tokens.labels - column_start,
      limit=jnp.broadcast_to(limit, shift.shape), row_mask=tokens.valid))


def overwrite(x, tokens: Tokens, saved, cotangents, column_start, limit, tail_gradient, *,
              layout, interpret, stages=None):
  """``x [T, V_local]`` overwritten by ``d loss / d x`` (in ``x``'s dtype).

  Args:
    x: logits, bf16, f16 or f32, ``T`` a multiple of 8 (TMA reads rows in tiles of 8;
      a padded copy would not be in place), a row a multiple of 32 bytes.
    tokens: the rows' tokens (``inv_temp`` f32; rows not ``valid`` get zero gradient;
      ``kept``, the kept sets over the local columns, read with the tiles).
    saved: ``(m, log s, entropy or None)`` ``[T]`` each, the forward's statistics.
    cotangents: ``(g_logp, g_entropy)`` ``[T]`` each, None for a symbolic zero.
    column_start: the global id of ``x``'s first column.
    limit: int32 scalar: local columns at or beyond it are excluded, or None.
    tail_gradient: ``(x, start, size) -> d x`` of rows ``[start, start + size)`` of
      ``x`` (XLA's elementwise pass), for the rows past the last whole block of
      ``CONFIG.rows``, which the kernel leaves as they were.
    layout: the columns' tiling (``mosaic_tile.segments``).
    interpret: run in JAX's GPU interpreter (off GPUs: tests).
    stages: tiles in flight per CTA on the way in (default: as many as fit in
      ``CONFIG.stage_bytes`` beside the two output tiles).

  Returns:
    the gradient, in ``x``'s buffer when ``x`` is dead. Memory: ``NUM_ROW_INPUTS``
    floats per row and, with kept sets, the words' ``mosaic_tile.kept_words`` copy
    (``T * V_local / 8`` bytes); XLA's copy of ``x`` first when ``x`` is still live.
  """
  num_rows, num_columns = x.shape
  _check_shape(x, layout)
  stages = _default_stages(x.dtype) if stages is None else stages
  whole = num_rows // CONFIG.rows * CONFIG.rows
  if whole:
    bound = num_columns if limit is None else limit
    rows = _row_inputs(tokens, saved, cotangents, column_start, bound)[:, :whole]
    rows = _by_block(rows, whole // CONFIG.rows)
    words = None if tokens.kept is None else mosaic_tile.segment_kept_words(
        tokens.kept[:whole], tokens.labels[:whole] - column_start, whole, layout)
    x = _kernel(x, rows, words, layout=layout, in_place=True, masked=limit is not None,
                stages=stages, interpret=interpret)
  if whole < num_rows:
    # (The barrier keeps XLA's GPU compiler from fusing the update into the kernel's
    # custom call, which it cannot lower: "DUS target must be a fusion parameter".)
    x = lax.optimization_barrier(x)
    x = lax.dynamic_update_slice_in_dim(x, tail_gradient(x, whole, num_rows - whole), whole, 0)
  return x


def gradient(x, tokens: Tokens, saved, cotangents, column_start, limit, *, layout,
             interpret, stages=None):
  """``d loss / d x`` of ``x [T, V_local]`` into a new array like ``x``: as ``overwrite``
  (the same arguments, and ``T`` a multiple of 8), the last block of ``CONFIG.rows`` rows moved
  back inside (below ``CONFIG.rows`` rows, a padded copy of ``x``). Memory: the gradient,
  ``NUM_ROW_INPUTS`` floats per row and, with kept sets, their ``mosaic_tile.kept_words``
  copy (``T * V_local / 8`` bytes)."""
  num_rows, num_columns = x.shape
  _check_shape(x, layout)
  stages = _default_stages(x.dtype) if stages is None else stages
  padded = max(num_rows, CONFIG.rows)
  blocks = mosaic_rows.block_rows(padded)
  bound = num_columns if limit is None else limit
  rows = _row_inputs(tokens, saved, cotangents, column_start, bound)
  rows = chunking.pad_rows(rows.T, padded, 0).T[:, blocks].transpose(1, 0, 2)
  words = None if tokens.kept is None else mosaic_tile.segment_kept_words(
      tokens.kept, tokens.labels - column_start, padded, layout)
  grad = _kernel(chunking.pad_rows(x, padded), rows, words, layout=layout, in_place=False,
                 masked=limit is not None, stages=stages, interpret=interpret)
  return grad[:num_rows]


def exp_overwrite(e, tiles, tokens: Tokens, saved, cotangents, column_start, *, layout,
                  softcap, interpret, stages=None):
  """The fused head's rows, held as their ``exp(z - m_tile)`` terms, overwritten by ``d
  loss / d (hidden @ weight)`` (in ``e``'s dtype): the fused objective path's ``d``,
  formed without the rows' logits.

  Args:
    e: ``[G, V_local]`` 16-bit, ``mosaic_head.statistics``' terms (``with_exp``), ``G`` a
      multiple of ``CONFIG.rows`` (every block whole: none is moved back), a row a multiple of
      32 bytes.
    tiles: f32 ``[tiles, 4, G]``, the same call's tile statistics: each row's max over
      each tile (the ``m_tile`` of ``e``) and the label's ``z``.
    tokens: the rows' tokens (``inv_temp`` f32; rows not ``valid`` get exactly zero
      gradient, NaN hidden states too). Kept sets and padded columns are already in ``e``
      (0 at their excluded columns).
    saved: ``(m, log s, entropy or None)`` ``[G]`` each, the rows' merged statistics.
    cotangents: ``(g_logp, g_entropy)`` ``[G]`` each, None for a symbolic zero.
    column_start: the global id of the first column.
    layout: the columns' tiling, as the statistics' call had it.
    softcap: the head's softcap (its factor from ``log p``), or None.
    interpret: run in JAX's GPU interpreter (off GPUs: tests).
    stages: tiles in flight per CTA on the way in (as ``overwrite``).

  Returns:
    the gradient, in ``e``'s buffer when ``e`` is dead (an intermediate). Memory: 8 +
    ``tiles`` floats per row (the row inputs and the tiles' shifts).
  """
  num_rows, num_columns = e.shape
  _check_shape(e, layout)
  if num_rows % CONFIG.rows:
    raise ValueError(f"e: {e.shape}, rows a multiple of {CONFIG.rows} expected")
  shift, log_sum, _ = saved
  valid = tokens.valid
  log_norm = jnp.where(valid, shift + log_sum, 0)
  rows = mosaic_tile.stack(mosaic_tile.ExpGradientInputs(
      inv_temp=tokens.inv_temp, log_norm=log_norm,
      **_cotangent_fields(valid, saved, cotangents),
      label_column=tokens.labels - column_start,
      label_capped=jnp.sum(tiles[:, 3], axis=0) / tokens.inv_temp, row_mask=valid))
  blocks = num_rows // CONFIG.rows
  tile_shift = jnp.where(valid, (tiles[:, 0] - shift) - log_sum, 0)  # (m, log s apart)
  stages = _default_stages(e.dtype) if stages is None else stages
  return _kernel(e, _by_block(rows, blocks), None, _by_block(tile_shift, blocks),
                 layout=layout, in_place=True, masked=False, stages=stages, interpret=interpret,
                 softcap=softcap, with_log_p=cotangents[1] is not None or softcap is not None)


def _check_shape(x, layout):
  """A ``ValueError`` unless ``x``'s rows are a multiple of 8, its columns those of
  ``layout`` and a row a multiple of 32 bytes (TMA tiles it: ``mosaic_rows.tiled``)."""
  num_rows, num_columns = x.shape
  if (num_columns != layout.count * layout.width or num_rows % 8
      or not mosaic_rows.tiled(layout, x.dtype)):
    raise ValueError(f"x: {x.shape}, rows a multiple of 8, the columns of {layout} and a "
                     "row a multiple of 32 bytes expected")


def _default_stages(dtype):
  """Tiles in flight per CTA on the way in: as many as fit in ``CONFIG.stage_bytes``
  beside the two output tiles."""
  return max(2, CONFIG.stage_bytes // (CONFIG.rows * TILE * jnp.dtype(dtype).itemsize) - 2)
