"""GPU check and timing of the fused path's Mosaic GPU forward (``implementation="mosaic"``).

1. Correctness of the compiled kernel: against ``implementation="xla"`` and the float64
   reference (bf16 inputs; ragged tokens and vocabulary, padded vocabulary, softcap,
   per-token temperature, masked rows, both weight layouts, inside ``shard_map`` over a
   vocab axis of every power-of-two count of the devices present); values and both
   gradients, with random per-token cotangents.
2. No DeprecationWarning from the Mosaic forward (the Triton one warns on JAX 0.11+).
3. Time (median of ``--repeats`` synchronized runs after a warm-up) of the forward and of
   forward + backward at V = 151936, D = 4096, bf16, for "mosaic", "triton" and "xla", and
   the forward's matmul rate; peak memory of forward + backward, each in a fresh process.

    python -m scripts.gpu_check_mosaic_linear            # on a Hopper GPU: JSON to $OUT
    python -m scripts.gpu_check_mosaic_linear --tiny     # anywhere: small shapes, smoke test
    python -m scripts.gpu_check_mosaic_linear --profile 32768   # the time, piece by piece

Exits 1 when a check fails. Prints a table last. ``--profile`` checks nothing: it prints
``bench.kernel_pieces.profile``'s rows and writes them to ``$OUT/mosaic_profile.json``.
"""

import argparse
import json
import os
import subprocess
import sys
import warnings

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, PartitionSpec as P

import jaxce
from bench import kernel_pieces
from bench.timing import time_ms
from jaxce import reference

V, D = 151936, 4096


def weighted(f, labels, cot, **kw):
  def loss(h, w):
    logp, entropy = f(h, w, labels, **kw)
    return jnp.sum(cot[0] * logp) + jnp.sum(cot[1] * entropy)
  return loss


def shard_counts():
  """The vocab shard counts the shard_map case runs: every power of two from 2 up to the
  devices present (1 on one device), so a host of 4 GPUs checks 2 shards as well as 4."""
  count = len(jax.devices())
  return [n for n in (2, 4, 8, 16) if n <= count] or [1]


def correctness(tokens, dim, columns):
  """Max abs differences per case; raises SystemExit(1) past the tolerances."""
  jax.config.update("jax_enable_x64", True)  # the float64 reference only
  rng = np.random.default_rng(0)
  failures, rows = [], []
  for layout, softcap in (("dv", None), ("vd", 30.0)):
    hidden = jnp.asarray(rng.normal(size=(tokens, dim)) * 0.5, jnp.bfloat16)
    weight = rng.normal(size=(dim, columns)) * 2 / np.sqrt(dim)
    weight[:, rng.integers(0, columns, 5)] *= 8
    weight = jnp.asarray(weight if layout == "dv" else weight.T, jnp.bfloat16)
    labels = rng.integers(0, columns - 37, tokens).astype(np.int32)
    labels[::13] = -100
    cot = jnp.asarray(rng.normal(size=(2, tokens)), jnp.float32)
    kw = dict(temperature=jnp.asarray(rng.uniform(0.6, 1.5, tokens), jnp.float32),
              logit_softcap=softcap, vocab_size=columns - 37, where=rng.random(tokens) < 0.9,
              weight_layout=layout)
    results = {}
    for name in ("xla", "mosaic"):
      f = weighted(jaxce.linear_logprobs_and_entropy, labels, cot, implementation=name, **kw)
      out = jaxce.linear_logprobs_and_entropy(hidden, weight, labels, implementation=name, **kw)
      results[name] = out + jax.jit(jax.grad(f, (0, 1)))(hidden, weight)
    for n in shard_counts():  # V_local = columns / n
      mesh = Mesh(np.array(jax.devices()[:n]), ("vocab",))
      spec = P("vocab") if layout == "vd" else P(None, "vocab")
      f = weighted(jaxce.sharded_linear_logprobs_and_entropy, labels, cot, mesh=mesh,
                   vocab_axis="vocab", implementation="mosaic", **kw)
      sharded_weight = jax.device_put(weight, jax.sharding.NamedSharding(mesh, spec))
      out = jaxce.sharded_linear_logprobs_and_entropy(
          hidden, sharded_weight, labels, mesh=mesh, vocab_axis="vocab",
          implementation="mosaic", **kw)
      results[f"mosaic in shard_map, {n} shards"] = out + jax.jit(jax.grad(f, (0, 1)))(
          hidden, sharded_weight)
    h64, w64 = (jnp.asarray(a, jnp.float64) for a in (hidden, weight))
    ref_kw = {k: v for k, v in kw.items()}
    exact = reference.linear_logprobs_and_entropy(h64, w64, labels, **ref_kw)
    for name, got in results.items():
      row = dict(case=f"{layout} softcap={softcap}", implementation=name)
      for i, what in enumerate(("logp", "entropy")):
        row[f"{what} vs f64"] = float(jnp.max(jnp.abs(got[i] - exact[i])))
        row[f"{what} vs xla"] = float(jnp.max(jnp.abs(got[i] - results["xla"][i])))
      for i, what in ((2, "d hidden"), (3, "d weight")):
        scale = float(jnp.max(jnp.abs(results["xla"][i].astype(jnp.float32))))
        row[f"{what} vs xla / max"] = float(jnp.max(jnp.abs(
            got[i].astype(jnp.float32) - results["xla"][i].astype(jnp.float32)))) / scale
      rows.append(row)
      print(json.dumps(row), flush=True)
      if name != "xla":
        bad = [k for k, v in row.items() if k.endswith("vs xla") and not v <= 2e-5]
        bad += [k for k, v in row.items() if k.endswith("/ max") and not v <= 2 ** -7]
        bad += [k for k in ("logp vs f64", "entropy vs f64")
                if not row[k] <= 1.5 * next(r[k] for r in rows if r["case"] == row["case"]
                                             and r["implementation"] == "xla") + 1e-5]
        if bad:
          failures.append((row["case"], name, bad))
  jax.config.update("jax_enable_x64", False)
  return rows, failures


