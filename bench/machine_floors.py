"""Floors at the machine's best, measured in the run: the fused path's GEMMs and the copy.

    python -m bench.machine_floors --out DIR            # on a GPU: T = 8192, 32768
    python -m bench.machine_floors --tiny               # anywhere: small shapes, XLA only

For each T, the three GEMM shapes of the fused path (V = 151936, D = 4096, bf16 in and out,
f32 accumulation), each as a plain row-major ``[M, K] x [K, N]`` matmul whose operands are
made (and transposed) before timing:

    h @ W     [T, D] x [D, V]   the forward (and its recomputation in the backward)
    d hidden  [T, V] x [V, D]
    d W       [D, T] x [T, V]

timed in cuBLAS (``torch.matmul``), XLA (``jnp.dot``) and JAX's Pallas Mosaic GPU matmul
(``jax.experimental.pallas.ops.gpu.hopper_matmul_mgpu``) at jaxce's kernel tiling (128 x 128
per warpgroup, two warpgroups along M, 64-deep K steps, 4 stages, a planar snake 8 row blocks
wide); the floor of a shape is the fastest. Beside them, jaxce's own kernels on their shapes
(``bench.kernel_pieces``) and the plain Mosaic matmul's rate on the same shape. The logits
path's floor: the fastest of an XLA copy and PyTorch's device-to-device ``y.copy_(x)`` of a
``[T, V]`` bf16 array. Median ms of ``--repeats`` calls (bench.timing); TFLOP/s =
``2 M N K`` / time; ``x peak`` = rate / the datasheet's dense bf16 peak (H100 SXM and H200:
989.4 TFLOP/s).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import traceback

from bench.timing import time_ms

V, D = 151936, 4096
TS = (8192, 32768)
# Dense bf16 tensor-core peak from the datasheets (TFLOP/s), by device-name fragment.
DATASHEET_BF16_TFLOPS = (("H200", 989.4), ("H100 80GB HBM3", 989.4), ("H100 SXM", 989.4))
BACKENDS = ("cublas", "xla", "mosaic")
SHAPES = ("h @ W", "d hidden", "d W")
PREFIX = "MACHINE_FLOORS "


def datasheet_peak(device_kind: str):
  return next((p for frag, p in DATASHEET_BF16_TFLOPS if frag in device_kind), None)


def gemm_dims(shape: str, t: int, v: int, d: int) -> tuple[int, int, int]:
  """``(M, K, N)`` of one of :data:`SHAPES`."""
  return {"h @ W": (t, d, v), "d hidden": (t, v, d), "d W": (d, t, v)}[shape]


def mosaic_config():
  """hopper_matmul_mgpu's TuningConfig at jaxce's Mosaic kernel tiling."""
  from jax.experimental.pallas.ops.gpu import hopper_matmul_mgpu as hm
  # jaxce internal (the lead may move it): the fused kernel's tile constants.
  from jaxce._kernels.mosaic import head as mh  # pylint: disable=import-outside-toplevel
  return hm.TuningConfig(
      tile_m=mh.CONFIG.tile_m, tile_n=mh.TILE_N, tile_k=mh.CONFIG.tile_k,
      max_concurrent_steps=mh.CONFIG.stages,
      grid_minor_dim=hm.MatmulDimension.M, grid_tile_width=mh.CONFIG.snake_width,
      wg_dimension=hm.MatmulDimension.M)


def _jax_operands(m, k, n, seed=0):
  import jax
  import jax.numpy as jnp
  ka, kb = jax.random.split(jax.random.key(seed))
  a = jax.random.normal(ka, (m, k), jnp.bfloat16)
  b = (jax.random.normal(kb, (k, n), jnp.float32) * k**-0.5).astype(jnp.bfloat16)
  return jax.block_until_ready((a, b))


def time_gemm(backend: str, m, k, n, repeats) -> float:
  """Median ms of one bf16 ``[m, k] x [k, n]`` matmul in ``backend``."""
  if backend == "cublas":
    import torch
    if not torch.cuda.is_available():
      raise RuntimeError("cuBLAS needs a CUDA GPU")
    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(k, n, device="cuda", dtype=torch.bfloat16) * k**-0.5
    sync = lambda _: torch.cuda.synchronize()
    try:
      return time_ms(torch.matmul, (a, b), repeats, sync=sync)
    finally:
      del a, b
      torch.cuda.empty_cache()
  import jax
  import jax.numpy as jnp
  if backend == "xla":
    fn = jax.jit(jnp.dot)
  elif backend == "mosaic":
    if jax.default_backend() != "gpu":
      raise RuntimeError("the Mosaic GPU matmul needs a Hopper GPU")
    from jax.experimental.pallas.ops.gpu import hopper_matmul_mgpu as hm
    config = mosaic_config()
    fn = jax.jit(lambda a, b: hm.matmul(a, b, None, config))
  else:
    raise ValueError(backend)
  args = _jax_operands(m, k, n)
  try:
    return time_ms(fn, args, repeats)
  finally:
    del args


def time_copy(backend: str, t, v, repeats) -> float:
  """Median ms of a device-to-device copy of a ``[t, v]`` bf16 array."""
  if backend == "torch":
    import torch
    if not torch.cuda.is_available():
      raise RuntimeError("torch's D2D copy needs a CUDA GPU")
    x = torch.randn(t, v, device="cuda", dtype=torch.bfloat16)
    y = torch.empty_like(x)
    try:
      return time_ms(lambda: y.copy_(x), (), repeats,
                     sync=lambda _: torch.cuda.synchronize())
    finally:
      del x, y
      torch.cuda.empty_cache()
  import jax
  import jax.numpy as jnp
  x = jax.block_until_ready(jnp.ones((t, v), jnp.bfloat16))
  return time_ms(jax.jit(jnp.copy), (x,), repeats)


def _attempt(fn, *args):
  try:
    return dict(ms=fn(*args), status="ok")
  except Exception as e:  # pylint: disable=broad-except  # each failure is a row
    cannot = isinstance(e, ImportError) or isinstance(e, RuntimeError) and "needs" in str(e)
    return dict(ms=None, status="skipped" if cannot else "error",
                error=f"{type(e).__name__}: {e}"[:500])


def _piece_shape(piece: str):
  if piece.startswith(("forward kernel", "d logits kernel")):
    return "h @ W"
  if piece.startswith("d W"):
    return "d W"
  if piece.startswith("d h"):
    return "d hidden"
  return None


def ours(t, v, d, repeats, tiny=False) -> list[dict]:
  """jaxce's fused-path pieces, timed by ``bench.kernel_pieces.profile``."""
  from bench import kernel_pieces  # pylint: disable=import-outside-toplevel
  rows = kernel_pieces.profile(t, d, v, 2 if tiny else repeats)
  return [dict(T=t, piece=r["piece"], shape=_piece_shape(r["piece"]), ms=r["ms"]) for r in rows]


