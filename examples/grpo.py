"""GRPO on a toy task with a small Flax NNX LM, log-probs and entropies from jaxce.

    python -m examples.grpo                              # one CPU device, jaxce.linear_token_loss
    python -m examples.grpo --path linear                # fused per-token log-probs + autodiff
    python -m examples.grpo --path logits                # jaxce on materialized logits
    python -m examples.grpo --path plain                 # jax.nn.log_softmax, for comparison
    python -m examples.grpo --mesh 2,4                   # data x vocab mesh (8 CPU devices)
    python -m examples.grpo --mesh 2,4 --sequence-parallel  # the batch over all 8 devices
    python -m examples.grpo --pmap                       # data parallel, jax.pmap

Each iteration samples ``group_size`` completions per prompt at ``--temperature``, rewards
each by the fraction of its tokens in the first quarter of the vocabulary (a toy task the
policy can learn), normalizes rewards within groups, scores the rollouts with the sampling
policy and the frozen reference policy (no gradient), then takes ``--inner-steps``
optimizer steps on them and prints the metrics of each.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax import lax

from examples import model as model_lib
from examples.loss import PATHS, GRPOConfig, completion_mask, group_advantages
from examples.train import Runner, make_mesh, make_optimizer, synthetic_rollouts

PAD, EOS = 0, 1


def parse_args(argv=None) -> argparse.Namespace:
  """The example's flags (sizes, loss options, layout); also used by the tests."""
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                              formatter_class=argparse.ArgumentDefaultsHelpFormatter)
  p.add_argument("--vocab", type=int, default=32768)
  p.add_argument("--d-model", type=int, default=64)
  p.add_argument("--layers", type=int, default=2)
  p.add_argument("--heads", type=int, default=4)
  p.add_argument("--prompts", type=int, default=4, help="prompts per batch")
  p.add_argument("--group-size", type=int, default=4, help="completions per prompt")
  p.add_argument("--prompt-len", type=int, default=8)
  p.add_argument("--completion-len", type=int, default=24)
  p.add_argument("--iterations", type=int, default=4, help="sample -> update rounds")
  p.add_argument("--inner-steps", type=int, default=2, help="optimizer steps per batch")
  p.add_argument("--path", choices=PATHS, default="objective")
  p.add_argument("--mesh", default=None, help="'data,vocab' sizes, e.g. 2,4")
  p.add_argument("--sequence-parallel", action="store_true",
                 help="with --mesh: the batch split over every device, the token embedding's "
                 "rows over vocab (GRPOConfig.sequence_parallel)")
  p.add_argument("--pmap", action="store_true", help="data parallel over local devices")
  p.add_argument("--cpu-devices", type=int, default=None,
                 help="simulated CPU devices (default: what --mesh / --pmap need)")
  p.add_argument("--temperature", type=float, default=0.8)
  p.add_argument("--clip-eps", type=float, default=0.2)
  p.add_argument("--kl-coef", type=float, default=0.04)
  p.add_argument("--entropy-coef", type=float, default=0.0)
  p.add_argument("--optimizer", choices=("adam", "sgd"), default="adam")
  p.add_argument("--lr", type=float, default=1e-3)
  p.add_argument("--seed", type=int, default=0)
  args = p.parse_args(argv)
  if args.sequence_parallel and args.mesh is None:
    p.error("--sequence-parallel splits the batch over a mesh's devices: give --mesh")
  return args


def mesh_shape(args):
  """``(data, vocab)`` from ``--mesh``, or None."""
  return None if args.mesh is None else tuple(int(n) for n in args.mesh.split(","))


def configs(args):
  """``(ModelConfig, GRPOConfig, optimizer)`` from the parsed flags."""
  model_cfg = model_lib.ModelConfig(
      vocab_size=args.vocab, d_model=args.d_model, num_layers=args.layers,
      num_heads=args.heads, max_len=args.prompt_len + args.completion_len)
  cfg = GRPOConfig(path=args.path, temperature=args.temperature, clip_eps=args.clip_eps,
                   kl_coef=args.kl_coef, entropy_coef=args.entropy_coef,
                   sequence_parallel=args.sequence_parallel)
  return model_cfg, cfg, make_optimizer(args.optimizer, args.lr)


def synthetic_problem(args):
  """``(graphdef, params, ref_params, rollouts)`` from the flags, on the host, the same in
  every process: the policy from ``--seed``, a reference that it has drifted from (every
  parameter x 0.9) and :func:`examples.train.synthetic_rollouts` in place of a sampler."""
  model_cfg, _, _ = configs(args)
  graphdef, params = model_lib.init(model_cfg, args.seed)
  params = jax.tree.map(np.asarray, params)
  rollouts = synthetic_rollouts(args.seed, num_prompts=args.prompts, group_size=args.group_size,
                                seq_len=args.prompt_len + args.completion_len,
                                vocab_size=args.vocab)
  return graphdef, params, jax.tree.map(lambda x: x * np.float32(0.9), params), rollouts


