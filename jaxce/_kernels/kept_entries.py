"""The kept-ids kernels' shared maths: a token's outputs over its kept set ``S_t`` involve
the logits of ``S_t`` (and the label) alone,

    z_v = x_{t,v} / T_t   for v in S_t ∪ {y_t}
    logp = z_y - m - log s,  s = Σ_v exp(z_v - m),  H = log s - Σ_v exp(z_v - m)(z_v - m) / s

so both kept-ids kernels (``linear_kept_ids`` on the fused head, ``logits_kept_ids`` on
logits) walk a flat list of *entries*: every kept id with its token (ids equal to the
token's label dropped), then each token's label, so the label counts once, kept or not.
The per-token statistics are segment reductions over the entries' ``z``, combined over
the vocab shards (each shard owns the ids in its column range) with one pmax and one
psum; the backward's ``d z`` of each entry comes from the saved statistics.

Memory: ``[N + T]`` arrays (``N`` kept ids), nothing ``[T, V]``-sized.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxce._kernels import softmax
from jaxce._kernels.config import Config, Tokens


def entries(tokens: Tokens, num_columns: int, config: Config, multiple: int = 1):
  """``(column, token, is_label, active)`` ``[N + T]`` each, zero-padded to a multiple of
  ``multiple``: the local column of every kept id on this shard (``tokens.kept``; dropping
  those equal to their token's label, those beyond the logical vocabulary and those of
  ignored tokens), then each token's label (on the shard that owns it). An inactive
  entry holds column 0 and a token in range."""
  ids, token = tokens.kept
  num_tokens = tokens.labels.shape[0]
  shard_start = softmax.shard_column_start(num_columns, config.vocab_axis)
  limit = num_columns if config.plan.mask_vocab is None else config.plan.mask_vocab - shard_start
  safe_token = jnp.clip(token, 0, num_tokens - 1)
  column = ids - shard_start
  kept = ((ids >= 0) & (token >= 0) & (token < num_tokens) & (column >= 0)
          & (column < jnp.minimum(num_columns, limit)) & (ids != tokens.labels[safe_token])
          & tokens.valid[safe_token])
  label_column = tokens.labels - shard_start
  owns_label = tokens.valid & (label_column >= 0) & (label_column < num_columns)
  column = jnp.concatenate([jnp.where(kept, column, 0), jnp.where(owns_label, label_column, 0)])
  token = jnp.concatenate([safe_token, jnp.arange(num_tokens, dtype=safe_token.dtype)])
  is_label = jnp.concatenate([jnp.zeros_like(kept), jnp.ones_like(owns_label)])
  active = jnp.concatenate([kept, owns_label])
  size = -(-column.shape[0] // multiple) * multiple
  pad = lambda a: jnp.pad(a, (0, size - a.shape[0]))
  return pad(column), pad(token), pad(is_label), pad(active)


def scaled(x, tokens: Tokens, entries_):
  """``z`` ``[size]`` in ``x``'s dtype (the compute dtype): each active entry's logit
  ``x`` (capped, on the fused head) over its token's temperature; inactive entries hold 0
  (never ``-inf``)."""
  _, token, _, active = entries_
  return jnp.where(active, x * tokens.inv_temp[token].astype(x.dtype), 0)


def statistics(z, entries_, num_tokens: int, config: Config):
  """``(m, log s, entropy or None, picked)`` ``[T]`` over every shard's entries."""
  _, token, is_label, active = entries_
  floor = jnp.finfo(z.dtype).min
  m = jax.ops.segment_max(jnp.where(active, z, floor), token, num_tokens)
  m = jnp.maximum(m, floor)  # (a token with no entry here: finfo.min, never -inf)
  shifted = z - m[token]
  e = jnp.where(active, jnp.exp(shifted), 0)
  s = jax.ops.segment_sum(e, token, num_tokens)
  q = (jax.ops.segment_sum(e * jnp.where(active, shifted, 0), token, num_tokens)
       if config.with_entropy else None)
  picked = jax.ops.segment_sum(jnp.where(is_label & active, z, 0), token, num_tokens)
  m, s, q, picked = softmax.combine_shards(m, s, q, picked, config.vocab_axis)
  log_s, entropy = softmax.finish_statistics(jnp.where(s > 0, s, 1), q)
  return m, log_s, entropy, picked


def outputs(statistics_, tokens: Tokens, config: Config):
  """``(outputs, saved)``: ``(logp,)`` or ``(logp, entropy)`` as returned, and the
  backward's ``(m, log s, entropy)``."""
  m, log_s, entropy, picked = statistics_
  logp, entropy_out = softmax.finish_outputs((picked - m) - log_s, entropy, tokens.labels,
                                             tokens.valid, config.vocab_size)
  out = (logp,) + ((entropy_out,) if config.with_entropy else ())
  return out, (m, log_s, entropy)


def logit_grad(z, entries_, saved, g_logp, g_entropy):
  """``d loss / d z`` of every entry, ``[size]`` like ``z``, from the forward's ``saved``
  ``(m, log s, entropy)`` and the cotangents (``[T]`` each, either may be None). The
  caller masks inactive entries and invalid tokens (after every factor)."""
  _, token, is_label, _ = entries_
  m, log_s, entropy = saved
  log_p = z - m[token] - log_s[token]
  p = jnp.exp(log_p)
  dz = jnp.zeros_like(z)
  if g_logp is not None:
    dz = dz + g_logp[token].astype(z.dtype) * (is_label.astype(z.dtype) - p)
  if g_entropy is not None:
    dz = dz - g_entropy[token].astype(z.dtype) * p * (log_p + entropy[token])
  return dz
