"""The fused path's Mosaic GPU forward kernel (``implementation="mosaic"``), run in JAX's
GPU interpreter: its tile statistics against float64, and the whole call against the XLA
path and the float64 reference. On GPUs, ``scripts/gpu_check_mosaic_linear.py`` checks
the compiled kernel the same way (and inside shard_map)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import assert_close, jaxce, kernel_device, reference, value_and_grads
from helpers import skip_module_without_mosaic_interpreter
from jaxce._kernels.mosaic import head as mosaic_head, tile as mosaic_tile

skip_module_without_mosaic_interpreter()


def _inputs(seed, tokens, dim, num_columns, vocab_dim):
  rng = np.random.default_rng(seed)
  hidden = rng.normal(size=(tokens, dim)) * 0.5
  weight = rng.normal(size=(dim, num_columns)) * 2 / np.sqrt(dim)
  weight[:, rng.integers(0, num_columns, 3)] *= 8  # a few peaked columns
  weight[:, 5] += 0.5  # and a shifted one
  hidden, weight = (jnp.asarray(a, jnp.bfloat16) for a in (hidden, weight))
  return rng, hidden, (weight if vocab_dim else weight.T)


def _statistics_f64(hidden, weight, labels, inv_temp, limit, column_start, vocab_dim, softcap):
  """``(m, s, q, picked)`` in float64 numpy, as the kernel defines them."""
  h = np.asarray(hidden, np.float64)
  w = np.asarray(weight, np.float64)
  x = h @ (w if vocab_dim else w.T)
  if softcap is not None:
    x = softcap * np.tanh(x / softcap)
  z = x * np.asarray(inv_temp, np.float64)[:, None]
  z[:, limit:] = -np.inf
  m = z.max(axis=1)
  e = np.exp(z - m[:, None])
  shifted = np.where(e > 0, z - m[:, None], 0.0)
  column = np.asarray(labels) - column_start
  owned = (column >= 0) & (column < limit)
  picked = np.where(owned, z[np.arange(len(z)), np.clip(column, 0, z.shape[1] - 1)], 0.0)
  return m, e.sum(axis=1), (e * shifted).sum(axis=1), picked


def _merged(tiles):
  """A row's ``(m, s, q, picked)`` over all its tiles (``[G, 4, C]``), by ``softmax``."""
  from jaxce._kernels import softmax
  m_tiles, s_tiles, q_tiles, picked = (tiles[:, i] for i in range(4))
  m = jnp.max(m_tiles, axis=0)
  s, q = softmax.merge_running(m_tiles, s_tiles, q_tiles, m[None])
  return m, jnp.sum(s, axis=0), jnp.sum(q, axis=0), jnp.sum(picked, axis=0)


