"""jaxce behind Tunix's GRPO and PPO policy losses (``google-tunix`` 0.1.7).

Tunix's losses take per-token log-probs from ``tunix.rl.common.compute_per_token_logps``,
which runs the policy's full forward: ``[B, L, V]`` logits in float32, then
``log_softmax`` over them (and the entropy from the same logits). The functions here
compute the same losses and aux metrics from the model's final hidden states and its
LM-head kernel: GRPO (``loss_algo="grpo"``, unpacked) with :func:`jaxce.linear_token_loss`
(its gradient formed in the forward pass, three matmuls), GSPO, packed sequences and PPO
with :func:`jaxce.linear_logprobs_and_entropy`. No ``[B, L, V]`` array, forward or
backward (the model's own logits are computed by nothing that is used, and XLA
removes them under ``jit``; ``tests/test_tunix.py`` checks the compiled plan).

    import jaxce.integrations.tunix as jaxce_tunix     # registers "jaxce_grpo", "jaxce_ppo"
    algo_config = GRPOConfig(...)
    jaxce_tunix.use_jaxce(algo_config)                  # policy_loss_fn = "jaxce_grpo"
    learner = GRPOLearner(rl_cluster, algo_config, reward_fns)

Kept sets (the sampler's top-k / top-p support, e.g. vLLM's sampling masks): give the
example a ``kept`` field (:class:`TrainExampleWithKept`), and every loss here computes the
log-probs and entropies over each token's kept set (``keep=``; docs/guides/kept_sets.md).

What of Tunix this relies on: ``function_registry.register_policy_loss_fn``, the loss
signature ``(model, train_example, algo_config, pad_id, eos_id)``, ``common.process_ids``,
``common.aggregate_loss``, ``common.compute_kl_divergence``, ``algo_core.masked_mean``,
and the model's ``output_hidden_states=True`` (it sows the final-norm output as the
``nnx.Intermediate`` ``all_hidden_states``) with its head at ``lm_head.w`` (``[D, V]``) or,
tied, ``embedder.input_embedding`` (``[V, D]``), and Gemma's ``final_logit_softcap``, as
Tunix's Qwen3, Qwen2, Llama3 and Gemma models have them (tests: Qwen3 and Gemma).
"""

from __future__ import annotations

import inspect
from typing import Any

import flax
import jax
import jax.numpy as jnp
from flax import nnx
from tunix.rl import algo_core, common, function_registry

import jaxce

__all__ = ["GRPO_LOSS", "PPO_LOSS", "TrainExampleWithKept", "grpo_loss", "per_token_logps",
           "ppo_loss", "use_jaxce"]

GRPO_LOSS, PPO_LOSS = "jaxce_grpo", "jaxce_ppo"


@flax.struct.dataclass(frozen=True)
class TrainExampleWithKept(common.TrainExample):
  """Tunix's ``TrainExample`` with the sampler's kept sets of the scored tokens.

  Attributes:
    kept: what ``keep=`` takes, one set per scored token: the completion tokens ``[B,
      L]`` (unpacked), or positions ``1 .. S - 1`` of each row (packed sequences, as
      the labels ``tokens[:, 1:]``). Packed words ``uint32 [B, L, ceil(V / 32)]``
      (``jaxce.keep.pack``, ``jaxce.keep.pack_ids``), or a :class:`jaxce.keep.KeptIds`
      (``jaxce.keep.from_csr`` of vLLM's ``SamplingMask``, tokens in ``[B, L]``'s
      flattened order). Tunix's learner slices every array of an example along the
      batch into mini-batches: there, pass packed words (a ``KeptIds``' CSR arrays do
      not slice by row). ``None``: the full vocabulary.
  """
  kept: Any = None


def per_token_logps(model, train_example, pad_id, eos_id, temperature=1.0):
  """``(logp, entropy)`` ``[B, L]`` float32 of the completion tokens, as
  ``common.compute_per_token_logps(..., return_logits=True)`` and
  ``algo_core.compute_entropy_from_logits`` give them, from the hidden states and the
  head (fused: memory ``d hidden`` and ``d W`` plus jaxce's tiles, no ``[B, L, V]``).

  Args:
    model: a Tunix NNX causal LM (``model(tokens, positions, cache, attention_mask,
      output_hidden_states=True)``; head ``lm_head.w`` or tied ``embedder``).
    train_example: Tunix's ``TrainExample`` (``prompt_ids``, ``completion_ids``, and
      ``segment_ids`` / ``segment_positions`` when packed).
    pad_id, eos_id: the tokenizer's.
    temperature: the rollout temperature (the logits are divided by it, as Tunix does).

  With a ``kept`` field on the example (:class:`TrainExampleWithKept`), each token's
  softmax runs over its kept set.
  """
  hidden, labels, weight, layout, packed = _head_inputs(model, train_example, pad_id, eos_id)
  logp, entropy = jaxce.linear_logprobs_and_entropy(
      hidden, weight, labels, temperature=_temperature(temperature), weight_layout=layout,
      logit_softcap=_softcap(model), keep=_kept(train_example))
  vocab_size = weight.shape[1 if layout == "dv" else 0]
  return _unpack(logp, packed, 0.0), _unpack(entropy, packed, jnp.log(vocab_size))


