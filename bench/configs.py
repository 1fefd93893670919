"""Benchmark configurations and the named suites.

A :class:`Config` is one row of the results: one implementation, one input path, one
mode, one shape. A suite is a list of :class:`Group` s (a grid of implementations x modes
x token counts), expanded into configs in an order that lets the driver skip a larger T
once a smaller one ran out of memory.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Optional, Sequence

IMPLS = ("jaxce", "jax_plain", "jax_scan_remat", "optax", "tokamax", "torch_eager", "liger",
         "liger_flsce", "liger_grpo", "cce")
TORCH_IMPLS = ("torch_eager", "liger", "liger_flsce", "liger_grpo", "cce")
# Peers that return only the log-prob: their rows use c = 0 (no entropy term).
# liger_grpo: Liger's GRPO loss, which has no entropy term.
LOGP_ONLY_IMPLS = ("optax", "tokamax", "liger", "liger_grpo", "cce")
# Peers that run only on a CUDA GPU: elsewhere their rows are "skipped" (no process).
GPU_ONLY_IMPLS = ("liger", "liger_flsce", "liger_grpo", "cce")
_WHEELS = "bash bench/get_peers.sh (PyPI access), then pip install --no-deps bench/.wheels/*.whl"
_LIGER = ("Liger-Kernel 0.8.5 and the CUTLASS DSL 4.8.1 (FLSCE's sm90 kernel) on a CUDA "
          "machine: pip install liger-kernel==0.8.5 nvidia-cutlass-dsl==4.8.1")


@dataclasses.dataclass(frozen=True)
class Peer:
  """An optional package a peer's rows need: the module, the version, how to install it."""
  module: str
  install: str
  version: Optional[str] = None  # the distribution and version the rows are for
  needs: tuple = ()  # other modules it imports, which an environment may lack


# The package each optional peer needs; a missing one gives a "skipped" row, no process.
PEERS = {
    "optax": Peer("optax", "pip install optax (the [bench] extra)"),
    "tokamax": Peer("tokamax", "tokamax 0.0.17 needs Python >= 3.12 and JAX >= 0.11.1: "
                    + _WHEELS + " (and flax, which qwix imports)", version="tokamax==0.0.17",
                    needs=("qwix", "flax", "jaxtyping", "pydantic", "einshape")),
    "torch_eager": Peer("torch", "pip install torch (CPU: --index-url "
                        "https://download.pytorch.org/whl/cpu)"),
    "liger": Peer("liger_kernel", _LIGER),
    "liger_flsce": Peer("liger_kernel", _LIGER),
    "liger_grpo": Peer("liger_kernel", _LIGER),
    "cce": Peer("cut_cross_entropy", "cut-cross-entropy 25.1.1: " + _WHEELS),
}
REQUIRES = {impl: peer.module for impl, peer in PEERS.items()}


def skip_reason(config: "Config", platform: str) -> Optional[str]:
  """Why ``config`` cannot run on ``platform`` (its peer missing, or a GPU-only peer
  without a GPU), with how to install the peer; ``None`` when it can run."""
  import importlib.util  # pylint: disable=import-outside-toplevel
  from importlib import metadata  # pylint: disable=import-outside-toplevel
  peer = PEERS.get(config.impl)
  if peer is None:
    return None
  if config.impl in GPU_ONLY_IMPLS and platform != "gpu":
    return (f"GPU only: {config.impl} runs on a CUDA GPU, this is {platform}. "
            f"To install it there: {peer.install}")
  missing = [m for m in (peer.module,) + peer.needs if importlib.util.find_spec(m) is None]
  if missing:
    return (f"not installed: {config.impl} needs the Python package providing "
            f"'{missing[0]}'. To install: {peer.install}")
  if peer.version:
    dist, want = peer.version.split("==")
    try:
      have = metadata.version(dist)
    except metadata.PackageNotFoundError:
      have = "?"
    if have != want:
      return (f"wrong version: {config.impl} rows are for {peer.version}, {dist} {have} is "
              f"installed. To install: {peer.install}")
  return None
