"""The fused LM-head path over kept ids: log-prob and entropy of the softmax renormalized
over each token's kept set ``S_t``, computing only the logits of ``S_t`` and the label
(``kept_entries``: the maths, the entries and their statistics).

The forward costs ``O((Σ_t |S_t| + T) · D)``, not ``O(T · V · D)``, and the gradient
reaches only those columns. The entries are walked in blocks of at most ``BLOCK``: each
block gathers its hidden rows and weight columns (``[block, D]`` each) and forms its
logits, ``z = softcap(h_t · W[:, v] + b_v) / T_t``, f32 ``[N + T]`` in all. The columns
are read as rows of a ``[V, D]`` weight, each one contiguous read: a ``[D, V]`` weight is
transposed once per pass (a column of it is ``D`` elements ``V`` apart, a read amplified
by the memory's sector size). The backward forms each entry's ``d z`` from the saved
statistics and logits, and accumulates ``d hidden`` (f32 ``[T, D]``; the entries sorted
by token, a run of adds a token), ``d weight`` (f32 ``[V, D]``, cast and transposed back
at the end) and ``d bias`` by scatter-adds over the blocks.

Memory: the entries' f32 logits ``[N + T]`` (kept for the backward), two ``[block, D]``
gathers at a time, and for a ``[D, V]`` weight its transposed copy while a pass runs; the
backward's f32 ``d hidden`` and ``d weight`` accumulators (the gradients' size in f32).
Nothing ``[T, V]``-sized.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from jaxce._kernels import head, kept_entries, plumbing
from jaxce._kernels.config import Config, KeptIds, Tokens

BLOCK = 16384  # entries per gather at most: two [BLOCK, D] operand-dtype arrays


def logprobs_entropy(hidden, weight, bias, tokens: Tokens, config: Config):
  """``hidden [T, D]``, ``weight`` (``[D, V_local]``, or ``[V_local, D]``), ``bias``
  ``[V_local]`` or None, and the ``tokens`` (``tokens.kept``: the kept ids, ``(ids,
  token)`` int32 ``[N]`` each, sorted by token, -1 ids unused) -> ``(logp [T],)`` or
  ``(logp, entropy)`` in the compute dtype; differentiable in ``hidden``, ``weight`` and
  ``bias``. Memory: see the module."""
  return _jitted(hidden, weight, bias, tokens, config=config)


def _block_size(tokens: Tokens) -> int:
  """Entries per block: the ``N + T`` entries in the fewest blocks of at most ``BLOCK``,
  of equal size (a multiple of 8), so the padding stays under 8 entries a block."""
  size = tokens.kept[0].shape[0] + tokens.labels.shape[0]
  blocks = -(-size // BLOCK)
  return -(-size // (8 * blocks)) * 8


def _entries(tokens: Tokens, num_columns: int, config: Config):
  """``kept_entries.entries``, sorted by token (each token's kept ids, then its label,
  then the padding of token 0 first): the backward's ``d hidden`` is a sum of runs, which
  XLA's scatter-add of sorted indices sums in registers before one atomic add a run."""
  entries = kept_entries.entries(tokens, num_columns, config, _block_size(tokens))
  order = jnp.argsort(entries[1], stable=True)
  return tuple(a[order] for a in entries)


def _blocks(block, *arrays):
  """``[size]`` arrays as ``[size / block, block]`` (for a scan over blocks)."""
  return tuple(a.reshape(-1, block) for a in arrays)


def _weight_rows(weight, vocab_dim):
  """``[V_local, D]``: the weight with one column per row; a ``[D, V]`` weight
  transposed (a copy of the weight)."""
  return weight if vocab_dim == 0 else weight.T


def _logits(hidden, weight_rows, bias, tokens, entries, config):
  """``(z, x)``, f32 ``[size]`` each: every entry's scaled logit ``z``
  (``kept_entries.scaled``) and its capped logit ``x`` before the temperature
  (``weight_rows``: ``[V_local, D]``)."""
  column, token, _, _ = entries
  operand_dtype, dtype = head.dtypes(hidden, weight_rows)

  def block(_, arrays):
    column, token = arrays
    h = jnp.take(hidden, token, axis=0).astype(operand_dtype)
    w = jnp.take(weight_rows, column, axis=0, mode="clip").astype(operand_dtype)
    x = jnp.einsum("nd,nd->n", h, w, preferred_element_type=dtype,
                   precision=head.lax_precision(config.plan.precision))
    if bias is not None:
      x = x + jnp.take(bias, column, mode="clip").astype(dtype)
    return None, head.cap(x, config.logit_softcap)

  _, x = lax.scan(block, None, _blocks(_block_size(tokens), column, token))
  x = x.reshape(-1)
  return kept_entries.scaled(x, tokens, entries), x