def no_deprecation_warning(tokens, dim, columns):
  hidden = jnp.ones((tokens, dim), jnp.bfloat16)
  weight = jnp.ones((dim, columns), jnp.bfloat16)
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    jax.block_until_ready(jaxce.linear_logprobs_and_entropy(
        hidden, weight, jnp.zeros(tokens, jnp.int32), implementation="mosaic"))
  return [str(w.message)[:120] for w in caught if issubclass(w.category, DeprecationWarning)]


def timing(tokens, dim, columns, repeats, implementations):
  hidden, weight, labels, cot = kernel_pieces.problem(tokens, dim, columns)
  rows = []
  for name in implementations:
    forward = jax.jit(lambda h, w, n=name: jaxce.linear_logprobs_and_entropy(
        h, w, labels, implementation=n))
    loss = weighted(jaxce.linear_logprobs_and_entropy, labels, cot, implementation=name)
    both = jax.jit(jax.value_and_grad(loss, (0, 1)))
    fwd_ms, fwd_min = time_ms(forward, (hidden, weight), repeats, with_min=True)
    both_ms = time_ms(both, (hidden, weight), max(3, repeats // 2))
    row = dict(tokens=tokens, implementation=name, forward_ms=fwd_ms,
               forward_tflops=2 * tokens * dim * columns / fwd_min / 1e9,
               fwd_bwd_ms=both_ms)
    rows.append(row)
    print(json.dumps(row), flush=True)
  return rows


def peak_memory(name, tokens, dim, columns):
  """Peak device bytes of one jitted forward + backward (run in a fresh process)."""
  hidden, weight, labels, cot = kernel_pieces.problem(tokens, dim, columns)
  loss = weighted(jaxce.linear_logprobs_and_entropy, labels, cot, implementation=name)
  stats = jax.devices()[0].memory_stats()
  base = stats["bytes_in_use"]
  jax.block_until_ready(jax.jit(jax.value_and_grad(loss, (0, 1)))(hidden, weight))
  stats = jax.devices()[0].memory_stats()
  return dict(implementation=name, tokens=tokens, inputs_gib=base / 2**30,
              extra_peak_gib=(stats["peak_bytes_in_use"] - base) / 2**30)


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--tiny", action="store_true", help="small shapes (any backend)")
  parser.add_argument("--memory", nargs=2, metavar=("IMPLEMENTATION", "TOKENS"))
  parser.add_argument("--repeats", type=int, default=10)
  parser.add_argument("--profile", type=int, metavar="TOKENS", help="only the profile")
  args = parser.parse_args()
  if args.profile:
    rows = kernel_pieces.profile(args.profile, D, V, args.repeats) if not args.tiny else (
        kernel_pieces.profile(512, 128, 1024, 2))
    with open(os.path.join(os.environ.get("OUT", "."), "mosaic_profile.json"), "w") as f:
      json.dump(dict(device=str(jax.devices()[0].device_kind), jax=jax.__version__,
                     commit=os.environ.get("JAXCE_COMMIT", "unknown"), rows=rows), f, indent=1)
    for r in rows:
      print(f"{r['piece']:<40} {r['ms']:8.2f} ms {r['tflops']:7.1f} TFLOP/s")
    return
  if args.memory:
    print(json.dumps(peak_memory(args.memory[0], int(args.memory[1]), D, V)))
    return
  report = dict(device=str(jax.devices()[0].device_kind), jax=jax.__version__,
                commit=os.environ.get("JAXCE_COMMIT", "unknown"))
  if args.tiny:
    rows, failures = correctness(300, 128, 384)
    report.update(correctness=rows, deprecations=no_deprecation_warning(256, 64, 128),
                  timing=timing(512, 128, 1024, 2, ("mosaic", "xla")), memory=[])
  else:
    rows, failures = correctness(1000, 256, 5120)
    report.update(correctness=rows, deprecations=no_deprecation_warning(512, 256, 1024))
    report["timing"] = [r for t in (8192, 32768)
                        for r in timing(t, D, V, args.repeats, ("mosaic", "triton", "xla"))]
    report["memory"] = []
    for name in ("mosaic", "triton"):
      out = subprocess.run([sys.executable, "-m", "scripts.gpu_check_mosaic_linear",
                            "--memory", name, "32768"], capture_output=True, text=True)
      report["memory"].append(json.loads(out.stdout.strip().splitlines()[-1]) if
                              out.returncode == 0 else dict(implementation=name,
                                                            error=out.stderr[-2000:]))
  if report["deprecations"]:
    failures.append(("deprecation warnings", report["deprecations"]))
  report["failures"] = [str(f) for f in failures]
  path = os.path.join(os.environ.get("OUT", "."), "mosaic_linear.json")
  with open(path, "w") as f:
    json.dump(report, f, indent=1)
  print(f"\n{report['device']}, JAX {report['jax']}, commit {report['commit']}")
  print(f"{'T':>7} {'impl':>7} {'fwd ms':>8} {'TFLOP/s':>8} {'fwd+bwd ms':>11}")
  for r in report["timing"]:
    print(f"{r['tokens']:>7} {r['implementation']:>7} {r['forward_ms']:>8.2f} "
          f"{r['forward_tflops']:>8.1f} {r['fwd_bwd_ms']:>11.2f}")
  for r in report["memory"]:
    print(r)
  print("FAILURES:" if failures else "all checks passed", *failures, sep="\n")
  sys.exit(1 if failures else 0)


if __name__ == "__main__":
  main()
