"""Writes ``memory_vs_chunk_size.ipynb`` (without outputs) from the cells below.

    python notebooks/build_notebook.py             # regenerate the notebook
    python notebooks/run_notebook.py --out notebooks/memory_vs_chunk_size.ipynb   # execute

Edit the cells here, not in the .ipynb. ``run_notebook.py`` fills the line that starts
with ``PROVENANCE`` (below) from the first code cell's output.
"""

from __future__ import annotations

import pathlib
import textwrap

import nbformat

from run_notebook import PRODUCED_ON, PROVENANCE

NOTEBOOK = pathlib.Path(__file__).resolve().parent / "memory_vs_chunk_size.ipynb"

CELLS = []


def md(text):
  CELLS.append(nbformat.v4.new_markdown_cell(textwrap.dedent(text).strip()))


def code(text):
  CELLS.append(nbformat.v4.new_code_cell(textwrap.dedent(text).strip()))


md(f"""
# Memory vs chunk size

`jaxce` computes per-token log-probabilities and entropies over a huge vocabulary by
walking the tokens in chunks of `chunk_size`. This notebook shows the trade-off a user
tunes: the device memory a call needs (XLA's compiled memory plan, and on a GPU the
measured peak), its time, and how both move with `chunk_size`, with the number of tokens
`T`, and with the number of vocab shards, for the **logits path**
(`jaxce.logprobs_and_entropy`) and the **fused LM-head path**
(`jaxce.linear_logprobs_and_entropy`), next to plain JAX (`jaxce.reference.*`:
`jax.nn.log_softmax` and autodiff) and next to the analytic memory model of `DESIGN.md`.

{PROVENANCE} not recorded yet; the first code cell prints the device and JAX version.

Sizes come from `JAXCE_NOTEBOOK_SIZE`: `small` (CI: the whole notebook in well under a
minute on two CPU cores) or `gpu` (realistic: V = 151936, T up to 32768, D = 4096);
unset, it picks `gpu` on an accelerator and `small` on a CPU. Execute it with
`python notebooks/run_notebook.py --out <path.ipynb>`.
""")

code(f"""
import os
import pathlib
import sys
import time

# Before JAX starts: 8 simulated CPU devices (the vocab-sharded section uses them when
# there are fewer than 8 accelerators), and no GPU preallocation so that the peaks
# measured below are the program's own.
flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in flags:
  os.environ["XLA_FLAGS"] = (flags + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
if "jax" in sys.modules:
  print("note: JAX was imported before this cell; restart the kernel to get 8 CPU devices")

# The helpers (memory_helpers.py) sit next to this notebook; jaxce is imported from the
# checkout when it is not installed.
NB_DIR = next(p for p in (pathlib.Path.cwd(), pathlib.Path.cwd() / "notebooks")
              if (p / "memory_helpers.py").exists())
sys.path.insert(0, str(NB_DIR))
import memory_helpers as mh  # noqa: E402  (also makes `import jaxce` work from a checkout)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import jaxlib  # noqa: E402
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

import jaxce  # noqa: E402

DEVICE = jax.devices()[0]
ACCEL = DEVICE.platform != "cpu"
SIZE = os.environ.get("JAXCE_NOTEBOOK_SIZE") or ("gpu" if ACCEL else "small")
# bf16 on accelerators. On CPU, f32: XLA's CPU backend upcasts a bf16 input to f32 in
# full before the loop, which would add a [T, V] f32 copy to every jaxce plan.
DTYPE = os.environ.get("JAXCE_NOTEBOOK_DTYPE") or ("bfloat16" if ACCEL else "float32")
print(f"{PRODUCED_ON} {{DEVICE.device_kind}} ({{DEVICE.platform}}, {{jax.device_count()}} "
      f"device(s)), JAX {{jax.__version__}}, jaxlib {{jaxlib.__version__}}, "
      f"Python {{sys.version.split()[0]}}, jaxce {{jaxce.__version__}}; "
      f"size preset {{SIZE!r}}, dtype {{DTYPE}}")
""")

