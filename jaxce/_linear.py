"""The fused LM-head path: log-prob and entropy of ``hidden @ weight`` without the logits.

Public entry: :func:`linear_logprobs_and_entropy` (re-exported by ``jaxce``).

Both passes walk a grid of ``[C, Vb]`` tiles, vocab blocks outer and token chunks
inner, recomputing ``hidden_chunk @ weight_block`` for each tile (operands in the
inputs' common dtype, as ``hidden @ weight`` would promote them; f32 accumulation):

* forward: an online softmax folds each tile into per-token running sums ``(m, s, q)``
  and the label's logit, ``[T]`` f32 each; shards combine them with one pmax + one psum.
  The tile's own statistics take two XLA passes over it, or one with the Pallas kernel
  of ``_pallas`` (the default on GPUs).
* backward: each tile's ``d logits`` (cast to the operand dtype) feeds two matmuls:
  ``d W_block = hidden_chunkᵀ @ d`` accumulates in f32 over the token chunks of the
  block and is then written once; ``d hidden += d @ W_blockᵀ`` accumulates in an f32
  ``[T, D]`` buffer, all-reduced over ``vocab_axis`` once at the end.

No ``[T, V]`` (or ``[T, V_local]``) buffer exists at any time. A ragged last chunk or
block is clamped back inside the array; its overlap is masked so nothing counts twice.
"""

from __future__ import annotations

from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from jaxce import _checks, _chunking, _math, _pallas

# The default tile: [chunk, block] = [8192, 8192] on GPUs. The backward reads and writes
# the f32 d W block accumulator once per token chunk (8 D V T / chunk bytes in all) and the
# f32 d hidden accumulator once per vocab block (8 D T V / block bytes), so near-square
# tiles move the least. Measured on an H200 (T = 32768, D = 4096, V = 151936, bf16,
# fwd+bwd, scripts/gpu_probe_round7.py): [8192, 8192] 281.6 ms, [4096, 8192] 288.3,
# [4096, 16384] 289.0, [2048, 16384] 295.0, [8192, 4096] 312.5, [6144, 6144] 326.6
# (blocks that are not a power of two run slower matmuls).
DEFAULT_VOCAB_BLOCK = 8192
# Bytes of one f32 [chunk, block] tile (materialized: it is a matmul output).
TILE_BYTES = 256 * 2**20
# XLA's CPU backend: 32 MiB tiles ([1024, 8192]); chunks of 256 to 2048 tokens all ran
# within 4 % of each other there, 4096 tokens 14 % slower (bench/NOTES.md, 17).
CPU_TILE_BYTES = 32 * 2**20


def plan_tiles(num_tokens: int, num_columns: int, chunk_size: int | None = None,
               vocab_block_size: int | None = None) -> tuple[int, int]:
  """``(chunk, block)``: the tile grid a call runs with.

  ``block = min(vocab_block_size or DEFAULT_VOCAB_BLOCK, num_columns)``; ``chunk`` is
  ``min(chunk_size, num_tokens)`` or, for ``None``, planned by
  :func:`jaxce._chunking.plan_chunk_size` from ``TILE_BYTES`` (``CPU_TILE_BYTES`` when
  JAX's default backend is the CPU).
  """
  block = min(vocab_block_size or DEFAULT_VOCAB_BLOCK, num_columns)
  budget = CPU_TILE_BYTES if jax.default_backend() == "cpu" else TILE_BYTES
  return _chunking.plan_chunk_size(num_tokens, block, chunk_size, budget), block


