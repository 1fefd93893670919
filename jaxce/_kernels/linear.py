"""The fused LM-head path's kernel: log-prob and entropy of ``hidden @ weight`` without
the logits, on arrays the front door has checked and flattened.

Both passes walk a grid of ``[C, Vb]`` tiles, vocab blocks outer and token chunks
inner, recomputing ``hidden_chunk @ weight_block`` for each tile (operands in the
inputs' common dtype, as ``hidden @ weight`` would promote them; f32 accumulation):

* forward: an online softmax folds each tile into per-token running sums ``(m, s, q)``
  and the label's logit, ``[T]`` f32 each; shards combine them with one pmax + one psum.
  The tile's own statistics take two XLA passes over it, or one with the Triton kernel
  of ``triton_rows``; with the ``"mosaic"`` backend one Mosaic GPU kernel
  (``mosaic_head``) runs the whole forward, the tiles' statistics formed in registers.
* backward: each tile's ``d logits`` (cast to the operand dtype) feeds two matmuls:
  ``d W_block = hidden_chunkᵀ @ d`` accumulates in f32 over the token chunks of the
  block and is then written once; ``d hidden += d @ W_blockᵀ`` accumulates in an f32
  ``[T, D]`` buffer, all-reduced over ``vocab_axis`` once at the end (with the ``"mosaic"``
  backend each tile's ``d logits`` is formed in its matmul's epilogue, ``mosaic_head``).
  With more tokens than columns (the plan's ``backward_order``) the loops swap: each
  chunk's ``d hidden`` rows sum over the blocks in an f32 ``[chunk, D]`` carry and are
  written once, and ``d W`` sums over the chunks in an f32 array like the weight, so
  nothing grows with T.

With the ``"mosaic"`` backend each token's outputs are batch-invariant by construction
(``mosaic_head``'s tiles merged in the columns' order by ``mosaic_merge``). A plan with
XLA's exact sums (``plan.exact_sums``) runs the forward differently: chunks of
``matmul_tile[0]`` tokens, each chunk's ``[C, V_local]`` logits by ``matmul_tile``-shaped
matmuls (``head.invariant_logits``) and their exact statistics
(``logits_rows.statistics``), so each token's outputs are the same bits whatever the
call around it.

No ``[T, V]`` (or ``[T, V_local]``) buffer exists at any time. The forward's XLA and
Triton loops clamp a ragged last chunk or block back inside the array (its overlap masked
so nothing counts twice; the planner picks chunks that divide ``T`` where it can). The
backward, and the Mosaic forward, walk exact token chunks (the plan's ``chunks``): equal chunks,
then one call on the rows left, so no row is computed twice whatever ``T``; with the Mosaic
kernels the backward's vocab blocks are exact too (the columns past the last whole block
run as one narrower block), so no column is either. The Mosaic kernels take any count of
rows that is a multiple of 8, at least 256 (``mosaic_head.padded_rows``: other calls are
padded with ignored rows), covering it with 256-row blocks whose last is moved back
inside: a call's work is its rows rounded up to 256.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from jaxce._kernels import chunking, head, logits_rows, plumbing, softmax
from jaxce._kernels.mosaic import head as mosaic_head
from jaxce._kernels.triton import rows as triton_rows
from jaxce._kernels.config import Config, Tokens


def logprobs_entropy(hidden, weight, bias, tokens: Tokens, config: Config):
  """``hidden [T, D]``, ``weight`` (``[D, V_local]``, or ``[V_local, D]``), ``bias``
  ``[V_local]`` or None, and the ``tokens`` -> ``(logp [T],)`` or ``(logp, entropy)`` in
  the compute dtype; differentiable in ``hidden``, ``weight`` and ``bias`` (jitted once per
  configuration).

  Memory: no ``[T, V]`` array. Forward: two f32 ``[chunk, block]`` tiles, the weight
  block being read and O(T). Backward: ``d hidden`` and ``d weight`` (the outputs), two
  f32 tiles and either (vocab order) an f32 ``[T, D]`` accumulator for ``d hidden`` (none
  with ``hidden_grad_accumulation="output"``) and an f32 ``[D, block]`` one for the weight block, or
  (``token_outer``) an f32 accumulator like the weight and an f32 ``[chunk, D]`` one.
  """
  num_tokens, padded = hidden.shape[0], config.plan.rows
  if num_tokens < padded:
    # Ignored rows up to the plan's rows (the Mosaic kernels' multiple of 8 rows: a copy
    # of hidden, which the backward keeps in place of the original): fewer than 8, or up
    # to 256 for a short call.
    hidden = chunking.pad_rows(hidden, padded)
    out = _jitted_linear_logprobs_entropy(hidden, weight, bias, tokens.padded(padded),
                                          config=config)
    return tuple(o[:num_tokens] for o in out)
  return _jitted_linear_logprobs_entropy(hidden, weight, bias, tokens, config=config)


def _grid(num_tokens, num_columns, chunk, block):
  """``(vocab blocks, token chunks)``: the static trip counts of the forward's two loops."""
  return chunking.num_chunks(num_columns, block), chunking.num_chunks(num_tokens, chunk)


