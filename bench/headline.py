"""``python -m bench.headline``: README's headline and the benchmarks page's full tables,
made from the committed results: the fused path at the shapes users run (``python -m bench
--suite shapes``: jaxce, Liger's FLSCE and plain JAX in one machine session) as a compact
table (README), a full one (docs/benchmarks.md) and one chart; the vocabulary over every
GPU count of a run (``--suite gpu-shards``: README's table, and a scaling chart on the
benchmarks page); the GRPO step (``python -m bench.grpo_step``, docs/benchmarks.md); each
path's time per column at the widths a GPU holds (``python -m bench.widths``, the sharded
guide).

    python -m bench.headline            # print the blocks
    python -m bench.headline --write    # rewrite the marked blocks and the two charts

A page marks each block with ``<!-- headline-KIND PATH -->`` on the line before it (KIND
one of ``BLOCKS``) and ``<!-- /headline -->`` on the line after it; tests/test_bench.py
checks that every marked block is what this module prints.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import statistics

from bench import grpo_step
from bench.__main__ import ROOT

PAGES = ("README.md", "docs/benchmarks.md", "docs/guides/sharded.md")
SHAPES = "bench/results/nvidia-h100-x1-shapes.json"
GRPO = "bench/results/nvidia-h100-x1-grpo_step.json"
SHARDS = "bench/results/nvidia-h200-x4-shards.json"
SHARDS_V, SHARDS_T = 151936, 32768  # (the sharded table's shape: Qwen3's vocabulary)
SHARDS_CHART = "bench/results/nvidia-h200-x4-shards_scaling.png"
CHART = "bench/results/nvidia-h100-x1-shapes_headline.png"
PEERS = (("jaxce", "jaxce"), ("liger_flsce", "FLSCE"), ("jax_plain", "plain JAX"))
ROW_BLOCK = 256  # the Mosaic kernels' rows per CTA: a T that divides by it is "round"


def _rows(results, impl, mode):
  """``{(V, D, T): row}`` of the ``ok`` rows of ``impl`` in ``mode``; a shape run several
  times at one commit reads as one row (``_pooled``)."""
  runs = {}
  for r in results["rows"]:
    if (r["impl"] == impl and r["variant"] == "default" and r["mode"] == mode
        and r["status"] == "ok"):
      runs.setdefault((r["V"], r["D"], r["T"]), []).append(r)
  return {key: _pooled(rows) for key, rows in runs.items()}


def _pooled(rows):
  """One row for several runs of one shape (each a fresh process, at one commit): the
  median of their times, the largest of their peaks, and ``runs``, their number."""
  if len(rows) == 1:
    return rows[0]
  commits = sorted({r.get("commit", "")[:7] for r in rows})
  if len(commits) > 1:
    raise ValueError(f"{rows[0]['impl']} at V, D, T = {rows[0]['V']}, {rows[0]['D']}, "
                     f"{rows[0]['T']} has rows of commits {commits}: the runs of one shape "
                     "that a cell pools must be of one commit")
  return {**rows[0], "ms": statistics.median(r["ms"] for r in rows),
          "peak_extra_bytes": max(r["peak_extra_bytes"] for r in rows), "runs": len(rows)}


def _same_run(row, other) -> bool:
  """Whether two rows come from one run of the same code (their commits), so that a
  ratio of their times compares the code, not two machine sessions."""
  return row.get("commit", "")[:7] == other.get("commit", "")[:7]


def _per_token_vs_round(rows, key) -> str:
  """The time per token of ``rows[key]`` over that of the round T (a multiple of
  ``ROW_BLOCK``) nearest it in ratio, of the same V and D: "round" for a round T, "–"
  when no round T of that V and D was measured, or not in the same run."""
  V, D, T = key
  if T % ROW_BLOCK == 0:
    return "round"
  rounds = [k for k in rows if k[:2] == (V, D) and k[2] % ROW_BLOCK == 0]
  if not rounds:
    return "–"
  near = min(rounds, key=lambda k: abs(math.log(k[2] / T)))
  if not _same_run(rows[key], rows[near]):
    return "–"
  return f"{(rows[key]['ms'] / T) / (rows[near]['ms'] / near[2]):.3f} (of {near[2]})"


def shapes_table(results: dict) -> str:
  """The fused path, fwd+bwd (with entropy, bf16) and forward, one line per (V, D, T), each
  mode's time per token against its round T's; a ratio only between rows of the same run
  (``_same_run``), else "–"; a shape run several times shows the median of its runs
  (``_pooled``), and a line under the table says so."""
  bwd = {impl: _rows(results, impl, "fwd_bwd") for impl, _ in PEERS}
  fwd = {impl: _rows(results, impl, "fwd") for impl, _ in PEERS}
  ms = lambda row: ("–" if row is None else f"{row['ms']:.1f}"
                    + (f" ({row['runs']})" if row.get("runs") else ""))
  gib = lambda row: "–" if row is None else f"{row['peak_extra_bytes'] / 2**30:.2f}"
  lines = ["| V | D | T | jaxce fwd+bwd ms | FLSCE ms | jaxce / FLSCE | jaxce per token / "
           "round T's | plain JAX ms | jaxce fwd ms | FLSCE fwd ms | jaxce fwd per token / "
           "round T's | extra GiB: jaxce / FLSCE / plain JAX |", "|---" * 12 + "|"]
  for key in sorted(bwd["jaxce"]):
    ours, peer, plain = (bwd[impl].get(key) for impl, _ in PEERS)
    lines.append("| " + " | ".join([
        str(key[0]), str(key[1]), str(key[2]), ms(ours), ms(peer),
        "–" if peer is None or not _same_run(ours, peer) else f"{ours['ms'] / peer['ms']:.3f}",
        _per_token_vs_round(bwd["jaxce"], key), ms(plain),
        ms(fwd["jaxce"].get(key)), ms(fwd["liger_flsce"].get(key)),
        _per_token_vs_round(fwd["jaxce"], key) if key in fwd["jaxce"] else "–",
        " / ".join(gib(r) for r in (ours, peer, plain))]) + " |")
  if any(row.get("runs") for rows in (*bwd.values(), *fwd.values()) for row in rows.values()):
    lines += ["", "A time with (n) after it is the median of n runs, each a fresh process, at "
              "one commit; its GiB the largest of their peaks."]
  return "\n".join(lines)


COMPACT_T = 16192  # a ragged T (OpenRLHF's budget) at which plain JAX's logits still fit


def compact_table(results: dict) -> str:
  """README's table: the fused fwd+bwd at ``COMPACT_T`` tokens, V = 151936, one line per
  hidden size: jaxce, FLSCE and plain JAX, time and extra memory (a ratio only between
  rows of one run)."""
  bwd = {impl: _rows(results, impl, "fwd_bwd") for impl, _ in PEERS}
  ms = lambda row: "–" if row is None else f"{row['ms']:.1f}"
  gib = lambda row: "–" if row is None else f"{row['peak_extra_bytes'] / 2**30:.2f}"
  ratio = lambda a, b: ("–" if a is None or b is None or not _same_run(a, b)
                        else f"{a['ms'] / b['ms']:.2f}")
  lines = ["| D | jaxce ms | FLSCE ms | plain JAX ms | jaxce / FLSCE | jaxce / plain JAX | "
           "extra GiB: jaxce / FLSCE / plain JAX |", "|---" * 7 + "|"]
  for key in sorted(k for k in bwd["jaxce"] if k[0] == 151936 and k[2] == COMPACT_T):
    ours, peer, plain = (bwd[impl].get(key) for impl, _ in PEERS)
    lines.append("| " + " | ".join([
        str(key[1]), ms(ours), ms(peer), ms(plain), ratio(ours, peer), ratio(ours, plain),
        " / ".join(gib(r) for r in (ours, peer, plain))]) + " |")
  return "\n".join(lines)


# (row name, input, variant, the variant of its one-GPU baseline): the token-split layout
# has no one-GPU row of its own (one device holds every token either way).
SHARDED_PATHS = (("fused", "linear", "default", "default"),
                 ("fused, tokens split", "linear", "token_split", "default"),
                 ("GRPO objective", "linear", "objective_grpo", "objective_grpo"),
                 ("logits", "logits", "default", "default"))


def _sharded_rows(results: dict):
  """``({(input, variant, n): row}, sorted GPU counts)`` of a sharded run's ok fwd+bwd rows."""
  rows = {(r["input"], r["variant"], r["n_devices"]): r for r in results["rows"]
          if r["impl"] == "jaxce" and r["mode"] == "fwd_bwd" and r["status"] == "ok"
          and (r.get("data") or 1) == 1 and r["V"] == SHARDS_V and r["T"] == SHARDS_T}
  return rows, sorted({n for _, _, n in rows})


