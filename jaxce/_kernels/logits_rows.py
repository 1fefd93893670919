"""Full logits rows ``[C, V_local]``: their forward statistics (XLA's two fused passes, or
a one-pass kernel, ``mosaic_rows`` merged by ``mosaic_merge`` or ``triton_rows`` merged by
``triton_merge``, as the plan says)
combined over the vocab shards, and their gradient in one elementwise pass. Shared by the
logits path's per-token and objective kernels and by the fused objective kernel, which
holds a chunk's full rows."""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from jaxce._kernels import chunking, softmax
from jaxce._kernels.mosaic import merge as mosaic_merge, rows as mosaic_rows
from jaxce._kernels.mosaic import rows_grad as mosaic_rows_grad, tile as mosaic_tile
from jaxce._kernels.triton import merge as triton_merge, rows as triton_rows
from jaxce._kernels.config import Tokens


def layout(num_columns: int, vocab_axis) -> mosaic_tile.Segments:
  """The Mosaic kernels' tiling of this shard's ``num_columns`` columns
  (``mosaic_tile.segments``: segments fixed by the whole vocabulary, each tiled from its
  own first column)."""
  return mosaic_tile.segments(num_columns, softmax.num_shards(vocab_axis))


def statistics(x, tokens: Tokens, column_start, config):
  """``(logp, m, log s, entropy or None)``, ``[C]`` each, of the rows ``x [C, V_local]``
  (``tokens``: theirs; ``column_start`` the global id of ``x``'s first column): with the
  ``"mosaic"`` backend (kept sets read with the tiles) or the ``"triton"`` one (no kept
  sets) the row statistics by a one-pass kernel, every shard's gathered in rank order and
  merged by ``mosaic_merge`` or ``triton_merge`` (each row's bits depend on its own
  inputs alone); with XLA's exact sums (``plan.exact_sums``)
  ``softmax.exact_statistics`` (then ``x`` is the logits before ``config.logit_softcap``, which
  it applies); else ``softmax.chunk_statistics`` (one pmax and one psum over the vocab
  axis)."""
  labels, inv_temp, valid, kept = tokens
  backend, interpret = config.plan.backend, config.plan.interpret
  if backend in ("mosaic", "triton"):
    limit = softmax.column_limit(config.plan.mask_vocab, column_start, x.shape[1])
    picked = softmax.label_logit(x, labels, inv_temp, column_start)
    segments = layout(x.shape[1], config.vocab_axis)
    if backend == "mosaic":  # (groups of columns, picked in the first)
      tiles = mosaic_rows.statistics(x, inv_temp, picked,
                                     None if config.plan.mask_vocab is None else limit, kept,
                                     None if kept is None else labels - column_start,
                                     layout=segments, with_entropy=config.with_entropy,
                                     interpret=interpret)
    else:
      m, s, q = triton_rows.row_statistics(x, inv_temp, limit, config.with_entropy,
                                           interpret=interpret)
      tiles = jnp.stack([m, s, q, picked])[None]  # this shard's columns: one tile
      segments = mosaic_tile.Segments(x.shape[1], 1, softmax.num_shards(config.vocab_axis))
    return tile_outputs(tiles, tokens, config, segments)
  if config.plan.exact_sums:
    return softmax.exact_statistics(x, labels, inv_temp, valid, column_start,
                                    config.vocab_size, config.plan.mask_vocab, config.vocab_axis,
                                    config.with_entropy, kept, config.logit_softcap)
  return softmax.chunk_statistics(x, labels, inv_temp, valid, column_start, config.vocab_size,
                                  config.plan.mask_vocab, config.vocab_axis, config.with_entropy,
                                  kept)


def tile_outputs(tiles, tokens: Tokens, config, segments: mosaic_tile.Segments):
  """``(logp, m, log s, entropy or None)``, ``[C]`` each as :func:`statistics` returns
  them, from this shard's tiles' statistics ``[G, 4, C]`` of the rows of ``tokens``, in
  ``segments`` (``merge_tiles``, then ``softmax.finish_outputs``)."""
  logp, m, log_s, entropy = merge_tiles(tiles, config, segments)
  logp, entropy_out = softmax.finish_outputs(logp, entropy, tokens.labels, tokens.valid,
                                             config.vocab_size)
  return logp, m, log_s, entropy_out


