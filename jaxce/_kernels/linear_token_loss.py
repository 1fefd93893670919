"""The fused path's objective kernel: ``sum objective(logp, entropy, *token_args)`` of
``softmax(hidden @ weight)`` and, under differentiation, its gradients, formed in the
forward pass with three matmuls.

One scan over groups of tokens (token-outer, the plan's ``grad_chunk``). Per group, the
rows' ``d logits`` in the operand dtype ``[G, V_local]``, then ``d hidden_group = d @
weightᵀ`` (matmul 2, all-reduced over the vocab axis in f32 and written once) and ``d
weight += hidden_groupᵀ @ d`` (matmul 3) into an f32 ``[D, V_local]`` sum, read and
written once per group (larger groups: fewer passes over it). The rows' ``d`` comes one of
two ways:

* with the plan's ``kernel_chunk`` (Hopper), one call of the fused head's forward kernel
  per group (matmul 1) writes the rows' per-tile statistics and their ``exp(z - m_tile)``
  terms in the operand dtype (``mosaic_head.statistics``); once the statistics are merged
  (shards combine them in rank order) and the objective has given each token's
  cotangents, one kernel writes ``d`` over those terms (``mosaic_rows_grad.
  exp_overwrite``). Each token's ``logp`` and ``entropy`` are the per-token path's bits;
  no f32 row reaches device memory. At an odd ``V_local`` (an unpadded vocabulary:
  151643, 50257), whose rows TMA cannot write, the terms are ``mosaic_head.exp_width``
  columns wide (``d`` is 0 past ``V_local``), and matmuls 2 and 3 read a copy of the
  weight zero-padded as wide: matmuls over rows of an odd number of columns ran the path
  2.6x slower (bench/NOTES.md, entry 58).
* else the group is walked in chunks of the plan's ``chunk``: ``x = hidden_chunk @
  weight``, the chunk's full ``[C, V_local]`` rows in f32 (matmul 1), kept until the
  chunk's statistics (one pmax + one psum over shards), per-token loss terms and
  cotangents give its ``d``, written into the group's.

The custom_vjp's backward only scales the stored gradients by the loss's cotangent.
Extra memory: the gradients, the f32 ``d weight`` sum and one group's ``d`` (without the
kernel, one chunk's f32 rows too; at an odd width, the padded copy of the weight; where the
kernel copies the weight in vocab blocks once a call, the plan's ``weight_copy`` ``"call"``,
that copy), flat in T beyond ``d hidden``.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from jaxce._kernels import chunking, head, logits_rows, loss_terms, plumbing, softmax
from jaxce._kernels.mosaic import head as mosaic_head, rows_grad as mosaic_rows_grad
from jaxce._kernels.config import Config, Tokens


def linear_token_loss(objective, hidden, weight, bias, tokens: Tokens, token_args,
                      config: Config):
  """``hidden [T, D]``, ``weight`` (``[D, V_local]`` or ``[V_local, D]``), ``bias``
  ``[V_local]`` or None, the ``tokens`` and ``token_args`` (each ``[T]``) -> ``(loss,
  (logp [T], entropy [T] or None))``; the loss (this device's tokens) is differentiable in
  ``hidden``, ``weight`` and ``bias``."""
  return _jitted(objective, hidden, weight, bias, tokens, tuple(token_args), config=config)


@plumbing.custom_vjp("objective", "config")
def _linear_token_loss(objective, hidden, weight, bias, tokens, token_args, config):
  return _run(objective, hidden, weight, bias, tokens, token_args, config,
              with_grads=False)[0]


class _Call(NamedTuple):
  """What every group of a call reads: the ``objective``, the ``weight`` and ``bias`` (or
  None), the weight the gradient matmuls read (``matmul_weight``: ``weight``, or at an
  odd width its copy zero-padded to the kernel's terms, ``mosaic_head.exp_width``), the
  kernel's copy of the weight in vocab blocks made once for every group (``weight_blocks``,
  the plan's ``weight_copy`` ``"call"``; else None), the call's ``config``, this shard's
  first global column, whether the gradients are formed (``with_grads``), the padded rows
  (``hidden [rows, D]``, the ``tokens`` and ``token_args``) and the primals as passed (the
  gradients take their types)."""
  objective: Callable
  weight: Any
  bias: Any
  matmul_weight: Any
  weight_blocks: Any
  config: Config
  column_start: Any
  with_grads: bool
  hidden: Any
  tokens: Tokens
  token_args: tuple
  primals: tuple

  @property
  def num_columns(self) -> int:
    return self.weight.shape[self.config.vocab_dim]

  @property
  def operand_dtype(self):
    return head.dtypes(self.hidden, self.weight)[0]


def _run(objective, hidden, weight, bias, tokens, token_args, config, with_grads):
  """``((loss, (logp, entropy)), ((d hidden, d weight, d bias), type witnesses) or
  None)``: the gradients of this device's loss, not yet summed over shard_map axes."""
  num_tokens, num_columns = hidden.shape[0], weight.shape[config.vocab_dim]
  group = config.plan.grad_chunk
  dtype = head.dtypes(hidden, weight)[1]
  primals = (hidden, weight, bias)
  # (the plan's rows: fewer tokens than a group are padded to it, so the batch-invariant
  # matmul keeps its rows and the kernel takes at least its 256 and a multiple of 8)
  padded = config.plan.rows
  call = _Call(objective, weight, bias, _matmul_weight(weight, config),
               _weight_blocks(weight, config), config,
               softmax.shard_column_start(num_columns, config.vocab_axis), with_grads,
               chunking.pad_rows(hidden, padded), tokens.padded(padded),
               tuple(chunking.pad_rows(a, padded) for a in token_args), primals)
  hidden, tokens = call.hidden, call.tokens
  group_step = functools.partial(_group_step, call)
  n_groups = chunking.num_chunks(padded, group)
  if with_grads:
    # d hidden's rows arrive summed over the vocab shards, so it varies like hidden; the
    # d bias sum and the group's d vary like every input together (the d weight sum too:
    # reduced at the end). The group's d is left unwritten: its chunks write every row
    # before the matmuls read it, so filling it with zeros would only cost a pass over
    # [G, V_local] (the kernel's groups need none). The first group runs outside the scan
    # and starts the f32 d weight sum with its matmul: no zeros written, none read (the
    # group's body compiles twice).
    d_bias, d_group = plumbing.unify_varying(
        (None if bias is None else jnp.zeros(bias.shape, dtype),
         None if config.plan.kernel_chunk else lax.empty((group, num_columns),
                                                          call.operand_dtype),
         hidden, weight, *tokens[:3]), config.vocab_axis)[:2]
    carry, first = group_step((jnp.zeros_like(hidden), None, d_bias, d_group), 0)
    outputs = jax.tree.map(lambda a: a[None], first)  # [1, ...]: as the scan stacks them
    if n_groups > 1:
      carry, rest = lax.scan(group_step, carry, jnp.arange(1, n_groups))
      outputs = jax.tree.map(lambda a, b: jnp.concatenate([a, b]), outputs, rest)
    loss, logp, *entropy = outputs
  else:
    _, (loss, logp, *entropy) = lax.scan(group_step, None, jnp.arange(n_groups))
  logp = chunking.unchunk(logp, padded)[:num_tokens]
  entropy = chunking.unchunk(entropy[0], padded)[:num_tokens] if entropy else None
  out = (jnp.sum(loss), (logp, entropy))
  if not with_grads:
    return out, None
  d_hidden, d_weight, d_bias, _ = carry
  d_weight = lax.slice_in_dim(d_weight, 0, num_columns, axis=config.vocab_dim)  # (odd widths)
  grads = (d_hidden[:num_tokens], d_weight.astype(primals[1].dtype),
           None if d_bias is None else d_bias.astype(primals[2].dtype))
  # Zero-size slices carry each primal's type over shard_map axes to the backward, which
  # sums the scaled gradients over the axes the primal does not vary over.
  witnesses = tuple(None if p is None else p.reshape(-1)[:0] for p in primals)
  return out, (grads, witnesses)


def _group_step(call: _Call, carry, g):
  """Group ``g`` of the scan: its outputs and, when differentiating, the carry ``(d
  hidden, d weight sum or None before the first group, d bias sum or None, the group's d
  buffer or None)`` with the group's gradients added."""
  config, weight, vocab_dim = call.config, call.weight, call.config.vocab_dim
  padded, group, chunk = config.plan.rows, config.plan.grad_chunk, config.plan.chunk
  start = chunking.chunk_start(g, padded, group)
  fresh = chunking.fresh_rows(g, start, group)
  h, group_tokens, group_args = chunking.take_rows((call.hidden, call.tokens, call.token_args),
                                                   start, group)
  group_rows = (h, group_tokens, group_args, fresh)
  # (the group's d: one buffer carried from group to group, written in place)
  d_hidden, d_weight, d_bias, d = carry if call.with_grads else (None,) * 4
  if config.plan.kernel_chunk is not None:
    d, outputs = _kernel_group(call, group_rows)
  else:
    (d, d_bias), (loss, *per_token) = lax.scan(functools.partial(_chunk_step, call, group_rows),
                                               (d, d_bias), jnp.arange(group // chunk))
    flat = lambda a: a.reshape((group,) + a.shape[2:])  # [chunks, chunk, ...] -> [group, ...]
    outputs = (jnp.sum(loss), *map(flat, per_token))
  if not call.with_grads:
    return carry, outputs
  row_mask = group_tokens.valid & fresh
  h = jnp.where(row_mask[:, None], h, 0)  # an ignored row's NaN must not reach d W as 0 * NaN
  dh_rows = head.contract(d, call.matmul_weight, 1, vocab_dim, config.plan.precision)
  dh_rows = plumbing.sum_over_shards(dh_rows, config.vocab_axis, call.primals[0],
                                     d_hidden.dtype, config.gathered)
  d_hidden = chunking.write_fresh(d_hidden, dh_rows, start, fresh)
  d_weight_group = head.weight_grad(h, d, vocab_dim, config.plan.precision)
  # (None before the first group, which writes the sum without reading zeros)
  d_weight = d_weight_group if d_weight is None else d_weight + d_weight_group
  # (the kernel's groups make their d afresh: none is carried)
  return (d_hidden, d_weight, d_bias, None if config.plan.kernel_chunk else d), outputs


def _chunk_step(call: _Call, group_rows, carry, i):
  """Chunk ``i`` of a group's rows (XLA's matmul): its outputs and, when differentiating,
  its ``d`` written into the group's (the operand dtype) and the running ``d bias``
  sum."""
  config, column_start, chunk = call.config, call.column_start, call.config.plan.chunk
  h, chunk_tokens, chunk_args, fresh = chunking.take_rows(group_rows, i * chunk, chunk)
  labels, inv_temp, valid, kept = chunk_tokens
  x, (logp, shift, log_sum, entropy) = _rows(h, call.weight, call.bias, chunk_tokens,
                                             column_start, config)
  row_mask = valid & fresh  # a clamped group's overlap counts once
  loss, g_logp, g_entropy = loss_terms.terms_and_cotangents(
      call.objective, logp, entropy, list(chunk_args), row_mask, call.with_grads)
  outputs = (loss, logp) + ((entropy,) if config.with_entropy else ())
  if not call.with_grads:
    return carry, outputs
  kept_tile = None if kept is None else softmax.kept_columns(
      kept, 0, call.num_columns, labels - column_start)
  z = softmax.scaled_logits(x, inv_temp, column_start, config.plan.mask_vocab, kept=kept_tile)
  dz = softmax.logit_grad(z, labels - column_start, shift, log_sum, entropy, g_logp,
                          g_entropy, row_mask)
  dx = head.logits_input_grad(dz, inv_temp, x, config.logit_softcap, row_mask)
  d_group, d_bias = carry
  d_group = lax.dynamic_update_slice_in_dim(d_group, dx.astype(call.operand_dtype), i * chunk,
                                            0)
  return (d_group, None if d_bias is None else d_bias + jnp.sum(dx, axis=0)), outputs


def _kernel_group(call: _Call, group_rows):
  """A group's outputs and, when differentiating, its ``d``: one call of the fused head's
  forward kernel (the rows' tile statistics and, when differentiating, their ``exp(z -
  m_tile)`` terms), then one kernel writing ``d`` over the terms."""
  config, column_start, with_grads = call.config, call.column_start, call.with_grads
  h, group_tokens, group_args, fresh = group_rows
  limit = softmax.kernel_limit(config.plan.mask_vocab, column_start, call.num_columns)
  segments = logits_rows.layout(call.num_columns, config.vocab_axis)
  out = mosaic_head.statistics(
      h, call.weight, group_tokens.labels, group_tokens.inv_temp, limit, group_tokens.kept,
      column_start=column_start, vocab_dim=config.vocab_dim, softcap=config.logit_softcap,
      with_entropy=config.with_entropy, interpret=config.plan.interpret,
      num_cores=config.plan.num_cores, with_exp=with_grads, layout=segments,
      blocks=call.weight_blocks)
  tiles, e = out if with_grads else (out, None)
  logp, shift, log_sum, entropy = logits_rows.tile_outputs(tiles, group_tokens, config,
                                                           segments)
  row_mask = group_tokens.valid & fresh  # a clamped group's overlap counts once
  loss, g_logp, g_entropy = loss_terms.terms_and_cotangents(
      call.objective, logp, entropy, list(group_args), row_mask, with_grads)
  outputs = (jnp.sum(loss), logp) + ((entropy,) if config.with_entropy else ())
  if not with_grads:
    return None, outputs
  # (an odd width's terms are wider, zeros past V_local: its lone segment is tiled as wide,
  # and d is 0 there, the matmul weight's zero padding's partner)
  d = mosaic_rows_grad.exp_overwrite(
      e, tiles, group_tokens._replace(valid=row_mask), (shift, log_sum, entropy),
      (g_logp, g_entropy), column_start,
      layout=segments._replace(width=e.shape[1]) if segments.count == 1 else segments,
      softcap=config.logit_softcap, interpret=config.plan.interpret)
  # (the kernels' outputs drop the shard_map axes: d varies like the weight's shard)
  return plumbing.unify_varying((d, call.weight), config.vocab_axis)[0], outputs


def _matmul_weight(weight, config):
  """The weight the gradient matmuls read: ``weight``, or where the kernel's terms are
  wider than it (an odd ``V_local``: ``mosaic_head.exp_width``) a copy zero-padded to
  them, read by every group: XLA's matmuls over rows of an odd number of 16-bit columns
  ran the path 2.6x slower per column on an H200 (bench/NOTES.md, entry 58)."""
  num_columns = weight.shape[config.vocab_dim]
  if config.plan.kernel_chunk is None:
    return weight
  width = mosaic_head.exp_width(num_columns, weight.dtype)
  if width == num_columns:
    return weight
  return head.pad_columns(weight, width, config.vocab_dim)


def _weight_blocks(weight, config):
  """With the plan's ``weight_copy`` ``"call"``, the kernel's copy of a weight it cannot read
  in place, in vocab blocks, made once before the groups (``mosaic_head.weight_blocks``:
  about the weight's bytes, alive until the last group); else None (each group's call
  copies a block at a time, or none is needed). A copy a group cost the GRPO step ~4 % at
  Qwen3's 151936 columns, D = 1024, on an H200 (bench/NOTES.md, entries 80 and 81)."""
  if config.plan.weight_copy != "call":
    return None
  return mosaic_head.weight_blocks(
      weight, num_rows=config.plan.grad_chunk, vocab_dim=config.vocab_dim,
      num_cores=config.plan.num_cores,
      layout=logits_rows.layout(weight.shape[config.vocab_dim], config.vocab_axis))


def _rows(hidden, weight, bias, tokens, column_start, config):
  """``(x, (logp, m, log s, entropy or None))``: a chunk's f32 logits ``x [C, V_local]``
  after the softcap (XLA's matmul), and their statistics as ``logits_rows.statistics``
  returns them."""
  if not config.plan.exact_sums:
    x = head.tile_logits(hidden, weight, bias, config.logit_softcap, config.vocab_dim,
                         config.plan.precision)
    return x, logits_rows.statistics(x, tokens, column_start, config)
  # batch-invariant: matmuls of one shape (chunk = the tile's rows), no softcap yet (the
  # exact statistics apply it themselves)
  x = head.invariant_logits(hidden, weight, bias, config.vocab_dim, config.plan.matmul_tile[1],
                            config.plan.precision)
  statistics = logits_rows.statistics(x, tokens, column_start, config)
  return head.cap(x, config.logit_softcap), statistics


def _fwd(objective, hidden, weight, bias, tokens, token_args, config):
  return _run(objective, hidden, weight, bias, tokens, token_args, config, with_grads=True)


def _bwd(objective, config, residuals, cotangents):
  del objective, config
  grads, witnesses = residuals
  scale = cotangents[0]  # the outputs (logp, entropy) are for metrics: no gradient
  scaled = tuple(None if g is None else plumbing.reduce_to_varying(g * scale.astype(g.dtype), w)
                 for g, w in zip(grads, witnesses))
  return scaled + (None, None)


_linear_token_loss.defvjp(_fwd, _bwd)
_jitted = jax.jit(_linear_token_loss, static_argnames=("objective", "config"))
