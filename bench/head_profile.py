"""Where the fused path's time goes on a Hopper GPU, piece by piece, in one run.

1. ``kernels``: at one kernel call's shape (``--chunk`` tokens, V = 151936, D = ``--dim``
   (4096), bf16, ``weight [D, V]``), XLA's ``h @ W`` (cuBLAS), JAX's plain Mosaic GPU
   matmul at jaxce's tiling (``bench.machine_floors.mosaic_config``), jaxce's kernel
   skeleton with a one-operation epilogue (each row's max), and jaxce's forward-statistics
   and d-logits kernels; TFLOP/s and the ratio to the plain Mosaic matmul on the same
   shape.
2. ``gemms``: the backward's two XLA GEMMs on one ``[chunk, block]`` tile, alone and with
   their f32 sums (does XLA fold the addend into the GEMM?).
3. ``plans``: fwd+bwd of ``linear_logprobs_and_entropy`` for each ``T:chunk:block`` of
   ``--plans`` (0: the planner's), and XLA's compiled memory plan (temporaries + outputs).
4. ``trace``: the default plan's fwd+bwd at ``--tokens`` under JAX's profiler: GPU time by
   kernel name.
5. ``objective``: value and gradients of the bench's GRPO objective on the objective path
   (``linear_token_loss``) for each ``T:rows:grad`` of ``--objective`` (MiB of the plan's
   two budgets, ``LINEAR_OBJECTIVE_ROWS_BYTES`` and ``LINEAR_OBJECTIVE_GRAD_BYTES``; 0:
   the planner's), with XLA's compiled memory plan; ``objective-trace``: the planned one at
   ``--tokens`` under the profiler.
6. ``shards-trace`` (several GPUs): the sharded fused, objective and logits paths' fwd+bwd
   (``sharded_*``, V = 151936 split over ``n`` GPUs for each ``n`` of ``--shards``, inputs
   made split) at ``--tokens``: each call's median time, then one call under the profiler,
   GPU 0's time by kind of kernel (NCCL, Mosaic, cuBLAS GEMMs, XLA's other kernels), its
   busy time (the union of its kernels' intervals) and its gaps (the time between its
   first kernel's start and its last kernel's end that no kernel ran).

    python -m bench.head_profile             # on a Hopper GPU: JSON to $OUT (or bench/out)
    python -m bench.head_profile --tiny      # anywhere: small shapes, a smoke test
    python -m bench.head_profile --sections shards-trace --shards 1,2,4   # a host of 4 GPUs

Median ms of ``--repeats`` calls (bench.timing). Prints a table last.
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import math
import os
import re
import tempfile

import jax
import jax.numpy as jnp

import jaxce
from bench import impls, machine_floors
from bench.timing import time_ms
from jaxce._kernels.mosaic import head as mh
from jaxce._kernels.mosaic import tile as mosaic_tile

V, D = 151936, 4096


def _operands(tokens, dim, columns, seed=0):
  keys = jax.random.split(jax.random.key(seed), 4)
  hidden = jax.random.normal(keys[0], (tokens, dim), jnp.bfloat16)
  weight = (jax.random.normal(keys[1], (dim, columns), jnp.float32) * dim**-0.5).astype(
      jnp.bfloat16)
  labels = jax.random.randint(keys[2], (tokens,), 0, columns)
  cot = jax.random.normal(keys[3], (2, tokens), jnp.float32)
  return jax.block_until_ready((hidden, weight, labels, cot))


def _device():
  return dict(interpret=jax.default_backend() != "gpu", num_cores=jaxce.plan.target().num_cores)


def _skeleton(hidden, weight, **device):
  """jaxce's kernel skeleton (``mosaic_head._tiles``) with each row's max as the epilogue."""
  rows = jnp.ones((3, hidden.shape[0]), jnp.float32)
  n_tiles = weight.shape[1] // mh.TILE_N

  def finish(x, inputs, column, kept, scratch, outs, n_idx, row_slice):
    del inputs, column, kept
    m = jnp.max(x, axis=1)
    copy_out = mh._copy_out  # pylint: disable=protected-access
    copy_out(scratch, (m, m, m, m), outs[0].at[n_idx, :, row_slice])

  return mh._tiles(  # pylint: disable=protected-access
      hidden, weight, rows, None, inputs_type=mosaic_tile.HeadStatisticsInputs, vocab_dim=1,
      stages=mh.CONFIG.stages, finish=finish,
      out_type=(jax.ShapeDtypeStruct((n_tiles, 4, hidden.shape[0]), jnp.float32),),
      scratch=mh.plgpu.SMEM((2, 4, mh.CONFIG.tile_m), jnp.float32), **device)[0]


def kernels(chunk, dim, columns, block, repeats):
  """Rows of section 1."""
  hidden, weight, labels, cot = _operands(chunk, dim, columns)
  ones = jnp.ones((chunk,), jnp.float32)
  device = _device()
  on_gpu = jax.default_backend() == "gpu"
  rows = []

  def add(piece, fn, args, n):
    flops = 2 * chunk * dim * n
    try:
      ms, best = time_ms(jax.jit(fn), args, repeats, with_min=True)
      rows.append(dict(section="kernels", piece=piece, M=chunk, K=dim, N=n, ms=ms,
                       tflops=flops / best / 1e9))
    except Exception as e:  # pylint: disable=broad-except  # each failure is a row
      rows.append(dict(section="kernels", piece=piece, M=chunk, K=dim, N=n, ms=None,
                       error=f"{type(e).__name__}: {e}"[:400]))
    print(json.dumps(rows[-1]), flush=True)

  w_block = weight[:, :block]
  for n, w in ((columns, weight), (block, w_block)):
    add(f"XLA h @ W (bf16 out) N={n}", jnp.dot, (hidden, w), n)
    if on_gpu:
      from jax.experimental.pallas.ops.gpu import (  # pylint: disable=import-outside-toplevel
          hopper_matmul_mgpu as hm)
      config = machine_floors.mosaic_config()
      add(f"plain Mosaic matmul N={n}", lambda a, b: hm.matmul(a, b, None, config),
          (hidden, w), n)
  add(f"skeleton, max-only epilogue N={columns}", lambda h, w: _skeleton(h, w, **device),
      (hidden, weight), columns)
  for softcap, entropy in ((None, True), (None, False), (30.0, True)):
    add(f"forward statistics N={columns} softcap={softcap} entropy={entropy}",
        lambda h, w, s=softcap, e=entropy: mh.statistics(
            h, w, labels, ones, None, column_start=0, vocab_dim=1, softcap=s,
            with_entropy=e, **device), (hidden, weight), columns)
  add(f"d logits N={block}", lambda h, w: mh.logits_grad(
      h, w, labels % block, ones, (ones, ones, ones), (cot[0], cot[1]), ones > 0,
      limit=block, first_kept=0, vocab_dim=1, softcap=None, **device), (hidden, w_block), block)
  return rows


def gemms(chunk, dim, block, repeats):
  """Rows of section 2: ``d W = hᵀ d`` and ``d h = d Wᵀ`` on one tile, f32 out."""
  hidden, weight, _, _ = _operands(chunk, dim, block, seed=1)
  d = (hidden[:, :1].astype(jnp.float32) * jnp.ones((1, block))).astype(jnp.bfloat16)
  d = jax.block_until_ready(d * 0.01)
  acc_h = jnp.ones((chunk, dim), jnp.float32)
  acc_w = jnp.ones((dim, block), jnp.float32)
  f32 = dict(preferred_element_type=jnp.float32)
  pieces = {
      "d W = h^T d": (lambda h, d: jnp.einsum("td,tv->dv", h, d, **f32), (hidden, d)),
      "d W sum += h^T d": (lambda a, h, d: a + jnp.einsum("td,tv->dv", h, d, **f32),
                           (acc_w, hidden, d)),
      "d W = (h^T d) as bf16": (lambda h, d: jnp.einsum("td,tv->dv", h, d, **f32).astype(
          jnp.bfloat16), (hidden, d)),
      "d h = d W^T": (lambda d, w: jnp.einsum("tv,dv->td", d, w, **f32), (d, weight)),
      "d h sum += d W^T": (lambda a, d, w: a + jnp.einsum("tv,dv->td", d, w, **f32),
                           (acc_h, d, weight)),
  }
  rows = []
  for name, (fn, args) in pieces.items():
    ms, best = time_ms(jax.jit(fn), args, repeats, with_min=True)
    rows.append(dict(section="gemms", piece=name, M=chunk, K=dim, N=block, ms=ms,
                     tflops=2 * chunk * dim * block / best / 1e9))
    print(json.dumps(rows[-1]), flush=True)
  return rows


def _loss(labels, cot, fn=jaxce.linear_logprobs_and_entropy, **kw):
  """Jitted value and gradients of the per-token fused path ``fn`` (its sharded form too),
  both outputs weighted by the cotangents ``cot``."""
  def loss(h, w):
    logp, entropy = fn(h, w, labels, **kw)
    return jnp.sum(cot[0] * logp) + jnp.sum(cot[1] * entropy)
  return jax.jit(jax.value_and_grad(loss, (0, 1)))


def plans(dim, columns, settings, repeats):
  """Rows of section 3: each ``(T, chunk, block)`` (``None``: the planner's), its time and
  XLA's compiled memory plan (temporaries + outputs, the gradients included)."""
  rows = []
  for tokens in sorted({t for t, _, _ in settings}):
    hidden, weight, labels, cot = _operands(tokens, dim, columns)
    for t, chunk, block in settings:
      if t != tokens:
        continue
      fn = _loss(labels, cot, chunk_size=chunk, vocab_block_size=block)
      plan = jaxce.plan.of(jaxce.linear_logprobs_and_entropy, hidden, weight, labels,
                           chunk_size=chunk, vocab_block_size=block)
      memory = fn.lower(hidden, weight).compile().memory_analysis()
      extra = (memory.temp_size_in_bytes + memory.output_size_in_bytes) / 2**30
      ms = time_ms(fn, (hidden, weight), repeats)
      rows.append(dict(section="plans", piece=f"T={tokens} chunk={plan.chunk} block={plan.block}"
                       + (" (planned)" if chunk is None else ""), tokens=tokens, ms=ms,
                       tflops=4 * 2 * tokens * dim * columns / ms / 1e9, backend=plan.backend,
                       compiled_extra_gib=extra))
      print(json.dumps(rows[-1]), flush=True)
  return rows


def _objective_loss(labels, cot, fn=jaxce.linear_token_loss, **kw):
  """Jitted value and gradients of the bench's GRPO objective on the objective path ``fn``
  (its sharded form too)."""
  objective, token_args = impls._grpo(cot[0])  # pylint: disable=protected-access
  return jax.jit(jax.value_and_grad(
      lambda h, w: fn(objective, h, w, labels, *token_args, **kw)[0], (0, 1)))


def objective(dim, columns, settings, repeats):
  """Rows of section 5: each ``(T, rows MiB, grad MiB)`` (``None``: the planner's budget;
  on Hopper the kernels' groups read grad MiB alone, beside
  ``LINEAR_OBJECTIVE_GRAD_PER_SUM``), its plan, time and XLA's compiled memory plan
  (temporaries + outputs)."""
  budgets = (jaxce.plan.LINEAR_OBJECTIVE_ROWS_BYTES, jaxce.plan.LINEAR_OBJECTIVE_GRAD_BYTES)
  rows = []
  planned = tuple(b["gpu"] for b in budgets)
  for tokens in sorted({t for t, _, _ in settings}):
    hidden, weight, labels, cot = _operands(tokens, dim, columns)
    for t, rows_mib, grad_mib in settings:
      if t != tokens:
        continue
      for budget, mib, default in zip(budgets, (rows_mib, grad_mib), planned):
        budget["gpu"] = default if mib is None else mib * 2**20
      fn = _objective_loss(labels, cot)
      plan = jaxce.plan.of(fn, hidden, weight)
      try:
        memory = fn.lower(hidden, weight).compile().memory_analysis()
        extra = (memory.temp_size_in_bytes + memory.output_size_in_bytes) / 2**30
        ms = time_ms(fn, (hidden, weight), repeats)
        error = None
      except Exception as e:  # pylint: disable=broad-except  (out of memory: a row says so)
        ms, extra, error = None, None, f"{type(e).__name__}: {e}"[:300]
      rows.append(dict(section="objective", piece=f"T={tokens} chunk={plan.chunk} "
                       f"grad_chunk={plan.grad_chunk}" + (" (planned)" if rows_mib is None
                                                          and grad_mib is None else ""),
                       tokens=tokens, ms=ms, backend=plan.backend, compiled_extra_gib=extra,
                       tflops=None if ms is None else 3 * 2 * tokens * dim * columns / ms / 1e9,
                       error=error))
      print(json.dumps(rows[-1]), flush=True)
  for budget, default in zip(budgets, planned):
    budget["gpu"] = default
  return rows


def _gpu_events(fn, args, device: int = 0):
  """``fn(*args)``'s kernels on GPU ``device`` under JAX's profiler (after one untimed
  call): ``[(name, start us, duration us)]``; on a machine without GPUs, every
  non-host event (none on CPUs)."""
  jax.block_until_ready(fn(*args))
  with tempfile.TemporaryDirectory() as where:
    with jax.profiler.trace(where, create_perfetto_trace=True):
      jax.block_until_ready(fn(*args))
    paths = glob.glob(os.path.join(where, "**", "*.trace.json.gz"), recursive=True)
    with gzip.open(paths[0]) as f:
      events = json.load(f)["traceEvents"]
  names = {e["pid"]: e["args"]["name"] for e in events
           if e.get("ph") == "M" and e.get("name") == "process_name"}
  gpu = {pid for pid, name in names.items() if "GPU" in name or "gpu" in name}
  mine = {pid for pid in gpu if re.search(rf"GPU:{device}\b", names[pid])} or gpu
  return [(e["name"], e["ts"], e["dur"]) for e in events
          if e.get("ph") == "X" and e.get("pid") in mine and "dur" in e]


XLA_KERNELS = ("fusion", "loop_", "input_", "wrapped_", "copy", "reduce", "transpose",
               "concatenate", "dynamic", "slice", "convert", "broadcast", "select", "memcpy",
               "memset", "triton")


def _kind(kernel: str) -> str:
  """The kind of a GPU kernel, by its name: NCCL, cuBLAS, XLA's own (fusions, copies,
  Triton), or the rest (jaxce's Mosaic kernels; the top names say which)."""
  name = kernel.lower()
  if "nccl" in name:
    return "NCCL"
  if any(k in name for k in ("gemm", "xmma", "cutlass", "cublas")):
    return "cuBLAS"
  if any(k in name for k in XLA_KERNELS):
    return "XLA"
  return "Mosaic and others"


def _busy_ms(events) -> float:
  """The union of the events' intervals, in ms (streams overlap)."""
  busy, end = 0.0, -math.inf
  for _, start, duration in sorted(events, key=lambda e: e[1]):
    if start + duration > end:
      busy += start + duration - max(start, end)
      end = start + duration
  return busy / 1e3


def _gaps_ms(events) -> float:
  """The time between the first event's start and the last one's end that no event
  covers, in ms (0 without events)."""
  if not events:
    return 0.0
  span = max(s + d for _, s, d in events) - min(s for _, s, _ in events)
  return span / 1e3 - _busy_ms(events)


def _sharded_call(path, mesh, tokens, dim, vocab):
  """``(fn, args)``: ``path``'s (``fused``, ``objective`` or ``logits``) fwd+bwd sharded
  over ``mesh``'s ``vocab`` axis, with bf16 inputs made on the devices already split
  (hidden replicated; the weight ``[D, V]`` and the logits ``[T, V]`` split by columns)."""
  # pylint: disable-next=import-outside-toplevel
  from jax.sharding import NamedSharding, PartitionSpec as P
  split, whole = NamedSharding(mesh, P(None, "vocab")), NamedSharding(mesh, P())
  keys = jax.random.split(jax.random.key(0), 4)
  make = lambda f, sharding: jax.jit(f, out_shardings=sharding)()
  labels = make(lambda: jax.random.randint(keys[2], (tokens,), 0, vocab), whole)
  cot = make(lambda: jax.random.normal(keys[3], (2, tokens), jnp.float32), whole)
  kw = dict(mesh=mesh, vocab_axis="vocab")
  if path == "logits":
    logits = make(lambda: (jax.random.normal(keys[0], (tokens, vocab)) * 2).astype(
        jnp.bfloat16), split)

    def loss(x):
      logp, entropy = jaxce.sharded_logprobs_and_entropy(x, labels, **kw)
      return jnp.sum(cot[0] * logp) + jnp.sum(cot[1] * entropy)
    return jax.jit(jax.value_and_grad(loss)), (logits,)
  hidden = make(lambda: jax.random.normal(keys[0], (tokens, dim), jnp.bfloat16), whole)
  weight = make(lambda: (jax.random.normal(keys[1], (dim, vocab)) * dim**-0.5).astype(
      jnp.bfloat16), split)
  if path == "objective":
    return _objective_loss(labels, cot, jaxce.sharded_linear_token_loss, **kw), (hidden, weight)
  return _loss(labels, cot, jaxce.sharded_linear_logprobs_and_entropy, **kw), (hidden, weight)


def shards_trace(tokens, dim, vocab, counts, repeats, top=8):
  """Rows of section 6: for each GPU count ``n`` of ``counts`` and each path, the sharded
  call's median ms (``piece="call"``), then GPU 0's kernel time by kind, its busy time,
  its gaps (the profiled call's span on GPU 0, first kernel's start to last kernel's end,
  less its busy time: the profiled call runs slower than the timed ones, so the call's
  median less the busy time is no measure of them), and its ``top`` kernels, from one
  call under the profiler."""
  from jax.sharding import Mesh  # pylint: disable=import-outside-toplevel
  import numpy as np  # pylint: disable=import-outside-toplevel
  rows = []
  for n in counts:
    if n > jax.device_count():
      continue
    mesh = Mesh(np.array(jax.devices()[:n]).reshape(1, n), ("data", "vocab"))
    for path in ("fused", "objective", "logits"):
      base = dict(section="shards-trace", path=path, n=n, tokens=tokens)
      try:
        fn, args = _sharded_call(path, mesh, tokens, dim, vocab)
        ms = time_ms(fn, args, repeats=repeats)
        events = _gpu_events(fn, args)
      except Exception as e:  # pylint: disable=broad-except
        rows.append(dict(base, piece="call", ms=None, error=f"{type(e).__name__}: {e}"[:300]))
        print(json.dumps(rows[-1]), flush=True)
        continue
      by_kind, by_name, calls = collections.Counter(), collections.Counter(), collections.Counter()
      for name, _, duration in events:
        by_kind[_kind(name)] += duration / 1e3
        by_name[name] += duration / 1e3
        calls[name] += 1
      busy = _busy_ms(events)
      new = [dict(base, piece="call", ms=ms), dict(base, piece="GPU 0 busy", ms=busy),
             dict(base, piece="GPU 0 gaps", ms=_gaps_ms(events))]
      new += [dict(base, piece=f"kind: {kind}", ms=t) for kind, t in sorted(by_kind.items())]
      new += [dict(base, piece=name[:160], ms=t, calls=calls[name])
              for name, t in by_name.most_common(top)]
      for r in new:
        print(json.dumps(r), flush=True)
      rows += new
      del fn, args
      jax.clear_caches()
  return rows


def trace(tokens, dim, columns, top, path="per-token"):
  """Rows of section 4: GPU time of one fwd+bwd call by kernel name (JAX's profiler), of
  the per-token path or (``path="objective"``) the objective path."""
  hidden, weight, labels, cot = _operands(tokens, dim, columns)
  fn = _objective_loss(labels, cot) if path == "objective" else _loss(labels, cot)
  total, count = collections.Counter(), collections.Counter()
  for name, _, duration in _gpu_events(fn, (hidden, weight)):
    total[name] += duration / 1e3
    count[name] += 1
  section = "objective-trace" if path == "objective" else "trace"
  rows = [dict(section=section, piece=name[:160], ms=ms, calls=count[name], tokens=tokens)
          for name, ms in total.most_common(top)]
  rows.append(dict(section=section, piece="all GPU events", ms=sum(total.values()),
                   calls=sum(count.values()), tokens=tokens))
  for r in rows:
    print(json.dumps(r), flush=True)
  return rows


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--tiny", action="store_true", help="small shapes (any backend)")
  parser.add_argument("--chunk", type=int, default=8192)
  parser.add_argument("--block", type=int, default=8192)
  parser.add_argument("--tokens", type=int, default=32768)
  parser.add_argument("--plans", default="8192:0:0,8192:8192:8192,8192:8192:8448,"
                      "8192:8192:25344,32768:0:0,32768:8192:8192,32768:32768:4224,"
                      "32768:32768:8448", help="T:chunk:block for section 3 (0: planned)")
  parser.add_argument("--objective", default="8192:0:0,32768:0:0,32768:1024:64,32768:512:0,"
                      "32768:2048:2500", help="T:rows MiB:grad MiB for section 5 (0: planned)")
  parser.add_argument("--sections", default="kernels,gemms,plans,trace")
  parser.add_argument("--repeats", type=int, default=5)
  parser.add_argument("--dim", type=int, default=D, help="the hidden size D")
  parser.add_argument("--shards", default="1,2,4", help="GPU counts for shards-trace")
  args = parser.parse_args()
  dim, columns = (128, 1024) if args.tiny else (args.dim, V)
  if args.tiny:
    args.chunk, args.block, args.tokens, args.plans, args.repeats = (256, 512, 512,
                                                                     "512:0:0,512:256:256", 1)
    args.objective = "512:0:0,512:1:1"
  parse = lambda text: [tuple(int(x) or None for x in p.split(":")) for p in text.split(",") if p]
  settings = parse(args.plans)
  sections = args.sections.split(",")
  rows = []
  if "kernels" in sections:
    rows += kernels(args.chunk, dim, columns, args.block, args.repeats)
  if "gemms" in sections:
    rows += gemms(args.chunk, dim, args.block, args.repeats)
  if "plans" in sections:
    rows += plans(dim, columns, settings, args.repeats)
  if "trace" in sections:
    rows += trace(args.tokens, dim, columns, 30)
  if "objective" in sections:
    rows += objective(dim, columns, parse(args.objective), args.repeats)
  if "objective-trace" in sections:
    rows += trace(args.tokens, dim, columns, 30, path="objective")
  if "shards-trace" in sections:
    rows += shards_trace(args.tokens, dim, columns, [int(n) for n in args.shards.split(",")],
                         args.repeats)
  report = dict(device=jax.devices()[0].device_kind, jax=jax.__version__,
                commit=os.environ.get("JAXCE_COMMIT", "unknown"), V=columns, D=dim, rows=rows)
  out = os.environ.get("OUT", "bench/out")  # (bench/out: ignored by git)
  os.makedirs(out, exist_ok=True)
  with open(os.path.join(out, "head_profile.json"), "w") as f:
    json.dump(report, f, indent=1)
  plain = {r["N"]: r["tflops"] for r in rows if r["piece"].startswith("plain Mosaic")
           and r.get("ms")}
  print(f"\n{report['device']}, JAX {report['jax']}, commit {report['commit']}")
  for r in rows:
    rate = (f"{r['tflops']:7.1f} TFLOP/s" if r.get("tflops") and "trace" not in r["section"]
            else "")
    ratio = (f" x{r['tflops'] / plain[r['N']]:.3f} plain" if r["section"] == "kernels"
             and r.get("tflops") and r.get("N") in plain else "")
    ms = "  error " + r["error"][:100] if r.get("ms") is None else f"{r['ms']:9.2f} ms"
    if r["section"] == "shards-trace":
      r = dict(r, piece=f"{r['path']} n={r['n']}: {r['piece']}")
    calls = f" ({r['calls']} calls)" if "calls" in r else ""
    calls += (f" {r['compiled_extra_gib']:.2f} GiB" if r.get("compiled_extra_gib") is not None
              else "")
    print(f"{r['section']:<8} {r['piece'][:70]:<70} {ms} {rate}{ratio}{calls}")


if __name__ == "__main__":
  main()