# Impls that chunk over tokens (the others ignore ``chunk_size``; their rows keep None).
CHUNKED_IMPLS = ("jaxce", "jax_scan_remat")
# Which impl runs which input path.
SUPPORTS = {
    "logits": ("jaxce", "jax_plain", "jax_scan_remat", "optax", "torch_eager"),
    "linear": ("jaxce", "jax_plain", "jax_scan_remat", "tokamax", "torch_eager", "liger",
               "liger_flsce", "liger_grpo", "cce"),
}
# Variants: "default"; "logp_only" (c = 0, entropy not computed); "inplace" (jaxce, logits
# donated so the gradient can take their buffer; value and gradient like every row);
# "inplace_grad" (the same, gradient only: ``jax.grad``, no loss value returned);
# "train_step" (hidden @ W -> logits as an intermediate of one jitted step -> loss ->
# grads of hidden and W; jaxce and jax_plain); "inplace_loop" and "train_step_loop" (the
# same with ``backward_in_place=True``: the backward overwrites the logits chunk by chunk);
# "xla" (jaxce with ``implementation="xla"``: XLA's two-pass statistics, not the kernel);
# "triton" (``implementation="triton"``: the Triton kernel even where the default is
# another; rows of runs before 2026-11-25 named it "pallas", relabelled in bench/results);
# "hidden_grad_output" (fused: ``hidden_grad_accumulation="output"``, no f32 [T, D] sum);
# "token_split" (fused, sharded: hidden, labels and cotangents split by tokens over the
# vocabulary's devices, as sequence parallelism leaves them: ``batch_axis=vocab_axis``);
# "objective" (jaxce.token_loss / linear_token_loss with the row's loss as the objective:
# the gradient formed in the forward); "grpo" (jaxce's per-token path or plain JAX, then
# the bench's GRPO objective, GRPO_NOTE, through autodiff); "objective_grpo" (the GRPO
# objective on the objective path). fwd_bwd only, one device.
# "keep" (jaxce with ``keep=``: packed words keeping KEPT_FRACTION of the columns at random
# per token) and "kept_ids" (jaxce with ``keep=jaxce.keep.from_csr(...)``: a sampler's
# kept ids in vLLM's CSR form, their sizes as prime-rl measured them; bench.inputs); both
# compared with the "default" row of the same run.
IN_PLACE_VARIANTS = ("inplace", "inplace_grad", "inplace_loop")
LOOP_VARIANTS = ("inplace_loop", "train_step_loop")
TRAIN_STEP_VARIANTS = ("train_step", "train_step_loop")
IMPLEMENTATION_VARIANTS = ("xla", "triton")
# tokamax rows name the implementation they ask for (tokamax 0.0.17 has both on GPU).
TOKAMAX_VARIANTS = ("xla", "chunked_xla")
OBJECTIVE_VARIANTS = ("objective", "grpo", "objective_grpo")
KEEP_VARIANTS = ("keep", "kept_ids")
KEPT_FRACTION = 0.05
# The variants a data × vocab mesh runs (Config.data > 1).
DATA_VARIANTS = ("default", "objective_grpo")
VARIANTS = ("default", "logp_only", "hidden_grad_output", "batch_invariant", "token_split") + \
    IN_PLACE_VARIANTS + TRAIN_STEP_VARIANTS + IMPLEMENTATION_VARIANTS + ("chunked_xla",) + \
    OBJECTIVE_VARIANTS + KEEP_VARIANTS
GRPO_NOTE = ("GRPO: clip 0.2 / 0.28, k3 KL to a reference with beta 0.04, entropy bonus 0.01, "
             "sequence-mean-token-mean over sequences of 1024 tokens")
MODES = ("fwd", "fwd_bwd")
ENTROPY_COEF = 0.01


