"""The PyTorch peers: eager PyTorch, Liger-Kernel and Cut Cross-Entropy (optional extras).

Same inputs and loss as the JAX implementations (``liger_grpo``: Liger's own GRPO loss).
Several configurations may share one process (``python -m bench`` batches one peer's rows
on a GPU unless ``--fresh``): the CUDA peak is reset for each. On CUDA: time with
``torch.cuda.synchronize`` around each call, memory = ``torch.cuda.max_memory_allocated``
(peak reset after the first call, so Triton autotuning is not counted, like XLA's autotuning
at compile time) minus the bytes allocated once the inputs are placed. On CPU: the
process's peak resident memory growth (``ru_maxrss``), a coarse figure.
"""

from __future__ import annotations

import gc
import resource

import numpy as np

from bench.configs import Config
from bench.timing import time_calls


def _tensor(torch, array, device):
  if array.dtype.name == "bfloat16":
    return torch.from_numpy(array.view(np.uint16)).view(torch.bfloat16).to(device)
  return torch.from_numpy(array).to(device)


def _place(torch, blocks: dict, device) -> dict:
  """Tensors on ``device`` from ``{name: (block, full_shape)}`` (bench.inputs.host_blocks):
  each block copied over and tiled there to its full rows, as the JAX runner does (the
  host never holds a full ``[T, V]`` array); ``labels`` int64; ``weight [D, V]`` becomes
  ``weight_vd [V, D]`` (contiguous, transposed on the device)."""
  out = {}
  for name, (block, shape) in blocks.items():
    t = _tensor(torch, block, device)
    if t.shape[0] != shape[0]:
      t = t.repeat((-(-shape[0] // t.shape[0]),) + (1,) * (t.ndim - 1))[:shape[0]]
    out[name] = t
  out["labels"] = out["labels"].long()
  if "weight" in out:
    out["weight_vd"] = out.pop("weight").t().contiguous()
  return out


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
  if config.impl == "liger_flsce":
    return flsce(entropy), names
  if config.impl == "cce":
    from cut_cross_entropy import linear_cross_entropy
    return (lambda t: (-linear_cross_entropy(t["hidden"], t["weight_vd"], t["labels"],
                                             reduction="none").float(), None)), names
  raise ValueError(f"unknown torch impl {config.impl}")


def flsce(entropy: bool):
  """Liger-Kernel's fused linear scaled cross-entropy (FLSCE; on an H100/H200 its sm90
  CuTe-DSL kernel): ``t -> (logp [T] f32, H [T] f32 or None)``, differentiable. bf16
  hidden ``[T, D]``, weight ``[V, D]`` (contiguous), int64 labels; its entropy is bf16."""
  from liger_kernel.ops.fused_linear_scaled_cross_entropy import (
      LigerFusedLinearScaledCrossEntropyFunction)

  def f(t):
    out = LigerFusedLinearScaledCrossEntropyFunction.apply(
        t["hidden"], t["weight_vd"], t["labels"], 1.0, -100, 1, entropy)
    nll, ent = out if entropy else (out, None)
    return -nll, None if ent is None else ent.float()
  return f


GRPO_SEQUENCE = 1024  # tokens per sequence, as bench.impls' GRPO objective
LIGER_GRPO_NOTE = ("Liger's LigerFusedLinearGRPOLoss with its defaults (loss_type='dapo', "
                   "clip 0.2 / 0.2, torch.compile, chunk_size=1) and beta=0.04: k3 KL to "
                   "given reference log-probs, no entropy term; sequences of 1024 tokens, "
                   "advantages per sequence")


def _liger_grpo_loss(t):
  """Liger's fused GRPO loss (a scalar) over sequences of GRPO_SEQUENCE tokens, with old
  and reference log-probs near the policy's as the JAX GRPO rows use."""
  from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss
  if "grpo" not in t:
    T, D = t["hidden"].shape
    L = min(GRPO_SEQUENCE, T)
    B = T // L
    adv = t["adv"][:B * L].view(B, L)
    t["grpo"] = dict(module=LigerFusedLinearGRPOLoss(beta=0.04), B=B, L=L,
                     mask=t["labels"].new_ones(B, L), adv=adv[:, 0].contiguous(),
                     old=(-2.0 + 0.1 * adv).contiguous(), ref=(-2.0 - 0.1 * adv).contiguous())
  g = t["grpo"]
  n = g["B"] * g["L"]
  loss, _ = g["module"](t["hidden"][:n].view(g["B"], g["L"], -1), t["weight_vd"],
                        t["labels"][:n].view(g["B"], g["L"]), g["mask"], g["adv"],
                        ref_per_token_logps=g["ref"], old_per_token_logps=g["old"])
  return loss


def time_after_first_call(call, sync, after, repeats: int, budget_s: float, between):
  """ms of each timed call, as the JAX rows are timed (bench.runner): the first call
  untimed (it compiles: CuTe DSL kernels, Triton autotuning; the JAX rows compile before
  any call), ``between()`` after it, then one warm-up call and up to ``repeats`` timed
  ones, as many as ``budget_s`` seconds allow judged from the warm-up's time. (Judged
  from the compiling call instead, a peer got a single timed call, made on a card still
  cool from the idle compile: bench/NOTES.md, entry 30.)"""
  sync(call())
  after()
  between()
  return time_calls(call, (), repeats, warmup=1, budget_s=budget_s, sync=sync, after=after)


def run(config: Config, blocks: dict, budget_s: float) -> dict:
  """Time and measure one config on ``blocks`` (bench.inputs.host_blocks). Returns the row
  fields the runner fills in."""
  import torch
  if config.n_devices not in (0, 1):
    raise ValueError("the PyTorch peers run on one device only")
  cuda = torch.cuda.is_available()
  if cuda:  # an earlier row of this process left nothing behind
    gc.collect()
    torch.cuda.empty_cache()
  device = torch.device("cuda" if cuda else "cpu")
  if config.impl == "liger_grpo":
    f, float_names = None, ("hidden", "weight_vd")
  else:
    f, float_names = _per_token(config)
  tensors = _place(torch, blocks, device)
  grad = config.mode == "fwd_bwd"
  for name in float_names:
    tensors[name].requires_grad_(grad)

  def call():
    if config.impl == "liger_grpo":
      loss = _liger_grpo_loss(tensors)
      loss.backward()
      return loss.detach()
    if not grad:
      with torch.no_grad():
        return f(tensors)
    logp, entropy = f(tensors)
    loss = (tensors["adv"] * logp).sum()
    if entropy is not None:
      loss = loss + config.coef * entropy.sum()
    loss.backward()
    return loss.detach()

  def sync(_):
    if cuda:
      torch.cuda.synchronize()

  def drop_grads():  # this call's gradients go before the next call
    for name in float_names:
      tensors[name].grad = None

  rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
  if cuda:
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()

  def reset_peak():  # Triton autotuning and compilation are not counted
    if cuda:
      torch.cuda.reset_peak_memory_stats()

  times = time_after_first_call(call, sync, drop_grads, config.repeats, budget_s, reset_peak)
  if cuda:
    peak, source = torch.cuda.max_memory_allocated() - base, "torch_cuda_peak"
  else:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - rss_before
    source = "host_rss"
  note = LIGER_GRPO_NOTE if config.impl == "liger_grpo" else (
      "entropy returned in bf16" if config.impl == "liger_flsce" and config.entropy else "")
  return dict(ms=float(np.median(times)), ms_all=times, repeats=len(times),
              peak_extra_bytes=int(peak), memory_source=source, n_devices=1,
              device=torch.cuda.get_device_name() if cuda else "cpu", note=note,
              torch=torch.__version__, peer_version=_peer_version(config.impl))


def _peer_version(impl: str):
  from importlib import metadata
  dist = {"liger": "liger-kernel", "liger_flsce": "liger-kernel", "liger_grpo": "liger-kernel",
          "cce": "cut-cross-entropy"}.get(impl)
  try:
    return metadata.version(dist) if dist else None
  except metadata.PackageNotFoundError:
    return None


def outputs(config: Config, host: dict) -> dict:
  """Per-token ``logp``, ``entropy`` (``None`` for log-prob-only peers) and the gradients
  ``d_hidden [T, D]``, ``d_W [D, V]`` of the row's loss, as float32 numpy
  (:mod:`bench.accuracy`)."""
  import torch
  device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
  f, _ = _per_token(config)
  t = _place(torch, {k: (v, v.shape) for k, v in host.items()}, device)
  t["hidden"].requires_grad_(True)
  t["weight_vd"].requires_grad_(True)
  logp, entropy = f(t)
  loss = (t["adv"] * logp).sum()
  if entropy is not None:
    loss = loss + config.coef * entropy.sum()
  loss.backward()
  host32 = lambda x: None if x is None else x.detach().float().cpu().numpy()
  return dict(logp=host32(logp), entropy=host32(entropy), d_hidden=host32(t["hidden"].grad),
              d_W=host32(t["weight_vd"].grad).T)
