"""One configuration in this (fresh) process; prints one ``BENCH_ROW {json}`` line.

    python -m bench.runner --json '{"impl": "jaxce", "input": "logits", ...}'
    python -m bench.runner --json '[{...}, {...}]'   # several, one row each (CPU only)
    python -m bench.runner --probe --dtypes bfloat16,float32   # device facts + floors

Peak device memory can only be read, never reset, inside a process, so the driver
(``python -m bench``) starts one process per configuration. The JAX procedure:

1. compile from abstract shapes (``jit(f).lower(ShapeDtypeStruct...).compile()``) before
   any input exists, so compile-time scratch (autotuning) does not sit on top of them;
2. make the inputs' random blocks with numpy on the host, ``device_put`` them and tile
   them to full size on the device (the blocks stay alive: inputs, not extra memory);
   note the bytes in use;
3. one warm-up call, then the median of up to ``repeats`` calls (fewer when a call is
   slow), each timed to ``block_until_ready``; each call's outputs are deleted before the
   next (two live gradients would double the figure); donated inputs are re-tiled
   (untimed) into the buffer the deleted gradient freed;
4. extra memory = ``peak_bytes_in_use`` minus the bytes in use after step 2, per device
   (``memory_source="device_peak"``); where the device keeps no statistics (CPU), or its
   peak was set while compiling (GEMM autotuning), XLA's compiled plan: temp + output -
   aliased bytes (``memory_source="xla_plan"``).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import traceback

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

from bench import inputs  # noqa: E402  (numpy only; no JAX import before the env is set)
from bench.configs import TORCH_IMPLS, Config  # noqa: E402
from bench.timing import time_calls  # noqa: E402

ROW_PREFIX = "BENCH_ROW "
PROBE_PREFIX = "BENCH_PROBE "
# Seconds of timed calls per config after the warm-up (at least one call); `python -m
# bench --repeat-seconds S` sets it through the environment.
REPEAT_BUDGET_S = float(os.environ.get("BENCH_REPEAT_SECONDS", "2.0"))


def _plan_bytes(compiled) -> int | None:
  """XLA's planned extra bytes per device: temp + output - aliased (donated) bytes."""
  try:
    m = compiled.memory_analysis()
    return int(m.temp_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes)
  except Exception:  # pylint: disable=broad-except  # not every backend plans memory
    return None


def _program(compiled) -> dict | None:
  """What the compiled program runs as: its custom calls by target (``mosaic_gpu_v2``:
  jaxce's Mosaic kernels; ``__gpu$xla.gpu.triton``: Pallas Triton; ``__cublas$gemm``) and
  its collectives by kind, each instruction of XLA's optimized HLO counted once (a loop
  body's too, however many times it runs; an async pair as one)."""
  try:
    text = compiled.as_text()
  except Exception:  # pylint: disable=broad-except  # not every backend prints its program
    return None
  collective = r"(all-gather|all-reduce|reduce-scatter|all-to-all|collective-permute)"
  return dict(custom_calls=dict(sorted(collections.Counter(
                  re.findall(r'custom_call_target="([^"]+)"', text)).items())),
              collectives=dict(sorted(collections.Counter(
                  re.findall(rf"\b{collective}(?:-start)?\(", text)).items())))


def _stats(devices, key):
  stats = [d.memory_stats() for d in devices]
  return None if any(s is None or key not in s for s in stats) else [s[key] for s in stats]