@dataclasses.dataclass(frozen=True)
class Config:
  """One benchmark configuration (one results row).

  Attributes:
    impl: one of :data:`IMPLS`.
    input: ``"logits"`` (``[T, V]`` logits given) or ``"linear"`` (``hidden [T, D]`` and
      ``W [D, V]`` given; the LM head is part of the measured function).
    mode: ``"fwd"`` (log-probs and entropies, no gradient) or ``"fwd_bwd"`` (value and
      gradient of ``sum(adv * logp) + c * sum(H)``).
    T, V: tokens and vocabulary columns (global, before any sharding).
    D: hidden size for the linear input (``None`` for logits).
    dtype: input dtype name (``"bfloat16"``, ``"float16"``, ``"float32"``).
    chunk_size: tokens per chunk for the chunked impls (``None``: the impl's default).
    n_devices: devices the arrays are split over (vocab axis); 0 means all visible.
    data: with ``data > 1``, the ``n_devices`` form a ``data × n_devices / data`` mesh (data ×
      vocab, as a data-parallel user runs the sharded head): the tokens split over the
      data axis (``batch_axis``), the vocabulary over the other (jaxce's ``sharded_*``).
    variant: one of :data:`VARIANTS`.
    repeats: timed calls after the warm-up (fewer when one call is slow).
  """
  impl: str
  input: str
  mode: str
  T: int
  V: int
  D: Optional[int] = None
  dtype: str = "bfloat16"
  chunk_size: Optional[int] = None
  n_devices: int = 1
  variant: str = "default"
  repeats: int = 5
  data: int = 1

  @property
  def entropy(self) -> bool:
    """Whether the loss has the entropy term (``c = 0.01``) or is log-prob only."""
    return self.impl not in LOGP_ONLY_IMPLS and self.variant != "logp_only"

  @property
  def coef(self) -> float:
    return ENTROPY_COEF if self.entropy else 0.0

  @property
  def name(self) -> str:
    """``impl`` or ``impl:variant``, as ``--impl`` accepts it."""
    return self.impl if self.variant == "default" else f"{self.impl}:{self.variant}"

  def to_json(self) -> str:
    return json.dumps(dataclasses.asdict(self))

  @classmethod
  def from_json(cls, text: str) -> "Config":
    return cls(**json.loads(text))

  def invalid(self) -> Optional[str]:
    """Why this combination cannot run (``None`` when it can)."""
    if self.impl not in SUPPORTS.get(self.input, ()):
      return f"{self.impl} has no {self.input} path"
    if self.variant in IN_PLACE_VARIANTS and (
        self.impl, self.input, self.mode) != ("jaxce", "logits", "fwd_bwd"):
      return f"{self.variant} is a jaxce logits fwd_bwd variant"
    if self.variant in TRAIN_STEP_VARIANTS and (
        self.impl not in ("jaxce", "jax_plain") or self.input != "linear"
        or self.mode != "fwd_bwd" or (self.impl != "jaxce" and self.variant in LOOP_VARIANTS)):
      return f"{self.variant} is a jaxce (train_step: or jax_plain) linear fwd_bwd variant"
    if self.impl == "tokamax" and self.variant not in TOKAMAX_VARIANTS:
      return f"tokamax rows name the implementation: tokamax:{' or tokamax:'.join(TOKAMAX_VARIANTS)}"
    if self.impl == "liger_grpo" and self.mode != "fwd_bwd":
      return "liger_grpo is a fwd_bwd loss"
    if self.variant in IMPLEMENTATION_VARIANTS + TOKAMAX_VARIANTS and not (
        self.impl == "tokamax" or self.impl == "jaxce" and self.variant in
        IMPLEMENTATION_VARIANTS):
      return f"{self.variant} is a jaxce (xla, triton) or tokamax (xla, chunked_xla) variant"
    if self.variant in OBJECTIVE_VARIANTS and (
        self.mode != "fwd_bwd" or self.impl not in (
            ("jaxce", "jax_plain") if self.variant == "grpo" else ("jaxce",))
        or self.n_devices != 1 and self.impl != "jaxce"):
      return (f"{self.variant} is a fwd_bwd variant of jaxce (grpo: or jax_plain, on one "
              "device)")
    if self.variant == "batch_invariant" and self.impl != "jaxce":
      return "batch_invariant is a jaxce variant"
    if self.variant in KEEP_VARIANTS and self.impl != "jaxce":
      return f"{self.variant} is a jaxce variant"
    if self.variant == "logp_only" and self.impl in LOGP_ONLY_IMPLS:
      return "already log-prob only"
    if self.input == "linear" and not self.D:
      return "the linear input needs D"
    if self.data != 1 and (self.impl != "jaxce" or self.variant not in DATA_VARIANTS
                           or self.n_devices % self.data or self.n_devices < 2 * self.data):
      return (f"a {self.data} × vocab mesh takes jaxce's {' or '.join(DATA_VARIANTS)} rows "
              "over a multiple of 2 × data devices")
    return None