md("""
## Sizes

One preset per size. `T` is the tokens of one step (batch × sequence, flattened).
Memory is swept over `chunk_size` at that `T`, and over `T` with `chunk_size=None`.
""")

code("""
PRESETS = {
    # CI on two CPU cores. V = 20000 > 2 × 8192 so that the fused path has several vocab
    # blocks (the last one ragged), as at real sizes.
    "small": dict(T=1024, V=20000, D=64, Ts=[256, 1024],
                  chunks={"logits": [16, 64, 256, 512], "fused": [16, 128, 512]},
                  peak_chunks={"logits": [], "fused": []}, time_reps=2),
    # One GPU: Qwen-2.5's padded vocabulary, a 32k-token RL step, a 4096-wide LM head.
    "gpu": dict(T=32768, V=151936, D=4096, Ts=[2048, 4096, 8192, 16384, 32768],
                chunks={"logits": [16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192],
                        "fused": [128, 256, 512, 1024, 2048, 4096, 8192, 16384]},
                peak_chunks={"logits": [16, 64, 256, 1024, 4096], "fused": [256, 2048, 16384]},
                time_reps=5),
}
CFG = PRESETS[SIZE]
T, V, D = CFG["T"], CFG["V"], CFG["D"]
UNIT, UNIT_BYTES = ("MiB", 2**20) if SIZE == "small" else ("GiB", 2**30)
# Figures are saved as PNGs (for the README) on full-size runs only.
FIG_DIR = pathlib.Path(os.environ.get("JAXCE_NOTEBOOK_FIGDIR", NB_DIR))


def save(fig, name):
  if SIZE != "small":
    fig.savefig(FIG_DIR / name, dpi=110, bbox_inches="tight")


def case(path, impl, mode, tokens=T, chunk=None, **extra):
  return dict(path=path, impl=impl, mode=mode, T=tokens, V=V, D=D, dtype=DTYPE, chunk=chunk,
              **extra)


def columns(c):
  # Columns of one tile row: V_local on the logits path, the vocab block on the fused path.
  local = c["V"] // c.get("shards", 1)
  return local if c["path"] == "logits" else jaxce.plan.linear_tiles(c["T"], local)[1]


def chunk_of(c):
  # The chunk jaxce runs with: min(chunk_size, T), or the planned one for None (the fused
  # path plans from its own tile budget).
  if c["path"] == "logits":
    return jaxce.plan.logits_chunk(c["T"], columns(c), c["chunk"])
  return jaxce.plan.linear_tiles(c["T"], c["V"] // c.get("shards", 1), c["chunk"])[0]


def in_units(nbytes):
  return np.asarray(nbytes, float) / UNIT_BYTES


print(f"T = {T}, V = {V}, D = {D}, {DTYPE}: the logits are "
      f"{in_units(T * V * np.dtype(DTYPE).itemsize):.2f} {UNIT}")
""")

md("""
### Peaks first, in fresh processes

The device's `peak_bytes_in_use` never goes down, and memory this process takes (even
compiler scratch) stays in its allocator's pool. So the measured peaks are taken first,
before this process compiles anything, each in its own Python process
(`memory_helpers.measure_peak`): inputs made on the host and `device_put`, one fwd+bwd
call, **measured extra = peak − bytes in use before the call**. If compiling peaked higher
than the call (autotuning scratch), the number is only an upper bound and is flagged.
They are shown next to the compiled plans further down. `memory_stats()` exists on GPUs
and TPUs, not on CPU: there this cell only checks the child process once.
""")