def _head_inputs(model, train_example, pad_id, eos_id):
  """``(hidden, labels, weight, weight_layout, packed)``: the final hidden states that
  predict each scored token (``[B, L, D]``; both in the head's compute dtype where the
  head casts to one, as Tunix's Qwen and Llama heads do), the tokens, and the head."""
  prompt, completion = train_example.prompt_ids, train_example.completion_ids
  segment_ids = getattr(train_example, "segment_ids", None)
  tokens, positions, attention_mask, input_segment_ids = common.process_ids(
      prompt, completion, pad_id, eos_id, segment_ids,
      getattr(train_example, "segment_positions", None))
  kwargs = {}
  if _takes_segment_ids(model) and (segment_ids is not None or input_segment_ids is not None):
    kwargs["segment_ids"] = segment_ids if segment_ids is not None else input_segment_ids
  graphdef, state = nnx.split(model)
  model = nnx.merge(graphdef, state)  # a copy: the sown hidden states stay out of `model`
  model(tokens, positions, None, attention_mask, output_hidden_states=True, **kwargs)
  (hidden,) = _value(nnx.pop(model, nnx.Intermediate)["all_hidden_states"])
  packed = segment_ids is not None
  if packed:  # every position but the first predicts the next
    hidden, labels = hidden[:, :-1], tokens[:, 1:]
  else:
    hidden, labels = hidden[:, -completion.shape[1] - 1:-1], completion
  weight, layout, dtype = _head(model)
  if dtype is not None:
    hidden, weight = hidden.astype(dtype), weight.astype(dtype)
  return hidden, labels, weight, layout, packed


def _kept(train_example):
  """The example's kept sets (``keep=``), or None."""
  return getattr(train_example, "kept", None)


def _takes_segment_ids(model):
  """Whether the model's ``__call__`` accepts ``segment_ids`` (Tunix passes them only then)."""
  try:
    parameters = inspect.signature(model.__call__).parameters.values()
  except (TypeError, ValueError):
    return False
  return any(p.name == "segment_ids" or p.kind == inspect.Parameter.VAR_KEYWORD
             for p in parameters)


def _unpack(per_token, packed, first):
  """Packed sequences: Tunix pads the first position back (its logits with zeros: a
  log-prob of 0 and a uniform distribution's entropy, ``log V``)."""
  if not packed:
    return per_token
  return jnp.pad(per_token, ((0, 0), (1, 0)), constant_values=first)


def _temperature(temperature):
  return 1.0 if temperature == 0.0 else temperature  # Tunix divides only by others


def _head(model):
  """``(weight, weight_layout, compute dtype or None)`` of the model's LM head: its own
  ``lm_head`` (``[D, V]``), else the tied embedding table (``[V, D]``)."""
  if hasattr(model, "lm_head"):
    return _value(model.lm_head.w), "dv", getattr(model.lm_head, "dtype", None)
  return (_value(model.embedder.input_embedding), "vd",
          getattr(model.embedder, "dtype", None))


def _softcap(model):
  """The model's final-logit softcap (Gemma's), or None."""
  return getattr(model.config, "final_logit_softcap", None)


def _value(variable):
  """An NNX variable's value (``get_value`` from Flax 0.12; ``.value`` before)."""
  return variable.get_value() if hasattr(variable, "get_value") else variable.value