@plumbing.custom_vjp("config")
def _linear_logprobs_entropy(hidden, weight, bias, tokens, config):
  """``hidden [T, D]``, ``weight [D, V_local]`` -> ``(logp [T],)`` or ``(logp, entropy)``."""
  return _forward(hidden, weight, bias, tokens, config)[0]


def _forward(hidden, weight, bias, tokens, config):
  if config.plan.exact_sums:
    return _invariant_forward(hidden, weight, bias, tokens, config)
  num_tokens, num_columns = hidden.shape[0], weight.shape[config.vocab_dim]
  chunk, block = config.plan.chunk, config.plan.block
  n_blocks, n_chunks = _grid(num_tokens, num_columns, chunk, block)
  shard_start = softmax.shard_column_start(num_columns, config.vocab_axis)
  dtype = head.dtypes(hidden, weight)[1]
  outer = tokens  # the outputs vary like the tokens, not per shard
  hidden, weight, bias, *arrays = plumbing.unify_varying((hidden, weight, bias, *tokens),
                                                         config.vocab_axis)
  tokens = Tokens(*arrays)
  if config.plan.backend == "mosaic":
    logp, m, log_s, entropy = _mosaic_statistics(hidden, weight, tokens, shard_start, config)
    logp, entropy_out = softmax.finish_outputs(logp, entropy, outer.labels, outer.valid,
                                               config.vocab_size)
    out = (logp,) + ((entropy_out,) if config.with_entropy else ())
    return out, (m, log_s, entropy)
  m, s, q = softmax.running_start(num_tokens, dtype, config.with_entropy, tokens.inv_temp)
  picked = jnp.zeros_like(s)

  def block_step(carry, j):
    col = chunking.chunk_start(j, num_columns, block)
    first_column = shard_start + j * block  # earlier blocks own the columns below
    w_cols = lax.dynamic_slice_in_dim(weight, col, block, config.vocab_dim)
    b_cols = None if bias is None else lax.dynamic_slice_in_dim(bias, col, block, 0)

    def chunk_step(carry, i):
      start = chunking.chunk_start(i, num_tokens, chunk)
      h, chunk_tokens, (m, s, q, picked) = chunking.take_rows(
          (hidden, tokens, carry), start, chunk)
      x = head.tile_logits(h, w_cols, b_cols, config.logit_softcap, config.vocab_dim,
                           config.plan.precision)
      if config.plan.backend == "triton":  # the tile's columns: ids in [first_column, mask_vocab)
        tile_start = shard_start + col
        limit = softmax.column_limit(config.plan.mask_vocab, tile_start, block)
        tile_m, tile_s, tile_q = triton_rows.row_statistics(
            x, chunk_tokens.inv_temp, limit, config.with_entropy,
            start=first_column - tile_start, interpret=config.plan.interpret)
        new = softmax.merge_statistics(m, s, q, tile_m, tile_s,
                                       tile_q if config.with_entropy else None)
      else:
        kept_tile = _tile_kept(chunk_tokens, col, block, shard_start)
        z = softmax.scaled_logits(x, chunk_tokens.inv_temp, shard_start + col,
                                  config.plan.mask_vocab, first_column, kept_tile)
        new = softmax.accumulate_tile(m, s, q, z)
      new += (picked + softmax.label_logit(x, chunk_tokens.labels, chunk_tokens.inv_temp,
                                           shard_start + col, first_column),)
      fresh = chunking.fresh_rows(i, start, chunk)  # the clamped chunk's overlap is done
      return tuple(None if c is None else chunking.write_fresh(c, n, start, fresh, old=o)
                   for c, n, o in zip(carry, new, (m, s, q, picked))), None

    carry, _ = lax.scan(chunk_step, carry, jnp.arange(n_chunks))
    return carry, None

  (m, s, q, picked), _ = lax.scan(block_step, (m, s, q, picked), jnp.arange(n_blocks))
  return _finish_forward(m, s, q, picked, outer, config)