def merge_tiles(tiles, config, segments: mosaic_tile.Segments):
  """``(logp before masking, m, log s, entropy or None)`` ``[C]`` of this shard's tiles'
  statistics ``[G, 4, C]`` (by the plan's backend: ``mosaic_merge`` or ``triton_merge``),
  cut into ``segments.count`` equal runs (``layout``: fixed by the whole vocabulary where
  the shards are whole segments). Where one stage does not merge every shard's tiles
  (more than the kernel's ``CONFIG.group``), each run's groups are merged on their shard
  first (``partial_sums``) and only those partial sums are gathered, in rank order, and
  merged (else the tiles themselves): the same bits on every shard, typed as such (the
  gather's output is invariant over the vocabulary's axes, so no collective follows the
  merge), and at every shard count whose shards are whole segments. Memory and traffic:
  the gathered partial sums, ``1 / CONFIG.group`` of the tiles' bytes."""
  kernel = mosaic_merge if config.plan.backend == "mosaic" else triton_merge
  options = dict(with_entropy=config.with_entropy, interpret=config.plan.interpret)
  if tiles.shape[0] * softmax.num_shards(config.vocab_axis) > kernel.CONFIG.group:
    tiles = kernel.partial_sums(tiles, segments=segments.count, **options)
  if config.vocab_axis is not None:
    tiles = lax.all_gather(tiles, config.vocab_axis, axis=0, tiled=True, to="invarying")
  return kernel.merge(tiles, **options)


def forward(x, tokens: Tokens, config):
  """``((logp,) or (logp, entropy), (m, log s, entropy or None))`` of every row of
  ``x [T, V_local]`` (no gradient): the outputs and the statistics the gradient needs.
  The Mosaic or Triton kernel reads all rows in one pass; XLA's statistics run in a scan
  over ``config.plan.chunk`` rows (a clamped last chunk, no copy)."""
  num_tokens, num_columns = x.shape
  with_entropy = config.with_entropy
  column_start = softmax.shard_column_start(num_columns, config.vocab_axis)
  if config.plan.backend in ("mosaic", "triton"):
    logp, m, log_s, entropy_out = statistics(x, tokens, column_start, config)
    return (logp,) + ((entropy_out,) if with_entropy else ()), (m, log_s, entropy_out)
  chunk = config.plan.chunk

  def step(_, i):
    start = chunking.chunk_start(i, num_tokens, chunk)
    logp, m, log_s, entropy = statistics(chunking.take_rows(x, start, chunk),
                                         tokens.rows(start, chunk), column_start, config)
    return None, (logp, m, log_s) + ((entropy,) if with_entropy else ())

  _, stacked = lax.scan(step, None, jnp.arange(chunking.num_chunks(num_tokens, chunk)))
  logp, m, log_s, *entropy = (chunking.unchunk(s, num_tokens) for s in stacked)
  # Residuals: m, log s and the entropy ([T] each; ignored rows get no gradient).
  return (logp,) + tuple(entropy), (m, log_s, entropy[0] if with_entropy else None)


def gradient(x, tokens: Tokens, saved, cotangents, mask_vocab, column_start, config=None):
  """``d loss / d x`` of logits rows ``x [C, V_local]`` (in ``x``'s dtype) from their
  tokens, the statistics the forward saved (``(m, log s, entropy or None)``) and the
  per-token cotangents (``(g_logp, g_entropy)``, ``[C]`` each; ``None`` for a symbolic
  zero): one elementwise pass. ``column_start``: the global id of ``x``'s first column.
  Where ``config``'s plan says so (``kept_grad_kernel``: all the rows, with kept sets),
  the pass is ``mosaic_rows_grad``'s kernel, which reads the kept words with its tiles;
  else (or without ``config``: a chunk of rows) XLA's fused pass."""
  labels, inv_temp, valid, kept = tokens
  if config is not None and config.plan.kept_grad_kernel:
    limit = softmax.kernel_limit(mask_vocab, column_start, x.shape[1])
    return mosaic_rows_grad.gradient(x, tokens, saved, cotangents, column_start, limit,
                                     layout=layout(x.shape[1], config.vocab_axis),
                                     interpret=config.plan.interpret)
  (shift, log_sum, entropy), (g_logp, g_entropy) = saved, cotangents
  if kept is not None:
    kept = softmax.kept_columns(kept, 0, x.shape[1], labels - column_start)
  z = softmax.scaled_logits(x, inv_temp, column_start, mask_vocab, kept=kept)
  dz = softmax.logit_grad(z, labels - column_start, shift, log_sum, entropy, g_logp,
                          g_entropy, valid)
  return (dz * inv_temp[:, None].astype(dz.dtype)).astype(x.dtype)
