"""The built-in objectives of ``jaxce.objectives`` against their published definitions, at
hand-computed values written out as numbers (nothing of jaxce computes an expected value):
each branch of the clipped surrogate with asymmetric bounds (0.2 / 0.28) and both signs of
the advantage, the dual clip, CISPO's clipped stop-gradient weight, the three KL
estimators, GRPO's sum (KL penalty, entropy bonus, ``beta = 0``, both surrogates) and the
three token weightings; and the gradient of each term with respect to the log-prob (and
the entropy) at the same points: zero where a clip binds, ``-A r`` where it does not.

Terms are ``objective(logp, entropy, *token_args)``, to be minimized, in float64 (the
test's x64), so every value is exact to float64 rounding.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxce import objectives

EXACT = dict(rtol=1e-12, atol=1e-12)


def _value_and_grads(term, logp, entropy, *token_args):
  """``(term, d term / d logp, d term / d entropy)`` per token, float64."""
  logp, entropy, *token_args = (jnp.asarray(a, jnp.float64)
                                for a in (logp, entropy, *token_args))
  f = lambda lp, h: jnp.sum(term(lp, h, *token_args))
  grads = jax.jit(lambda lp, h: (term(lp, h, *token_args), *jax.grad(f, (0, 1))(lp, h)))
  return tuple(np.asarray(a) for a in grads(logp, entropy))


def _check(term, cases, *, entropy=None):
  """``cases``: rows ``(ratio, advantage, expected term, expected d term / d logp)``; the
  log-prob is ``old_logp + log(ratio)`` with ``old_logp = -1.3``."""
  ratio, advantage, expected, expected_grad = (np.array(c, np.float64) for c in zip(*cases))
  old_logp = np.full(ratio.shape, -1.3)
  logp = old_logp + np.log(ratio)
  entropy = np.zeros(ratio.shape) if entropy is None else entropy
  values, d_logp, _ = _value_and_grads(term, logp, entropy, advantage, old_logp)
  np.testing.assert_allclose(values, expected, **EXACT, err_msg="term")
  np.testing.assert_allclose(d_logp, expected_grad, **EXACT, err_msg="d term / d logp")


# PPO's clipped surrogate with DAPO's clip-higher, as TRL's GRPOTrainer._compute_loss
# (v0.2x) has it: coef_1 = exp(logp - old_logp), coef_2 = clamp(coef_1, 1 - epsilon_low,
# 1 + epsilon_high), per_token_loss = -min(coef_1 * A, coef_2 * A) (DAPO, arXiv 2503.14476,
# eq. 10, with epsilon_low = 0.2, epsilon_high = 0.28). Where the clamped branch is the
# min and the clamp binds, the term is constant in logp (gradient 0); otherwise it is
# -r A, whose derivative in logp is -r A too.
ASYMMETRIC = [
    # ratio, A,  term,  d term / d logp
    (0.5, 2.0, -1.0, -1.0),     # r < 1 - eps_low, A > 0: r A is the min, not clipped
    (0.5, -2.0, 1.6, 0.0),      # r < 1 - eps_low, A < 0: clipped to 0.8: -(0.8 * -2)
    (0.78, -1.0, 0.8, 0.0),     # 0.72 < r < 0.8: the lower bound is 1 - eps_low, not 1 - eps_high
    (1.0, 0.5, -0.5, -0.5),     # inside the range
    (1.25, 2.0, -2.5, -2.5),    # 1.2 < r < 1.28: clip-higher leaves it unclipped
    (1.5, 2.0, -2.56, 0.0),     # r > 1 + eps_high, A > 0: clipped to 1.28: -(1.28 * 2)
    (1.5, -2.0, 3.0, 3.0),      # r > 1 + eps_high, A < 0: r A is the min, not clipped
    (0.7, 1.0, -0.7, -0.7),     # r < 1 - eps_high, A > 0: not clipped
]

# epsilon_high=None is PPO's symmetric clip (Schulman et al. 2017, eq. 7): [0.8, 1.2].
SYMMETRIC = [
    (1.25, 2.0, -2.4, 0.0),     # r > 1.2, A > 0: clipped to 1.2
    (1.15, 2.0, -2.3, -2.3),    # inside
    (0.78, -1.0, 0.8, 0.0),     # r < 0.8, A < 0: clipped to 0.8
    (1.25, -1.0, 1.25, 1.25),   # r > 1.2, A < 0: not clipped
]

# Dual-clip PPO (Ye et al. 2020, "Mastering Complex Control in MOBA Games with Deep RL",
# arXiv 1912.09729, eq. 5): for A < 0 the objective is max(min(r A, clip(r) A), c A), so
# the term is bounded by -c A and carries no gradient where that bound binds; for A >= 0
# it is the ordinary clipped surrogate. c = 3, eps = 0.2.
DUAL_CLIP = [
    (4.0, -1.0, 3.0, 0.0),      # A < 0, r > c: the dual clip binds at -c A = 3
    (2.0, -1.0, 2.0, 2.0),      # A < 0, 1.2 < r < c: -r A, not clipped
    (0.5, -1.0, 0.8, 0.0),      # A < 0, r < 0.8: the ordinary clip binds (0.8 < 3)
    (4.0, 1.0, -1.2, 0.0),      # A > 0, r > c: only the ordinary clip (not -c A = -3)
    (0.1, 1.0, -0.1, -0.1),     # A > 0, tiny r: r A, untouched by the dual clip
    (4.0, -0.5, 1.5, 0.0),      # A < 0: the bound scales with A: -3 * -0.5
]


def test_clipped_surrogate_asymmetric_bounds():
  _check(objectives.clipped_surrogate(epsilon_low=0.2, epsilon_high=0.28), ASYMMETRIC)


def test_clipped_surrogate_symmetric_by_default():
  _check(objectives.clipped_surrogate(0.2), SYMMETRIC)


def test_dual_clip_binds_only_for_negative_advantages():
  _check(objectives.clipped_surrogate(0.2, dual_clip=3.0), DUAL_CLIP)


def test_surrogate_does_not_use_the_entropy():
  """An entropy of NaN (not computed) leaves the surrogate's terms and gradients alone."""
  _check(objectives.clipped_surrogate(0.2, 0.28), ASYMMETRIC,
         entropy=np.full(len(ASYMMETRIC), np.nan))