def measure(Ts=TS, v=V, d=D, repeats=10, tiny=False) -> dict:
  import time
  import jax
  start = time.perf_counter()
  log = lambda what: print(f"[{time.perf_counter() - start:6.1f} s] {what}", file=sys.stderr,
                           flush=True)
  device = jax.devices()[0]
  peak = datasheet_peak(device.device_kind)
  out = dict(device=device.device_kind, platform=device.platform, V=v, D=d, Ts=list(Ts),
             datasheet_bf16_tflops=peak, gemm=[], floors=[], ours=[], copy=[])
  for t in Ts:
    for shape in SHAPES:
      m, k, n = gemm_dims(shape, t, v, d)
      flops = 2 * m * k * n
      best = None
      for backend in BACKENDS:
        row = dict(T=t, shape=shape, M=m, K=k, N=n, backend=backend,
                   **_attempt(time_gemm, backend, m, k, n, repeats))
        if row["ms"]:
          row["tflops"] = flops / row["ms"] / 1e9
          row["x_peak"] = row["tflops"] / peak if peak else None
          best = row if best is None or row["ms"] < best["ms"] else best
        out["gemm"].append(row)
        print(json.dumps(row), file=sys.stderr, flush=True)
      log(f"T={t} {shape}")
      if best:
        out["floors"].append(dict(T=t, shape=shape, backend=best["backend"], ms=best["ms"],
                                  tflops=best["tflops"], x_peak=best["x_peak"]))
    copies = [dict(T=t, backend=b, **_attempt(time_copy, b, t, v, repeats))
              for b in ("xla", "torch")]
    for c in copies:
      if c["ms"]:
        c["GBps"] = 2 * 2 * t * v / c["ms"] / 1e6
    out["copy"] += copies
    try:
      pieces = ours(t, v, d, repeats, tiny)
    except Exception as e:  # pylint: disable=broad-except  # the floors stand without it
      out.setdefault("ours_error", []).append(f"T={t}: {type(e).__name__}: {e}"[:1000])
      traceback.print_exc()
      pieces = []
    log(f"T={t}: copies and jaxce's kernels")
    for p in pieces:
      m, k, n = gemm_dims(p["shape"], t, v, d) if p["shape"] else (0, 0, 0)
      p["tflops"] = 2 * m * k * n / p["ms"] / 1e9 if p["shape"] else None
      plain = next((g for g in out["gemm"] if (g["T"], g["shape"], g["backend"]) ==
                    (t, p["shape"], "mosaic") and g["ms"]), None)
      p["mosaic_matmul_tflops"] = plain["tflops"] if plain else None
      p["x_mosaic_matmul"] = (p["tflops"] / plain["tflops"]) if plain and p["tflops"] else None
      out["ours"].append(p)
  return out


def _f(x, spec):
  return "–" if x is None else format(x, spec)


