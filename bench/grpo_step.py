"""``python -m bench.grpo_step``: the GRPO training step at named model sizes, every loss
path, written to bench/out/<device>-grpo_step.json (.md).

    python -m bench.grpo_step                                # small and medium, V = 151936
    python -m bench.grpo_step --sizes small --largest-batch  # and each path's largest batch
    python -m bench.grpo_step --tiny --sizes small           # CPU smoke (tests/test_bench.py)
    python -m bench.grpo_step --reports small=a.json,medium=b.json  # tabulate gpu_run's reports
    python -m bench.grpo_step --sizes medium --merge         # add a size to the file there
    python -m bench.grpo_step --sizes medium --meshes 2x2:sp --merge  # or a mesh of a size
    python -m bench.grpo_step --meshes 1x1,2x2               # 1 GPU, then 2 x 2 (data x vocab)
    python -m bench.grpo_step --meshes 1x1,2x2,2x2:sp        # and sequence parallel on 2 x 2
    python -m bench.grpo_step --attention cudnn              # the model's attention on cuDNN

Each size (and each mesh of ``--meshes``, ``DATAxVOCAB`` over the first ``DATA * VOCAB``
devices; default: one ``1 x n`` mesh over every visible device; ``DATAxVOCAB:sp`` in the
sequence-parallel layout, ``GRPOConfig.sequence_parallel``: the batch split over every
device, the token embedding's rows over vocab) is one ``python -m
examples.gpu_run`` (each path in its own fresh process: median
step time, median scoring time, peak device memory; see examples/gpu_run.py), given
``--timeout`` seconds. The JSON holds one row per (size, path) and the raw gpu_run reports;
the ``.md`` beside it (also printed) one table per size, each path against the ``plain``
(``jax.nn.log_softmax``) row of the same size, mesh and run. With ``--largest-batch``, each path's
batch is then doubled, one fresh gpu_run per try, until it runs out of memory, reaches 8 x
the size's sequences, or its share of a second ``--timeout`` seconds per size is spent
(the paths share it evenly; time one leaves goes to the next). ``--reports`` tabulates
reports ``python -m examples.gpu_run`` already wrote at the sizes named (each run with the
size's flags and ``--paths`` of this suite's), so a run made in pieces on a lent machine
gets the same JSON and tables.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
import time

from bench.__main__ import ROOT, add_destination, child_env, device_slug, git
from bench.__main__ import resolve_destination
from examples.gpu_run import PATHS

SIZES = {"small": dict(d_model=1024, layers=2, heads=8, sequences=8, seq_len=1024),
         "medium": dict(d_model=2048, layers=2, heads=16, sequences=16, seq_len=2048)}
TINY = dict(vocab=4096, d_model=64, layers=1, heads=2, sequences=4, seq_len=64, warmup=1,
            steps=2)
LARGEST_FACTOR = 8  # --largest-batch tries up to this many times a size's sequences


def parse_args(argv=None):
  """The options; ``args.out`` is the destination directory."""
  p = argparse.ArgumentParser(prog="python -m bench.grpo_step",
                              description=__doc__.splitlines()[0])
  p.add_argument("--sizes", default=",".join(SIZES), help=f"comma list of {tuple(SIZES)}")
  p.add_argument("--paths", default=",".join(PATHS), help=f"comma list of {PATHS}")
  p.add_argument("--vocab", type=int, default=151936)
  p.add_argument("--timeout", type=float, default=280.0, help="seconds per size")
  p.add_argument("--largest-batch", action="store_true",
                 help="double each path's sequences until out of memory (8 x at most)")
  p.add_argument("--tiny", action="store_true", help=f"every size becomes {TINY} (CPU)")
  p.add_argument("--reports", help="comma list of SIZE=FILE: tabulate these gpu_run reports "
                 "(the sizes' flags, JAXCE_COMMIT the commit they ran) instead of running")
  p.add_argument("--meshes", default="", help="comma list of DATAxVOCAB meshes, each over "
                 "the first DATA * VOCAB devices (default: 1 x every visible device); "
                 "DATAxVOCAB:sp in the sequence-parallel layout")
  p.add_argument("--attention", choices=("xla", "cudnn"), default="xla",
                 help="the model's attention: XLA's (the default: the [B, heads, S, S] "
                 "scores materialized) or cuDNN's flash attention (GPUs)")
  p.add_argument("--merge", action="store_true", help="keep the destination file's sizes "
                 "and meshes that this run does not redo (a run made a size or a mesh per "
                 "call)")
  add_destination(p)
  args = p.parse_args(argv)
  if args.reports:
    args.reports = dict(item.split("=", 1) for item in args.reports.split(","))
    args.sizes = ",".join(args.reports)
  try:
    args.meshes = [parse_mesh(m) for m in args.meshes.split(",") if m]
  except ValueError:
    p.error(f"--meshes takes DATAxVOCAB or DATAxVOCAB:sp items (1x1,2x2,2x2:sp) of positive "
            f"sizes, got {args.meshes!r}")
  if args.reports and args.meshes:
    p.error("--reports tabulates gpu_run's reports as they ran: give no --meshes")
  unknown = [s for s in args.sizes.split(",") if s not in SIZES]
  unknown += [s for s in args.paths.split(",") if s not in PATHS]
  if unknown:
    p.error(f"unknown sizes or paths {unknown}")
  resolve_destination(p, args)
  return args


def parse_mesh(text: str) -> tuple:
  """``"2x2"`` -> ``(2, 2, False)``, ``"2x2:sp"`` -> ``(2, 2, True)`` (data, vocab, whether
  sequence parallel); ValueError for anything else."""
  shape, _, layout = text.partition(":")
  data, vocab = (int(n) for n in shape.split("x"))
  if min(data, vocab) < 1 or layout not in ("", "sp"):
    raise ValueError(text)
  return data, vocab, layout == "sp"


def mesh_name(mesh) -> str:
  """``(2, 2, True)`` -> ``"2x2:sp"``, as ``--meshes`` takes it."""
  return f"{mesh[0]}x{mesh[1]}" + (":sp" if mesh[2] else "")


def gpu_run(size: dict, paths, timeout: float, mesh=None) -> dict:
  """The report of ``python -m examples.gpu_run`` at ``size`` (its flags) for ``paths``,
  on ``mesh`` (``(data, vocab, sequence_parallel)`` over the first ``data * vocab``
  devices; None: ``1 x`` every visible device), or ``{"error": ...}`` when it wrote none."""
  flags = [x for k, v in size.items() for x in (f"--{k.replace('_', '-')}", str(v))]
  if mesh:
    flags += ["--devices", str(mesh[0] * mesh[1]), "--data", str(mesh[0])]
    flags += ["--sequence-parallel"] * mesh[2]
  with tempfile.TemporaryDirectory() as tmp:
    out = os.path.join(tmp, "gpu_run.json")
    cmd = [sys.executable, "-m", "examples.gpu_run", *flags, "--paths", ",".join(paths),
           "--timeout", str(timeout), "--out", out]
    try:  # (its own --timeout ends it; the margin is for its start)
      proc = subprocess.run(cmd, cwd=ROOT, env=child_env(mesh[0] * mesh[1] if mesh else 1),
                            stderr=subprocess.PIPE,
                            text=True, timeout=timeout + 60)
    except subprocess.TimeoutExpired:
      return dict(error=f"timed out after {timeout + 60:.0f} s")
    if not os.path.exists(out):
      return dict(error=f"exit {proc.returncode}: {proc.stderr[-3000:]}")
    with open(out) as f:
      return json.load(f)


def is_oom(error) -> bool:
  """Whether an error text is an out-of-memory failure."""
  return error is not None and ("RESOURCE_EXHAUSTED" in error or
                                "out of memory" in error.lower())


def make_row(name: str, size: dict, path: str, result: dict, commit: str = "",
             mesh=None) -> dict:
  """One (size, path) row from gpu_run's result for the path (device 0's bytes), run at
  ``commit``; with ``mesh`` (data, vocab, sequence_parallel) given, the row names it. The
  attention is the one the measuring process reports it ran."""
  first = lambda key: (result.get(key) or [None])[0]
  layout = {}
  if mesh:
    layout = dict(mesh=list(mesh[:2]), **({"sequence_parallel": True} if mesh[2] else {}))
  return dict(size=name, path=path, commit=commit, **layout,
              d_model=size["d_model"], layers=size["layers"],
              heads=size["heads"], sequences=size["sequences"], seq_len=size["seq_len"],
              attention=result.get("attention", size.get("attention", "xla")),
              tokens_per_step=size["sequences"] * (size["seq_len"] - 1),
              step_ms_median=result.get("step_ms_median"),
              score_ms_median=result.get("score_ms_median"),
              peak_bytes_in_use=first("peak_bytes_in_use"),
              bytes_in_use_before_steps=first("bytes_in_use_before_steps"),
              peak_minus_before=first("peak_minus_before"),
              first_step_s=result.get("first_step_s"), error=result.get("error"))


def largest_batch(size: dict, row: dict, deadline: float, mesh=None) -> dict:
  """``largest_sequences_ok``, ``first_sequences_failed`` (None if none failed) and
  ``largest_batch_stop`` (oom, cap, time budget or error, then ``largest_batch_error``) for
  the path of ``row``, whose sizes double from the size's ``sequences`` until ``deadline``."""
  ok, n, error = size["sequences"], 2 * size["sequences"], row["error"]
  if error:
    ok, n = None, size["sequences"]
  while not error and n <= LARGEST_FACTOR * size["sequences"]:
    left = deadline - time.monotonic()
    if left < 10:
      break
    print(f"largest batch: {row['path']} at {n} sequences", flush=True)
    report = gpu_run(dict(size, sequences=n), [row["path"]], left, mesh)
    error = report.get("error") or report["results"][0].get("error")
    ok, n = (ok, n) if error else (n, 2 * n)
  if (not error and n <= LARGEST_FACTOR * size["sequences"]) or (
      error and ("timed out" in error or "budget is spent" in error)):
    return dict(largest_sequences_ok=ok, first_sequences_failed=None,
                largest_batch_stop="time budget")
  stop = "cap" if not error else "oom" if is_oom(error) else "error"
  return dict(largest_sequences_ok=ok, first_sequences_failed=n if error else None,
              largest_batch_stop=stop, **({"largest_batch_error": error[-1000:]}
                                          if stop == "error" else {}))


