"""``batch_invariant=True`` on a GPU: the bitwise checks (a token's ``logp`` and
``entropy`` alone, among T = 8192 and among T = 32768 tokens, forward only and inside
``value_and_grad``, and in a second process: XLA autotunes each matmul shape per
process) and the bench rows (fwd+bwd time and the plan's temporary memory
against the default and XLA in the same process), fused and logits paths.

    python -m scripts.gpu_batch_invariant              # JSON lines, and $OUT/batch_invariant.json
    python -m scripts.gpu_batch_invariant --tokens 512 --vocab 4096 --dim 256   # small
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

import jax
import jax.numpy as jnp
import numpy as np

import jaxce
from scripts import _fused_rows

PROBES = 8


def main():
  parser = _fused_rows.parser(__doc__)
  parser.add_argument("--probe-only", help="write the probes' bits (.npz) here and stop")
  args = parser.parse_args()
  p = _fused_rows.problem(args)
  hidden, weight, labels, cot, logits = (p[k] for k in ("hidden", "weight", "labels", "cot",
                                                         "logits"))
  t, n = args.tokens, args.logits_tokens
  fused, per_token = jaxce.linear_logprobs_and_entropy, jaxce.logprobs_and_entropy
  paths = {"fused": (fused, (hidden, weight), t), "logits": (per_token, (logits,), n)}

  def rows_of(fn, arrays, count, **kw):
    """The first ``count`` tokens' (logp, entropy) as uint32 bits."""
    out = jax.jit(lambda *a: fn(*(x[:count] if x.shape[0] != weight.shape[0] else x
                                  for x in a), labels[:count], **kw))(*arrays)
    return [np.asarray(o)[:PROBES].view(np.uint32) for o in out]

  if args.probe_only:
    np.savez(args.probe_only, **{
        f"{path}_{k}": bits for path, (fn, arrays, tokens) in paths.items()
        for k, bits in enumerate(rows_of(fn, arrays, tokens, batch_invariant=True))})
    return
  with tempfile.TemporaryDirectory() as tmp:  # the same call in a fresh process
    other = os.path.join(tmp, "probes.npz")
    subprocess.run([sys.executable, "-m", "scripts.gpu_batch_invariant", *sys.argv[1:],
                    "--probe-only", other], check=True)
    other = dict(np.load(other))
  checks = []
  for path, (fn, arrays, tokens) in paths.items():
    want = rows_of(fn, arrays, PROBES, batch_invariant=True)
    same = all(np.array_equal(other[f"{path}_{k}"], w) for k, w in enumerate(want))
    checks.append(dict(path=path, tokens=tokens, other_process=True,
                       same_bits_as_alone=bool(same)))
    print(json.dumps(checks[-1]), flush=True)
    for count in sorted({1, min(8192, tokens), tokens}):
      got = rows_of(fn, arrays, count, batch_invariant=True)
      same = all(np.array_equal(g[:min(count, PROBES)], w[:min(count, PROBES)])
                 for g, w in zip(got, want))
      checks.append(dict(path=path, tokens=count, same_bits_as_alone=bool(same)))

    def loss(*a):
      logp, ent = fn(*a, labels[:tokens], batch_invariant=True)
      return jnp.sum(cot[0, :tokens] * logp) + jnp.sum(cot[1, :tokens] * ent), (logp, ent)
    (_, out), _ = jax.jit(jax.value_and_grad(loss, tuple(range(len(arrays))),
                                             has_aux=True))(*arrays)
    same = all(np.array_equal(np.asarray(o)[:PROBES].view(np.uint32), w)
               for o, w in zip(out, want))
    checks.append(dict(path=path, tokens=tokens, inside_value_and_grad=True,
                       same_bits_as_alone=bool(same)))
    print(json.dumps(checks[-1]), flush=True)

  rows = []
  for path, (fn, arrays, tokens) in paths.items():
    for variant, kw in (("default", {}), ("xla", dict(implementation="xla")),
                        ("batch_invariant", dict(batch_invariant=True))):
      rows.append(dict(path=path, variant=variant, **_fused_rows.fwd_bwd_row(
          fn, arrays, labels[:tokens], cot[:, :tokens], args.repeats, **kw)))
      print(json.dumps(rows[-1]), flush=True)
  by = {(r["path"], r["variant"]): r for r in rows}
  summary = dict(device=jax.devices()[0].device_kind, jax=jax.__version__,
                 commit=os.environ.get("JAXCE_COMMIT", "unknown"),
                 all_same_bits=all(c["same_bits_as_alone"] for c in checks))
  for path in paths:
    inv = by[(path, "batch_invariant")]
    summary[f"{path}_invariant_over_default"] = inv["fwd_bwd_ms"] / by[(path, "default")][
        "fwd_bwd_ms"]
    summary[f"{path}_invariant_extra_temp_gib"] = inv["temp_gib"] - by[(path, "default")][
        "temp_gib"]
  print(json.dumps(summary), flush=True)
  out = os.environ.get("OUT")
  if out:
    with open(os.path.join(out, "batch_invariant.json"), "w") as f:
      json.dump(dict(summary=summary, checks=checks, rows=rows), f, indent=1)


if __name__ == "__main__":
  main()