def row_key(row) -> tuple:
  """The identity of a results row (a dict) or config: re-running it replaces the row."""
  get = row.get if isinstance(row, dict) else lambda k, d=None: getattr(row, k, d)
  return (get("impl"), get("variant", "default"), get("input"), get("mode"), get("T"),
          get("V"), get("D"), get("dtype"), get("chunk_size"), get("n_devices"),
          get("data", 1) or 1)


@dataclasses.dataclass(frozen=True)
class Group:
  """A grid of configs: every (impl spec, mode, T, chunk size) with the other fields fixed.

  ``impls`` holds ``"impl"`` or ``"impl:variant"`` specs; impossible combinations (say the
  in-place variant in ``fwd`` mode) are dropped on expansion.
  """
  input: str
  impls: Sequence[str]
  Ts: Sequence[int]
  V: int
  D: Optional[int] = None
  modes: Sequence[str] = MODES
  dtype: str = "bfloat16"
  chunk_sizes: Sequence[Optional[int]] = (None,)
  n_devices: int = 1
  data: int = 1


def _spec(spec: str) -> tuple[str, str]:
  impl, _, variant = spec.partition(":")
  return impl, variant or "default"


_BWD = dict(modes=("fwd_bwd",))


def _cpu_groups(Ts, V, D):
  """jaxce and plain JAX in both modes; the other peers and variants in fwd_bwd only (the
  GPU-only peers give one "skipped" row each, with how to install them)."""
  return [
      Group("logits", ("jaxce", "jax_plain"), Ts, V),
      Group("logits", ("jaxce:inplace", "jaxce:inplace_grad", "jax_scan_remat", "optax",
                       "torch_eager"), Ts, V,
            **_BWD),
      Group("linear", ("jaxce", "jax_plain"), Ts, V, D),
      Group("linear", ("jaxce:logp_only", "jax_scan_remat", "tokamax:chunked_xla",
                       "torch_eager", "jaxce:train_step", "jax_plain:train_step"), Ts, V, D,
            **_BWD),
      Group("linear", ("liger_flsce",), Ts[-1:], V, D, **_BWD),
  ]


_GPU_T = (8192, 32768)
_LARGE_T = (262144, 1048576)
_GPU_V, _GPU_D = 151936, 4096
_SHARDED_T = (32768, 131072)
# Every peer on the fused path, in both modes (liger_grpo, a loss, in the objective suite).
_FUSED_PEERS = ("jaxce", "jax_plain", "tokamax:xla", "tokamax:chunked_xla", "torch_eager",
                "liger_flsce", "liger", "cce")


def _gpu_groups(Ts):
  """The one-GPU suite: jaxce against every peer (the chunked peers in fwd_bwd only)."""
  return [
      Group("logits", ("jaxce", "jax_plain", "torch_eager"), Ts, _GPU_V),
      Group("logits", ("jaxce:inplace",), Ts, _GPU_V, **_BWD),
      Group("linear", _FUSED_PEERS, Ts, _GPU_V, _GPU_D),
  ]


def _gpu_variant_groups(Ts):
  """jaxce's own variants and backends on one GPU (the levers), and the secondary
  baselines (scan + remat, optax, the train step with the logits as an intermediate)."""
  return [
      Group("logits", ("jaxce:xla", "jaxce:batch_invariant"), Ts, _GPU_V),
      Group("logits", ("jaxce:inplace_grad", "jaxce:inplace_loop", "jax_scan_remat",
                       "optax"), Ts, _GPU_V, **_BWD),
      # The fused forward before its Mosaic GPU kernel (Triton statistics of XLA tiles).
      Group("linear", ("jaxce:triton", "jaxce:batch_invariant"), Ts, _GPU_V, _GPU_D),
      Group("linear", ("jaxce:logp_only", "jaxce:xla", "jax_scan_remat", "jaxce:train_step",
                       "jaxce:train_step_loop", "jax_plain:train_step"), Ts, _GPU_V, _GPU_D,
            **_BWD),
      # Kept sets (issues 42 and 43): against the default rows of the same run.
      Group("logits", ("jaxce:keep", "jaxce:kept_ids"), Ts, _GPU_V, **_BWD),
      Group("linear", ("jaxce:keep", "jaxce:kept_ids"), Ts, _GPU_V, _GPU_D, **_BWD),
  ]


