"""Where kept ids stop paying (``jaxce.plan.KEPT_IDS_FRACTION``): both paths' fwd+bwd with
sets of exactly ``k`` ids per token (the label and ``k - 1`` random ids, as top-k
sampling keeps them), once over the kept columns only (the sparse form) and once packed
into words over whole rows (the dense form), for each ``--sizes`` k (``--logits-sizes`` on
the logits path), against the call without a kept set, all in one process.

    python -m scripts.gpu_kept_ids_crossover   # JSON lines, and $OUT/kept_ids_crossover.json
    python -m scripts.gpu_kept_ids_crossover --tokens 1024 --vocab 4096 --dim 256 --sizes 4,64

Each row as ``gpu_keep_rows``'s, with ``form`` and ``k``, and the fraction of the
``T x V`` logits the entries make, ``(N + T) / (T V)``.
"""

from __future__ import annotations

import json

import jax
import numpy as np

import jaxce
from scripts import _fused_rows


def main():
  parser = _fused_rows.parser(__doc__)
  parser.add_argument("--sizes", default="8,64,256,1024")
  parser.add_argument("--logits-sizes", default="8,64,256,1024,4096")
  args = parser.parse_args()
  p = _fused_rows.problem(args)
  hidden, weight, labels, cot, logits = (p[k] for k in ("hidden", "weight", "labels", "cot",
                                                         "logits"))
  n, v = args.logits_tokens, args.vocab
  rng = np.random.default_rng(3)
  rows = []

  def row(path, form, k, fn, arrays, labels, cot, **kw):
    jaxce.plan.KEPT_IDS_FRACTION = dict.fromkeys(fraction, 0.0 if form == "dense" else 1.0)
    jax.clear_caches()  # (the fraction is read when a call is traced)
    r = dict(path=path, form=form, k=k,
             **_fused_rows.fwd_bwd_row(fn, arrays, labels, cot, args.repeats, **kw))
    r["fraction_of_logits"] = 0 if not k else (k * labels.shape[0] + labels.shape[0]) / (
        labels.shape[0] * v)
    rows.append(r)
    print(json.dumps(r), flush=True)

  fraction = dict(jaxce.plan.KEPT_IDS_FRACTION)
  fused, per_token = jaxce.linear_logprobs_and_entropy, jaxce.logprobs_and_entropy
  row("fused", "none", 0, fused, (hidden, weight), labels, cot)
  row("logits", "none", 0, per_token, (logits,), labels[:n], cot[:, :n])
  for k in (int(s) for s in args.sizes.split(",")):
    for form in ("sparse", "dense"):
      row("fused", form, k, fused, (hidden, weight), labels, cot, keep=_top_k(rng, labels, k, v))
  for k in (int(s) for s in args.logits_sizes.split(",")):
    for form in ("sparse", "dense"):
      row("logits", form, k, per_token, (logits,), labels[:n], cot[:, :n],
          keep=_top_k(rng, labels[:n], k, v))
  jaxce.plan.KEPT_IDS_FRACTION = fraction
  summary = _fused_rows.run_info()
  print(json.dumps(summary), flush=True)
  _fused_rows.save("kept_ids_crossover.json", summary, rows)


def _top_k(rng, labels, k, num_columns):
  """Kept ids, ``k`` per token: its label, then ``k - 1`` random ids (CSR)."""
  t = labels.shape[0]
  ids = rng.integers(0, num_columns, (t, k), dtype=np.int32).reshape(-1)
  return _fused_rows.kept_ids(ids, np.full(t, k), labels)


if __name__ == "__main__":
  main()
