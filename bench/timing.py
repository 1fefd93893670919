"""The one timing loop of the bench, the notebook and the GPU checks."""

from __future__ import annotations

import statistics
import time

import jax


def time_ms(fn, args, repeats: int, warmup: int = 2) -> tuple[float, float]:
  """``(median, best)`` milliseconds of ``fn(*args)`` over ``repeats`` timed calls, each
  waited for (``block_until_ready``), after ``warmup`` untimed calls (the first compiles)."""
  for _ in range(warmup):
    jax.block_until_ready(fn(*args))
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append((time.perf_counter() - start) * 1e3)
  return statistics.median(times), min(times)