def _sharded_paths(rows, counts):
  """``(name, {n: row})`` of each of ``SHARDED_PATHS`` measured at every count of the run
  (``n = 1``: its one-GPU base row)."""
  for name, path, variant, base_variant in SHARDED_PATHS:
    one = rows.get((path, base_variant, 1))
    if one is None or any((path, variant, n) not in rows for n in counts if n > 1):
      continue
    yield name, {n: one if n == 1 else rows[path, variant, n] for n in counts}


def shards_table(results: dict) -> str:
  """README's sharded rows: each path's fwd+bwd on every GPU count of the run, time and
  extra memory per GPU, each against the one-GPU row (×; the token-split layout against
  the fused path's one-GPU row). A path missing at some count of the run is left out."""
  rows, counts = _sharded_rows(results)
  gpus = lambda n: "1 GPU" if n == 1 else f"{n} GPUs"
  lines = ["| path | " + " | ".join(f"{gpus(n)} ms" for n in counts) + " | "
           + " | ".join(f"{gpus(n)} GiB" for n in counts) + " |",
           "|---" * (1 + 2 * len(counts)) + "|"]
  gib = lambda r: r["peak_extra_bytes"] / 2**30
  for name, by_count in _sharded_paths(rows, counts):
    one = by_count[1]
    cell = lambda n, value, base, fmt: (f"{value:{fmt}}" if n == 1
                                        else f"{value:{fmt}} ({value / base:.2f}×)")
    times = [cell(n, by_count[n]["ms"], one["ms"], ".1f") for n in counts]
    memory = [cell(n, gib(by_count[n]), gib(one), ".2f") for n in counts]
    lines.append(f"| {name} | " + " | ".join(times + memory) + " |")
  return "\n".join(lines)


