"""``python -m bench.widths``: each path's time per vocabulary column at the widths a
device holds when a real vocabulary is split over GPUs (not multiples of 128), against
the nearest width above whose segments are whole tiles, in one process on one GPU.

    python -m bench.widths                                  # the default widths and modes
    python -m bench.widths --V 37984,75968 --mode fwd --out bench/out/widths.json
    python -m bench.widths --mode objective,logits          # the other two paths
    python -m bench.widths --V 37984 --mode fwd --out OUT/w.json \
        --merge-into bench/results/nvidia-h200-x1-widths.json  # replace those rows there
    python -m bench.widths --V 128256/4 --mode fwd          # a shard of 128256 over 4 GPUs

Modes: ``fwd`` and ``fwd_bwd``, the fused head (``linear_logprobs_and_entropy``, both
outputs, random per-token cotangents); ``objective``, the GRPO objective path
(``linear_token_loss``, the bench's GRPO objective) forward and backward; ``logits``, the
logits path (``logprobs_and_entropy`` of ``[T, V]`` bf16 logits) forward and backward,
and ``logits_fwd`` its forward alone.

A kernel sees only its shard: a local call at V = 37984 is what each GPU of a 4-way Qwen3
call runs. Not at every width: the kernels cut a shard's columns into segments fixed by the
whole vocabulary (``mosaic_tile.segments``), and Llama 3's 128256 over 4 GPUs is 2 segments
of 16032 a shard where a local call at 32064 is 4 of 8016. ``--V 128256/4`` times the
shard's own segments: the local call at 32064 columns with the kernels tiling them as
that shard (the row's ``shards``: 4). Each row: the median of ``--rounds`` x ``--repeats`` timed calls
(``bench.timing``), inputs made on the host (the logits mode's logits on the device);
``per_column`` is the ragged width's time per column over its round neighbour's, from the
same process, the two timed in alternating rounds. The round neighbour is the nearest
multiple of 128 above whose segments (``mosaic_tile.segments``) are whole tiles, read in
place: a multiple of 128 whose segments are not (38016 is 8 of 4752 columns) pays the
segments' cost itself and would hide it.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics

import numpy as np

from bench.__main__ import git

# Qwen3's 151936 over 2, 4, 8 GPUs (a local call at those widths is the shard's);
# Llama 3's 128256 over 4, and a local call at its shard's width.
WIDTHS = ("37984", "75968", "18992", "128256/4", "32064")
# Whose width each is (the sharded guide's table), by (columns, shards).
LABELS = {(151936, 1): "Qwen3, 8 segments", (37984, 1): "151936 over 4",
          (75968, 1): "151936 over 2", (18992, 1): "151936 over 8",
          (32064, 1): "4 segments of 8016", (32064, 4): "128256 over 4: 2 segments of 16032",
          (151643, 1): "Qwen, unpadded", (50257, 1): "GPT-2",
          (128256, 1): "Llama 3, 8 segments"}


def parse_width(spec: str) -> tuple[int, int]:
  """``(columns, shards)`` of a ``--V`` entry: ``"37984"`` (a local call, one device's
  segments) or ``"128256/4"`` (a shard of 128256 over 4: 32064 columns in that shard's
  segments)."""
  vocab, _, shards = spec.partition("/")
  shards = int(shards or 1)
  if int(vocab) % shards:
    raise ValueError(f"--V {spec}: {vocab} does not split over {shards} devices")
  return int(vocab) // shards, shards


@contextlib.contextmanager
def _tiled_as_shard(columns: int, shards: int):
  """The kernels tile a local call's ``columns`` as one of ``shards`` devices' shard of
  ``columns * shards`` (``logits_rows.layout``, which every kernel path asks), other widths
  as before."""
  from jaxce._kernels import logits_rows  # pylint: disable=import-outside-toplevel
  from jaxce._kernels.mosaic import tile  # pylint: disable=import-outside-toplevel
  own = logits_rows.layout
  logits_rows.layout = lambda num_columns, vocab_axis: (
      tile.segments(num_columns, shards) if num_columns == columns and vocab_axis is None
      else own(num_columns, vocab_axis))
  try:
    yield
  finally:
    logits_rows.layout = own


def round_width(columns: int) -> int:
  """The nearest width ``>= columns`` that the kernels tile in whole tiles of 128 columns,
  every segment's last tile full (37984 -> 38400: 4 segments of 9600)."""
  from jaxce._kernels.mosaic import tile  # pylint: disable=import-outside-toplevel
  width = -(-columns // tile.TILE) * tile.TILE
  while tile.segments(width).partial:
    width += tile.TILE
  return width


def _inputs(tokens, depth, columns, mode="fwd", seed=0):
  """``(hidden, weight, labels, cotangents)`` on the device, made on the host; for the
  ``logits`` modes ``hidden`` is ``[T, columns]`` logits (shifted, some rows peaked), and
  ``weight`` (unused) ``[1, columns]``."""
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  rng = np.random.default_rng(seed)
  logits_mode = mode.startswith("logits")
  if logits_mode:  # (made on the device: a [T, V] f32 array on the host is slow)
    logits = jax.random.normal(jax.random.key(seed), (tokens, columns), jnp.float32) * 2 + 10
    logits = logits.at[::7, 0].add(40).astype(jnp.bfloat16)
    depth = 1
  else:
    hidden = (rng.normal(size=(tokens, depth)) * 0.5).astype(np.float32)
  weight = (rng.normal(size=(depth, columns)) * 2 / np.sqrt(depth)).astype(np.float32)
  labels = rng.integers(0, columns, tokens).astype(np.int32)
  cotangents = rng.normal(size=(2, tokens)).astype(np.float32)
  put = lambda a: jax.device_put(jnp.asarray(a, jnp.bfloat16))
  return (logits if logits_mode else put(hidden), put(weight), jax.device_put(labels),
          jax.device_put(cotangents))


def _call(mode):
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  import jaxce  # pylint: disable=import-outside-toplevel
  from bench.impls import _grpo  # pylint: disable=import-outside-toplevel

  def run(hidden, weight, labels, cotangents):
    if mode == "objective":
      objective, token_args = _grpo(cotangents[0])
      loss = lambda h, w: jnp.sum(jaxce.linear_token_loss(objective, h, w, labels,
                                                          *token_args)[0])
      return jax.grad(loss, (0, 1))(hidden, weight)
    if mode == "logits_fwd":  # (hidden is the [T, V] logits here, and in "logits")
      return jaxce.logprobs_and_entropy(hidden, labels)
    if mode == "logits":
      def logits_loss(x):
        logp, entropy = jaxce.logprobs_and_entropy(x, labels)
        return jnp.sum(logp * cotangents[0] + entropy * cotangents[1])
      return jax.grad(logits_loss)(hidden)
    def loss(h, w):
      logp, entropy = jaxce.linear_logprobs_and_entropy(h, w, labels)
      return jnp.sum(logp * cotangents[0] + entropy * cotangents[1]), (logp, entropy)
    if mode == "fwd":
      return loss(hidden, weight)[1]
    return jax.grad(loss, (0, 1), has_aux=True)(hidden, weight)
  return jax.jit(run)


def measure(widths, modes, tokens, depth, repeats, on_row=lambda rows: None, rounds=3):
  """Rows ``{mode, V, shards, V_round, ms, ms_round, per_column, backend}`` of ``widths``
  (``--V`` entries, ``parse_width``); ``on_row(rows)`` after each. The two widths of a row are timed in ``rounds`` alternating rounds of
  ``repeats`` calls each (both programs compiled and their inputs held beforehand), and
  each width's ``ms`` is the median of all its calls: a GPU's clocks drift over a run (by
  3 % in a 7 ms forward on an H200), and widths timed one after the other took the drift
  for a difference between them."""
  rows = []
  for mode in modes:
    for columns, shards in map(parse_width, widths):
      with _tiled_as_shard(columns, shards):
        rows.append(_row(mode, columns, shards, tokens, depth, repeats, rounds))
      on_row(rows)
  return rows


def _row(mode, columns, shards, tokens, depth, repeats, rounds):
  """One row of ``measure``: ``columns`` (tiled as one of ``shards`` devices' shard) and
  its round neighbour."""
  import jax  # pylint: disable=import-outside-toplevel
  import jaxce  # pylint: disable=import-outside-toplevel
  from bench.timing import time_calls  # pylint: disable=import-outside-toplevel
  round_columns = round_width(columns)
  pair = (columns, round_columns)
  args = {width: _inputs(tokens, depth, width, mode) for width in pair}
  call = _call(mode)  # (one jitted function: a program per width's shapes)
  backend = {width: jaxce.plan.of(call, *args[width]).backend for width in pair}
  timed = {width: [] for width in pair}
  for index in range(rounds):
    for width in pair:
      timed[width] += time_calls(call, args[width], repeats=repeats,
                                 warmup=2 if index == 0 else 1)
  ms = {width: statistics.median(timed[width]) for width in pair}
  del args, call
  jax.clear_caches()
  row = dict(mode=mode, V=columns, shards=shards, V_round=round_columns, T=tokens, D=depth,
             ms=ms[columns], ms_round=ms[round_columns],
             per_column=(ms[columns] / columns) / (ms[round_columns] / round_columns),
             backend=backend[columns], backend_round=backend[round_columns],
             timed_calls=len(timed[columns]))
  print(json.dumps(row), flush=True)
  return row


def row_key(row) -> tuple:
  """A row's shape: ``(mode, T, D, V, shards)`` (a newer row of the same shape replaces
  it)."""
  return row["mode"], row["T"], row["D"], row["V"], row.get("shards", 1)


def merge(old: dict | None, new: dict) -> dict:
  """``new``'s facts (device, versions, commit) and rows, plus ``old``'s rows of shapes
  ``new`` did not run, in ``old``'s order and then ``new``'s."""
  fresh = {row_key(r): r for r in new["rows"]}
  rows = [fresh.pop(row_key(r), r) for r in (old or {}).get("rows", [])]
  return dict(new, rows=rows + list(fresh.values()))


def main(argv=None):
  p = argparse.ArgumentParser(prog="python -m bench.widths", description=__doc__.splitlines()[0])
  p.add_argument("--V", default=",".join(map(str, WIDTHS)), help="comma list of widths")
  p.add_argument("--mode", default="fwd,fwd_bwd", help="comma list: fwd,fwd_bwd,objective,logits,logits_fwd")
  p.add_argument("--T", type=int, default=32768)
  p.add_argument("--D", type=int, default=4096)
  p.add_argument("--repeats", type=int, default=5, help="timed calls per width and round")
  p.add_argument("--rounds", type=int, default=3, help="alternating rounds of the two widths")
  p.add_argument("--out", help="write the rows here (json), with the device and versions")
  p.add_argument("--merge-into", metavar="RESULTS_JSON",
                 help="then merge them into RESULTS_JSON (a committed results file): each row "
                      "replaces the row of its shape (mode, T, D, V) there")
  args = p.parse_args(argv)
  import jax  # pylint: disable=import-outside-toplevel
  commit = os.environ.get("JAXCE_COMMIT") or git("rev-parse", "--short", "HEAD")

  def results(rows):  # (the run's facts, each row with the commit)
    return dict(device=jax.devices()[0].device_kind, jax=jax.__version__, commit=commit,
                rows=[dict(r, commit=commit) for r in rows])

  def save(rows):  # (after each row: a run cut short keeps what it measured)
    if args.out:
      with open(args.out, "w", encoding="utf-8") as f:
        json.dump(results(rows), f, indent=1)

  rows = measure(args.V.split(","), args.mode.split(","), args.T, args.D,
                 args.repeats, save, args.rounds)
  if args.merge_into:
    old = None
    if os.path.exists(args.merge_into):
      with open(args.merge_into, encoding="utf-8") as f:
        old = json.load(f)
    with open(args.merge_into, "w", encoding="utf-8") as f:
      json.dump(merge(old, results(rows)), f, indent=1)


if __name__ == "__main__":
  main()
