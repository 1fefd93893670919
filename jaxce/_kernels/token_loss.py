"""The logits path's objective kernel: ``sum objective(logp, entropy, *token_args)`` of
``softmax(logits)`` and, under differentiation, its gradient, formed in the forward pass.

The logits rows' forward statistics (``logits_rows.forward``: one Mosaic or Triton pass,
or XLA's chunked scan; shards combine them with one pmax + one psum), the objective's
per-token terms and cotangents (O(T)), then, when differentiating, ``d logits`` in one
elementwise pass (``logits_rows.gradient``): two passes over the logits (read; read +
write). The custom_vjp's backward only scales the stored gradient by the loss's
cotangent.
"""

from __future__ import annotations

import jax

from jaxce._kernels import logits_rows, loss_terms, plumbing, softmax
from jaxce._kernels.config import Config, Tokens


def token_loss(objective, x, tokens: Tokens, token_args, config: Config):
  """``x [T, V_local]``, its ``tokens`` and ``token_args`` (each ``[T]``) -> ``(loss,
  (logp [T], entropy [T] or None))``; the loss (this device's tokens) is differentiable
  in ``x``."""
  return _jitted(objective, x, tokens, tuple(token_args), config=config)


@plumbing.custom_vjp("objective", "config")
def _token_loss(objective, x, tokens, token_args, config):
  return _run(objective, x, tokens, token_args, config, with_grads=False)[0]


def _run(objective, x, tokens, token_args, config, with_grads):
  """``((loss, (logp, entropy)), (d x, type witness) or None)``: the gradient of this
  device's loss, not yet summed over shard_map axes."""
  outputs, saved = logits_rows.forward(x, tokens, config)
  logp = outputs[0]
  entropy = outputs[1] if config.with_entropy else None
  loss, g_logp, g_entropy = loss_terms.terms_and_cotangents(objective, logp, entropy,
                                                            token_args, tokens.valid, with_grads)
  out = (loss, (logp, entropy))
  if not with_grads:
    return out, None
  grad = logits_rows.gradient(x, tokens, saved, (g_logp, g_entropy), config.plan.mask_vocab,
                              softmax.shard_column_start(x.shape[1], config.vocab_axis),
                              config)
  # A zero-size slice carries x's type over shard_map axes to the backward, which sums
  # the scaled gradient over the axes x does not vary over.
  return out, (grad, x.reshape(-1)[:0])


def _fwd(objective, x, tokens, token_args, config):
  return _run(objective, x, tokens, token_args, config, with_grads=True)


def _bwd(objective, config, residuals, cotangents):
  del objective, config
  grad, witness = residuals
  scale = cotangents[0]  # the outputs (logp, entropy) are for metrics: no gradient
  return (plumbing.reduce_to_varying(grad * scale.astype(grad.dtype), witness), None, None)


_token_loss.defvjp(_fwd, _bwd)
_jitted = jax.jit(_token_loss, static_argnames=("objective", "config"))