def shards_chart(results: dict, path: str) -> None:
  """Time and extra memory per GPU of each sharded path's fwd+bwd against the GPU count,
  each × its one-GPU row (``shards_table``'s numbers), beside the ideal ``1 / n``: one
  figure, two panels, log-log; the title names the device and the commit."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  rows, counts = _sharded_rows(results)
  fig, axes = plt.subplots(1, 2, figsize=(10, 4))
  for ax, key, label in ((axes[0], "ms", "fwd+bwd time"),
                         (axes[1], "peak_extra_bytes", "extra memory per GPU")):
    ax.plot(counts, [1 / n for n in counts], "k--", lw=1, label="ideal 1 / n")
    for name, by_count in _sharded_paths(rows, counts):
      ax.plot(counts, [by_count[n][key] / by_count[1][key] for n in counts], "o-", label=name)
    ax.set(xscale="log", yscale="log", xlabel="GPUs (vocabulary shards)",
           ylabel=f"{label}, × one GPU", xticks=counts)
    ax.set_xticklabels([str(n) for n in counts])
    ax.set_yticks([2.0**-k for k in range(len(counts) + 1)])
    ax.yaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda y, _: f"{y:g}"))
    for axis in (ax.xaxis, ax.yaxis):
      axis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    ax.grid(True, which="both", alpha=0.3)
  axes[1].legend(fontsize=8)
  commits = ", ".join(sorted({r.get("commit", "?") for r in rows.values()}))
  _save(fig, f"V = 151936 split over GPUs, T = 32768, D = 4096, bf16: "
        f"{results['n_devices']} × {results['device']}, JAX {results['jax']}, "
        f"jaxce {commits}", path)


WIDTH_MODES = (("fwd", "fused forward"), ("fwd_bwd", "fused fwd+bwd"),
               ("objective", "objective fwd+bwd"), ("logits_fwd", "logits forward"),
               ("logits", "logits fwd+bwd"))


def widths_table(results: dict) -> str:
  """The sharded guide's table: each path's time per column at each width of
  ``python -m bench.widths``'s rows against the next multiple of 128 in the same process
  (``per_column``), one line per width (``widths.LABELS`` says whose it is), ``–`` where
  a path was not measured at that width, the backend named where the width ran another
  than its neighbour. Rows at more than one shape: one line per shape and width, the
  shape in its first column."""
  from bench import widths  # pylint: disable=import-outside-toplevel
  rows = {widths.row_key(r): r for r in results["rows"]}
  modes = [(m, name) for m, name in WIDTH_MODES if any(k[0] == m for k in rows)]
  shapes = len({k[1:3] for k in rows}) > 1
  lines = ["| " + ("shape | " if shapes else "") + "columns a GPU | "
           + " | ".join(name for _, name in modes) + " |",
           "|---" * (len(modes) + 1 + shapes) + "|"]
  for tokens, depth, columns, shards in dict.fromkeys(k[1:] for k in rows):
    label = widths.LABELS.get((columns, shards), f"a shard of {shards}" * (shards > 1))
    label = f" ({label})" if label else ""
    cells = [f"{row['per_column']:.2f}×{_backend_note(row)}"
             if (row := rows.get((m, tokens, depth, columns, shards))) else "–"
             for m, _ in modes]
    shape = f"T = {tokens}, D = {depth} | " if shapes else ""
    lines.append(f"| {shape}{columns}{label} | " + " | ".join(cells) + " |")
  return "\n".join(lines)


def _backend_note(row: dict) -> str:
  """`` (XLA)`` where a width's row ran XLA while its round neighbour ran the kernels."""
  backend = row.get("backend", "mosaic")
  return "" if backend == row.get("backend_round", backend) else f" ({backend.upper()})"


