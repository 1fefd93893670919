"""Kept-set rows (``keep=``) on a GPU: the fused and logits paths' fwd+bwd with a
top-p-like mask (about 5 % of the vocabulary kept per token, random per token) against the
same call without ``keep`` in the same process, with XLA's compiled memory plan; and both
paths with a sampler's kept ids (``jaxce.keep.from_csr``; set sizes as prime-rl measured
them, ``bench.inputs.sampler_set_sizes``: ~46 % singletons, median 2, mean ~8, a tail to
a few hundred; rows before 2026-11-25's second session drew a mean of ~6), the fused path in
both weight layouts, against the same sets as packed words (``kept_ids_*`` rows; the
largest difference of their log-probs and entropies is in the summary).

    python -m scripts.gpu_keep_rows                      # JSON lines, and $OUT/keep_rows.json
    python -m scripts.gpu_keep_rows --tokens 1024 --vocab 4096 --dim 256   # small

Each row: the backend the planner chose (``jaxce.plan.of``), the median fwd+bwd time, and
the plan's temporary bytes (``memory_analysis``) beyond the inputs and outputs.
"""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np

import jaxce
from bench import inputs
from scripts import _fused_rows


def main():
  parser = _fused_rows.parser(__doc__)
  parser.add_argument("--kept", type=float, default=0.05)
  args = parser.parse_args()
  p = _fused_rows.problem(args)
  hidden, weight, labels, cot, logits = (p[k] for k in ("hidden", "weight", "labels", "cot",
                                                         "logits"))
  v, n = args.vocab, args.logits_tokens

  @jax.jit
  def make_keep(key, labels):  # ~kept of the columns per token, and the label
    mask = jax.random.uniform(key, (labels.shape[0], v)) < args.kept
    return jaxce.keep.pack(mask | (jnp.arange(v) == labels[:, None]))

  keep = make_keep(p["key"], labels)
  rows = []

  def row(path, variant, fn, arrays, labels, cot, **kw):
    r = dict(path=path, variant=variant,
             **_fused_rows.fwd_bwd_row(fn, arrays, labels, cot, args.repeats, **kw),
             keep_gib=(0 if "keep" not in kw else sum(
                 a.nbytes for a in jax.tree.leaves(kw["keep"])) / 2**30))
    rows.append(r)
    print(json.dumps(r), flush=True)

  fused = jaxce.linear_logprobs_and_entropy
  row("fused", "default", fused, (hidden, weight), labels, cot)
  row("fused", "xla", fused, (hidden, weight), labels, cot, implementation="xla")
  row("fused", "keep", fused, (hidden, weight), labels, cot, keep=keep)
  sizes = jnp.asarray(inputs.sampler_set_sizes(np.random.default_rng(1), labels.shape[0]))
  kept = _kept_ids(p["key"], sizes, labels, v)
  words = jaxce.keep.pack_ids(kept, v, shape=labels.shape)
  weight_vd = jnp.asarray(weight.T)  # (a transposed copy, made once, not timed)
  vd = lambda h, w, labels, **kw: fused(h, w, labels, weight_layout="vd", **kw)
  row("fused", "kept_ids", fused, (hidden, weight), labels, cot, keep=kept)
  row("fused", "kept_ids_vd", vd, (hidden, weight_vd), labels, cot, keep=kept)
  row("fused", "kept_ids_as_words", fused, (hidden, weight), labels, cot, keep=words)
  sparse, dense = (jax.jit(lambda k: fused(hidden, weight, labels, keep=k))(k)
                   for k in (kept, words))
  kept_ids_difference = max(float(jnp.max(jnp.abs(a - b))) for a, b in zip(sparse, dense))
  per_token = jaxce.logprobs_and_entropy
  row("logits", "default", per_token, (logits,), labels[:n], cot[:, :n])
  row("logits", "xla", per_token, (logits,), labels[:n], cot[:, :n], implementation="xla")
  row("logits", "keep", per_token, (logits,), labels[:n], cot[:, :n], keep=keep[:n])
  logits_kept = _kept_ids(p["key"], sizes[:n], labels[:n], v)
  logits_words = jaxce.keep.pack_ids(logits_kept, v, shape=(n,))
  row("logits", "kept_ids", per_token, (logits,), labels[:n], cot[:, :n], keep=logits_kept)
  row("logits", "kept_ids_as_words", per_token, (logits,), labels[:n], cot[:, :n],
      keep=logits_words)
  sparse, dense = (jax.jit(lambda k: per_token(logits, labels[:n], keep=k))(k)
                   for k in (logits_kept, logits_words))
  logits_difference = max(float(jnp.max(jnp.abs(a - b))) for a, b in zip(sparse, dense))
  by = {(r["path"], r["variant"]): r for r in rows}
  summary = _fused_rows.run_info(kept_fraction=args.kept,
                 kept_ids=int(sizes.sum()), kept_ids_mean=float(sizes.mean()),
                 kept_ids_median=float(jnp.median(sizes)),
                 kept_ids_p99=float(jnp.percentile(sizes, 99)),
                 kept_ids_singletons=float(jnp.mean(sizes == 1)),
                 kept_ids_vs_words_max_difference=kept_ids_difference,
                 logits_kept_ids_vs_words_max_difference=logits_difference)
  for path, variants in (("fused", ("kept_ids", "kept_ids_vd", "kept_ids_as_words")),
                         ("logits", ("kept_ids", "kept_ids_as_words"))):
    for variant in variants:
      summary[f"{path}_{variant}_over_default"] = by[(path, variant)]["fwd_bwd_ms"] / by[
          (path, "default")]["fwd_bwd_ms"]
  for path in ("fused", "logits"):
    keep_row = by[(path, "keep")]
    summary[f"{path}_keep_over_default"] = keep_row["fwd_bwd_ms"] / by[(path, "default")][
        "fwd_bwd_ms"]
    summary[f"{path}_keep_over_xla"] = keep_row["fwd_bwd_ms"] / by[(path, "xla")]["fwd_bwd_ms"]
    summary[f"{path}_keep_extra_temp_gib"] = keep_row["temp_gib"] - by[(path, "xla")]["temp_gib"]
  print(json.dumps(summary), flush=True)
  _fused_rows.save("keep_rows.json", summary, rows)


def _kept_ids(key, sizes, labels, num_columns):
  """The CSR kept ids of sets of ``sizes``: the label and random other ids."""
  offsets = jnp.concatenate([jnp.zeros(1, jnp.int32), jnp.cumsum(sizes)])
  total = int(offsets[-1])
  position = jnp.arange(total)
  token = jnp.searchsorted(offsets, position, side="right") - 1
  ids = jax.random.randint(jax.random.fold_in(key, 2), (total,), 0, num_columns)
  ids = jnp.where(position == offsets[token], labels[token], ids)  # the first: the label
  return jaxce.keep.from_csr(ids, offsets)


if __name__ == "__main__":
  main()