def _objective_groups(Ts):
  """A GRPO objective (GRPO_NOTE), issue 20: the objective path (gradient in the forward)
  against the per-token path + autodiff, plain JAX and Liger's fused GRPO loss."""
  return [
      Group("linear", ("jaxce:objective_grpo", "jaxce:grpo", "jax_plain:grpo",
                       "jaxce:objective", "jaxce", "liger_grpo"), Ts, _GPU_V, _GPU_D, **_BWD),
      Group("logits", ("jaxce:objective_grpo", "jaxce:grpo", "jax_plain:grpo",
                       "jaxce:objective", "jaxce"), Ts, _GPU_V, **_BWD),
  ]


# The shapes users run (issue 56): ragged T (shifted labels give B x (S - 1) tokens,
# padding removal the real count, OpenRLHF's budget 16192, verl's examples 24000) beside
# the round T next to them, at the hidden sizes RL users train most, fused path.
_SHAPE_T = (8184, 8192, 16192, 16384, 24000, 24576, 32760, 32768)
_SHAPE_D = (1024, 2048, 2560, 4096, 5120)


def _shape_groups():
  """jaxce and FLSCE at every shape (both modes); plain JAX while its logits fit (it
  holds several f32 ``[T, V]`` arrays); a second vocabulary (248320 columns) at D =
  4096."""
  return ([Group("linear", ("jaxce", "liger_flsce"), _SHAPE_T, _GPU_V, d) for d in _SHAPE_D]
          + [Group("linear", ("jax_plain",), _SHAPE_T[:4], _GPU_V, d) for d in _SHAPE_D]
          + [Group("linear", ("jaxce", "liger_flsce"), (8184, 32760), 248320, 4096)])


_SHARD_COUNTS = (1, 2, 4)


def _shard_count_groups():
  """Qwen3's vocabulary over 1, 2 and 4 GPUs of one host (each GPU's 151936 / n columns:
  75968 and 37984, not multiples of 128), T = 32768, D = 4096: the fused path (on several
  GPUs in both layouts: hidden states replicated, or split by tokens), the GRPO objective
  path and the logits path, with one GPU's call as the baseline of each."""
  return [g for n in _SHARD_COUNTS for g in (
      Group("linear", ("jaxce",) + (("jaxce:token_split",) if n > 1 else ()), (32768,), _GPU_V,
            _GPU_D, n_devices=n),
      Group("linear", ("jaxce:objective_grpo",), (32768,), _GPU_V, _GPU_D, n_devices=n,
            **_BWD),
      Group("logits", ("jaxce",), (32768,), _GPU_V, n_devices=n, **_BWD))]


def _more_shard_groups():
  """The rest of the sharded rows, on a host of 4 GPUs (after ``gpu-shards``): Qwen3.5's
  248320 columns over 1, 2 and 4 GPUs (62080 a GPU: whole tiles); T = 262144 at 1 and 4
  GPUs (the fused and objective paths); and the 2 × 2 data × vocab mesh (tokens split over
  data, vocabulary over the other axis) at T = 32768, V = 151936, beside ``gpu-shards``'
  one-GPU and 1 × 4 rows."""
  return ([g for n in _SHARD_COUNTS for g in (
              Group("linear", ("jaxce", "jaxce:objective_grpo"), (32768,), 248320, _GPU_D,
                    n_devices=n, **_BWD),
              Group("logits", ("jaxce",), (32768,), 248320, n_devices=n, **_BWD))]
          + [Group("linear", ("jaxce", "jaxce:objective_grpo"), (262144,), _GPU_V, _GPU_D,
                   n_devices=n, **_BWD) for n in (1, 4)]
          + [Group("linear", ("jaxce", "jaxce:objective_grpo"), (32768,), _GPU_V, _GPU_D,
                   n_devices=4, data=2, **_BWD),
             Group("logits", ("jaxce",), (32768,), _GPU_V, n_devices=4, data=2, **_BWD)])


