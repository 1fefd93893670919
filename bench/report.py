"""Results files: merge rows into ``<slug>.json``, write the ``.md`` table and the plot.

    python -m bench.report bench/results/cpu.json     # rewrite cpu.md and cpu_memory.png
    python -m bench.report bench/results/cpu.json --readme-T 4096   # a docs/benchmarks.md table
    python -m bench.report OUT/main/nvidia-h200-x1.json --merge-into bench/results/nvidia-h200-x1.json

JSON schema (issue 4; extra keys are documented in bench/README.md)::

    {"device": str, "n_devices": int, "jax": str, "hbm_GBps": float, "bf16_tflops": float,
     "commit": str,
     "rows": [{"impl": str, "input": "logits" | "linear", "mode": "fwd" | "fwd_bwd",
               "T": int, "V": int, "D": int | null, "dtype": str, "chunk_size": int | null,
               "n_devices": int, "status": "ok" | "oom" | "error" | "skipped",
               "peak_extra_bytes": int, "logits_bytes": int, "ms": float,
               "floor_ms": float, ...}]}

``peak_extra_bytes`` and ``ms`` are null in rows whose status is not ``"ok"``.
"""

from __future__ import annotations

import argparse
import json
import os

from bench import configs
from bench.configs import row_key

STATUSES = ("ok", "oom", "error", "skipped")
GiB = 2**30


def load(path: str) -> dict | None:
  if not os.path.exists(path):
    return None
  with open(path) as f:
    return json.load(f)


def merge(old: dict | None, new: dict) -> dict:
  """``new``'s top-level facts and rows, plus ``old``'s rows that ``new`` does not redo.

  A new row that did not run because its package is missing (status ``"skipped"``) does
  not replace a row measured earlier where the package was installed.
  """
  old_rows = {row_key(r): r for r in (old or {}).get("rows", [])}
  rows = {}
  for r in new["rows"]:
    previous = old_rows.get(row_key(r))
    skipped = lambda row: row.get("status") == "skipped" or bool(row.get("skipped"))
    rows[row_key(r)] = previous if skipped(r) and previous and not skipped(previous) else r
  kept = [r for k, r in old_rows.items() if k not in rows]
  return dict(new, rows=sort_rows(kept + list(rows.values())))


def devices(row) -> str:
  """A row's device count, with its mesh when it is data × vocab (``"4 (2 × 2)"``)."""
  data = row.get("data") or 1
  n = row["n_devices"]
  return str(n) if data == 1 else f"{n} ({data} × {n // data})"


def sort_rows(rows):
  order = {v: i for i, v in enumerate(configs.VARIANTS)}
  return sorted(rows, key=lambda r: (
      r["n_devices"], r.get("data") or 1, r["input"] != "logits", r["mode"], r["T"],
      r["D"] or 0, r["dtype"], r["chunk_size"] or 0, r["impl"] != "jaxce", r["impl"],
      order.get(r.get("variant"), 9)))


def name(row) -> str:
  variant = row.get("variant", "default")
  return row["impl"] if variant == "default" else f"{row['impl']}:{variant}"


def _fmt(value, spec):
  return "–" if value is None else format(value, spec)


def _accuracy_by_name(accuracy) -> dict:
  if accuracy and "T" not in accuracy:
    return {}
  return {name(a): a for a in (accuracy or {}).get("rows", []) if a.get("status") == "ok"}


def _errors(a) -> str:
  """``logp, H, d hidden, d W`` errors of one accuracy row (bench/README.md defines them)."""
  return ", ".join(_fmt(a.get(k), ".1e") for k in ACCURACY_KEYS)


ACCURACY_KEYS = ("logp", "entropy", "d_hidden", "d_W")


