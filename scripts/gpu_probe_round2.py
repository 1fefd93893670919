"""Development probe (GPU), round 2: where the fused path's time goes, the stacked-d-W
backward (jaxce._linear._STACKED_DW, commit ecf1253; removed after this probe: 1-2%
faster for 50% more working memory, bench/NOTES.md), the training step's second
[T, V] buffer, and multi-row / prefetching variants of the Pallas forward. Prints JSON lines; writes a profile and HLO dumps under --out.

    python scripts/gpu_probe_round2.py --out DIR [--parts fused,train,pallas]
"""

import argparse
import glob
import gzip
import json
import os
import shutil
import sys
import time
from functools import partial

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

import jaxce
from _timing import bench, emit
from jaxce import _linear

V, D = 151936, 4096
rng = np.random.default_rng(0)


def rate():
  a = jax.device_put(rng.standard_normal((8192, 8192), np.float32).astype(jnp.bfloat16))
  ms = bench(jax.jit(lambda a: a @ a), a, repeats=20)
  return 2 * 8192**3 / ms / 1e9


def kernel_times(trace_dir):
  """Per trace process (host threads, GPU streams): summed event durations by name, ms."""
  files = glob.glob(os.path.join(trace_dir, "**", "*.trace.json.gz"), recursive=True)
  if not files:
    return {}
  events = json.load(gzip.open(files[0])).get("traceEvents", [])
  pids = {e["pid"]: e["args"]["name"] for e in events
          if e.get("ph") == "M" and e.get("name") == "process_name"}
  totals = {}
  for e in events:
    if e.get("ph") == "X":
      per = totals.setdefault(str(pids.get(e.get("pid"), e.get("pid"))), {})
      per[e["name"]] = per.get(e["name"], 0.0) + e.get("dur", 0) / 1e3
  return {pid: dict(sorted(per.items(), key=lambda kv: -kv[1])[:25])
          for pid, per in totals.items()}


def fused(out, tflops):
  T = 32768
  h = jax.device_put(rng.standard_normal((T, D), np.float32).astype(jnp.bfloat16))
  w = jax.device_put((rng.standard_normal((D, V), np.float32) * 0.02).astype(jnp.bfloat16))
  labels = jax.device_put(rng.integers(0, V, T).astype(np.int32))
  adv = jax.device_put(rng.standard_normal(T).astype(np.float32))
  floor = 4 * 2 * T * D * V / tflops / 1e9

  def make(cs, vb):
    def loss(h, w):
      lp, en = jaxce.linear_logprobs_and_entropy(h, w, labels, chunk_size=cs, vocab_block_size=vb)
      return jnp.sum(adv * lp) + 0.01 * jnp.sum(en)
    return jax.jit(jax.grad(loss, (0, 1))), jax.jit(lambda h, w: jaxce.linear_logprobs_and_entropy(
        h, w, labels, chunk_size=cs, vocab_block_size=vb))

  for stacked, cs, vb in [(False, None, None), (True, 2048, 16384), (True, 4096, 8192),
                          (True, 8192, 4096), (True, 4096, 4096), (True, 2048, 8192),
                          (False, 8192, 4096)]:
    _linear._STACKED_DW = stacked
    g, f = make(cs, vb)
    c = g.lower(h, w).compile()
    ms = bench(c, h, w, repeats=5)
    row = dict(part="fused", stacked=stacked, chunk=cs, block=vb, fwd_bwd_ms=ms,
               ratio=ms / floor, temp_GiB=c.memory_analysis().temp_size_in_bytes / 2**30)
    if not stacked:
      row["fwd_ms"] = bench(f, h, w, repeats=5)
    emit(**row)
    if not stacked and cs is None:
      open(os.path.join(out, "fused_hlo.txt"), "w").write(c.as_text())
      tdir = "/tmp/trace_fused"
      jax.block_until_ready(c(h, w))
      with jax.profiler.trace(tdir, create_perfetto_trace=True):
        for _ in range(2):
          jax.block_until_ready(c(h, w))
      emit(part="fused_kernels", ms_per_2_steps=kernel_times(tdir))
      for f_ in glob.glob(os.path.join(tdir, "**", "*.trace.json.gz"), recursive=True)[:1]:
        shutil.copy(f_, os.path.join(out, "fused.trace.json.gz"))
  _linear._STACKED_DW = False
  # GEMM shapes of the loops, alone.
  for name, (m, k, n) in {"fwd_2048x16384": (2048, D, 16384), "dh_2048x16384": (2048, 16384, D),
                          "dw_k2048_n16384": (D, 2048, 16384), "dw_k32768_n4096": (D, T, 4096),
                          "fwd_8192x4096": (8192, D, 4096)}.items():
    a = jax.device_put(rng.standard_normal((m, k), np.float32).astype(jnp.bfloat16))
    b = jax.device_put(rng.standard_normal((k, n), np.float32).astype(jnp.bfloat16))
    acc = jnp.zeros((m, n), jnp.float32)
    mm = jax.jit(lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.float32))
    mm_acc = jax.jit(lambda acc, a, b: acc + jnp.dot(a, b, preferred_element_type=jnp.float32),
                     donate_argnums=0)
    t = bench(mm, a, b, repeats=20)
    emit(part="gemm", shape=name, ms=t, tflops=2 * m * k * n / t / 1e9)
    times = []
    for _ in range(10):
      jax.block_until_ready(acc)
      t0 = time.perf_counter()
      acc = mm_acc(acc, a, b)
      jax.block_until_ready(acc)
      times.append(time.perf_counter() - t0)
    t = 1e3 * float(np.median(times[2:]))
    emit(part="gemm_accumulate", shape=name, ms=t, tflops=2 * m * k * n / t / 1e9)