def sample(params, prompts, key, *, graphdef, completion_len: int, temperature: float):
  """Sample completions at ``temperature``: the distribution the loss must score.

  Args:
    params, graphdef: the policy.
    prompts: int32 ``[B, P]``.
    key: a PRNG key.
    completion_len: C, tokens sampled per sequence; after EOS the rest is PAD.

  Returns:
    ``tokens`` int32 ``[B, P + C]`` and ``lengths`` int32 ``[B]`` (completion tokens,
    EOS included). No KV cache: each token reruns the prefix (fine at toy sizes).
  """
  model = nnx.merge(graphdef, params)
  batch, prompt_len = prompts.shape
  tokens = jnp.concatenate([prompts, jnp.full((batch, completion_len), PAD, prompts.dtype)], 1)

  def body(i, carry):
    tokens, done, lengths = carry
    hidden = model.hidden_states(tokens)[:, prompt_len - 1 + i]
    logits = model.lm_head(hidden).astype(jnp.float32) / temperature
    new = jnp.where(done, PAD, jax.random.categorical(jax.random.fold_in(key, i), logits))
    tokens = lax.dynamic_update_slice_in_dim(tokens, new[:, None].astype(tokens.dtype),
                                             prompt_len + i, 1)
    return tokens, done | (new == EOS), lengths + (~done).astype(jnp.int32)

  start = (tokens, jnp.zeros(batch, bool), jnp.zeros(batch, jnp.int32))
  tokens, _, lengths = lax.fori_loop(0, completion_len, body, start)
  return tokens, lengths


def rewards(tokens, lengths, *, prompt_len: int, vocab_size: int):
  """Host float ``[B]``: fraction of each completion's tokens with id < vocab_size / 4."""
  completion = tokens[:, prompt_len:]
  in_completion = np.arange(completion.shape[1]) < lengths[:, None]
  good = (completion < vocab_size // 4) & in_completion
  return good.sum(1) / np.maximum(lengths, 1)


def main(argv=None):
  args = parse_args(argv)
  shape = mesh_shape(args)
  devices = args.cpu_devices or (8 if args.pmap else int(np.prod(shape)) if shape else None)
  if devices:
    jax.config.update("jax_num_cpu_devices", devices)  # before any backend starts
  model_cfg, cfg, optimizer = configs(args)
  graphdef, params = model_lib.init(model_cfg, args.seed)
  host_params = jax.tree.map(np.asarray, params)
  mesh = None
  if shape:
    mesh = make_mesh(*shape, devices=jax.devices()[:shape[0] * shape[1]])
  runner = Runner(graphdef, cfg, optimizer, mesh=mesh, pmap=args.pmap)
  params = runner.place_params(host_params)
  ref_params = runner.place_params(host_params)  # frozen: the policy before training
  opt_state = runner.init(params)
  sampler = runner.compile(lambda p, prompts, key: sample(
      p, prompts, key, graphdef=graphdef, completion_len=args.completion_len,
      temperature=args.temperature))
  rng = np.random.default_rng(args.seed)
  key = jax.random.PRNGKey(args.seed)
  batch_size = args.prompts * args.group_size
  print(f"jax {jax.__version__} on {jax.device_count()} {jax.default_backend()} device(s); "
        f"path={cfg.path} mesh={shape} sequence_parallel={args.sequence_parallel} "
        f"pmap={args.pmap}; B={batch_size} sequences of "
        f"{args.prompt_len}+{args.completion_len} tokens, V={args.vocab}")
  start = time.perf_counter()
  for it in range(args.iterations):
    prompts = rng.integers(2, args.vocab, (args.prompts, args.prompt_len), dtype=np.int32)
    prompts = np.repeat(prompts, args.group_size, axis=0)
    key, sub = jax.random.split(key)
    keys = jax.random.split(sub, runner.devices) if args.pmap else sub
    tokens, lengths = runner.to_host(sampler(params, *runner.place_rows(prompts), keys))
    reward = rewards(tokens, lengths, prompt_len=args.prompt_len, vocab_size=args.vocab)
    advantages = np.asarray(group_advantages(reward, args.group_size))
    mask = np.asarray(completion_mask(np.full(batch_size, args.prompt_len), lengths,
                                      tokens.shape[1]))
    batch = runner.batch(params, ref_params, *runner.place_rows(tokens, mask, advantages))
    for step in range(args.inner_steps):
      params, opt_state, metrics = runner.step(params, opt_state, batch)
      metrics = {k: float(np.ravel(v)[0]) for k, v in runner.to_host(metrics).items()}
      print(f"iter {it} step {step}  reward {reward.mean():.4f}  " +
            "  ".join(f"{k} {v:.5f}" for k, v in metrics.items()), flush=True)
  print(f"{args.iterations * args.inner_steps} steps in {time.perf_counter() - start:.1f} s "
        "(compilation included)")


if __name__ == "__main__":
  main()