def grpo_loss(model, train_example, algo_config, pad_id, eos_id, **kwargs):
  """Tunix's ``grpo`` policy loss (``algo_core.grpo_loss_fn``: ``loss_algo`` "grpo" or
  "gspo-token", every ``loss_agg_mode``, dual clip ``epsilon_c``, ``sampler_is_weights``,
  the KL penalty ``beta`` with ``kl_loss_mode``) with jaxce's log-probs and entropy.
  Returns ``(loss, aux)`` with Tunix's aux keys.

  ``loss_algo="grpo"`` on unpacked sequences is a sum of per-token terms (every
  ``loss_agg_mode`` is linear in the per-token losses: its weights are the gradient of
  Tunix's own ``aggregate_loss``), so it runs as :func:`jaxce.linear_token_loss`; GSPO's
  sequence ratio couples the tokens and takes the per-token path."""
  del kwargs
  mask = train_example.completion_mask
  mode = algo_config.loss_agg_mode
  aggregate = lambda x: common.aggregate_loss(x, mask, mode)
  mean = lambda x: algo_core.masked_mean(x, mask)
  advantages = train_example.advantages.astype(jnp.float32)
  adv = advantages if advantages.ndim == 2 else advantages[:, None]
  sampler_weights = getattr(train_example, "sampler_is_weights", None)
  has_old = train_example.old_per_token_logps is not None
  old_logp = train_example.old_per_token_logps if has_old else jnp.zeros(mask.shape)
  ref_logp = train_example.ref_per_token_logps
  beta = algo_config.beta if ref_logp is not None else 0.0
  fused = algo_config.loss_algo == "grpo" and getattr(train_example, "segment_ids",
                                                       None) is None
  if fused:  # the gradient formed in the forward pass: three matmuls
    pg_weight = jax.grad(aggregate)(jnp.zeros(mask.shape, jnp.float32))  # linear in x

    def objective(logp, entropy, adv, old_logp, ref_logp, pg_weight, sampler_weight):
      del entropy
      old = old_logp if has_old else jax.lax.stop_gradient(logp)
      value = _surrogate(_log_ratio(logp, old), adv, algo_config)[0] * sampler_weight
      if beta:
        value = value + beta * common.compute_kl_divergence(
            logp, ref_logp, algo_config.kl_loss_mode, clamp_value=algo_config.kl_clamp_value)
      return pg_weight * value

    hidden, labels, weight, layout, _ = _head_inputs(model, train_example, pad_id, eos_id)
    loss, (logp, entropy) = jaxce.linear_token_loss(
        objective, hidden, weight, labels, adv, old_logp.astype(jnp.float32),
        jnp.zeros(mask.shape) if ref_logp is None else ref_logp.astype(jnp.float32),
        pg_weight, 1.0 if sampler_weights is None else sampler_weights.astype(jnp.float32),
        temperature=_temperature(algo_config.temperature), weight_layout=layout,
        logit_softcap=_softcap(model), return_entropy=True, keep=_kept(train_example))
    logp, entropy = jax.lax.stop_gradient(logp), jax.lax.stop_gradient(entropy)  # metrics
  else:
    logp, entropy = per_token_logps(model, train_example, pad_id, eos_id,
                                    algo_config.temperature)
  old = old_logp.astype(jnp.float32) if has_old else jax.lax.stop_gradient(logp)
  ppo_kl = mean(old - logp)
  log_ratio = _log_ratio(logp, old)
  if algo_config.loss_algo == "gspo-token":  # the sequence's mean log-ratio, per token
    sequence = (log_ratio * mask).sum(-1) / jnp.clip(mask.sum(-1), min=1)
    log_ratio = jnp.clip(logp - jax.lax.stop_gradient(logp)
                         + jax.lax.stop_gradient(sequence)[:, None], max=10.0)
  per_token, dual_fraction, ratio, unclipped, clipped = _surrogate(log_ratio, adv,
                                                                    algo_config)
  dual = per_token if sampler_weights is None else per_token * sampler_weights.astype(
      jnp.float32)
  pg_loss = aggregate(dual)
  if not fused:
    loss = pg_loss
  scored = mask > 0
  adv_all = jnp.broadcast_to(adv, mask.shape)
  aux = {
      "kl": 0.0, "kl_loss": 0.0, "pg_loss": pg_loss,
      "pg_clipfrac": mean(clipped > unclipped), "ppo_kl": ppo_kl,
      "pg_clipfrac_lower": aggregate(dual_fraction),
      "is_ratio/mean": mean(ratio),
      "is_ratio/max": jnp.max(jnp.where(scored, ratio, 0.0)),
      "is_ratio/min": jnp.min(jnp.where(scored, ratio, jnp.inf)),
      "log_ratio/abs_mean": mean(jnp.abs(log_ratio)),
      "pg_loss/unclipped_mean": mean(unclipped), "pg_loss/clipped_mean": mean(clipped),
      "advantage/abs_mean": mean(jnp.abs(adv_all)),
      "advantage/max": jnp.max(jnp.where(scored, adv_all, -jnp.inf)),
      "advantage/min": jnp.min(jnp.where(scored, adv_all, jnp.inf)),
      "advantage/nonzero_frac": mean((jnp.abs(adv_all) > 1e-8).astype(jnp.float32)),
      "sampler_is/weight_mean": jnp.float32(1.0), "sampler_is/weight_min": jnp.float32(1.0),
  }
  if sampler_weights is not None:
    weights = sampler_weights.astype(jnp.float32)
    aux["sampler_is/weight_mean"] = mean(weights)
    aux["sampler_is/weight_min"] = jnp.min(jnp.where(scored, weights, jnp.inf))
  if train_example.ref_per_token_logps is not None:
    kl = common.compute_kl_divergence(logp, train_example.ref_per_token_logps,
                                      algo_config.kl_loss_mode,
                                      clamp_value=algo_config.kl_clamp_value)
    aux["kl"] = ((kl * mask).sum() / jnp.clip(mask.sum(), min=1)).astype(jnp.float32)
    aux["kl_loss"] = aggregate(kl)
    if algo_config.beta and not fused:
      loss = loss + algo_config.beta * aux["kl_loss"]
  aux["entropy"] = aggregate(entropy)
  return loss, aux