def linear_logprobs_and_entropy(hidden, weight, labels, *, bias=None, logit_softcap=None,
                                temperature=1.0, where=None, vocab_size=None, chunk_size=None,
                                vocab_axis=None, return_entropy=True, vocab_block_size=None,
                                weight_layout="dv", implementation=None,
                                hidden_grad_accumulation="float32"):
  """Per-token log-prob and entropy of ``softmax(softcap(hidden @ weight + bias) / T)``.

  Args:
    hidden: ``[..., D]`` bf16, f16 or f32.
    weight: ``[D, V]`` (``V = V_local`` with ``vocab_axis``), a Flax ``Linear`` kernel;
      or ``[V, D]`` with ``weight_layout="vd"``.
    labels: int ``[...]`` = ``hidden.shape[:-1]``, global ids; negative ids are ignored.
    bias: optional ``[V]``.
    logit_softcap: optional float c > 0: logits become ``c * tanh(logits / c)`` before the
      temperature (Gemma 2 style).
    temperature, where, vocab_size, vocab_axis, return_entropy: as in
      :func:`jaxce.logprobs_and_entropy`.
    chunk_size: tokens per tile; ``None`` plans it from an f32 tile budget of 256 MiB
      (32 MiB on CPUs): 8192 tokens with the default block (see :func:`plan_tiles`).
    vocab_block_size: vocab columns per tile; ``None``: ``min(V, 8192)``.
    weight_layout: ``"dv"`` (``weight`` is ``[D, V]``) or ``"vd"`` (``[V, D]``: tied
      embeddings pass the embedding table itself). Either way the matmuls read the array
      as stored; passing ``embedding.T`` with ``"dv"`` also works but XLA may then copy
      the table and the gradient into the other layout.
    implementation: the forward's statistics of each f32 tile by ``"xla"`` (two fused
      passes over the tile: the max, then the sums) or ``"pallas"`` (one pass, the
      Triton kernel of the logits path; interpreted off GPUs, for tests). ``None``:
      as :func:`jaxce.logprobs_and_entropy` decides.
    hidden_grad_accumulation: where the backward sums ``d hidden`` over the vocab blocks
      (and shards). ``"float32"`` (default): an f32 ``[T, D]`` buffer, rounded to
      ``hidden``'s dtype once at the end. ``"output"``: in ``d hidden`` itself, in
      ``hidden``'s dtype, so no f32 ``[T, D]`` buffer exists (``4 T D`` bytes less; with
      the vocabulary split over GPUs this is the largest buffer that does not shrink with
      their number), at the price of one rounding per vocab block of each shard and one
      per shard in the all-reduce (bench/NOTES.md has the measured error). The same as
      ``"float32"`` for float32 ``hidden``.
  Returns:
    ``(logp, entropy)`` float32 of ``labels.shape`` (entropy ``None`` when
    ``return_entropy=False``). Gradients flow to ``hidden``, ``weight`` and ``bias`` in
    their own dtypes.

  Dtypes: the matmuls take ``hidden`` and ``weight`` in their common dtype, as
  ``hidden @ weight`` does (bf16 hidden with an f32 kernel: f32 matmuls, like the
  reference). Each tile is cast on the fly; no converted copy of either array is made.
  For bf16 matmuls with f32 parameters, pass ``kernel.astype(jnp.bfloat16)`` (what Flax's
  ``Linear(dtype=jnp.bfloat16)`` does); its gradient then comes back in f32 through the cast.

  Memory: no ``[T, V]`` array. Forward: two f32 ``[chunk, Vb]`` tiles, the weight block
  being read and O(T). Backward: ``d hidden`` and ``d weight`` (the outputs), an f32
  ``[T, D]`` accumulator for ``d hidden`` (none with ``hidden_grad_accumulation=
  "output"``), an f32 ``[D, Vb]`` accumulator for the weight block and two f32 tiles.
  """
  hidden = _checks.as_array("hidden", hidden)
  weight = _checks.as_array("weight", weight)
  labels = _checks.as_array("labels", labels)
  if vocab_axis is None:  # arrays split over a mesh's explicit axes: the shard_map wrapper
    from jaxce import _sharded  # pylint: disable=import-outside-toplevel  (it wraps this)
    out = _sharded.linear_split_like_their_types(hidden, weight, labels, dict(
        bias=bias, logit_softcap=logit_softcap, temperature=temperature, where=where,
        vocab_size=vocab_size, chunk_size=chunk_size, return_entropy=return_entropy,
        vocab_block_size=vocab_block_size, weight_layout=weight_layout,
        implementation=implementation))
    if out is not None:
      return out
  _checks.check_float("hidden", hidden)
  _checks.check_float("weight", weight)
  if weight_layout not in ("dv", "vd"):
    raise ValueError(f'weight_layout must be "dv" ([D, V]) or "vd" ([V, D]), got {weight_layout=!r}')
  vocab_dim = 1 if weight_layout == "dv" else 0
  if weight.ndim != 2 or weight.shape[1 - vocab_dim] != hidden.shape[-1]:
    expected = "[D, V]" if vocab_dim else "[V, D]"
    raise ValueError(f"weight must have shape {expected} (weight_layout={weight_layout!r}) with "
                     f"D = hidden.shape[-1] = {hidden.shape[-1]}, got {weight.shape=}")
  _checks.check_labels(labels, hidden.shape[:-1], "hidden.shape[:-1]")
  _checks.check_chunk_size(chunk_size)
  _checks.check_chunk_size(vocab_block_size, "vocab_block_size")
  num_columns = weight.shape[vocab_dim]
  _checks.check_columns("weight", num_columns)
  if bias is not None:
    bias = _checks.as_array("bias", bias)
    _checks.check_float("bias", bias)
    if bias.shape != (num_columns,):
      raise ValueError(f"bias must have shape [V] = ({num_columns},), got {bias.shape=}")
  if hidden_grad_accumulation not in ("float32", "output"):
    raise ValueError('hidden_grad_accumulation must be "float32" or "output", got '
                     f"{hidden_grad_accumulation=!r}")
  if logit_softcap is not None and not (isinstance(logit_softcap, (int, float))
                                        and logit_softcap > 0):
    raise ValueError(f"logit_softcap must be None or a float > 0, got {logit_softcap=!r}")
  shards = _checks.vocab_shards(vocab_axis)
  vocab_size = _checks.check_vocab_size(
      vocab_size, num_columns * shards,
      "weight" if shards == 1 else f"weight across {shards} shards of {vocab_axis!r}")
  operand_dtype = jnp.promote_types(hidden.dtype, weight.dtype)
  inv_temp = _checks.inverse_temperature(temperature, labels.shape,
                                          _math.compute_dtype(operand_dtype))
  valid = _checks.valid_mask(labels, where)
  _checks.check_labels_in_range(labels, valid, vocab_size)

  if labels.size == 0:
    zeros = jnp.zeros(labels.shape, _math.compute_dtype(operand_dtype))
    return zeros, (zeros if return_entropy else None)
  num_tokens = labels.size
  chunk, block = plan_tiles(num_tokens, num_columns, chunk_size, vocab_block_size)
  static = _Static(vocab_size=vocab_size,
                   mask_vocab=vocab_size if vocab_size < num_columns * shards else None,
                   chunk=chunk, block=block, vocab_axis=vocab_axis,
                   softcap=None if logit_softcap is None else float(logit_softcap),
                   with_entropy=return_entropy, vocab_dim=vocab_dim,
                   pallas=_pallas.resolve_implementation(implementation, hidden,
                                                         weight) == "pallas",
                   hidden_grad_in_output=hidden_grad_accumulation == "output")
  out = _jitted_linear_logprobs_entropy(
      hidden.reshape(num_tokens, hidden.shape[-1]), weight, bias,
      labels.reshape(-1).astype(jnp.int32), inv_temp.reshape(-1), valid.reshape(-1), static)
  logp = out[0].reshape(labels.shape)
  entropy = out[1].reshape(labels.shape) if return_entropy else None
  return logp, entropy