def _invariant_forward(hidden, weight, bias, tokens, config):
  """The batch-invariant forward: ``(outputs, (m, log s, entropy))`` as ``_forward``'s.
  Chunks of ``matmul_tile[0]`` tokens (fewer tokens are padded with ignored zero rows, so
  the matmul keeps its shape); each holds its f32 ``[C, V_local]`` logits."""
  chunk, block = config.plan.matmul_tile
  num_tokens, num_columns = hidden.shape[0], weight.shape[config.vocab_dim]
  padded = max(num_tokens, chunk)
  hidden, tokens = chunking.pad_rows(hidden, padded), tokens.padded(padded)
  shard_start = softmax.shard_column_start(num_columns, config.vocab_axis)

  def step(_, i):
    start = chunking.chunk_start(i, padded, chunk)
    x = head.invariant_logits(chunking.take_rows(hidden, start, chunk), weight, bias,
                              config.vocab_dim, block, config.plan.precision)
    return None, logits_rows.statistics(x, tokens.rows(start, chunk), shard_start, config)

  _, stacked = lax.scan(step, None, jnp.arange(chunking.num_chunks(padded, chunk)))
  logp, m, log_s, entropy = (None if s is None else chunking.unchunk(s, padded)[:num_tokens]
                             for s in stacked)
  out = (logp,) + ((entropy,) if config.with_entropy else ())
  return out, (m, log_s, entropy)


def _mosaic_statistics(hidden, weight, tokens, shard_start, config):
  """``(logp, m, log s, entropy or None)`` ``[T]`` (before masking) by the Mosaic GPU
  kernel, one call per chunk of the plan's ``kernel_chunks``, and
  ``mosaic_merge`` (``logits_rows.merge_tiles``): each token's tiles merged in the columns'
  order, each shard's first stage where its tiles are and the partial sums gathered in rank
  order. Each token's bits depend on its own inputs alone."""
  num_tokens, num_columns = hidden.shape[0], weight.shape[config.vocab_dim]
  limit = softmax.kernel_limit(config.plan.mask_vocab, shard_start, num_columns)
  segments = logits_rows.layout(num_columns, config.vocab_axis)

  def chunk_step(_, start, size):
    h, chunk_tokens = chunking.take_rows((hidden, tokens), start, size)
    tiles = mosaic_head.statistics(
        h, weight, chunk_tokens.labels, chunk_tokens.inv_temp, limit, chunk_tokens.kept,
        column_start=shard_start,
        vocab_dim=config.vocab_dim, softcap=config.logit_softcap, with_entropy=config.with_entropy,
        interpret=config.plan.interpret, num_cores=config.plan.num_cores, layout=segments)
    return None, logits_rows.merge_tiles(tiles, config, segments)

  chunks = config.plan.kernel_chunks
  return chunking.scan_chunks(chunk_step, None, chunks)[1]


def _tile_kept(tokens, col, block, shard_start):
  """The ``[chunk, block]`` kept set of a chunk's ``tokens`` in the tile at local column
  ``col``, or None without kept sets."""
  if tokens.kept is None:
    return None
  return softmax.kept_columns(tokens.kept, col, block, tokens.labels - (shard_start + col))


def _finish_forward(m, s, q, picked, tokens, config):
  """Outputs and residuals from this device's running statistics."""
  m, s, q, picked = softmax.combine_shards(m, s, q, picked, config.vocab_axis)
  log_s, entropy = softmax.finish_statistics(s, q)
  logp, entropy_out = softmax.finish_outputs((picked - m) - log_s, entropy, tokens.labels,
                                           tokens.valid, config.vocab_size)
  out = (logp,) + ((entropy_out,) if config.with_entropy else ())
  return out, (m, log_s, entropy)


def _linear_logprobs_entropy_fwd(hidden, weight, bias, tokens, config):
  hidden, weight, bias, tokens = plumbing.primal_values((hidden, weight, bias, tokens))
  out, saved = _forward(hidden, weight, bias, tokens, config)
  return out, (hidden, weight, bias, tokens, saved)