code("""
STATS = mh.memory_stats(DEVICE)
measured = {}  # (path, impl, chunk) -> the child's report
PROBE_PLAN = None
if STATS and os.environ.get("JAXCE_NOTEBOOK_PEAK", "1") != "0":
  for path in ("logits", "fused"):
    todo = [case(path, "plain", "fwd+bwd")]
    todo += [case(path, "jaxce", "fwd+bwd", chunk=c) for c in CFG["peak_chunks"][path]]
    for c in todo:
      name = f"{path:6s} {c['impl']:5s} chunk {c['chunk'] or '-':>5}"
      report = mh.measure_peak(c)
      if "error" in report:
        print(f"{name}: {report['error']}")
        continue
      measured[path, c["impl"], c["chunk"]] = report
      flag = "  (compiling peaked higher: an upper bound)" if report["compile_dominates"] else ""
      print(f"{name}: plan {report['plan']['extra'] / 2**30:7.3f} GiB, "
            f"measured {report['measured_extra'] / 2**30:7.3f} GiB{flag}")
else:
  probe = mh.measure_peak(case("logits", "jaxce", "fwd+bwd", chunk=CFG["chunks"]["logits"][1]))
  print(f"{DEVICE.platform}: no memory_stats() (or JAXCE_NOTEBOOK_PEAK=0), nothing to measure; "
        f"child process check: {'ok' if 'plan' in probe else probe}")
  PROBE_PLAN = probe.get("plan")
""")

md("""
## Reading a compiled memory plan

`jax.jit(f).lower(*shapes).compile().memory_analysis()` is XLA's buffer assignment for
one device, without allocating or running anything: `argument_size_in_bytes` (inputs),
`output_size_in_bytes`, `temp_size_in_bytes` (everything else alive at some point) and
`alias_size_in_bytes` (outputs written into donated inputs). What a call adds on top of
its inputs is **extra = temp + output − alias**: that is what every plot below shows.

Here is the fwd+bwd of the RL loss `sum(adv * logp) + 0.01 * sum(H)` on the logits
path, with the planned chunk size:
""")

code("""
def loss(logits, labels, adv):
  logp, entropy = jaxce.logprobs_and_entropy(logits, labels)
  return jnp.sum(adv * logp) + 0.01 * jnp.sum(entropy)


shapes = (jax.ShapeDtypeStruct((T, V), DTYPE), jax.ShapeDtypeStruct((T,), jnp.int32),
          jax.ShapeDtypeStruct((T,), jnp.float32))
analysis = jax.jit(jax.grad(loss)).lower(*shapes).compile().memory_analysis()
for field in ("argument_size_in_bytes", "output_size_in_bytes", "temp_size_in_bytes",
              "alias_size_in_bytes"):
  print(f"{field:24s} {in_units(getattr(analysis, field)):10.2f} {UNIT}")
""")

md("""
The output is the gradient, one array like the logits; the temp is the working set.
`memory_helpers.py` wraps exactly this for every case below (`compile_case`,
`memory_plan`) and keeps the compiled executables, which the timing section reuses.

## The memory model (DESIGN.md)

With `C` the chunk, `V_l` the columns a device holds, `Vb = min(V_l, 8192)` the fused
path's vocab block and `s` the input dtype's bytes, what a jaxce call adds is:

| | forward | forward + backward |
|---|---|---|
| logits path | k · C·V_l·4 | T·V_l·s (the gradient) + k · C·V_l·4 |
| fused path | k · C·Vb·4 | T·D·s + D·V_l·s (`d hidden`, `d W`) + T·D·4 + D·Vb·4 (f32 accumulators) + k · C·Vb·4 |

plus O(T): a few `[T]` f32 vectors (log-probs, entropies, the saved `lse` and `H`).
`k` counts the live f32 `[C, columns]` tiles. The docstrings (printed below) promise
"a few" tiles of working set on the logits path, whose upcast XLA may fuse into the
reductions so that no tile is materialised at all, and "one or two" on the fused path,
where the matmul's f32 output is a real tile. So the plots draw the model as a band:
from 0 (logits path) or 1 (fused path) tile, to 2 tiles and 4 `[T]` vectors. Nothing else may grow with T: no `[T, V]` f32 copy, no softmax saved for the
backward. Plain JAX has no such bound: it materialises f32 `[T, V]` arrays, several of
them in the backward.
""")

