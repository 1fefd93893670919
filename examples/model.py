"""A small Flax NNX causal language model: the policy of the GRPO example.

Token + learned position embeddings, ``num_layers`` pre-norm blocks (causal multi-head
attention, GELU MLP), a final RMSNorm and an untied LM head ``nnx.Linear(D, V)`` whose
``[D, V]`` kernel is what jaxce's fused path takes as ``weight``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Sizes and dtypes of :class:`CausalLM`.

  Attributes:
    vocab_size: V, the LM head's columns.
    d_model: D, the hidden width (divisible by ``num_heads``).
    num_layers: transformer blocks.
    num_heads: attention heads.
    max_len: longest sequence (positions are learned).
    dtype: activations and matmul inputs (e.g. ``jnp.bfloat16`` on GPU).
    param_dtype: stored parameters (the optimizer's master copy).
    attention: ``jax.nn.dot_product_attention``'s ``implementation``: ``"xla"`` (its
      default; materializes the ``[B, heads, S, S]`` scores) or ``"cudnn"`` (cuDNN's
      flash attention: NVIDIA GPUs, bf16 or f16 activations).
  """
  vocab_size: int = 32768
  d_model: int = 64
  num_layers: int = 2
  num_heads: int = 4
  max_len: int = 64
  dtype: Any = jnp.float32
  param_dtype: Any = jnp.float32
  attention: str = "xla"


class Block(nnx.Module):
  """Pre-norm transformer block: ``x + attn(norm(x))``, then ``x + mlp(norm(x))``."""

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    d = cfg.d_model
    kw = dict(dtype=cfg.dtype, param_dtype=cfg.param_dtype, rngs=rngs)
    self.num_heads = cfg.num_heads
    self.attention = cfg.attention
    self.attn_norm = nnx.RMSNorm(d, **kw)
    self.qkv = nnx.Linear(d, 3 * d, use_bias=False, **kw)
    self.attn_out = nnx.Linear(d, d, use_bias=False, **kw)
    self.mlp_norm = nnx.RMSNorm(d, **kw)
    self.mlp_in = nnx.Linear(d, 4 * d, use_bias=False, **kw)
    self.mlp_out = nnx.Linear(4 * d, d, use_bias=False, **kw)

  def __call__(self, x):
    """``x [B, S, D]`` -> ``[B, S, D]``; causal, so right padding never reaches a real token."""
    b, s, d = x.shape
    qkv = self.qkv(self.attn_norm(x)).reshape(b, s, 3, self.num_heads, d // self.num_heads)
    y = jax.nn.dot_product_attention(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], is_causal=True,
                                     implementation=self.attention)
    x = x + self.attn_out(y.reshape(b, s, d))
    return x + self.mlp_out(jax.nn.gelu(self.mlp_in(self.mlp_norm(x))))


class CausalLM(nnx.Module):
  """Decoder-only LM. ``hidden_states`` stops before the LM head, for jaxce's fused path."""

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    kw = dict(dtype=cfg.dtype, param_dtype=cfg.param_dtype, rngs=rngs)
    self.embed = nnx.Embed(cfg.vocab_size, cfg.d_model, **kw)
    self.positions = nnx.Embed(cfg.max_len, cfg.d_model, **kw)
    self.blocks = nnx.Sequential(*(Block(cfg, rngs=rngs) for _ in range(cfg.num_layers)))
    self.final_norm = nnx.RMSNorm(cfg.d_model, **kw)
    self.lm_head = nnx.Linear(cfg.d_model, cfg.vocab_size, use_bias=False, **kw)

  def hidden_states(self, tokens):
    """``tokens`` int ``[B, S]`` -> final hidden states ``[B, S, D]`` in ``cfg.dtype``."""
    x = self.embed(tokens) + self.positions(jnp.arange(tokens.shape[-1]))
    return self.final_norm(self.blocks(x))

  def __call__(self, tokens):
    """``tokens [B, S]`` -> logits ``[B, S, V]``: materializes ``B*S*V`` values."""
    return self.lm_head(self.hidden_states(tokens))


def init(cfg: ModelConfig, seed: int):
  """``(graphdef, params)``: the model split into its static graph and its ``nnx.Param`` state.

  Every process that calls this with the same ``seed`` gets the same values.
  """
  return nnx.split(CausalLM(cfg, rngs=nnx.Rngs(seed)), nnx.Param)


def abstract_graphdef(cfg: ModelConfig):
  """The graph definition alone, with no parameter computed (e.g. for another dtype)."""
  return nnx.split(nnx.eval_shape(lambda: CausalLM(cfg, rngs=nnx.Rngs(0))), nnx.Param)[0]


def lm_head_kernel(model: CausalLM):
  """The ``[D, V]`` LM head kernel in the head's compute dtype, as ``model.lm_head`` casts
  it before its matmul (bf16 matmuls over f32 parameters; the gradient reaches the f32
  parameter through the cast). A tied model would return ``embedding.T``."""
  head = model.lm_head
  kernel = head.kernel[...]
  return kernel if head.dtype is None else kernel.astype(head.dtype)
