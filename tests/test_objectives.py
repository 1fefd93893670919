"""The objective path (``token_loss``, ``linear_token_loss``): loss and every gradient
against float64 plain-JAX references for each built-in objective, on peaked logits with
masks, per-token temperature, a padded vocabulary, ragged chunks, bias and softcap; the
vocabulary split over 2, 4 and 8 simulated devices; three matmul passes where the general
path needs four; no gradient work without differentiation; memory flat in T."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh

from helpers import devices, jaxce, reference

objectives = jaxce.objectives
B, S, D, COLUMNS, VOCAB = 3, 7, 8, 96, 90
OBJECTIVES = {
    "grpo": objectives.grpo(0.2, 0.28, beta=0.04, entropy_coef=0.01),
    "grpo_k1_dual_clip": objectives.grpo(0.2, beta=0.1, kl_estimator="k1", dual_clip=3.0),
    "grpo_k2_no_entropy": objectives.grpo(0.2, beta=0.1, kl_estimator="k2"),
    "cispo": objectives.grpo(epsilon_high=0.3, beta=0.0, surrogate="cispo", entropy_coef=0.02),
    "ppo": lambda lp, h, adv, old, ref, w: w * objectives.clipped_surrogate(0.2)(lp, h, adv, old),
}


def _problem(seed=0, columns=COLUMNS, vocab=VOCAB):
  """Peaked, shifted logits through the head; masked and ignored tokens; token args."""
  rng = np.random.default_rng(seed)
  hidden = rng.normal(size=(B, S, D))
  weight = rng.normal(size=(D, columns)) * 0.8
  weight[:, rng.integers(0, vocab, 3)] *= 5  # peaked columns
  bias = rng.normal(size=columns) - 40.0  # shifted: all logits near -40
  labels = rng.integers(0, vocab, (B, S))
  labels[0, 2] = -100
  mask = rng.random((B, S)) < 0.85
  args = (rng.normal(size=(B, S)), -rng.uniform(0.5, 5, (B, S)), -rng.uniform(0.5, 5, (B, S)),
          np.asarray(objectives.token_weights(mask)))
  options = dict(temperature=rng.uniform(0.7, 1.3, (B, S)), where=mask, vocab_size=vocab)
  return hidden, weight, bias, labels, args, options


def _reference_loss(objective, labels, args, options, logits_fn):
  """The objective on the plain reference's (logp, entropy), summed over kept tokens."""
  def loss(*arrays):
    logp, entropy = logits_fn(*arrays)
    valid = (labels >= 0) & options["where"]
    return jnp.sum(jnp.where(valid, objective(logp, entropy, *args), 0))
  return loss


def _close(actual, expected, rtol, what):
  """Max abs error within ``rtol`` of the reference's largest magnitude (at least 1): the
  k3 penalty of a token far from the reference is exp of a large gap."""
  expected = np.asarray(expected, np.float64)
  err = float(np.max(np.abs(np.asarray(actual, np.float64) - expected)))
  limit = rtol * max(1.0, float(np.max(np.abs(expected))))
  assert np.isfinite(err) and err <= limit, f"{what}: {err:.3e} > {limit:.1e}"


@pytest.mark.parametrize("name", list(OBJECTIVES))
@pytest.mark.parametrize("chunk_size", [None, 4])
def test_fused_objective_matches_reference(name, chunk_size):
  objective = OBJECTIVES[name]
  hidden, weight, bias, labels, args, options = _problem()
  head = dict(bias=bias, logit_softcap=50.0)
  ref = _reference_loss(objective, labels, args, options, lambda h, w, b: (
      reference.linear_logprobs_and_entropy(h, w, labels, **dict(head, bias=b), **options)))
  value, grads = jax.value_and_grad(ref, (0, 1, 2))(hidden, weight, bias)
  f = lambda h, w, b: jaxce.linear_token_loss(objective, h, w, labels, *args, chunk_size=chunk_size,
                                              **dict(head, bias=b), **options)[0]
  got, got_grads = jax.jit(jax.value_and_grad(f, (0, 1, 2)))(hidden, weight, bias)
  _close(got, value, 1e-10, "loss")
  for what, g, r in zip(("d hidden", "d weight", "d bias"), got_grads, grads):
    _close(g, r, 1e-10, what)