def table(rows, accuracy=None) -> str:
  """A markdown table of ``rows``: memory in GiB and as a multiple of the logits' bytes,
  time in ms and as a multiple of the floor; a ``commit`` column when the rows come from
  several commits (a merged file); with ``accuracy`` (:mod:`bench.accuracy`'s results),
  each fused-path row's errors vs float64 at its T."""
  commits = len({r.get("commit") for r in rows}) > 1
  by_name = _accuracy_by_name(accuracy)
  head = ("| impl | input | mode | T | V | D | dtype | chunk | dev | status | extra GiB "
          "| × logits | ms | floor ms | × floor | memory from |")
  if by_name:
    head += f" error vs f64 at T={accuracy['T']}: logp, H, d hidden, d W |"
  if commits:
    head += " commit |"
  lines = [head, "|" + "---|" * head.count(" | ") + "---|"]
  for r in rows:
    chunk = r["chunk_size"] if r["chunk_size"] is not None else (
        f"auto ({r['chunk_used']})" if r.get("chunk_used") else "–")
    status = r["status"] if r["status"] == "ok" else f"**{r['status']}**"
    extra = None if r["peak_extra_bytes"] is None else r["peak_extra_bytes"] / GiB
    line = (
        f"| {name(r)}{'' if r.get('entropy', True) else ' (logp)'} | {r['input']} "
        f"| {r['mode']} | {r['T']} | {r['V']} | {_fmt(r['D'], 'd')} | {r['dtype']} | {chunk} "
        f"| {devices(r)} | {status} | {_fmt(extra, '.3f')} | {_fmt(r.get('x_logits'), '.2f')} "
        f"| {_fmt(r['ms'], '.2f')} | {_fmt(r['floor_ms'], '.2f')} "
        f"| {_fmt(r.get('x_floor'), '.2f')} | {r.get('memory_source') or '–'} |")
    if by_name:
      a = by_name.get(name(r)) if r["input"] == "linear" and r["n_devices"] == 1 else None
      line += f" {_errors(a) if a else '–'} |"
    if commits:
      line += f" {(r.get('commit') or '?')[:7]} |"
    lines.append(line)
  return "\n".join(lines)


def summary_table(results: dict, T: int, chunks: bool = False) -> str:
  """A table of the benchmarks page (docs/benchmarks.md): the rows at ``T`` tokens with the
  default chunk size, one line each; with ``chunks``, also the rows of a given chunk size
  (named ``impl (chunk N)``)."""
  head = ("| impl | input | mode | T | GPUs | extra memory (per GPU) | × logits bytes | time "
          "| × floor |")
  lines = [head, "|" + "---|" * head.count(" | ") + "---|"]
  for r in sort_rows(results["rows"]):
    if r["T"] != T or (r["chunk_size"] is not None and not chunks):
      continue
    logp = "" if r.get("entropy", True) else " (logp)"
    if r["chunk_size"] is not None:
      logp += f" (chunk {r['chunk_size']})"
    if r["status"] != "ok":
      lines.append(f"| {name(r)}{logp} | {r['input']} | {r['mode']} | {r['T']} "
                   f"| {devices(r)} | **{r['status']}** | – | – | – |")
      continue
    lines.append(
        f"| {name(r)}{logp} | {r['input']} | {r['mode']} | {r['T']} | {devices(r)} "
        f"| {r['peak_extra_bytes'] / GiB:.2f} GiB | {_fmt(r.get('x_logits'), '.2f')} "
        f"| {r['ms']:.1f} ms | {_fmt(r.get('x_floor'), '.2f')} |")
  return "\n".join(lines)


def markdown(results: dict) -> str:
  rates = ", ".join(f"{k} {v:.3g}" for k, v in results.get("matmul_tflops", {}).items())
  parts = [
      f"# Benchmark results: {results['device']} × {results['n_devices']}",
      "",
      f"JAX {results['jax']}, host {results.get('host', '?')}, "
      f"commit `{results['commit'][:12]}`"
      f"{' (uncommitted changes)' if results.get('dirty') else ''}, {results.get('date', '')}. "
      f"Floors measured by the latest run: HBM {results['hbm_GBps']:.1f} GB/s, "
      f"matmul TFLOP/s: {rates or results['bf16_tflops']}; each row's floor ms comes "
      "from the run that measured the row" + (
          ", at the machine's best (the floors section below; `floor_source`)"
          if results.get("machine_floors", {}).get("floors") else "") + ".",
      "",
      "Loss `sum(adv * logp) + c * sum(H)`, c = 0.01 (0 for log-prob-only rows, marked "
      "(logp)). Extra memory = peak minus the inputs, per device; `× logits` = extra / "
      "(T·V·itemsize per device); `× floor` = time / floor (bench/NOTES.md defines the "
      "floors). memory from: `device_peak` = measured allocator peak, `xla_plan` = XLA's "
      "compiled memory plan (on CPU; on a GPU where the compile-time peak hides the run's, "
      "as the row's note says), `torch_cuda_peak`, `host_rss`.",
      "",
      table(results["rows"], results.get("accuracy")),
  ]
  if results.get("accuracy"):
    parts += ["", accuracy_markdown(results["accuracy"])]
  if results.get("machine_floors"):
    from bench import machine_floors
    parts += ["", machine_floors.markdown(results["machine_floors"])]
  sweeps = sweep_summary(results["rows"])
  if sweeps:
    parts += ["", "## Chunk-size sweeps: the default chunk vs the best one", "",
              "| impl | input | mode | T | V | D | dev | default chunk | ms | best chunk | ms "
              "| default / best |", "|" + "---|" * 12]
    parts += sweeps
  errors = [r for r in results["rows"] if r["status"] != "ok" and r.get("error")]
  if errors:
    parts += ["", "## Rows that did not run", ""]
    parts += [f"- {name(r)} {r['input']} {r['mode']} T={r['T']} n={devices(r)}: "
              f"{r['status']}: " + (r["error"] if r["status"] == "skipped" else
                                    r["error"].splitlines()[0][:300]) for r in errors]
  notes = sorted({f"{name(r)}: {r['note']}" for r in results["rows"] if r.get("note")})
  if notes:
    parts += ["", "## Notes", ""] + [f"- {n}" for n in notes]
  return "\n".join(parts) + "\n"