code("""
def model_extra(c, tiles, vectors):
  # The DESIGN.md model of what one jaxce call adds, in bytes.
  s = np.dtype(c["dtype"]).itemsize
  tokens, local = c["T"], c["V"] // c.get("shards", 1)
  small = tiles * 4 * chunk_of(c) * columns(c) + vectors * 4 * tokens
  if c["mode"] == "fwd":
    return small
  if c["path"] == "logits":
    return tokens * local * s + small
  return tokens * D * s + D * local * s + tokens * D * 4 + D * columns(c) * 4 + small


def band(c):
  # low: 0 (logits path) or 1 (fused path) tile, and the forward's two outputs;
  # high: 2 tiles and 4 [T] vectors.
  low = model_extra(c, 0 if c["path"] == "logits" else 1, 2 if c["mode"] == "fwd" else 0)
  return low, model_extra(c, 2, 4)


for fn in (jaxce.logprobs_and_entropy, jaxce.linear_logprobs_and_entropy):
  memory = fn.__doc__[fn.__doc__.index("Memory:"):].strip()
  print(f"{fn.__name__}:\\n  " + " ".join(memory.split()) + "\\n")


_compiled, _plans, _compile_seconds = {}, {}, [0.0]


def key(c):
  resolved = chunk_of(c) if c["impl"] == "jaxce" else None  # None and 512 may be one program
  return (c["path"], c["impl"], c["mode"], c["T"], resolved, c.get("shards"), c["dtype"])


def plan(c, mesh=None):
  # Compiled memory plan of a case (cached; compiles on first use).
  if key(c) not in _plans:
    start = time.perf_counter()
    _compiled[key(c)] = mh.compile_case(c, mesh)
    _plans[key(c)] = mh.memory_plan(_compiled[key(c)])
    _compile_seconds[0] += time.perf_counter() - start
  return _plans[key(c)]


def plot_vs_chunk(ax, path, mode):
  chunks = CFG["chunks"][path]
  dense = np.unique(np.geomspace(chunks[0], chunks[-1], 60).astype(int))
  lo_hi = np.array([band(case(path, "jaxce", mode, chunk=int(c))) for c in dense]).T
  ax.fill_between(dense, *in_units(lo_hi), color="C2", alpha=0.3, label="model (DESIGN.md)")
  ax.plot(chunks, in_units([plan(case(path, "jaxce", mode, chunk=c))["extra"] for c in chunks]),
          "o-", color="C0", label="jaxce, compiled plan")
  ax.axhline(in_units(plan(case(path, "plain", mode))["extra"]), color="C3", ls="--",
             label="plain JAX, compiled plan")
  default = chunk_of(case(path, "jaxce", mode))
  ax.axvline(default, color="gray", ls=":", label=f"chunk_size=None -> {default}")
  ax.set(yscale="log", xlabel="chunk_size (tokens)", ylabel=f"extra memory ({UNIT})",
         title=f"{path} path, {mode}, T = {T}")
  ax.set_xscale("log", base=2)


def plot_vs_tokens(ax, path, mode):
  ts = CFG["Ts"]
  lo_hi = np.array([band(case(path, "jaxce", mode, t)) for t in ts]).T
  ax.fill_between(ts, *in_units(lo_hi), color="C2", alpha=0.3, label="model (DESIGN.md)")
  ax.plot(ts, in_units([plan(case(path, "jaxce", mode, t))["extra"] for t in ts]), "o-",
          color="C0", label="jaxce (chunk_size=None), compiled plan")
  ax.plot(ts, in_units([plan(case(path, "plain", mode, t))["extra"] for t in ts]), "s--",
          color="C3", label="plain JAX, compiled plan")
  ax.set(yscale="log", xlabel="T (tokens)", ylabel=f"extra memory ({UNIT})",
         title=f"{path} path, {mode}, chunk_size=None")
  ax.set_xscale("log", base=2)


def plot_measured(ax, path):
  points = [(chunk_of(r["case"]), r["measured_extra"]) for (p, impl, _), r in measured.items()
            if p == path and impl == "jaxce"]
  if points:
    ax.plot(*zip(*[(c, in_units(e)) for c, e in points]), "x", ms=10, mew=2, color="k",
            label="jaxce, measured peak")
  if (path, "plain", None) in measured:
    ax.axhline(in_units(measured[path, "plain", None]["measured_extra"]), color="C3", ls=":",
               label="plain JAX, measured peak")


def sweep_figure(path):
  fig, axes = plt.subplots(2, 2, figsize=(12, 8.5), constrained_layout=True)
  for col, mode in enumerate(("fwd", "fwd+bwd")):
    plot_vs_chunk(axes[0, col], path, mode)
    plot_vs_tokens(axes[1, col], path, mode)
  for ax in axes.flat:
    ax.legend(fontsize=8)
  return fig
""")

