"""Timing helpers shared by the GPU development probes in this folder."""

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.floors import median_seconds  # noqa: E402


def bench(f, *args, repeats=15):
  """Median wall time in ms of ``f(*args)`` (bench.floors.median_seconds)."""
  return 1e3 * median_seconds(f, *args, repeats=repeats)


def emit(**row):
  """Print one JSON line (the probes' output format)."""
  print(json.dumps(row), flush=True)