@pytest.mark.parametrize("chunk_size, grad_chunk", [(5, 5), (5, 20), (4, 12), (3, 21)])
def test_fused_objective_gradient_groups(chunk_size, grad_chunk, monkeypatch):
  """Chunks' d logits gathered into groups for the gradient matmuls (T = 21): one chunk a
  group, a group clamped back over 19 rows of the one before, groups that divide T's
  chunks, one group of 7 chunks (the last clamped inside it); the planned group is used."""
  monkeypatch.setattr(jaxce.plan, "linear_objective_grad_chunk", lambda *a, **k: grad_chunk)
  objective = OBJECTIVES["grpo"]
  hidden, weight, bias, labels, args, options = _problem(8)
  assert jaxce.plan.of(jaxce.linear_token_loss, objective, hidden, weight, labels, *args,
                       chunk_size=chunk_size, **options).grad_chunk == grad_chunk
  ref = _reference_loss(objective, labels, args, options, lambda h, w, b: (
      reference.linear_logprobs_and_entropy(h, w, labels, bias=b, **options)))
  value, grads = jax.value_and_grad(ref, (0, 1, 2))(hidden, weight, bias)
  f = lambda h, w, b: jaxce.linear_token_loss(objective, h, w, labels, *args, bias=b,
                                              chunk_size=chunk_size, **options)
  (got, (logp, _)), got_grads = jax.jit(jax.value_and_grad(f, (0, 1, 2), has_aux=True))(
      hidden, weight, bias)
  _close(got, value, 1e-10, "loss")
  _close(logp, reference.linear_logprobs_and_entropy(hidden, weight, labels, bias=bias,
                                                     **options)[0], 1e-10, "logp")
  for what, g, r in zip(("d hidden", "d weight", "d bias"), got_grads, grads):
    _close(g, r, 1e-10, what)


def test_objective_grad_chunk_plan():
  """Whole chunks within the budget and T, a count dividing T's chunks when one is within
  a factor 2, else the fewest even groups (a clamped last group repeats the fewest
  chunks); the chunk itself when one chunk's d logits are over the budget."""
  budget = jaxce.plan.LINEAR_OBJECTIVE_GRAD_BYTES["gpu"]
  grad_chunk = lambda t, v, c: jaxce.plan.linear_objective_grad_chunk(t, v, c, "gpu")
  columns = budget // (2 * 1024 * 6)  # 6 chunks of 1024 fit
  assert grad_chunk(32768, columns, 1024) == 4096  # 32 chunks: 4 divides, 6 and 5 do not
  assert grad_chunk(6 * 1024, columns, 1024) == 6144
  # No count in [3, 6] divides 7: two groups of 4 (one chunk done twice), not two of 6
  # (the second clamped back over five)
  assert grad_chunk(7 * 1024, columns, 1024) == 4096
  # Whole chunks in T only (4 of the 5), and no count in [2, 4] divides 5: two groups of 3
  assert grad_chunk(4 * 1024 + 10, columns, 1024) == 3072
  assert grad_chunk(5 * 1024 + 10, columns, 1024) == 3072  # 3 divides 6 chunks
  assert grad_chunk(512, columns, 1024) == 1024  # (a padded, batch-invariant chunk)
  assert grad_chunk(32768, budget, 1024) == 1024