SUITES = {
    # Default: a couple of minutes on 2 CPU cores; XLA's compiled memory plan and time.
    "cpu": _cpu_groups((128, 512, 2048), 16384, 64),
    # The CI smoke test: tiny shapes, a 2-device sharded row (simulated CPU devices).
    "smoke": [
        Group("logits", ("jaxce", "jax_plain"), (64, 200), 1000),
        Group("logits", ("jaxce:inplace", "jaxce:inplace_grad", "jaxce:inplace_loop",
                         "jaxce:xla", "jax_scan_remat", "optax"), (200,), 1000, **_BWD),
        Group("linear", ("jaxce", "jax_plain", "jaxce:train_step", "jaxce:train_step_loop",
                         "jax_plain:train_step"), (200,), 1000, 32),
        Group("logits", ("jaxce", "jax_plain", "jaxce:batch_invariant"), (200,), 1000,
              n_devices=2, **_BWD),
        Group("linear", ("jaxce", "jaxce:batch_invariant", "jaxce:token_split"), (200,), 1000,
              32, n_devices=2, **_BWD),
        Group("linear", ("jaxce", "jaxce:objective_grpo"), (200,), 1000, 32, n_devices=4,
              data=2, **_BWD),
        Group("logits", ("jaxce",), (200,), 1000, n_devices=4, data=2, **_BWD),
        Group("linear", ("jaxce:objective_grpo", "jaxce:grpo", "jax_plain:grpo"), (200,), 1000,
              32, **_BWD),
        Group("logits", ("jaxce:objective",), (200,), 1000, **_BWD),
        Group("logits", ("jaxce:keep", "jaxce:kept_ids"), (200,), 1000, **_BWD),
        Group("linear", ("jaxce:keep", "jaxce:kept_ids"), (200,), 1000, 32, **_BWD),
    ],
    # One GPU: the headline numbers (V = 151936, bf16; D = 4096 on the fused path).
    "gpu": _gpu_groups(_GPU_T),
    "gpu-variants": _gpu_variant_groups(_GPU_T),
    # One GPU, long batches (run with --fresh: one process per row, torch rows included):
    # the fused path's memory-bounded methods only, T-major (every method at 262144 first).
    "gpu-large": [
        Group("linear", ("jaxce", "liger_flsce", "jaxce:objective_grpo", "liger_grpo",
                         "jaxce:objective", "tokamax:chunked_xla"), (T,), _GPU_V, _GPU_D,
              **_BWD) for T in _LARGE_T],
    # All visible GPUs, vocabulary split: jaxce's shard_map vs plain JAX under jit, and the
    # one-device figures at T = 32768 on the same machine to compare with (issue 24).
    "gpu-sharded": [
        Group("logits", ("jaxce", "jax_plain"), _SHARDED_T, _GPU_V, n_devices=0),
        Group("logits", ("jaxce:inplace",), _SHARDED_T, _GPU_V, n_devices=0, **_BWD),
        Group("linear", ("jaxce",), _SHARDED_T, _GPU_V, _GPU_D, n_devices=0),
        # plain JAX's fused fwd_bwd at T = 131072 (77 GiB of logits a GPU) did not finish
        # within 5 minutes on two H200s (bench/NOTES.md): its forward only there.
        Group("linear", ("jax_plain",), (32768,), _GPU_V, _GPU_D, n_devices=0),
        Group("linear", ("jax_plain",), (131072,), _GPU_V, _GPU_D, n_devices=0,
              modes=("fwd",)),
        # XLA's statistics inside shard_map (the default there before issue 24); the fused
        # backward's d hidden summed in bf16, and smaller token chunks (memory levers).
        Group("logits", ("jaxce:xla",), (32768,), _GPU_V, n_devices=0, **_BWD),
        Group("linear", ("jaxce:xla",), (32768,), _GPU_V, _GPU_D, n_devices=0, **_BWD),
        Group("linear", ("jaxce:hidden_grad_output",), (32768,), _GPU_V, _GPU_D, n_devices=0,
              chunk_sizes=(None, 4096), **_BWD),
        Group("linear", ("jaxce",), (32768,), _GPU_V, _GPU_D, n_devices=0,
              chunk_sizes=(4096,), **_BWD),
        # The best one-GPU paths (plain calls) on the same machine.
        Group("logits", ("jaxce", "jax_plain"), (32768,), _GPU_V, **_BWD),
        Group("linear", ("jaxce", "jax_plain"), (32768,), _GPU_V, _GPU_D, **_BWD),
    ],
    # 1, 2 and 4 GPUs of one host at Qwen3's vocabulary (README's sharded table).
    "gpu-shards": _shard_count_groups(),
    # 4 GPUs: Qwen3.5's vocabulary, T = 262144 and the 2 × 2 data × vocab mesh.
    "gpu-shards-more": _more_shard_groups(),
    "objective": _objective_groups(_GPU_T),
    # One GPU: the shape sweep behind README's headline (run with --resume across calls).
    "shapes": _shape_groups(),
    "objective-cpu": [
        Group("linear", ("jaxce:objective_grpo", "jaxce:grpo", "jax_plain:grpo",
                         "jaxce:objective"), (2048,), 16384, 64, **_BWD),
        Group("logits", ("jaxce:objective_grpo", "jaxce:grpo", "jax_plain:grpo",
                         "jaxce:objective"), (2048,), 16384, **_BWD),
    ],
    # Chunk-size sweeps for jaxce (issue 5, target 6: the default within 5 % of the best).
    "sweep": [
        Group("logits", ("jaxce",), (32768,), _GPU_V,
              chunk_sizes=(None, 128, 256, 512, 1024, 2048, 4096), **_BWD),
        Group("linear", ("jaxce",), (32768,), _GPU_V, _GPU_D,
              chunk_sizes=(None, 512, 1024, 2048, 4096, 8192, 16384), **_BWD),
    ],
    "sweep-cpu": [
        Group("logits", ("jaxce",), (4096,), 32768,
              chunk_sizes=(None, 64, 128, 256, 512, 1024, 4096), **_BWD),
        Group("linear", ("jaxce",), (4096,), 32768, 128,
              chunk_sizes=(None, 256, 512, 1024, 2048, 4096), **_BWD),
    ],
}
DEFAULT_SUITE = "cpu"
# The suites whose rows have a results file of their own (bench/results/<device>-<name>.json):
# a run of one of them alone writes there by default, not into the device's main file.
RESULTS_NAMES = {"shapes": "shapes", "gpu-shards": "shards", "gpu-shards-more": "shards_more"}


