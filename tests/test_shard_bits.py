"""The kernels over several vocab shards: their bits across shard counts, and their
gradients where shards end in partial tiles. On a GPU host at the vocabularies users
run, on 1, 2 and 4 of the devices it has; off GPUs in JAX's GPU interpreter on 1 and 2
simulated CPU devices at small widths of the same kinds (Python 3.12's step of
``.ci/run``).

What holds (docs/guides/reproducible.md): on the kernel paths a token's ``logp`` and
``entropy`` are the same bits at every shard count ``n`` whose shards hold whole
segments of the vocabulary (``mosaic_tile.segments``, fixed by ``V`` alone): each
segment is tiled from its own first column, its tiles merged in groups fixed by the
vocabulary, and the groups' sums in the columns' order, whichever device computed them.
Qwen3.5's 248320 columns (4 segments of 62080 whole tiles) at n = 1, 2 and 4, and Qwen3's
151936 (8 segments of 18992, each's last tile partial) at n = 1, 2, 4 and 8 are such
cases (off GPUs: 1024 columns, 8 segments of 128; 640, 4 segments of 160)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh

from helpers import devices, jaxce, skip_module_without_mosaic_interpreter

ON_GPU = jax.default_backend() == "gpu"
skip_module_without_mosaic_interpreter()
# (ragged token counts; the vocabularies' widths: on a GPU Qwen3.5's and Qwen3's, off GPUs
# the interpreter's small widths of the same kinds)
TOKENS, DIM = (1000, 1024) if ON_GPU else (260, 128)
WHOLE_TILES, PARTIAL_TILES = (248320, 151936) if ON_GPU else (1024, 640)
# (Not 8: Qwen3.5's shards of 31040 columns end in partial tiles. Off GPUs only 2: with 4
# or more simulated devices JAX's interpreter can stop for good, its simulated threads
# waiting at the kernels' barriers, not for want of cores: the objective path's
# gradient at 4 devices on 2, 4 and 10 cores, the fused head's kept sets at 8 on 2;
# bench/NOTES.md, entry 86.)
SHARD_COUNTS = (2, 4) if ON_GPU else (2,)


def _inputs(columns, seed=0):
  rng = np.random.default_rng(seed)
  hidden = jnp.asarray(rng.normal(size=(TOKENS, DIM)), jnp.bfloat16)
  weight = rng.normal(size=(DIM, columns)) * 1.5 / np.sqrt(DIM)
  weight[:, rng.integers(0, columns, 8)] *= 6  # a few peaked columns
  weight = jnp.asarray(weight, jnp.bfloat16)
  labels = jnp.asarray(rng.integers(0, columns - 7, TOKENS), jnp.int32)
  keep = jaxce.keep.pack(jnp.asarray(rng.random((TOKENS, columns)) < 0.3))
  logits = jax.jit(jnp.dot)(hidden, weight)  # once, on one device: the same at every n
  return dict(hidden=hidden, weight=weight, logits=logits, labels=labels, keep=keep,
              temperature=jnp.asarray(rng.uniform(0.6, 1.4, TOKENS), jnp.float32),
              adv=jnp.asarray(rng.normal(size=TOKENS), jnp.float32))


OPTIONS = {
    "plain": dict(),
    "temperature+softcap": dict(temperature=True, logit_softcap=30.0, vocab_size=-7),
    "kept sets": dict(keep=True),
}


def _outputs(path, shards, inputs, options):
  """``(logp, entropy)`` of ``path`` with the vocabulary over ``shards`` devices."""
  mesh = Mesh(np.array(devices(shards)), ("v",))
  over = dict(mesh=mesh, vocab_axis="v", implementation="mosaic")
  kw = dict(options)
  if kw.pop("temperature", False):
    kw["temperature"] = inputs["temperature"]
  if kw.pop("keep", False):
    kw["keep"] = inputs["keep"]
  if "vocab_size" in kw:
    kw["vocab_size"] += inputs["weight"].shape[1]
  h, w, labels = inputs["hidden"], inputs["weight"], inputs["labels"]
  if path == "logits":
    kw.pop("logit_softcap", None)
    fn = functools.partial(jaxce.sharded_logprobs_and_entropy, **over, **kw)
    return jax.jit(lambda x: fn(x, labels))(inputs["logits"])
  if path == "fused":
    fn = functools.partial(jaxce.sharded_linear_logprobs_and_entropy, **over, **kw)
    return jax.jit(lambda h, w: fn(h, w, labels))(h, w)
  objective = lambda logp, entropy, adv: -adv * logp - 0.01 * entropy
  fn = functools.partial(jaxce.sharded_linear_token_loss, objective, **over, **kw)
  return jax.jit(lambda h, w: fn(h, w, labels, inputs["adv"])[1])(h, w)


def _differing(a, b):
  return int(np.sum(np.asarray(a).view(np.uint32) != np.asarray(b).view(np.uint32)))


def _check_same_bits(path, columns, options):
  counts = [n for n in SHARD_COUNTS if n <= jax.device_count()]
  if not counts:
    pytest.skip(f"needs 2 devices, {jax.device_count()} present")
  inputs = _inputs(columns)
  logp, entropy = _outputs(path, 1, inputs, OPTIONS[options])
  for shards in counts:
    got_logp, got_entropy = _outputs(path, shards, inputs, OPTIONS[options])
    bad = _differing(got_logp, logp), _differing(got_entropy, entropy)
    assert bad == (0, 0), (f"{path}, {options}, V = {columns}: {bad[0]} log-probs and "
                           f"{bad[1]} entropies of {TOKENS} differ between 1 and {shards} "
                           "shards")


@pytest.mark.parametrize("options", OPTIONS)
@pytest.mark.parametrize("path", ["fused", "objective", "logits"])
def test_the_same_bits_on_shards_of_whole_tiles(path, options):
  """Qwen3.5's 248320 columns on 1, 2 and 4 devices (62080 columns each at 4: whole
  tiles; off GPUs 1024 on 1 and 2): the kernels' bits do not depend on the shard
  count."""
  _check_same_bits(path, WHOLE_TILES, options)


@pytest.mark.parametrize("options", OPTIONS)
@pytest.mark.parametrize("path", ["fused", "objective", "logits"])
def test_the_same_bits_on_shards_of_partial_tiles(path, options):
  """Qwen3's 151936 columns (off GPUs 640) on 1, 2 and 4 devices: the kernels tile each of
  the vocabulary's segments (8 of 18992 columns; off GPUs 4 of 160) from its own first
  column, so a shard's tiles, each segment's last one partial, are one device's whatever
  the shard count."""
  _check_same_bits(path, PARTIAL_TILES, options)


@pytest.mark.parametrize("options", ["temperature+softcap", "kept sets"])
def test_the_objective_paths_bits_in_groups_on_shards_of_partial_tiles(options, monkeypatch):
  """The objective path in groups of 256 tokens (4 on a GPU, 2 off GPUs, the last clamped
  back), over Qwen3's 151936 columns (off GPUs 640): each shard's segments are copied out
  once a call, before the groups (the plan's ``weight_copy``), inside ``shard_map`` as on
  one device, and a token's bits are the same at every shard count."""
  columns = PARTIAL_TILES
  for platform in ("cpu", "gpu"):
    monkeypatch.setitem(jaxce.plan.LINEAR_OBJECTIVE_GRAD_BYTES, platform, 256 * 2 * columns // 4)
  inputs = _inputs(columns)
  for shards in (1,) + tuple(n for n in SHARD_COUNTS if n <= jax.device_count()):
    mesh = Mesh(np.array(devices(shards)), ("v",))
    got = jaxce.plan.of(
        lambda h, w: jaxce.sharded_linear_token_loss(
            lambda logp, entropy: logp, h, w, inputs["labels"], mesh=mesh, vocab_axis="v",
            implementation="mosaic"), inputs["hidden"], inputs["weight"])
    assert (got.grad_chunk, got.weight_copy) == (256, "call"), (shards, got)
  _check_same_bits("objective", columns, options)


@pytest.mark.parametrize("shards", SHARD_COUNTS)
@pytest.mark.parametrize("layout", ["dv", "vd"])
@pytest.mark.parametrize("path", ["per-token", "objective"])
def test_sharded_gradients_where_shards_end_in_partial_tiles(path, shards, layout):
  """``d hidden`` and ``d W`` of the sharded kernels when each shard's 192 columns end in
  a partial tile, against one device's XLA call: the per-token path (random cotangents for
  both outputs) and the objective path (its ``d logits`` formed from stored terms), a
  temperature and a padded vocabulary. (Both gradients were wrong by the order of their
  size there: the backward's last vocab block of 64 columns lost its ``d logits`` to the
  tile's piece past its end; bench/NOTES.md, entries 44 and 45.)"""
  mesh = Mesh(np.array(devices(shards)), ("v",))
  rng = np.random.default_rng(shards)
  tokens, dim, columns = 300, 128, 192 * shards
  hidden = jnp.asarray(rng.normal(size=(tokens, dim)) * 0.5, jnp.bfloat16)
  weight = rng.normal(size=(dim, columns)) * 2 / np.sqrt(dim)
  weight = jnp.asarray(weight if layout == "dv" else weight.T, jnp.bfloat16)
  labels = rng.integers(0, columns - 37, tokens).astype(np.int32)
  labels[::13] = -100
  cot = jnp.asarray(rng.normal(size=(2, tokens)), jnp.float32)
  kw = dict(weight_layout=layout, vocab_size=columns - 37,
            temperature=jnp.asarray(rng.uniform(0.6, 1.5, tokens), jnp.float32))
  objective = lambda logp, entropy, a, b: a * logp + b * entropy

  def grads(sharded, **extra):
    over = dict(mesh=mesh, vocab_axis="v") if sharded else {}
    if path == "per-token":
      fn = (jaxce.sharded_linear_logprobs_and_entropy if sharded
            else jaxce.linear_logprobs_and_entropy)
      loss = lambda h, w: sum(jnp.sum(c * o) for c, o in zip(
          cot, fn(h, w, labels, **kw, **over, **extra)))
    else:
      fn = jaxce.sharded_linear_token_loss if sharded else jaxce.linear_token_loss
      loss = lambda h, w: fn(objective, h, w, labels, cot[0], cot[1], **kw, **over,
                             **extra)[0]
    return jax.jit(jax.grad(loss, (0, 1)))(hidden, weight)

  want = grads(False, implementation="xla")
  got = grads(True, implementation="mosaic")
  for what, a, b in zip(("d hidden", "d weight"), got, want):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    error = np.max(np.abs(a - b)) / np.max(np.abs(b))
    assert error <= 2 ** -7, f"{path}, {what}: max error {error:.3g} of its largest entry"