# CISPO (MiniMax-M1, arXiv 2506.13585, eq. 4-5): J = sg(r_hat) A log pi, with
# r_hat = clip(r, 1 - eps_low_IS, 1 + eps_high_IS) and no lower bound in practice (TRL's
# loss_type="cispo": -clamp(coef_1, max=...).detach() * A * logp). The weight is a
# constant, so d term / d logp = -min(r, 1 + eps_high) A at every token, clipped or not.
# Rows: logp, old_logp, A, term, d term / d logp.
CISPO = [
    (-0.5, -1.0, 2.0, 1.28, -2.56),     # r = e^0.5 > 1.28: weight 1.28; -1.28 * 2 * -0.5
    # r = e^-0.2 = 0.8187307530779818: -r * 2 * -1.2; gradient -r * 2 (with the weight's
    # own gradient it would be -2 r (1 + logp) = +0.327...)
    (-1.2, -1.0, 2.0, 1.964953807387156, -1.6374615061559637),
    # r = e^-1 = 0.36787944117144233, A < 0: no lower clip (0.8 would give -1.6)
    (-2.0, -1.0, -1.0, -0.7357588823428847, 0.36787944117144233),
]


CISPO_TERMS = {
    "cispo default": lambda: objectives.cispo(),
    "cispo 0.28": lambda: objectives.cispo(0.28),
    # GRPO's CISPO surrogate (default eps_high 0.28 there too), weight 1, no KL:
    "grpo cispo default": lambda: lambda lp, h, adv, old: objectives.grpo(
        beta=0.0, surrogate="cispo")(lp, h, adv, old, jnp.nan, 1.0),
}


@pytest.mark.parametrize("name", list(CISPO_TERMS))
def test_cispo_clipped_stop_gradient_weight(name):
  logp, old_logp, advantage, expected, expected_grad = (np.array(c) for c in zip(*CISPO))
  values, d_logp, _ = _value_and_grads(CISPO_TERMS[name](), logp, np.zeros(3), advantage,
                                       old_logp)
  np.testing.assert_allclose(values, expected, **EXACT, err_msg="term")
  np.testing.assert_allclose(d_logp, expected_grad, **EXACT, err_msg="d term / d logp")


