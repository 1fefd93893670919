"""What the objective kernels share: a chunk's loss terms and their per-token cotangents
(the front door has checked that the objective is per-token: ``jaxce._checks``).

An objective maps ``(logp, entropy, *token_args)``, each ``[C]`` for a chunk of C tokens,
to ``[C]`` per-token terms; the loss is their sum over kept tokens. Because each term
depends only on its own token, a chunk's cotangents ``d loss / d logp`` and
``d loss / d entropy`` are known as soon as the chunk's statistics are: the kernels form
the logits' gradient while the chunk's rows are still at hand.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def terms_and_cotangents(objective, logp, entropy, token_args, row_mask, with_grads):
  """The chunk's loss (the sum of its terms where ``row_mask`` is True) and, with
  ``with_grads``, the per-token cotangents ``(g_logp, g_entropy)`` (``g_entropy`` None
  without entropy), exactly 0 where ``row_mask`` is False."""
  entropy_in = jnp.zeros_like(logp) if entropy is None else entropy
  terms, vjp = jax.vjp(lambda lp, h: objective(lp, h, *token_args), logp, entropy_in)
  weight = row_mask.astype(terms.dtype)
  loss = jnp.sum(jnp.where(row_mask, terms, 0))
  if not with_grads:
    return loss, None, None
  g_logp, g_entropy = vjp(weight)
  g_logp = jnp.where(row_mask, g_logp, 0).astype(logp.dtype)
  g_entropy = None if entropy is None else jnp.where(row_mask, g_entropy, 0).astype(logp.dtype)
  return loss, g_logp, g_entropy


def per_token_loss(objective, per_token, operands, tokens, token_args, config):
  """``(loss, (logp, entropy or None))`` of ``objective`` over the outputs of a per-token
  kernel ``per_token(*operands, tokens, config)`` (the kept-ids kernels: their gradients
  cost little, so autodiff through them serves), the loss differentiable in the operands.
  Rows of ignored tokens reach the objective as 0 and get no cotangent (not ``0 * NaN``)."""
  out = per_token(*operands, tokens, config)
  logp, entropy = out[0], (out[1] if config.with_entropy else None)
  row_mask = tokens.valid
  masked = lambda v: jnp.where(row_mask, v, 0)
  entropy_in = jnp.zeros_like(logp) if entropy is None else masked(entropy)
  terms = objective(masked(logp), entropy_in, *token_args)
  return jnp.sum(jnp.where(row_mask, terms, 0)), (logp, entropy)
