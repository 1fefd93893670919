"""Development probe for the GPU (not part of the package): floors, then time and compiled
memory of jaxce vs plain JAX over a few configurations, in one process. Prints JSON lines.

    python scripts/gpu_probe.py [--quick] [--out DIR]
"""

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import jax
import jax.numpy as jnp
import numpy as np

import jaxce
from _timing import bench
from jaxce import reference


def floors():
  x = jax.device_put(np.random.default_rng(0).standard_normal((2**30 // 2,), np.float32).astype(jnp.bfloat16))
  copy = jax.jit(lambda x: x * 2)
  ms = bench(copy, x, repeats=20)
  gbps = 2 * x.nbytes / ms / 1e6
  a = jax.device_put(np.random.default_rng(1).standard_normal((8192, 8192), np.float32).astype(jnp.bfloat16))
  mm = jax.jit(lambda a: a @ a)
  ms_mm = bench(mm, a, repeats=20)
  return gbps, 2 * 8192**3 / ms_mm / 1e9


def main():
  p = argparse.ArgumentParser()
  p.add_argument("--out", default=os.environ.get("OUT", "."))
  p.add_argument("--quick", action="store_true")
  p.add_argument("--only", default="")
  args = p.parse_args()
  rows = []

  def emit(**row):
    rows.append(row)
    print(json.dumps(row), flush=True)

  gbps, tflops = floors()
  emit(kind="floors", hbm_GBps=gbps, bf16_tflops=tflops, device=jax.devices()[0].device_kind,
       jax=jax.__version__)
  rng = np.random.default_rng(0)
  V = 151936
  for T in ([8192] if args.quick else [8192, 32768]):
    if args.only and "logits" not in args.only:
      break
    x_host = (rng.standard_normal((T, V), np.float32) * 2).astype(jnp.bfloat16)
    labels = jax.device_put(rng.integers(0, V, T).astype(np.int32))
    adv = jax.device_put(rng.standard_normal(T).astype(np.float32))
    x = jax.device_put(x_host)
    nbytes = T * V * 2
    def loss(fn):
      def l(x):
        logp, ent = fn(x, labels)
        return jnp.sum(adv * logp) + 0.01 * jnp.sum(ent)
      return l
    impls = {"plain": lambda x, l: reference.logprobs_and_entropy(x, l)}
    for cs in [256, 512, 1024, 2048, None]:
      impls[f"jaxce_c{cs}"] = (lambda cs: lambda x, l: jaxce.logprobs_and_entropy(x, l, chunk_size=cs))(cs)
    for name, fn in impls.items():
      for mode in ["fwd", "fwd_bwd"]:
        f = jax.jit(lambda x, fn=fn: fn(x, labels)) if mode == "fwd" else jax.jit(jax.grad(loss(fn)))
        try:
          c = f.lower(x).compile()
          mem = c.memory_analysis()
          ms = bench(c, x)
          floor = (1 if mode == "fwd" else 3) * nbytes / gbps / 1e6
          emit(kind="logits", impl=name, T=T, mode=mode, ms=ms, floor_ms=floor, ratio=ms / floor,
               temp_over_logits=mem.temp_size_in_bytes / nbytes)
        except Exception as e:  # noqa: BLE001
          emit(kind="logits", impl=name, T=T, mode=mode, error=str(e)[:300])
    # In place: donated logits, backward overwrites them.
    for cs in [1024, None]:
      g = jax.jit(jax.grad(loss(lambda x, l: jaxce.logprobs_and_entropy(
          x, l, chunk_size=cs))), donate_argnums=0)
      c = g.lower(x).compile()
      mem = c.memory_analysis()
      times = []
      for _ in range(6):
        xi = jax.device_put(x_host)
        jax.block_until_ready(xi)
        t = time.perf_counter()
        out = c(xi)
        jax.block_until_ready(out)
        times.append(time.perf_counter() - t)
        del out
      emit(kind="logits", impl=f"jaxce_inplace_c{cs}", T=T, mode="fwd_bwd",
           ms=float(np.median(times[1:]) * 1e3), floor_ms=3 * nbytes / gbps / 1e6,
           temp_over_logits=mem.temp_size_in_bytes / nbytes)
    if T == 8192:
      hlo = jax.jit(jax.grad(loss(lambda x, l: jaxce.logprobs_and_entropy(x, l, chunk_size=1024)))).lower(x).compile().as_text()
      open(os.path.join(args.out, "logits_fwd_bwd_hlo.txt"), "w").write(hlo)
    del x
  D = 4096
  for T in ([8192] if args.quick else [8192, 32768]):
    if args.only and "linear" not in args.only:
      break
    h = jax.device_put((rng.standard_normal((T, D), np.float32)).astype(jnp.bfloat16))
    w = jax.device_put((rng.standard_normal((D, V), np.float32) * 0.02).astype(jnp.bfloat16))
    labels = jax.device_put(rng.integers(0, V, T).astype(np.int32))
    adv = jax.device_put(rng.standard_normal(T).astype(np.float32))
    flops = 2 * T * D * V
    configs = {"plain": lambda h, w, l: reference.linear_logprobs_and_entropy(h, w, l)}
    for cs, vb in [(1024, 16384), (2048, 8192), (4096, 4096), (2048, 16384), (None, None)]:
      configs[f"jaxce_c{cs}_v{vb}"] = (lambda cs, vb: lambda h, w, l: jaxce.linear_logprobs_and_entropy(
          h, w, l, chunk_size=cs, vocab_block_size=vb))(cs, vb)
    for name, fn in configs.items():
      for mode in ["fwd", "fwd_bwd"]:
        if mode == "fwd":
          f = jax.jit(lambda h, w, fn=fn: fn(h, w, labels))
        else:
          f = jax.jit(jax.grad(lambda h, w, fn=fn: (lambda o: jnp.sum(adv * o[0]) + 0.01 * jnp.sum(o[1]))(fn(h, w, labels)), (0, 1)))
        try:
          c = f.lower(h, w).compile()
          mem = c.memory_analysis()
          ms = bench(c, h, w, repeats=5)
          floor = (1 if mode == "fwd" else 4) * flops / tflops / 1e9
          emit(kind="linear", impl=name, T=T, mode=mode, ms=ms, floor_ms=floor, ratio=ms / floor,
               temp_GiB=mem.temp_size_in_bytes / 2**30)
        except Exception as e:  # noqa: BLE001
          emit(kind="linear", impl=name, T=T, mode=mode, error=str(e)[:300])
    del h, w
  json.dump(rows, open(os.path.join(args.out, "probe.json"), "w"), indent=1)


if __name__ == "__main__":
  main()