def train(out):
  T = 32768
  dump = "/tmp/xla_dump"
  h = jax.device_put(rng.standard_normal((T, D), np.float32).astype(jnp.bfloat16))
  w = jax.device_put((rng.standard_normal((D, V), np.float32) * 0.02).astype(jnp.bfloat16))
  labels = jax.device_put(rng.integers(0, V, T).astype(np.int32))
  adv = jax.device_put(rng.standard_normal(T).astype(np.float32))

  for impl in ["pallas", "xla"]:
    def train_step_probe(h, w):
      lp, en = jaxce.logprobs_and_entropy(h @ w, labels, implementation=impl)
      return jnp.sum(adv * lp) + 0.01 * jnp.sum(en)
    g = jax.jit(jax.grad(train_step_probe, (0, 1)))
    c = g.lower(h, w).compile()
    ma = c.memory_analysis()
    jax.block_until_ready(c(h, w))
    stats0 = jax.devices()[0].memory_stats()
    ms = bench(c, h, w, repeats=5)
    emit(part="train_step", impl=impl, ms=ms, temp_GiB=ma.temp_size_in_bytes / 2**30,
         peak_GiB=stats0.get("peak_bytes_in_use", 0) / 2**30,
         logits_GiB=T * V * 2 / 2**30)
    if impl == "pallas":
      open(os.path.join(out, "train_hlo.txt"), "w").write(c.as_text())
  bufs = glob.glob(os.path.join(dump, "*train_step_probe*buffer-assignment.txt"))
  for i, f_ in enumerate(sorted(bufs)[:2]):
    with open(f_) as src, gzip.open(os.path.join(out, f"train_buffers{i}.txt.gz"), "wt") as dst:
      dst.write(src.read())


