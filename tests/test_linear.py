"""The fused LM-head path against the float64 reference: values and all three gradients."""

import functools
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

from helpers import (TOLERANCE, assert_close, devices, jaxce, reference, reference_options,
                     value_and_grads)


def _case(seed, shape, dim, num_columns, vocab_size=None, ignore=0.2):
  rng = np.random.default_rng(seed)
  hidden = rng.normal(size=shape + (dim,))
  weight = rng.normal(size=(dim, num_columns)) * 2 / np.sqrt(dim)
  weight[:, rng.integers(0, num_columns, 3)] *= 6  # a few peaked columns
  bias = rng.normal(size=num_columns) - 3.0
  labels = rng.integers(0, vocab_size or num_columns, shape)
  labels[rng.random(shape) < ignore] = -100
  loss_kw = dict(labels=labels, cot_logp=rng.normal(size=shape), cot_entropy=rng.normal(size=shape))
  return rng, hidden, weight, bias, loss_kw


def _check(hidden, weight, bias, dtype, loss_kw, **kw):
  arrays = tuple(jnp.asarray(a, dtype) for a in (hidden, weight, bias))
  f = lambda h, w, b, labels, **k: jaxce.linear_logprobs_and_entropy(h, w, labels, bias=b, **k)
  fr = lambda h, w, b, labels, **k: reference.linear_logprobs_and_entropy(h, w, labels, bias=b, **k)
  (logp, ent), grads = value_and_grads(f, arrays, (0, 1, 2), **loss_kw, **kw)
  ref_kw = reference_options(reference.linear_logprobs_and_entropy, kw)
  (logp_r, ent_r), grads_r = value_and_grads(
      fr, tuple(jnp.asarray(a, jnp.float64) for a in arrays), (0, 1, 2), **loss_kw, **ref_kw)
  tol = TOLERANCE[dtype]
  assert_close(logp, logp_r, tol["value"], "logp")
  assert_close(ent, ent_r, tol["value"], "entropy")
  for name, g, gr, a in zip(("d hidden", "d weight", "d bias"), grads, grads_r, arrays):
    assert g.dtype == a.dtype
    assert_close(g, gr, tol["grad"] * 10, name)  # sums over T or V of f32 products
  return logp, ent, grads


@pytest.mark.parametrize("chunk_size,vocab_block_size", [
    (1, 1009), (7, 100), (13, 333), (36, 1009), (37, 64), (100, 2000), (None, None)])
def test_tilings_match_reference(chunk_size, vocab_block_size):
  _, h, w, b, loss_kw = _case(0, (37,), 24, 1009)
  _check(h, w, b, jnp.float32, loss_kw, chunk_size=chunk_size, vocab_block_size=vocab_block_size,
         temperature=0.8)


def test_float64_is_exact_with_softcap_temperature_mask_padding():
  rng, h, w, b, loss_kw = _case(1, (3, 7), 17, 517, vocab_size=500)
  where = rng.random((3, 7)) < 0.8
  _check(h, w, b, jnp.float64, loss_kw, chunk_size=4, vocab_block_size=96, logit_softcap=5.0,
         temperature=rng.uniform(0.5, 1.5, (3, 1)), vocab_size=500, where=where)


@pytest.mark.parametrize("chunk_size,vocab_block_size,vocab_size", [
    (8, 96, 500), (None, None, None), (5, 1000, 1009)])
def test_triton_statistics_match_reference(chunk_size, vocab_block_size, vocab_size):
  """The forward's one-pass kernel (Pallas interpret mode): a ragged last block whose
  overlap must not count twice, padded columns, softcap and per-token temperature."""
  rng, h, w, b, loss_kw = _case(5, (2, 11), 16, 1009, vocab_size=vocab_size)
  _check(h, w, b, jnp.float32, loss_kw, chunk_size=chunk_size,
         vocab_block_size=vocab_block_size, vocab_size=vocab_size, logit_softcap=8.0, temperature=rng.uniform(0.5, 1.5, (2, 1)),
         implementation="triton")


def test_check_grads_float64():
  _, h, w, b, loss_kw = _case(2, (5,), 6, 23, ignore=0.0)
  labels = loss_kw["labels"]
  f = lambda h, w, b: jaxce.linear_logprobs_and_entropy(
      h, w, labels, bias=b, chunk_size=2, vocab_block_size=10, logit_softcap=3.0)
  check_grads(f, (h, w, b), order=1, modes=["rev"])