def ppo_loss(model, train_example, algo_config, pad_id, eos_id, **kwargs):
  """Tunix's ``ppo`` policy loss (``algo_core.ppo_policy_loss_fn``: clipped surrogate
  with ``epsilon_low`` / ``epsilon_high``, dual clip ``epsilon_c``, entropy bonus
  ``entropy_coef``, KL penalty ``kl_coef``) with jaxce's log-probs and entropy (the
  entropy gets its gradient too). Returns ``(loss, aux)`` with Tunix's aux keys."""
  del kwargs
  mask = train_example.completion_mask
  mean = lambda x: algo_core.masked_mean(x, mask)
  logp, entropy = per_token_logps(model, train_example, pad_id, eos_id)
  adv = train_example.advantages
  ratio = jnp.exp(logp - train_example.old_per_token_logps)
  unclipped = -ratio * adv
  clipped = -jnp.clip(ratio, 1 - algo_config.epsilon_low, 1 + algo_config.epsilon_high) * adv
  dual, dual_fraction = _dual_clip(jnp.maximum(unclipped, clipped), adv,
                                   getattr(algo_config, "epsilon_c", None))
  loss = mean(dual)
  aux = {"pg_clipfrac": mean(clipped > unclipped), "pg_clipfrac_lower": mean(dual_fraction)}
  if algo_config.entropy_coef:
    aux["loss/entropy"] = mean(entropy)
    loss = loss - algo_config.entropy_coef * aux["loss/entropy"]
  if getattr(algo_config, "kl_coef", 0.0) > 0.0 and train_example.ref_per_token_logps is not None:
    kl = common.compute_kl_divergence(logp, train_example.ref_per_token_logps, "kl",
                                      clamp_value=getattr(algo_config, "kl_clamp_value", None))
    aux["kl"] = mean(kl)
    loss = loss + algo_config.kl_coef * aux["kl"]
  return loss, aux


def _log_ratio(logp, old):
  """Tunix's GRPO log importance ratio, clipped to ±20."""
  return jnp.clip(logp - old, -20.0, 20.0)


def _surrogate(log_ratio, adv, algo_config):
  """GRPO's per-token clipped surrogate and dual clip: ``(loss, dual-clip fraction,
  ratio, unclipped, clipped)``."""
  ratio = jnp.exp(log_ratio)
  epsilon = algo_config.epsilon
  unclipped = -adv * ratio
  clipped = -adv * jnp.clip(ratio, 1 - epsilon, 1 + getattr(algo_config, "epsilon_high",
                                                           epsilon))
  loss, fraction = _dual_clip(jnp.maximum(unclipped, clipped), adv,
                              getattr(algo_config, "epsilon_c", None))
  return loss, fraction, ratio, unclipped, clipped


def _dual_clip(per_token, adv, epsilon_c):
  """Dual-clip PPO: a negative advantage's loss is capped at ``-epsilon_c * adv``.
  Returns the per-token loss and where the cap bit (0/1 float)."""
  cap = per_token if epsilon_c is None else -epsilon_c * adv
  fraction = ((per_token > cap) & (adv < 0.0)).astype(jnp.float32)
  return jnp.where(adv < 0.0, jnp.minimum(cap, per_token), per_token), fraction


def use_jaxce(algo_config):
  """Point a Tunix ``GRPOConfig`` / ``PPOConfig`` at the jaxce loss of its kind, after its
  own validation (which accepts only Tunix's built-in names). Returns ``algo_config``.

  Example:
    >>> from tunix.rl.grpo.grpo_learner import GRPOConfig
    >>> import jaxce.integrations.tunix as jaxce_tunix
    >>> config = jaxce_tunix.use_jaxce(GRPOConfig(num_generations=4, beta=0.04))
    >>> config.policy_loss_fn
    'jaxce_grpo'
  """
  names = {"grpo": GRPO_LOSS, "ppo": PPO_LOSS, GRPO_LOSS: GRPO_LOSS, PPO_LOSS: PPO_LOSS}
  if algo_config.policy_loss_fn not in names:
    raise ValueError(f'algo_config.policy_loss_fn must be "grpo" or "ppo", got '
                     f"{algo_config.policy_loss_fn!r}")
  algo_config.policy_loss_fn = names[algo_config.policy_loss_fn]
  return algo_config


function_registry.register_policy_loss_fn(GRPO_LOSS)(grpo_loss)
function_registry.register_policy_loss_fn(PPO_LOSS)(ppo_loss)
