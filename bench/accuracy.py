"""Error vs float64 of every fused-path implementation: log-prob, entropy, d hidden, d W.

    python -m bench.accuracy                       # T = 512, V = 151936, D = 4096, bf16 (GPU)
    python -m bench.accuracy --T 16 --V 1000 --D 32 --impl jaxce,jax_plain   # anywhere

One process: the bf16 inputs are made once on the host (random, with a few peaked
columns); each implementation runs the very functions the bench times (``bench.impls``,
``bench.impls_torch``) for its per-token outputs and its gradients of
``sum(adv * logp) + c * sum(H)`` (random per-token ``adv``; c = 0.01, 0 for log-prob-only
peers); the reference is the same loss in float64 (JAX's x64 mode, on the device), from the same
bf16 values. Errors (bench/README.md):

* ``logp``, ``entropy``: the largest absolute error over the tokens (nats);
* ``d_hidden``, ``d_W``: the largest absolute error over the gradient's entries, divided by
  the largest absolute entry of the float64 gradient.

An implementation that cannot run here gives a row with ``status`` "skipped" and the
reason; one that fails, "error". Prints ``ACCURACY {json}`` last (``--out FILE`` writes it).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import traceback

import numpy as np

from bench import configs, inputs
from bench.configs import Config

PREFIX = "ACCURACY "
T, V, D = 512, 151936, 4096
REFERENCE_ROWS = 2048  # tokens of the float64 reference at a time (reference)
IMPLS = ("jaxce", "jaxce:batch_invariant", "jaxce:objective", "jax_plain", "jax_scan_remat",
         "tokamax:xla", "tokamax:chunked_xla", "torch_eager", "liger_flsce", "liger", "cce")
DEFINITION = (
    "logp, entropy: max over tokens of |value - float64 value| (nats); d hidden, d W: max "
    "|gradient - float64 gradient| / max |float64 gradient|, of sum(adv * logp) + c * sum(H) "
    "with random per-token adv (c = 0.01; 0 for log-prob-only peers); the float64 reference "
    "(JAX x64, on the device) starts from the same bf16 operands.")


def host_problem(t, v, d, seed=0) -> dict:
  """bf16 ``hidden [t, d]``, ``weight [d, v]`` (logits about N(0, 4), 64 columns 4x
  larger: peaked rows), int32 labels, float32 ``adv``; numpy."""
  rng = np.random.default_rng(seed)
  bf16 = inputs.DTYPES["bfloat16"]
  hidden = rng.standard_normal((t, d), np.float32).astype(bf16)
  weight = rng.standard_normal((d, v), np.float32) * np.float32(2 / np.sqrt(d))
  weight[:, rng.integers(0, v, min(64, v))] *= 4
  return dict(hidden=hidden, weight=weight.astype(bf16),
              labels=rng.integers(0, v, t).astype(np.int32),
              adv=rng.standard_normal(t).astype(np.float32))


def reference(problem: dict, coef: float, rows: int = REFERENCE_ROWS) -> dict:
  """float64 ``logp, entropy, d_hidden [t, d]`` and ``d_W [d, v]`` (the last in float32:
  a gradient error is relative to its largest entry), as numpy, computed in float64 on the
  default device (JAX's x64 mode on for this call only, then as it was), ``rows`` tokens
  at a time (the loss is a sum over tokens: each chunk's ``d_hidden`` rows, and ``d_W``
  summed over the chunks in float64), so its memory is a few float64 ``[rows, v]`` arrays
  and ``d_W``'s, at any ``t``."""
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  was_x64 = jax.config.read("jax_enable_x64")
  jax.config.update("jax_enable_x64", True)
  try:
    def loss(h, w, labels, adv):
      logp_all = jax.nn.log_softmax(h @ w, axis=-1)
      logp = jnp.take_along_axis(logp_all, labels[:, None], axis=-1)[:, 0]
      entropy = -jnp.sum(jnp.exp(logp_all) * logp_all, axis=-1)
      return jnp.sum(adv * logp) + coef * jnp.sum(entropy), (logp, entropy)

    @jax.jit
    def chunk(h, w, labels, adv, d_w):
      (_, (logp, entropy)), (d_h, d_w_chunk) = jax.value_and_grad(
          loss, (0, 1), has_aux=True)(h, w, labels, adv)
      return logp, entropy, d_h, d_w + d_w_chunk

    f64 = lambda x: jnp.asarray(np.asarray(x, np.float32), jnp.float64)
    w = f64(problem["weight"])
    d_w = jnp.zeros_like(w)
    outs = []
    for start in range(0, problem["hidden"].shape[0], rows):
      part = slice(start, start + rows)
      *out, d_w = chunk(f64(problem["hidden"][part]), w, jnp.asarray(problem["labels"][part]),
                        f64(problem["adv"][part]), d_w)
      outs.append([np.asarray(o) for o in out])
    logp, entropy, d_hidden = (np.concatenate(o) for o in zip(*outs))
    return dict(logp=logp, entropy=entropy, d_hidden=d_hidden,
                d_W=np.asarray(d_w.astype(jnp.float32)))
  finally:
    jax.config.update("jax_enable_x64", was_x64)


def _max_abs_diff(a, b) -> float:
  return float(np.max(np.abs(np.asarray(a, np.float64) - b)))


def errors(got: dict, ref: dict) -> dict:
  """The four errors (module docstring); ``None`` where ``got`` has no such output."""
  out = {}
  for key in ("logp", "entropy"):
    out[key] = None if got.get(key) is None else _max_abs_diff(got[key], ref[key])
  for key in ("d_hidden", "d_W"):
    out[key] = None if got.get(key) is None else (
        _max_abs_diff(got[key], ref[key]) / float(np.max(np.abs(ref[key]))))
  return out


def _config(spec: str, t, v, d, mode="fwd_bwd") -> Config:
  impl, _, variant = spec.partition(":")
  return Config(impl=impl, variant=variant or "default", input="linear", mode=mode, T=t, V=v,
                D=d)


def _numpy(x):
  return None if x is None else np.asarray(x, np.float32)


def jax_outputs(spec, problem) -> dict:
  """The bench's JAX function for ``spec``: per-token outputs (its ``fwd`` build, where it
  has one) and gradients (its ``fwd_bwd`` build)."""
  import jax  # pylint: disable=import-outside-toplevel
  from bench import impls  # pylint: disable=import-outside-toplevel
  t, d = problem["hidden"].shape
  v = problem["weight"].shape[1]
  device = jax.devices()[:1]
  put = lambda name: jax.device_put(problem[name], device[0])
  out = {}
  fwd = _config(spec, t, v, d, mode="fwd")
  if fwd.invalid() is None:
    built = impls.build(fwd, device)
    result = jax.jit(built.fn)(*(put(n) for n in built.names))
    logp, entropy = result if isinstance(result, tuple) else (result, None)
    out.update(logp=_numpy(logp), entropy=_numpy(entropy))
  built = impls.build(_config(spec, t, v, d), device)
  _, (d_hidden, d_w) = jax.jit(built.fn)(*(put(n) for n in built.names))
  out.update(d_hidden=_numpy(d_hidden), d_W=_numpy(d_w))
  return out


def _measure(spec, problem, platform) -> dict:
  config = _config(spec, *problem["hidden"].shape[:1], problem["weight"].shape[1],
                   problem["hidden"].shape[1])
  row = dict(impl=config.impl, variant=config.variant, coef=config.coef,
             loss="sum(adv*logp)" + (f" + {config.coef:g}*sum(H)" if config.coef else ""))
  if config.invalid():
    return dict(row, status="skipped", error=config.invalid())
  reason = configs.skip_reason(config, platform)
  if reason:
    return dict(row, status="skipped", error=reason)
  if config.impl == "liger_grpo":
    return dict(row, status="skipped", error="a loss: no per-token outputs to compare")
  try:
    if config.impl in configs.TORCH_IMPLS:
      from bench import impls_torch  # pylint: disable=import-outside-toplevel
      got = impls_torch.outputs(config, problem)
    else:
      got = jax_outputs(spec, problem)
  except Exception as e:  # pylint: disable=broad-except  # every failure becomes a row
    return dict(row, status="error", error=f"{type(e).__name__}: {e}"[:2000],
                traceback=traceback.format_exc()[-3000:])
  return dict(row, status="ok", got=got)


def measure(specs=IMPLS, t=T, v=V, d=D, platform=None) -> dict:
  """Every implementation's errors vs float64 (see the module docstring)."""
  import time  # pylint: disable=import-outside-toplevel
  if platform is None:
    import jax  # pylint: disable=import-outside-toplevel
    platform = jax.devices()[0].platform
  start = time.perf_counter()
  log = lambda what: print(f"[{time.perf_counter() - start:6.1f} s] {what}", file=sys.stderr,
                           flush=True)
  problem = host_problem(t, v, d)
  log("inputs made")
  refs = {}
  for coef in sorted({_config(s, t, v, d).coef for s in specs}):
    refs[coef] = reference(problem, coef)
    log(f"float64 reference, c = {coef:g}")
  rows = []
  for spec in specs:
    row = _measure(spec, problem, platform)
    got = row.pop("got", None)
    if got is not None:
      row.update(errors(got, refs[row["coef"]]))
      if row["impl"] == "liger_flsce":
        row["note"] = "entropy returned in bf16"
    del got
    rows.append(row)
    log(f"{spec}: {row['status']}")
  return dict(T=t, V=v, D=d, dtype="bfloat16", definition=DEFINITION,
              reference="float64 on the device (JAX x64)", rows=rows)


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--T", type=int, default=T)
  parser.add_argument("--V", type=int, default=V)
  parser.add_argument("--D", type=int, default=D)
  parser.add_argument("--impl", help=f"comma list (default: {','.join(IMPLS)})")
  parser.add_argument("--out", help="also write the JSON here")
  args = parser.parse_args(argv)
  specs = args.impl.split(",") if args.impl else IMPLS
  result = measure(specs, args.T, args.V, args.D)
  for r in result["rows"]:
    errs = "  ".join(f"{k} {r[k]:.2e}" if r.get(k) is not None else f"{k} –"
                     for k in ("logp", "entropy", "d_hidden", "d_W"))
    print(f"{configs.Config(r['impl'], 'linear', 'fwd', 1, 1, variant=r['variant']).name:22s}"
          f" {r['status']:7s} {errs if r['status'] == 'ok' else r.get('error', '')}",
          file=sys.stderr)
  if args.out:
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
      json.dump(result, f, indent=1)
  print(PREFIX + json.dumps(result), flush=True)


if __name__ == "__main__":
  main()