class _Static(NamedTuple):
  """The static (Python, hashable) options of one call."""
  vocab_size: int
  mask_vocab: int | None
  chunk: int
  block: int
  vocab_axis: object
  softcap: float | None
  with_entropy: bool
  vocab_dim: int
  pallas: bool = False
  hidden_grad_in_output: bool = False


def _contract(a, b, a_dim, b_dim):
  """``a`` and ``b`` contracted over one dimension each, in their common dtype with f32
  (f64) accumulation."""
  operand_dtype = jnp.promote_types(a.dtype, b.dtype)
  return lax.dot_general(a.astype(operand_dtype), b.astype(operand_dtype),
                         (((a_dim,), (b_dim,)), ((), ())),
                         preferred_element_type=_math.compute_dtype(operand_dtype))


def _tile_logits(hidden_rows, weight_cols, bias_cols, softcap, vocab_dim):
  """``[C, Vb]`` f32 logits of one tile (f32 accumulation)."""
  dtype = _math.compute_dtype(hidden_rows.dtype, weight_cols.dtype)
  x = _contract(hidden_rows, weight_cols, 1, 1 - vocab_dim)
  if bias_cols is not None:
    x = x + bias_cols.astype(dtype)
  if softcap is not None:
    x = softcap * jnp.tanh(x / softcap)
  return x