md("""
## Logits path: memory vs chunk size and vs T

Top row: `chunk_size` swept at fixed T. Bottom row: T swept with `chunk_size=None`.
Plain JAX does not chunk: it is the dashed line (top) and the red squares (bottom).
""")

code("""
fig = sweep_figure("logits")
save(fig, "memory_vs_chunk_size_logits.png")
plt.show()
""")

md("""
## Fused path: memory vs chunk size and vs T

The same for `linear_logprobs_and_entropy(hidden [T, D], W [D, V], labels)`; its fwd+bwd
takes the gradient w.r.t. both `hidden` and `W`. Plain JAX computes `hidden @ W` in f32
and autodiffs through `log_softmax`: several f32 `[T, V]` arrays.
""")

code("""
fig = sweep_figure("fused")
save(fig, "memory_vs_chunk_size_fused.png")
plt.show()
""")

md("""
## How well does the model match?

Per chunk size, the tiles the compiled plan implies: (plan − model without tiles and
`[T]` vectors) / one f32 tile. A least-squares line through the chunk sweep separates
what grows with the chunk (the slope: k, in tiles) from a fixed part the model does
not list (the intercept), and the last column says at how many chunk sizes the plan
lies in the model's band.

What the CPU plans of this jaxce version show, and why (checked in XLA's buffer
assignment dump, `XLA_FLAGS=--xla_dump_to=DIR`; the lines printed below are for the
device that ran this notebook, and XLA's GPU compiler fuses differently, so compare):

* **Logits path, forward**: one f32 tile (the CPU backend materialises the upcast chunk
  that the max, the sums and the label pick read).
* **Logits path, forward + backward**: the gradient and no tile. The backward is one
  elementwise pass without temporaries, and the forward's tiles are dead before the
  gradient is written, so XLA places them inside the gradient's own buffer.
* **Fused path, forward**: two tiles (the matmul's f32 logits and their exponentials for
  the online softmax) plus one f32 `[D, Vb]` block: the column slice `W[:, block]` is
  copied out once per vocab block. The docstring says "one f32 tile"; the plan says two,
  and the fit's intercept is the block.
* **Fused path, forward + backward**: about two tiles, plus one to one and a half `[D, Vb]`
  blocks beyond the model's fixed part (the `W` column slice again, and the block's `d W`
  in the weight's dtype before it is written into `d W`). These blocks do not grow with
  T or the chunk: small next to `d W` at real sizes, but they dominate at small chunks.
* A chunk of T or more is a single pass; the fit leaves such chunk sizes out.
""")

