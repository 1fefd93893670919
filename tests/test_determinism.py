"""Determinism: repeated calls are bitwise identical, plans change results only by
rounding, and repeated calls with the same shapes neither retrace nor recompile."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from strategies import jaxce, max_error, run_jaxce, simple_inputs, vocab_mesh

T, D = 37, 16
COLUMNS = {"logits": 1008, "linear": 200}  # both divisible by 2 and 4 shards
EAGER_SHARDED_BUG = ("bug: a plain eager call of the shard_map wrappers raises "
                     "NotImplementedError 'custom_vjp symbolic_zeros support with shard_map "
                     "is not implemented'")


def _inputs(path, dtype=np.float32):
  return simple_inputs(path, (T,), columns=COLUMNS[path], hidden=D, dtype=dtype)


def _assert_identical(a, b):
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
    np.testing.assert_array_equal(x, y)


def _ulp_tolerance(expected, ulps, dtype):
  """``ulps`` f32 ulps of the array's scale ``max(1, max |expected|)``; bf16 arrays may
  also round to the adjacent bf16 value (2^-7 of the scale)."""
  scale = max(1.0, float(np.max(np.abs(np.asarray(expected, np.float64)), initial=0.0)))
  tol = ulps * np.finfo(np.float32).eps * scale
  return tol + (2.0**-7 * scale if dtype == jnp.bfloat16 else 0.0)


def _assert_within_ulps(actual, expected, ulps, what):
  (out_a, grads_a), (out_e, grads_e) = actual, expected
  pairs = [("logp", out_a[0], out_e[0]), ("entropy", out_a[1], out_e[1])] + [
      (f"d {k}", grads_a[k], grads_e[k]) for k in sorted(grads_e)]
  for name, a, e in pairs:
    err, tol = max_error(a, e), _ulp_tolerance(e, ulps, e.dtype)
    assert err <= tol, f"{what}: {name} differs by {err:.2e} > {tol:.1e}"


@pytest.mark.parametrize("path", ["logits", "linear"])
@pytest.mark.parametrize("shards", [1, 2])
def test_repeated_jit_calls_are_bitwise_identical(path, shards):
  inputs = _inputs(path)
  first = run_jaxce(path, inputs, shards=shards, chunk_size=8)
  for _ in range(2):
    _assert_identical(run_jaxce(path, inputs, shards=shards, chunk_size=8), first)


@pytest.mark.parametrize("path", ["logits", "linear"])
def test_repeated_eager_calls_are_bitwise_identical_and_match_jit(path):
  inputs = _inputs(path)
  first = run_jaxce(path, inputs, jit=False, chunk_size=8)
  _assert_identical(run_jaxce(path, inputs, jit=False, chunk_size=8), first)
  _assert_within_ulps(first, run_jaxce(path, inputs, chunk_size=8), 4, "eager vs jit")


@pytest.mark.parametrize("path", ["logits", "linear"])
def test_sharded_wrappers_work_eagerly(path):
  """A plain forward call, no jit and no grad (under grad or jit they work)."""
  diff, rest, _ = jax.tree.map(jnp.asarray, _inputs(path))
  fn = (jaxce.sharded_logprobs_and_entropy if path == "logits"
        else jaxce.sharded_linear_logprobs_and_entropy)
  call = lambda diff: fn(**diff, **rest, mesh=vocab_mesh(2), vocab_axis="v", chunk_size=8)
  eager, jitted = call(diff), jax.jit(call)(diff)
  for a, b in zip(eager, jitted):
    assert max_error(a, b) <= _ulp_tolerance(b, 4, np.float32)


@pytest.mark.parametrize("dtype", [np.float32, jnp.bfloat16])
@pytest.mark.parametrize("path,options", [
    ("logits", [dict(chunk_size=c) for c in (1, 5, 16, 36, 100)]
     + [dict(implementation="pallas")]),
    ("linear", [dict(chunk_size=c, vocab_block_size=b)
                for c, b in ((1, 7), (5, 64), (36, None), (100, 7), (5, None))]
     + [dict(chunk_size=5, vocab_block_size=7, implementation="pallas")]),
])
def test_plans_change_results_only_by_rounding(path, options, dtype):
  """Against the default plan: values and gradients within 16 f32 ulps of their scale
  (the same sums in another order), bf16 gradients within one bf16 rounding step."""
  inputs = _inputs(path, dtype)
  default = run_jaxce(path, inputs)
  for option in options:
    _assert_within_ulps(run_jaxce(path, inputs, **option), default, 16, str(option))


def _call(path, arrays, shards=1, **options):
  """``sum(a * logp) + sum(b * entropy)`` and its gradient, for a jitted wrapper."""
  fn = {("logits", 1): jaxce.logprobs_and_entropy,
        ("linear", 1): jaxce.linear_logprobs_and_entropy,
        ("logits", 2): jaxce.sharded_logprobs_and_entropy,
        ("linear", 2): jaxce.sharded_linear_logprobs_and_entropy}[path, shards]
  if shards > 1:
    options.update(mesh=vocab_mesh(shards), vocab_axis="v")
  diff, rest, (a, b) = arrays

  def loss(diff):
    logp, entropy = fn(**diff, **rest, **options)
    return jnp.sum(a * logp) + jnp.sum(b * entropy)

  return jax.value_and_grad(loss)(diff)


@pytest.mark.parametrize("path", ["logits", "linear"])
@pytest.mark.parametrize("shards", [1, 2])
def test_no_retracing_on_repeated_calls(path, shards):
  """New values of every array (logits, labels, per-token temperature, mask) with the same
  shapes reuse the trace."""
  chex.clear_trace_counter()
  step = jax.jit(chex.assert_max_traces(
      lambda arrays: _call(path, arrays, shards, chunk_size=8), n=1))
  for seed in range(3):
    diff, rest, cot = simple_inputs(path, (T,), columns=COLUMNS[path], hidden=D, seed=seed)
    rng = np.random.default_rng(seed)
    rest.update(temperature=rng.uniform(0.5, 2, T).astype(np.float32),
                where=rng.random(T) < 0.8)
    jax.block_until_ready(step(jax.tree.map(jnp.asarray, (diff, rest, cot))))


_compiles = []


def _on_event(name, *unused_args, **unused_kwargs):
  if name == "/jax/core/compile/backend_compile_duration":  # one per XLA compilation
    _compiles.append(name)


jax.monitoring.register_event_duration_secs_listener(_on_event)


def _compilations(call):
  """Number of XLA compilations while running ``call()``."""
  _compiles.clear()
  jax.block_until_ready(call())
  return len(_compiles)


@pytest.mark.parametrize("path", ["logits", "linear"])
def test_repeated_eager_calls_do_not_recompile(path):
  # A shape no other test uses, so that the first call must compile.
  arrays = jax.tree.map(jnp.asarray, simple_inputs(path, (29,), columns=96, hidden=D))
  call = lambda: _call(path, arrays, chunk_size=8)
  assert _compilations(call) > 0, "no compilation seen: is the monitoring event still sent?"
  repeated = _compilations(call)
  assert repeated == 0, f"{repeated} compilations on a repeated eager call"
