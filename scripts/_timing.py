"""Timing helpers shared by the GPU development probes in this folder."""

import json
import time

import jax
import numpy as np


def bench(f, *args, repeats=15):
  """Median wall time in ms of ``f(*args)`` after one warm-up call; each call's outputs
  are dropped before the next."""
  out = f(*args)
  jax.block_until_ready(out)
  del out
  times = []
  for _ in range(repeats):
    t = time.perf_counter()
    out = f(*args)
    jax.block_until_ready(out)
    times.append(time.perf_counter() - t)
    del out
  return float(np.median(times) * 1e3)


def emit(**row):
  """Print one JSON line (the probes' output format)."""
  print(json.dumps(row), flush=True)
