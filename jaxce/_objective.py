"""What the objective kernels share: checking a per-token objective, a chunk's softmax
statistics, and the chunk's loss terms with their per-token cotangents.

An objective maps ``(logp, entropy, *token_args)``, each ``[C]`` for a chunk of C tokens,
to ``[C]`` per-token terms; the loss is their sum over kept tokens. Because each term
depends only on its own token, a chunk's cotangents ``d loss / d logp`` and
``d loss / d entropy`` are known as soon as the chunk's statistics are: the kernels form
the logits' gradient while the chunk's rows are still at hand.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxce import _logits, _math

# Primitives that combine several tokens: an objective using one of them is not a sum of
# per-token terms (a mean over the batch, a sequence's sum, a sort...).
_ACROSS_TOKENS = frozenset({
    "reduce_sum", "reduce_max", "reduce_min", "reduce_prod", "reduce_and", "reduce_or",
    "reduce_xor", "argmax", "argmin", "cumsum", "cumprod", "cummax", "cummin",
    "cumlogsumexp", "sort", "dot_general", "conv_general_dilated", "reduce_precision_sum",
    "psum", "pmax", "pmin", "all_gather", "all_to_all", "top_k", "scatter-add", "scatter_add",
})


def _primitives(jaxpr):
  """Every primitive name in ``jaxpr`` and the jaxprs nested in its equations."""
  for eqn in jaxpr.eqns:
    yield eqn.primitive.name
    for param in eqn.params.values():
      for sub in (param if isinstance(param, (tuple, list)) else (param,)):
        inner = getattr(sub, "jaxpr", sub)
        if hasattr(inner, "eqns"):
          yield from _primitives(inner)


def check_objective(objective, num_tokens, token_args, dtype) -> bool:
  """Trace ``objective`` on ``[num_tokens]`` inputs; return whether it uses the entropy.

  Raises:
    TypeError: it is not callable, or does not return one ``[num_tokens]`` float array.
    ValueError: it combines tokens (a reduction, cumulative op, sort or matmul over its
      inputs): not a sum of per-token terms.
  """
  if not callable(objective):
    raise TypeError(f"objective must be a function (logp, entropy, *token_args) -> per-token "
                    f"terms, got {type(objective).__name__}")
  shape = jax.ShapeDtypeStruct((num_tokens,), dtype)
  args = [jax.ShapeDtypeStruct((num_tokens,), a.dtype) for a in token_args]
  closed = jax.make_jaxpr(objective)(shape, shape, *args)
  out = closed.out_avals
  if len(out) != 1 or out[0].shape != (num_tokens,) or not jnp.issubdtype(out[0].dtype,
                                                                          jnp.floating):
    raise TypeError(
        "objective must return one float array of per-token terms with the shape of its "
        f"inputs ({num_tokens},), got {[(a.shape, str(a.dtype)) for a in out]}")
  across = sorted(set(_primitives(closed.jaxpr)) & _ACROSS_TOKENS)
  if across:
    raise ValueError(
        f"objective combines tokens ({', '.join(across)}): token_loss needs a sum of "
        "per-token terms. Pass per-token weights (e.g. jaxce.objectives.token_weights) for "
        "normalizations; for sequence-level objectives (GSPO's sequence ratio) use "
        "linear_logprobs_and_entropy / logprobs_and_entropy with autodiff")
  entropy_var = closed.jaxpr.invars[1]
  reads = [v for eqn in closed.jaxpr.eqns for v in eqn.invars] + list(closed.jaxpr.outvars)
  return any(v is entropy_var for v in reads)


def statistics(x, labels, inv_temp, valid, column_start, vocab_size, mask_vocab, vocab_axis,
               with_entropy, pallas):
  """A chunk's ``(logp, m, log s, entropy or None)`` over this shard's ``[C, V_local]``
  rows ``x`` (``_math.chunk_statistics``; with ``pallas`` the row statistics are the
  one-pass kernel's)."""
  statistics_of = _logits.pallas_statistics if pallas else _math.chunk_statistics
  return statistics_of(x, labels, inv_temp, valid, column_start, vocab_size, mask_vocab,
                       vocab_axis, with_entropy)


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