def grpo_tables(results: dict) -> str:
  """``bench.grpo_step``'s tables (one per model size, each under its size as a bold
  line, then the paths that failed), without its title paragraph."""
  body = grpo_step.markdown(results).split("\n## ", 1)[1]
  return "\n".join(f"**{line[3:]}**" if line.startswith("## ") else line
                   for line in ("## " + body).strip().splitlines())


def chart(results: dict, path: str) -> None:
  """Time per 1000 tokens and extra memory of the fused fwd+bwd against T (V = 151936),
  jaxce, FLSCE and plain JAX at D = 1024, 2048 and 4096 (the table has every D): one
  figure, two panels (a flat time line: no shape costs more per token than its
  neighbours); the title names the commits of the jaxce rows drawn."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  import matplotlib.ticker
  fig, (time_ax, memory_ax) = plt.subplots(1, 2, figsize=(11, 4.2))
  colors = dict(jaxce="tab:blue", liger_flsce="tab:orange", jax_plain="tab:gray")
  styles = {1024: ":", 2048: "--", 4096: "-"}
  drawn = {k: r for k, r in _rows(results, "jaxce", "fwd_bwd").items()
           if k[0] == 151936 and k[1] in styles}
  commits = ", ".join(sorted({r.get("commit", results["commit"])[:7] for r in drawn.values()}))
  for impl, label in PEERS:
    rows = _rows(results, impl, "fwd_bwd")
    for D, style in styles.items():
      keys = sorted(k for k in rows if k[0] == 151936 and k[1] == D)
      if not keys:
        continue
      T = [k[2] for k in keys]
      kw = dict(color=colors[impl], linestyle=style, marker="o", markersize=3,
                label=f"{label}, D = {D}")
      time_ax.plot(T, [1000 * rows[k]["ms"] / k[2] for k in keys], **kw)
      memory_ax.plot(T, [rows[k]["peak_extra_bytes"] / 2**30 for k in keys], **kw)
  time_ax.set(xlabel="tokens T (ragged and round)", ylabel="fwd+bwd ms per 1000 tokens",
              ylim=(0, None))
  memory_ax.set(xlabel="tokens T (ragged and round)", ylabel="extra device memory, GiB",
                yscale="log")
  memory_ax.yaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda y, _: f"{y:g}"))
  for ax in (time_ax, memory_ax):
    ax.grid(True, which="both", alpha=0.3)
  memory_ax.legend(fontsize=7, ncol=2)
  _save(fig, f"fused LM head, V = 151936, bf16, fwd+bwd with entropy: {results['device']}, "
        f"JAX {results['jax']}, jaxce {commits}, Liger-Kernel "
        f"{results['versions'].get('liger-kernel')}", path)


def _save(fig, title, path):
  """``fig`` under ``title``, written to ``path`` (100 dpi) and closed."""
  import matplotlib.pyplot as plt
  fig.suptitle(title, fontsize=9)
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)


BLOCKS = {"headline-shapes": shapes_table, "headline-grpo": grpo_tables,
          "headline-compact": compact_table, "headline-shards": shards_table,
          "headline-widths": widths_table}


def blocks(page: str) -> list[tuple[int, int, str]]:
  """``(first line, end line, generated text)`` of each marked block of ``page``: the
  lines between its marker and the next ``<!-- /headline -->``."""
  lines, out = page.splitlines(), []
  for i, line in enumerate(lines):
    found = re.match(r"<!-- (headline-\w+) (\S+) -->$", line)
    if not found:
      continue
    with open(os.path.join(ROOT, found[2])) as f:
      text = BLOCKS[found[1]](json.load(f))
    out.append((i + 1, lines.index("<!-- /headline -->", i), text))
  return out


def main(argv=None):
  p = argparse.ArgumentParser(prog="python -m bench.headline",
                              description=__doc__.splitlines()[0])
  p.add_argument("--write", action="store_true", help="rewrite the pages' blocks and the chart")
  args = p.parse_args(argv)
  for page in PAGES:
    path = os.path.join(ROOT, page)
    with open(path) as f:
      text = f.read()
    if not args.write:
      for _, _, block in blocks(text):
        print(block + "\n")
      continue
    lines = text.splitlines()
    for start, end, block in reversed(blocks(text)):
      lines[start:end] = block.splitlines()
    with open(path, "w") as f:
      f.write("\n".join(lines) + "\n")
  if args.write:
    with open(os.path.join(ROOT, SHAPES)) as f:
      chart(json.load(f), os.path.join(ROOT, CHART))
    with open(os.path.join(ROOT, SHARDS)) as f:
      shards_chart(json.load(f), os.path.join(ROOT, SHARDS_CHART))
    print(f"wrote {', '.join(PAGES)}, {CHART} and {SHARDS_CHART}")


if __name__ == "__main__":
  main()
