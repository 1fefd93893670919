"""jaxce's per-token fwd+bwd against Liger's FLSCE in one process, cold and at the power cap.

V = 151936, D = 4096, bf16, the bench's loss (``sum(adv * logp) + 0.01 * sum(H)``), at
T = 8192 and 32768, the two implementations alternating:

* ``cold``: the GPU idle ``COLD_S`` seconds, then one warm-up and 5 timed calls (as a
  bench row right after its compile);
* ``sustained``: ``SETTLE_S`` seconds of untimed calls (the clocks settle under the
  card's power limit), then ``REPEATS`` timed calls.

    python -m scripts.gpu_power_cap_ab   # Hopper GPU, Liger: JSON lines, $OUT/power_cap_ab.json

Log ``nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,clocks_throttle_reasons.active
--format=csv -lms 250`` beside it for the clocks.
"""
from __future__ import annotations

import json
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

import jaxce
from bench.impls_torch import flsce
from bench.timing import time_calls
from scripts import _fused_rows

V, D = 151936, 4096
SETTLE_S, REPEATS, COLD_S = 3.0, 10, 6.0


def _calls(tokens, seed=0):
  """``{"jaxce": call, "liger_flsce": call}``: one fwd+bwd each, waited for, on the same
  inputs."""
  import torch  # pylint: disable=import-outside-toplevel
  rng = np.random.default_rng(seed)
  hidden = rng.standard_normal((tokens, D), dtype=np.float32)
  weight = rng.standard_normal((D, V), dtype=np.float32) * D**-0.5
  labels = rng.integers(0, V, tokens)
  adv = rng.standard_normal(tokens, dtype=np.float32)
  h, w = jnp.asarray(hidden, jnp.bfloat16), jnp.asarray(weight, jnp.bfloat16)
  label_ids, advantages = jnp.asarray(labels, jnp.int32), jnp.asarray(adv)

  def loss(h, w):
    logp, entropy = jaxce.linear_logprobs_and_entropy(h, w, label_ids)
    return jnp.sum(advantages * logp) + 0.01 * jnp.sum(entropy)
  step = jax.jit(jax.value_and_grad(loss, (0, 1)))
  jax.block_until_ready(step(h, w))
  t = dict(hidden=torch.tensor(hidden, device="cuda", dtype=torch.bfloat16).requires_grad_(True),
           weight_vd=torch.tensor(weight.T.copy(), device="cuda",
                                  dtype=torch.bfloat16).requires_grad_(True),
           labels=torch.tensor(labels, device="cuda", dtype=torch.int64),
           adv=torch.tensor(adv, device="cuda"))
  peer = flsce(True)

  def peer_call():
    logp, entropy = peer(t)
    ((t["adv"] * logp).sum() + 0.01 * entropy.sum()).backward()
    t["hidden"].grad = t["weight_vd"].grad = None
    torch.cuda.synchronize()
  peer_call()  # compiles
  return {"jaxce": lambda: jax.block_until_ready(step(h, w)), "liger_flsce": peer_call}


def _timed(call, n, warmup=0):
  """ms of ``n`` calls of ``call`` (each waits for itself) after ``warmup`` untimed ones."""
  return time_calls(call, (), n, warmup, sync=lambda _: None)


def main():
  import torch  # pylint: disable=import-outside-toplevel
  rows = []

  def emit(**row):
    rows.append(dict(row, at=time.strftime("%H:%M:%S")))
    print(json.dumps(rows[-1]), flush=True)

  for tokens in (8192, 32768):
    calls = _calls(tokens)
    for r in range(2):
      for name, call in calls.items():
        time.sleep(COLD_S)
        times = _timed(call, 5, warmup=1)
        emit(T=tokens, impl=name, mode="cold", round=r, ms=statistics.median(times),
             ms_all=times)
    for r in range(3):
      for name, call in calls.items():
        end = time.perf_counter() + SETTLE_S
        while time.perf_counter() < end:
          call()
        times = _timed(call, REPEATS)
        emit(T=tokens, impl=name, mode="sustained", round=r, ms=statistics.median(times),
             ms_all=times)
    del calls
    torch.cuda.empty_cache()
  _fused_rows.save("power_cap_ab.json", _fused_rows.run_info(torch=torch.__version__), rows)


if __name__ == "__main__":
  main()