def _grid(num_tokens, num_columns, chunk, block):
  """``(vocab blocks, token chunks)``: the static trip counts of the two loops."""
  return _chunking.num_chunks(num_columns, block), _chunking.num_chunks(num_tokens, chunk)


@partial(jax.custom_vjp, nondiff_argnums=(6,))
def _linear_logprobs_entropy(hidden, weight, bias, labels, inv_temp, valid, static):
  """``hidden [T, D]``, ``weight [D, V_local]`` -> ``(logp [T],)`` or ``(logp, entropy)``."""
  return _forward(hidden, weight, bias, labels, inv_temp, valid, static)[0]


def _forward(hidden, weight, bias, labels, inv_temp, valid, static):
  num_tokens, num_columns = hidden.shape[0], weight.shape[static.vocab_dim]
  chunk, block = static.chunk, static.block
  n_blocks, n_chunks = _grid(num_tokens, num_columns, chunk, block)
  shard_start = _math.shard_column_start(num_columns, static.vocab_axis)
  dtype = _math.compute_dtype(hidden.dtype, weight.dtype)
  outer_labels, outer_valid = labels, valid  # the outputs vary like these, not per shard
  hidden, weight, bias, labels, inv_temp, valid = _math.unify_varying(
      (hidden, weight, bias, labels, inv_temp, valid), static.vocab_axis)
  m, s, q = _math.running_start(num_tokens, dtype, static.with_entropy, inv_temp)
  picked = jnp.zeros_like(s)

  def block_step(carry, j):
    col = _chunking.chunk_start(j, num_columns, block)
    first_column = shard_start + j * block  # earlier blocks own the columns below
    w_cols = lax.dynamic_slice_in_dim(weight, col, block, static.vocab_dim)
    b_cols = None if bias is None else lax.dynamic_slice_in_dim(bias, col, block, 0)

    def chunk_step(carry, i):
      start = _chunking.chunk_start(i, num_tokens, chunk)
      rows = lambda a: lax.dynamic_slice_in_dim(a, start, chunk, 0)
      x = _tile_logits(rows(hidden), w_cols, b_cols, static.softcap, static.vocab_dim)
      m, s, q, picked = (None if c is None else rows(c) for c in carry)
      if static.pallas:  # the tile's own columns: global ids in [first_column, mask_vocab)
        tile_start = shard_start + col
        limit = block if static.mask_vocab is None else jnp.clip(
            static.mask_vocab - tile_start, 0, block)
        tile_m, tile_s, tile_q = _pallas.row_statistics(
            x, rows(inv_temp), limit, static.with_entropy, start=first_column - tile_start)
        new = _math.merge_statistics(m, s, q, tile_m, tile_s,
                                     tile_q if static.with_entropy else None)
      else:
        z = _math.scaled_logits(x, rows(inv_temp), shard_start + col, static.mask_vocab,
                                first_column)
        new = _math.accumulate_tile(m, s, q, z)
      new += (picked + _math.label_logit(x, rows(labels), rows(inv_temp), shard_start + col,
                                         first_column),)
      fresh = _chunking.fresh_rows(i, start, chunk)  # the clamped chunk's overlap is done
      return tuple(None if c is None else
                   lax.dynamic_update_slice_in_dim(c, jnp.where(fresh, n, o), start, 0)
                   for c, n, o in zip(carry, new, (m, s, q, picked))), None

    carry, _ = lax.scan(chunk_step, carry, jnp.arange(n_chunks))
    return carry, None

  (m, s, q, picked), _ = lax.scan(block_step, (m, s, q, picked), jnp.arange(n_blocks))
  m, s, q, picked = _math.combine_shards(m, s, q, picked, static.vocab_axis)
  log_s, entropy = _math.finish_statistics(s, q)
  logp, entropy_out = _math.finish_outputs((picked - m) - log_s, entropy, outer_labels,
                                           outer_valid, static.vocab_size)
  out = (logp,) + ((entropy_out,) if static.with_entropy else ())
  return out, (m, log_s, entropy)