code("""
def match(path, mode):
  chunks = [c for c in CFG["chunks"][path] if c < T]
  cases = [case(path, "jaxce", mode, chunk=c) for c in chunks]
  compiled = np.array([plan(c)["extra"] for c in cases], float)
  base = np.array([model_extra(c, 0, 0) for c in cases], float)
  tile = np.array([4 * chunk_of(c) * columns(c) for c in cases], float)
  slope, intercept = np.polyfit(tile, compiled - base, 1)
  inside = [lo <= e <= hi for (lo, hi), e in zip(map(band, cases), compiled)]
  fixed = f"{in_units(intercept):+.3f} {UNIT}"
  if path == "fused":
    fixed += f" = {intercept / (4 * D * columns(cases[0])):+.2f} f32 [D, Vb] blocks"
  print(f"{path} path, {mode}: tiles implied at chunk "
        + ", ".join(f"{c}: {(e - b) / t:.2f}" for c, e, b, t in zip(chunks, compiled, base, tile)))
  print(f"    fit: k = {slope:.2f} tiles, fixed part beyond the model {fixed}; "
        f"in the band at {sum(inside)}/{len(inside)} chunk sizes")


for path in ("logits", "fused"):
  for mode in ("fwd", "fwd+bwd"):
    match(path, mode)
""")

md("""
## Measured peak vs compiled plan

The peaks measured at the top (fresh process per point), as black crosses, on the
fwd+bwd plans. On CPU there is nothing to measure and this cell only confirms that the
child process compiled the same plan as this one.
""")

code("""
if measured:
  fig, axes = plt.subplots(1, 2, figsize=(12, 4.2), constrained_layout=True)
  for ax, path in zip(axes, ("logits", "fused")):
    plot_vs_chunk(ax, path, "fwd+bwd")
    plot_measured(ax, path)
    ax.set_title(f"{path} path, fwd+bwd, T = {T}: plan vs measured peak")
    ax.legend(fontsize=8)
  save(fig, "memory_vs_chunk_size_measured.png")
  plt.show()
  for (path, impl, chunk), r in measured.items():
    ours = plan(r["case"])["extra"]
    print(f"{path:6s} {impl:5s} chunk {chunk or '-':>5}: measured / plan = "
          f"{r['measured_extra'] / ours:.3f}" + ("  (upper bound)" if r["compile_dominates"] else ""))
elif PROBE_PLAN is not None:
  same = PROBE_PLAN == plan(case("logits", "jaxce", "fwd+bwd", chunk=CFG["chunks"]["logits"][1]))
  print("the child process compiled the same plan:", same)
else:
  print("no peak could be measured")
""")

md("""
## Time vs chunk size

Median wall time of one jitted fwd+bwd call on this machine (inputs already on the
device, the previous call's outputs dropped first). Very small chunks pay per-step
overhead (and, on the fused path, narrow matmuls); very large ones spill the tile out of
cache. The default's tile budget is discussed in the last section. Cases whose plan does
not fit the device are skipped.
""")

code("""
LIMIT = STATS.get("bytes_limit", float("inf"))
times = {}
for path in ("logits", "fused"):
  cases = [case(path, "jaxce", "fwd+bwd", chunk=c) for c in CFG["chunks"][path]]
  cases.append(case(path, "plain", "fwd+bwd"))
  arrays = [jax.device_put(a, DEVICE) for a in mh.host_inputs(cases[0])]
  for c in cases:
    if plan(c)["extra"] + plan(c)["argument"] > 0.9 * LIMIT:
      print(f"{path} {c['impl']}: skipped, its plan does not fit the device")
      continue
    try:
      times[key(c)] = mh.run_time(_compiled[key(c)], arrays, CFG["time_reps"])
    except jax.errors.JaxRuntimeError as error:  # e.g. a fragmented device heap
      if "RESOURCE_EXHAUSTED" not in str(error):
        raise
      print(f"{path} {c['impl']} chunk {chunk_of(c)}: out of memory on this device")
  del arrays
  plain_ms = times.get(key(cases[-1]), float("nan")) * 1e3
  print(f"{path} path, T = {T}: plain JAX {plain_ms:.1f} ms; jaxce "
        + ", ".join(f"{chunk_of(c)}: {times[key(c)] * 1e3:.1f}" for c in cases[:-1]
                    if key(c) in times) + " ms")

fig, axes = plt.subplots(1, 2, figsize=(12, 4), constrained_layout=True)
for ax, path in zip(axes, ("logits", "fused")):
  chunks = [c for c in CFG["chunks"][path] if key(case(path, "jaxce", "fwd+bwd", chunk=c)) in times]
  ax.plot(chunks, [times[key(case(path, "jaxce", "fwd+bwd", chunk=c))] * 1e3 for c in chunks],
          "o-", color="C0", label="jaxce")
  if key(case(path, "plain", "fwd+bwd")) in times:
    ax.axhline(times[key(case(path, "plain", "fwd+bwd"))] * 1e3, color="C3", ls="--",
               label="plain JAX")
  ax.axvline(chunk_of(case(path, "jaxce", "fwd+bwd")), color="gray", ls=":",
             label="chunk_size=None")
  ax.set(xlabel="chunk_size (tokens)", ylabel="ms per fwd+bwd", ylim=(0, None),
         title=f"{path} path, T = {T}, {DEVICE.device_kind}")
  ax.set_xscale("log", base=2)
  ax.legend(fontsize=8)
save(fig, "memory_vs_chunk_size_time.png")
plt.show()
""")