# Schulman, "Approximating KL Divergence" (2020), with r = p_ref / p = exp(d),
# d = ref_logp - logp: k1 = -log r = -d, k2 = (log r)^2 / 2 = d^2 / 2,
# k3 = (r - 1) - log r = exp(d) - d - 1 (TRL GRPOTrainer: per_token_kl =
# exp(ref - logp) - (ref - logp) - 1). Derivatives in logp: k1: 1; k2: -d; k3: 1 - exp(d).
# Rows: logp, ref_logp, k1, k2, k3, d k1, d k2, d k3.
KL = [
    (-1.0, -2.5, 1.5, 1.125, 0.7231301601484298, 1.0, 1.5, 0.7768698398515702),    # d = -1.5
    (-2.0, -0.5, -1.5, 1.125, 1.9816890703380648, 1.0, -1.5, -3.4816890703380645),  # d = 1.5
    (-1.0, -1.0, 0.0, 0.0, 0.0, 1.0, 0.0, 0.0),                                      # d = 0
]


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_kl_estimators(estimator):
  column = {"k1": 2, "k2": 3, "k3": 4}[estimator]
  table = np.array(KL)
  values, d_logp, _ = _value_and_grads(objectives.kl(estimator), table[:, 0], np.zeros(3),
                                       table[:, 1])
  np.testing.assert_allclose(values, table[:, column], **EXACT, err_msg="term")
  np.testing.assert_allclose(d_logp, table[:, column + 3], **EXACT, err_msg="d term / d logp")


def test_kl_default_is_k3_and_unknown_estimators_are_refused():
  values, _, _ = _value_and_grads(objectives.kl(), [-2.0], [0.0], [-0.5])
  np.testing.assert_allclose(values, [1.9816890703380648], **EXACT)
  with pytest.raises(ValueError, match="estimator"):
    objectives.kl("k4")


# GRPO's per-token loss, TRL GRPOTrainer._compute_loss (v0.2x):
#   per_token_loss = -min(coef_1 A, coef_2 A) + beta * per_token_kl
# with the KL only when beta != 0 (no reference model then), plus verl's entropy bonus
# (dp_actor: policy_loss = pg_loss - entropy_coeff * entropy), times the token's weight.
# Rows: logp, entropy, A, ratio, ref_logp, weight, term, d term / d logp, d term / d entropy.
GRPO = {
    # clip 0.2 / 0.28, k3, beta 0.04, entropy 0.01:
    #   row 1: 0.25 * (-2.56 + 0.04 * 0.7231301601484298 - 0.01 * 2); the surrogate is
    #   clipped (gradient 0), the KL's gradient 0.25 * 0.04 * (1 - e^-1.5)
    #   row 2: 1.0 * (-2.5 + 0 - 0.01 * 0.5), unclipped (r = 1.25 < 1.28): gradient -2.5
    "clip-higher, k3, entropy": (
        dict(epsilon_low=0.2, epsilon_high=0.28, beta=0.04, entropy_coef=0.01),
        [(-1.0, 2.0, 2.0, 1.5, -2.5, 0.25, -0.6377686983985157, 0.007768698398515702, -0.0025),
         (-1.0, 0.5, 2.0, 1.25, -1.0, 1.0, -2.505, -2.5, -0.01)]),
    # dual clip 3, k1, beta 0.1: 0.5 * (3 + 0.1 * 1.5); gradient 0.5 * 0.1 * 1
    "dual clip, k1": (
        dict(epsilon_low=0.2, beta=0.1, kl_estimator="k1", dual_clip=3.0),
        [(-1.0, 0.0, -1.0, 4.0, -2.5, 0.5, 1.575, 0.05, 0.0)]),
    # k2, beta 0.1, A = 0: 2 * 0.1 * 1.125; gradient 2 * 0.1 * -1.5
    "k2": (
        dict(epsilon_low=0.2, beta=0.1, kl_estimator="k2"),
        [(-2.0, 0.0, 0.0, 1.0, -0.5, 2.0, 0.225, -0.3, 0.0)]),
    # beta = 0: no KL at all, so a NaN reference log-prob (none loaded) and a NaN entropy
    # (not computed) change nothing: -1.2 * 2, clipped
    "beta 0": (
        dict(epsilon_low=0.2, beta=0.0),
        [(-1.0, np.nan, 2.0, 1.5, np.nan, 1.0, -2.4, 0.0, 0.0)]),
    # CISPO surrogate (default eps_high 0.28), entropy 0.02, weight 0.5:
    #   0.5 * (1.28 - 0.02 * 1.5); gradient 0.5 * -1.28 * 2; d entropy 0.5 * -0.02
    "cispo, entropy": (
        dict(beta=0.0, surrogate="cispo", entropy_coef=0.02),
        [(-0.5, 1.5, 2.0, np.exp(0.5), np.nan, 0.5, 0.625, -1.28, -0.01)]),
    # CISPO with eps_high 0.3: 1.3 * 2 * 0.5; gradient -1.3 * 2
    "cispo 0.3": (
        dict(epsilon_high=0.3, beta=0.0, surrogate="cispo"),
        [(-0.5, 0.0, 2.0, np.exp(0.5), np.nan, 1.0, 1.3, -2.6, 0.0)]),
}


