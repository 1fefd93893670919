"""The logits path's kernel: log-prob and entropy of ``[T, V_local]`` logits rows with a
hand-written backward, on arrays the front door (``jaxce._api``) has checked and
flattened.

Forward: the row statistics of every token by the Pallas kernel (one pass) or by XLA in a
scan over chunks of tokens (two fused passes per chunk); shards combine them with one pmax
and one psum. Backward: one fused elementwise pass writes the gradient, or (``in_place``)
a loop overwrites the logits chunk by chunk.
"""

from __future__ import annotations

from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from jaxce import _chunking, _math, _pallas


class Config(NamedTuple):
  """The static (Python, hashable) configuration of one call.

  Attributes:
    vocab_size: the logical vocabulary (kept labels at or above it give NaN).
    mask_vocab: ``vocab_size`` when some columns must be masked, else ``None``.
    chunk: tokens per step of the XLA forward's scan and the in-place backward's loop;
      ``None`` when neither runs (the Pallas forward with the one-pass backward).
    vocab_axis: the mesh axis (or tuple) the columns are split over, or ``None``.
    with_entropy: compute (and return) the entropy.
    implementation: ``"xla"`` or ``"pallas"``: the forward's row statistics.
    in_place: the backward overwrites the logits chunk by chunk.
  """
  vocab_size: int
  mask_vocab: int | None
  chunk: int | None
  vocab_axis: object
  with_entropy: bool
  implementation: str
  in_place: bool


def logprobs_entropy(x, labels, inv_temp, valid, config: Config):
  """``x [T, V_local]``, ``labels`` int32 ``[T]``, ``inv_temp [T]``, ``valid`` bool
  ``[T]`` -> ``(logp [T],)`` or ``(logp, entropy)`` in the compute dtype; differentiable
  in ``x`` (jitted once per configuration, inlined inside an outer jit or shard_map).

  Memory: the forward keeps ``x`` and three ``[T]`` vectors as residuals; its working set
  is O(T) with the Pallas kernel and the reductions' partial sums of one ``[chunk,
  V_local]`` tile with XLA. The backward reads ``x`` once and writes the gradient (an
  array like ``x``); with ``in_place`` it overwrites ``x``'s buffer when ``x`` is dead.
  """
  return _jitted_logprobs_entropy(x, labels, inv_temp, valid, config)


@partial(jax.custom_vjp, nondiff_argnums=(4,))
def _logprobs_entropy(x, labels, inv_temp, valid, config):
  return forward(x, labels, inv_temp, valid, config)[0]


def pallas_statistics(x, labels, inv_temp, valid, column_start, vocab_size, mask_vocab,
                      vocab_axis, with_entropy):
  """``(logp, m, log s, entropy or None)`` of rows ``x [C, V_local]`` (the arguments of
  ``_math.chunk_statistics``) with the one-pass Pallas kernel for the row statistics."""
  num_columns = x.shape[1]
  limit = num_columns if mask_vocab is None else jnp.clip(
      mask_vocab - column_start, 0, num_columns)
  m, s, q = _pallas.row_statistics(x, inv_temp, limit, with_entropy)
  picked = _math.label_logit(x, labels, inv_temp, column_start)
  m, s, q, picked = _math.combine_shards(m, s, q if with_entropy else None, picked, vocab_axis)
  log_s, entropy = _math.finish_statistics(s, q)
  logp, entropy = _math.finish_outputs((picked - m) - log_s, entropy, labels, valid,
                                       vocab_size)
  return logp, m, log_s, entropy


