"""Every vocabulary on every GPU count: the widths real vocabularies give a device when
they are split over 1, 2, 4 or 8 GPUs, planned on the Mosaic kernels (a kernel sees only
its shard's ``V_local``), the columns' tiling (``mosaic_tile.segments``) and the kept-set
words of a partial last tile. The kernels themselves run at such widths in
``test_mosaic_linear.py`` and ``test_mosaic_rows.py`` (the interpreter, and the GPU)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax.sharding import Mesh

from helpers import devices, jaxce
from jaxce import plan
from jaxce._kernels.mosaic import head as mosaic_head, tile as mosaic_tile

HOPPER = plan.Target("gpu", "9.0", 132)
# (vocabulary, shard count): each shard's columns are not a multiple of 128.
RAGGED = [(151936, 2), (151936, 4), (151936, 8), (128256, 4), (128256, 8), (129280, 4),
          (129280, 8)]


@pytest.mark.parametrize("vocab,shards", RAGGED)
def test_the_kernels_run_every_shard_of_a_real_vocabulary(vocab, shards, monkeypatch):
  """On a Hopper GPU the planner says Mosaic for what each shard runs (a local call at
  ``V / n`` columns), on the fused head, the objective path and the logits path."""
  monkeypatch.setattr(plan, "target", lambda *a, mesh=None: HOPPER)
  columns = vocab // shards
  assert columns % 128
  hidden = jax.ShapeDtypeStruct((8184, 1024), jnp.bfloat16)
  weight = jax.ShapeDtypeStruct((1024, columns), jnp.bfloat16)
  logits = jax.ShapeDtypeStruct((8184, columns), jnp.bfloat16)
  labels = jax.ShapeDtypeStruct((8184,), jnp.int32)
  objective = lambda logp, entropy: logp
  plans = {
      "fused": plan.of(jaxce.linear_logprobs_and_entropy, hidden, weight, labels),
      "objective": plan.of(jaxce.linear_token_loss, objective, hidden, weight, labels),
      "logits": plan.of(jaxce.logprobs_and_entropy, logits, labels),
      "token_loss": plan.of(jaxce.token_loss, objective, logits, labels),
  }
  for name, got in plans.items():
    assert got.backend == "mosaic", (name, got.reason)
  assert plans["objective"].kernel_chunk is not None, plans["objective"]


@pytest.mark.parametrize("columns", [151643, 50257])
def test_odd_widths_run_the_kernels_on_every_path(columns, monkeypatch):
  """An unpadded vocabulary (Qwen's 151643 tokens, GPT-2's 50257: not a multiple of 16
  columns, rows TMA cannot tile) runs the fused head's kernels in either layout (its
  weight read in blocks copied out: ``test_mosaic_linear.py``), the objective path's
  (its terms ``mosaic_head.exp_width`` columns wide), and the logits paths' statistics
  (the rows loaded by the kernel itself: ``mosaic_rows.direct_columns``); the logits
  path's gradient there is XLA's pass (in place: chunk by chunk), its kernels writing
  rows in the tiles' swizzle."""
  monkeypatch.setattr(plan, "target", lambda *a, mesh=None: HOPPER)
  hidden = jax.ShapeDtypeStruct((256, 1024), jnp.bfloat16)
  weight = jax.ShapeDtypeStruct((1024, columns), jnp.bfloat16)
  labels = jax.ShapeDtypeStruct((256,), jnp.int32)
  objective = lambda logp, entropy: logp
  for layout, w in (("dv", weight), ("vd", jax.ShapeDtypeStruct((columns, 1024), jnp.bfloat16))):
    got = plan.of(jaxce.linear_logprobs_and_entropy, hidden, w, labels, weight_layout=layout)
    assert got.backend == "mosaic", got
    got = plan.of(jaxce.linear_token_loss, objective, hidden, w, labels, weight_layout=layout)
    assert got.backend == "mosaic" and got.kernel_chunk is not None, got
  logits = jax.ShapeDtypeStruct((256, columns), jnp.bfloat16)
  keep = jax.ShapeDtypeStruct((256, -(-columns // 32)), jnp.uint32)
  for call in ((jaxce.logprobs_and_entropy, logits, labels),
               (jaxce.token_loss, objective, logits, labels)):
    got = plan.of(*call)
    assert got.backend == "mosaic" and not got.kept_grad_kernel, got
    assert plan.of(*call, implementation="mosaic").backend == "mosaic"
  got = plan.of(jaxce.logprobs_and_entropy, logits, labels, keep=keep, backward_in_place=True)
  assert got.backend == "mosaic" and got.in_place == "chunks" and not got.kept_grad_kernel, got
  whole = jax.ShapeDtypeStruct((256, 1024 * 37), jnp.bfloat16)
  got = plan.of(jaxce.logprobs_and_entropy, whole, labels, backward_in_place=True,
                keep=jax.ShapeDtypeStruct((256, 1024 * 37 // 32), jnp.uint32))
  assert got.in_place == "kernel" and got.kept_grad_kernel, got


@pytest.mark.parametrize("columns,layout,copied", [
    (151643, "dv", True), (151643, "vd", True),  # odd: TMA reads neither layout in place
    (37984, "dv", True), (37984, "vd", True),    # segments of 18992: each copied out
    (75968, "dv", True), (151936, "vd", True),
    (31040, "dv", False),                        # one segment read in place, then its rest
    (131072, "dv", False), (131072, "vd", False)])  # segments of whole tiles: in place
def test_a_weight_copied_in_blocks_is_copied_once_per_forward(columns, layout, copied,
                                                               monkeypatch):
  """The fused forward copies a weight TMA cannot read in place out in vocab blocks, once
  per kernel call (``mosaic_head.reads_in_blocks``): the planner lets such a call's tile
  statistics take up to the weight's bytes rather than copy it once per 14,000 rows (T =
  32768 at 151643 columns: one call, not three; at 262144 tokens, 4 calls, not 20), and
  never more than the weight; a weight read in place keeps the statistics' budget."""
  monkeypatch.setattr(plan, "target", lambda *a, mesh=None: HOPPER)
  depth = 4096
  shape = (depth, columns) if layout == "dv" else (columns, depth)
  weight = jax.ShapeDtypeStruct(shape, jnp.bfloat16)
  for tokens in (32768, 262144):
    hidden = jax.ShapeDtypeStruct((tokens, depth), jnp.bfloat16)
    labels = jax.ShapeDtypeStruct((tokens,), jnp.int32)
    got = plan.of(jaxce.linear_logprobs_and_entropy, hidden, weight, labels,
                  weight_layout=layout)
    assert got.backend == "mosaic", got.reason
    stats_bytes = got.kernel_chunk * columns * 4 // 32  # (1/32 of the f32 logits' bytes)
    weight_bytes = depth * columns * 2
    assert stats_bytes <= max(plan.LINEAR_KERNEL_STATS_BYTES, weight_bytes * copied)
    calls = got.kernel_chunks.count + bool(got.kernel_chunks.last)
    if copied:  # (each call copies the weight: one pass per 16 D rows at the least)
      assert got.kernel_chunk >= min(tokens, 16 * depth - 256), (tokens, got.kernel_chunks)
    else:
      assert got.kernel_chunk == plan.linear_kernel_chunk(tokens, columns), got.kernel_chunks
  assert calls == (4 if copied else -(-262144 * columns * 4 // 32
                                       // plan.LINEAR_KERNEL_STATS_BYTES)), got.kernel_chunks


@pytest.mark.parametrize("columns,shards,want", [
    (151936, 1, (18992, 8, 8)),    # Qwen3: 8 segments of 18992 (148 tiles and 48 columns)
    (75968, 2, (18992, 4, 8)),     # ... the same 8 over 2, 4 and 8 GPUs
    (37984, 4, (18992, 2, 8)),
    (18992, 8, (18992, 1, 8)),
    (248320, 1, (62080, 4, 4)),    # Qwen3.5: 4 segments of whole tiles, read in place
    (62080, 4, (62080, 1, 4)),
    (31040, 8, (31040, 1, 8)),     # (8 GPUs: shards of one partial tile's width)
    (128256, 1, (16032, 8, 8)),    # Llama 3, DeepSeek-V3: the same at every n up to 8
    (32320, 4, (16160, 2, 8)),
    (131072, 1, (16384, 8, 8)),    # whole tiles: one tiling of the columns from 0
    (151643, 1, (151643, 1, 1)),   # odd: one segment, at any shard count
    (400, 1, (400, 1, 1)),
    (64, 1, (64, 1, 1)),           # no segment narrower than a tile (each would cost one)
    (768, 1, (192, 4, 4)),
    (124160, 2, (62080, 2, 4)),    # Qwen3.5 over 2: whole tiles, read in place ...
    (124160, 1, (15520, 8, 8)),    # ... where one device's 124160 columns are not
])
def test_segments_are_fixed_by_the_vocabulary(columns, shards, want):
  """The kernels' segments: 8 or 4 equal segments of whole tiles, else up to 8 of a
  multiple of 16 columns, fixed by ``V`` alone, each tiled from its own first column (its
  last tile partial where the width is not whole tiles), the same at every shard count
  whose shards hold whole segments."""
  layout = mosaic_tile.segments(columns, shards)
  assert (layout.width, layout.count, layout.total) == want
  assert layout.num_tiles == layout.count * -(-layout.width // 128)
  assert layout.split == (layout.count > 1 and bool(layout.width % 128))


def test_a_shard_is_read_as_its_segments_say():
  """Whether the fused forward copies a weight out in blocks depends on the shard's
  segments, not its width alone: a shard of 124160 columns of Qwen3.5's 248320 (2
  segments of whole tiles) is read in place, the same width on one device (8 segments of
  15520) in blocks; the planner weighs the copy as the kernels make it."""
  bf16 = jnp.bfloat16
  assert not mosaic_head.reads_in_blocks(124160, bf16, 1, mosaic_tile.segments(124160, 2))
  assert mosaic_head.reads_in_blocks(124160, bf16, 1, mosaic_tile.segments(124160))
  assert mosaic_head.reads_in_blocks(124160, bf16, 1)
  assert mosaic_head.reads_in_blocks(37984, bf16, 1, mosaic_tile.segments(37984, 4))


def test_kept_words_of_segments():
  """The kept words of several segments whose first columns are not multiples of 32
  (8 segments of 176 columns): each segment's tiles from its own first column, the
  label's bit set in its segment alone, zeros past each segment's end and past the
  rows."""
  rng = np.random.default_rng(1)
  rows, columns = 5, 1408
  layout = mosaic_tile.segments(columns)
  assert layout.split and layout.width == 176
  mask = rng.random((rows, columns)) < 0.3
  label_column = np.array([3, 177, -1, 1407, 200])
  got = np.asarray(mosaic_tile.segment_kept_words(jaxce.keep.pack(mask),
                                                  jnp.asarray(label_column), 8, layout))
  assert got.shape == (8 * 2 * 4, 8) and got.dtype == np.uint32
  want = mask.copy()
  owned = label_column >= 0
  want[np.arange(rows)[owned], label_column[owned]] = True
  padded = np.zeros((8, 8, 256), bool)  # [rows, segments, two tiles of columns]
  padded[:rows, :, :176] = want.reshape(rows, 8, 176)
  bits = (got.T[:, :, None] >> np.arange(32, dtype=np.uint32)) & 1
  np.testing.assert_array_equal(bits.reshape(8, 8, 256).astype(bool), padded)


def test_kept_words_of_a_partial_tile():
  """The kept words the kernels read for ``V`` columns that are not a multiple of 128:
  each tile's four words, the label's bit set, zeros past the columns and past the
  rows."""
  rng = np.random.default_rng(0)
  rows, columns = 5, 400
  mask = rng.random((rows, columns)) < 0.3
  label_column = np.array([3, 399, -1, 450, 131])  # (-1 and 450: the label lies elsewhere)
  words = jaxce.keep.pack(mask)
  assert words.shape == (rows, 13)
  got = np.asarray(mosaic_tile.kept_words(words, jnp.asarray(label_column), 8, columns))
  assert got.shape == (16, 8) and got.dtype == np.uint32
  want = mask.copy()
  owned = (label_column >= 0) & (label_column < columns)
  want[np.arange(rows)[owned], label_column[owned]] = True
  padded = np.zeros((8, 512), bool)
  padded[:rows, :columns] = want
  bits = (got.T[:, :, None] >> np.arange(32, dtype=np.uint32)) & 1
  np.testing.assert_array_equal(bits.reshape(8, 512).astype(bool), padded)


@pytest.mark.parametrize("depth,columns,shards,want", [
    (1024, 151936, 1, "call"),   # a Qwen3 head of D = 1024: 0.29 GiB, copied once
    (1536, 151936, 1, "call"),   # 0.44 GiB
    (2048, 151936, 1, "group"),  # 0.58 GiB: past the budget, a copy a group
    (4096, 151936, 1, "group"),  # 1.16 GiB
    (4096, 37984, 4, "call"),    # a shard of four: 2 segments of 18992, 0.29 GiB
    (4096, 75968, 2, "group"),   # a shard of two: 4 segments of 18992, 0.58 GiB
    (1024, 151643, 1, "call"),   # unpadded: one segment TMA cannot read in place
    (4096, 152064, 1, None),     # whole tiles, read in place: no copy
    (4096, 62080, 4, None)])     # Qwen3.5's 248320 over 4: whole tiles
def test_objective_weight_copy_at_the_shapes_users_run(depth, columns, shards, want,
                                                       monkeypatch):
  """Where the fused objective path copies a weight its kernel cannot read in place, on a
  Hopper GPU at real shapes (T = 32768, several groups; a shard's segments as the sharded
  call tiles them): once a call where the copy fits ``LINEAR_OBJECTIVE_COPY_BYTES``, once
  a group past it, never where the kernel reads the weight in place. One group needs no
  copy made before it."""
  monkeypatch.setattr(plan, "target", lambda *a, mesh=None: HOPPER)
  mesh = Mesh(np.array(devices(shards)), ("vocab",))
  weight = jax.ShapeDtypeStruct((depth, columns * shards), jnp.bfloat16)
  objective = lambda logp, entropy: logp
  for tokens, where in ((32768, want), (256, want and "group")):
    hidden = jax.ShapeDtypeStruct((tokens, depth), jnp.bfloat16)
    labels = jax.ShapeDtypeStruct((tokens,), jnp.int32)
    call = lambda h, w, lab: jaxce.sharded_linear_token_loss(objective, h, w, lab, mesh=mesh,
                                                             vocab_axis="vocab")
    got = plan.of(call, hidden, weight, labels)
    assert got.backend == "mosaic" and got.weight_copy == where, (tokens, got)


@pytest.mark.parametrize("tokens", [8184, 16192, 32760, 100000, 262144])
@pytest.mark.parametrize("columns", [151936, 37984])
def test_objective_groups_at_the_shapes_users_run(tokens, columns, monkeypatch):
  """The fused objective path's groups on a Hopper GPU at real shapes (D = 4096; a whole
  Qwen3 head, and one shard of four): each group's ``[group, V]`` terms fit the budget,
  there are as few groups as the budget allows, and their rows exceed ``T`` by less than
  a row block each (the last group clamped back): no group's work is done twice."""
  monkeypatch.setattr(plan, "target", lambda *a, mesh=None: HOPPER)
  depth, block = 4096, 64
  hidden = jax.ShapeDtypeStruct((tokens, depth), jnp.bfloat16)
  weight = jax.ShapeDtypeStruct((depth, columns), jnp.bfloat16)
  labels = jax.ShapeDtypeStruct((tokens,), jnp.int32)
  got = plan.of(jaxce.linear_token_loss, lambda logp, entropy: logp, hidden, weight, labels)
  assert got.backend == "mosaic" and got.kernel_chunk == got.grad_chunk, got
  group = got.grad_chunk
  budget = min(plan.LINEAR_OBJECTIVE_GRAD_BYTES["gpu"],
               plan.LINEAR_OBJECTIVE_GRAD_PER_SUM["gpu"] * 4 * depth * columns)
  fits = lambda rows: rows * columns * 2 <= budget
  count = -(-tokens // group)
  assert group % block == 0 and fits(group), (group, budget)
  assert count == 1 or not fits(-(-tokens // (count - 1) // block) * block), (count, group)
  assert count * group - tokens < block * count, (count, group)
