"""The GRPO step at a realistic vocabulary, the LM head split over every visible GPU:
step time and peak memory per device, jaxce against the plain-JAX loss.

    python -m examples.gpu_run --out gpu_run.json
    python -m examples.gpu_run --out small.json --vocab 4096 --d-model 64 --seq-len 64  # CPU

Each path (``--paths``, default all of :data:`PATHS`: ``objective``, the whole GRPO loss
through ``jaxce.linear_token_loss``; ``linear``, jaxce's fused log-probs and entropies and
autodiff; ``plain``, ``jax.nn.log_softmax``; ``logits``, jaxce on materialized logits; see
:mod:`examples.loss`) runs in a fresh process (so ``peak_bytes_in_use`` is its own, with
``XLA_PYTHON_CLIENT_PREALLOCATE=false``): a ``1 x n`` (data x vocab) mesh over the ``n``
visible devices, the :mod:`examples.model` LM with bf16 activations and float32 parameters
(Adam), one batch of ``--sequences x --seq-len`` tokens (V = 151936 by default, as Qwen),
``--warmup`` steps, then ``--steps`` timed ones. Reported per path: the median step time
(forward + backward + Adam), the median time of the no-gradient scoring pass (old and
reference log-probs), compile time, and per device the bytes in use before the first step
(parameters, optimizer state, batch) and the peak (of the whole run: scoring passes
included). The JSON goes to ``--out``; the whole run stops after ``--timeout`` seconds.
``python -m bench.grpo_step`` runs this at named sizes and tabulates it against ``plain``."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

from examples.multihost import subprocess_env

PATHS = ("objective", "linear", "plain", "logits")


def parse_args(argv=None):
  """Sizes, paths and the time budget; `--child` marks a measuring child process."""
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--out", required=True, help="JSON results")
  p.add_argument("--paths", default=",".join(PATHS), help=f"comma-separated, of {PATHS}")
  p.add_argument("--vocab", type=int, default=151936)
  p.add_argument("--d-model", type=int, default=1024)
  p.add_argument("--layers", type=int, default=2)
  p.add_argument("--heads", type=int, default=8)
  p.add_argument("--attention", choices=("xla", "cudnn"), default="xla",
                 help="the model's attention (jax.nn.dot_product_attention's implementation)")
  p.add_argument("--sequences", type=int, default=8, help="B (group size 2)")
  p.add_argument("--seq-len", type=int, default=1024, help="S: B * (S - 1) tokens per step")
  p.add_argument("--warmup", type=int, default=2)
  p.add_argument("--steps", type=int, default=5)
  p.add_argument("--timeout", type=float, default=170.0,
                 help="seconds for all paths; a path that would start past it is skipped")
  p.add_argument("--devices", type=int, default=0,
                 help="the first N visible devices (0: all of them)")
  p.add_argument("--data", type=int, default=1,
                 help="the mesh's data axis (the rest of the devices: its vocab axis)")
  p.add_argument("--sequence-parallel", action="store_true",
                 help="the batch split over every device (data and vocab), the token "
                 "embedding's rows over vocab (GRPOConfig.sequence_parallel)")
  p.add_argument("--child", default=None, help=argparse.SUPPRESS)  # path, in the child
  args = p.parse_args(argv)
  if args.data < 1 or args.sequences % args.data or args.devices < 0:
    p.error(f"--data must be >= 1 and divide --sequences, got --data {args.data}, "
            f"--sequences {args.sequences} (and --devices >= 0, got {args.devices})")
  if args.sequence_parallel and args.devices and args.sequences % args.devices:
    p.error(f"--sequence-parallel splits the --sequences ({args.sequences}) over every one "
            f"of the --devices ({args.devices}): they must divide them")
  return args


def timed(fn, *args):
  """``(output, milliseconds)`` of ``fn(*args)``, waiting for the device."""
  import jax
  start = time.perf_counter()
  out = jax.block_until_ready(fn(*args))
  return out, 1e3 * (time.perf_counter() - start)


def measure(args, path: str) -> dict:
  """One path, in this process: the numbers reported for it."""
  import jax
  import jax.numpy as jnp
  from flax import nnx

  from examples import model as model_lib
  from examples.loss import GRPOConfig
  from examples.train import Runner, make_mesh, make_optimizer
  from examples.train import synthetic_rollouts

  devices = jax.devices()[:args.devices or None]
  if len(devices) % args.data:
    raise SystemExit(f"--data {args.data} does not divide the {len(devices)} devices")
  mesh = make_mesh(args.data, len(devices) // args.data, devices)
  model_cfg = model_lib.ModelConfig(
      vocab_size=args.vocab, d_model=args.d_model, num_layers=args.layers,
      num_heads=args.heads, max_len=args.seq_len, dtype=jnp.bfloat16,
      attention=args.attention)
  cfg = GRPOConfig(path=path, temperature=0.7, kl_coef=0.04, entropy_coef=0.01,
                   sequence_parallel=args.sequence_parallel)
  graphdef = model_lib.abstract_graphdef(model_cfg)
  abstract = nnx.state(nnx.eval_shape(lambda: model_lib.CausalLM(model_cfg, rngs=nnx.Rngs(0))),
                       nnx.Param)
  runner = Runner(graphdef, cfg, make_optimizer("adam", 1e-5), mesh=mesh)
  # Initialized where it lives: each device computes its own shard, nothing on the host.
  init = jax.jit(lambda: model_lib.init(model_cfg, 0)[1],
                 out_shardings=runner.param_shardings(abstract))
  params, ref_params = init(), init()
  rollouts = synthetic_rollouts(0, num_prompts=args.sequences // 2, group_size=2,
                                seq_len=args.seq_len, vocab_size=args.vocab)
  tokens, mask, advantages = runner.place_rows(*rollouts)
  opt_state = runner.init(params)
  start = time.perf_counter()
  batch = runner.batch(params, ref_params, tokens, mask, advantages)
  jax.block_until_ready(batch)
  score_compile_s = time.perf_counter() - start
  score_ms = [timed(runner.score, ref_params, tokens, mask)[1] for _ in range(args.steps)]
  baseline = [d.memory_stats() for d in devices]
  step_ms, losses = [], []
  for _ in range(args.warmup + args.steps):
    (params, opt_state, metrics), ms = timed(runner.step, params, opt_state, batch)
    step_ms.append(ms)
    losses.append(float(metrics["loss"]))
  peak = [d.memory_stats() for d in devices]
  bytes_of = lambda stats, key: None if stats is None else int(stats.get(key, 0))
  before = [bytes_of(s, "bytes_in_use") for s in baseline]
  peak = [bytes_of(s, "peak_bytes_in_use") for s in peak]
  return dict(
      path=path, mesh=[args.data, len(devices) // args.data],
      sequence_parallel=args.sequence_parallel, attention=args.attention,
      tokens_per_step=int(np.prod(np.shape(rollouts[1]))),
      valid_tokens=int(np.sum(rollouts[1])),
      step_ms_median=float(np.median(step_ms[args.warmup:])), step_ms=step_ms,
      first_step_s=step_ms[0] / 1e3, score_ms_median=float(np.median(score_ms)),
      score_first_s=score_compile_s, losses=losses,
      bytes_in_use_before_steps=before, peak_bytes_in_use=peak,
      peak_minus_before=[None if p is None else p - b for p, b in zip(peak, before)])


def run_child(args, path: str, timeout: float) -> dict:
  """``measure`` in a fresh process; an ``error`` entry when it fails or times out."""
  if timeout <= 0:
    return dict(path=path, error="skipped: the --timeout budget is spent")
  with tempfile.TemporaryDirectory() as tmp:
    out = os.path.join(tmp, "result.json")
    cmd = [sys.executable, "-m", "examples.gpu_run", *child_argv(args, path, out)]
    try:
      proc = subprocess.run(cmd, env=subprocess_env(XLA_PYTHON_CLIENT_PREALLOCATE="false"),
                            capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
      return dict(path=path, error=f"timed out after {timeout:.0f} s")
    if proc.returncode or not os.path.exists(out):
      return dict(path=path, error=f"exit {proc.returncode}: {proc.stderr[-3000:]}")
    with open(out) as f:
      return json.load(f)


def gib(n):
  return "n/a" if n is None else f"{n / 2**30:.2f}"


def child_argv(args, path: str, out: str):
  """The flags of this run for the child that measures ``path``."""
  sizes = ("vocab", "d_model", "layers", "heads", "sequences", "seq_len", "warmup", "steps",
           "devices", "data", "attention")
  argv = [x for k in sizes for x in (f"--{k.replace('_', '-')}", str(getattr(args, k)))]
  argv += ["--sequence-parallel"] * args.sequence_parallel
  return argv + ["--child", path, "--out", out]


def main(argv=None):
  args = parse_args(argv)
  if args.child:
    import flax
    import jax
    result = measure(args, args.child)
    result.update(device=jax.devices()[0].device_kind,
                  num_devices=len(jax.devices()[:args.devices or None]),
                  platform=jax.default_backend(), jax=jax.__version__, flax=flax.__version__)
    with open(args.out, "w") as f:
      json.dump(result, f)
    return
  # The parent never starts a JAX backend: it would hold device memory the children need.
  report = dict(config=vars(args), results=[])
  start = time.perf_counter()
  for path in args.paths.split(","):
    result = run_child(args, path, args.timeout - (time.perf_counter() - start))
    report["results"].append(result)
    if "error" in result:
      print(f"{path:9s} FAILED: {result['error'][-2000:]}", flush=True)
      continue
    for key in ("device", "num_devices", "platform", "jax", "flax"):
      report[key] = result[key]
    print(f"{path:9s} step {result['step_ms_median']:8.1f} ms  score "
          f"{result['score_ms_median']:7.1f} ms  first step {result['first_step_s']:5.1f} s  "
          f"peak GiB/device {[gib(b) for b in result['peak_bytes_in_use']]} (before steps "
          f"{[gib(b) for b in result['bytes_in_use_before_steps']]})  losses "
          f"{[round(x, 5) for x in result['losses'][:3]]}", flush=True)
  report["wall_s"] = time.perf_counter() - start
  with open(args.out, "w") as f:
    json.dump(report, f, indent=1)
  print(f"{report.get('num_devices')} x {report.get('device')}, {report['wall_s']:.0f} s; "
        f"wrote {args.out}")


if __name__ == "__main__":
  main()