def forward(x, labels, inv_temp, valid, config):
  """``((logp,) or (logp, entropy), (m, log s, entropy or None))`` of every row of ``x``
  (no gradient): the outputs and the statistics the gradient needs."""
  num_tokens, num_columns = x.shape
  vocab_size, mask_vocab, chunk, vocab_axis, with_entropy = (
      config.vocab_size, config.mask_vocab, config.chunk, config.vocab_axis,
      config.with_entropy)
  column_start = _math.shard_column_start(num_columns, vocab_axis)
  if config.implementation == "pallas":
    logp, m, log_s, entropy_out = pallas_statistics(
        x, labels, inv_temp, valid, column_start, vocab_size, mask_vocab, vocab_axis,
        with_entropy)
    return (logp,) + ((entropy_out,) if with_entropy else ()), (m, log_s, entropy_out)

  def step(_, i):
    start = _chunking.chunk_start(i, num_tokens, chunk)
    rows = lambda a: lax.dynamic_slice_in_dim(a, start, chunk, 0)
    logp, m, log_s, entropy = _math.chunk_statistics(
        rows(x), rows(labels), rows(inv_temp), rows(valid), column_start, vocab_size,
        mask_vocab, vocab_axis, with_entropy)
    return None, (logp, m, log_s) + ((entropy,) if with_entropy else ())

  _, stacked = lax.scan(step, None, jnp.arange(_chunking.num_chunks(num_tokens, chunk)))
  logp, m, log_s, *entropy = (_chunking.unchunk(s, num_tokens) for s in stacked)
  # Residuals: m, log s and the entropy ([T] each; ignored rows get no gradient).
  return (logp,) + tuple(entropy), (m, log_s, entropy[0] if with_entropy else None)


def _logprobs_entropy_fwd(x, labels, inv_temp, valid, config):
  x, labels, inv_temp, valid = (p.value for p in (x, labels, inv_temp, valid))
  out, stats = forward(x, labels, inv_temp, valid, config)
  return out, (x, labels, inv_temp, valid) + stats


def logits_gradient(x, labels, inv_temp, valid, shift, log_sum, entropy, g_logp, g_entropy,
                    mask_vocab, column_start):
  """``d loss / d x`` of logits rows ``x [C, V_local]`` (in ``x``'s dtype) from their
  statistics and the per-token cotangents (``[C]`` each; ``None`` for a symbolic zero):
  one elementwise pass. ``column_start``: the global id of ``x``'s first column."""
  z = _math.scaled_logits(x, inv_temp, column_start, mask_vocab)
  dz = _math.logit_grad(z, labels - column_start, shift, log_sum, entropy, g_logp, g_entropy,
                        valid)
  return (dz * inv_temp[:, None].astype(dz.dtype)).astype(x.dtype)


def _logprobs_entropy_bwd(config, residuals, cotangents):
  x, labels, inv_temp, valid, shift, log_sum, entropy = residuals
  mask_vocab, chunk, vocab_axis = config.mask_vocab, config.chunk, config.vocab_axis
  g_logp = _math.symbolic_zero_to_none(cotangents[0])
  g_entropy = _math.symbolic_zero_to_none(cotangents[1]) if config.with_entropy else None
  if g_logp is None and g_entropy is None:
    return (jnp.zeros_like(x), None, None, None)
  column_start = _math.shard_column_start(x.shape[1], vocab_axis)
  gradient = lambda x, rows: logits_gradient(
      x, rows(labels), rows(inv_temp), rows(valid), rows(shift), rows(log_sum),
      rows(entropy), rows(g_logp), rows(g_entropy), mask_vocab, column_start)

  if not config.in_place:
    # One elementwise pass over [T, V_local] into a new array.
    return (gradient(x, lambda a: a), None, None, None)

  # The logits buffer is the loop carry; each step overwrites one chunk of rows with
  # its gradient (XLA updates a loop carry in place, copying it first only when the
  # logits are still needed after the backward). A ragged tail is one static step.
  num_tokens = x.shape[0]
  full, tail = divmod(num_tokens, chunk)

  def overwrite(x, start, size):
    rows = lambda a: None if a is None else lax.dynamic_slice_in_dim(a, start, size, 0)
    return lax.dynamic_update_slice_in_dim(x, gradient(rows(x), rows), start, 0)

  x = lax.fori_loop(0, full, lambda i, x: overwrite(x, i * chunk, chunk), x)
  if tail:
    x = overwrite(x, full * chunk, tail)
  return (x, None, None, None)


_logprobs_entropy.defvjp(_logprobs_entropy_fwd, _logprobs_entropy_bwd, symbolic_zeros=True)
# Jitted once per static configuration, so repeated eager calls do not recompile; inside
# an outer jit (or shard_map) it is inlined.
_jitted_logprobs_entropy = jax.jit(_logprobs_entropy, static_argnums=(4,))
