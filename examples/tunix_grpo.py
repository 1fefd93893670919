"""GRPO steps through Tunix's own loss functions on Tunix's Qwen3: Tunix's ``grpo`` policy
loss against the jaxce-backed ``jaxce_grpo`` (``jaxce.integrations.tunix``).

    python -m examples.tunix_grpo                      # CPU: a tiny Qwen3, a few steps
    python -m examples.tunix_grpo --gpu --out r.json   # one GPU: D = 4096, V = 151936

The step is what Tunix's ``GRPOLearner`` runs once its rollouts are in: a
``TrainExample`` (prompts, completions, masks, group-relative advantages from Tunix's
``grpo`` advantage estimator over synthetic rewards, reference and old log-probs), the
registered policy loss under ``nnx.value_and_grad``, an optax AdamW update. (The learner
itself also needs rollout engines and a cluster, which are not what is compared here.)
Random init, synthetic prompts and rewards.

Each loss runs in a fresh process (its own ``peak_bytes_in_use``): the median step time
over ``--steps`` steps after ``--warmup``, the bytes in use before the first step
(parameters, optimizer state, batch) and the peak. With ``--gpu``: Qwen3-8B's width
(D = 4096, 32 heads of 128, 8 KV heads, MLP 12288) with ``--layers`` layers, V = 151936,
bf16, 16 sequences of a 128-token prompt and ``--completion`` completion tokens.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

LOSSES = ("grpo", "jaxce_grpo")
PAD, EOS = 0, 1


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--gpu", action="store_true", help="the realistic shape (one GPU)")
  p.add_argument("--out", help="JSON results (both losses)")
  p.add_argument("--losses", default=",".join(LOSSES))
  p.add_argument("--layers", type=int, default=2)
  p.add_argument("--completion", type=int, default=2048)
  p.add_argument("--steps", type=int, default=5)
  p.add_argument("--warmup", type=int, default=2)
  p.add_argument("--child", help=argparse.SUPPRESS)
  return p.parse_args(argv)


def build(args):
  """``(model, optimizer, example, config)`` of the chosen size."""
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  import numpy as np
  import optax
  from flax import nnx
  from tunix.models.qwen3 import model as qwen3
  from tunix.rl import algo_core, common
  from tunix.rl.grpo.grpo_learner import GRPOConfig

  import jaxce.integrations.tunix  # noqa: F401  (registers "jaxce_grpo")

  if args.gpu:
    shape = dict(num_layers=args.layers, vocab_size=151936, embed_dim=4096, hidden_dim=12288,
                 num_heads=32, head_dim=128, num_kv_heads=8)
    batch, prompt_len, completion_len, dtype = 16, 128, args.completion, jnp.bfloat16
  else:
    shape = dict(num_layers=2, vocab_size=1024, embed_dim=64, hidden_dim=128, num_heads=4,
                 head_dim=16, num_kv_heads=2)
    batch, prompt_len, completion_len, dtype = 8, 8, 24, jnp.float32
  config = qwen3.ModelConfig(**shape, rope_theta=1_000_000, norm_eps=1e-6, dtype=dtype,
                             param_dtype=dtype, use_tied_embedding=False)
  model = qwen3.Qwen3(config, rngs=nnx.Rngs(0))
  optimizer = nnx.Optimizer(model, optax.adamw(1e-5), wrt=nnx.Param)

  rng = np.random.default_rng(0)
  vocab = shape["vocab_size"]
  prompt = rng.integers(2, vocab, (batch, prompt_len))
  completion = rng.integers(2, vocab, (batch, completion_len))
  lengths = rng.integers(completion_len // 2, completion_len + 1, batch)
  mask = np.arange(completion_len)[None] < lengths[:, None]
  completion = np.where(mask, completion, PAD)
  rewards = rng.normal(size=batch)  # synthetic rewards, two generations per prompt
  advantages = algo_core.compute_advantages(rewards, num_generations=2)
  near = -np.log(vocab) + 0.1 * rng.normal(size=mask.shape)  # old / reference log-probs
  example = common.TrainExample(
      prompt_ids=jnp.asarray(prompt), prompt_mask=jnp.asarray(prompt != PAD),
      completion_ids=jnp.asarray(completion), completion_mask=jnp.asarray(mask, jnp.int32),
      advantages=jnp.asarray(advantages, jnp.float32),
      ref_per_token_logps=jnp.asarray(near, jnp.float32),
      old_per_token_logps=jnp.asarray(near + 0.05, jnp.float32))
  algo_config = GRPOConfig(num_generations=2, beta=0.04, epsilon=0.2)
  algo_config.temperature = 1.0  # set by GRPOLearner from the rollout config
  return model, optimizer, example, algo_config


def measure(args, loss_name: str) -> dict:
  """One loss's steps in this process."""
  import jax  # pylint: disable=import-outside-toplevel
  from flax import nnx
  from tunix.rl import function_registry

  model, optimizer, example, config = build(args)
  loss_fn = function_registry.get_policy_loss_fn(loss_name)

  @nnx.jit
  def step(model, optimizer, example):
    (loss, aux), grads = nnx.value_and_grad(
        lambda m: loss_fn(m, example, config, PAD, EOS), has_aux=True)(model)
    optimizer.update(model, grads)
    return loss, aux

  device = jax.devices()[0]
  stats = lambda key: (device.memory_stats() or {}).get(key)
  before = stats("bytes_in_use")
  start = time.perf_counter()
  loss, aux = jax.block_until_ready(step(model, optimizer, example))
  compile_s = time.perf_counter() - start
  losses, times = [float(loss)], []
  for i in range(args.warmup - 1 + args.steps):
    start = time.perf_counter()
    loss, aux = jax.block_until_ready(step(model, optimizer, example))
    if i >= args.warmup - 1:
      times.append((time.perf_counter() - start) * 1e3)
    losses.append(float(loss))
  peak = stats("peak_bytes_in_use")
  return dict(loss_fn=loss_name, device=device.device_kind, jax=jax.__version__,
              step_ms=statistics.median(times), step_ms_all=times, compile_s=compile_s,
              losses=losses, entropy=float(aux["entropy"]), kl=float(aux["kl"]),
              bytes_in_use_before_steps=before, peak_bytes_in_use=peak,
              peak_minus_before=None if peak is None else peak - before)