@pytest.mark.parametrize("layout", ["dv_of_transpose", "vd"])
def test_tied_embedding(layout):
  rng, h, w, _, loss_kw = _case(3, (11,), 16, 301)
  embedding = jnp.asarray(w.T, jnp.float32)  # [V, D]
  labels = loss_kw["labels"]
  kw = dict(chunk_size=4, vocab_block_size=64)
  if layout == "vd":
    fn = lambda h, e, l: jaxce.linear_logprobs_and_entropy(h, e, l, weight_layout="vd", **kw)
  else:
    fn = lambda h, e, l: jaxce.linear_logprobs_and_entropy(h, e.T, l, **kw)
  loss = lambda fn, h, e: jnp.sum(loss_kw["cot_logp"] * fn(h, e, labels)[0])
  g = jax.jit(jax.grad(lambda h, e: loss(fn, h, e), (0, 1)))(h, embedding)
  gr = jax.grad(lambda h, e: loss(lambda h, e, l: reference.linear_logprobs_and_entropy(h, e.T, l),
                                  h, e), (0, 1))(h, jnp.asarray(embedding, jnp.float64))
  assert_close(g[0], gr[0], 2e-4, "d hidden")
  assert_close(g[1], gr[1], 2e-4, "d embedding")
  # The reference takes the same keywords: the table itself with weight_layout="vd".
  gv = jax.grad(lambda h, e: loss(lambda h, e, l: reference.linear_logprobs_and_entropy(
      h, e, l, weight_layout="vd"), h, e), (0, 1))(h, jnp.asarray(embedding, jnp.float64))
  assert_close(gv[0], gr[0], 1e-12, "reference d hidden, vd")
  assert_close(gv[1], gr[1], 1e-12, "reference d embedding, vd")


@pytest.mark.parametrize("tokens,dim,num_columns,vocab_block_size,seed", [
    (40, 64, 777, 200, 4),
    # 32 token chunks a vocab block: d W's block sum must stay f32 across them. Relative
    # d W error against float64, measured: 2.359e-3 with f32 sums, 6.627e-3 when the sum
    # is rounded to bf16 after every chunk; the limit is 2.742e-3 (plain JAX: 1.583e-3).
    (512, 32, 257, 64, 0)])
def test_bf16_no_worse_than_plain_jax(tokens, dim, num_columns, vocab_block_size, seed):
  _, h, w, b, loss_kw = _case(seed, (tokens,), dim, num_columns)
  arrays = tuple(jnp.asarray(a, jnp.bfloat16) for a in (h, w, b))
  f = lambda h, w, b, labels, **k: jaxce.linear_logprobs_and_entropy(h, w, labels, bias=b, **k)
  fr = lambda h, w, b, labels, **k: reference.linear_logprobs_and_entropy(h, w, labels, bias=b, **k)
  run = lambda fn, arrays, **kw: jax.jit(lambda *a: value_and_grads(fn, a, (0, 1, 2), **kw))(
      *arrays)  # jitted: one compilation, not one per primitive
  (lp, en), g = run(f, arrays, chunk_size=16, vocab_block_size=vocab_block_size, **loss_kw)
  (lp_p, en_p), g_p = run(fr, arrays, **loss_kw)
  (lp_r, en_r), g_r = run(fr, tuple(jnp.asarray(a, jnp.float64) for a in arrays), **loss_kw)
  rel = lambda a, r: np.linalg.norm(np.asarray(a, np.float64) - r) / np.linalg.norm(r)
  for name, a, p, r in [("logp", lp, lp_p, lp_r), ("entropy", en, en_p, en_r)] + [
      (f"grad{i}", g[i], g_p[i], g_r[i]) for i in range(3)]:
    assert rel(a, r) <= rel(p, r) * 1.1 + 1e-3, f"{name}: {rel(a, r):.2e} vs plain {rel(p, r):.2e}"


