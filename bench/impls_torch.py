"""The PyTorch peers: eager PyTorch, Liger-Kernel and Cut Cross-Entropy (optional extras).

Same inputs and loss as the JAX implementations. On CUDA: time with
``torch.cuda.synchronize`` around each call, memory = ``torch.cuda.max_memory_allocated``
(peak reset after the warm-up, so Triton autotuning is not counted, like XLA's autotuning
at compile time) minus the bytes allocated once the inputs are placed. On CPU: the
process's peak resident memory growth (``ru_maxrss``), a coarse figure.
"""

from __future__ import annotations

import resource
import time

import numpy as np

from bench.configs import Config


def _tensor(torch, array, device):
  if array.dtype.name == "bfloat16":
    return torch.from_numpy(array.view(np.uint16)).view(torch.bfloat16).to(device)
  return torch.from_numpy(array).to(device)


def _per_token(config: Config):
  """``f(tensors) -> (logp [T] f32, H [T] f32 or None)`` and the float inputs' names."""
  import torch
  entropy = config.entropy

  def eager(logits, labels):
    logp_all = torch.log_softmax(logits.float(), dim=-1)
    logp = logp_all.gather(-1, labels[:, None])[:, 0]
    if not entropy:
      return logp, None
    return logp, -(logp_all.exp() * logp_all).sum(-1)

  if config.input == "logits":
    if config.impl != "torch_eager":
      raise ValueError(f"{config.impl} has no logits path here")
    return (lambda t: eager(t["logits"], t["labels"])), ("logits",)
  names = ("hidden", "weight_vd")
  if config.impl == "torch_eager":
    return (lambda t: eager(t["hidden"] @ t["weight_vd"].T, t["labels"])), names
  if config.impl == "liger":
    from liger_kernel.transformers.fused_linear_cross_entropy import (
        LigerFusedLinearCrossEntropyLoss)
    loss = LigerFusedLinearCrossEntropyLoss(reduction="none")

    def liger(t):
      out = loss(t["weight_vd"], t["hidden"], t["labels"])
      return -(out[0] if isinstance(out, tuple) else out).float(), None
    return liger, names
  if config.impl == "cce":
    from cut_cross_entropy import linear_cross_entropy
    return (lambda t: (-linear_cross_entropy(t["hidden"], t["weight_vd"], t["labels"],
                                             reduction="none").float(), None)), names
  raise ValueError(f"unknown torch impl {config.impl}")


def run(config: Config, host: dict, budget_s: float) -> dict:
  """Time and measure one config. Returns the row fields the runner fills in."""
  import torch
  if config.n_devices not in (0, 1):
    raise ValueError("the PyTorch peers run on one device only")
  cuda = torch.cuda.is_available()
  device = torch.device("cuda" if cuda else "cpu")
  f, float_names = _per_token(config)
  tensors = {"labels": _tensor(torch, host["labels"], device).long(),
             "adv": _tensor(torch, host["adv"], device)}
  if config.input == "logits":
    tensors["logits"] = _tensor(torch, host["logits"], device)
  else:
    tensors["hidden"] = _tensor(torch, host["hidden"], device)
    tensors["weight_vd"] = _tensor(torch, np.ascontiguousarray(host["weight"].T), device)
  grad = config.mode == "fwd_bwd"
  for name in float_names:
    tensors[name].requires_grad_(grad)

  def call():
    if not grad:
      with torch.no_grad():
        return f(tensors)
    logp, entropy = f(tensors)
    loss = (tensors["adv"] * logp).sum()
    if entropy is not None:
      loss = loss + config.coef * entropy.sum()
    loss.backward()
    return loss.detach()

  def timed():
    if cuda:
      torch.cuda.synchronize()
    start = time.perf_counter()
    out = call()
    if cuda:
      torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    del out
    for name in float_names:  # drop this call's gradients before the next call
      tensors[name].grad = None
    return seconds

  rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
  if cuda:
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
  warm = timed()
  if cuda:
    torch.cuda.reset_peak_memory_stats()
  repeats = max(1, min(config.repeats, int(budget_s / max(warm, 1e-9))))
  times = [timed() for _ in range(repeats)]
  if cuda:
    peak, source = torch.cuda.max_memory_allocated() - base, "torch_cuda_peak"
  else:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - rss_before
    source = "host_rss"
  return dict(ms=float(np.median(times)) * 1e3, ms_all=[t * 1e3 for t in times],
              repeats=repeats, peak_extra_bytes=int(peak), memory_source=source,
              n_devices=1, device=torch.cuda.get_device_name() if cuda else "cpu",
              torch=torch.__version__)