def ratio(value, plain) -> str:
  """``value / plain`` to two decimals; "–" when either is missing (a failed row)."""
  return "–" if value is None or not plain else f"{value / plain:.2f}"


def markdown(results: dict) -> str:
  """The report: a header, then one table per size, each path against ``plain``."""
  lines = [f"# GRPO step: {results['num_devices']} × {results['device']}",
           "", f"JAX {results['jax']}, flax {results['flax']}, commit "
           f"{results['commit'][:7]}, {results['date']}; python -m bench.grpo_step "
           "(examples/gpu_run.py). Ratios: this path / the plain-JAX path "
           "(`jax.nn.log_softmax`) of the same size, mesh and run; × 1 device: this path on a "
           "1 × 1 mesh of the same run. Peak: device 0's peak bytes in "
           "use over the run (scoring passes included); before steps: parameters, Adam "
           "state and the batch."]
  columns = ["path", "step ms", "× plain JAX step", "scoring ms", "× plain scoring",
             "peak GiB", "× plain peak", "peak − before steps GiB", "× plain"]
  for name, mesh, parallel in dict.fromkeys(table_of(r) for r in results["rows"]):
    rows = [r for r in results["rows"] if table_of(r) == (name, mesh, parallel)]
    plain = next((r for r in rows if r["path"] == "plain" and not r["error"]), {})
    batch = ["largest batch"] if any("largest_batch_stop" in r for r in rows) else []
    one = {r["path"]: r for r in results["rows"] if table_of(r) == (name, (1, 1), False)}
    versus_one = ["step × 1 device", "peak × 1 device"] if one and mesh != (1, 1) else []
    r0 = rows[0]
    attention = r0.get("attention", "xla")
    attention = "" if attention == "xla" else f" ({attention} attention)"
    lines += ["", f"## {name}: D = {r0['d_model']}, {r0['layers']} layer(s), {r0['heads']} "
              f"heads{attention}, {r0['sequences']} × {r0['seq_len']} tokens "
              f"({r0['tokens_per_step']} a step), V = {results['vocab']}"
              + (f", {mesh[0] * mesh[1]} device(s): {mesh[0]} × {mesh[1]} (data × vocab)"
                 if mesh else "")
              + (", sequence parallel (the batch over every device, the token embedding's "
                 "rows over vocab)" if parallel else "")
              + (f" (commit {r0['commit'][:7]})" if r0.get("commit", results["commit"])
                 != results["commit"] else ""), "",
              "| " + " | ".join(columns + versus_one + batch) + " |",
              "|---" * len(columns + versus_one + batch) + "|"]
    for r in rows:
      cells = [r["path"]]
      for key, scale, fmt in (("step_ms_median", 1, "{:.1f}"), ("score_ms_median", 1, "{:.1f}"),
                              ("peak_bytes_in_use", 2**30, "{:.2f}"),
                              ("peak_minus_before", 2**30, "{:.2f}")):
        value = "–" if r[key] is None else fmt.format(r[key] / scale)
        cells += [value, ratio(r[key], plain.get(key))]
      if versus_one:  # (the same path and size on one device, same run)
        alone = one.get(r["path"], {})
        cells += [ratio(r[key], alone.get(key))
                  for key in ("step_ms_median", "peak_bytes_in_use")]
      if batch:
        stop, failed = r.get("largest_batch_stop"), r.get("first_sequences_failed")
        cells.append("–" if stop is None else f"{r['largest_sequences_ok'] or '–'} ("
                     + (f"{stop} at {failed}" if failed else stop) + ")")
      lines.append("| " + " | ".join(cells) + " |")
    for r in rows:
      if r["error"]:
        text = "out of memory" if is_oom(r["error"]) else r["error"].strip()[-300:]
        lines.append(f"\n{r['path']} failed: {text}")
  return "\n".join(lines) + "\n"