@pytest.mark.parametrize("tokens,dim,num_columns,vocab_dim,softcap,padded", [
    (256, 64, 128, 1, None, True),    # one tile
    (512, 128, 384, 1, None, True),   # two row blocks, three vocab tiles
    (768, 192, 256, 0, None, True),   # [V, D] weight, three row blocks
    (512, 128, 384, 0, 30.0, True),   # softcap
    (264, 64, 128, 1, None, True),    # ragged rows: the last row block moved back by 248 rows
    (520, 128, 384, 0, 30.0, True),   # ragged rows: three row blocks, the last moved back
    (512, 128, 384, 1, None, False),  # no padded columns: no column masked
    (520, 128, 384, 0, 30.0, False),
    (264, 64, 400, 1, None, True),    # V not a multiple of 128: a partial last tile of 16
    (520, 128, 400, 0, 30.0, False),  # (and a 32-byte swizzle on the [D, V] weight)
    (256, 64, 224, 1, None, False),   # one whole tile and a partial one of 96 (64-byte)
])
def test_tile_statistics_match_float64(tokens, dim, num_columns, vocab_dim, softcap, padded):
  rng, hidden, weight = _inputs(tokens + num_columns, tokens, dim, num_columns, vocab_dim)
  column_start = 10  # this weight holds ids [10, 10 + V): some labels lie outside it
  labels = jnp.asarray(rng.integers(0, num_columns + 30, tokens), jnp.int32)
  inv_temp = jnp.asarray(rng.uniform(0.5, 2.0, tokens), jnp.float32)
  limit = num_columns - 9 if padded else None  # padded columns at the end, or none
  # (one segment: its tiles from column 0, as a shard of its own)
  kw = dict(column_start=column_start, vocab_dim=vocab_dim, softcap=softcap,
            with_entropy=True, layout=mosaic_tile.Segments(num_columns, 1, 1),
            **kernel_device())
  tiles = mosaic_head.statistics(hidden, weight, labels, inv_temp, limit, **kw)
  assert tiles.shape == (-(-num_columns // 128), 4, tokens)
  # With the exp(z - m) terms (the fused objective path's rows): the same statistics'
  # bits, and each column's exp(z - m_tile) in hidden's dtype, 0 past the limit; rounded
  # once from f32 terms whose z - m is off by the logits' rounding.
  same_tiles, e = mosaic_head.statistics(hidden, weight, labels, inv_temp, limit, **kw,
                                         with_exp=True)
  assert np.array_equal(np.asarray(same_tiles).view(np.uint32),
                        np.asarray(tiles).view(np.uint32))
  x = np.asarray(hidden, np.float64) @ np.asarray(weight if vocab_dim else weight.T, np.float64)
  x = x if softcap is None else softcap * np.tanh(x / softcap)
  bound = num_columns if limit is None else limit
  z = np.where(np.arange(num_columns) < bound, x * np.asarray(inv_temp)[:, None], -np.inf)
  padded_z = np.pad(z, [(0, 0), (0, -num_columns % 128)], constant_values=-np.inf)
  tile_max = np.repeat(np.max(padded_z.reshape(tokens, -1, 128), axis=2), 128,
                       axis=1)[:, :num_columns]
  want_e = np.exp(z - tile_max)
  assert e.shape == (tokens, num_columns) and e.dtype == hidden.dtype
  assert np.all(np.asarray(e, np.float64)[:, bound:] == 0)
  error = np.abs(np.asarray(e, np.float64) - want_e)
  scale = np.max(np.abs(z[np.isfinite(z)]))
  bad = error > (2**-8 + 4e-6 * scale) * want_e  # (bf16: 8 significant bits)
  assert not bad.any(), (np.asarray(e, np.float64)[bad][:5], want_e[bad][:5])
  got = _merged(tiles)
  want = _statistics_f64(hidden, weight, labels, inv_temp,
                         num_columns if limit is None else limit, column_start, vocab_dim,
                         softcap)
  # m and picked: f32 rounding of the logits, relative to their size. s: each exp(z - m)
  # is off by about |z - m| * 2**-24 (|z - m| reaches ~30 here), relative. q = sum of
  # exp(z - m) (z - m): each term's z - m is off by the logits' rounding, so its error is
  # relative to s times their size (not to q, which is ~0 for a peaked row).
  scale = np.max(np.abs(want[0]))
  for name, g, w in zip(("m", "s", "q", "picked"), got, want):
    relative = dict(s=w, q=want[1] * scale).get(name, scale)
    assert_close(np.asarray(g) / relative, w / relative, 1e-5 if name in ("s", "q") else 2e-6,
                 name)


def test_column_blocks_fill_the_waves_of_the_widths_users_shard_to():
  """The whole tiles of a weight that TMA cannot read in place (every segment's, side by
  side) are read in vocab blocks of at most ``CONFIG.block_bytes``, each a kernel call
  whose last wave of tiles leaves SMs idle: of the fewest blocks, one more, and blocks that
  fill whole waves, the one that leaves the fewest idle, a call counted as
  ``CONFIG.call_waves``. At T = 32768 on 132 SMs a block of 66 tiles is 64 waves: Llama 3's
  128256 over 4 GPUs (2 segments of 125 whole tiles) was read a segment's block of 62 or
  63 tiles at a time, 3.6 waves idle, now 0.6; a local 32064 (4 segments of 62), 0.5.
  Checked over the vocabularies users shard (Qwen3's 151936 over 1, 2, 4 and 8 GPUs,
  Llama 3's 128256 over 1 and 4, DeepSeek-V3's 129280 over 4 and 8, the unpadded 151643
  and GPT-2's 50257), D from 1024 to 8192, ragged and round T, 132, 114 and 78 SMs: every
  whole tile in one block, none wider than allowed, at most two widths, never more idle
  than the fewest blocks; none for fewer than ``CONFIG.min_block_tiles`` tiles."""
  segments = mosaic_tile.segments

  def blocks(layout, rows=32768, depth=4096, cores=132):
    return mosaic_head.column_blocks(layout.count * (layout.width // 128), depth=depth,
                                     dtype=jnp.bfloat16, num_rows=rows, num_cores=cores)

  def idle(widths, rows=32768, cores=132):
    return sum(-(mosaic_head.row_blocks(rows) * b) % cores for b in widths) / cores

  assert segments(32064, 4) == mosaic_tile.Segments(16032, 2, 8)
  assert blocks(segments(32064, 4)) == (66, 66, 66, 52)
  assert idle((63, 62) * 2) > 3.5 and idle(blocks(segments(32064, 4))) < 0.6
  assert blocks(segments(32064)) == (66, 66, 66, 50)  # (4 segments of 8016)
  assert blocks(segments(151936)) == (66,) * 17 + (62,)
  assert blocks(segments(37984, 4), depth=1024) == (296,)  # (fewer calls than waves idle)
  assert mosaic_head.column_blocks(7, depth=4096, dtype=jnp.bfloat16, num_rows=32768,
                                   num_cores=132) == ()
  shards = [(151936, n) for n in (1, 2, 4, 8)] + [(128256, 1), (128256, 4), (129280, 4),
                                                  (129280, 8), (151643, 1), (50257, 1)]
  for vocab, count in shards:
    layout = segments(vocab // count, count)
    tiles = layout.count * (layout.width // 128)
    for depth in (1024, 4096, 5120, 8192):
      most = mosaic_head.CONFIG.block_bytes // (128 * depth * 2)  # (tiles a block)
      for rows in (4096, 8184, 30000, 32768, 262144):
        for cores in (132, 114, 78):
          widths = blocks(layout, rows, depth, cores)
          fewest = -(-tiles // most)
          equal = (-(-tiles // fewest),) * (tiles % fewest) + (tiles // fewest,) * (
              fewest - tiles % fewest)
          shape = (vocab, count, depth, rows, cores)
          assert sum(widths) == tiles and max(widths) <= most and len(set(widths)) <= 2, shape
          assert idle(widths, rows, cores) + 0.25 * len(widths) <= idle(
              equal, rows, cores) + 0.25 * fewest, shape


def _in_one_program(*args, **kw):
  """``mosaic_head.statistics`` of a weight read in several kernel calls, under ``jax.jit`` as
  users' programs run it (in the interpreter, on 2 cores, calls dispatched one by one
  could wait on each other's threads for good)."""
  return jax.jit(lambda *a: mosaic_head.statistics(*a, **kw))(*args)


def _split_inputs(seed, dim, num_columns, vocab_dim, softcap, limit, with_kept, tokens=264):
  """The inputs of ``mosaic_head.statistics`` for a weight read in more than one call: labels
  in and out of the shard (column 10 on), temperatures, a ``limit`` (or None), kept sets
  (or None), and its keyword arguments."""
  rng, hidden, weight = _inputs(seed, tokens, dim, num_columns, vocab_dim)
  labels = jnp.asarray(rng.integers(0, num_columns + 30, tokens), jnp.int32)
  inv_temp = jnp.asarray(rng.uniform(0.5, 2.0, tokens), jnp.float32)
  kept = (jnp.asarray(rng.integers(0, 2**32, (tokens, -(-num_columns // 32)), dtype=np.uint32))
          if with_kept else None)
  kw = dict(column_start=10, vocab_dim=vocab_dim, softcap=softcap, with_entropy=True,
            **kernel_device())
  return (hidden, weight, labels, inv_temp, None if limit is None else jnp.int32(limit), kept,
          kw)


@pytest.mark.parametrize("softcap,padded,with_kept,with_exp,vocab_dim,num_columns", [
    (None, False, False, False, 1, 8 * 128 + 96), (30.0, True, True, False, 1, 9 * 128 + 96),
    (None, False, True, False, 1, 8 * 128 + 91), (None, True, False, False, 0, 8 * 128 + 91),
    (None, False, False, True, 1, 8 * 128 + 96), (30.0, True, True, True, 1, 9 * 128 + 96),
    (30.0, True, True, True, 1, 8 * 128 + 91)])
def test_blockwise_statistics_are_the_whole_arrays_bits(softcap, padded, with_kept, with_exp,
                                                        vocab_dim, num_columns, monkeypatch):
  """A ``[D, V]`` weight that is not whole tiles (one segment: a shard of its own), in
  blocks of 4 tiles and the columns
  left (a partial tile; or a whole tile and a partial one; or an odd width, whose rows TMA
  cannot read at all): the statistics are one call's over the whole array, bit for bit
  (that array zero-padded to a multiple of 16 columns, the padding masked as a partial
  tile's columns past the array are; on GPUs, 128-byte reads against 64- or 32-byte
  ones), with a temperature, labels in and out of the shard, a padded vocabulary, kept
  sets. A ``[V, D]`` weight is split only where its rows are not whole tiles of 8 (TMA's
  tiling of dimension 0: 1115 rows); its partial tile reads zeros past the array. With
  ``exp`` terms (the objective path), each block's kernel writes them into one array at
  the block's first column: the whole call's terms, bit for bit; at an odd width the
  array is ``exp_width`` columns wide (rows TMA can write), zeros past the weight's."""
  dim = 64
  hidden, weight, labels, inv_temp, limit, kept, kw = _split_inputs(
      7, dim, num_columns, vocab_dim, softcap, num_columns - 200 if padded else None, with_kept)
  monkeypatch.setattr(mosaic_head, "CONFIG", dataclasses.replace(
      mosaic_head.CONFIG, block_bytes=dim * 2 * 128 * 4, min_block_tiles=4))
  assert len(mosaic_head.column_blocks(num_columns // 128, depth=dim, dtype=hidden.dtype,
                                      num_rows=264, num_cores=kernel_device()["num_cores"])) > 1
  calls = []
  blockwise = mosaic_head._segment_statistics
  monkeypatch.setattr(mosaic_head, "_segment_statistics",
                      lambda *a, **k: calls.append(1) or blockwise(*a, **k))
  got = _in_one_program(hidden, weight, labels, inv_temp, limit, kept, with_exp=with_exp,
                        layout=mosaic_tile.Segments(num_columns, 1, 1), **kw)
  assert len(calls) == (1 if vocab_dim else num_columns % 8 != 0)
  aligned = jnp.pad(weight, [(0, -num_columns % 16) if dim == vocab_dim else (0, 0)
                             for dim in range(2)])
  whole = mosaic_head._statistics(hidden, aligned, labels, inv_temp, limit, kept,
                                  num_columns=num_columns, with_exp=with_exp, **kw)
  tiles = got[0] if with_exp else got
  assert tiles.shape == whole[0].shape == (-(-num_columns // 128), 4, hidden.shape[0])
  assert np.array_equal(np.asarray(tiles).view(np.uint32),
                        np.asarray(whole[0]).view(np.uint32))
  if with_exp:
    width = -(-num_columns // 64) * 64 if num_columns % 16 else num_columns
    assert mosaic_head.exp_width(num_columns, hidden.dtype) == width
    assert got[1].shape == (hidden.shape[0], width)
    assert np.array_equal(np.asarray(got[1][:, :num_columns]).view(np.uint16),
                          np.asarray(whole[1][:, :num_columns]).view(np.uint16))
    assert not np.asarray(got[1][:, num_columns:], np.float32).any()


@pytest.mark.parametrize("softcap,padded,with_kept,with_exp,vocab_dim,num_columns", [
    (None, False, False, False, 1, 8 * 128 + 64), (30.0, True, True, True, 1, 8 * 128 + 64),
    (None, False, True, True, 0, 8 * 128 + 48), (None, True, False, False, 0, 2 * 128 + 8)])
def test_whole_tiles_then_rest_are_the_whole_arrays_bits(softcap, padded, with_kept, with_exp,
                                                         vocab_dim, num_columns, monkeypatch):
  """A weight of one segment that TMA reads in place at the 128-byte swizzle but whose last
  tile is partial (a ``[D, V]`` one of a multiple of 64 columns, as Qwen3.5's 248320 over
  8 GPUs gives: 31040; a ``[V, D]`` one of whole tiles of 8 rows) runs its whole tiles in one
  call over the array and the columns left in another, over one zero-padded tile: the
  statistics and ``exp`` terms are one call's over the whole array (its partial tile
  masked under a ``pl.when``), bit for bit, with a temperature, labels in and out of the
  shard, a padded vocabulary, kept sets, a softcap."""
  hidden, weight, labels, inv_temp, limit, kept, kw = _split_inputs(
      5, 64, num_columns, vocab_dim, softcap, num_columns - 100 if padded else None, with_kept)
  calls = []
  split = mosaic_head._whole_tiles_then_rest
  monkeypatch.setattr(mosaic_head, "_whole_tiles_then_rest",
                      lambda *a, **k: calls.append(1) or split(*a, **k))
  got = mosaic_head.statistics(hidden, weight, labels, inv_temp, limit, kept,
                               with_exp=with_exp, layout=mosaic_tile.Segments(num_columns, 1, 1),
                               **kw)
  assert calls == [1]
  whole = mosaic_head._statistics(hidden, weight, labels, inv_temp, limit, kept,
                                  num_columns=num_columns, with_exp=with_exp, **kw)
  got = got if with_exp else (got,)
  assert got[0].shape == whole[0].shape == (-(-num_columns // 128), 4, hidden.shape[0])
  for g, w in zip(got, whole):
    assert g.shape == w.shape
    assert np.array_equal(np.asarray(g).view(np.uint16 if g.dtype.itemsize == 2 else
                                             np.uint32),
                          np.asarray(w).view(np.uint16 if w.dtype.itemsize == 2 else
                                             np.uint32))


@pytest.mark.parametrize("softcap,padded,with_kept,with_exp,vocab_dim,num_columns", [
    (None, False, False, False, 1, 8 * 176), (30.0, True, True, True, 1, 8 * 176),
    (None, True, True, True, 0, 8 * 176), (None, False, True, True, 1, 4 * 560)])
def test_segments_are_each_segments_own_bits(softcap, padded, with_kept, with_exp, vocab_dim,
                                             num_columns, monkeypatch):
  """A weight of segments whose last tiles are partial (8 of 176 columns, as Qwen3's
  151936 are 8 of 18992; 4 of 560 in vocab blocks of 2 tiles and the columns left): the
  statistics and ``exp`` terms are, segment by segment, those of a call over that
  segment's columns alone (its first global id, limit and kept words its own), bit for
  bit, as a shard holding those columns computes them; a segment's partial last tile
  masks its columns past the segment's end, whose terms no store reaches. The segments'
  columns left after their vocab blocks are read in one call (8 of 176: 2 tiles each, the
  first whole; 4 of 560: one partial tile each). With a temperature, labels in and out of
  the shard, a padded vocabulary (its limit inside the last segment), kept sets, a
  softcap."""
  dim = 64
  hidden, weight, labels, inv_temp, limit, kept, kw = _split_inputs(
      9, dim, num_columns, vocab_dim, softcap, num_columns - 100 if padded else None, with_kept)
  monkeypatch.setattr(mosaic_head, "CONFIG", dataclasses.replace(
      mosaic_head.CONFIG, block_bytes=dim * 2 * 128 * 2, min_block_tiles=2))
  layout = mosaic_tile.segments(num_columns)
  assert layout.split
  got = _in_one_program(hidden, weight, labels, inv_temp, limit, kept, with_exp=with_exp,
                        layout=layout, **kw)
  got = got if with_exp else (got,)
  width, per = layout.width, layout.tiles_per_segment
  assert got[0].shape == (layout.num_tiles, 4, hidden.shape[0])
  for segment in range(layout.count):
    start = segment * width
    own = _in_one_program(
        hidden, jax.lax.slice_in_dim(weight, start, start + width, axis=vocab_dim), labels,
        inv_temp, None if limit is None else limit - start,
        None if kept is None else mosaic_tile.segment_words(kept, start, width),
        with_exp=with_exp, layout=mosaic_tile.Segments(width, 1, 1),
        **dict(kw, column_start=kw["column_start"] + start))
    own = own if with_exp else (own,)
    assert np.array_equal(np.asarray(got[0][segment * per:(segment + 1) * per]).view(np.uint32),
                          np.asarray(own[0]).view(np.uint32)), segment
    if with_exp:
      assert np.array_equal(np.asarray(got[1][:, start:start + width]).view(np.uint16),
                            np.asarray(own[1][:, :width]).view(np.uint16)), segment


def test_unmasked_statistics_are_the_masked_ones():
  """No limit leaves the columns unmasked (the default: no padded vocabulary); a limit at
  the last column masks them and excludes none. Both give the same ``m`` and picked logit,
  bit for bit, and the same sums up to rounding (without the mask's select between them,
  a compiler may fuse a product into the sum that follows: one rounding fewer; measured
  on an H100, only the entropy sums moved, bench/NOTES.md entry 38)."""
  tokens, num_columns = 264, 384
  rng, hidden, weight = _inputs(3, tokens, 128, num_columns, 1)
  labels = jnp.asarray(rng.integers(0, num_columns, tokens), jnp.int32)
  inv_temp = jnp.asarray(rng.uniform(0.5, 2.0, tokens), jnp.float32)
  kw = dict(column_start=0, vocab_dim=1, softcap=None, with_entropy=True, **kernel_device())
  run = lambda limit: mosaic_head.statistics(hidden, weight, labels, inv_temp, limit, **kw)
  unmasked, masked = (np.asarray(a) for a in (jax.jit(lambda: run(None))(),
                                              jax.jit(run)(jnp.int32(num_columns))))
  for field in (0, 3):  # m, picked
    assert np.array_equal(unmasked[:, field].view(np.uint32), masked[:, field].view(np.uint32))
  assert_close(unmasked[:, 1] / masked[:, 1], np.ones_like(masked[:, 1]), 2e-6, "s")
  scale = np.max(np.abs(unmasked[:, 0])) * masked[:, 1]  # (q's error is relative to this)
  assert_close(unmasked[:, 2] / scale, masked[:, 2] / scale, 2e-6, "q")


@pytest.mark.parametrize("vocab_dim,softcap,first_kept,limit,tokens", [
    (1, None, 0, 384, 512), (0, 30.0, 100, 300, 512), (1, 30.0, 0, 300, 392),
    (1, None, None, None, 392), (0, 30.0, None, None, 512)])
def test_logits_grad_tile_matches_float64(vocab_dim, softcap, first_kept, limit, tokens):
  """The backward's tile: d logits from the saved statistics, per-row cotangents and
  temperature; a clamped block's overlap (columns below ``first_kept``) and padded
  columns (from ``limit``) get 0, dropped rows get 0 even with NaN hidden states; 392
  rows: the last row block moved back inside (its shared rows written by both). Without
  ``first_kept`` and ``limit`` the tiles are not masked (no column excluded)."""
  from jaxce._kernels import head, softmax
  rng, hidden, weight = _inputs(11, tokens, 128, 384, vocab_dim)
  keep = rng.random(tokens) < 0.9
  hidden = hidden.at[np.flatnonzero(~keep)[:3]].set(jnp.nan)
  hidden = jnp.where(keep[:, None], hidden, 0)  # as the backward hands it over
  label_column = rng.integers(-2, 400, tokens)
  label_column = jnp.asarray(np.where(label_column < (first_kept or 0), -1, label_column),
                             jnp.int32)
  inv_temp, g_logp, g_entropy = (jnp.asarray(a, jnp.float32) for a in (
      rng.uniform(0.5, 2.0, tokens), rng.normal(size=tokens), rng.normal(size=tokens)))
  # The statistics the forward saved, from the float64 logits (kept columns only).
  h64, w64 = np.asarray(hidden, np.float64), np.asarray(weight, np.float64)
  x = h64 @ (w64 if vocab_dim else w64.T)
  if softcap is not None:
    x = softcap * np.tanh(x / softcap)
  columns = np.arange(384)
  z = np.where((columns >= (first_kept or 0)) & (columns < (limit or 384)),
               x * np.asarray(inv_temp)[:, None], -np.inf)
  shift = z.max(axis=1)
  e = np.exp(z - shift[:, None])
  log_sum = np.log(e.sum(axis=1))
  with np.errstate(invalid="ignore"):  # 0 * -inf at excluded columns, dropped by the where
    entropy = log_sum - np.where(e > 0, e * (z - shift[:, None]), 0).sum(axis=1) / e.sum(axis=1)
  got = mosaic_head.logits_grad(
      hidden, weight, label_column, inv_temp,
      tuple(jnp.asarray(a, jnp.float32) for a in (shift, log_sum, entropy)),
      (g_logp, g_entropy), jnp.asarray(keep), limit=limit, first_kept=first_kept,
      vocab_dim=vocab_dim, softcap=softcap, **kernel_device())
  dz = softmax.logit_grad(jnp.asarray(z), jnp.asarray(label_column), *(jnp.asarray(a) for a in (
      shift, log_sum, entropy)), jnp.asarray(g_logp, jnp.float64),
      jnp.asarray(g_entropy, jnp.float64), jnp.asarray(keep))
  want = head.logits_input_grad(dz, jnp.asarray(inv_temp, jnp.float64), jnp.asarray(x),
                                   softcap, jnp.asarray(keep))
  assert got.dtype == jnp.bfloat16
  assert not np.any(np.asarray(got)[~keep]), "dropped rows must be exactly 0"
  assert not np.any(np.asarray(got)[:, :first_kept or 0]), "the overlap must be exactly 0"
  # bf16 output: each entry within one rounding of its float64 value (plus f32 noise near
  # 0), so a term off by 1 % in any column shows.
  got, want = np.asarray(got, np.float64), np.asarray(want)
  bound = 2 ** -8 * np.abs(want) + 2 ** -16 * np.max(np.abs(want))
  bad = np.abs(got - want) > bound
  assert not bad.any(), (np.argwhere(bad)[:5], got[bad][:5], want[bad][:5])


@pytest.mark.parametrize("weight_layout,tokens,max_unrolled,chunk,columns", [
    ("dv", 300, 64, None, 384), ("vd", 300, 64, None, 384), ("dv", 700, 64, None, 384),
    ("vd", 700, 2, None, 384), ("vd", 700, 64, 256, 384), ("dv", 600, 64, 256, 640),
    ("dv", 300, 64, None, 400), ("vd", 700, 64, None, 400),  # (V: 3 tiles and 16 columns)
    # a last vocab block of 64 columns (blocks of 128), one 128-byte piece wide: its
    # d logits were overwritten on GPUs by the piece past its end (bench/NOTES.md, 45)
    ("dv", 300, 64, None, 192), ("vd", 300, 64, None, 320),
    # odd widths (an unpadded vocabulary: rows TMA cannot read), its last tile padded
    ("dv", 300, 64, None, 401), ("vd", 700, 64, None, 401),
    # 8 segments of 176 columns, each tiled from its own first column (as Qwen3's 151936)
    ("dv", 300, 64, None, 1408), ("vd", 300, 64, None, 1408)])
def test_matches_xla_path_and_reference(weight_layout, tokens, max_unrolled, chunk, columns,
                                        monkeypatch):
  """bf16 inputs, ragged tokens and vocabulary, padded vocabulary, per-token temperature,
  softcap, ignored and masked tokens; random cotangents for both outputs. The Mosaic
  forward must be as exact as the XLA path's (both accumulate in f32). 700 tokens over
  384 columns: the backward walks token chunks outer, its three blocks of 128 unrolled,
  or (past ``MAX_UNROLLED_BLOCKS``) scanned. With ``chunk_size=256`` the backward runs a
  chunk of 256 rows, then one call on the rows left (448 of 700 in token order; 344 of
  600 with vocab blocks outer over 640 columns)."""
  monkeypatch.setattr(jaxce.plan, "MAX_UNROLLED_BLOCKS", max_unrolled)
  vocab_dim = 1 if weight_layout == "dv" else 0
  rng, hidden, weight = _inputs(7, tokens, 128, columns, vocab_dim)
  vocab = 250 if columns % 128 == 0 else columns - 9  # (live columns in the partial tile)
  block = 128 if tokens > columns else None
  plan = jaxce.plan.of(jaxce.linear_logprobs_and_entropy, hidden, weight,
                       np.zeros(tokens, np.int32), implementation="mosaic",
                       weight_layout=weight_layout, chunk_size=chunk, vocab_block_size=block)
  assert plan.backward_order == ("token" if tokens > columns else "vocab"), plan
  assert plan.unrolled_blocks == (tokens > columns and max_unrolled > 2), plan
  assert plan.chunks.sizes == (
      (256, mosaic_head.padded_rows(tokens) - 256) if chunk else
      (mosaic_head.padded_rows(tokens),)), plan
  labels = rng.integers(0, vocab, tokens)
  labels[rng.random(tokens) < 0.1] = -100
  loss_kw = dict(labels=labels, cot_logp=rng.normal(size=tokens),
                 cot_entropy=rng.normal(size=tokens))
  kw = dict(temperature=rng.uniform(0.6, 1.5, tokens), logit_softcap=20.0, vocab_size=vocab,
            where=rng.random(tokens) < 0.9, weight_layout=weight_layout)
  f = lambda h, w, labels, **k: jaxce.linear_logprobs_and_entropy(
      h, w, labels, vocab_block_size=block, chunk_size=chunk, **k)
  fr = lambda h, w, labels, **k: reference.linear_logprobs_and_entropy(h, w, labels, **k)
  mosaic = value_and_grads(f, (hidden, weight), (0, 1), implementation="mosaic", **loss_kw, **kw)
  xla = value_and_grads(f, (hidden, weight), (0, 1), implementation="xla", **loss_kw, **kw)
  exact = value_and_grads(fr, tuple(jnp.asarray(a, jnp.float64) for a in (hidden, weight)),
                          (0, 1), **loss_kw, **kw)
  for i, name in enumerate(("logp", "entropy")):
    err_mosaic = np.max(np.abs(np.asarray(mosaic[0][i], np.float64) - exact[0][i]))
    err_xla = np.max(np.abs(np.asarray(xla[0][i], np.float64) - exact[0][i]))
    assert err_mosaic <= 1.5 * err_xla + 1e-6, (name, err_mosaic, err_xla)
    assert_close(mosaic[0][i], xla[0][i], 1e-5, name)
  for name, g, gx in zip(("d hidden", "d weight"), mosaic[1], xla[1]):
    assert g.dtype == jnp.bfloat16
    # The same backward from residuals that differ in the last f32 bits: at most one
    # bf16 rounding step apart.
    assert_close(g, gx, 2 ** -7 * float(jnp.max(jnp.abs(gx.astype(jnp.float32)))), name)


@pytest.mark.parametrize("weight_layout,softcap,columns", [
    ("dv", None, 640), ("vd", 20.0, 640),
    ("dv", None, 656), ("vd", 20.0, 656)])  # (a narrow block of 144: its last tile partial)
def test_unmasked_backward_and_its_narrow_last_block(weight_layout, softcap, columns):
  """No padded vocabulary and no kept sets: the backward's kernels mask no column, and
  the columns past the last whole vocab block (128 of 640, in blocks of 256) make one block
  as wide as they are, not a block clamped back over the one before. Per-token temperature, an
  ignored row whose hidden state is NaN (its row of ``d`` exactly 0: ``d W`` stays finite),
  random cotangents for both outputs; values and gradients as exact as the XLA path's
  against float64, the gradients within one bf16 rounding step of it."""
  vocab_dim = 1 if weight_layout == "dv" else 0
  tokens = 300
  rng, hidden, weight = _inputs(17, tokens, 128, columns, vocab_dim)
  hidden = hidden.at[7].set(jnp.nan)
  labels = rng.integers(0, columns, tokens)
  labels[7] = -100
  loss_kw = dict(labels=labels, cot_logp=rng.normal(size=tokens),
                 cot_entropy=rng.normal(size=tokens))
  kw = dict(temperature=rng.uniform(0.6, 1.5, tokens), logit_softcap=softcap,
            weight_layout=weight_layout)
  plan = jaxce.plan.of(jaxce.linear_logprobs_and_entropy, hidden, weight, labels,
                       implementation="mosaic", vocab_block_size=256, **kw)
  assert (plan.backend, plan.backward_order, plan.block) == ("mosaic", "vocab", 256), plan
  f = lambda h, w, labels, **k: jaxce.linear_logprobs_and_entropy(
      h, w, labels, vocab_block_size=256, **k)
  fr = lambda h, w, labels, **k: reference.linear_logprobs_and_entropy(h, w, labels, **k)
  mosaic = value_and_grads(f, (hidden, weight), (0, 1), implementation="mosaic", **loss_kw, **kw)
  xla = value_and_grads(f, (hidden, weight), (0, 1), implementation="xla", **loss_kw, **kw)
  # (the reference's own autodiff takes the NaN into d W: its row is zeroed there)
  exact = value_and_grads(fr, tuple(jnp.asarray(a, jnp.float64) for a in (
      hidden.at[7].set(0), weight)), (0, 1), **loss_kw, **kw)
  kept_rows = np.arange(tokens) != 7
  for i, name in enumerate(("logp", "entropy")):
    err_mosaic = np.max(np.abs(np.asarray(mosaic[0][i], np.float64) - exact[0][i])[kept_rows])
    err_xla = np.max(np.abs(np.asarray(xla[0][i], np.float64) - exact[0][i])[kept_rows])
    assert err_mosaic <= 1.5 * err_xla + 1e-6, (name, err_mosaic, err_xla)
  for name, g, gx, ge in zip(("d hidden", "d weight"), mosaic[1], xla[1], exact[1]):
    g32, gx32 = (np.asarray(a, np.float32) for a in (g, gx))
    if name == "d hidden":  # (the ignored row's gradient is 0 on every path)
      assert np.all(g32[7] == 0) and np.all(gx32[7] == 0), name
      g32, gx32, ge = g32[kept_rows], gx32[kept_rows], np.asarray(ge)[kept_rows]
    assert np.all(np.isfinite(g32)), name
    scale = float(np.max(np.abs(gx32)))
    assert_close(g32, gx32, 2 ** -7 * scale, name)
    err_mosaic = np.max(np.abs(g32 - ge))
    err_xla = np.max(np.abs(gx32 - ge))
    assert err_mosaic <= 1.5 * err_xla + 2 ** -9 * scale, (name, err_mosaic, err_xla)


@pytest.mark.parametrize("weight_layout,tokens,columns,block", [
    ("dv", 300, 384, None), ("vd", 700, 384, 128),
    ("dv", 300, 656, 256),  # blocks of 256 and a narrow last one of 144 (a partial tile)
    ("vd", 300, 400, None),  # one block of 400 columns: its last tile partial
    ("dv", 300, 1408, None)])  # 8 segments of 176: their kept words start mid-word
def test_kept_sets_match_xla_path_and_reference(weight_layout, tokens, columns, block):
  """``keep=`` read with the tiles in both kernels: ~5 % kept, a row whose arg-max is
  dropped, a row keeping its label alone, a label outside its kept set; a padded
  vocabulary, per-token temperature, softcap and random cotangents. Values as exact as
  the XLA path's against float64, the same gradients, the plan on the kernel. Also where
  the backward's last vocab block is narrower than the others and where ``V`` is not a
  multiple of 128 (the kept words of a partial tile)."""
  vocab_dim = 1 if weight_layout == "dv" else 0
  # (the padded vocabulary ends in the last tile: the narrow block's and the partial
  # tile's columns are live)
  vocab = 250 if columns == 384 else columns - 9
  rng, hidden, weight = _inputs(13, tokens, 128, columns, vocab_dim)
  labels = rng.integers(0, vocab, tokens)
  mask = rng.random((tokens, columns)) < 0.05
  mask[np.arange(tokens), labels] = True
  logits = np.asarray(hidden, np.float32) @ np.asarray(weight if vocab_dim else weight.T,
                                                       np.float32)
  mask[0, np.argmax(logits[0, :vocab])] = False
  mask[1] = False
  mask[1, labels[1]] = True
  mask[2, labels[2]] = False
  keep = jaxce.keep.pack(mask)
  loss_kw = dict(labels=labels, cot_logp=rng.normal(size=tokens),
                 cot_entropy=rng.normal(size=tokens))
  kw = dict(temperature=rng.uniform(0.6, 1.5, tokens), logit_softcap=20.0, vocab_size=vocab,
            weight_layout=weight_layout, keep=keep)
  f = lambda h, w, labels, **k: jaxce.linear_logprobs_and_entropy(
      h, w, labels, vocab_block_size=block, **k)
  fr = lambda h, w, labels, **k: reference.linear_logprobs_and_entropy(h, w, labels, **k)
  plan = jaxce.plan.of(jaxce.linear_logprobs_and_entropy, hidden, weight, labels,
                       implementation="mosaic", weight_layout=weight_layout, keep=keep,
                       vocab_block_size=block)
  assert plan.backend == "mosaic", plan
  if block == 256:
    assert (plan.backward_order, plan.block, columns % plan.block) == ("vocab", 256, 144), plan
  mosaic = value_and_grads(f, (hidden, weight), (0, 1), implementation="mosaic", **loss_kw, **kw)
  xla = value_and_grads(f, (hidden, weight), (0, 1), implementation="xla", **loss_kw, **kw)
  exact = value_and_grads(fr, tuple(jnp.asarray(a, jnp.float64) for a in (hidden, weight)),
                          (0, 1), **loss_kw, **kw)
  for i, name in enumerate(("logp", "entropy")):
    # Mixed abs/rel error per token: an f32 result's rounding grows with its magnitude
    # (a row at logp -13 carries 8x the absolute error of one at -1.5).
    scale = np.maximum(1.0, np.abs(exact[0][i]))
    err_mosaic = np.max(np.abs(np.asarray(mosaic[0][i], np.float64) - exact[0][i]) / scale)
    err_xla = np.max(np.abs(np.asarray(xla[0][i], np.float64) - exact[0][i]) / scale)
    assert err_mosaic <= 5e-6, (name, err_mosaic)
    assert err_mosaic <= 1.5 * err_xla + 2e-7, (name, err_mosaic, err_xla)
  assert abs(float(mosaic[0][0][1])) < 1e-6  # the label alone: log-prob 0
  for name, g, gx in zip(("d hidden", "d weight"), mosaic[1], xla[1]):
    assert np.all(np.isfinite(np.asarray(g, np.float32))), name
    assert_close(g, gx, 2 ** -7 * float(jnp.max(jnp.abs(gx.astype(jnp.float32)))), name)


@pytest.mark.parametrize("change,message", [
    (dict(dtype=jnp.float32), "16-bit float dtype"),
    (dict(bias=True), "bias"),
    (dict(dim=96), "multiple of 64"),
    (dict(dtype=jnp.float64, objective=True), "16-bit float.*nor from XLA.s matmul.*float64"),
])
def test_unsupported_calls_say_why(change, message):
  tokens, dim = change.get("tokens", 256), change.get("dim", 64)
  hidden = jnp.ones((tokens, dim), change.get("dtype", jnp.bfloat16))
  columns = change.get("columns", 128)
  weight = jnp.ones((dim, columns), change.get("dtype", jnp.bfloat16))
  bias = jnp.zeros(columns) if change.get("bias") else None
  labels = jnp.zeros(tokens, jnp.int32)
  with pytest.raises(ValueError, match=f'implementation="mosaic".*{message}'):
    if change.get("objective"):
      jaxce.linear_token_loss(lambda logp, entropy: logp, hidden, weight, labels,
                              implementation="mosaic")
    else:
      jaxce.linear_logprobs_and_entropy(hidden, weight, labels, bias=bias,
                                        implementation="mosaic")


def test_each_tokens_bits_do_not_depend_on_the_call():
  """Batch invariance by construction: a token's logp and entropy are the same bits alone
  (T = 1, padded to the kernel's 256 rows), among 7, 300 and 600 tokens at random
  positions (one the last row; from 300, a last row block moved back inside), with
  another chunk_size (the backward's chunks: 256 rows, then the 344 left), inside
  ``jit(value_and_grad)`` with the temperature closed over (a constant) or passed as an
  argument, and forward only; per-token temperature, softcap, a padded vocabulary,
  ignored neighbours; on GPUs also among 520. The planner says so (``invariant_to``).

  Off GPUs the kernels run in JAX's interpreter, whose matmul (XLA:CPU's) is not the
  same function of a row wherever the row sits in its tile: with these inputs, a row at
  24 or 56 of a 128-row tile (of the rows checked, every 8th) gets other bits in one of
  the three vocab tiles, at any T, round ones and the code before ragged T included
  (measured with JAX 0.12). So there a probe's position
  can change its bits through the interpreter alone, and the draws below are the ones
  this test has always made; the compiled kernels' wgmma has no such dependence, and on
  GPUs the 520-token case adds draws of its own."""
  rng, hidden, weight = _inputs(5, 600, 64, 384, 1)
  labels = rng.integers(0, 380, 600)
  temperature = rng.uniform(0.6, 1.4, 600)
  where = rng.random(600) < 0.8
  probes = np.arange(5)
  where[probes] = True
  kw = dict(logit_softcap=30.0, vocab_size=380, implementation="mosaic",
            batch_invariant=True)

  def call(rows, differentiate=False, constant=False, **extra):
    h, t = hidden[rows], jnp.asarray(temperature[rows], jnp.float32)
    f = lambda h, w, t: jaxce.linear_logprobs_and_entropy(
        h, w, labels[rows], temperature=t, where=where[rows], **kw, **extra)
    if not differentiate:
      return f(h, weight, t)
    loss = lambda h, w, t: (lambda o: (jnp.sum(o[0]) + jnp.sum(o[1]), o))(f(h, w, t))
    if constant:
      step = jax.jit(jax.value_and_grad(lambda h, w: loss(h, w, t), (0, 1), has_aux=True))
      return step(h, weight)[0][1]
    return jax.jit(jax.value_and_grad(loss, (0, 1), has_aux=True))(h, weight, t)[0][1]

  bits = lambda out, at: tuple(np.asarray(o)[at].view(np.uint32) for o in out)
  want = [bits(call(np.array([p])), 0) for p in probes]
  want = tuple(np.stack(w) for w in zip(*want))
  cases = [(7, {}), (300, {}), (600, {}), (600, dict(chunk_size=256)),
           (600, dict(differentiate=True, constant=True)), (600, dict(differentiate=True))]
  if jax.default_backend() == "gpu":
    cases.append((520, {}))
  for tokens, extra in cases:
    others = rng.permutation(np.arange(5, 600))[:tokens - len(probes)]
    at = rng.permutation(tokens)[:len(probes)]
    if tokens - 1 not in at:
      at[0] = tokens - 1
    rows = np.empty(tokens, np.int64)
    rows[at] = probes
    rows[np.setdiff1d(np.arange(tokens), at)] = others
    got = bits(call(rows, **extra), at)
    for name, g, w in zip(("logp", "entropy"), got, want):
      assert np.array_equal(g, w), f"T = {tokens} {extra}: {name} {g.view(np.float32)} vs " \
                                   f"{w.view(np.float32)}"
  plan = jaxce.plan.of(jaxce.linear_logprobs_and_entropy, hidden, weight, labels, **kw)
  assert plan.invariant_to == ("tokens", "chunking", "differentiation", "constants")


def _equations(jaxpr, times=1):
  """``(equation, times it runs)`` for every equation of a traced program and of the jaxprs
  in its parameters (kernels' bodies too), scans' trip counts included."""
  for eqn in getattr(jaxpr, "jaxpr", jaxpr).eqns:
    yield eqn, times
    inner_times = times * eqn.params.get("length", 1) if eqn.primitive.name == "scan" else times
    for param in eqn.params.values():
      for sub in (param if isinstance(param, (tuple, list)) else (param,)):
        if hasattr(getattr(sub, "jaxpr", sub), "eqns"):
          yield from _equations(sub, inner_times)


def _kernel_rows(jaxpr, dim):
  """``{"forward": rows x columns, "backward": rows x columns}``: the matmul work of the
  fused head's Mosaic kernels a traced program runs (each call's rows rounded up to its
  row blocks, ``mosaic_head.row_blocks``, times the columns of its ``[dim, V]`` weight
  operand), scans' trip counts included. A head kernel is a Pallas call whose first
  operand is ``hidden``'s ``[C, dim]`` rows; the backward's write ``[C, Vb]`` d logits,
  the forward's their statistics (``[tiles, 4, C]``, or into an array in place)."""
  rows = {"forward": 0, "backward": 0}
  for eqn, times in _equations(jaxpr):
    first = eqn.invars[0].aval if eqn.invars else None
    if (eqn.primitive.name in ("pallas_call", "mpmd_map") and first.ndim == 2
        and first.shape[1] == dim and first.dtype == jnp.bfloat16):
      backward = bool(eqn.outvars) and eqn.outvars[0].aval.ndim == 2
      rows["backward" if backward else "forward"] += (
          times * mosaic_head.row_blocks(first.shape[0]) * mosaic_head.CONFIG.min_rows
          * eqn.invars[1].aval.shape[1])
  return rows


@pytest.mark.parametrize("columns,block", [(151936, None), (2048, 512)])
def test_ragged_tokens_cost_their_rows_rounded_up_to_a_row_block(columns, block, monkeypatch):
  """No work done twice: the Mosaic kernels of a fused fwd+bwd planned for a Hopper GPU
  (traced on abstract shapes, nothing run) process each token's row once, up to the rows
  that round ``T`` up to the kernels' 256-row block; the forward each of the columns'
  tiles once (151936 columns: 8 segments of 18992, each's last tile padded to 128
  columns), the backward each column once (a ragged vocabulary's last block as wide as
  the columns left): forward and backward,
  ragged and round ``T``, vocab blocks outer (151936 columns: no block divides them)
  and token chunks outer (2048), with the planned and with a requested chunk. (Planned
  for T = 8184 before, the kernels ran 15872 rows, a second chunk clamped back over the
  first; the backward's last block was clamped back over the one before.)"""
  monkeypatch.setattr(jaxce.plan, "target", lambda *a, mesh=None: jaxce.plan.Target(
      "gpu", "9.0", 132))
  dim = 64
  weight = jax.ShapeDtypeStruct((dim, columns), jnp.bfloat16)
  cases = [(8184, None), (8192, None), (16192, None), (24000, None), (32760, None),
           (1000, None), (777, None), (8184, 2048), (5000, 1000)]
  for tokens, chunk in cases:
    if columns < 151936 and tokens > 8192:
      continue  # (the token-order cases: chunks of the small vocabulary's plan)
    hidden = jax.ShapeDtypeStruct((tokens, dim), jnp.bfloat16)
    labels = jax.ShapeDtypeStruct((tokens,), jnp.int32)
    kw = dict(chunk_size=chunk, vocab_block_size=block)
    plan = jaxce.plan.of(jaxce.linear_logprobs_and_entropy, hidden, weight, labels, **kw)
    assert plan.backend == "mosaic", plan
    assert plan.backward_order == ("vocab" if tokens <= columns else "token"), plan
    loss = lambda h, w: sum(jnp.sum(o) for o in jaxce.linear_logprobs_and_entropy(
        h, w, jnp.zeros(tokens, jnp.int32), **kw))
    rows = _kernel_rows(jax.make_jaxpr(jax.grad(loss, (0, 1)))(hidden, weight), dim)
    rounded = -(-tokens // mosaic_head.CONFIG.min_rows) * mosaic_head.CONFIG.min_rows
    tiled = mosaic_tile.segments(columns).num_tiles * mosaic_head.TILE_N
    assert rows["forward"] == rounded * tiled, (tokens, chunk, plan, rows)
    assert rows["backward"] == rounded * columns, (tokens, chunk, plan, rows)


def test_head_profile_kernel_section_runs():
  """``bench.head_profile``'s kernel section runs every piece it times without an
  error row (on GPUs two more: the plain Mosaic matmul at both widths); its max-only
  skeleton calls ``mosaic_head._tiles`` directly, which nothing else here does."""
  from bench import head_profile
  rows = head_profile.kernels(256, 64, 256, 128, 1)
  assert len(rows) == (9 if jax.default_backend() == "gpu" else 7)
  assert [(r["piece"], r["error"]) for r in rows if r.get("error")] == []


def test_kernel_pieces_profile_runs():
  """``bench.kernel_pieces.profile`` (``bench.machine_floors``' jaxce rows and
  ``gpu_check_mosaic_linear --profile``) times each piece it names: the forward kernel
  at four walk widths and depths, the d-logits kernel and the two gradient GEMMs."""
  from bench import kernel_pieces
  rows = kernel_pieces.profile(256, 64, 256, 1)
  assert len(rows) == 7 and all(r["ms"] > 0 for r in rows), rows


@pytest.mark.parametrize("capability", ["9.0", "8.0"])
def test_gpu_calls_take_an_array_temperatures_reciprocal_on_the_device(capability, monkeypatch):
  """Planned for a GPU (traced on CPU, nothing runs), an array temperature's reciprocal is
  computed on the device, whether the user's ``jit`` passes it or closes over it: on Hopper
  by the reciprocal kernel (``mosaic_reciprocal``), elsewhere by XLA's division behind an
  optimization barrier. XLA folds a constant's reciprocal on the host, which need not
  round as the device does, so without this a token's bits would depend on how the
  temperature reached the call. (A GPU run alone saw this before.)"""
  monkeypatch.setattr(jaxce.plan, "target", lambda *a, mesh=None: jaxce.plan.Target(
      "gpu", capability, 132))
  tokens, dim = 300, 64
  hidden = jax.ShapeDtypeStruct((tokens, dim), jnp.bfloat16)
  weight = jax.ShapeDtypeStruct((dim, 384), jnp.bfloat16)
  labels = jnp.zeros(tokens, jnp.int32)
  temperature = jnp.linspace(0.5, 1.5, tokens)

  def reciprocals(jaxpr):
    """Kernel calls on one 1-D float32 operand (the temperatures, padded to the kernel's
    block), and optimization barriers."""
    found = [0, 0]
    for eqn in getattr(jaxpr, "jaxpr", jaxpr).eqns:
      avals = [v.aval for v in eqn.invars]
      if (eqn.primitive.name in ("pallas_call", "mpmd_map") and len(avals) == 1
          and avals[0].ndim == 1 and avals[0].dtype == jnp.float32):
        found[0] += 1
      found[1] += eqn.primitive.name == "optimization_barrier"
      for param in eqn.params.values():
        for sub in (param if isinstance(param, (tuple, list)) else (param,)):
          if hasattr(getattr(sub, "jaxpr", sub), "eqns"):
            found = [a + b for a, b in zip(found, reciprocals(sub))]
    return found

  closed = lambda h, w: jaxce.linear_logprobs_and_entropy(h, w, labels, temperature=temperature)
  passed = lambda h, w, t: jaxce.linear_logprobs_and_entropy(h, w, labels, temperature=t)
  for jaxpr in (jax.make_jaxpr(closed)(hidden, weight),
                jax.make_jaxpr(passed)(hidden, weight, temperature)):
    kernels, barriers = reciprocals(jaxpr)
    assert (kernels, barriers > 0) == ((1, False) if capability == "9.0" else (0, True)), (
        kernels, barriers)


@pytest.mark.parametrize("weight_layout,softcap,with_keep,columns", [
    ("dv", None, False, 384), ("vd", 20.0, False, 384), ("dv", 20.0, True, 384),
    ("dv", 20.0, True, 400),  # (V not a multiple of 128: the terms' partial last tile)
    ("dv", 20.0, True, 391),  # (odd: the terms and d 448 columns wide, the weight padded)
    ("dv", 20.0, True, 1408)])  # (8 segments of 176: [rows, 8, 176] terms)
def test_objective_gradients_from_the_kernels_terms_match_float64(weight_layout, softcap,
                                                                  with_keep, columns,
                                                                  monkeypatch):
  """``linear_token_loss`` on the kernels: the fused head's kernel writes each row's
  ``exp(z - m_tile)`` terms in bf16 and ``mosaic_rows_grad.exp_overwrite`` writes ``d``
  over them. 700 tokens in three groups of 256 (the last clamped back), per-token
  weights of both log-prob and entropy, per-token temperature (some cold: labels whose
  terms underflow), a padded vocabulary, ignored tokens (one with NaN hidden states),
  softcap, kept sets. The log-probs, entropies and gradients against float64, as close
  as the XLA path's (which rounds ``d`` once; the kernel's terms add one bf16 rounding),
  and the loss as the sum of their objective."""
  monkeypatch.setitem(jaxce.plan.LINEAR_OBJECTIVE_GRAD_BYTES, "cpu", 300 * 384 * 2)
  monkeypatch.setitem(jaxce.plan.LINEAR_OBJECTIVE_GRAD_BYTES, "gpu", 300 * 384 * 2)
  vocab_dim = 1 if weight_layout == "dv" else 0
  tokens = 700
  rng, hidden, weight = _inputs(21, tokens, 128, columns, vocab_dim)
  vocab = 250 if columns % 128 == 0 else columns - 9  # (live columns in the partial tile)
  labels = rng.integers(0, vocab, tokens)
  labels[:20] = -100
  hidden = hidden.at[3].set(jnp.nan)  # an ignored token's NaN stays out of the gradients
  temperature = rng.uniform(0.6, 1.5, tokens)
  temperature[::7] = 0.02
  keep = None
  if with_keep:
    mask = rng.random((tokens, columns)) < 0.3
    mask[np.arange(tokens), np.maximum(labels, 0)] = True
    keep = jaxce.keep.pack(mask)
  weight_logp, weight_entropy = rng.normal(size=tokens), rng.normal(size=tokens)
  objective = lambda logp, entropy, a, b: a * logp + b * entropy
  options = dict(temperature=temperature, logit_softcap=softcap, vocab_size=vocab,
                 weight_layout=weight_layout, keep=keep)
  plan = jaxce.plan.of(jaxce.linear_token_loss, objective, hidden, weight, labels,
                       weight_logp, weight_entropy, implementation="mosaic", **options)
  assert plan.backend == "mosaic" and plan.kernel_chunk == plan.grad_chunk == 256, plan

  def fused(implementation):
    call = lambda h, w: jaxce.linear_token_loss(objective, h, w, labels, weight_logp,
                                                weight_entropy, implementation=implementation,
                                                **options)
    return jax.jit(jax.value_and_grad(call, (0, 1), has_aux=True))(hidden, weight)

  def exact(h, w):
    h = jnp.where((labels >= 0)[:, None], h, 0)
    logp, entropy = reference.linear_logprobs_and_entropy(h, w, labels, **options)
    return jnp.sum(jnp.where(labels >= 0, objective(logp, entropy, weight_logp,
                                                     weight_entropy), 0)), (logp, entropy)

  want = jax.value_and_grad(exact, (0, 1), has_aux=True)(
      *(jnp.asarray(a, jnp.float64) for a in (hidden, weight)))
  (loss, (logp, entropy)), grads = fused("mosaic")
  (_, (xla_logp, xla_entropy)), xla_grads = fused("xla")
  error = lambda a, b: float(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(b))))
  scale = lambda a: max(1.0, float(np.max(np.abs(np.asarray(a)))))
  # Both to within 2e-6 of the logits' scale (the largest |logp|, the cold tokens'): an
  # entropy's f32 error is not relative to its own size, its sums cancel (on an H200 at
  # 384 columns the XLA path's was 7.0e-6 of 4.3, the kernel's 9.3e-6).
  ref_logp, ref_entropy = want[0][1]
  for what, got, xla, ref in (("logp", logp, xla_logp, ref_logp),
                              ("entropy", entropy, xla_entropy, ref_entropy)):
    assert error(got, ref) <= 2e-6 * scale(ref_logp), (what, error(got, ref), error(xla, ref))
  # The loss is the objective summed over those per-token values: the sum of terms of
  # either sign (|loss| 79 against a sum of |terms| of 12884 at 1408 columns) is checked
  # as a sum, to f32's rounding of each term, and the terms' accuracy above.
  valid = labels >= 0
  terms = np.where(valid, objective(np.asarray(logp, np.float64), np.asarray(entropy, np.float64),
                                    weight_logp, weight_entropy), 0)
  assert abs(float(loss) - terms.sum()) <= 2**-23 * np.abs(terms).sum(), (float(loss), terms.sum())
  # The gradients' root-mean-square error, relative to the reference's: both paths end in
  # one bf16 rounding of each gradient (about 2**-9 of it); the kernel's extra rounding
  # of the terms feeds sums over tokens, where it partly cancels.
  rms = lambda a, ref: float(np.sqrt(np.mean(np.square(np.asarray(a, np.float64) - ref))
                                     / np.mean(np.square(ref))))
  for what, got, xla, ref in zip(("d hidden", "d weight"), grads, xla_grads, want[1]):
    got, ref = np.asarray(got, np.float64), np.asarray(ref)
    assert np.isfinite(got).all(), what
    assert rms(got, ref) <= 1.5 * rms(xla, ref), (what, rms(got, ref), rms(xla, ref))
    assert error(got, ref) <= 1.5 * error(xla, ref), (what, error(got, ref), error(xla, ref))
  assert np.all(np.asarray(grads[0])[:20] == 0), "ignored tokens get exactly 0"


def _weight_copies(jaxpr, shapes):
  """How many arrays of the ``shapes`` of a weight's vocab blocks a traced program copies
  out (the concatenate of a block's pieces, the pad of a lone piece), scans' trip counts
  included."""
  return sum(times for eqn, times in _equations(jaxpr)
             if eqn.primitive.name in ("concatenate", "pad")
             and eqn.outvars[0].aval.shape in shapes)


@pytest.mark.parametrize("columns", [1408, 391])
def test_objective_copies_its_weight_once_a_call_or_once_a_group(columns, monkeypatch):
  """Where the kernel cannot read the weight in place (8 segments of 176 columns, as
  Qwen3's 151936 are 8 of 18992; an odd width, 391) and the path runs several groups, the
  plan's ``weight_copy`` says where the weight is copied out in vocab blocks: ``"call"``,
  within ``LINEAR_OBJECTIVE_COPY_BYTES``, once before the groups (no copy in the scan over
  them), else ``"group"``, in each group's call. Both give the same bits: loss, log-probs,
  entropies and both gradients (300 tokens in two groups of 256, the last clamped back;
  a temperature, kept sets, a padded vocabulary, a softcap)."""
  monkeypatch.setitem(jaxce.plan.LINEAR_OBJECTIVE_GRAD_BYTES, "cpu", 300 * columns * 2)
  monkeypatch.setitem(jaxce.plan.LINEAR_OBJECTIVE_GRAD_BYTES, "gpu", 300 * columns * 2)
  tokens, dim = 300, 64
  rng, hidden, weight = _inputs(23, tokens, dim, columns, 1)
  labels = rng.integers(0, columns - 9, tokens)
  labels[:7] = -100
  mask = rng.random((tokens, columns)) < 0.5
  mask[np.arange(tokens), np.maximum(labels, 0)] = True
  a, b = rng.normal(size=tokens), rng.normal(size=tokens)
  objective = lambda logp, entropy, a, b: a * logp + b * entropy
  options = dict(temperature=rng.uniform(0.6, 1.5, tokens), logit_softcap=20.0,
                 vocab_size=columns - 9, keep=jaxce.keep.pack(mask), implementation="mosaic")
  copy_bytes = mosaic_head.weight_blocks_bytes(mosaic_tile.segments(columns), dim,
                                               jnp.bfloat16)
  results = {}
  for budget, where in ((copy_bytes, "call"), (copy_bytes - 1, "group")):
    monkeypatch.setitem(jaxce.plan.LINEAR_OBJECTIVE_COPY_BYTES, "cpu", budget)
    monkeypatch.setitem(jaxce.plan.LINEAR_OBJECTIVE_COPY_BYTES, "gpu", budget)
    # (a function of its own for each budget: JAX reuses a function's trace for the same
    # shapes, and the budget is read when the call is traced)
    step = jax.value_and_grad(
        lambda h, w: jaxce.linear_token_loss(objective, h, w, labels, a, b, **options),
        (0, 1), has_aux=True)
    plan = jaxce.plan.of(jaxce.linear_token_loss, objective, hidden, weight, labels, a, b,
                         **options)
    assert (plan.backend, plan.grad_chunk, plan.weight_copy) == ("mosaic", 256, where), plan
    # the weight's vocab blocks copied out: once, or once in each of the 2 groups
    blocks = mosaic_head.weight_blocks(weight, num_rows=256, vocab_dim=1,
                                       num_cores=kernel_device()["num_cores"])
    copies = _weight_copies(jax.make_jaxpr(step)(hidden, weight), {b.shape for b in blocks})
    assert copies == len(blocks) * (1 if where == "call" else 2), (where, copies, len(blocks))
    results[where] = jax.tree.leaves(jax.jit(step)(hidden, weight))
  bits = lambda x: np.asarray(x).reshape(-1).view(f"u{x.dtype.itemsize}")
  for got, want in zip(results["call"], results["group"]):
    assert got.dtype == want.dtype and np.array_equal(bits(got), bits(want))


@pytest.mark.parametrize("softcap", [None, 8.0])
def test_exp_overwrite_is_the_logit_gradient_of_its_terms(softcap):
  """``mosaic_rows_grad.exp_overwrite``: each column's ``d x`` from its bf16 term ``e =
  exp(z - m_tile)``, the tile's max and the row's statistics is the float64 gradient of
  the logits those terms stand for, to the output's bf16 rounding, column by column (the
  entropy term ``p log p`` dominating: ``g_logp`` is small). Peaked rows, excluded columns
  (``e = 0``) and a whole tile excluded, a label whose term underflowed (its softcap
  factor from the label's own logit), an ignored row whose terms are NaN; two row
  blocks."""
  # pylint: disable-next=import-outside-toplevel
  from jaxce._kernels.mosaic import rows_grad as mosaic_rows_grad
  from jaxce._kernels.config import Tokens  # pylint: disable=import-outside-toplevel
  rng = np.random.default_rng(5)
  rows, columns, start = 128, 384, 1000
  inv_temp = rng.uniform(0.5, 2.0, rows)
  capped = rng.normal(size=(rows, columns)) * 2.0
  capped[:, 7] += 3.0  # a peaked column
  if softcap is not None:
    capped = np.clip(capped, -0.95 * softcap, 0.95 * softcap)
  labels = rng.integers(0, columns, rows)
  labels[1], inv_temp[1] = 300, 50.0  # a cold row: its label's term underflows
  capped[1, 256:] = 0.0
  capped[1, 300] = -0.9 * (softcap or 10.0)
  z = capped * inv_temp[:, None]
  excluded = rng.random(z.shape) < 0.2
  excluded[0, 128:256] = True  # a tile with none kept
  excluded[np.arange(rows), labels] = False
  z[excluded] = -np.inf
  tile_max = np.maximum(np.max(z.reshape(rows, 3, 128), axis=2), np.finfo(np.float32).min)
  e = np.asarray(jnp.asarray(np.exp(z - np.repeat(tile_max, 128, axis=1)), jnp.bfloat16),
                 np.float64)
  e[1, 300] = 0.0
  m = np.max(z, axis=1)
  log_sum = np.log(np.sum(np.exp(z - m[:, None]), axis=1))
  entropy = rng.uniform(0.0, 5.0, rows)  # (any number: the kernel takes H as given)
  g_logp, g_entropy = rng.normal(size=rows) * 0.01, rng.normal(size=rows)
  valid = np.arange(rows) != 4
  e[4] = np.nan
  label_z = z[np.arange(rows), labels]
  tiles = np.zeros((3, 4, rows))
  tiles[:, 0] = tile_max.T
  tiles[labels // 128, 3, np.arange(rows)] = label_z
  tokens = Tokens(labels=jnp.asarray(labels + start, jnp.int32),
                  inv_temp=jnp.asarray(inv_temp, jnp.float32), valid=jnp.asarray(valid),
                  kept=None)
  f32 = lambda a: jnp.asarray(a, jnp.float32)
  got = mosaic_rows_grad.exp_overwrite(
      jnp.asarray(e, jnp.bfloat16), f32(tiles), tokens, tuple(map(f32, (m, log_sum, entropy))),
      tuple(map(f32, (g_logp, g_entropy))), start, layout=mosaic_tile.Segments(columns, 1, 1),
      softcap=softcap, interpret=kernel_device()["interpret"])
  # float64: the gradient of the logits whose terms are e (log p = log e + m_tile - lse)
  with np.errstate(divide="ignore", invalid="ignore"):
    log_p = np.log(e) + np.repeat(tile_max, 128, axis=1) - (m + log_sum)[:, None]
    p = np.exp(log_p)
    plogp = np.where(e > 0, p * log_p, 0.0)
  onehot = np.arange(columns) == labels[:, None]
  dz = onehot * g_logp[:, None] - p * (g_logp + g_entropy * entropy)[:, None] - (
      plogp * g_entropy[:, None])
  want = dz * inv_temp[:, None]
  if softcap is not None:
    want = want * (1 - np.square(np.where(onehot, (label_z / inv_temp)[:, None], capped)
                                 / softcap))
  want[~valid] = 0
  got = np.asarray(got, np.float64)
  assert got.shape == (rows, columns) and np.all(got[4] == 0)
  assert got[1, 300] != 0 and np.isfinite(got).all()
  # One bf16 rounding of each output (f32 arithmetic far below it), column by column.
  error = np.abs(got - want)
  bad = error > 2**-8 * np.abs(want) + 1e-6 * np.max(np.abs(want))
  assert not bad.any(), (got[bad][:5], want[bad][:5])


def test_objective_kernels_inside_shard_map():
  """The objective path's kernels inside ``shard_map`` (through the sharded wrapper, on one
  device: the interpreter runs one): the gradients keep the weight shard's varying type
  (the kernels' outputs carry none) and are the unsharded call's bits."""
  from jax.sharding import Mesh  # pylint: disable=import-outside-toplevel
  rng, hidden, weight = _inputs(9, 300, 64, 512, 1)
  labels = jnp.asarray(rng.integers(0, 512, 300), jnp.int32)
  a, b = (jnp.asarray(rng.normal(size=300), jnp.float32) for _ in range(2))
  objective = lambda logp, entropy, a, b: a * logp + b * entropy
  mesh = Mesh(np.array(jax.devices()[:1]), ("v",))
  run = lambda f, **k: jax.jit(jax.value_and_grad(lambda h, w: f(
      objective, h, w, labels, a, b, implementation="mosaic", **k)[0], (0, 1)))(hidden, weight)
  got = run(jaxce.sharded_linear_token_loss, mesh=mesh, vocab_axis="v")
  want = run(jaxce.linear_token_loss)
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    assert np.array_equal(np.asarray(g, np.float32), np.asarray(w, np.float32))
