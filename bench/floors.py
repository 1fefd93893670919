"""Hardware floors, measured on the device the rows run on, and each row's floor time.

* HBM bandwidth: a jitted copy of a large f32 array (2 GiB on GPU, 64 MiB on CPU); the
  bytes read plus the bytes written over the median time.
* Matmul rate: 16 back-to-back square matmuls (8192 on GPU, 512 on CPU) of standard
  normal data in each input dtype of the suite, ``16 * 2 n^3`` flops over the median
  time. Random data and a sustained run, because a GPU runs all-ones operands (few bits
  toggling, less power) and short bursts at higher clocks: on an H200, one 8192 matmul of
  ones ran at 711 TFLOP/s and 16 in a row at 785, normal data at 660 and 657, while
  jaxce's own cuBLAS matmuls ran at 600-630 (bench/NOTES.md).

A row's floor (see bench/NOTES.md):
* logits path: bytes that must move / bandwidth; ``fwd`` reads the logits once, ``fwd_bwd``
  reads them twice and writes the gradient once (3 x the logits bytes);
* fused (linear) path: matmul flops / rate; ``fwd`` is one ``2 T D V`` matmul, ``fwd_bwd``
  four (the forward, its recomputation in the backward, ``d hidden`` and ``d W``);
* train step (hidden @ W -> logits -> loss -> grads): three matmuls plus the logits
  path's ``fwd_bwd`` bytes.
Per device for sharded rows (``V / n`` columns each).
"""

from __future__ import annotations

from bench.configs import TRAIN_STEP_VARIANTS, Config


def median_seconds(fn, *args, repeats):
  """Median wall seconds of ``fn(*args)`` after one warm-up call (``bench.timing``)."""
  from bench.timing import time_ms
  return time_ms(fn, args, repeats, warmup=1) / 1e3


def measure(dtypes=("bfloat16",)) -> dict:
  """Floors of ``jax.devices()[0]``.

  Returns:
    ``{"hbm_GBps": float, "matmul_tflops": {dtype: float}, "bf16_tflops": float}``.
  """
  import jax
  import jax.numpy as jnp
  from jax import lax
  device = jax.devices()[0]
  big = device.platform != "cpu"
  n_copy = (2**29 if big else 2**24)  # f32 elements: 2 GiB / 64 MiB
  x = jax.device_put(jnp.zeros((n_copy,), jnp.float32), device)
  seconds = median_seconds(jax.jit(jnp.copy), x, repeats=20 if big else 5)
  del x
  hbm = 2 * 4 * n_copy / seconds / 1e9
  n, chained = (8192, 16) if big else (512, 4)
  rates = {}
  for dtype in dict.fromkeys(("bfloat16",) + tuple(dtypes)):
    a = jax.device_put(jax.random.normal(jax.random.key(0), (n, n), dtype), device)
    # x <- (x @ a) / sqrt(n) keeps the values O(1); the scale folds into the matmul.
    chain = jax.jit(lambda a: lax.fori_loop(0, chained, lambda _, x: (x @ a) * n**-0.5, a))
    seconds = median_seconds(chain, a, repeats=10 if big else 3)
    rates[dtype] = chained * 2 * n**3 / seconds / 1e12
    del a
  return dict(hbm_GBps=hbm, matmul_tflops=rates, bf16_tflops=rates["bfloat16"])


def floor_ms(config: Config, n_devices: int, hbm_GBps: float, matmul_tflops: dict,
             itemsize: int) -> float:
  """The row's floor time in ms, per device (see the module docstring)."""
  V = config.V // max(n_devices, 1)
  logits_bytes = config.T * V * itemsize
  passes = 1 if config.mode == "fwd" else 3
  memory_ms = passes * logits_bytes / (hbm_GBps * 1e9) * 1e3
  if config.input == "logits":
    return memory_ms
  matmul = 2 * config.T * config.D * V / (matmul_tflops[config.dtype] * 1e12) * 1e3
  if config.variant in TRAIN_STEP_VARIANTS:
    return 3 * matmul + memory_ms
  return (1 if config.mode == "fwd" else 4) * matmul