def table_of(row: dict) -> tuple:
  """The table a row belongs to: ``(size, mesh, sequence_parallel)`` (``mesh`` ``()`` for
  a run without ``--meshes``)."""
  return row["size"], tuple(row.get("mesh") or ()), row.get("sequence_parallel", False)


def merged(previous: dict, results: dict) -> dict:
  """``results`` with ``previous``'s tables (a size on a mesh) that it does not redo (their
  rows keep the commit they ran at), the sizes in :data:`SIZES`' order, a size's meshes
  in the order they ran; both must come from the same device and vocabulary."""
  for key in ("device", "num_devices", "jax", "vocab", "tiny", "attention"):
    default = "xla" if key == "attention" else None  # (files from before the flag: XLA's)
    if previous.get(key, default) != results.get(key, default):
      raise SystemExit(f"--merge: the destination ran {key}={previous.get(key)!r}, this run "
                       f"{results.get(key)!r}")
  redone = {table_of(r) for r in results["rows"]}
  for row in previous["rows"]:
    row.setdefault("commit", previous["commit"])
  order = lambda names: sorted(names, key=lambda n: list(SIZES).index(n.split()[0]))
  sizes = {**previous["sizes"], **results["sizes"]}
  rows = [r for r in previous["rows"] if table_of(r) not in redone] + results["rows"]
  runs = {**{n: run for n, run in previous["gpu_run"].items() if n not in results["gpu_run"]},
          **results["gpu_run"]}
  return dict(results, sizes={n: sizes[n] for n in order(sizes)},
              rows=[r for n in order(sizes) for r in rows if r["size"] == n],
              gpu_run={n: runs[n] for n in order(runs)})