md("""
## Vocab-sharded: per-device memory vs number of shards

`jaxce.sharded_logprobs_and_entropy(logits, labels, mesh=..., vocab_axis="vocab")` splits
the vocabulary over a mesh axis: each device holds `[T, V / n]` and the shards exchange
only `[T]`-sized statistics. The per-device plan of the jitted SPMD program is again
`memory_analysis()`. With fewer than 8 accelerators this section compiles for the 8
simulated CPU devices (in f32, for the reason given at the top); the plan is still per
device. Plain JAX is left to XLA's SPMD partitioner. With `chunk_size=None` the chunk
grows as `V / n` shrinks (the tile budget is fixed), so the tile term stays near its
budget while the gradient shrinks as 1/n.
""")

code("""
SHARDS = [1, 2, 4, 8]
mesh_devices = jax.devices() if jax.device_count() >= max(SHARDS) else jax.devices("cpu")
shard_dtype = DTYPE if mesh_devices[0].platform != "cpu" else "float32"
rows = []
for n in SHARDS:
  mesh = mh.vocab_mesh(mesh_devices[:n])
  row = {"n": n}
  for impl, mode in (("jaxce", "fwd"), ("jaxce", "fwd+bwd"), ("plain", "fwd+bwd")):
    c = dict(case("logits", impl, mode), shards=n, dtype=shard_dtype)
    row[impl, mode] = plan(c, mesh)["extra"]
    if (impl, mode) == ("jaxce", "fwd+bwd"):
      row["chunk"], row["band"] = chunk_of(c), band(c)
  rows.append(row)
  print(f"{n} shard(s) on {mesh_devices[0].platform}, chunk {row['chunk']:5d}, per device: "
        f"jaxce fwd {in_units(row['jaxce', 'fwd']):8.2f}, "
        f"fwd+bwd {in_units(row['jaxce', 'fwd+bwd']):8.2f}, "
        f"plain JAX fwd+bwd {in_units(row['plain', 'fwd+bwd']):8.2f} {UNIT}")

fig, ax = plt.subplots(figsize=(7, 4.5), constrained_layout=True)
ns = [r["n"] for r in rows]
ax.fill_between(ns, *in_units(np.array([r["band"] for r in rows]).T), color="C2",
                alpha=0.3, label="model, fwd+bwd")
ax.plot(ns, in_units([r["jaxce", "fwd+bwd"] for r in rows]), "o-", color="C0",
        label="jaxce fwd+bwd, plan")
ax.plot(ns, in_units([r["jaxce", "fwd"] for r in rows]), "^-", color="C4", label="jaxce fwd, plan")
ax.plot(ns, in_units([r["plain", "fwd+bwd"] for r in rows]), "s--", color="C3",
        label="plain JAX fwd+bwd, plan")
ax.set(yscale="log", xlabel="vocab shards", ylabel=f"extra memory per device ({UNIT})",
       title=f"logits path, T = {T}, V = {V}, {shard_dtype}, chunk_size=None")
ax.set_xscale("log", base=2)
ax.set_xticks(ns, [str(n) for n in ns])
ax.legend(fontsize=8)
save(fig, "memory_vs_chunk_size_sharded.png")
plt.show()
""")

