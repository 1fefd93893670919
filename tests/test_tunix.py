"""jaxce behind Tunix's policy losses: for the same Tunix model (Qwen3; Gemma), batch and
seed, Tunix's own ``grpo`` / ``ppo`` loss and the jaxce-backed one agree in loss, aux
metrics and every parameter's gradient, and the jaxce step's compiled program holds no
``[B, L, V]`` array.

Tolerances (float32 model): both sides compute the same float32 function; they differ
only in how the softmax sums are ordered (jaxce's online softmax over vocab tiles against
one ``logsumexp``), so log-probs agree to a few float32 ulps of the logits (|z| < 20
here: ~1e-5) and gradients to ~1e-5 of their largest entry.
"""

import copy
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

tunix_models = pytest.importorskip(
    "tunix.models.qwen3.model", reason="google-tunix is not installed: pip install -e .[tunix]")
from tunix.rl import common, function_registry  # noqa: E402
from tunix.rl.grpo.grpo_learner import GRPOConfig  # noqa: E402
from tunix.rl.ppo.ppo_learner import PPOConfig  # noqa: E402

from jaxce.integrations import tunix as jaxce_tunix  # noqa: E402

PAD, EOS = 0, 1
B, PROMPT, COMPLETION = 4, 5, 7


def _model(tied, vocab_size=300, seed=0):
  config = tunix_models.ModelConfig(
      num_layers=2, vocab_size=vocab_size, embed_dim=64, hidden_dim=128, num_heads=4,
      head_dim=16, num_kv_heads=2, rope_theta=10000, norm_eps=1e-6, use_tied_embedding=tied)
  return tunix_models.Qwen3(config, rngs=nnx.Rngs(seed))


def _example(rng, vocab_size=300, *, old=True, ref=True, sampler_weights=False,
             token_advantages=False, shape=(B, PROMPT, COMPLETION)):
  batch, prompt_length, completion_length = shape
  prompt = rng.integers(2, vocab_size, (batch, prompt_length))
  prompt[0, :2] = PAD  # left-padded prompt
  completion = rng.integers(2, vocab_size, (batch, completion_length))
  lengths = rng.integers(1, completion_length + 1, batch)
  lengths[0] = completion_length
  mask = np.arange(completion_length)[None] < lengths[:, None]
  completion = np.where(mask, completion, PAD)
  # Near the random-init policy's log-probs (about -log V), so that the ratios straddle the
  # clip range and both clipped and unclipped tokens carry gradient.
  near = lambda: jnp.asarray(-np.log(vocab_size) + 0.15 * rng.normal(size=mask.shape),
                             jnp.float32)
  return common.TrainExample(
      prompt_ids=jnp.asarray(prompt), prompt_mask=jnp.asarray(prompt != PAD),
      completion_ids=jnp.asarray(completion), completion_mask=jnp.asarray(mask, jnp.int32),
      advantages=jnp.asarray(rng.normal(size=mask.shape if token_advantages else batch),
                             jnp.float32),
      ref_per_token_logps=near() if ref else None, old_per_token_logps=near() if old else None,
      sampler_is_weights=(jnp.asarray(rng.uniform(0.5, 1.0, mask.shape), jnp.float32)
                          if sampler_weights else None))


def _loss_and_grads(name, model, example, config):
  loss_fn = function_registry.get_policy_loss_fn(name)
  f = lambda m: loss_fn(m, example, config, PAD, EOS)
  (loss, aux), grads = nnx.value_and_grad(f, has_aux=True)(model)
  return loss, aux, grads


def _compare(model, example, config, tunix_name, jaxce_name):
  loss, aux, grads = _loss_and_grads(tunix_name, model, example, config)
  loss_j, aux_j, grads_j = _loss_and_grads(jaxce_name, model, example, config)
  np.testing.assert_allclose(loss_j, loss, rtol=1e-5, atol=1e-6)
  assert set(aux_j) == set(aux), set(aux) ^ set(aux_j)
  for key in aux:
    np.testing.assert_allclose(np.asarray(aux_j[key]), np.asarray(aux[key]), rtol=2e-5,
                               atol=1e-6, err_msg=key)
  flat, flat_j = jax.tree.leaves(nnx.to_pure_dict(grads)), jax.tree.leaves(
      nnx.to_pure_dict(grads_j))
  assert len(flat) == len(flat_j)
  scale = max(float(jnp.max(jnp.abs(g))) for g in flat)
  assert scale > 0
  for g, gj in zip(flat, flat_j):
    np.testing.assert_allclose(gj, g, rtol=0, atol=1e-5 * scale)


