"""The first on-policy step of GRPO, as a user writes it: the scoring pass
(``linear_logprobs_and_entropy``, no gradient) gives the old log-probs, then
``linear_token_loss`` on the same batch and parameters. The policy is the old policy, so
each token's ratio ``exp(logp - old_logp)`` is exactly 1 and nothing is clipped: the
objective path's ``logp`` is the scoring pass's bits.

Where that is promised: with the fused head's kernels (Hopper's default; off GPUs in JAX's
GPU interpreter, which needs JAX >= 0.11) and with ``batch_invariant=True`` everywhere, on one
device and with the vocabulary split over 2 or 4 (``sharded_*``: on GPUs Qwen3's 151936
columns give shards of 75968 and 37984, off GPUs 384 give 192 in the interpreter, not
multiples of 128). On
GPUs the calls run at a real shape (T = 8 x 1023 tokens, D = 1024, V = 151936, bf16),
where the objective path's groups of 2048 rows put each token at another place in the
kernels' row blocks than the scoring pass's single call. Off GPUs at a small one whose
calls take the same row blocks (320 tokens in one group: two blocks of 256, the second
moved back): the interpreter's matmul (XLA:CPU) can round a row differently by its place
in a block, which the GPU's does not."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import mosaic_gpu as plgpu
from jax.sharding import Mesh

from helpers import devices, jaxce

ON_GPU = jax.default_backend() == "gpu"
# (batch, sequence, D, columns, vocab_size): a shifted-label batch, the vocabulary padded
SHAPE = (8, 1023, 1024, 151936, 151665) if ON_GPU else (4, 80, 64, 384, 380)
EPSILON_LOW, EPSILON_HIGH = 0.2, 0.28
CASES = {
    "default": dict(),  # the plan's kernels: on GPUs the default, off GPUs XLA (no promise)
    "batch_invariant": dict(batch_invariant=True),
    "mosaic": dict(implementation="mosaic"),  # what Hopper runs by default
}


def _batch(seed=0, columns=SHAPE[3], vocab=SHAPE[4]):
  batch, length, depth = SHAPE[:3]
  rng = np.random.default_rng(seed)
  hidden = jnp.asarray(rng.normal(size=(batch, length, depth)), jnp.bfloat16)
  weight = rng.normal(size=(depth, columns)) * 1.5 / np.sqrt(depth)
  weight[:, rng.integers(0, vocab, 8)] *= 6  # a few peaked columns
  weight = jnp.asarray(weight, jnp.bfloat16)
  labels = rng.integers(0, vocab, (batch, length))
  mask = rng.random((batch, length)) < 0.9
  advantages = np.repeat(rng.normal(size=(batch, 1)), length, axis=1)
  ref_logp = -rng.uniform(0.1, 8.0, (batch, length))
  return hidden, weight, labels, mask, advantages, ref_logp


@pytest.mark.parametrize("shards", [1, 2, 4])
@pytest.mark.parametrize("case", CASES)
def test_first_on_policy_step_has_ratio_exactly_one(case, shards, monkeypatch):
  _first_step(case, shards, SHAPE[3], SHAPE[4], monkeypatch)


@pytest.mark.parametrize("case", CASES)
def test_first_on_policy_step_at_an_unpadded_vocabulary(case, monkeypatch):
  """An odd width (Qwen's 151643 tokens, no padded columns): the objective path's kernels
  write their terms into a wider array (``mosaic_head.exp_width``) and the scoring pass
  reads the weight in blocks copied out; the bits are still the same."""
  _first_step(case, 1, 151643 if ON_GPU else 381, None, monkeypatch)


def _first_step(case, shards, columns, vocab_size, monkeypatch):
  options = CASES[case]
  if not ON_GPU:  # (one group: the interpreter's rows in the scoring pass's blocks)
    monkeypatch.setitem(jaxce.plan.LINEAR_OBJECTIVE_GRAD_PER_SUM, "cpu", 64.0)
  if case == "default" and not ON_GPU:
    pytest.skip("off GPUs the default plan runs XLA's sums, which promise no bits across "
                "paths (the 'mosaic' case runs Hopper's default in the interpreter)")
  if case == "mosaic" and not ON_GPU and not hasattr(plgpu, "InterpretGPUParams"):
    pytest.skip(f"the Mosaic GPU interpreter needs JAX >= 0.11 (this is {jax.__version__})")
  if case == "mosaic" and not ON_GPU and shards > 2:
    pytest.skip("off GPUs JAX's interpreter can stop for good with 4 simulated devices, "
                "on 2, 4 or 10 CPU cores alike (2 shards run here; a GPU host runs 4)")
  if shards > 1:
    mesh = Mesh(np.array(devices(shards)), ("vocab",))
    score_fn = functools.partial(jaxce.sharded_linear_logprobs_and_entropy, mesh=mesh,
                                 vocab_axis="vocab")
    loss_fn_of = functools.partial(jaxce.sharded_linear_token_loss, mesh=mesh,
                                   vocab_axis="vocab")
  else:
    score_fn, loss_fn_of = jaxce.linear_logprobs_and_entropy, jaxce.linear_token_loss
  hidden, weight, labels, mask, advantages, ref_logp = _batch(0, columns, vocab_size or columns)
  common = dict(temperature=0.9, where=mask, vocab_size=vocab_size, **options)

  @jax.jit
  def score(params, hidden):  # the rollout's scoring pass
    return score_fn(hidden, params, labels, **common)[0]

  objective = jaxce.objectives.grpo(EPSILON_LOW, EPSILON_HIGH, beta=0.04, entropy_coef=0.01)
  weights = jaxce.objectives.token_weights(mask)

  @jax.jit
  def train_step(params, hidden, old_logp):
    def loss_fn(params):
      return loss_fn_of(objective, hidden, params, labels, advantages, old_logp, ref_logp,
                        weights, **common)
    return jax.value_and_grad(loss_fn, has_aux=True)(params)

  old_logp = score(weight, hidden)
  (loss, (logp, entropy)), grad = train_step(weight, hidden, old_logp)
  ratio = jnp.exp(logp - old_logp)
  clipped = (ratio < 1 - EPSILON_LOW) | (ratio > 1 + EPSILON_HIGH)
  kept = np.asarray(mask)
  differing = np.asarray(logp)[kept].view(np.uint32) != np.asarray(old_logp)[kept].view(
      np.uint32)
  assert not differing.any(), (
      f"{case}, {shards} shard(s): {differing.sum()} of {kept.sum()} tokens' log-probs "
      f"differ from the scoring pass's, up to {float(jnp.max(jnp.abs(logp - old_logp))):.3g}")
  assert np.all(np.asarray(ratio)[kept] == 1.0) and not np.asarray(clipped)[kept].any()
  assert np.isfinite(float(loss)) and np.isfinite(np.asarray(grad, np.float32)).all()
  # (a nearly peaked row's entropy, 2e-10 in float64, rounds to within 1e-7 of 0 in f32,
  # on either side: the XLA path's too)
  assert entropy is not None and np.all(np.asarray(entropy)[kept] > -1e-7)
  assert np.median(np.asarray(entropy)[kept]) > 0.01