def run_jax(config: Config, blocks: dict) -> dict:
  import jax
  import jax.numpy as jnp
  import numpy as np
  from bench import impls
  available = jax.devices()
  n = config.n_devices or len(available)
  if n > len(available):
    raise ValueError(f"needs {n} devices, {len(available)} visible")
  devices = available[:n]
  built = impls.build(config, devices)
  shardings = impls.shardings(built.names, devices, config.variant, config.data)
  abstract = [jax.ShapeDtypeStruct(blocks[k][1], blocks[k][0].dtype, sharding=shardings[k])
              for k in built.names]
  compiled = jax.jit(built.fn, donate_argnums=built.donate).lower(*abstract).compile()
  plan, program = _plan_bytes(compiled), _program(compiled)
  compile_peak = _stats(devices, "peak_bytes_in_use")

  # Inputs: host blocks put on the device, tiled to full size there (see bench.inputs).
  placed = {k: jax.device_put(blocks[k][0], shardings[k]) for k in built.names}

  tilers = {}

  def full(name):
    block, shape = placed[name], blocks[name][1]
    if block.shape == shape and built.names.index(name) not in built.donate:
      return block  # a donated input is always a copy: the block must survive the call
    if name not in tilers:
      reps = (-(-shape[0] // block.shape[0]),) + (1,) * (block.ndim - 1)
      tilers[name] = jax.jit(lambda b: jnp.tile(b, reps)[:shape[0]],
                             out_shardings=shardings[name])
    return jax.block_until_ready(tilers[name](block))

  args = [full(k) for k in built.names]
  base = _stats(devices, "bytes_in_use")

  def refill():  # a call consumed the donated buffers: make fresh ones (untimed)
    for i in built.donate:
      args[i] = full(built.names[i])

  times = time_calls(compiled, args, config.repeats, warmup=1, budget_s=REPEAT_BUDGET_S,
                     after=refill if built.donate else None)
  peak = _stats(devices, "peak_bytes_in_use")
  row = dict(ms=float(np.median(times)), ms_all=times, repeats=len(times),
             plan_extra_bytes=plan, program=program, n_devices=n,
             chunk_used=built.chunk_used, note=built.note, device=devices[0].device_kind)
  if peak is not None and base is not None and max(compile_peak) >= max(peak):
    # The allocator's peak was set while compiling (XLA's GEMM autotuner allocates the
    # outputs it tries, twice with its correctness check), so the run's own peak cannot
    # be read: report XLA's plan, which equals the device peak wherever both are known.
    row.update(peak_extra_bytes=plan, memory_source="xla_plan",
               compile_peak_bytes=max(compile_peak),
               device_peak_upper_bound=max(p - b for p, b in zip(peak, base)))
    row["note"] = (row["note"] + "; " if row["note"] else "") + (
        "device peak hidden by the compile-time peak: XLA's plan")
  elif peak is not None and base is not None:
    row.update(peak_extra_bytes=max(p - b for p, b in zip(peak, base)),
               memory_source="device_peak", compile_peak_bytes=max(compile_peak))
  else:
    row.update(peak_extra_bytes=plan, memory_source="xla_plan")
  return row


def classify(error: BaseException | str) -> str:
  """``"oom"`` for an out-of-memory failure (XLA or PyTorch), else ``"error"``."""
  text = str(error)
  oom = ("RESOURCE_EXHAUSTED" in text or "out of memory" in text.lower()
         or type(error).__name__ == "OutOfMemoryError")
  return "oom" if oom else "error"


def run(config: Config) -> dict:
  """The row fields this process can fill: timing, memory, status (no floors)."""
  row = dict(status="ok", error=None, ms=None, peak_extra_bytes=None,
             logits_bytes=None, memory_source=None)
  try:
    if config.impl in TORCH_IMPLS:
      from bench import impls_torch
      row.update(impls_torch.run(config, inputs.host_blocks(config), REPEAT_BUDGET_S))
    else:
      row.update(run_jax(config, inputs.host_blocks(config)))
  except Exception as e:  # pylint: disable=broad-except  # every failure becomes a row
    row.update(status=classify(e), error=f"{type(e).__name__}: {e}"[:2000],
               traceback=traceback.format_exc()[-4000:])
  return row


def _host_cpu() -> str:
  """The host CPU's model name and core count (context for CPU rows)."""
  model = ""
  try:
    with open("/proc/cpuinfo") as f:
      model = next((l.split(":", 1)[1].strip() for l in f if l.startswith("model name")), "")
  except OSError:
    pass
  return f"{model or 'unknown CPU'}, {os.cpu_count()} cores"


def probe(dtypes) -> dict:
  """Device kind and count, JAX version and the measured floors of device 0."""
  import jax
  from bench import floors
  device = jax.devices()[0]
  facts = dict(platform=device.platform, device=device.device_kind,
               n_devices=jax.device_count(), jax=jax.__version__, host=_host_cpu())
  facts.update(floors.measure(dtypes))
  return facts


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--json", help="a Config as JSON, or a list of them")
  parser.add_argument("--probe", action="store_true", help="print device facts and floors")
  parser.add_argument("--dtypes", default="bfloat16", help="matmul dtypes for --probe")
  args = parser.parse_args(argv)
  if args.probe:
    print(PROBE_PREFIX + json.dumps(probe(args.dtypes.split(","))), flush=True)
    return
  payload = json.loads(args.json)
  for fields in (payload if isinstance(payload, list) else [payload]):
    print(ROW_PREFIX + json.dumps(run(Config(**fields))), flush=True)


if __name__ == "__main__":
  main()