def main(argv=None):
  args = parse_args(argv)
  if args.child:
    print(json.dumps(measure(args, args.child)))
    return
  results = []
  for name in args.losses.split(","):  # a fresh process per loss: its own peak
    argv_child = [sys.executable, "-m", "examples.tunix_grpo", "--child", name,
                  "--layers", str(args.layers), "--completion", str(args.completion),
                  "--steps", str(args.steps), "--warmup", str(args.warmup)]
    argv_child += ["--gpu"] if args.gpu else []
    env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false")
    out = subprocess.run(argv_child, capture_output=True, text=True, env=env)
    if out.returncode:
      oom = "RESOURCE_EXHAUSTED" in out.stderr or "out of memory" in out.stderr.lower()
      results.append(dict(loss_fn=name, status="oom" if oom else "error",
                          error=out.stderr[-1500:]))
    else:
      results.append(dict(json.loads(out.stdout.strip().splitlines()[-1]), status="ok"))
    r = results[-1]
    if r["status"] == "ok":
      gib = lambda b: "n/a" if b is None else f"{b / 2**30:.2f} GiB"
      print(f"{name:>11}: step {r['step_ms']:.1f} ms, peak {gib(r['peak_bytes_in_use'])} "
            f"({gib(r['peak_minus_before'])} over params + optimizer + batch), losses "
            f"{[round(x, 5) for x in r['losses']]}")
    else:
      print(f"{name:>11}: {r['status']}: {r['error'][-300:]}")
  if args.out:
    commit = os.environ.get("JAXCE_COMMIT", "unknown")
    with open(args.out, "w") as f:
      json.dump(dict(commit=commit, gpu=args.gpu, layers=args.layers,
                     completion=args.completion, results=results), f, indent=1)


if __name__ == "__main__":
  main()