def accuracy_markdown(accuracy: dict) -> str:
  """The accuracy section: each fused-path impl's errors vs float64 (bench/README.md)."""
  if "rows" not in accuracy:
    return f"## Error vs float64\n\nNot measured: {accuracy.get('error')}"
  lines = [f"## Error vs float64 (T = {accuracy['T']}, V = {accuracy['V']}, D = "
           f"{accuracy['D']}, {accuracy['dtype']} operands)", "",
           accuracy.get("definition", ""), "",
           "| impl | loss | logp | entropy | d hidden | d W | note |", "|---|---|---|---|---|---|---|"]
  for a in accuracy["rows"]:
    if a.get("status") != "ok":
      lines.append(f"| {name(a)} | – | **{a.get('status')}** | – | – | – | "
                   f"{(a.get('error') or '').splitlines()[0][:200] if a.get('error') else ''} |")
      continue
    lines.append(f"| {name(a)} | {a.get('loss', '')} | " + " | ".join(
        _fmt(a.get(k), ".2e") for k in ACCURACY_KEYS) + f" | {a.get('note') or ''} |")
  return "\n".join(lines)


def sweep_summary(rows) -> list[str]:
  """Table lines comparing ``chunk_size=None`` with the fastest explicit chunk size, for
  every configuration measured at several chunk sizes (issue 5, target 6)."""
  groups = {}
  for r in rows:
    if r["status"] == "ok" and r["ms"]:
      key = row_key(r)[:8] + row_key(r)[9:]  # all but chunk_size
      groups.setdefault(key, []).append(r)
  lines = []
  for group in groups.values():
    default = [r for r in group if r["chunk_size"] is None]
    explicit = [r for r in group if r["chunk_size"] is not None]
    if default and explicit:
      d, best = default[0], min(explicit, key=lambda r: r["ms"])
      lines.append(f"| {name(d)} | {d['input']} | {d['mode']} | {d['T']} | {d['V']} "
                   f"| {_fmt(d['D'], 'd')} | {d['n_devices']} | {_fmt(d.get('chunk_used'), 'd')} "
                   f"| {d['ms']:.2f} | {best['chunk_size']} | {best['ms']:.2f} "
                   f"| {d['ms'] / best['ms']:.3f} |")
  return lines


def panels(rows) -> list[tuple]:
  """The plot's panels: one ``(input, V, D, dtype)`` each (``D`` 0 on logits), so that no
  panel mixes shapes; logits first."""
  order = {"logits": 0, "linear": 1}
  return sorted({(r["input"], r["V"], r["D"] or 0, r["dtype"]) for r in rows},
                key=lambda k: (order.get(k[0], 2),) + k[1:])