@pytest.mark.parametrize("depth", [1024, 4096, 5120])
@pytest.mark.parametrize("columns", [151936, 37984, 248320, 62080])
def test_objective_kernel_groups_at_the_shapes_users_run(columns, depth):
  """The fused objective path's groups on the GPU's budgets (one head kernel call per
  group, its ``[group, V_local]`` terms held): each a multiple of the gradient kernel's 64
  rows, at least 256, its terms within both budgets; the fewest groups those allow; and
  their rows cover ``T`` with less than a block per group over (a group twice the size,
  or twice as many, fails). Ragged and round ``T`` from 1000 to 262144 tokens."""
  budget = min(jaxce.plan.LINEAR_OBJECTIVE_GRAD_BYTES["gpu"],
               int(jaxce.plan.LINEAR_OBJECTIVE_GRAD_PER_SUM["gpu"] * 4 * depth * columns))
  most = budget // (2 * columns) // 64 * 64  # (rows of bf16 terms within the budget)
  for tokens in (1000, 8184, 32768, 100000, 262144):
    chunk, group = jaxce.plan.linear_objective_kernel_tiles(tokens, columns, None, "gpu", 2,
                                                           depth)
    assert chunk == group and group % 64 == 0 and group >= 256, (tokens, group)
    assert group * columns * 2 <= max(budget, 256 * columns * 2), (tokens, group)
    groups = -(-tokens // group)
    assert groups == -(-tokens // max(most, 256)), (tokens, group, most)
    assert groups * group - tokens < 64 * groups or group == 256, (tokens, group)


@pytest.mark.parametrize("name", list(OBJECTIVES))
@pytest.mark.parametrize("chunk_size", [None, 4])
def test_logits_objective_matches_reference(name, chunk_size):
  objective = OBJECTIVES[name]
  hidden, weight, bias, labels, args, options = _problem(1)
  logits = hidden @ weight + bias
  ref = _reference_loss(objective, labels, args, options, lambda x: (
      reference.logprobs_and_entropy(x, labels, **options)))
  value, grad = jax.value_and_grad(ref)(logits)
  f = lambda x: jaxce.token_loss(objective, x, labels, *args, chunk_size=chunk_size, **options)[0]
  got, got_grad = jax.jit(jax.value_and_grad(f))(logits)
  _close(got, value, 1e-10, "loss")
  _close(got_grad, grad, 1e-10, "d logits")


def test_outputs_are_metrics_without_gradient():
  """(logp, entropy) come back as the reference's, under stop_gradient; an objective that
  does not use the entropy computes none (None) unless asked for it."""
  hidden, weight, bias, labels, args, options = _problem(2)
  logp_r, entropy_r = reference.linear_logprobs_and_entropy(hidden, weight, labels, bias=bias,
                                                            **options)
  loss, (logp, entropy) = jaxce.linear_token_loss(OBJECTIVES["grpo"], hidden, weight, labels,
                                                  *args, bias=bias, **options)
  _close(logp, logp_r, 1e-10, "logp")
  _close(entropy, entropy_r, 1e-10, "entropy")
  no_entropy = OBJECTIVES["grpo_k2_no_entropy"]
  assert jaxce.linear_token_loss(no_entropy, hidden, weight, labels, *args, bias=bias,
                                 **options)[1][1] is None
  _, (_, entropy) = jaxce.linear_token_loss(no_entropy, hidden, weight, labels, *args,
                                            bias=bias, return_entropy=True, **options)
  _close(entropy, entropy_r, 1e-10, "entropy for metrics")
  metric_grad = jax.grad(lambda h: jnp.sum(jaxce.linear_token_loss(
      OBJECTIVES["grpo"], h, weight, labels, *args, bias=bias, **options)[1][0]))(hidden)
  assert not np.any(metric_grad)


def test_ignored_tokens_contribute_nothing():
  """An objective that is NaN at ignored tokens (a NaN token argument there) gives a
  finite loss and exactly zero gradient rows for them."""
  hidden, weight, bias, labels, args, options = _problem(3)
  advantages = np.where(options["where"], args[0], np.nan)
  ignored = ~options["where"] | (labels < 0)
  loss, grads = jax.value_and_grad(lambda h, w: jaxce.linear_token_loss(
      OBJECTIVES["ppo"], h, w, labels, advantages, *args[1:], bias=bias, **options)[0],
      (0, 1))(hidden, weight)
  assert np.isfinite(loss) and np.all(np.isfinite(grads[1]))
  assert np.all(np.asarray(grads[0])[ignored] == 0)


@pytest.mark.parametrize("shards", [2, 4, 8])
def test_sharded_objective_matches_unsharded(shards):
  """The vocabulary split over simulated devices (the columns padded to divide), through
  both wrappers, and with the batch split too (2 x 2)."""
  columns = 96  # divides by 2, 4 and 8
  hidden, weight, bias, labels, args, options = _problem(4, columns=columns)
  objective = OBJECTIVES["grpo"]
  mesh = Mesh(np.array(devices(shards)), ("v",))
  fused = lambda f: jax.jit(jax.value_and_grad(lambda h, w, b: f(
      objective, h, w, labels, *args, bias=b, chunk_size=5, **options)[0], (0, 1, 2)))
  expected = fused(jaxce.linear_token_loss)(hidden, weight, bias)
  got = fused(lambda *a, **k: jaxce.sharded_linear_token_loss(*a, mesh=mesh, vocab_axis="v", **k))(
      hidden, weight, bias)
  for g, e in zip(jax.tree.leaves(got), jax.tree.leaves(expected)):
    _close(g, e, 1e-10, f"fused, {shards} shards")
  logits = hidden @ weight + bias
  on_logits = lambda f: jax.jit(jax.value_and_grad(lambda x: f(
      objective, x, labels, *args, chunk_size=5, **options)[0]))
  expected = on_logits(jaxce.token_loss)(logits)
  got = on_logits(lambda *a, **k: jaxce.sharded_token_loss(*a, mesh=mesh, vocab_axis="v", **k))(
      logits)
  for g, e in zip(jax.tree.leaves(got), jax.tree.leaves(expected)):
    _close(g, e, 1e-10, f"logits, {shards} shards")


def test_batch_and_vocab_split_and_explicit_arrays():
  """A 2 x 2 (batch x vocab) mesh through the wrapper, and the plain function on arrays
  split over an explicit mesh (jax.make_mesh's default): the loss sums every shard."""
  hidden, weight, bias, labels, args, options = _problem(5)
  hidden, labels = hidden[:2], labels[:2]  # a batch of 2 over 2 data shards
  args = tuple(a[:2] for a in args)
  options = {k: v[:2] if np.ndim(v) else v for k, v in options.items()}
  objective = OBJECTIVES["grpo"]
  f = lambda h, w, **k: jaxce.linear_token_loss(objective, h, w, labels, *args, bias=bias,
                                                chunk_size=3, **options, **k)[0]
  expected = jax.value_and_grad(f, (0, 1))(hidden, weight)
  mesh = Mesh(np.array(devices(4)).reshape(2, 2), ("data", "v"))
  wrapped = jax.jit(jax.value_and_grad(lambda h, w: jaxce.sharded_linear_token_loss(
      objective, h, w, labels, *args, bias=bias, chunk_size=3, mesh=mesh, vocab_axis="v",
      batch_axis="data", **options)[0], (0, 1)))(hidden, weight)
  for g, e in zip(jax.tree.leaves(wrapped), jax.tree.leaves(expected)):
    _close(g, e, 1e-10, "2 x 2 mesh")
  explicit = jax.make_mesh((2, 2), ("data", "v"), devices=jax.devices()[:4],
                           axis_types=(jax.sharding.AxisType.Explicit,) * 2)
  put = lambda a, *spec: jax.device_put(a, jax.sharding.NamedSharding(explicit, jax.P(*spec)))
  with jax.set_mesh(explicit):  # explicit sharding's own rule for eager calls
    got = jax.value_and_grad(f, (0, 1))(put(hidden, "data"), put(weight, None, "v"))
  for g, e in zip(jax.tree.leaves(got), jax.tree.leaves(expected)):
    _close(g, e, 1e-10, "explicit arrays")


def _matmul_flops(jaxpr, repeat=1):
  """Flops of every dot_general in ``jaxpr``, scans counted ``length`` times."""
  total = 0
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "dot_general":
      (contract, _), _ = eqn.params["dimension_numbers"]
      lhs = eqn.invars[0].aval.shape
      k = int(np.prod([lhs[d] for d in contract]))
      total += 2 * int(np.prod(eqn.outvars[0].aval.shape)) * k * repeat
    times = eqn.params.get("length", 1) if eqn.primitive.name == "scan" else 1
    for param in eqn.params.values():
      for sub in (param if isinstance(param, (tuple, list)) else (param,)):
        inner = getattr(sub, "jaxpr", sub)
        if hasattr(inner, "eqns"):
          total += _matmul_flops(inner, repeat * times)
  return total


def test_fused_objective_runs_three_matmuls_general_path_four():
  """Counted in the jaxprs, scan lengths included (T = 64 in chunks of 16, V = 256):
  value and gradients with the objective path are 3 x 2 T D V flops; the general path
  with the same objective 4 x; the loss alone (no differentiation) 1 x."""
  tokens, dim, columns = 64, 16, 256
  rng = np.random.default_rng(6)
  hidden, weight = rng.normal(size=(tokens, dim)), rng.normal(size=(dim, columns))
  labels = rng.integers(0, columns, tokens)
  args = (rng.normal(size=tokens), -np.ones(tokens), -np.ones(tokens), np.ones(tokens))
  objective, unit = OBJECTIVES["grpo"], 2 * tokens * dim * columns
  fused = lambda h, w: jaxce.linear_token_loss(objective, h, w, labels, *args, chunk_size=16)[0]

  def general(h, w):
    logp, entropy = jaxce.linear_logprobs_and_entropy(h, w, labels, chunk_size=16)
    return jnp.sum(objective(logp, entropy, *args))

  flops = lambda f: _matmul_flops(jax.make_jaxpr(f)(hidden, weight).jaxpr)
  assert flops(jax.value_and_grad(fused, (0, 1))) == 3 * unit
  assert flops(jax.value_and_grad(general, (0, 1))) == 4 * unit
  assert flops(fused) == unit


def test_fused_objective_memory_is_flat_in_tokens(monkeypatch):
  """XLA's compiled plan of value and gradients: no [T, V] buffer, and 4x the tokens add
  no more than 4x the d hidden output's growth (the rest is the f32 [D, V] d W sum, one
  chunk's rows and one group's d logits, the same at any T: groups of 2 chunks here, on
  every platform; on GPUs also cuBLAS's 32 MiB workspace)."""
  dim, columns, chunk = 32, 16384, 64
  objective = OBJECTIVES["grpo"]
  for platform in ("gpu", "cpu"):
    monkeypatch.setitem(jaxce.plan.LINEAR_OBJECTIVE_GRAD_BYTES, platform, 8 * 2**20)

  def temp_bytes(tokens):
    shapes = [jax.ShapeDtypeStruct((tokens, dim), jnp.float32),
              jax.ShapeDtypeStruct((dim, columns), jnp.float32)]
    token = lambda dtype=jnp.float32: jax.ShapeDtypeStruct((tokens,), dtype)
    f = lambda h, w, l, *a: jaxce.linear_token_loss(objective, h, w, l, *a, chunk_size=chunk)[0]
    plan = jax.jit(jax.value_and_grad(f, (0, 1))).lower(
        *shapes, token(jnp.int32), *(token() for _ in range(4))).compile()
    return plan.memory_analysis().temp_size_in_bytes

  small, large = temp_bytes(1024), temp_bytes(4096)
  logits_bytes = 4096 * columns * 4
  assert large < logits_bytes / 4, (large, logits_bytes)
  assert large - small <= 4 * (4096 - 1024) * dim * 4 + 4 * 4096 * 16, (small, large)


def test_objective_errors_name_the_problem():
  hidden, weight, bias, labels, args, options = _problem(7)
  logits = hidden @ weight
  with pytest.raises(ValueError, match=r"combines tokens \(reduce_sum\).*per-token"):
    jaxce.token_loss(lambda lp, h, a: lp - jnp.mean(lp), logits, labels, args[0])
  with pytest.raises(ValueError, match=r"combines tokens \(cumsum\)"):
    jaxce.linear_token_loss(lambda lp, h: jnp.cumsum(lp), hidden, weight, labels)
  with pytest.raises(TypeError, match=r"objective must return one float array"):
    jaxce.token_loss(lambda lp, h: (lp, h), logits, labels)
  with pytest.raises(TypeError, match=r"objective must be a function"):
    jaxce.token_loss("grpo", logits, labels)
  with pytest.raises(ValueError, match=r"return_entropy=False.*uses the entropy"):
    jaxce.token_loss(OBJECTIVES["grpo"], logits, labels, *args, return_entropy=False)
  with pytest.raises(ValueError, match=r"token_args\[1\] must be broadcastable"):
    jaxce.token_loss(OBJECTIVES["ppo"], logits, labels, args[0], np.ones(5), *args[2:])
  with pytest.raises(TypeError, match=r"vocab_block_size"):
    jaxce.linear_token_loss(OBJECTIVES["ppo"], hidden, weight, labels, *args,
                            vocab_block_size=16)


def test_token_weights_normalize_like_the_frameworks():
  mask = np.array([[1, 1, 0, 0], [1, 1, 1, 1]], bool)
  terms = np.array([[1.0, 3.0, 9.0, 9.0], [2.0, 2.0, 2.0, 6.0]])
  total = lambda mode, **k: float(np.sum(objectives.token_weights(mask, mode, **k) * terms))
  assert total("token_mean") == pytest.approx((1 + 3 + 2 + 2 + 2 + 6) / 6)
  assert total("sequence_mean_token_mean") == pytest.approx((2.0 + 3.0) / 2)
  assert total("constant", max_length=8) == pytest.approx(16 / (2 * 8))
  with pytest.raises(ValueError, match="mode"):
    objectives.token_weights(mask, "sum")


@pytest.mark.parametrize("path", ["fused", "logits"])
def test_objective_path_is_as_exact_as_the_general_path(path):
  """bf16 inputs, float64 reference on the same values: the objective path's loss,
  log-probs and gradients are no further from it than the per-token path + autodiff
  (both compute in f32; a margin of 1e-6 of the scale for rounding order)."""
  hidden, weight, bias, labels, args, options = _problem(8)
  objective = OBJECTIVES["grpo"]
  bf16 = lambda a: jnp.asarray(a, jnp.bfloat16)
  if path == "fused":
    arrays, exact = (bf16(hidden), bf16(weight)), (jnp.asarray(bf16(hidden), jnp.float64),
                                                   jnp.asarray(bf16(weight), jnp.float64))
    per_token = lambda fn: lambda h, w: fn(h, w, labels, bias=bias, **options)
    fused = lambda h, w: jaxce.linear_token_loss(objective, h, w, labels, *args, bias=bias,
                                                 chunk_size=4, **options)
    general = per_token(jaxce.linear_logprobs_and_entropy)
    ref = per_token(reference.linear_logprobs_and_entropy)
  else:
    logits = hidden @ weight + bias
    arrays, exact = (bf16(logits),), (jnp.asarray(bf16(logits), jnp.float64),)
    per_token = lambda fn: lambda x: fn(x, labels, **options)
    fused = lambda x: jaxce.token_loss(objective, x, labels, *args, **options)
    general = per_token(jaxce.logprobs_and_entropy)
    ref = per_token(reference.logprobs_and_entropy)
  valid = (labels >= 0) & options["where"]
  total = lambda outputs: jnp.sum(jnp.where(valid, objective(*outputs, *args), 0))
  argnums = tuple(range(len(arrays)))
  ref_value, ref_grads = jax.value_and_grad(lambda *a: total(ref(*a)), argnums)(*exact)
  ref_logp = ref(*exact)[0]
  (value, (logp, _)), grads = jax.value_and_grad(lambda *a: fused(*a), argnums, has_aux=True)(
      *arrays)
  general_value, general_grads = jax.value_and_grad(lambda *a: total(general(*a)), argnums)(
      *arrays)
  general_logp = general(*arrays)[0]
  error = lambda a, r: float(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(r))))
  scale = lambda r: 1e-6 * max(1.0, float(np.max(np.abs(np.asarray(r)))))
  assert error(value, ref_value) <= error(general_value, ref_value) + scale(ref_value)
  assert error(logp, ref_logp) <= error(general_logp, ref_logp) + scale(ref_logp)
  for g, gg, r in zip(grads, general_grads, ref_grads):
    assert error(g, r) <= error(gg, r) + scale(r)


@pytest.mark.parametrize("softcap", [None, 5.0])
def test_ignored_nan_hidden_state_stays_out_of_the_fused_objective_grads(softcap):
  """A padding row with a NaN hidden state (ignored by its label): the loss and every
  gradient stay finite, with a softcap too (its factor of a NaN logit is NaN)."""
  rng = np.random.default_rng(0)
  hidden = jnp.asarray(rng.normal(size=(6, 8)), jnp.float32).at[2].set(jnp.nan)
  weight = jnp.asarray(rng.normal(size=(8, 50)), jnp.float32)
  labels = jnp.asarray([1, 2, -100, 4, 5, 6])
  advantages = jnp.asarray(rng.normal(size=6), jnp.float32)
  loss = lambda h, w: jaxce.linear_token_loss(lambda logp, ent, a: -a * logp, h, w, labels,
                                              advantages, logit_softcap=softcap)[0]
  value, (d_hidden, d_weight) = jax.value_and_grad(loss, (0, 1))(hidden, weight)
  assert np.isfinite(value) and np.isfinite(d_weight).all()
  assert np.all(d_hidden[2] == 0) and np.isfinite(d_hidden).all()
