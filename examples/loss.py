"""The GRPO objective, with per-token log-probs and entropies from jaxce or from plain JAX.

Only :func:`token_logprobs` differs between the paths; the objective around it is shared,
so the paths can be compared number for number:

* ``"objective"`` (default): the whole GRPO loss through ``jaxce.linear_token_loss`` with
  ``jaxce.objectives.grpo``: its gradient is formed in the forward pass (three matmuls of
  the LM head, not four), and the logits never exist.
* ``"linear"``: ``jaxce.linear_logprobs_and_entropy(hidden, lm_head_kernel, labels)``,
  then the objective below with autodiff; the ``[B, S, V]`` logits never exist.
* ``"logits"``: the model's logits, then ``jaxce.logprobs_and_entropy`` (chunked, bounded
  working set; the gradient is one array like the logits).
* ``"plain"``: the logits, then ``jax.nn.log_softmax`` in float32 and autodiff: several
  ``[B, S, V]`` float32 arrays alive in the backward. What a user has before jaxce.

With a ``mesh`` (axes ``"data"`` and ``"vocab"``), arrays are global and sharded: the batch
over ``data``, the LM head kernel's columns over ``vocab``; the jaxce paths run inside
``shard_map`` through ``jaxce.sharded_*``, the plain path is left to the compiler. With
``GRPOConfig.sequence_parallel`` the batch is split over both axes instead, as sequence
parallelism leaves it (the model body runs each device's own tokens): the jaxce fused paths
take that layout as it is (``batch_axis=("data", "vocab")``), the logits and plain paths
gather the hidden states over ``vocab`` before the LM head, as Megatron's output layer does.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

import jaxce
from examples.model import lm_head_kernel

PATHS = ("objective", "linear", "logits", "plain")
DATA, VOCAB = "data", "vocab"  # mesh axis names
# path -> (one device or per-device under pmap, global arrays over a mesh via shard_map)
_JAXCE = {
    "linear": (jaxce.linear_logprobs_and_entropy, jaxce.sharded_linear_logprobs_and_entropy),
    "logits": (jaxce.logprobs_and_entropy, jaxce.sharded_logprobs_and_entropy),
}


class Batch(NamedTuple):
  """One batch of rollouts, ``B`` sequences of ``S`` tokens: prompt, completion, padding.

  Attributes:
    tokens: int32 ``[B, S]``.
    mask: bool ``[B, S-1]``: True where the label ``tokens[:, t+1]`` is a completion token
      (not prompt, not padding); the loss and its gradient see only these positions.
    advantages: float32 ``[B]``, group-normalized rewards.
    old_logp: float32 ``[B, S-1]``, log-probs under the policy that sampled the batch.
    ref_logp: float32 ``[B, S-1]``, log-probs under the frozen reference policy.
  """
  tokens: jax.Array
  mask: jax.Array
  advantages: jax.Array
  old_logp: jax.Array
  ref_logp: jax.Array


@dataclasses.dataclass(frozen=True)
class GRPOConfig:
  """Static options of the GRPO loss (hashable: a change recompiles).

  Attributes:
    path: one of :data:`PATHS`.
    temperature: the sampler's temperature; log-probs are those of ``softmax(logits / T)``.
    clip_eps: PPO ratio clip, ``[1 - eps, 1 + eps]``.
    kl_coef: weight of the k3 KL estimate to the reference policy.
    entropy_coef: weight of the entropy bonus. 0 leaves the term out of the graph.
    log_entropy: compute the entropy as a metric even when ``entropy_coef == 0``. It is
      free in the backward: jaxce's backward skips the entropy work when the entropy
      gets no gradient (a symbolic-zero cotangent).
    sequence_parallel: on a mesh, the batch is split over ``data`` and ``vocab`` together
      (each device runs the model body on its own sequences), not over ``data`` alone (the
      body repeated on every ``vocab`` device); the batch must divide over all devices.
  """
  path: str = "objective"
  temperature: float = 1.0
  clip_eps: float = 0.2
  kl_coef: float = 0.04
  entropy_coef: float = 0.0
  log_entropy: bool = True
  sequence_parallel: bool = False


def plain_logprobs_and_entropy(logits, labels, *, temperature, where, return_entropy=True):
  """The usual JAX code: ``log_softmax`` over float32 logits, autodiff for the gradient.

  ``logits [..., V]``, ``labels`` int ``[...]``, ``where`` bool ``[...]``. Returns float32
  ``(logp, entropy)`` of ``labels.shape`` (float64 for float64 logits), 0 where ``~where``.
  Memory: the float32 copy of the logits, the log-softmax and the softmax, ``[..., V]``
  each, plus their gradients.
  """
  dtype = jnp.promote_types(logits.dtype, jnp.float32)
  log_p = jax.nn.log_softmax(logits.astype(dtype) / temperature, axis=-1)
  logp = jnp.where(where, jnp.take_along_axis(log_p, labels[..., None], -1)[..., 0], 0)
  if not return_entropy:
    return logp, None
  return logp, jnp.where(where, -jnp.sum(jnp.exp(log_p) * log_p, axis=-1), 0)


def token_axes(mesh, sequence_parallel: bool = False):
  """The mesh axes the batch's rows are split over: ``"data"``, or with
  ``sequence_parallel`` ``("data", "vocab")`` (the vocab axis last, as jaxce's token-split
  layout takes it); None without a mesh."""
  if mesh is None:
    return None
  return (DATA, VOCAB) if sequence_parallel else DATA


def token_logprobs(model, tokens, mask, *, path="linear", temperature=1.0, return_entropy=True,
                   mesh=None, sequence_parallel=False):
  """Log-prob of every next token, and the entropy of the distribution it was drawn from.

  Args:
    model: a :class:`examples.model.CausalLM`.
    tokens: int ``[B, S]``; position ``t`` predicts ``tokens[:, t+1]``.
    mask: bool ``[B, S-1]``, the positions to score (others return 0, with zero gradient).
    path: one of :data:`PATHS` (``"objective"`` scores as ``"linear"``).
    temperature: the sampler's temperature (float or array broadcastable to ``[B, S-1]``).
    return_entropy: False skips the entropy (forward and backward).
    mesh: a ``jax.sharding.Mesh`` with axes ``("data", "vocab")`` for global sharded arrays,
      or None on one device (and under ``pmap``, where each device holds its batch shard).
    sequence_parallel: with ``mesh``, the rows are split over both axes
      (:func:`token_axes`).

  Returns:
    ``(logp, entropy)`` float32 ``[B, S-1]`` (``entropy`` None without ``return_entropy``).
  """
  hidden = model.hidden_states(tokens[:, :-1])
  labels = tokens[:, 1:]
  kw = dict(temperature=temperature, where=mask, return_entropy=return_entropy)
  rows = token_axes(mesh, sequence_parallel)
  sharding = {} if mesh is None else dict(mesh=mesh, vocab_axis=VOCAB, batch_axis=rows)
  if path in ("linear", "objective"):  # the objective path scores with the fused head too
    fused = _JAXCE["linear"][mesh is not None]
    return fused(hidden, lm_head_kernel(model), labels, **sharding, **kw)
  if mesh is not None and sequence_parallel:  # gather the rows over vocab for the logits
    hidden = jax.lax.with_sharding_constraint(hidden, NamedSharding(mesh, P(DATA)))
    labels, mask = (jax.lax.with_sharding_constraint(x, NamedSharding(mesh, P(DATA)))
                    for x in (labels, mask))
    kw["where"], sharding["batch_axis"] = mask, DATA
  logits = model.lm_head(hidden)  # [B, S-1, V]: the array the fused path never builds
  if mesh is not None and sequence_parallel:  # (and its gradient: rows over data alone)
    logits = jax.lax.with_sharding_constraint(logits, NamedSharding(mesh, P(DATA, None, VOCAB)))
  if path == "logits":
    return _JAXCE[path][mesh is not None](logits, labels, **sharding, **kw)
  if path == "plain":  # with a mesh, the compiler partitions it
    return plain_logprobs_and_entropy(logits, labels, **kw)
  raise ValueError(f"path must be one of {PATHS}, got {path=!r}")


def policy_logprobs(params, tokens, mask, *, graphdef, cfg: GRPOConfig, mesh=None):
  """No-gradient log-probs ``[B, S-1]`` (old policy, reference policy): no entropy work."""
  model = nnx.merge(graphdef, params)
  logp, _ = token_logprobs(model, tokens, mask, path=cfg.path, temperature=cfg.temperature,
                           return_entropy=False, mesh=mesh,
                           sequence_parallel=cfg.sequence_parallel)
  return jax.lax.stop_gradient(logp)


def masked_mean(x, mask):
  """GRPO's average: mean over a sequence's masked tokens, then over sequences.

  ``x``, ``mask`` ``[B, S-1]`` -> scalar. A data-parallel mean of equal batch shards of
  this equals it on the whole batch.
  """
  per_sequence = jnp.sum(jnp.where(mask, x, 0), axis=-1)
  return jnp.mean(per_sequence / jnp.maximum(jnp.sum(mask, axis=-1), 1))


def grpo_loss(params, graphdef, batch: Batch, cfg: GRPOConfig, mesh=None):
  """Clipped-ratio policy loss + ``kl_coef`` * KL(policy || reference) - ``entropy_coef`` * H.

  Args:
    params: the policy's ``nnx.Param`` state (differentiated).
    graphdef: its ``nnx`` graph definition.
    batch: a :class:`Batch`.
    cfg: a :class:`GRPOConfig`.
    mesh: see :func:`token_logprobs`.

  Returns:
    ``(loss, metrics)``: a scalar and a dict of scalars (not differentiated).
  """
  model = nnx.merge(graphdef, params)
  if cfg.path == "objective":
    return _objective_loss(model, batch, cfg, mesh)
  # Python-side gate on a static coefficient: at 0 the entropy is either not computed
  # (log_entropy=False) or only logged; never ``0.0 * entropy`` in the loss, which is not a
  # symbolic zero and would run the entropy backward for nothing.
  with_entropy = cfg.entropy_coef != 0 or cfg.log_entropy
  logp, entropy = token_logprobs(model, batch.tokens, batch.mask, path=cfg.path,
                                 temperature=cfg.temperature, return_entropy=with_entropy,
                                 mesh=mesh, sequence_parallel=cfg.sequence_parallel)
  adv = batch.advantages[:, None]
  ratio = jnp.exp(logp - batch.old_logp)
  clipped = jnp.clip(ratio, 1 - cfg.clip_eps, 1 + cfg.clip_eps)
  per_token = -jnp.minimum(ratio * adv, clipped * adv)
  log_ref_ratio = batch.ref_logp - logp
  kl = jnp.exp(log_ref_ratio) - log_ref_ratio - 1  # k3 estimator: >= 0, unbiased
  per_token = per_token + cfg.kl_coef * kl
  if cfg.entropy_coef != 0:
    per_token = per_token - cfg.entropy_coef * entropy
  loss = masked_mean(per_token, batch.mask)
  metrics = dict(loss=loss, kl=masked_mean(kl, batch.mask),
                 clip_fraction=masked_mean((clipped != ratio).astype(jnp.float32), batch.mask))
  if entropy is not None:
    metrics["entropy"] = masked_mean(entropy, batch.mask)
  return loss, jax.lax.stop_gradient(metrics)


def _objective_loss(model, batch: Batch, cfg: GRPOConfig, mesh):
  """:func:`grpo_loss` as one ``jaxce.linear_token_loss`` call: the same objective, with
  ``masked_mean`` as per-token weights (sequence-mean-token-mean)."""
  labels, mask = batch.tokens[:, 1:], batch.mask
  objective = jaxce.objectives.grpo(cfg.clip_eps, beta=cfg.kl_coef,
                                    entropy_coef=cfg.entropy_coef)
  token_args = (jnp.broadcast_to(batch.advantages[:, None], mask.shape), batch.old_logp,
                batch.ref_logp, jaxce.objectives.token_weights(mask, "sequence_mean_token_mean"))
  sharding = {} if mesh is None else dict(mesh=mesh, vocab_axis=VOCAB,
                                          batch_axis=token_axes(mesh, cfg.sequence_parallel))
  fn = jaxce.sharded_linear_token_loss if mesh is not None else jaxce.linear_token_loss
  loss, (logp, entropy) = fn(
      objective, model.hidden_states(batch.tokens[:, :-1]), lm_head_kernel(model), labels,
      *token_args, temperature=cfg.temperature, where=mask,
      return_entropy=True if cfg.log_entropy else None, **sharding)
  ratio = jnp.exp(logp - batch.old_logp)  # metrics from the returned (logp, entropy)
  clipped = jnp.clip(ratio, 1 - cfg.clip_eps, 1 + cfg.clip_eps)
  log_ref_ratio = batch.ref_logp - logp
  metrics = dict(loss=loss, kl=masked_mean(jnp.exp(log_ref_ratio) - log_ref_ratio - 1, mask),
                 clip_fraction=masked_mean((clipped != ratio).astype(jnp.float32), mask))
  if entropy is not None:
    metrics["entropy"] = masked_mean(entropy, mask)
  return loss, jax.lax.stop_gradient(metrics)


def group_advantages(rewards, group_size: int, eps: float = 1e-4):
  """GRPO advantages: rewards ``[G * n]`` normalized within each group of ``n`` samples of
  one prompt (consecutive rows) -> float32 ``[G * n]``."""
  r = jnp.asarray(rewards, jnp.float32).reshape(-1, group_size)
  return ((r - r.mean(-1, keepdims=True)) / (r.std(-1, keepdims=True) + eps)).reshape(-1)


def completion_mask(prompt_lengths, completion_lengths, seq_len: int):
  """bool ``[B, seq_len - 1]``: label position ``t`` (token ``t+1``) is in the completion.

  Sequences are laid out ``[prompt | completion | padding]``; ``prompt_lengths`` and
  ``completion_lengths`` are int ``[B]``.
  """
  t = jnp.arange(1, seq_len)[None, :]
  start = jnp.asarray(prompt_lengths)[:, None]
  return (t >= start) & (t < start + jnp.asarray(completion_lengths)[:, None])
