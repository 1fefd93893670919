"""The fused path over kept ids (``jaxce.keep.from_csr``) on a GPU, in both weight
layouts, with the sets' ids drawn uniformly over the vocabulary or by a Zipf popularity
(a few ids shared by most tokens, as top-p sets are), against the full head without a
kept set in the same process; with ``--before FILE``, the same rows with ``FILE``'s
``logprobs_entropy`` (an earlier ``linear_kept_ids``) in place of the current one; with
``--blocks``, the current one's rows for each entry block size (``linear_kept_ids.BLOCK``).

    git show 94577b4:jaxce/_kernels/linear_kept_ids.py > /tmp/before.py
    python -m scripts.gpu_kept_ids_layouts --before /tmp/before.py --blocks 4096,16384

Each row as ``gpu_keep_rows``'s (backend, median fwd+bwd time, temporary memory) and the
forward's median time alone; JSON lines, and ``$OUT/kept_ids_layouts.json`` with the
summary (ratios to the full head).
"""

from __future__ import annotations

import importlib.util
import json

import jax
import jax.numpy as jnp
import numpy as np

import jaxce
from bench import inputs
from bench.timing import time_ms
from jaxce import _dispatch
from scripts import _fused_rows


def main():
  parser = _fused_rows.parser(__doc__)
  parser.add_argument("--before", default=None)
  parser.add_argument("--zipf", type=float, default=1.1)
  parser.add_argument("--blocks", default=str(_dispatch.linear_kept_ids.BLOCK))
  args = parser.parse_args()
  p = _fused_rows.problem(args)
  hidden, weight, labels, cot = (p[k] for k in ("hidden", "weight", "labels", "cot"))
  v = args.vocab
  rng = np.random.default_rng(1)
  sizes = inputs.sampler_set_sizes(rng, labels.shape[0])
  popular = rng.permutation(v)  # the Zipf ranks' ids
  zipf_ids = popular[np.minimum(rng.zipf(args.zipf, int(sizes.sum())), v) - 1]
  uniform_ids = rng.integers(0, v, int(sizes.sum()))
  sets = dict(uniform=_fused_rows.kept_ids(uniform_ids, sizes, labels),
              zipf=_fused_rows.kept_ids(zipf_ids, sizes, labels))
  weight_vd = jnp.asarray(weight.T)  # (a transposed copy, made once, not timed)
  fused = jaxce.linear_logprobs_and_entropy
  vd = lambda h, w, labels, **kw: fused(h, w, labels, weight_layout="vd", **kw)
  rows = []

  def row(variant, fn, arrays, **kw):
    r = dict(variant=variant, **_fused_rows.fwd_bwd_row(fn, arrays, labels, cot, args.repeats,
                                                       **kw))
    forward = jax.jit(lambda a, lab, named: fn(*a, lab, **named))
    r["forward_ms"] = time_ms(forward, (tuple(arrays), labels, kw), args.repeats)
    rows.append(r)
    print(json.dumps(r), flush=True)

  row("default", fused, (hidden, weight))
  kernels = dict(after=_dispatch.linear_kept_ids)
  if args.before:
    spec = importlib.util.spec_from_file_location("kept_ids_before", args.before)
    kernels["before"] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(kernels["before"])
  default_block = kernels["after"].BLOCK
  for name, kernel in kernels.items():
    _dispatch.linear_kept_ids = kernel
    for block in ([int(b) for b in args.blocks.split(",")] if name == "after" else [0]):
      suffix = f"_block{block}" if block and block != default_block else ""
      kernel.BLOCK = block or kernel.BLOCK
      jax.clear_caches()  # (BLOCK is read when a call is traced)
      for ids, kept in sets.items():
        row(f"{name}_{ids}_dv{suffix}", fused, (hidden, weight), keep=kept)
        row(f"{name}_{ids}_vd{suffix}", vd, (hidden, weight_vd), keep=kept)
      kernel.BLOCK = default_block
  _dispatch.linear_kept_ids = kernels["after"]
  outputs = {}
  for name, kernel in kernels.items():
    _dispatch.linear_kept_ids = kernel
    outputs[name] = jax.jit(lambda k: fused(hidden, weight, labels, keep=k))(sets["zipf"])
  _dispatch.linear_kept_ids = kernels["after"]
  default_ms = rows[0]["fwd_bwd_ms"]
  summary = _fused_rows.run_info(kept_ids=int(sizes.sum()), zipf=args.zipf,
                 zipf_distinct_ids=int(np.unique(zipf_ids).size),
                 uniform_distinct_ids=int(np.unique(np.asarray(sets["uniform"].ids)).size),
                 **{f"{r['variant']}_over_default": r["fwd_bwd_ms"] / default_ms
                    for r in rows[1:]})
  if "before" in outputs:
    summary["before_vs_after_max_difference"] = max(
        float(jnp.max(jnp.abs(a - b))) for a, b in zip(outputs["before"], outputs["after"]))
  print(json.dumps(summary), flush=True)
  _fused_rows.save("kept_ids_layouts.json", summary, rows)


if __name__ == "__main__":
  main()