GRPO_CASES = {
    "grpo, sequence-mean-token-mean, low_var_kl": dict(
        loss_agg_mode="sequence-mean-token-mean", beta=0.04, kl_loss_mode="low_var_kl"),
    "grpo, token-mean, dual clip, sampler weights": dict(
        loss_agg_mode="token-mean", beta=0.0, epsilon_c=3.0, sampler_weights=True),
    "gspo-token, seq-mean-token-sum, no old log-probs": dict(
        loss_algo="gspo-token", loss_agg_mode="seq-mean-token-sum", old=False),
    "grpo, sequence-mean-token-scale, kl": dict(
        loss_agg_mode="sequence-mean-token-scale", beta=0.1, kl_loss_mode="kl"),
    "grpo, sequence-mean-token-sum-norm, mse_kl, no ref": dict(
        loss_agg_mode="sequence-mean-token-sum-norm", beta=0.1, kl_loss_mode="mse_kl",
        ref=False),
}


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("case", list(GRPO_CASES))
def test_grpo_matches_tunix(case, tied):
  options = dict(GRPO_CASES[case])
  example_kw = {k: options.pop(k) for k in ("old", "ref", "sampler_weights") if k in options}
  epsilon_c = options.pop("epsilon_c", None)
  config = GRPOConfig(num_generations=2, epsilon=0.2, **options)
  config.temperature = 0.7  # set by GRPOLearner from the rollout config
  if epsilon_c is not None:
    config.epsilon_c = epsilon_c
  rng = np.random.default_rng(len(case) + tied)
  _compare(_model(tied), _example(rng, **example_kw), config, "grpo", jaxce_tunix.GRPO_LOSS)


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_ppo_matches_tunix(tied):
  config = PPOConfig(epsilon_low=0.2, epsilon_high=0.28, epsilon_c=3.0, entropy_coef=0.01)
  rng = np.random.default_rng(7 + tied)
  example = _example(rng, token_advantages=True)  # PPO's advantages are per token (GAE)
  _compare(_model(tied), example, config, "ppo", jaxce_tunix.PPO_LOSS)


def _packed_example(rng, vocab_size=300):
  """Two packed rows of 12 tokens: no prompts, the documents' segment ids and positions."""
  shape = (2, 12)
  positions = np.stack([np.r_[np.arange(5), np.arange(7)], np.r_[np.arange(8), np.arange(4)]])
  near = lambda: jnp.asarray(-np.log(vocab_size) + 0.1 * rng.normal(size=shape), jnp.float32)
  return common.TrainExample(
      prompt_ids=jnp.zeros((2, 0), jnp.int32), prompt_mask=jnp.zeros((2, 0), bool),
      completion_ids=jnp.asarray(rng.integers(2, vocab_size, shape)),
      completion_mask=jnp.asarray(rng.random(shape) < 0.7, jnp.int32),
      advantages=jnp.asarray(rng.normal(size=shape), jnp.float32),
      ref_per_token_logps=near(), old_per_token_logps=near(),
      segment_ids=jnp.asarray(1 + (positions < np.roll(positions, 1, axis=1)).cumsum(1)),
      segment_positions=jnp.asarray(positions))


@pytest.mark.parametrize("loss_algo", ["grpo", "gspo-token"])
def test_packed_sequences_match_tunix(loss_algo):
  """Sequence packing: every position but the first predicts the next token (Tunix pads
  the first back)."""
  config = GRPOConfig(num_generations=2, beta=0.04, loss_algo=loss_algo)
  config.temperature = 0.8
  _compare(_model(False), _packed_example(np.random.default_rng(3)), config, "grpo",
           jaxce_tunix.GRPO_LOSS)