def main(argv=None):
  """Run the sizes, write the JSON and the markdown; exit status 1 when no row ran."""
  start, args = time.monotonic(), parse_args(argv)
  overrides = TINY if args.tiny else dict(vocab=args.vocab)
  commit = os.environ.get("JAXCE_COMMIT") or git("rev-parse", "HEAD")
  rows, runs, facts = [], {}, {}
  for name, mesh in [(n, m) for n in args.sizes.split(",") for m in (args.meshes or [None])]:
    size = dict(SIZES[name], **overrides)
    if args.attention != "xla":  # (a flag of gpu_run's, as the sizes' are)
      size["attention"] = args.attention
    if args.reports:
      with open(args.reports[name]) as f:
        runs[name] = report = json.load(f)
      if any(report["config"][key] != value for key, value in size.items()):
        raise SystemExit(f"{args.reports[name]} ran {report['config']}, not {name}: {size}")
    else:
      print(f"{name}: python -m examples.gpu_run {size}"
            + (f" on a {mesh_name(mesh)} mesh" if mesh else ""), flush=True)
      report = gpu_run(size, args.paths.split(","), args.timeout, mesh)
      runs[name if mesh is None else f"{name} {mesh_name(mesh)}"] = report
    facts.update({k: report[k] for k in ("device", "platform", "jax", "flax")
                  if k in report and k not in facts})
    if "num_devices" in report:  # (the run's most devices: its slug)
      facts["num_devices"] = max(facts.get("num_devices", 0), report["num_devices"])
    facts.setdefault("platform", "cpu" if report.get("device") == "cpu" else "gpu")
    by_path = {r["path"]: r for r in report.get("results", [])}
    size_rows = [make_row(name, size, path, by_path.get(path, dict(error=report.get("error"))),
                          commit, mesh) for path in args.paths.split(",")]
    deadline = time.monotonic() + args.timeout
    for i, row in enumerate(size_rows if args.largest_batch else []):
      share = (deadline - time.monotonic()) / (len(size_rows) - i)  # what is left, shared
      row.update(largest_batch(size, row, time.monotonic() + share, mesh))
    rows += size_rows
  slug = device_slug(dict(facts, n_devices=facts.get("num_devices"))) if facts else "unknown"
  results = dict(device=facts.get("device"), num_devices=facts.get("num_devices"),
                 platform=facts.get("platform"), jax=facts.get("jax"), flax=facts.get("flax"),
                 commit=commit, date=datetime.datetime.now(datetime.timezone.utc).strftime(
                     "%Y-%m-%d %H:%M UTC"),
                 vocab=overrides["vocab"], tiny=args.tiny, attention=args.attention,
                 sizes={n: dict(SIZES[n], **overrides) for n in args.sizes.split(",")},
                 wall_s=time.monotonic() - start, rows=rows, gpu_run=runs)
  os.makedirs(args.out, exist_ok=True)
  path = os.path.join(args.out, f"{slug}-grpo_step")
  if args.merge and os.path.exists(path + ".json"):
    with open(path + ".json") as f:
      results = merged(json.load(f), results)
  with open(path + ".json", "w") as f:
    json.dump(results, f, indent=1)
  text = markdown(results)
  with open(path + ".md", "w") as f:
    f.write(text)
  print("\n" + text)
  shown = os.path.relpath(path) if path.startswith(ROOT + os.sep) else path
  print(f"{results['wall_s']:.0f} s; wrote {shown}.json, .md")
  return 0 if any(not r["error"] for r in rows) else 1


if __name__ == "__main__":
  sys.exit(main())