def test_hidden_grad_accumulation_output():
  """``hidden_grad_accumulation="output"`` sums ``d hidden`` in its own dtype: the same
  numbers as the default for float32 inputs; for bf16 ones only ``d hidden`` changes, with
  at most 3x the default's error against float64 (measured over three seeds: 0.8x to 2.1x),
  and the backward's program has no f32 ``[T, D]`` array (the default has one)."""
  _, h, w, b, loss_kw = _case(0, (128,), 32, 513)
  f = lambda h, w, b, labels, **k: jaxce.linear_logprobs_and_entropy(
      h, w, labels, bias=b, chunk_size=32, vocab_block_size=32, **k)
  run = lambda fn, arrays, **kw: jax.jit(lambda *a: value_and_grads(fn, a, (0, 1, 2), **kw))(
      *arrays)
  f32 = tuple(jnp.asarray(a, jnp.float32) for a in (h, w, b))
  for a, r in zip(jax.tree.leaves(run(f, f32, hidden_grad_accumulation="output", **loss_kw)),
                  jax.tree.leaves(run(f, f32, **loss_kw))):
    np.testing.assert_array_equal(a, r)
  bf16 = tuple(jnp.asarray(a, jnp.bfloat16) for a in (h, w, b))
  fr = lambda h, w, b, labels: reference.linear_logprobs_and_entropy(h, w, labels, bias=b)
  _, g_r = run(fr, tuple(jnp.asarray(a, jnp.float64) for a in bf16), **loss_kw)
  (lp, en), g = run(f, bf16, hidden_grad_accumulation="output", **loss_kw)
  (lp_d, en_d), g_d = run(f, bf16, **loss_kw)
  for a, r in [(lp, lp_d), (en, en_d), (g[1], g_d[1]), (g[2], g_d[2])]:
    np.testing.assert_array_equal(a, r)
  err = lambda a: np.max(np.abs(np.asarray(a, np.float64) - g_r[0])) / np.max(np.abs(g_r[0]))
  assert err(g[0]) <= 3 * err(g_d[0]), (err(g[0]), err(g_d[0]))
  # The program jaxce emits (XLA's CPU backend itself widens bf16 loop buffers to f32),
  # with chunks of 32 rows and with one chunk of all 128 (the Mosaic kernels' plan on a
  # GPU): no f32 [T, D] sum, and no f32 [T, D] d hidden rows of a block either (blocks of
  # 64 columns: no tile of logits is [128, 32]).
  for chunk in (32, 128):
    program = lambda chunk=chunk, **k: jax.jit(jax.grad(
        lambda h, w: jnp.sum(jaxce.linear_logprobs_and_entropy(
            h, w, loss_kw["labels"], chunk_size=chunk, vocab_block_size=64, **k)[0]),
        (0, 1))).lower(*bf16[:2]).as_text()
    assert "tensor<128x32xf32>" in program(), chunk
    assert "tensor<128x32xf32>" not in program(hidden_grad_accumulation="output"), chunk


def test_unused_entropy_and_no_bias():
  _, h, w, _, loss_kw = _case(5, (10,), 8, 50)
  labels, a = loss_kw["labels"], loss_kw["cot_logp"]
  f = lambda h, w: jnp.sum(a * jaxce.linear_logprobs_and_entropy(h, w, labels, chunk_size=3,
                                                                 vocab_block_size=16)[0])
  fr = lambda h, w: jnp.sum(a * reference.linear_logprobs_and_entropy(h, w, labels)[0])
  for g, gr in zip(jax.grad(f, (0, 1))(h, w), jax.grad(fr, (0, 1))(h, w)):
    assert_close(g, gr, 1e-10, "grad")
  logp, ent = jaxce.linear_logprobs_and_entropy(h, w, labels, return_entropy=False)
  assert ent is None
  assert_close(logp, reference.linear_logprobs_and_entropy(h, w, labels)[0], 1e-10, "logp")