def markdown(mf: dict) -> str:
  """The floors section of a results .md."""
  if "floors" not in mf:
    return f"## Floors at the machine's best\n\nNot measured: {mf.get('error')}"
  peak = mf.get("datasheet_bf16_tflops")
  lines = [f"## Floors at the machine's best (same run; V = {mf['V']}, D = {mf['D']}, bf16)",
           "", "Median ms of each GEMM in cuBLAS (torch.matmul), XLA (jnp.dot) and JAX's "
           "Mosaic GPU matmul at jaxce's tiling; the floor is the fastest; x peak = TFLOP/s "
           f"/ {peak or '?'} (datasheet dense bf16).", "",
           "| T | GEMM | M x K x N | cuBLAS ms (TFLOP/s) | XLA ms (TFLOP/s) | Mosaic ms (TFLOP/s) "
           "| floor | floor TFLOP/s | x peak |", "|---|---|---|---|---|---|---|---|---|"]
  for f in mf["floors"]:
    cells = []
    for b in BACKENDS:
      g = next(g for g in mf["gemm"] if (g["T"], g["shape"], g["backend"]) ==
               (f["T"], f["shape"], b))
      cells.append(f"{g['ms']:.2f} ({g['tflops']:.0f})" if g["ms"] else f"– ({g['status']})")
    g0 = next(g for g in mf["gemm"] if (g["T"], g["shape"]) == (f["T"], f["shape"]))
    lines.append(f"| {f['T']} | {f['shape']} | {g0['M']} x {g0['K']} x {g0['N']} | "
                 + " | ".join(cells) + f" | {f['backend']} | {f['tflops']:.0f} "
                 f"| {_f(f['x_peak'], '.2f')} |")
  if mf.get("ours"):
    lines += ["", "jaxce's kernels (scripts/gpu_check_mosaic_linear.py --profile) beside the "
              "plain Mosaic matmul on the same shape:", "",
              "| T | piece | shape | ms | TFLOP/s | plain Mosaic TFLOP/s | ratio |",
              "|---|---|---|---|---|---|---|"]
    lines += [f"| {p['T']} | {p['piece']} | {p['shape'] or '–'} | {p['ms']:.2f} "
              f"| {_f(p['tflops'], '.0f')} | {_f(p['mosaic_matmul_tflops'], '.0f')} "
              f"| {_f(p['x_mosaic_matmul'], '.3f')} |" for p in mf["ours"]]
  for e in mf.get("ours_error", []):
    lines += ["", f"jaxce's kernels not timed: {e}"]
  if mf.get("copy"):
    lines += ["", "Logits path: copy of a [T, V] bf16 array (read + write):", "",
              "| T | backend | ms | GB/s |", "|---|---|---|---|"]
    lines += [f"| {c['T']} | {c['backend']} | {_f(c['ms'], '.3f')} | {_f(c.get('GBps'), '.0f')} |"
              for c in mf["copy"]]
  return "\n".join(lines)


def floor_ms(config, mf: dict, itemsize: int = 2):
  """A row's floor from the machine's best (``None`` where ``mf`` lacks what it needs):
  logits path = bytes (fwd 1x, fwd_bwd 3x the logits) / the fastest copy's rate; fused
  path = the fastest time of each GEMM at the row's T (scaled by T from the nearest
  measured T): fwd = h @ W, fwd_bwd = 2 (h @ W) + d hidden + d W; train step = 3 GEMMs +
  the logits path's fwd_bwd bytes. One device, bf16, the measured V and D only."""
  if (not mf.get("floors") or config.n_devices != 1 or config.dtype != "bfloat16"
      or config.V != mf["V"] or (config.input == "linear" and config.D != mf["D"])):
    return None
  rates = [c["GBps"] for c in mf.get("copy", []) if c.get("GBps")]
  memory = None
  if rates:
    memory = (1 if config.mode == "fwd" else 3) * config.T * config.V * itemsize / (
        max(rates) * 1e6)
  if config.input == "logits":
    return memory
  best = {}
  for f in mf["floors"]:
    near = best.get(f["shape"])
    if near is None or abs(f["T"] - config.T) < abs(near["T"] - config.T):
      best[f["shape"]] = f
  if set(best) != set(SHAPES):
    return None
  ms = {s: f["ms"] * config.T / f["T"] for s, f in best.items()}
  if config.variant in ("train_step", "train_step_loop"):
    return None if memory is None else ms["h @ W"] + ms["d hidden"] + ms["d W"] + memory
  if config.mode == "fwd":
    return ms["h @ W"]
  return 2 * ms["h @ W"] + ms["d hidden"] + ms["d W"]


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--T", default=",".join(map(str, TS)), help="comma list of T")
  parser.add_argument("--repeats", type=int, default=10)
  parser.add_argument("--tiny", action="store_true", help="T = 256, V = 1024, D = 128")
  parser.add_argument("--out", help="directory for machine_floors.json and .md")
  args = parser.parse_args(argv)
  if args.tiny:
    result = measure((256,), 1024, 128, 2, tiny=True)
  else:
    result = measure(tuple(int(t) for t in args.T.split(",")), V, D, args.repeats)
  result["commit"] = os.environ.get("JAXCE_COMMIT", "")
  print(markdown(result), file=sys.stderr)
  if args.out:
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "machine_floors.json"), "w") as f:
      json.dump(result, f, indent=1)
    with open(os.path.join(args.out, "machine_floors.md"), "w") as f:
      f.write(markdown(result) + "\n")
  print(PREFIX + json.dumps(result), flush=True)


if __name__ == "__main__":
  main()