@pytest.mark.parametrize("loss_algo", ["grpo", "gspo-token"])
def test_gemma_matches_tunix(loss_algo):
  """Tunix's Gemma: a tied head without a compute-dtype cast, the final-logit softcap
  (Gemma 2's, applied before the temperature), no segment ids in its call."""
  from tunix.models.gemma import model as gemma  # pylint: disable=import-outside-toplevel
  config = gemma.ModelConfig(
      num_layers=2, num_embed=300, embed_dim=64, hidden_dim=128, num_heads=2, head_dim=32,
      num_kv_heads=1, final_logit_softcap=3.0, use_post_attn_norm=True,
      use_post_ffw_norm=True, attention_types=(gemma.AttentionType.GLOBAL,) * 2)
  algo_config = GRPOConfig(num_generations=2, beta=0.04, loss_algo=loss_algo)
  algo_config.temperature = 0.8
  _compare(gemma.Gemma(config, rngs=nnx.Rngs(0)), _example(np.random.default_rng(1)),
           algo_config, "grpo", jaxce_tunix.GRPO_LOSS)


def test_use_jaxce_selects_the_registered_losses():
  config = jaxce_tunix.use_jaxce(GRPOConfig(num_generations=2))
  assert config.policy_loss_fn == jaxce_tunix.GRPO_LOSS
  assert function_registry.get_policy_loss_fn(config.policy_loss_fn) is jaxce_tunix.grpo_loss
  assert jaxce_tunix.use_jaxce(PPOConfig()).policy_loss_fn == jaxce_tunix.PPO_LOSS
  config.policy_loss_fn = "mystery"
  with pytest.raises(ValueError, match="policy_loss_fn"):
    jaxce_tunix.use_jaxce(config)


def _largest_array(name, model, example, config):
  """Elements of the largest array in the optimized HLO of one jitted loss + gradient."""
  loss_fn = function_registry.get_policy_loss_fn(name)
  graphdef, state = nnx.split(model)

  def step(state, example):
    f = lambda m: loss_fn(m, example, config, PAD, EOS)[0]
    return nnx.value_and_grad(f)(nnx.merge(graphdef, state))

  text = jax.jit(step).lower(state, example).compile().as_text()
  import re  # pylint: disable=import-outside-toplevel
  sizes = [int(np.prod([int(d) for d in dims.split(",") if d]))
           for dims in re.findall(r"[fbsu]\d+\[([\d,]*)\]", text)]
  return max(sizes)


def test_jaxce_step_holds_no_logits():
  """The model's own ``[B, P + L, V]`` logits are dead in the jaxce step and XLA removes
  them; Tunix's own step holds them (so the check can fail). 8 x 80 completion tokens and
  V = 16384: the completion's f32 logits (42 MB) exceed jaxce's CPU tile (32 MiB), so the
  largest array of the jaxce step is a tile, a quarter of them."""
  vocab_size, shape = 16384, (8, 5, 80)
  model = _model(False, vocab_size)
  example = _example(np.random.default_rng(0), vocab_size, shape=shape)
  config = GRPOConfig(num_generations=2, beta=0.04)
  config.temperature = 1.0
  logits = shape[0] * shape[2] * vocab_size
  assert _largest_array("grpo", model, example, config) >= logits
  assert _largest_array(jaxce_tunix.GRPO_LOSS, model, example, config) < logits


def test_example_steps_follow_the_same_trajectory():
  """examples/tunix_grpo.py's CPU default, two steps in this process: Tunix's loss and
  the jaxce one give the same losses step after step (the updates agree too)."""
  from examples import tunix_grpo  # pylint: disable=import-outside-toplevel
  args = tunix_grpo.parse_args(["--steps", "1", "--warmup", "1"])
  tunix_run, jaxce_run = (tunix_grpo.measure(args, name) for name in tunix_grpo.LOSSES)
  assert len(tunix_run["losses"]) == 2
  np.testing.assert_allclose(jaxce_run["losses"], tunix_run["losses"], rtol=1e-5, atol=1e-7)


# Options at values that change the result, and a completion with no tokens (issue 30).
# Every ``algo_config`` option jaxce.integrations.tunix reads: loss_agg_mode, beta,
# loss_algo, kl_loss_mode, temperature (the cases above); epsilon, epsilon_high,
# epsilon_c and kl_clamp_value for GRPO, epsilon_low, epsilon_high, epsilon_c,
# entropy_coef, kl_coef and kl_clamp_value for PPO (below), each checked to change
# Tunix's own loss, so a jaxce loss that ignored it would not match.


