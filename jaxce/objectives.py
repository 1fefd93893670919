"""Built-in per-token RL objectives for :func:`jaxce.token_loss` and
:func:`jaxce.linear_token_loss`, and the per-token weights of the usual normalizations.

Each factory returns ``objective(logp, entropy, *token_args) -> terms`` (elementwise), to
be minimized; normalizations enter as a per-token ``weight`` (``token_weights``), so the
loss is ``sum(weight * term)`` over kept tokens. ``r = exp(logp - old_logp)`` is the
importance ratio, ``A`` the advantage.

    objective = jaxce.objectives.grpo(epsilon_low=0.2, epsilon_high=0.28, beta=0.04)
    weight = jaxce.objectives.token_weights(mask, "sequence_mean_token_mean")
    loss, (logp, ent) = jaxce.linear_token_loss(
        objective, hidden, kernel, labels, advantages, old_logp, ref_logp, weight, where=mask)
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

__all__ = ["clipped_surrogate", "cispo", "kl", "grpo", "token_weights"]


def clipped_surrogate(epsilon_low=0.2, epsilon_high=None, dual_clip=None):
  """PPO's clipped surrogate, ``-min(r A, clip(r, 1 - epsilon_low, 1 + epsilon_high) A)``.

  ``epsilon_high=None`` is symmetric (PPO); a larger one is DAPO's clip-higher (the form
  of TRL's GRPOTrainer with ``epsilon_high``, and Liger's ``clip_coef_fn``). ``dual_clip=c``
  (c > 1) bounds the term of a negative advantage by ``-c A`` (dual-clip PPO, Ye et al.
  2020). Token args: ``(advantages, old_logp)``.

  Example:
    >>> import jax.numpy as jnp
    >>> from jaxce import objectives
    >>> logp = jnp.log(jnp.array([0.5, 0.5, 0.5]))
    >>> old_logp = jnp.log(jnp.array([0.25, 0.5, 0.25]))  # ratios r = 2, 1, 2
    >>> advantages = jnp.array([1.0, 1.0, -1.0])
    >>> ppo = objectives.clipped_surrogate(epsilon_low=0.2)
    >>> print(ppo(logp, None, advantages, old_logp))     # r clipped to 1.2 where A > 0
    [-1.2 -1.   2. ]
    >>> dual = objectives.clipped_surrogate(epsilon_low=0.2, dual_clip=1.5)
    >>> print(dual(logp, None, advantages, old_logp))    # where A < 0, at most -1.5 A
    [-1.2 -1.   1.5]
  """
  high = epsilon_low if epsilon_high is None else epsilon_high

  def term(logp, entropy, advantages, old_logp):
    del entropy
    ratio = jnp.exp(logp - old_logp)
    clipped = jnp.clip(ratio, 1 - epsilon_low, 1 + high)
    surrogate = jnp.minimum(ratio * advantages, clipped * advantages)
    if dual_clip is not None:
      surrogate = jnp.where(advantages < 0, jnp.maximum(surrogate, dual_clip * advantages),
                            surrogate)
    return -surrogate
  return term


def cispo(epsilon_high=0.28):
  """CISPO (MiniMax-M1): the importance weight is clipped and carries no gradient,
  ``-stop_gradient(min(r, 1 + epsilon_high)) A logp``. Token args: ``(advantages,
  old_logp)``.

  Example:
    >>> import jax.numpy as jnp
    >>> from jaxce import objectives
    >>> logp = jnp.log(jnp.array([0.5, 0.5]))
    >>> old_logp = jnp.log(jnp.array([0.25, 0.5]))       # r = 2 (weighted 1.28), 1
    >>> term = objectives.cispo(epsilon_high=0.28)
    >>> print(term(logp, None, jnp.array([1.0, 1.0]), old_logp))  # -w A logp
    [0.8872 0.6931 ]
  """
  def term(logp, entropy, advantages, old_logp):
    del entropy
    weight = lax.stop_gradient(jnp.minimum(jnp.exp(logp - old_logp), 1 + epsilon_high))
    return -weight * advantages * logp
  return term


def kl(estimator="k3"):
  """A per-token estimate of KL(policy || reference) from ``d = ref_logp - logp``
  (Schulman, "Approximating KL divergence"): ``"k1"`` ``-d``; ``"k2"`` ``d² / 2``;
  ``"k3"`` ``exp(d) - d - 1`` (the one TRL's GRPOTrainer, Liger's GRPO loss and Tunix's
  GRPO learner use). Token args: ``(ref_logp,)``.

  Example:
    >>> import jax.numpy as jnp
    >>> from jaxce import objectives
    >>> logp = jnp.log(jnp.array([0.5, 0.25]))
    >>> ref_logp = jnp.log(jnp.array([0.25, 0.25]))     # d = -log 2, 0
    >>> print(objectives.kl("k3")(logp, None, ref_logp))  # exp(d) - d - 1
    [0.1931 0.    ]
    >>> print(objectives.kl("k1")(logp, None, ref_logp))  # -d
    [ 0.6931 -0.    ]
  """
  forms = {"k1": lambda d: -d, "k2": lambda d: 0.5 * jnp.square(d),
           "k3": lambda d: jnp.exp(d) - d - 1}
  if estimator not in forms:
    raise ValueError(f'estimator must be "k1", "k2" or "k3", got {estimator=!r}')

  def term(logp, entropy, ref_logp):
    del entropy
    return forms[estimator](ref_logp - logp)
  return term


def grpo(epsilon_low=0.2, epsilon_high=None, beta=0.04, kl_estimator="k3",
         entropy_coef=0.0, dual_clip=None, surrogate="clip"):
  """GRPO / DAPO's per-token objective, ``weight * (surrogate + beta KL - entropy_coef H)``.

  Args:
    epsilon_low, epsilon_high, dual_clip: the clipped surrogate's (``surrogate="clip"``);
      with ``surrogate="cispo"`` only ``epsilon_high`` (default 0.28 there).
    beta: weight of the KL penalty (``kl_estimator`` of :func:`kl`; 0 drops it).
    entropy_coef: weight of the entropy bonus (0: the entropy is not computed).
    surrogate: ``"clip"`` (:func:`clipped_surrogate`) or ``"cispo"`` (:func:`cispo`).

  Token args: ``(advantages, old_logp, ref_logp, weight)``; ``weight`` carries the
  normalization (:func:`token_weights`). Matches TRL's GRPOTrainer per-token loss
  (``-min(coef_1 A, coef_2 A) + beta * per_token_kl``) with its ``loss_type`` folded
  into ``weight``.

  Example:
    >>> import jax.numpy as jnp
    >>> from jaxce import objectives
    >>> objective = objectives.grpo(epsilon_low=0.2, epsilon_high=0.28, beta=0.04,
    ...                             entropy_coef=0.01)
    >>> logp = jnp.log(jnp.array([0.5, 0.5]))
    >>> old_logp = ref_logp = jnp.log(jnp.array([0.25, 0.5]))  # r = 2 (clipped to 1.28), 1
    >>> entropy, advantages = jnp.array([1.0, 2.0]), jnp.array([1.0, -1.0])
    >>> weight = jnp.array([0.5, 0.5])                  # objectives.token_weights
    >>> print(objective(logp, entropy, advantages, old_logp, ref_logp, weight))
    [-0.6411  0.49  ]

    The loss and its gradient, formed in the forward pass:
    ``jaxce.linear_token_loss(objective, hidden, kernel, labels, advantages, old_logp,
    ref_logp, weight, where=mask)``.
  """
  if surrogate not in ("clip", "cispo"):
    raise ValueError(f'surrogate must be "clip" or "cispo", got {surrogate=!r}')
  policy = (clipped_surrogate(epsilon_low, epsilon_high, dual_clip) if surrogate == "clip"
            else cispo(0.28 if epsilon_high is None else epsilon_high))
  penalty = kl(kl_estimator)

  def term(logp, entropy, advantages, old_logp, ref_logp, weight):
    value = policy(logp, entropy, advantages, old_logp)
    if beta:
      value = value + beta * penalty(logp, entropy, ref_logp)
    if entropy_coef:
      value = value - entropy_coef * entropy
    return weight * value
  return term


def token_weights(mask, mode="sequence_mean_token_mean", max_length=None):
  """Per-token weights that turn ``sum(weight * term)`` into a normalized loss.

  Args:
    mask: ``[B, S]`` bool or 0/1, the tokens that count (completion tokens).
    mode: ``"token_mean"`` (every kept token of the batch alike: TRL's ``bnpo`` / DAPO),
      ``"sequence_mean_token_mean"`` (the mean over sequences of each one's token mean:
      TRL's ``grpo``), or ``"constant"`` (divided by ``B * max_length``: Dr. GRPO, TRL's
      ``dr_grpo``).
    max_length: the constant's length (``"constant"`` only; default ``S``).

  Returns:
    float32 ``[B, S]``, 0 where ``mask`` is False.

  Example:
    >>> import jax.numpy as jnp
    >>> from jaxce import objectives
    >>> mask = jnp.array([[1, 1, 0], [1, 0, 0]], bool)
    >>> print(objectives.token_weights(mask, "sequence_mean_token_mean"))
    [[0.25 0.25 0.  ]
     [0.5  0.   0.  ]]
    >>> print(objectives.token_weights(mask, "token_mean"))
    [[0.3333 0.3333 0.    ]
     [0.3333 0.     0.    ]]
  """
  mask = jnp.asarray(mask).astype(jnp.float32)
  if mode == "token_mean":
    return mask / jnp.maximum(jnp.sum(mask), 1.0)
  if mode == "sequence_mean_token_mean":
    lengths = jnp.maximum(jnp.sum(mask, axis=-1, keepdims=True), 1.0)
    return mask / lengths / mask.shape[0]
  if mode == "constant":
    return mask / (mask.shape[0] * (mask.shape[-1] if max_length is None else max_length))
  raise ValueError('mode must be "token_mean", "sequence_mean_token_mean" or "constant", got '
                   f"{mode=!r}")
