"""The one timing loop of the bench, the notebook and the GPU checks.

    from bench.timing import time_ms
    ms = time_ms(jitted, (x, y), repeats=10)                  # median ms
    ms, best = time_ms(jitted, (x, y), repeats=10, with_min=True)

Warm-up calls first (the first one compiles, when the function is not compiled yet), each
waited for and not timed; then up to ``repeats`` timed calls, each one waited for
(``jax.block_until_ready`` of its outputs, or ``sync``) and its outputs dropped before the
next call, so two results never coexist.
"""

from __future__ import annotations

import statistics
import time


def _block(out):
  import jax  # pylint: disable=import-outside-toplevel  # not needed by the torch runner
  return jax.block_until_ready(out)


def time_calls(fn, args=(), repeats: int = 5, warmup: int = 1, *, budget_s=None, sync=None,
               after=None) -> list[float]:
  """Milliseconds of each timed call of ``fn(*args)``.

  Args:
    fn: the function (jitted or compiled, or any callable).
    args: its positional arguments.
    repeats: timed calls, at most.
    warmup: untimed calls before them (at least one when ``budget_s`` is given).
    budget_s: fewer timed calls when one is slow: about ``budget_s`` seconds of them, as
      judged from the fastest call so far (the last warm-up call, then each timed call:
      a warm-up that paid a one-time cost, such as NCCL's first collective on a mesh,
      does not cut the timed calls to one), and never fewer than one.
    sync: waits for a call's output (default ``jax.block_until_ready``; for PyTorch,
      ``lambda out: torch.cuda.synchronize()``).
    after: called after every call, untimed (e.g. to re-make donated inputs).

  Returns:
    The timed calls' wall times in ms, in order.
  """
  sync = sync or _block
  warm = None
  for _ in range(max(warmup, 1 if budget_s else 0)):
    start = time.perf_counter()
    out = fn(*args)
    sync(out)
    warm = time.perf_counter() - start
    del out
    if after:
      after()
  def allowed(fastest_s):  # timed calls the budget allows, judged from the fastest call
    if budget_s is None or fastest_s is None:
      return repeats
    return max(1, min(repeats, int(budget_s / max(fastest_s, 1e-9))))

  times = []
  while len(times) < allowed(min(times) / 1e3 if times else warm):
    start = time.perf_counter()
    out = fn(*args)
    sync(out)
    times.append((time.perf_counter() - start) * 1e3)
    del out
    if after:
      after()
  return times


def time_ms(fn, args=(), repeats: int = 5, warmup: int = 2, *, with_min: bool = False,
            **kw):
  """Median ms of ``fn(*args)`` over ``repeats`` timed calls after ``warmup`` untimed ones
  (:func:`time_calls` takes the other keywords); ``(median, min)`` with ``with_min``."""
  times = time_calls(fn, args, repeats, warmup, **kw)
  median = statistics.median(times)
  return (median, min(times)) if with_min else median
