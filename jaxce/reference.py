"""Plain, unchunked reference implementations: the yardstick every test checks against.

Same meaning as the public jaxce functions, written with ``jax.nn.log_softmax`` and
autodiff. They materialize ``[T, V]`` float32 (or float64) arrays; use them for tests,
not for training. Each call runs one jitted program (compiled once per shape and option),
not one small program per operation.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from jaxce import keep as _keep

__all__ = ["logprobs_and_entropy", "linear_logprobs_and_entropy"]


def logprobs_and_entropy(logits, labels, *, temperature=1.0, where=None, vocab_size=None,
                         return_entropy=True, keep=None):
  """``(logp, entropy)`` of ``labels.shape`` in float32 (float64 for float64 logits).

  Takes the options that change the numbers, no others (no chunking, no sharding).
  ``keep``: the packed kept sets or kept ids (``jaxce.keep``); the dropped logits become
  ``-inf``, except each token's label column.

  Example:
    >>> import jax.numpy as jnp
    >>> from jaxce import reference
    >>> logits = jnp.log(jnp.array([[0.5, 0.25, 0.25, 1.0]]))  # [T=1, V=4]: a padded column
    >>> logp, ent = reference.logprobs_and_entropy(logits, jnp.array([0]), vocab_size=3)
    >>> print(logp, ent)                                 # the padding is out of the softmax
    [-0.6931] [1.0397]
    >>> print(reference.logprobs_and_entropy(logits, jnp.array([3]), vocab_size=3)[0])
    [nan]
  """
  return _logprobs_and_entropy(logits, labels, temperature, where, vocab_size, keep,
                               return_entropy=return_entropy)


@functools.partial(jax.jit, static_argnames="return_entropy")
def _logprobs_and_entropy(logits, labels, temperature, where, vocab_size, keep, *,
                          return_entropy):
  """:func:`logprobs_and_entropy`'s computation (``return_entropy`` static, the rest traced)."""
  dtype = jnp.promote_types(logits.dtype, jnp.float32)
  t = lax.stop_gradient(jnp.broadcast_to(jnp.asarray(temperature, dtype), labels.shape))
  z = logits.astype(dtype) / t[..., None]
  num_columns = logits.shape[-1]
  vocab_size = num_columns if vocab_size is None else vocab_size
  z = jnp.where(jnp.arange(num_columns) < vocab_size, z, -jnp.inf)
  if isinstance(keep, _keep.KeptIds):
    keep = _keep.pack_ids(keep, num_columns, shape=labels.shape)
  if keep is not None:
    kept = _keep.unpack(keep, num_columns) | (jnp.arange(num_columns) == labels[..., None])
    z = jnp.where(kept, z, -jnp.inf)
  log_p = jax.nn.log_softmax(z, axis=-1)
  logp = jnp.take_along_axis(log_p, jnp.clip(labels, 0, num_columns - 1)[..., None], -1)[..., 0]
  valid = labels >= 0
  if where is not None:
    valid = valid & jnp.broadcast_to(where, labels.shape)
  logp = jnp.where(labels >= vocab_size, jnp.nan, logp)
  logp = jnp.where(valid, logp, 0)
  if not return_entropy:
    return logp, None
  p = jnp.exp(log_p)
  entropy = -jnp.sum(p * jnp.where(p > 0, log_p, 0), axis=-1)
  return logp, jnp.where(valid, entropy, 0)


def linear_logprobs_and_entropy(hidden, weight, labels, *, bias=None, logit_softcap=None,
                                temperature=1.0, where=None, vocab_size=None,
                                return_entropy=True, weight_layout="dv", keep=None):
  """The fused path's meaning: ``logits = softcap(hidden @ weight + bias)``, then as above.

  ``weight`` is ``[D, V]``, or ``[V, D]`` with ``weight_layout="vd"``. The matmul takes the
  inputs' common dtype with float32 accumulation (float64 for float64 inputs), like the
  real function.

  Example:
    >>> import jax.numpy as jnp
    >>> import jaxce
    >>> from jaxce import reference
    >>> hidden = jnp.eye(2)                                # [T=2, D=2]
    >>> weight = jnp.log(jnp.array([[0.5, 0.25, 0.25], [0.1, 0.2, 0.7]]))  # [D=2, V=3]
    >>> labels = jnp.array([0, 2])
    >>> logp, ent = reference.linear_logprobs_and_entropy(hidden, weight, labels,
    ...                                                   logit_softcap=1.0)
    >>> print(logp)
    [-0.9195 -0.7361 ]
    >>> fused, _ = jaxce.linear_logprobs_and_entropy(hidden, weight, labels, logit_softcap=1.0)
    >>> bool(jnp.allclose(fused, logp, atol=1e-6))        # the fused path means the same
    True
  """
  if weight_layout not in ("dv", "vd"):
    raise ValueError(f'weight_layout must be "dv" or "vd", got {weight_layout=!r}')
  return _linear_logprobs_and_entropy(hidden, weight, labels, bias, logit_softcap,
                                      temperature, where, vocab_size, keep,
                                      return_entropy=return_entropy,
                                      weight_layout=weight_layout)


@functools.partial(jax.jit, static_argnames=("return_entropy", "weight_layout"))
def _linear_logprobs_and_entropy(hidden, weight, labels, bias, logit_softcap, temperature,
                                 where, vocab_size, keep, *, return_entropy, weight_layout):
  """:func:`linear_logprobs_and_entropy`'s computation (the layout and ``return_entropy``
  static, the rest traced)."""
  if weight_layout == "vd":
    weight = weight.T
  dtype = jnp.promote_types(jnp.promote_types(hidden.dtype, weight.dtype), jnp.float32)
  logits = jnp.matmul(hidden, weight, preferred_element_type=dtype)
  if bias is not None:
    logits = logits + bias.astype(dtype)
  if logit_softcap is not None:
    logits = logit_softcap * jnp.tanh(logits / logit_softcap)
  return logprobs_and_entropy(logits, labels, temperature=temperature, where=where,
                              vocab_size=vocab_size, return_entropy=return_entropy, keep=keep)