class _Backward(NamedTuple):
  """What every piece of the fused backward reads: the primals as passed (the gradients
  take their types), the arrays after ``unify_varying`` (``hidden [T, D]``, ``weight``,
  ``bias`` or None, the ``tokens``, the forward's ``saved`` ``(m, log s, entropy)`` and
  the ``cotangents`` ``(g_logp, g_entropy)``, each ``[T]`` or None), the row chunks, the
  shard's first column and the call's ``config``."""
  primals: tuple
  hidden: Any
  weight: Any
  bias: Any
  tokens: Tokens
  saved: tuple
  cotangents: tuple
  chunks: chunking.RowChunks
  shard_start: Any
  config: Config

  @property
  def num_blocks(self) -> int:
    return chunking.num_chunks(self.weight.shape[self.config.vocab_dim], self.config.plan.block)


def _linear_logprobs_entropy_bwd(config, residuals, cotangents):
  primals = residuals[:3]
  hidden, weight, bias, tokens, saved = residuals
  hidden, weight, bias, *arrays = plumbing.unify_varying(
      (hidden, weight, bias, *tokens, *saved), config.vocab_axis)
  g_logp = plumbing.symbolic_zero_to_none(cotangents[0])
  g_entropy = plumbing.symbolic_zero_to_none(cotangents[1]) if config.with_entropy else None
  if g_logp is None and g_entropy is None:
    return (jnp.zeros_like(primals[0]), jnp.zeros_like(primals[1]),
            None if bias is None else jnp.zeros_like(primals[2]), None)
  num_columns = weight.shape[config.vocab_dim]
  bwd = _Backward(primals, hidden, weight, bias, Tokens(*arrays[:4]), tuple(arrays[4:]),
                  (g_logp, g_entropy),
                  config.plan.chunks,
                  softmax.shard_column_start(num_columns, config.vocab_axis), config)
  grads = (_token_outer_grads if config.plan.backward_order == "token" else
           _vocab_outer_grads)(bwd)
  grads = tuple(None if g is None else plumbing.reduce_to_varying(g, p)
                for g, p in zip(grads, primals))
  return grads + (None,)


def _chunk_rows(bwd: _Backward, start, size):
  """The rows ``[start, start + size)``: ``hidden`` (ignored rows zeroed: their NaN must
  not reach ``d W``), tokens, saved statistics, cotangents and the row mask (valid),
  taken once per chunk for all its tiles."""
  h, chunk_tokens, chunk_saved, chunk_cotangents = chunking.take_rows(
      (bwd.hidden, bwd.tokens, bwd.saved, bwd.cotangents), start, size)
  row_mask = chunk_tokens.valid
  return (jnp.where(row_mask[:, None], h, 0), chunk_tokens, chunk_saved, chunk_cotangents,
          row_mask)