def expand(groups: Sequence[Group], *, impls=None, inputs=None, modes=None, Ts=None, V=None,
           D=None, dtype=None, chunk_sizes=None, repeats=5) -> list[Config]:
  """The configs of a suite, with command-line overrides and filters applied.

  Args:
    groups: the suite.
    impls: keep only these ``impl`` or ``impl:variant`` names (``None``: all).
    inputs, modes: keep only these input paths / modes.
    Ts, V, D, dtype, chunk_sizes: replace the suite's values.
    repeats: timed calls per config.

  Returns:
    Valid configs, ordered by group, mode, impl, chunk size, then ascending T.
  """
  out, seen = [], set()
  for g in groups:
    if inputs and g.input not in inputs:
      continue
    for mode in g.modes:
      if modes and mode not in modes:
        continue
      for spec in g.impls:
        impl, variant = _spec(spec)
        name = impl if variant == "default" else spec
        if impls and impl not in impls and name not in impls and f"{impl}:{variant}" not in impls:
          continue
        for chunk in (chunk_sizes if chunk_sizes is not None else g.chunk_sizes):
          for T in sorted(Ts or g.Ts):
            c = Config(impl=impl, input=g.input, mode=mode, T=T, V=V or g.V,
                       D=(D or g.D) if g.input == "linear" else None, dtype=dtype or g.dtype,
                       chunk_size=chunk if impl in CHUNKED_IMPLS else None,
                       n_devices=g.n_devices, variant=variant, repeats=repeats,
                       data=g.data)
            if c.invalid() is None and row_key(c) not in seen:
              seen.add(row_key(c))
              out.append(c)
  return out