def plot(results: dict, path: str) -> None:
  """Peak extra memory vs T (fwd_bwd, default chunk sizes), one line per implementation,
  one panel per path."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  import matplotlib.ticker
  rows = [r for r in results["rows"] if r["mode"] == "fwd_bwd" and r["chunk_size"] is None]
  shapes = panels(rows) or [("logits", 0, 0, "?")]
  fig, axes = plt.subplots(1, len(shapes), figsize=(6.5 * len(shapes), 4.8), squeeze=False)

  def label(r):
    return name(r) + ("" if r.get("entropy", True) else " (logp)") + (
        f" ×{devices(r)} dev" if r["n_devices"] > 1 else "")

  keys = sorted({label(r) for r in rows})
  palette = plt.get_cmap("tab10" if len(keys) <= 10 else "tab20").colors
  colors = {k: palette[i % len(palette)] for i, k in enumerate(keys)}
  for ax, shape in zip(axes[0], shapes):
    lines = {}
    for r in rows:  # one panel, one shape: never two (V, D) on the same axes
      if (r["input"], r["V"], r["D"] or 0, r["dtype"]) == shape:
        lines.setdefault(label(r), []).append(r)
    for key, group in sorted(lines.items()):
      ok = sorted((r["T"], r["peak_extra_bytes"] / GiB) for r in group
                  if r["status"] == "ok" and r["peak_extra_bytes"] is not None)
      if not ok and not any(r["status"] == "oom" for r in group):
        continue  # skipped rows: named under the table, not in the legend
      style = "-" if key.startswith("jaxce") else "--"
      ax.plot([t for t, _ in ok], [m for _, m in ok], style, marker="o", label=key,
              color=colors[key])
      failed = sorted(r["T"] for r in group if r["status"] == "oom")
      if failed:
        ax.plot(failed, [1.0] * len(failed), "x", color=colors[key], markersize=10,
                transform=ax.get_xaxis_transform(), clip_on=False)
    if not any(line.get_xydata().size for line in ax.get_lines()):
      ax.text(0.5, 0.5, "no measured rows", ha="center", transform=ax.transAxes)
      ax.set_title(f"{shape[0]} path, fwd+bwd", fontsize=10)
      continue
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.yaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda y, _: f"{y:g}"))
    ax.yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    ax.set_xlabel("tokens T")
    ax.set_ylabel("peak extra memory per device (GiB)")
    inp, V, D, dtype = shape
    ax.set_title(f"{inp} path, fwd+bwd: V={V}" + (f", D={D}" if D else "") + f", {dtype}",
                 fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    if lines:
      ax.legend(fontsize=7)
  sources = sorted({r.get("memory_source") for r in rows if r.get("memory_source")})
  fig.suptitle(f"{results['device']} × {results['n_devices']}, JAX {results['jax']} "
               f"(memory: {', '.join(sources)}; × = out of memory)", fontsize=10)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def write(results: dict, json_path: str) -> dict:
  """Write ``results`` to ``json_path`` and its ``.md`` table and ``_memory.png`` plot."""
  stem = json_path[:-len(".json")] if json_path.endswith(".json") else json_path
  os.makedirs(os.path.dirname(os.path.abspath(json_path)), exist_ok=True)
  with open(json_path, "w") as f:
    json.dump(results, f, indent=1)
    f.write("\n")
  with open(stem + ".md", "w") as f:
    f.write(markdown(results))
  plot(results, stem + "_memory.png")
  return dict(json=json_path, md=stem + ".md", png=stem + "_memory.png")


def main(argv=None):
  parser = argparse.ArgumentParser(description="Rewrite a results JSON's table and plot.")
  parser.add_argument("json", help="bench/results/<slug>.json")
  parser.add_argument("--readme-T", type=int,
                      help="print README's summary table of the rows at this T instead")
  parser.add_argument("--chunks", action="store_true",
                      help="with --readme-T: also the rows of a given chunk size")
  parser.add_argument("--merge-into", metavar="RESULTS_JSON",
                      help="merge this run's rows into RESULTS_JSON (e.g. bench/results/"
                      "nvidia-h200-x1.json, from a GPU session's $OUT) and rewrite its .md/.png")
  args = parser.parse_args(argv)
  results = load(args.json)
  if results is None:
    raise SystemExit(f"no such file: {args.json}")
  if args.merge_into:
    merged = merge(load(args.merge_into), results)
    for key in ("accuracy", "machine_floors"):  # this run's, or the file's own
      if key not in results and key in (load(args.merge_into) or {}):
        merged[key] = load(args.merge_into)[key]
    for path in write(merged, args.merge_into).values():
      print(path)
    return
  if args.readme_T:
    print(summary_table(results, args.readme_T, args.chunks))
    return
  for path in write(results, args.json).values():
    print(path)


if __name__ == "__main__":
  main()