def _tile_grads(bwd: _Backward, rows, w_cols, b_cols, col, first_column, width=None,
                dw_dtype=None, dh_dtype=None):
  """The tile of a chunk's ``rows`` (``_chunk_rows``) and ``width`` columns (the plan's
  block unless given) from local column ``col``: its ``d hidden`` rows ``[chunk, D]`` (f32,
  or ``dh_dtype`` when given: rounded once by the matmul),
  its ``d W`` columns (f32, or ``dw_dtype`` when given: rounded once by the matmul) and
  its ``d bias`` columns (None without a bias), exactly 0 in a clamped block's overlap and
  at ignored rows. ``first_column``: the global id of the block's first column of its own
  (past a clamped block's overlap), or None for a block with no overlap."""
  config = bwd.config
  width = config.plan.block if width is None else width
  h, chunk_tokens, chunk_saved, chunk_cotangents, row_mask = rows
  labels, inv_temp, _, _ = chunk_tokens
  shard_start, vocab_dim = bwd.shard_start, config.vocab_dim
  overlap = first_column is not None
  first_column = first_column if overlap else shard_start + col
  label_column = labels - (shard_start + col)
  label_column = jnp.where(labels >= first_column, label_column, -1)
  d_bias = None
  if config.plan.backend == "mosaic":  # d formed in the matmul's epilogue (no bias here)
    kept_words = None if chunk_tokens.kept is None else lax.dynamic_slice_in_dim(
        chunk_tokens.kept, col // 32, -(-width // 32), axis=1)  # (col: a multiple of 128)
    limit = softmax.kernel_limit(config.plan.mask_vocab, shard_start + col, width)
    # A block that is not whole tiles (a ragged vocabulary's last; the block is a copy
    # already) is zero-padded to whole tiles, its padding masked as past the limit: every
    # tile then takes the 128-byte swizzle, at any width. Its d W columns are the
    # padded matmul's first ``width``.
    padding = -width % mosaic_head.TILE_N
    if padding:
      w_cols = head.pad_columns(w_cols, width + padding, vocab_dim)
      limit = width if limit is None else jnp.minimum(limit, width)
    d = mosaic_head.logits_grad(
        h, w_cols, label_column, inv_temp, chunk_saved, chunk_cotangents, row_mask,
        kept_words, limit=limit,
        first_kept=first_column - (shard_start + col) if overlap else None,
        vocab_dim=vocab_dim, softcap=config.logit_softcap, interpret=config.plan.interpret,
        num_cores=config.plan.num_cores)
  else:
    x = head.tile_logits(h, w_cols, b_cols, config.logit_softcap, vocab_dim, config.plan.precision)
    kept_tile = _tile_kept(chunk_tokens, col, width, shard_start)
    z = softmax.scaled_logits(x, inv_temp, shard_start + col, config.plan.mask_vocab,
                              first_column, kept_tile)
    dz = softmax.logit_grad(z, label_column, *chunk_saved, *chunk_cotangents, row_mask)
    dx = head.logits_input_grad(dz, inv_temp, x, config.logit_softcap, row_mask)
    d = dx.astype(head.dtypes(bwd.hidden, bwd.weight)[0])
    d_bias = None if bwd.bias is None else jnp.sum(dx, axis=0)
  dw_tile = head.weight_grad(h, d, vocab_dim, config.plan.precision, dw_dtype)
  dh_rows = head.contract(d, w_cols, 1, vocab_dim, config.plan.precision, dh_dtype)
  if dw_tile.shape[vocab_dim] > width:  # (a padded block's)
    dw_tile = lax.slice_in_dim(dw_tile, 0, width, axis=vocab_dim)
  return dh_rows, dw_tile, d_bias


def _block_slices(bwd: _Backward, j):
  """Block ``j``'s first local column, weight and bias columns, first global id."""
  block, vocab_dim = bwd.config.plan.block, bwd.config.vocab_dim
  col = chunking.chunk_start(j, bwd.weight.shape[vocab_dim], block)
  w_cols = lax.dynamic_slice_in_dim(bwd.weight, col, block, vocab_dim)
  b_cols = None if bwd.bias is None else lax.dynamic_slice_in_dim(bwd.bias, col, block, 0)
  return col, w_cols, b_cols, bwd.shard_start + j * block


def _add_rows(d_hidden, dh_rows, start):
  """``d_hidden`` with ``dh_rows`` added to its rows from ``start``, in its dtype."""
  old_rows = lax.dynamic_slice_in_dim(d_hidden, start, dh_rows.shape[0], 0)
  return lax.dynamic_update_slice_in_dim(d_hidden, (old_rows + dh_rows).astype(old_rows.dtype),
                                         start, 0)


def _write_block(bwd: _Backward, grads, col, dw_block, db_block):
  """``(d hidden, d weight, d bias)`` with a block's ``d W`` (and ``d bias``) columns from
  local column ``col`` written in the primals' dtypes."""
  d_hidden, d_weight, d_bias = grads
  d_weight = lax.dynamic_update_slice_in_dim(d_weight, dw_block.astype(d_weight.dtype), col,
                                             bwd.config.vocab_dim)
  if d_bias is not None:
    d_bias = lax.dynamic_update_slice_in_dim(d_bias, db_block.astype(d_bias.dtype), col, 0)
  return d_hidden, d_weight, d_bias


def _vocab_outer_grads(bwd: _Backward):
  """The backward with vocab blocks outer and token chunks inner: ``(d hidden, d weight, d
  bias or None)``, not yet reduced to the primals' varying types. Each block's ``d W``
  (and ``d bias``) columns sum over the chunks in f32 and are written once; ``d hidden``
  sums over the blocks in an f32 ``[T, D]`` array (in hidden's dtype with
  ``hidden_grad_accumulation="output"``), all-reduced over the vocab axis at the end.

  With one chunk (all ``T`` rows: the plan's default up to tens of thousands of tokens)
  its rows are the same for every block: they are taken and masked once, and each block's
  ``d W`` comes out of its matmul in the weight's dtype (no f32 sum, no cast pass). The
  blocks write every column of ``d W``, so it starts uninitialized (no zeros written)."""
  config, hidden, weight, bias, chunks = bwd.config, bwd.hidden, bwd.weight, bwd.bias, bwd.chunks
  n_blocks, vocab_dim, block = bwd.num_blocks, config.vocab_dim, config.plan.block
  num_columns = weight.shape[vocab_dim]
  # With the Mosaic kernels a ragged vocabulary's last block is as wide as the columns left
  # (any width: ``_tile_grads`` pads it to whole tiles), before the scan (after it, XLA may
  # run its kernel early and hold its tiles through the scan): no column is done twice,
  # and no block masks any (no vocab_size or kept sets). Otherwise its clamped last block
  # runs first: its overlap with the block before it gets exact zeros, which that block's
  # own columns then overwrite (no read-back).
  narrow = config.plan.own_blocks
  whole = _chunk_rows(bwd, 0, chunks.total) if len(chunks.sizes) == 1 else None
  dtype = head.dtypes(hidden, weight)[1]
  accumulator_dtype = hidden.dtype if config.hidden_grad_accumulation == "output" else dtype
  # (every column is written by a block: no zeros; the weight's varying type inside shard_map)
  d_weight = plumbing.unify_varying((lax.empty(weight.shape, weight.dtype), weight),
                                    config.vocab_axis)[0]
  carry = (jnp.zeros_like(hidden, accumulator_dtype), d_weight,
           None if bias is None else jnp.zeros_like(bias))
  full_blocks = num_columns // block if narrow else n_blocks
  if full_blocks * block < num_columns:  # (narrow: the columns left)
    col = full_blocks * block
    width = num_columns - col
    carry = _block_grads(bwd, whole, carry, col, _columns(weight, col, width, vocab_dim),
                         None if bias is None else _columns(bias, col, width, 0), None, width)
  (d_hidden, d_weight, d_bias), _ = lax.scan(
      functools.partial(_vocab_block_step, bwd, whole, narrow), carry, jnp.arange(full_blocks))
  d_hidden = plumbing.sum_over_shards(d_hidden, config.vocab_axis, bwd.primals[0],
                                      hidden.dtype, config.gathered)
  return d_hidden, d_weight, d_bias


def _vocab_block_step(bwd: _Backward, whole, narrow, grads, k):
  """The vocab-outer scan's step ``k``: block ``k`` of the blocks of their own columns
  (``narrow``: the Mosaic kernels), or of the clamped blocks, the last one first."""
  block, vocab_dim, n_blocks = bwd.config.plan.block, bwd.config.vocab_dim, bwd.num_blocks
  if narrow:  # (blocks of their own columns: no overlap)
    col = k * block
    w_cols = lax.dynamic_slice_in_dim(bwd.weight, col, block, vocab_dim)
    b_cols = None if bwd.bias is None else lax.dynamic_slice_in_dim(bwd.bias, col, block, 0)
    return _block_grads(bwd, whole, grads, col, w_cols, b_cols, None, block), None
  ragged = bwd.weight.shape[vocab_dim] % block != 0
  j = (k + n_blocks - 1) % n_blocks if ragged else k
  col, w_cols, b_cols, first_column = _block_slices(bwd, j)
  return _block_grads(bwd, whole, grads, col, w_cols, b_cols, first_column, block), None


def _block_grads(bwd: _Backward, whole, grads, col, w_cols, b_cols, first_column, width):
  """``grads`` (``(d hidden, d weight, d bias)``) with a vocab block's added: its ``d W``
  (and ``d bias``) columns summed over the token chunks and written once, its ``d
  hidden`` rows added. ``whole``: the rows of the plan's one chunk (``_chunk_rows``),
  taken once for every block, or None (several chunks, scanned)."""
  d_hidden, d_weight, d_bias = grads
  # (``d hidden``'s rows come out of their matmul in the sum's dtype: an f32 sum, or with
  # hidden_grad_accumulation="output" hidden's own, so no f32 [chunk, D] array is made)
  if whole is not None:
    dh_rows, dw_block, db_block = _tile_grads(bwd, whole, w_cols, b_cols, col, first_column,
                                              width, dw_dtype=bwd.weight.dtype,
                                              dh_dtype=d_hidden.dtype)
    return _write_block(bwd, (_add_rows(d_hidden, dh_rows, 0), d_weight, d_bias), col,
                        dw_block, db_block)
  step = lambda start, size: _tile_grads(bwd, _chunk_rows(bwd, start, size), w_cols, b_cols,
                                         col, first_column, width, dh_dtype=d_hidden.dtype)

  def chunk_step(carry, start, size):
    d_hidden, dw_block, db_block = carry
    dh_rows, dw_tile, db_tile = step(start, size)
    return (_add_rows(d_hidden, dh_rows, start), dw_block + dw_tile,
            None if db_block is None else db_block + db_tile), None

  # The first tile starts the block's f32 sums (no zero-filled accumulator to add to).
  dh_rows, dw_block, db_block = step(0, bwd.chunks.sizes[0])
  (d_hidden, dw_block, db_block), _ = chunking.scan_chunks(
      chunk_step, (_add_rows(d_hidden, dh_rows, 0), dw_block, db_block), bwd.chunks, first=1)
  return _write_block(bwd, (d_hidden, d_weight, d_bias), col, dw_block, db_block)


class _TokenOuter(NamedTuple):
  """The token-outer backward's vocab blocks: with ``unrolled`` (the plan's
  ``unrolled_blocks``) the blocks' first local columns ``starts`` and ``widths`` (the
  last as wide as the columns left), each with a sum of its own; else one sum like the
  weight (``starts == (0,)``, ``widths == (V_local,)``) that scanned blocks add into."""
  bwd: _Backward
  unrolled: bool
  starts: tuple
  widths: tuple


def _token_outer_grads(bwd: _Backward):
  """The backward with token chunks outer and vocab blocks inner: ``(d hidden, d weight, d
  bias or None)``, not yet reduced to the primals' varying types. Each chunk's ``d
  hidden`` rows are summed over the blocks in an f32 ``[chunk, D]`` carry (all-reduced
  over the vocab axis) and written once; ``d W`` (and ``d bias``) sum over the chunks in
  f32.

  With the Mosaic kernels, up to ``jaxce.plan.MAX_UNROLLED_BLOCKS`` blocks are unrolled
  (the plan's ``unrolled_blocks``), the last one
  as wide as the columns left (no clamped overlap), each with its own sum, so the sum is
  added inside the block's GEMM; each block's tiles are made after the block before it is
  done (one block's tiles live at a time). Otherwise the blocks are scanned, each tile
  added into one sum like the weight (a clamped block's overlap adds exact zeros).

  Memory beyond the outputs: the sums (like the weight) and one chunk's tiles, whatever
  T. The token chunks are the plan's ``chunks``: each row once."""
  config, weight, bias = bwd.config, bwd.weight, bwd.bias
  block, dtype = config.plan.block, head.dtypes(bwd.hidden, weight)[1]
  vocab_dim, num_columns = config.vocab_dim, weight.shape[config.vocab_dim]
  unrolled = config.plan.unrolled_blocks
  starts = tuple(range(0, num_columns, block)) if unrolled else (0,)
  widths = tuple(min(block, num_columns - col) for col in starts) if unrolled else (num_columns,)
  outer = _TokenOuter(bwd, unrolled, starts, widths)
  # d hidden's rows are all-reduced as they are written: the sum has hidden's own type.
  # (zeros_like: the sums take the weight's varying type too)
  carry = (jnp.zeros_like(bwd.primals[0]),
           tuple(jnp.zeros_like(_columns(weight, col, width, vocab_dim), dtype)
                 for col, width in zip(starts, widths)),
           tuple(None if bias is None else jnp.zeros_like(_columns(bias, col, width, 0), dtype)
                 for col, width in zip(starts, widths)))
  (d_hidden, dw_sums, db_sums), _ = chunking.scan_chunks(
      functools.partial(_token_chunk_step, outer), carry, bwd.chunks)
  return (d_hidden, _assemble(starts, dw_sums, weight, vocab_dim),
          None if bias is None else _assemble(starts, db_sums, bias, 0))


def _columns(a, col, width, dim):
  """``a``'s ``width`` columns from ``col`` along ``dim`` (a static slice)."""
  return lax.slice_in_dim(a, col, col + width, axis=dim)


def _token_chunk_step(outer: _TokenOuter, carry, start, size):
  """The token-outer scan's step: the chunk of rows ``[start, start + size)`` over every
  vocab block, its ``d hidden`` rows all-reduced and written once, the sums added to."""
  bwd = outer.bwd
  d_hidden, dw_sums, db_sums = carry
  blocks = _unrolled_blocks if outer.unrolled else _scanned_blocks
  dh_rows, dw_sums, db_sums = blocks(outer, _chunk_rows(bwd, start, size), dw_sums, db_sums)
  dh_rows = plumbing.sum_over_shards(dh_rows, bwd.config.vocab_axis, bwd.primals[0],
                                     d_hidden.dtype, bwd.config.gathered)
  d_hidden = lax.dynamic_update_slice_in_dim(d_hidden, dh_rows, start, 0)
  return (d_hidden, dw_sums, db_sums), None


def _unrolled_blocks(outer: _TokenOuter, rows, dw_sums, db_sums):
  """A chunk's ``rows`` over the unrolled blocks: ``(d hidden rows, the d W sums, the d
  bias sums)``, each block's sum added inside its GEMM."""
  bwd = outer.bwd
  vocab_dim = bwd.config.vocab_dim
  dh_rows, new_dw, new_db = None, [], []
  for col, width, dw_sum, db_sum in zip(outer.starts, outer.widths, dw_sums, db_sums):
    # The block's weight columns are sliced from a barrier on this chunk's values, so
    # XLA cannot hoist the slices out of the chunk loop (a copy of the weight held for
    # the whole backward); each block's tiles wait for the last block's GEMMs (one live).
    # Every output of a barrier is read: XLA drops an operand whose output nothing reads.
    if dh_rows is None:
      weight_here, rows = lax.optimization_barrier((bwd.weight, rows))
    else:
      weight_here, dh_rows, new_dw[-1] = lax.optimization_barrier((bwd.weight, dh_rows,
                                                                   new_dw[-1]))
    w_cols = _columns(weight_here, col, width, vocab_dim)
    b_cols = None if bwd.bias is None else _columns(bwd.bias, col, width, 0)
    dh_tile, dw_tile, db_tile = _tile_grads(bwd, rows, w_cols, b_cols, col, None, width)
    dh_rows = dh_tile if dh_rows is None else dh_rows + dh_tile
    new_dw.append(dw_sum + dw_tile)
    new_db.append(None if db_sum is None else db_sum + db_tile)
  return dh_rows, tuple(new_dw), tuple(new_db)


def _scanned_blocks(outer: _TokenOuter, rows, dw_sums, db_sums):
  """A chunk's ``rows`` over the plan's blocks, scanned: ``(d hidden rows, (the d W sum,),
  (the d bias sum,))``, each tile added into the one sum like the weight."""
  bwd = outer.bwd
  dtype = head.dtypes(bwd.hidden, bwd.weight)[1]

  def block_step(carry, j):
    dh_rows, d_weight, d_bias = carry
    col, w_cols, b_cols, first_column = _block_slices(bwd, j)
    dh_tile, dw_tile, db_tile = _tile_grads(bwd, rows, w_cols, b_cols, col, first_column)
    add = lambda a, t, dim: lax.dynamic_update_slice_in_dim(
        a, lax.dynamic_slice_in_dim(a, col, t.shape[dim], dim) + t, col, dim)
    return (dh_rows + dh_tile, add(d_weight, dw_tile, bwd.config.vocab_dim),
            None if d_bias is None else add(d_bias, db_tile, 0)), None

  dh_rows = jnp.zeros_like(rows[0], dtype)  # (zeros_like: the varying type too)
  (dh_rows, d_weight, d_bias), _ = lax.scan(block_step, (dh_rows, *dw_sums, *db_sums),
                                            jnp.arange(bwd.num_blocks))
  return dh_rows, (d_weight,), (d_bias,)


def _assemble(starts, sums, like, dim):
  """The sums (each from its column in ``starts``) written into one array like ``like`` in
  its dtype, each cast as it is written (no cast pieces beside the output)."""
  out = jnp.zeros_like(like)
  for col, piece in zip(starts, sums):
    out = lax.dynamic_update_slice_in_dim(out, piece.astype(like.dtype), col, dim)
  return out


_linear_logprobs_entropy.defvjp(_linear_logprobs_entropy_fwd, _linear_logprobs_entropy_bwd,
                                symbolic_zeros=True)
# Jitted once per configuration, so repeated eager calls do not recompile.
_jitted_linear_logprobs_entropy = jax.jit(_linear_logprobs_entropy,
                                          static_argnames=("config",))