def _linear_logprobs_entropy_fwd(hidden, weight, bias, labels, inv_temp, valid, static):
  hidden, weight, bias, labels, inv_temp, valid = (
      None if p is None else p.value for p in (hidden, weight, bias, labels, inv_temp, valid))
  out, stats = _forward(hidden, weight, bias, labels, inv_temp, valid, static)
  return out, (hidden, weight, bias, labels, inv_temp, valid) + stats


def _linear_logprobs_entropy_bwd(static, residuals, cotangents):
  primals = residuals[:3]
  hidden, weight, bias, labels, inv_temp, valid, shift, log_sum, entropy = _math.unify_varying(
      residuals, static.vocab_axis)
  g_logp = _math.symbolic_zero_to_none(cotangents[0])
  g_entropy = _math.symbolic_zero_to_none(cotangents[1]) if static.with_entropy else None
  no_bias_grad = None if bias is None else jnp.zeros_like(bias)
  if g_logp is None and g_entropy is None:
    return (jnp.zeros_like(primals[0]), jnp.zeros_like(primals[1]),
            None if bias is None else jnp.zeros_like(primals[2]), None, None, None)

  num_tokens, num_columns = hidden.shape[0], weight.shape[static.vocab_dim]
  chunk, block = static.chunk, static.block
  n_blocks, n_chunks = _grid(num_tokens, num_columns, chunk, block)
  shard_start = _math.shard_column_start(num_columns, static.vocab_axis)
  operand_dtype = jnp.promote_types(hidden.dtype, weight.dtype)  # of the matmuls
  dtype = _math.compute_dtype(operand_dtype)
  vocab_dim = static.vocab_dim

  def tile_grads(d_hidden, w_cols, b_cols, col, first_column, i):
    """Tile ``(j, i)``: ``d hidden`` with its rows added, and the tile's f32 ``d W`` and
    ``d bias`` columns (exactly 0 in a clamped block's overlap and at ignored rows)."""
    start = _chunking.chunk_start(i, num_tokens, chunk)
    rows = lambda a: None if a is None else lax.dynamic_slice_in_dim(a, start, chunk, 0)
    h = rows(hidden)
    x = _tile_logits(h, w_cols, b_cols, static.softcap, vocab_dim)
    keep = rows(valid) & _chunking.fresh_rows(i, start, chunk)
    h = jnp.where(keep[:, None], h, 0)  # an ignored row's NaN must not reach d W as 0 * NaN
    z = _math.scaled_logits(x, rows(inv_temp), shard_start + col, static.mask_vocab,
                            first_column)
    label_column = rows(labels) - (shard_start + col)
    label_column = jnp.where(rows(labels) >= first_column, label_column, -1)
    dz = _math.logit_grad(z, label_column, rows(shift), rows(log_sum), rows(entropy),
                          rows(g_logp), rows(g_entropy), keep)
    dx = dz * rows(inv_temp)[:, None].astype(dtype)
    if static.softcap is not None:
      dx = dx * (1 - jnp.square(x / static.softcap))
    d = dx.astype(operand_dtype)
    # d W columns in the weight's layout: [D, Vb] = hᵀ d, or [Vb, D] = dᵀ h.
    dw_tile = _contract(h, d, 0, 0) if vocab_dim else _contract(d, h, 0, 0)
    dh_rows = _contract(d, w_cols, 1, vocab_dim)
    d_hidden = lax.dynamic_update_slice_in_dim(
        d_hidden, (rows(d_hidden) + dh_rows).astype(d_hidden.dtype), start, 0)
    return d_hidden, dw_tile, (None if bias is None else jnp.sum(dx, axis=0))

  # A ragged vocabulary's clamped last block runs first: its overlap with the block before
  # it gets exact zeros, which that block's own columns then overwrite (no read-back).
  ragged = num_columns % block != 0

  def block_step(carry, k):
    d_hidden, d_weight, d_bias = carry
    j = (k + n_blocks - 1) % n_blocks if ragged else k
    col = _chunking.chunk_start(j, num_columns, block)
    first_column = shard_start + j * block
    w_cols = lax.dynamic_slice_in_dim(weight, col, block, vocab_dim)
    b_cols = None if bias is None else lax.dynamic_slice_in_dim(bias, col, block, 0)
    step = partial(tile_grads, w_cols=w_cols, b_cols=b_cols, col=col,
                   first_column=first_column)

    def chunk_step(carry, i):
      d_hidden, dw_block, db_block = carry
      d_hidden, dw_tile, db_tile = step(d_hidden, i=i)
      return (d_hidden, dw_block + dw_tile,
              None if db_block is None else db_block + db_tile), None

    # The first tile starts the block's f32 sums (no zero-filled accumulator to add to).
    (d_hidden, dw_block, db_block), _ = lax.scan(
        chunk_step, step(d_hidden, i=0), jnp.arange(1, n_chunks))
    d_weight = lax.dynamic_update_slice_in_dim(d_weight, dw_block.astype(weight.dtype), col,
                                               vocab_dim)
    if bias is not None:
      d_bias = lax.dynamic_update_slice_in_dim(d_bias, db_block.astype(bias.dtype), col, 0)
    return (d_hidden, d_weight, d_bias), None

  accumulator_dtype = hidden.dtype if static.hidden_grad_in_output else dtype
  carry = (jnp.zeros_like(hidden, accumulator_dtype), jnp.zeros_like(weight), no_bias_grad)
  (d_hidden, d_weight, d_bias), _ = lax.scan(block_step, carry, jnp.arange(n_blocks))
  if static.vocab_axis is not None:
    d_hidden = lax.psum(d_hidden, static.vocab_axis)  # partial sums over vocab shards
  grads = (d_hidden.astype(hidden.dtype), d_weight, d_bias)
  grads = tuple(None if g is None else _math.reduce_to_varying(g, p)
                for g, p in zip(grads, primals))
  return grads + (None, None, None)


_linear_logprobs_entropy.defvjp(_linear_logprobs_entropy_fwd, _linear_logprobs_entropy_bwd,
                                symbolic_zeros=True)
# Jitted once per static configuration, so repeated eager calls do not recompile.
_jitted_linear_logprobs_entropy = jax.jit(_linear_logprobs_entropy, static_argnums=(6,))