def _binding_example(seed, *, token_advantages=False, empty_row=None):
  """``_example`` with a third of the old log-probs 2 lower (ratios near e^2 > 3: the
  dual clip binds for negative advantages) and a third of the reference log-probs 1.5
  higher (large KL terms, which a clamp cuts); optionally one completion with no tokens."""
  rng = np.random.default_rng(seed)
  example = _example(rng, token_advantages=token_advantages)
  far = lambda: jnp.asarray(rng.random(example.completion_mask.shape) < 1 / 3)
  example = example.replace(
      old_per_token_logps=example.old_per_token_logps - 2.0 * far(),
      ref_per_token_logps=example.ref_per_token_logps + 1.5 * far())
  if empty_row is not None:
    example = example.replace(
        completion_mask=example.completion_mask.at[empty_row].set(0),
        completion_ids=example.completion_ids.at[empty_row].set(PAD))
  return example


def _assert_each_option_matters(model, example, config, name, options):
  """Tunix's own loss changes when each option is set back to ``options[option]`` (its
  default or off), so a jaxce loss that ignored the option would not match it."""
  loss_fn = function_registry.get_policy_loss_fn(name)
  loss = float(loss_fn(model, example, config, PAD, EOS)[0])
  for option, default in options.items():
    other = copy.copy(config)
    setattr(other, option, default)
    changed = float(loss_fn(model, example, other, PAD, EOS)[0])
    assert abs(changed - loss) > 1e-4 * abs(loss), f"{option} does not change Tunix's loss"


@pytest.mark.parametrize("loss_algo", ["grpo", "gspo-token"])
def test_grpo_binding_options_match_tunix(loss_algo):
  """Asymmetric clip (epsilon 0.1, epsilon_high 0.28), a dual clip that binds and a KL
  clamp that binds, on the fused path ("grpo") and the per-token one ("gspo-token")."""
  config = GRPOConfig(num_generations=2, epsilon=0.1, beta=0.1, kl_loss_mode="low_var_kl",
                      loss_agg_mode="token-mean", loss_algo=loss_algo, kl_clamp_value=0.5)
  config.temperature = 0.7
  config.epsilon_high = 0.28  # not a GRPOConfig field: Tunix reads it when set
  config.epsilon_c = 3.0
  model, example = _model(False), _binding_example(11)
  aux = function_registry.get_policy_loss_fn("grpo")(model, example, config, PAD, EOS)[1]
  if loss_algo == "grpo":  # GSPO's sequence ratios are e^mean: its dual clip may not bind
    assert float(aux["pg_clipfrac_lower"]) > 0, "the dual clip does not bind"
  _assert_each_option_matters(model, example, config, "grpo", dict(
      epsilon=0.2, epsilon_high=0.1, kl_clamp_value=None,
      **({"epsilon_c": None} if loss_algo == "grpo" else {})))
  _compare(model, example, config, "grpo", jaxce_tunix.GRPO_LOSS)


@dataclasses.dataclass(slots=True, kw_only=True)
class _PPOConfigWithKL(PPOConfig):
  """Tunix's PPO loss reads ``kl_coef`` when the config has it; PPOConfig (slotted) does
  not, so a user's config class adds it."""
  kl_coef: float = 0.0


def test_ppo_binding_options_match_tunix():
  """Asymmetric clip (0.1 / 0.28), a dual clip that binds, the entropy bonus, the KL
  penalty (``kl_coef``) and a KL clamp that binds."""
  config = _PPOConfigWithKL(epsilon_low=0.1, epsilon_high=0.28, epsilon_c=3.0,
                            entropy_coef=0.01, kl_clamp_value=0.2, kl_coef=0.1)
  model, example = _model(False), _binding_example(12, token_advantages=True)
  aux = function_registry.get_policy_loss_fn("ppo")(model, example, config, PAD, EOS)[1]
  assert float(aux["pg_clipfrac_lower"]) > 0, "the dual clip does not bind"
  _assert_each_option_matters(model, example, config, "ppo", dict(
      epsilon_low=0.2, epsilon_high=0.1, epsilon_c=None, entropy_coef=0.0, kl_coef=0.0,
      kl_clamp_value=None))
  _compare(model, example, config, "ppo", jaxce_tunix.PPO_LOSS)