def _rows_kernel(x_ref, inv_temp_ref, m_ref, s_ref, q_ref, *, block, prefetch):
  num_columns = x_ref.shape[1]
  inv_temp = inv_temp_ref[...]
  lanes = lax.iota(jnp.int32, block)
  floor = jnp.finfo(jnp.float32).min
  n = pl.cdiv(num_columns, block)

  def load(i):
    start = jnp.minimum(i * block, num_columns - block)
    return plgpu.load(x_ref.at[:, pl.ds(start, block)])

  def step(i, carry):
    m, s, q, x = carry
    x_next = load(jnp.minimum(i + 1, n - 1)) if prefetch else None
    x = x if prefetch else load(i)
    start = jnp.minimum(i * block, num_columns - block)
    keep = (start + lanes) >= i * block
    z = jnp.where(keep[None, :], x.astype(jnp.float32) * inv_temp[:, None], -jnp.inf)
    m_new = jnp.maximum(m, jnp.maximum(jnp.max(z, axis=1), floor))
    shifted = z - m_new[:, None]
    e = jnp.exp(shifted)
    scale = jnp.exp(m - m_new)
    s_new = s * scale + jnp.sum(e, axis=1)
    q = scale * (q + (m - m_new) * s) + jnp.sum(jnp.where(e > 0, e * shifted, 0.0), axis=1)
    return m_new, s_new, q, x_next

  rows = x_ref.shape[0]
  zero = jnp.zeros((rows,), jnp.float32)
  x0 = load(0) if prefetch else None
  m, s, q, _ = lax.fori_loop(0, n, step, (zero + floor, zero, zero, x0))
  m_ref[...] = m
  s_ref[...] = s
  q_ref[...] = q


def rows_statistics(x, inv_temp, rows, block, warps, prefetch, stages=1):
  T, Vl = x.shape
  spec = pl.BlockSpec((rows,), lambda i: (i,))
  out = jax.ShapeDtypeStruct((T,), jnp.float32)
  return pl.pallas_call(
      partial(_rows_kernel, block=block, prefetch=prefetch),
      out_shape=(out, out, out), grid=(T // rows,),
      in_specs=[pl.BlockSpec((rows, Vl), lambda i: (i, 0)), spec],
      out_specs=(spec, spec, spec),
      compiler_params=plgpu.CompilerParams(num_warps=warps, num_stages=stages),
      interpret=jax.default_backend() != "gpu",
  )(x, inv_temp)


def pallas(out):
  T = 32768
  x = jax.device_put((rng.standard_normal((T, V), np.float32) * 2).astype(jnp.bfloat16))
  inv = jnp.ones((T,), jnp.float32)
  labels = jax.device_put(rng.integers(0, V, T).astype(np.int32))
  emit(part="pallas", variant="row_max", ms=bench(jax.jit(lambda x: jnp.max(x, axis=-1)), x),
       floor_ms=T * V * 2 / 4.8e9)
  emit(part="pallas", variant="jaxce_main", ms=bench(jax.jit(
      lambda x: jaxce.logprobs_and_entropy(x, labels, implementation="pallas")), x))
  xs = x[:256].astype(jnp.float32)
  ref_m = jnp.max(xs, 1)
  ref_s = jnp.sum(jnp.exp(xs - ref_m[:, None]), 1)
  for rows, block, warps, prefetch in [(1, 4096, 8, True), (2, 2048, 8, False), (2, 2048, 8, True),
                                       (4, 1024, 4, False), (4, 1024, 8, False), (4, 1024, 4, True),
                                       (4, 2048, 8, False), (4, 2048, 8, True), (8, 1024, 8, False),
                                       (8, 512, 4, False), (8, 1024, 8, True), (16, 512, 8, False)]:
    try:
      f = jax.jit(partial(rows_statistics, rows=rows, block=block, warps=warps, prefetch=prefetch))
      m, s, q = f(x[:256], inv[:256])
      err = float(jnp.max(jnp.abs(m - ref_m) + jnp.abs(s / ref_s - 1)))
      emit(part="pallas", rows=rows, block=block, warps=warps, prefetch=prefetch,
           ms=bench(f, x, inv), err=err)
    except Exception as e:  # noqa: BLE001
      emit(part="pallas", rows=rows, block=block, warps=warps, prefetch=prefetch, error=str(e)[:400])


def main():
  p = argparse.ArgumentParser()
  p.add_argument("--out", default=os.environ.get("OUT", "."))
  p.add_argument("--parts", default="pallas,train,fused")
  args = p.parse_args()
  tflops = rate()
  emit(part="floors", bf16_tflops=tflops, device=jax.devices()[0].device_kind, jax=jax.__version__)
  for part in args.parts.split(","):
    t0 = time.time()
    {"fused": lambda: fused(args.out, tflops), "train": lambda: train(args.out),
     "pallas": lambda: pallas(args.out)}[part]()
    emit(part=part, seconds=time.time() - t0)


if __name__ == "__main__":
  main()
