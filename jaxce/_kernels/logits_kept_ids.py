"""The logits path over kept ids: log-prob and entropy of the softmax renormalized over each
token's kept set ``S_t``, reading only the logits of ``S_t`` and the label
(``kept_entries``: the maths, the entries and their statistics).

The forward gathers each entry's logit from ``x [T, V_local]`` (``N + T`` elements, no
pass over the rows) and reduces them per token. The backward forms each entry's ``d z``
and writes the gradient, an array like ``x`` that is 0 outside the kept columns, with one
scatter of the entries.

Memory: ``[N + T]`` f32 arrays; the backward's gradient (like ``x``, the output).
Nothing else ``[T, V]``-sized.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxce._kernels import kept_entries, plumbing, softmax
from jaxce._kernels.config import Config, KeptIds, Tokens


def logprobs_entropy(x, tokens: Tokens, config: Config):
  """``x [T, V_local]`` and its ``tokens`` (``tokens.kept``: the kept ids, ``(ids, token)``
  int32 ``[N]`` each, -1 ids unused) -> ``(logp [T],)`` or ``(logp, entropy)`` in the
  compute dtype; differentiable in ``x``. Memory: see the module."""
  return _jitted(x, tokens, config=config)


def _unified(x, tokens, config, *extra):
  """``x``, ``tokens`` and ``extra`` with one varying type over ``shard_map`` axes."""
  x, *arrays = plumbing.unify_varying(
      (x, tokens.labels, tokens.inv_temp, tokens.valid, *tokens.kept, *extra), config.vocab_axis)
  return x, Tokens(*arrays[:3], KeptIds(*arrays[3:5])), arrays[5:]


def _logits(x, tokens, entries):
  """``z``, the entries' scaled logits in the compute dtype (``kept_entries.scaled``)."""
  column, token, _, _ = entries
  dtype = softmax.compute_dtype(x.dtype)
  return kept_entries.scaled(x[token, column].astype(dtype), tokens, entries)


def _forward(x, tokens, config):
  outer = tokens
  x, tokens, _ = _unified(x, tokens, config)
  entries = kept_entries.entries(tokens, x.shape[1], config)
  z = _logits(x, tokens, entries)
  return kept_entries.outputs(kept_entries.statistics(z, entries, x.shape[0], config), outer,
                              config)


@plumbing.custom_vjp("config")
def _kept_ids_logprobs_entropy(x, tokens, config):
  return _forward(x, tokens, config)[0]


def _fwd(x, tokens, config):
  x, tokens = plumbing.primal_values((x, tokens))
  out, saved = _forward(x, tokens, config)
  return out, (x, tokens, saved)


def _bwd(config, residuals, cotangents):
  witness, tokens, (m, log_s, entropy) = residuals
  g_logp = plumbing.symbolic_zero_to_none(cotangents[0])
  g_entropy = plumbing.symbolic_zero_to_none(cotangents[1]) if config.with_entropy else None
  if g_logp is None and g_entropy is None:
    return jnp.zeros_like(witness), None
  saved = (m, log_s) + (() if entropy is None else (entropy,))
  x, tokens, (m, log_s, *rest) = _unified(witness, tokens, config, *saved)
  entries = kept_entries.entries(tokens, x.shape[1], config)
  column, token, _, active = entries
  z = _logits(x, tokens, entries)
  dz = kept_entries.logit_grad(z, entries, (m, log_s, rest[0] if rest else None), g_logp,
                               g_entropy)
  # the temperature's factor; exactly 0 at inactive entries, after it (no 0 * NaN)
  dx = jnp.where(active & tokens.valid[token], dz * tokens.inv_temp[token].astype(dz.dtype), 0)
  # Each (token, column) is one entry (a kept id equal to its label was dropped): the
  # scatter writes every entry once; inactive entries add 0.
  grad = jnp.zeros_like(x).at[token, column].add(dx.astype(x.dtype))
  return plumbing.reduce_to_varying(grad, witness), None


_kept_ids_logprobs_entropy.defvjp(_fwd, _bwd, symbolic_zeros=True)
_jitted = jax.jit(_kept_ids_logprobs_entropy, static_argnames=("config",))
