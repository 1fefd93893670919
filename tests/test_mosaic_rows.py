"""The logits path's Mosaic GPU forward (``mosaic_rows``, ``implementation="mosaic"``),
run in JAX's GPU interpreter off GPUs: its group statistics against float64, the public
calls (both logits-path functions and the fused objective's row statistics) against XLA
and the float64 reference with gradients, and a token's bits whatever the call around it.
On GPUs the tally (``bash scripts/gpu_tests.sh``) runs these tests on the compiled kernel;
the bench's logits-path rows (``python -m bench``) time it at full size."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import TOLERANCE, assert_close, count_primitives, devices, jaxce, kernel_device
from helpers import reference
from helpers import skip_module_without_mosaic_interpreter, value_and_grads
from jaxce._kernels.mosaic import merge as mosaic_merge, rows as mosaic_rows
from jaxce._kernels.mosaic import tile as mosaic_tile

skip_module_without_mosaic_interpreter()


def _group_columns(columns):
  """``[(first, stop)]``: each group's columns, in order, as ``mosaic_rows`` groups a
  single call's ``columns`` (the groups of each segment of whole tiles, the last tile of
  a ragged width partial)."""
  layout = mosaic_tile.segments(columns)
  size = mosaic_rows.tiles_per_group(layout) * mosaic_rows.TILE
  return [(s * layout.width + k, min(s * layout.width + k + size, (s + 1) * layout.width))
          for s in range(layout.count) for k in range(0, layout.width, size)]


def _logits(rng, tokens, columns, dtype):
  """Peaked and shifted rows: a per-row offset of +-60, a spike per row, a -inf column."""
  x = rng.normal(size=(tokens, columns)) * 3 + rng.uniform(-60, 60, (tokens, 1))
  x[np.arange(tokens), rng.integers(0, columns, tokens)] += 25
  x[::5, 3] = -np.inf
  return jnp.asarray(x, dtype)


@pytest.mark.parametrize("tokens,columns,dtype,limit,min_tiles", [
    (8, 128, jnp.bfloat16, None, 8),      # fewer rows than a CTA's: padded
    (300, 384, jnp.float32, 300, 1),      # a ragged row count (padded to 8), 3 groups, a limit
    (136, 256, jnp.float16, None, 1),     # the last row block moved back, 2 groups
    (64, 1152, jnp.bfloat16, 1100, 4),    # a short last group
    (136, 400, jnp.bfloat16, None, 2),    # V not a multiple of 128: a partial last tile
    (300, 1008, jnp.float32, 1000, 4),    # (in a short last group, behind a limit)
    (64, 1024, jnp.bfloat16, None, 1),    # 8 segments of one tile each: a group each
    (136, 2432, jnp.bfloat16, None, 2),   # 8 segments of 304: each tiled from its first
    (300, 1408, jnp.float32, 1300, 1),    # column, its last tile partial; 8 of 176, a limit
    (136, 401, jnp.bfloat16, None, 2),    # an odd width: loaded by the kernel itself,
    (300, 1003, jnp.float32, 1000, 4),    # its last tile the row's last 128 columns; a limit
    (530, 200, jnp.float16, None, 1),     # rows of 16 bytes, not 32
])
def test_group_statistics_match_float64(tokens, columns, dtype, limit, min_tiles, monkeypatch):
  monkeypatch.setattr(mosaic_rows, "CONFIG", dataclasses.replace(mosaic_rows.CONFIG,
                                                              min_tiles_per_group=min_tiles))
  rng = np.random.default_rng(tokens + columns)
  x = _logits(rng, tokens, columns, dtype)
  inv_temp = rng.uniform(0.5, 2.0, tokens).astype(np.float32)
  picked = rng.normal(size=tokens).astype(np.float32)
  tiles = mosaic_rows.statistics(x, jnp.asarray(inv_temp), jnp.asarray(picked), limit,
                                 layout=mosaic_tile.segments(columns), with_entropy=True,
                                 interpret=kernel_device()["interpret"])
  groups = _group_columns(columns)
  assert tiles.shape == (len(groups), 4, tokens)
  z = np.asarray(x.astype(jnp.float32), np.float64) * inv_temp[:, None].astype(np.float64)
  if limit is not None:
    z[:, limit:] = -np.inf
  tiles = np.asarray(tiles, np.float64)
  for g, (first, stop) in enumerate(groups):
    part = z[:, first:stop]
    m = np.maximum(part.max(axis=1), np.finfo(np.float32).min)
    e = np.exp(part - m[:, None])
    q = np.sum(e * np.where(np.isfinite(part), part - m[:, None], 0), axis=1)
    scale = np.max(np.abs(m))
    assert_close(tiles[g, 0], m, 2**-22 * scale, f"group {g}: m")
    assert_close(tiles[g, 1], e.sum(axis=1), 2e-6 * e.sum(axis=1).max() * (1 + scale), f"s {g}")
    assert_close(tiles[g, 2], q, 2e-6 * e.sum(axis=1).max() * (1 + scale), f"q {g}")
    np.testing.assert_array_equal(tiles[g, 3], picked if g == 0 else 0)


@pytest.mark.parametrize("columns,with_kept", [(400, False), (656, True), (2432, True)])
def test_only_the_partial_tiles_group_is_masked(columns, with_kept, monkeypatch):
  """A width whose last tile is partial runs its last group (with several segments, each
  segment's: 2432 columns are 8 of 304) in a call of its own, the only
  one whose fold masks columns: the groups' statistics are one call's that masks every
  tile (the mask excludes no column of a whole tile), ``m`` and the picked logit bit for
  bit, the sums up to rounding (without the mask's select, a compiler may fuse the fold
  differently; the split is a function of the width alone, so each token's bits still
  depend on its own inputs only)."""
  monkeypatch.setattr(mosaic_rows, "CONFIG", dataclasses.replace(mosaic_rows.CONFIG,
                                                              min_tiles_per_group=2))
  rng = np.random.default_rng(columns)
  tokens = 136
  x = _logits(rng, tokens, columns, jnp.bfloat16)
  inv_temp = jnp.asarray(rng.uniform(0.5, 2.0, tokens), jnp.float32)
  layout = mosaic_tile.segments(columns)
  assert layout.partial and mosaic_rows.num_groups(layout) > 1
  words = None
  if with_kept:
    label_column = jnp.asarray(rng.integers(0, columns, tokens))
    words = mosaic_tile.segment_kept_words(
        jaxce.keep.pack(jnp.asarray(rng.random((tokens, columns)) < 0.3)), label_column, tokens,
        layout)
  row_inputs = mosaic_tile.stack(mosaic_tile.RowsStatisticsInputs(
      inv_temp=inv_temp, picked=jnp.asarray(rng.normal(size=tokens), jnp.float32),
      limit=jnp.full((tokens,), float(columns), jnp.float32)))
  row_inputs = row_inputs[:, mosaic_rows.block_rows(tokens)].transpose(1, 0, 2)
  kw = dict(layout=layout, with_entropy=True, stages=2,
            interpret=kernel_device()["interpret"])
  calls = []
  one_call = mosaic_rows._group_statistics
  monkeypatch.setattr(mosaic_rows, "_group_statistics",
                      lambda *a, **k: calls.append(k["masked"]) or one_call(*a, **k))
  split = mosaic_rows._statistics(x, row_inputs, words, masked=False, **kw)
  assert calls == [False, True]
  whole = one_call(mosaic_rows.columns_view(x, layout), row_inputs, words, lambda i: i,
                   mosaic_rows.num_groups(layout), masked=True, tiled_rows=True, **kw)
  split, whole = np.asarray(split), np.asarray(whole)  # [groups, row blocks, 4, rows]
  for field in (0, 3):  # m, picked
    assert np.array_equal(split[:, :, field].view(np.uint32), whole[:, :, field].view(np.uint32))
  s, q = (split[:, :, i].astype(np.float64) for i in (1, 2))
  want_s, want_q = (whole[:, :, i].astype(np.float64) for i in (1, 2))
  assert_close(s / want_s, np.ones_like(s), 1e-5, "s")
  scale = (np.abs(whole[:, :, 0]) + 1) * want_s  # (q's error is relative to this)
  assert_close(q / scale, want_q / scale, 1e-6, "q")


@pytest.mark.parametrize("tokens,columns,dtype,limit", [
    (136, 384, jnp.bfloat16, None),  # the last row block moved back, 3 groups
    (300, 256, jnp.float32, 200),    # a ragged row count (padded to 8), a limit
    (136, 400, jnp.bfloat16, None),  # a partial last tile: its words past V are zeros
    (136, 1408, jnp.bfloat16, None),  # 8 segments of 176: their words start mid-word
    (300, 401, jnp.bfloat16, None),  # an odd width: the last tile's words from V - 128
])
def test_group_statistics_over_kept_sets(tokens, columns, dtype, limit, monkeypatch):
  """Kept sets read with the tiles: ~5 % kept at random, a row keeping its label alone (or
  nothing: the label column still kept), a row keeping every column; each matches float64
  over exactly its kept columns and the label's."""
  monkeypatch.setattr(mosaic_rows, "CONFIG", dataclasses.replace(mosaic_rows.CONFIG,
                                                              min_tiles_per_group=1))
  rng = np.random.default_rng(tokens + 7)
  x = _logits(rng, tokens, columns, dtype)
  inv_temp = rng.uniform(0.5, 2.0, tokens).astype(np.float32)
  label_column = rng.integers(-40, columns + 40, tokens)  # (outside: the label lies elsewhere)
  kept = rng.random((tokens, columns)) < 0.05
  kept[1] = False
  kept[2] = True
  words = jaxce.keep.pack(kept)
  tiles = mosaic_rows.statistics(x, jnp.asarray(inv_temp), jnp.zeros(tokens, jnp.float32),
                                 limit, words, jnp.asarray(label_column),
                                 layout=mosaic_tile.segments(columns), with_entropy=True,
                                 interpret=kernel_device()["interpret"])
  groups = _group_columns(columns)
  z = np.asarray(x.astype(jnp.float32), np.float64) * inv_temp[:, None].astype(np.float64)
  owned = (label_column >= 0) & (label_column < columns)
  kept[np.arange(tokens), np.clip(label_column, 0, columns - 1)] |= owned
  z[~kept] = -np.inf
  if limit is not None:
    z[:, limit:] = -np.inf
  tiles = np.asarray(tiles, np.float64)
  assert tiles.shape[0] == len(groups)
  for g, (first, stop) in enumerate(groups):
    part = z[:, first:stop]
    m = np.maximum(part.max(axis=1), np.finfo(np.float32).min)
    e = np.exp(part - m[:, None])
    q = np.sum(e * np.where(np.isfinite(part), part - m[:, None], 0), axis=1)
    scale = np.max(np.abs(np.where(np.isfinite(part).any(axis=1), m, 0)))
    assert_close(tiles[g, 0], m, 2**-22 * np.max(np.abs(m)), f"group {g}: m")
    assert_close(tiles[g, 1], e.sum(axis=1), 2e-6 * max(e.sum(axis=1).max(), 1) * (1 + scale),
                 f"s {g}")
    assert_close(tiles[g, 2], q, 2e-6 * max(e.sum(axis=1).max(), 1) * (1 + scale), f"q {g}")


@pytest.mark.parametrize("tokens,columns", [(40, 384), (300, 384), (300, 400), (136, 1408),
                                            (296, 401)])
def test_matches_xla_and_reference(tokens, columns):
  """bf16 logits, per-token temperature, a padded vocabulary, ignored and masked tokens,
  random cotangents for both outputs: the Mosaic forward as exact as XLA's, the same
  gradient; also at a width that is not a multiple of 128 (a partial last tile), and at
  an odd one (rows the kernel loads itself; the last block of 64 rows moved back)."""
  rng = np.random.default_rng(tokens)
  x = _logits(rng, tokens, columns, jnp.bfloat16)
  vocab = 370 if columns == 384 else columns - 9  # (live columns in a partial tile)
  labels = rng.integers(0, vocab, tokens)
  labels[rng.random(tokens) < 0.1] = -100
  loss_kw = dict(labels=labels, cot_logp=rng.normal(size=tokens),
                 cot_entropy=rng.normal(size=tokens))
  kw = dict(temperature=rng.uniform(0.6, 1.5, tokens), vocab_size=vocab,
            where=rng.random(tokens) < 0.9)
  f = jaxce.logprobs_and_entropy
  mosaic = value_and_grads(f, (x,), (0,), implementation="mosaic", **loss_kw, **kw)
  xla = value_and_grads(f, (x,), (0,), implementation="xla", **loss_kw, **kw)
  exact = value_and_grads(reference.logprobs_and_entropy, (jnp.asarray(x, jnp.float64),), (0,),
                          **loss_kw, **kw)
  for i, name in enumerate(("logp", "entropy")):
    err_mosaic = np.max(np.abs(np.asarray(mosaic[0][i], np.float64) - exact[0][i]))
    err_xla = np.max(np.abs(np.asarray(xla[0][i], np.float64) - exact[0][i]))
    assert err_mosaic <= 1.5 * err_xla + 2e-6, (name, err_mosaic, err_xla)
  g, gx = (np.asarray(a[1][0], np.float32) for a in (mosaic, xla))
  assert_close(g, gx, 2**-7 * np.max(np.abs(gx)), "d logits")


@pytest.mark.parametrize("path", ["logprobs_and_entropy", "token_loss"])
def test_kept_sets_match_xla_and_reference(path):
  """``keep=`` in the kernel: ~5 % kept, a row whose arg-max is dropped, a row keeping its
  label alone, a label outside its kept set, a padded vocabulary and a per-token
  temperature; values as exact as XLA's against float64, the same gradient. The planner
  keeps the call on the kernel."""
  rng = np.random.default_rng(11)
  tokens, columns, vocab = 200, 384, 370
  x = _logits(rng, tokens, columns, jnp.bfloat16)
  labels = rng.integers(0, vocab, tokens)
  mask = rng.random((tokens, columns)) < 0.05
  mask[np.arange(tokens), labels] = True
  mask[0, np.argmax(np.asarray(x[0], np.float32))] = False
  mask[1] = False
  mask[1, labels[1]] = True
  mask[2, labels[2]] = False
  kw = dict(labels=labels, keep=jaxce.keep.pack(mask), vocab_size=vocab,
            temperature=rng.uniform(0.6, 1.5, tokens))
  cot = rng.normal(size=(2, tokens))
  if path == "token_loss":
    objective = lambda logp, entropy, c0, c1: c0 * logp + c1 * entropy
    fn = lambda x, **o: jaxce.token_loss(objective, x, kw["labels"], *cot, **o, **{
        k: v for k, v in kw.items() if k != "labels"})[0]
    ref = lambda x: _weighted_sum(reference.logprobs_and_entropy(x, **kw), cot)
  else:
    fn = lambda x, **o: _weighted_sum(jaxce.logprobs_and_entropy(x, **o, **kw), cot)
    ref = lambda x: _weighted_sum(reference.logprobs_and_entropy(x, **kw), cot)
  plan = jaxce.plan.of(lambda x: fn(x, implementation="mosaic"), x)
  assert plan.backend == "mosaic"
  mosaic, xla = (jax.value_and_grad(lambda x: fn(x, implementation=b))(x)
                 for b in ("mosaic", "xla"))
  exact = jax.value_and_grad(ref)(jnp.asarray(x, jnp.float64))
  err_mosaic, err_xla = (abs(float(a[0]) - float(exact[0])) for a in (mosaic, xla))
  assert err_mosaic <= 1.5 * err_xla + 1e-5 * (1 + abs(float(exact[0]))), (err_mosaic, err_xla)
  g, gx = (np.asarray(a[1], np.float32) for a in (mosaic, xla))
  assert np.all(np.isfinite(g))
  assert_close(g, gx, 2**-7 * np.max(np.abs(gx)), "d logits")
  dropped = ~mask
  dropped[np.arange(tokens), labels] = False
  assert np.all(g[dropped] == 0)


def _weighted_sum(outputs, cot):
  return jnp.sum(cot[0] * outputs[0]) + jnp.sum(cot[1] * outputs[1])


def _backward_kernels(loss, x):
  """The kernel calls ``jax.grad(loss)`` at ``x`` adds to ``loss``'s own (its backward's)."""
  # (plgpu.kernel's primitive is mpmd_map in JAX 0.11 and 0.12; pallas_call counts too)
  kernels = lambda fn: count_primitives(jax.make_jaxpr(fn)(x), "mpmd_map", "pallas_call")
  return kernels(jax.grad(loss)) - kernels(loss)


@pytest.mark.parametrize("tokens,keep,in_place,entropy_cotangent,kernel,columns", [
    (200, False, True, True, True, 384),     # 3 whole blocks of rows, then 8 rows by XLA
    (128, True, True, True, True, 384),      # kept sets read with the tiles
    (64, False, True, False, True, 384),     # no entropy cotangent (a symbolic zero)
    (60, False, True, True, False, 384),     # T not a multiple of 8: XLA's loop
    (200, True, False, True, True, 384),     # kept sets, a new array: the last block moved back
    (40, True, False, False, True, 384),     # below ROWS rows: a padded copy
    (60, True, False, True, False, 384),     # T not a multiple of 8: XLA's fused pass
    (200, False, True, True, True, 400),     # the last tile partial: in place,
    (128, True, True, True, True, 400),      # with kept sets,
    (200, True, False, True, True, 400),     # into a new array
    (200, False, True, True, True, 1408),    # 8 segments of 176 (each's last tile
    (128, True, True, True, True, 1408),     # partial): in place, with kept sets,
    (200, True, False, True, True, 1408),    # into a new array
    (200, False, True, True, False, 401),    # an odd width: XLA's loop in place,
    (128, True, False, True, False, 401),    # its fused pass with kept sets
])
def test_gradient_kernels_match_xla(tokens, keep, in_place, entropy_cotangent, kernel, columns):
  """The gradient kernel on the Mosaic plan, over the logits (``backward_in_place=True``:
  its output aliases them) or, with a kept set, into a new array, with a padded
  vocabulary, per-token temperature, ignored tokens and random cotangents; the same
  gradient as XLA's, float64's within bf16 rounding, exactly zero at excluded columns and
  ignored rows. ``kernel``: whether the backward runs the kernel (one more Pallas call in
  the fwd+bwd's jaxpr than in the forward's)."""
  rng = np.random.default_rng(tokens)
  vocab = 370 if columns == 384 else columns - 9  # (live columns in a partial tile)
  x = _logits(rng, tokens, columns, jnp.bfloat16)
  labels = rng.integers(0, vocab, tokens)
  where = rng.random(tokens) < 0.9
  kw = dict(labels=labels, vocab_size=vocab, temperature=rng.uniform(0.6, 1.5, tokens),
            where=where)
  if keep:
    mask = rng.random((tokens, columns)) < 0.05
    mask[1] = False
    kw["keep"] = jaxce.keep.pack(mask)
  cot = rng.normal(size=(2, tokens)) * np.array([[1.0], [1.0 if entropy_cotangent else 0.0]])
  loss = lambda f, **o: lambda x: _weighted_sum(f(x, **o, **kw), cot)
  f = jaxce.logprobs_and_entropy
  forward = loss(f, implementation="mosaic", backward_in_place=in_place)
  mosaic = jax.grad(forward)
  assert _backward_kernels(forward, x) == kernel
  got = jax.jit(mosaic)(x)
  new = jax.jit(jax.grad(loss(f, implementation="xla")))(x)
  exact = jax.grad(loss(reference.logprobs_and_entropy))(jnp.asarray(x, jnp.float64))
  g, gx, ge = (np.asarray(a, np.float64) for a in (got, new, exact))
  assert np.all(np.isfinite(g))
  assert_close(g, gx, 2**-7 * np.max(np.abs(gx)), "vs XLA")
  assert_close(g, ge, 2**-7 * np.max(np.abs(ge)), "vs float64")
  assert np.all(g[:, vocab:] == 0) and np.all(g[~where] == 0)
  if keep:
    dropped = ~mask
    dropped[np.arange(tokens), labels] = False
    assert np.all(g[dropped] == 0)


@pytest.mark.parametrize("keep,in_place", [(True, False), (False, True), (True, True)])
def test_gradient_kernel_precision_at_large_logits(keep, in_place):
  """f32 logits ~100 at temperature 0.1 (z ~ 1000, where an f32 ulp is 6e-5), two equal
  maxima per row and a per-row shift: the gradient kernel (with a kept set, over the
  logits, or both) as close to float64 as plain JAX's f32 gradient, within ``TOLERANCE``.
  A kernel that forms ``z - (m + log s)`` rounds ``m + log s`` at 1000 and is 5e-4 off;
  ``(z - m) - log s`` is exact where ``z`` is near ``m``, as ``softmax.logit_grad``."""
  tokens, columns = 128, 256  # (two whole blocks of rows: the kernel takes every row)
  x = np.full((tokens, columns), 97.0)
  x[:, :2] = 100.0
  x = jnp.asarray(x + 0.037 * np.arange(tokens)[:, None], jnp.float32)
  labels = jnp.asarray(np.arange(tokens) % 3, jnp.int32)
  cot = np.random.default_rng(5).normal(size=(2, tokens))
  kw = dict(labels=labels, temperature=0.1)
  if keep:  # (every column but a few: the label's column is always in the row's set)
    kw["keep"] = jaxce.keep.pack(jnp.asarray((np.arange(columns) % 61 != 60)[None]
                                             .repeat(tokens, 0)))
  loss = lambda f, **o: lambda x: _weighted_sum(f(x, **o, **kw), cot)
  forward = loss(jaxce.logprobs_and_entropy, implementation="mosaic", backward_in_place=in_place)
  assert _backward_kernels(forward, x) == 1
  got = jax.jit(jax.grad(forward))(x)
  plain = jax.jit(jax.grad(loss(reference.logprobs_and_entropy)))(x)
  exact = jax.grad(loss(reference.logprobs_and_entropy))(jnp.asarray(x, jnp.float64))
  err = lambda g: float(np.max(np.abs(np.asarray(g, np.float64) - np.asarray(exact))))
  assert err(got) <= err(plain) + TOLERANCE[jnp.float32]["grad"], (err(got), err(plain))


@pytest.mark.parametrize("keep,in_place", [(True, False), (False, True)])
def test_gradient_kernel_zero_at_ignored_rows_of_nan_or_inf(keep, in_place):
  """Ignored rows (``where=False``) whose logits hold NaN or +inf (padding rows of a model
  that left them undefined) get an exactly zero gradient from the gradient kernel, as
  from XLA's pass, and the other rows theirs: the row mask comes after every factor."""
  rng = np.random.default_rng(8)
  tokens, columns = 128, 256  # (whole blocks of rows: the kernel takes every row)
  x = np.array(_logits(rng, tokens, columns, jnp.float32))
  where = np.ones(tokens, bool)
  where[[3, 70, 71]] = False
  x[3, 5], x[70, :], x[71, 9] = np.nan, np.inf, np.inf
  x = jnp.asarray(x, jnp.bfloat16)
  kw = dict(labels=rng.integers(0, columns, tokens), where=where)
  if keep:
    kw["keep"] = jaxce.keep.pack(jnp.asarray(rng.random((tokens, columns)) < 0.5))
  cot = rng.normal(size=(2, tokens))
  loss = lambda **o: lambda x: _weighted_sum(jaxce.logprobs_and_entropy(x, **o, **kw), cot)
  forward = loss(implementation="mosaic", backward_in_place=in_place)
  assert _backward_kernels(forward, x) == 1
  got = np.asarray(jax.jit(jax.grad(forward))(x), np.float32)
  want = np.asarray(jax.jit(jax.grad(loss(implementation="xla")))(x), np.float32)
  assert np.all(want[~where] == 0), want[~where]
  assert np.all(got[~where] == 0), got[~where]
  assert_close(got[where], want[where], 2**-7 * np.max(np.abs(want)), "valid rows")


def test_sharded_kept_sets_gradient_kernel():
  """The sharded call (``shard_map`` over a vocab axis of two devices; one on a host of
  one GPU) with a kept set on the Mosaic plan: the gradient kernel's output typed as
  varying over the axis, values and gradients those of the unsharded XLA call."""
  rng = np.random.default_rng(11)
  tokens, columns = 72, 512
  x = _logits(rng, tokens, columns, jnp.bfloat16)
  labels = jnp.asarray(rng.integers(0, columns, tokens), jnp.int32)
  keep = jaxce.keep.pack(jnp.asarray(rng.random((tokens, columns)) < 0.05))
  cot = rng.normal(size=(2, tokens))
  mesh = jax.sharding.Mesh(np.array(devices(min(2, jax.device_count()))), ("v",))
  sharded = lambda x: _weighted_sum(jaxce.sharded_logprobs_and_entropy(
      x, labels, mesh=mesh, vocab_axis="v", keep=keep, implementation="mosaic"), cot)
  single = lambda x: _weighted_sum(jaxce.logprobs_and_entropy(
      x, labels, keep=keep, implementation="xla"), cot)
  got, want = (jax.jit(jax.value_and_grad(f))(x) for f in (sharded, single))
  assert_close(float(got[0]), float(want[0]), 1e-5 * abs(float(want[0])), "loss")
  w = np.asarray(want[1], np.float32)
  assert_close(np.asarray(got[1], np.float32), w, 2**-7 * np.max(np.abs(w)), "gradient")


@pytest.mark.parametrize("path", ["token_loss", "linear_token_loss"])
def test_objective_paths_match_xla(path):
  rng = np.random.default_rng(3)
  tokens = 72
  labels = jnp.asarray(rng.integers(0, 256, tokens), jnp.int32)
  adv = jnp.asarray(rng.normal(size=tokens), jnp.float32)
  objective = lambda logp, entropy, adv: -adv * logp - 0.01 * entropy
  if path == "token_loss":
    operands = (_logits(rng, tokens, 256, jnp.bfloat16),)
    fn = lambda *a, **kw: jaxce.token_loss(objective, *a, labels, adv, **kw)[0]
  else:
    hidden = jnp.asarray(rng.normal(size=(tokens, 64)), jnp.bfloat16)
    weight = jnp.asarray(rng.normal(size=(64, 256)) * 0.3, jnp.bfloat16)
    operands = (hidden, weight)
    fn = lambda *a, **kw: jaxce.linear_token_loss(objective, *a, labels, adv, **kw)[0]
  assert jaxce.plan.of(lambda *a: fn(*a, implementation="mosaic"), *operands).backend == "mosaic"
  got = jax.value_and_grad(lambda *a: fn(*a, implementation="mosaic"),
                           tuple(range(len(operands))))(*operands)
  want = jax.value_and_grad(lambda *a: fn(*a, implementation="xla"),
                            tuple(range(len(operands))))(*operands)
  assert_close(got[0], want[0], 1e-5 * (1 + abs(float(want[0]))), "loss")
  for g, w in zip(got[1], want[1]):
    w = np.asarray(w, np.float32)
    assert_close(np.asarray(g, np.float32), w, 2**-7 * np.max(np.abs(w)), "gradient")


@pytest.mark.parametrize("columns", [256, 401])
def test_each_tokens_bits_do_not_depend_on_the_call(columns):
  """Batch invariance by construction, in either mode: a token's logp and entropy are the
  same bits alone (padded to the kernel's rows), among 9 and 200 tokens at random
  positions (one the last row), inside ``jit(grad)`` with the temperature closed over or
  passed, and forward only; at an odd width too, where a token's row starts at any
  address. The planner says so. (On GPUs the same test is in the GPU tally: there the
  temperature's reciprocal comes from ``mosaic_reciprocal``.)"""
  rng = np.random.default_rng(9)
  x = _logits(rng, 200, columns, jnp.bfloat16)
  labels = rng.integers(0, columns, 200)
  temperature = rng.uniform(0.6, 1.4, 200).astype(np.float32)
  probes = np.arange(3)

  def call(rows, differentiate=False, constant=False, invariant=False):
    f = lambda x, t: jaxce.logprobs_and_entropy(x, labels[rows], temperature=t,
                                                batch_invariant=invariant,
                                                implementation="mosaic")
    t = jnp.asarray(temperature[rows])
    if not differentiate:
      return f(x[rows], t)
    loss = lambda x, t: (lambda o: (jnp.sum(o[0]) + jnp.sum(o[1]), o))(f(x, t))
    if constant:
      return jax.jit(jax.grad(lambda x: loss(x, t), has_aux=True))(x[rows])[1]
    return jax.jit(jax.grad(loss, has_aux=True))(x[rows], t)[1]

  bits = lambda out, at: tuple(np.asarray(o)[at].view(np.uint32) for o in out)
  plan = jaxce.plan.of(jaxce.logprobs_and_entropy, x, labels, implementation="mosaic")
  assert plan.invariant_to == ("tokens", "chunking", "differentiation", "constants")
  for invariant in (False, True):
    want = tuple(np.stack(w) for w in zip(*[
        bits(call(np.array([p]), invariant=invariant), 0) for p in probes]))
    for tokens, extra in ((9, {}), (200, {}), (200, dict(differentiate=True, constant=True)),
                          (200, dict(differentiate=True))):
      others = rng.permutation(np.arange(3, 200))[:tokens - len(probes)]
      at = np.concatenate([[tokens - 1], rng.permutation(tokens - 1)[:len(probes) - 1]])
      rows = np.empty(tokens, np.int64)
      rows[at] = probes
      rows[np.setdiff1d(np.arange(tokens), at)] = others
      got = bits(call(rows, invariant=invariant, **extra), at)
      for name, g, w in zip(("logp", "entropy"), got, want):
        assert np.array_equal(g, w), f"T = {tokens} {extra} {invariant}: {name}"


def test_merge_takes_the_groups_in_order():
  """The groups reach ``mosaic_merge`` in the columns' order (group 0 holds the label's
  z): the merged log-prob of a row equals the float64 one."""
  rng = np.random.default_rng(1)
  x = _logits(rng, 64, 512, jnp.float32)
  inv_temp = jnp.ones(64, jnp.float32)
  z = np.asarray(x, np.float64)
  labels = rng.integers(0, 512, 64)
  picked = jnp.asarray(z[np.arange(64), labels], jnp.float32)
  tiles = mosaic_rows.statistics(x, inv_temp, picked, None, layout=mosaic_tile.segments(512),
                                 with_entropy=True,
                                 interpret=kernel_device()["interpret"])
  logp = mosaic_merge.merge(tiles, with_entropy=True, interpret=kernel_device()["interpret"])[0]
  m = z.max(axis=1)
  want = z[np.arange(64), labels] - (m + np.log(np.exp(z - m[:, None]).sum(axis=1)))
  assert_close(logp, want, 1e-5, "logp")