md("""
## What `chunk_size=None` picks, and why

`jaxce.plan.chunk_size` sizes one f32 `[C, columns]` tile to a fixed budget:
`C = budget / (4 · columns)`, capped at T (one chunk when all of T fits); otherwise
rounded down to a multiple of 8 and moved down to a divisor of T if one lies within a
factor 2, so that no ragged last chunk is needed (a ragged one is handled without copies
anyway; the divisor rule can cost up to half the budget). On the logits path `columns`
is `V_local` and the budget `LOGITS_TILE_BYTES` of the backend (`jaxce.plan.logits_chunk`);
on the fused path (`jaxce.plan.linear_tiles`) `columns` is the vocab block `min(V_local,
DEFAULT_VOCAB_BLOCK)` and the budget `LINEAR_TILE_BYTES` of the backend, so the fused
path's default does not depend on V. The budget trades the tile's memory
(see the sweeps above) against per-step overhead (see the timings); the library's own
reasoning for its value is printed first, from its source.
""")

code("""
import inspect  # noqa: E402

# (the budgets' module: where jaxce.plan's tile sizes are defined)
source = inspect.getsource(inspect.getmodule(jaxce.plan.logits_chunk)).splitlines()
start = next(i for i, line in enumerate(source) if line.startswith("# Logits path"))
at = next(i for i, line in enumerate(source) if line.startswith("def "))
print("\\n".join(source[start:at]))
print(f"# this backend: {jaxce.plan.budget_platform()!r}\\n")
print(f"{'T':>7} {'V':>7} | {'logits C':>8} {'chunks':>6} {'ragged':>6} {'tile MiB':>8} | "
      f"{'fused C':>7} {'chunks':>6} {'tile MiB':>8}")
for tokens in (1, 1000, 4096, 12000, 32768, 131072):
  for vocab in (32000, 128256, 151936, 262144):
    c = jaxce.plan.logits_chunk(tokens, vocab)
    f, block = jaxce.plan.linear_tiles(tokens, vocab)
    print(f"{tokens:7d} {vocab:7d} | {c:8d} {-(-tokens // c):6d} {str(tokens % c != 0):>6} "
          f"{4 * c * vocab / 2**20:8.1f} | {f:7d} {-(-tokens // f):6d} {4 * f * block / 2**20:8.1f}")
""")

md("""
## Summary

Chunking turns the memory of log-prob + entropy from several f32 copies of the logits
(plain JAX) into the gradient plus a tile budget; the fused path removes the logits
altogether. The figure saved for the README: the fwd+bwd memory of both paths against
the chunk size, with plain JAX and the model (and the measured peak, on a GPU).
""")

code("""
fig, axes = plt.subplots(1, 2, figsize=(12, 4.2), constrained_layout=True)
for ax, path in zip(axes, ("logits", "fused")):
  plot_vs_chunk(ax, path, "fwd+bwd")
  plot_measured(ax, path)
  shape = f"T = {T}, V = {V}" + (f", D = {D}" if path == "fused" else "")
  ax.set_title(f"{path} path, fwd+bwd ({shape}, {DTYPE})\\n{DEVICE.device_kind}, JAX {jax.__version__}")
  ax.legend(fontsize=8)
save(fig, "memory_vs_chunk_size.png")
plt.show()
print(f"{len(_plans)} programs compiled in {_compile_seconds[0]:.1f} s")
""")


def build() -> nbformat.NotebookNode:
  nb = nbformat.v4.new_notebook(cells=CELLS)
  nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
  nb.metadata["language_info"] = {"name": "python"}
  return nb


if __name__ == "__main__":
  nbformat.write(build(), NOTEBOOK)
  print(f"wrote {NOTEBOOK} ({len(CELLS)} cells)")
