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


def terms_and_cotangents(objective, logp, entropy, token_args, keep, with_grads):
  """The chunk's loss (sum of the kept tokens' terms) and, with ``with_grads``, the
  per-token cotangents ``(g_logp, g_entropy)`` (``g_entropy`` None without entropy),
  exactly 0 at tokens not kept."""
  entropy_in = jnp.zeros_like(logp) if entropy is None else entropy
  terms, vjp = jax.vjp(lambda lp, h: objective(lp, h, *token_args), logp, entropy_in)
  weight = keep.astype(terms.dtype)
  loss = jnp.sum(jnp.where(keep, terms, 0))
  if not with_grads:
    return loss, None, None
  g_logp, g_entropy = vjp(weight)
  g_logp = jnp.where(keep, g_logp, 0).astype(logp.dtype)
  g_entropy = None if entropy is None else jnp.where(keep, g_entropy, 0).astype(logp.dtype)
  return loss, g_logp, g_entropy