@pytest.mark.parametrize("case", list(GRPO))
def test_grpo_per_token_loss(case):
  options, rows = GRPO[case]
  (logp, entropy, advantage, ratio, ref_logp, weight, expected, expected_grad,
   expected_entropy_grad) = (np.array(c, np.float64) for c in zip(*rows))
  old_logp = logp - np.log(ratio)
  values, d_logp, d_entropy = _value_and_grads(objectives.grpo(**options), logp, entropy,
                                               advantage, old_logp, ref_logp, weight)
  np.testing.assert_allclose(values, expected, **EXACT, err_msg="term")
  np.testing.assert_allclose(d_logp, expected_grad, **EXACT, err_msg="d term / d logp")
  np.testing.assert_allclose(d_entropy, expected_entropy_grad, **EXACT,
                             err_msg="d term / d entropy")


def test_grpo_refuses_unknown_surrogates():
  with pytest.raises(ValueError, match="surrogate"):
    objectives.grpo(surrogate="gspo")
  with pytest.raises(ValueError, match="estimator"):
    objectives.grpo(kl_estimator="k5")


# The normalizations as per-token weights, sum(weight * term) over a [B, S] batch
# (TRL GRPOTrainer loss_type, v0.2x): "token_mean" = bnpo / DAPO's token-level mean,
# sum(term * mask) / clamp(sum(mask), 1); "sequence_mean_token_mean" = "grpo",
# ((term * mask).sum(-1) / clamp(mask.sum(-1), 1)).mean() over all B sequences;
# "constant" = Dr. GRPO (Liu et al. 2025, arXiv 2503.20783) / "dr_grpo",
# sum(term * mask) / (B * max_completion_length). A batch of 3 rows of 4, the last empty.
MASK = [[1, 1, 0, 0], [1, 1, 1, 1], [0, 0, 0, 0]]
WEIGHTS = {
    ("token_mean", None): [[1 / 6, 1 / 6, 0, 0], [1 / 6] * 4, [0] * 4],
    ("sequence_mean_token_mean", None): [[1 / 6, 1 / 6, 0, 0], [1 / 12] * 4, [0] * 4],
    ("constant", None): [[1 / 12, 1 / 12, 0, 0], [1 / 12] * 4, [0] * 4],
    ("constant", 8): [[1 / 24, 1 / 24, 0, 0], [1 / 24] * 4, [0] * 4],
}


@pytest.mark.parametrize("mode,max_length", list(WEIGHTS))
@pytest.mark.parametrize("mask_dtype", [bool, np.float32])
def test_token_weights(mode, max_length, mask_dtype):
  mask = np.array(MASK, mask_dtype)
  weights = objectives.token_weights(mask, mode, max_length=max_length)
  assert weights.dtype == jnp.float32 and weights.shape == mask.shape
  np.testing.assert_allclose(np.asarray(weights), WEIGHTS[mode, max_length], rtol=2**-23,
                             atol=0)


def test_token_weights_default_and_empty_batch():
  """The default is TRL's "grpo" mode; a batch without a kept token weighs all zero (no
  NaN from 0 / 0); an unknown mode is refused."""
  np.testing.assert_allclose(np.asarray(objectives.token_weights(np.array(MASK, bool))),
                             WEIGHTS["sequence_mean_token_mean", None], rtol=2**-23, atol=0)
  empty = np.zeros((2, 3), bool)
  for mode in ("token_mean", "sequence_mean_token_mean", "constant"):
    assert np.all(np.asarray(objectives.token_weights(empty, mode)) == 0), mode
  with pytest.raises(ValueError, match="mode"):
    objectives.token_weights(empty, "seq_sum")
