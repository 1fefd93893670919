"""The logits path's fwd+bwd with a ~5 % kept set (``keep=``) against the same call
without, in one process, each row printed as it is measured (JSON lines; also
``$OUT/keep_logits.jsonl``): ``_fused_rows.fwd_bwd_row``'s backend, median time and
temporary memory. With ``--parts``, also where the kept set's time goes: the forward
alone, the kept words' preparation (``mosaic_tile.kept_words``) alone, the forward kernel
alone on prepared words, the gradient's pass alone (XLA's and ``mosaic_rows_grad``'s, with
and without the kept set), and the compiled fwd+bwd program's HLO
(``$OUT/keep_fwd_bwd.hlo.txt``). The logits, labels and kept sets are the jitted
functions' arguments, as in a training step (a kept set closed over as a constant lets
XLA fold its preparation into the constant, and time something no user runs).

    python -m scripts.gpu_keep_logits [--tokens 32768 --vocab 151936 --kept 0.05] [--parts]
"""

from __future__ import annotations

import argparse
import json
import os

import jax
import jax.numpy as jnp
import numpy as np

import jaxce
from bench.timing import time_ms
from jaxce._kernels import logits_rows, mosaic_rows, mosaic_rows_grad, mosaic_tile
from jaxce._kernels.config import Tokens
from scripts import _fused_rows


def main():
  parser = argparse.ArgumentParser(description=__doc__)
  parser.add_argument("--tokens", type=int, default=32768)
  parser.add_argument("--vocab", type=int, default=151936)
  parser.add_argument("--kept", type=float, default=0.05)
  parser.add_argument("--repeats", type=int, default=10)
  parser.add_argument("--parts", action="store_true")
  args = parser.parse_args()
  t, v = args.tokens, args.vocab
  key = jax.random.key(0)
  logits = (jax.random.normal(key, (t, v), jnp.float32) * 3).astype(jnp.bfloat16)
  labels = jax.random.randint(key, (t,), 0, v)
  keep = jax.jit(lambda k: jaxce.keep.pack(
      (jax.random.uniform(k, (t, v)) < args.kept) | (jnp.arange(v) == labels[:, None])))(key)
  cot = jax.random.normal(key, (2, t))
  out = os.environ.get("OUT")
  rows = []

  def row(variant, measured=None, **kw):
    if measured is None:
      measured = _fused_rows.fwd_bwd_row(jaxce.logprobs_and_entropy, (logits,), labels, cot,
                                         args.repeats, **kw)
    r = dict(variant=variant, vocab=v, **{"tokens": t, **measured},
             device=jax.devices()[0].device_kind, jax=jax.__version__,
             commit=os.environ.get("JAXCE_COMMIT", "unknown"))
    rows.append(r)
    print(json.dumps(r), flush=True)
    if out:
      with open(os.path.join(out, "keep_logits.jsonl"), "a") as f:
        f.write(json.dumps(r) + "\n")

  row("default")
  row("keep", keep=keep)
  row("default")  # (again: the spread)
  row("keep_xla", keep=keep, implementation="xla")
  row("keep_invariant", keep=keep, batch_invariant=True)
  base = min(r["fwd_bwd_ms"] for r in rows if r["variant"] == "default")
  print(json.dumps({r["variant"]: round(r["fwd_bwd_ms"] / base, 3) for r in rows}))
  if args.parts:
    parts(row, logits, labels, keep, cot, args.repeats, out)


def parts(row, logits, labels, keep, cot, repeats, out):
  """The forward alone with and without ``keep``, the words' preparation alone, the
  forward kernel alone on prepared words and without, the gradient's pass alone (XLA's
  and ``mosaic_rows_grad``'s, with and without ``keep``); the fwd+bwd HLO to ``out``."""
  t, v = logits.shape
  forward = jax.jit(lambda x, lab, k: jaxce.logprobs_and_entropy(x, lab, keep=k))
  row("fwd_default", {"fwd_ms": time_ms(forward, (logits, labels, None), repeats)})
  row("fwd_keep", {"fwd_ms": time_ms(forward, (logits, labels, keep), repeats)})
  prepare = jax.jit(lambda k, lab: mosaic_tile.kept_words(k, lab, t))
  row("kept_words", {"ms": time_ms(prepare, (keep, labels), repeats)})
  words = prepare(keep, labels)
  block_rows = mosaic_rows.block_rows(t)
  row_inputs = jnp.stack([jnp.ones(t), jnp.zeros(t), jnp.full(t, float(v))])
  row_inputs = row_inputs[:, block_rows].transpose(1, 0, 2)
  kernel = jax.jit(lambda x, r, w: mosaic_rows._statistics(  # pylint: disable=protected-access
      x, r, w, masked=False, with_entropy=True, stages=6,
      interpret=jax.default_backend() != "gpu"))
  row("kernel_default", {"ms": time_ms(lambda x, r: kernel(x, r, None),
                                       (logits, row_inputs), repeats)})
  row("kernel_keep", {"ms": time_ms(kernel, (logits, row_inputs, words), repeats)})
  saved = (jnp.zeros(t), jnp.full(t, float(np.log(v))), jnp.ones(t))
  for name, kept in (("default", None), ("keep", keep)):
    tokens = Tokens(labels, jnp.ones(t), jnp.ones(t, bool), kept)
    for backend, fn in (("xla", lambda x, tok, c: logits_rows.gradient(
        x, tok, saved, (c[0], c[1]), None, 0)), ("mosaic", lambda x, tok, c: (
            mosaic_rows_grad.gradient(x, tok, saved, (c[0], c[1]), 0, None,
                                      interpret=jax.default_backend() != "gpu")))):
      row(f"gradient_{backend}_{name}", {"ms": time_ms(jax.jit(fn), (logits, tokens, cot),
                                                       repeats)})
  if out:
    def loss(x, lab, k):
      logp, ent = jaxce.logprobs_and_entropy(x, lab, keep=k)
      return jnp.sum(cot[0] * logp) + jnp.sum(cot[1] * ent)
    with open(os.path.join(out, "keep_fwd_bwd.hlo.txt"), "w") as f:
      f.write(jax.jit(jax.grad(loss)).lower(logits, labels, keep).compile().as_text())


if __name__ == "__main__":
  main()