def _forward(hidden, weight, bias, tokens, config):
  num_tokens = hidden.shape[0]
  outer = tokens
  hidden, weight, bias, *arrays = plumbing.unify_varying(
      (hidden, weight, bias, tokens.labels, tokens.inv_temp, tokens.valid, *tokens.kept),
      config.vocab_axis)
  tokens = Tokens(*arrays[:3], KeptIds(*arrays[3:]))
  entries = _entries(tokens, weight.shape[config.vocab_dim], config)
  z, x = _logits(hidden, _weight_rows(weight, config.vocab_dim), bias, tokens, entries, config)
  out, saved = kept_entries.outputs(kept_entries.statistics(z, entries, num_tokens, config),
                                    outer, config)
  return out, (saved, x)


@plumbing.custom_vjp("config")
def _kept_ids_logprobs_entropy(hidden, weight, bias, tokens, config):
  return _forward(hidden, weight, bias, tokens, config)[0]


def _fwd(hidden, weight, bias, tokens, config):
  hidden, weight, bias, tokens = plumbing.primal_values((hidden, weight, bias, tokens))
  out, saved = _forward(hidden, weight, bias, tokens, config)
  return out, (hidden, weight, bias, tokens, saved)


def _bwd(config, residuals, cotangents):
  hidden, weight, bias, tokens, ((m, log_s, entropy), x) = residuals
  g_logp = plumbing.symbolic_zero_to_none(cotangents[0])
  g_entropy = plumbing.symbolic_zero_to_none(cotangents[1]) if config.with_entropy else None
  zeros = (jnp.zeros_like(hidden), jnp.zeros_like(weight),
           None if bias is None else jnp.zeros_like(bias), None)
  if g_logp is None and g_entropy is None:
    return zeros
  witnesses = (hidden, weight, bias)
  saved = (x, m, log_s) + (() if entropy is None else (entropy,))
  hidden, weight, bias, *arrays = plumbing.unify_varying(
      (hidden, weight, bias, tokens.labels, tokens.inv_temp, tokens.valid, *tokens.kept,
       *saved), config.vocab_axis)
  tokens = Tokens(*arrays[:3], KeptIds(*arrays[3:5]))
  x, m, log_s, *rest = arrays[5:]
  entropy = rest[0] if rest else None
  num_columns = weight.shape[config.vocab_dim]
  entries = _entries(tokens, num_columns, config)
  column, token, _, active = entries
  weight_rows = _weight_rows(weight, config.vocab_dim)
  z = kept_entries.scaled(x, tokens, entries)
  dtype = z.dtype
  dz = kept_entries.logit_grad(z, entries, (m, log_s, entropy), g_logp, g_entropy)
  valid = active & tokens.valid[token]
  dx = head.logits_input_grad(dz[:, None], tokens.inv_temp[token], x[:, None], config.logit_softcap,
                              valid)[:, 0]

  def block(carry, arrays):
    d_hidden, d_weight_rows = carry
    column, token, dx = arrays
    h = jnp.take(hidden, token, axis=0).astype(dtype)
    w = jnp.take(weight_rows, column, axis=0).astype(dtype)
    d_hidden = d_hidden.at[token].add(dx[:, None] * w, indices_are_sorted=True)
    d_weight_rows = d_weight_rows.at[column].add(dx[:, None] * h)
    return (d_hidden, d_weight_rows), None

  # (zeros_like: the sums vary like every input together over shard_map axes)
  start = (jnp.zeros_like(hidden, dtype), jnp.zeros_like(weight_rows, dtype))
  (d_hidden, d_weight_rows), _ = lax.scan(block, start, _blocks(_block_size(tokens), column,
                                                                token, dx))
  d_hidden = plumbing.sum_over_shards(d_hidden, config.vocab_axis, witnesses[0], hidden.dtype,
                                      config.gathered)
  d_weight = d_weight_rows.astype(weight.dtype)
  d_bias = None if bias is None else jax.ops.segment_sum(dx, column, num_columns)
  grads = (d_hidden, d_weight if config.vocab_dim == 0 else d_weight.T,
           None if bias is None else d_bias.astype(bias.dtype))
  return tuple(None if g is None else plumbing.reduce_to_varying(g, w)
               for g, w in zip(grads, witnesses)) + (None,)


_kept_ids_logprobs_entropy.defvjp(_fwd, _bwd, symbolic_zeros=True)
_jitted = jax.jit(_kept_ids_logprobs_entropy, static_argnames=("config",))
