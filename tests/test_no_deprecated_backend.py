"""No default path runs JAX's deprecated Pallas Triton backend: every public function and
its gradient, with the default options, ``batch_invariant=True`` and a kept set, in a
fresh process with ``DeprecationWarning`` turned into an error, and the Triton backend
never imported. Meaningful on GPUs (the GPU tally runs it); on CPUs XLA runs every call
and the test checks the same."""

import os
import subprocess
import sys
import textwrap

CALLS = textwrap.dedent("""
    import sys, warnings
    import jax, jax.numpy as jnp, numpy as np
    import jaxce
    warnings.filterwarnings("error", category=DeprecationWarning)
    rng = np.random.default_rng(0)
    T, D, V = 512, 128, 1024
    logits = jnp.asarray(rng.normal(size=(T, V)) * 3, jnp.bfloat16)
    hidden = jnp.asarray(rng.normal(size=(T, D)), jnp.bfloat16)
    weight = jnp.asarray(rng.normal(size=(D, V)) * 0.1, jnp.bfloat16)
    labels = jnp.asarray(rng.integers(0, V, T), jnp.int32)
    adv = jnp.asarray(rng.normal(size=T), jnp.float32)
    t = jnp.asarray(rng.uniform(0.7, 1.3, T), jnp.float32)
    keep = jaxce.keep.pack(jnp.asarray(rng.random((T, V)) < 0.3) | (
        jnp.arange(V) == labels[:, None]))
    objective = lambda logp, entropy, adv: -adv * logp - 0.01 * entropy
    mesh = jax.make_mesh((1,), ("v",))
    per_token = lambda o: jnp.sum(o[0]) + jnp.sum(o[1])
    calls = {
        "logprobs_and_entropy": (lambda x, **k: per_token(jaxce.logprobs_and_entropy(
            x, labels, temperature=t, **k)), (logits,)),
        "token_loss": (lambda x, **k: jaxce.token_loss(objective, x, labels, adv,
                                                       temperature=t, **k)[0], (logits,)),
        "linear_logprobs_and_entropy": (lambda h, w, **k: per_token(
            jaxce.linear_logprobs_and_entropy(h, w, labels, temperature=t, **k)),
            (hidden, weight)),
        "linear_token_loss": (lambda h, w, **k: jaxce.linear_token_loss(
            objective, h, w, labels, adv, temperature=t, **k)[0], (hidden, weight)),
        "sharded_logprobs_and_entropy": (lambda x, **k: per_token(
            jaxce.sharded_logprobs_and_entropy(x, labels, mesh=mesh, vocab_axis="v", **k)),
            (logits,)),
        "sharded_linear_token_loss": (lambda h, w, **k: jaxce.sharded_linear_token_loss(
            objective, h, w, labels, adv, mesh=mesh, vocab_axis="v", **k)[0],
            (hidden, weight)),
    }
    for name, (fn, arrays) in calls.items():
        for options in ({}, dict(batch_invariant=True), dict(keep=keep)):
            value, grads = jax.jit(jax.value_and_grad(
                lambda *a: fn(*a, **options), tuple(range(len(arrays)))))(*arrays)
            assert np.isfinite(float(value)), (name, options)
            plan = jaxce.plan.of(lambda *a: fn(*a, **options), *arrays)
            print(name, sorted(options), plan.backend)
            assert plan.backend != "triton", (name, options, plan)
    loaded = [m for m in sys.modules if m.startswith("jax._src.pallas.triton")]
    assert not loaded, loaded
    print("ok")
""")


def test_no_public_call_runs_the_deprecated_triton_backend():
  env = dict(os.environ)
  out = subprocess.run([sys.executable, "-c", CALLS], capture_output=True, text=True, env=env,
                       timeout=900)
  assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stdout + out.stderr