@pytest.mark.parametrize("case", ["grpo", "gspo-token", "ppo"])
def test_completion_without_tokens_matches_tunix(case):
  """One completion of the batch has no tokens (all masked): it counts in no mean
  (Tunix's sequence means skip it) and its rows get no gradient, on the fused GRPO path
  (``sequence-mean-token-mean``: the mean over non-empty sequences), the per-token one
  (GSPO, ``seq-mean-token-sum``) and PPO."""
  model = _model(False)
  if case == "ppo":
    config = PPOConfig(epsilon_low=0.2, epsilon_high=0.28, entropy_coef=0.01)
    example = _binding_example(13, token_advantages=True, empty_row=2)
  else:
    config = GRPOConfig(num_generations=2, beta=0.04, loss_algo=case, loss_agg_mode=(
        "sequence-mean-token-mean" if case == "grpo" else "seq-mean-token-sum"))
    config.temperature = 0.7
    example = _binding_example(13, empty_row=2)
  assert not np.any(example.completion_mask[2]) and np.all(np.asarray(example.completion_mask).sum(1)[
      [0, 1, 3]] > 0)
  _compare(model, example, config, case.replace("gspo-token", "grpo"),
           jaxce_tunix.PPO_LOSS if case == "ppo" else jaxce_tunix.GRPO_LOSS)


def _kept_model(kept_logits, tied):
  """A Qwen3 whose logits outside each position's kept set (``kept_logits``, bool ``[B, S,
  V]``) are -1e9: Tunix's own loss on them is the loss over the kept sets (exp(-1e9) is
  0 in float32, and 0 * -1e9 is 0 in its entropy), the oracle for ``keep=``."""
  class KeptQwen3(tunix_models.Qwen3):
    def __call__(self, *args, **kwargs):
      logits, cache = super().__call__(*args, **kwargs)
      return jnp.where(kept_logits, logits, -1e9), cache

  reference = _model(tied)
  model = KeptQwen3(reference.config, rngs=nnx.Rngs(0))
  nnx.update(model, nnx.state(reference))
  return model


@pytest.mark.parametrize("case", ["grpo", "gspo-token", "ppo", "packed"])
@pytest.mark.parametrize("form", ["words", "kept_ids"])
def test_kept_sets_match_tunix_on_masked_logits(case, form):
  """``TrainExampleWithKept.kept`` (a sampler's small sets, the label in each; as packed
  words or as vLLM-style CSR kept ids; packed sequences too): every loss, aux metric and
  gradient equals Tunix's own loss on logits set to -1e9 outside the kept sets."""
  rng = np.random.default_rng(21)
  vocab = 300
  if case == "packed":  # the labels are tokens[:, 1:], predicted from positions 0 .. S - 2
    example = _packed_example(rng, vocab)
    labels = np.asarray(example.completion_ids)[:, 1:]
    first = 0
  else:  # the completion's tokens, predicted from positions PROMPT - 1 ..
    example = _example(rng, token_advantages=case == "ppo")
    labels = np.asarray(example.completion_ids)
    first = PROMPT - 1
  sets = [sorted({int(t), *rng.integers(0, vocab, rng.integers(0, 5))})
          for t in labels.reshape(-1)]
  mask = np.zeros(labels.shape + (vocab,), bool)
  for i, ids in enumerate(sets):
    mask[i // labels.shape[1], i % labels.shape[1], ids] = True
  sequence = example.prompt_ids.shape[1] + example.completion_ids.shape[1]
  kept_logits = np.ones((labels.shape[0], sequence, vocab), bool)
  kept_logits[:, first:first + labels.shape[1]] = mask
  if form == "words":
    kept = jaxce_tunix.jaxce.keep.pack(jnp.asarray(mask))
  else:
    offsets = np.concatenate([[0], np.cumsum([len(s) for s in sets])])
    kept = jaxce_tunix.jaxce.keep.from_csr(np.concatenate(sets), offsets)
  fields = {f.name: getattr(example, f.name) for f in dataclasses.fields(example)}
  example = jaxce_tunix.TrainExampleWithKept(**fields, kept=kept)
  if case == "ppo":
    config = PPOConfig(epsilon_low=0.2, epsilon_high=0.28, epsilon_c=3.0, entropy_coef=0.01)
    names = ("ppo", jaxce_tunix.PPO_LOSS)
  else:
    config = GRPOConfig(num_generations=2, epsilon=0.2, beta=0.04,
                        loss_algo="grpo" if case == "packed" else case,
                        loss_agg_mode="sequence-mean-token-mean")
    config.temperature = 0.7
    names = ("grpo", jaxce_tunix.GRPO_LOSS)
  _compare(_kept_model(jnp.asarray(kept_logits), False), example, config, *names)