@pytest.mark.parametrize("shards", [1, 4])
def test_all_negative_logits(shards):
  """Every logit near -300 or -1e4 (trap 2: a running max that starts at 0, not -inf,
  underflows every exp(z - max) to 0): one vocab shard or four (shard_map over simulated
  devices), a ragged grid of token chunks and vocab blocks, padded columns; values and
  all three gradients against float64. The logits are exact in f32 (multiples of 1/64
  below 2^14 in magnitude), so the shift costs no rounding and the f32 tolerances hold."""
  rng = np.random.default_rng(10)
  tokens, dim, num_columns, vocab_size = 13, 16, 180, 177  # 45 columns a shard of 4
  hidden = rng.integers(-8, 9, (tokens, dim)) / 8
  weight = rng.integers(-8, 9, (dim, num_columns)) / 8
  spread = rng.integers(-64, 65, num_columns) / 8  # peaked rows: columns apart by up to 16
  labels = rng.integers(0, vocab_size, tokens)
  labels[3] = -100
  loss_kw = dict(labels=labels, cot_logp=rng.normal(size=tokens),
                 cot_entropy=rng.normal(size=tokens))
  kw = dict(vocab_size=vocab_size, chunk_size=5, vocab_block_size=16)
  if shards == 1:
    f = lambda h, w, b, labels, **k: jaxce.linear_logprobs_and_entropy(h, w, labels, bias=b, **k)
  else:
    from jax.sharding import Mesh
    mesh = Mesh(np.array(devices(shards)), ("vocab",))
    f = lambda h, w, b, labels, **k: jaxce.sharded_linear_logprobs_and_entropy(
        h, w, labels, bias=b, mesh=mesh, vocab_axis="vocab", **k)
  fr = lambda h, w, b, labels, **k: reference.linear_logprobs_and_entropy(h, w, labels, bias=b, **k)
  step = jax.jit(lambda *a: value_and_grads(f, a, (0, 1, 2), **loss_kw, **kw))
  ref_step = jax.jit(lambda *a: value_and_grads(fr, a, (0, 1, 2), **loss_kw,
                                                vocab_size=vocab_size))
  tol = TOLERANCE[jnp.float32]
  for shift in (-300.0, -1e4):  # through the bias: one compiled plan for both
    arrays = (hidden, weight, spread + shift)
    (logp, ent), grads = step(*(jnp.asarray(a, jnp.float32) for a in arrays))
    (logp_r, ent_r), grads_r = ref_step(*(jnp.asarray(a, jnp.float64) for a in arrays))
    assert_close(logp, logp_r, tol["value"], f"logp, shift {shift}")
    assert_close(ent, ent_r, tol["value"], f"entropy, shift {shift}")
    for name, g, gr in zip(("d hidden", "d weight", "d bias"), grads, grads_r):
      assert_close(g, gr, tol["grad"] * 10, f"{name}, shift {shift}")


def test_default_tile_plan(monkeypatch):
  """The documented defaults: [8192, 8192] tiles on GPUs (256 MiB f32), 32 MiB on CPUs."""
  tiles = jaxce.plan.linear_tiles
  assert tiles(32768, 151936, 3000, 4096) == (3000, 4096)
  assert tiles(100, 5000) == (100, 5000)  # both capped by the problem: one tile
  monkeypatch.setattr(jax, "default_backend", lambda: "cpu")
  assert tiles(32768, 151936) == (1024, 8192)
  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
  assert tiles(32768, 151936) == (8192, 8192)
  assert tiles(12000, 75968) == (6000, 8192)  # a divisor of T within 2x


def test_mosaic_backward_tile_plan():
  """The Mosaic backward: all T tokens in one chunk while their [T, block] d logits fit the
  budget (vocab order), else the fewest, most even multiples of 256 rows in linear_tiles'
  budget; with token chunks outer, likewise in the budget's tile; the block of least modelled
  time, which on an H100's 132 SMs at V = 151936, D = 4096 is the measured best, 8448
  (bench/NOTES.md, entry 25), up to twice that with one chunk at D = 4096 (entry 40) while
  its tile is within 256 MiB (entry 88);
  requested sizes as given, on the kernel's multiples; a shard's narrow vocabulary may take
  a smaller block, down to a quarter of the budget's."""
  tiles = functools.partial(jaxce.plan.linear_kernel_tiles, platform="gpu", depth=4096,
                            num_cores=132)
  assert tiles(32768, 151936) == (32768, 8448)
  assert tiles(8192, 151936) == (8192, 12672)  # one chunk, a wide head: 12 blocks, not 18
  assert tiles(8184, 151936) == (8184, 12672)  # ragged T: all of it, one chunk
  # The grown block's [T, block] d logits stay within 256 MiB (entry 88: at T = 16192,
  # 16896 columns held 0.26 GiB more than 8448 for no time): no growth past ~16k tokens.
  for depth in (4096, 5120):
    assert jaxce.plan.linear_kernel_tiles(16192, 151936, platform="gpu", depth=depth,
                                          num_cores=132) == (16192, 8448)
  assert tiles(4096, 151936) == (4096, 16896)  # a short batch keeps the wide block
  for depth in (1024, 2048, 2560):  # the blocks of before up to D = 2560
    assert jaxce.plan.linear_kernel_tiles(8184, 151936, platform="gpu", depth=depth,
                                          num_cores=132) == (8184, 8448)
  assert tiles(1000, 151936)[0] == 1000
  assert tiles(65536, 151936) == (65536, 4224)  # the budget halves the block
  # A 4-way shard of 151936: 9 blocks in whole waves, not 5 of 7680 (measured on an H200:
  # 0.6 % faster in 0.26 GiB less, bench/NOTES.md entry 71); 2-way: the same as one GPU's.
  assert tiles(32768, 37984) == (32768, 4224)
  assert tiles(32768, 75968) == (32768, 8448)
  # Past V_local tokens in one chunk: the vocab order's plan (largest block by D).
  assert tiles(32768, 18992) == (32768, 6400) and tiles(16384, 16000) == (16384, 8064)
  assert tiles(131072, 151936) == (8192, 8448)  # below LINEAR_KERNEL_MIN_BLOCK: chunks
  assert tiles(100000, 151936) == (7936, 8448)  # 13 even chunks of the budget's 8192
  assert tiles(1048576, 151936) == (35072, 8448)  # token order: 30 chunks of the budget
  assert tiles(200000, 151936) == (33536, 8448)  # 6 even chunks (the rows left: 32320)
  assert tiles(32768, 151936, 8192) == (8192, 8192)  # requested: linear_tiles' plan
  assert tiles(32768, 151936, None, 5000) == (8192, 4992)
  assert tiles(304, 1024) == (304, 1024)  # a small vocabulary: one block
  from jaxce import _budgets  # pylint: disable=import-outside-toplevel
  cost = functools.partial(_budgets._kernel_block_cost, 32768, 151936, 4096, num_cores=132)
  # The model's order of the blocks measured at T = 32768 (the fastest first).
  assert cost(block=8448) < cost(block=8960) < cost(block=4224)
  assert cost(block=8448) < cost(block=8192)


@pytest.mark.parametrize("tokens,columns,chunk,order", [
    (32768, 18992, 32768, "vocab"),  # 151936 over 8: one chunk past V_local
    (32768, 32000, 32768, "vocab"),  # a 32000-token vocabulary on one GPU
    (65536, 32000, 32768, "token"),  # two chunks: d W's f32 sum is the smaller
    (32768, 151936, 32768, "vocab")])
def test_mosaic_backward_takes_vocab_order_for_one_chunk(tokens, columns, chunk, order,
                                                         monkeypatch):
  """With the Mosaic kernels and nothing requested, tokens past ``V_local`` that fit one
  chunk take vocab blocks outer: token chunks outer would hold an f32 ``d W`` sum on top
  of the one chunk's f32 ``d hidden`` rows (all ``T``), which the vocab order holds alone;
  a requested size keeps the order by the sums' sizes."""
  monkeypatch.setattr(jaxce.plan, "target", lambda *a, mesh=None: jaxce.plan.Target(
      "gpu", "9.0", 132))
  hidden = jax.ShapeDtypeStruct((tokens, 4096), jnp.bfloat16)
  weight = jax.ShapeDtypeStruct((4096, columns), jnp.bfloat16)
  labels = jax.ShapeDtypeStruct((tokens,), jnp.int32)
  plan = jaxce.plan.of(jaxce.linear_logprobs_and_entropy, hidden, weight, labels)
  assert (plan.backend, plan.chunk, plan.backward_order) == ("mosaic", chunk, order), plan
  assert plan.chunks.sizes == (chunk,) * (tokens // chunk), plan
  requested = jaxce.plan.of(jaxce.linear_logprobs_and_entropy, hidden, weight, labels,
                            vocab_block_size=4096)
  assert requested.backward_order == jaxce.plan.linear_backward_order(tokens, columns)


def test_chunk_plan_keeps_one_chunk_when_everything_fits():
  chunk_size = jaxce.plan.chunk_size
  assert chunk_size(100, 10, None, 2**20) == 100  # not 2 x 50
  assert chunk_size(1000, 1000, None, 4 * 1000 * 300) == 250  # a divisor
  # None: the fewest even steps (4 of 256 rows; 296 would clamp back 183 of 1001)
  assert chunk_size(1001, 1000, None, 4 * 1000 * 300) == 256
  # A T just past the budget with no divisor near it: two even steps, not 8192 twice
  assert chunk_size(8209, 8192, None, 4 * 8192 * 8192) == 4112


@pytest.mark.parametrize("hidden_dtype,weight_dtype", [
    (jnp.bfloat16, jnp.float32), (jnp.float32, jnp.bfloat16)])
def test_mixed_dtypes_promote_like_a_matmul(hidden_dtype, weight_dtype):
  """bf16 activations with an f32 kernel (Flax's param_dtype) and the reverse: the matmuls
  run in the common dtype, as ``hidden @ weight`` and the reference do, not in a silently
  narrowed one; each gradient comes back in its own input's dtype."""
  _, h, w, b, loss_kw = _case(8, (30,), 48, 301)
  arrays = (jnp.asarray(h, hidden_dtype), jnp.asarray(w, weight_dtype), jnp.asarray(b))
  f = lambda h, w, b, labels, **k: jaxce.linear_logprobs_and_entropy(
      h, w, labels, bias=b, chunk_size=8, vocab_block_size=64, **k)
  fr = lambda h, w, b, labels, **k: reference.linear_logprobs_and_entropy(h, w, labels, bias=b, **k)
  # The reference on the same values in f64: the inputs' own rounding is not an error.
  exact = tuple(jnp.asarray(a, jnp.float64) for a in arrays)
  (logp, ent), grads = value_and_grads(f, arrays, (0, 1, 2), **loss_kw)
  (logp_r, ent_r), grads_r = value_and_grads(fr, exact, (0, 1, 2), **loss_kw)
  tol = TOLERANCE[jnp.float32]
  assert_close(logp, logp_r, tol["value"], "logp")
  assert_close(ent, ent_r, tol["value"], "entropy")
  for name, g, gr, a in zip(("d hidden", "d weight", "d bias"), grads, grads_r, arrays):
    assert g.dtype == a.dtype, (name, g.dtype, a.dtype)
    # a bf16 gradient is rounded once at the end: half a bf16 ulp of its largest entry
    bf16 = 2.0**-8 * float(np.max(np.abs(gr))) if a.dtype == jnp.bfloat16 else 0.0
    assert_close(g, gr, tol["grad"] * 10 + bf16, name)


@pytest.mark.parametrize("dtype,chunk_size,vocab_block_size,layout", [
    (jnp.float64, 7, 24, "dv"), (jnp.float64, None, None, "vd"), (jnp.float32, 16, 50, "dv")])
def test_token_outer_backward_matches_reference(dtype, chunk_size, vocab_block_size, layout):
  """More tokens than columns: the backward walks token chunks outer (its f32 sum is
  like the weight, not like ``hidden``); ragged chunks and blocks, bias, softcap,
  temperature, ignored and masked rows, a padded vocabulary, both weight layouts."""
  rng, h, w, b, loss_kw = _case(6, (3, 41), 12, 101, vocab_size=97)
  assert jaxce.plan.linear_backward_order(3 * 41, 101) == "token"
  if layout == "vd":
    w = np.ascontiguousarray(w.T)
  _check(h, w, b, dtype, loss_kw, chunk_size=chunk_size, vocab_block_size=vocab_block_size,
         logit_softcap=4.0, temperature=rng.uniform(0.5, 1.5, (3, 1)), vocab_size=97,
         where=rng.random((3, 41)) < 0.85, weight_layout=layout)


def test_token_outer_backward_sharded():
  """The token-outer backward inside shard_map: each chunk's d hidden rows all-reduced
  over the vocab axis, d W per shard."""
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
  mesh = Mesh(np.array(devices(2)), ("vocab",))
  rng, h, w, b, loss_kw = _case(8, (90,), 10, 64)
  assert jaxce.plan.linear_backward_order(90, 32) == "token"
  arrays = (jnp.asarray(h, jnp.float32),
            jax.device_put(jnp.asarray(w, jnp.float32), NamedSharding(mesh, P(None, "vocab"))),
            jax.device_put(jnp.asarray(b, jnp.float32), NamedSharding(mesh, P("vocab"))))
  f = lambda h, w, b, labels, **k: jaxce.sharded_linear_logprobs_and_entropy(
      h, w, labels, bias=b, mesh=mesh, vocab_axis="vocab", chunk_size=16, vocab_block_size=12,
      temperature=0.9, **k)
  fr = lambda h, w, b, labels, **k: reference.linear_logprobs_and_entropy(
      h, w, labels, bias=b, temperature=0.9, **k)
  (logp, ent), grads = value_and_grads(f, arrays, (0, 1, 2), **loss_kw)
  (logp_r, ent_r), grads_r = value_and_grads(
      fr, tuple(jnp.asarray(a, jnp.float64) for a in (h, w, b)), (0, 1, 2), **loss_kw)
  assert_close(logp, logp_r, TOLERANCE[jnp.float32]["value"], "logp")
  for name, g, gr in zip(("d hidden", "d weight", "d bias"), grads, grads_r):
    assert_close(g, gr, TOLERANCE[jnp.float32]["grad"] * 10, name)
