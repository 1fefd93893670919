"""The Mosaic GPU kernels lowered for CUDA on this machine, at the vocabulary widths a
device holds when real vocabularies are split over GPUs: lowering builds every TMA copy
and refuses one the hardware cannot make (an array whose rows are not tiled as the
tile's swizzle, a row block that is not 16-byte aligned), which the interpreter does not
check. The public calls as a user's ``jit`` traces them (fwd+bwd), planned for a Hopper
GPU, ragged token counts (T % 4 != 0: the merge kernel's padded rows); inside
``shard_map`` too. What the kernels compute is tested in the interpreter
(``test_mosaic_linear.py``, ``test_mosaic_rows.py``) and on the GPU (the tally)."""

import re

import jax
import jax.numpy as jnp
import pytest
from jax.experimental.pallas import mosaic_gpu as plgpu
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from helpers import devices, jaxce
from jaxce import plan
from jaxce._kernels.mosaic import head as mosaic_head, tile as mosaic_tile

if not hasattr(plgpu, "InterpretGPUParams"):
  pytest.skip(f"lowering the Mosaic GPU kernels needs JAX >= 0.11 (this is {jax.__version__});"
              " .ci/run runs these tests on Python 3.12", allow_module_level=True)

HOPPER = plan.Target("gpu", "9.0", 132)
S = jax.ShapeDtypeStruct
TOKENS, DEPTH = 1001, 256
# Qwen3's 151936 over 2, 4, 8 GPUs; DeepSeek-V3's 129280 over 8 (a 32-byte swizzle).
WIDTHS = (75968, 37984, 18992, 16160)


def _fused(h, w, labels, g, **kw):
  def loss(h, w):
    logp, entropy = jaxce.linear_logprobs_and_entropy(h, w, labels, **kw)
    return jnp.sum(logp * g + 0.1 * entropy)
  return jax.grad(loss, (0, 1))(h, w)


def _objective(h, w, labels, g, **kw):
  objective = lambda logp, entropy, a: a * logp + 0.01 * entropy
  return jax.grad(lambda h, w: jaxce.linear_token_loss(objective, h, w, labels, g, **kw)[0],
                  (0, 1))(h, w)


def _logits(x, labels, g, **kw):
  loss = lambda x: jnp.sum(jaxce.logprobs_and_entropy(x, labels, **kw)[0] * g)
  return jax.grad(loss)(x)


def _over_shards(call, mesh, **kwargs):
  """``call`` (``_fused`` or ``_objective``) with ``kwargs`` inside ``shard_map`` over
  ``mesh``'s axis ``"v"``: hidden states, labels and ``g`` replicated, the weight's columns
  split; ``d hidden`` replicated, ``d W`` split like the weight."""
  return jax.shard_map(lambda h, w, labels, g: call(h, w, labels, g, vocab_axis="v", **kwargs),
                       mesh=mesh, in_specs=(P(), P(None, "v"), P(), P()),
                       out_specs=(P(), P(None, "v")))


def _cuda_program(f, *args):
  """The StableHLO of ``jax.jit(f)`` traced at ``args`` and lowered for CUDA."""
  return jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def _kernel_calls(text):
  """The Mosaic GPU kernel calls in a program's text (its custom calls: the name also
  occurs in their serialized modules)."""
  return len(re.findall(r"custom_call @mosaic_gpu", text))


def _lowered_kernels(f, *args):
  """The number of Mosaic GPU kernel calls in ``f``'s program lowered for CUDA."""
  return _kernel_calls(_cuda_program(f, *args))


@pytest.mark.parametrize("columns", [151643, 50257])
def test_unpadded_widths_lower_for_cuda_with_no_matmul_over_odd_rows(columns, monkeypatch):
  """Unpadded vocabularies (Qwen's 151643 tokens, GPT-2's 50257; odd widths, whose rows TMA
  cannot read: a ``[D, V]`` weight's in whole swizzles, a ``[V, D]`` one's in tiles of 8
  rows) run the fused head's kernels in both layouts, fwd+bwd, read in blocks copied
  out, the last one zero-padded to whole tiles; and the objective path's, its terms and
  ``d`` ``mosaic_head.exp_width`` columns wide. No XLA matmul takes an operand or makes a
  result with the odd width as a dimension: on an H200 such matmuls ran the objective
  path 2.6x slower per column than 151680 columns (bench/NOTES.md, entry 58)."""
  monkeypatch.setattr(plan, "target", lambda *a, mesh=None: HOPPER)
  hidden, labels = S((TOKENS, DEPTH), jnp.bfloat16), S((TOKENS,), jnp.int32)
  g = S((TOKENS,), jnp.float32)
  odd = re.compile(rf"tensor<([0-9]+x)*{columns}x")
  for path in (_fused, _objective):
    for layout, shape in (("dv", (DEPTH, columns)), ("vd", (columns, DEPTH))):
      call = lambda *a: path(*a, weight_layout=layout)  # pylint: disable=cell-var-from-loop
      text = _cuda_program(call, hidden, S(shape, jnp.bfloat16), labels, g)
      assert _kernel_calls(text), (path.__name__, layout)
      matmuls = [line for line in text.splitlines() if "stablehlo.dot_general" in line]
      assert matmuls and not [line for line in matmuls if odd.search(line)], (
          path.__name__, layout, [line for line in matmuls if odd.search(line)][:2])


def _forward_program(path, columns):
  """The StableHLO, lowered for CUDA, of the ``"fused"`` path's forward or the
  ``"objective"`` path's value and gradients at ``TOKENS`` tokens, D = 4096 and a ``[D,
  columns]`` bf16 weight (the caller has planned for Hopper)."""
  hidden, labels = S((TOKENS, 4096), jnp.bfloat16), S((TOKENS,), jnp.int32)
  weight = S((4096, columns), jnp.bfloat16)
  if path == "fused":
    call = lambda h, w, l: jaxce.linear_logprobs_and_entropy(h, w, l)
  else:
    call = lambda h, w, l: _objective(h, w, l, jnp.ones(l.shape, jnp.float32))
  return _cuda_program(call, hidden, weight, labels)


@pytest.mark.parametrize("path", ["fused", "objective"])
def test_the_forward_blocks_are_unrolled_and_their_kernel_lowered_once_a_width(path,
                                                                               monkeypatch):
  """A ``[D, V]`` weight of 37984 columns (Qwen3 over 4 GPUs: 2 of the vocabulary's
  segments of 18992, whose rows TMA reads in place only at a 32-byte swizzle) goes through
  the fused forward in ``column_blocks``' vocab blocks copied out (both segments' whole
  tiles side by side) and a call over the columns left: a call a block, not a loop, whose
  steps left the GPU idle between the calls (0.4 ms in 7.6 at 18992 columns on an H200),
  the kernel lowered once a block width. The objective path's forward too, its blocks
  writing their ``exp`` terms into one uninitialized ``[C, 2, 18992]`` array (no
  concatenation of them)."""
  monkeypatch.setattr(plan, "target", lambda *a, mesh=None: HOPPER)
  text = _forward_program(path, 37984)
  blocks = mosaic_head.column_blocks(2 * (18992 // 128), depth=4096, dtype=jnp.bfloat16,
                                     num_rows=mosaic_head.padded_rows(TOKENS),
                                     num_cores=HOPPER.num_cores)
  assert len(blocks) > 2 and len(set(blocks)) == 2, blocks  # (the test's premise)
  functions = re.findall(r"func.func private @(vocab_block[_0-9]*)\(", text)
  assert len(functions) == 3, functions  # (2 block widths, the columns left)
  assert sum(text.count(f"call @{name}(") for name in functions) == len(blocks) + 1
  lines = text.splitlines()
  assert not [line for line in lines if "stablehlo.while" in line
              and any(f"4096x{tiles * 128}xbf16" in line for tiles in blocks)]
  assert not [line for line in lines if "stablehlo.concatenate" in line and "x37984x" in line]
  if path == "objective":
    assert [line for line in lines if "@AllocateBuffer" in line and "x2x18992xbf16" in line]


@pytest.mark.parametrize("path", ["fused", "objective"])
def test_the_segments_columns_left_are_read_in_one_call(path, monkeypatch):
  """Over segments whose last tiles are partial (2, 4 and 8 of 18992 at 37984, 75968 and
  151936 columns; 4 of 8016 at 32064), the columns each segment leaves after the vocab
  blocks are read in one kernel call, as a lone segment's (18992) are: a call a segment
  read all of hidden again for a tile's columns (8 of them cost 3 % of the forward's time
  at 151936 columns on an H200). The program calls the kernels once a vocab block and once
  more at every count."""
  monkeypatch.setattr(plan, "target", lambda *a, mesh=None: HOPPER)
  for columns in (18992, 37984, 75968, 151936, 32064):
    layout = mosaic_tile.segments(columns)
    blocks = mosaic_head.column_blocks(
        layout.count * (layout.width // 128), depth=4096, dtype=jnp.bfloat16,
        num_rows=mosaic_head.padded_rows(TOKENS), num_cores=HOPPER.num_cores)
    calls = re.findall(r"call @vocab_block[_0-9]*\(", _forward_program(path, columns))
    assert len(calls) == len(blocks) + 1, (columns, blocks, len(calls))


@pytest.mark.parametrize("path", ["fused", "objective"])
@pytest.mark.parametrize("columns", [37984, 75968, 151643])
def test_the_forward_calls_write_their_statistics_into_one_array(path, columns, monkeypatch):
  """Where the forward takes several kernel calls over a weight (vocab blocks copied out
  at 37984 and 151643 columns; the whole tiles in place, then the columns left, at
  75968), each writes its tiles' f32 ``[tiles, 4, C]`` statistics in place into one
  array: no concatenation of them follows (on an H200 it took 47 of the forward's 1052 us
  at T = 8184, D = 1024, 37984 columns, and held the statistics twice)."""
  monkeypatch.setattr(plan, "target", lambda *a, mesh=None: HOPPER)
  text = _forward_program(path, columns)
  assert _kernel_calls(text) >= 2
  statistics = re.compile(r"-> tensor<[0-9]+x4x[0-9]+xf32>")
  concatenated = [line for line in text.splitlines()
                  if "stablehlo.concatenate" in line and statistics.search(line)]
  assert not concatenated, concatenated[:2]


@pytest.mark.parametrize("columns", WIDTHS)
def test_every_path_lowers_for_cuda(columns, monkeypatch):
  monkeypatch.setattr(plan, "target", lambda *a, mesh=None: HOPPER)
  hidden, weight = S((TOKENS, DEPTH), jnp.bfloat16), S((DEPTH, columns), jnp.bfloat16)
  labels, g = S((TOKENS,), jnp.int32), S((TOKENS,), jnp.float32)
  logits = S((TOKENS, columns), jnp.bfloat16)
  keep = S((TOKENS, -(-columns // 32)), jnp.uint32)
  assert _lowered_kernels(_fused, hidden, weight, labels, g)
  assert _lowered_kernels(lambda *a: _fused(*a, weight_layout="vd"), hidden,
                          S((columns, DEPTH), jnp.bfloat16), labels, g)
  assert _lowered_kernels(_objective, hidden, weight, labels, g)
  assert _lowered_kernels(lambda x, l, g, k: _logits(x, l, g, keep=k), logits, labels, g, keep)
  whole_rows = S((1000, columns), jnp.bfloat16)  # (in place: rows a multiple of 8)
  assert _lowered_kernels(lambda *a: _logits(*a, backward_in_place=True), whole_rows,
                          S((1000,), jnp.int32), S((1000,), jnp.float32))


@pytest.mark.parametrize("columns,dtype", [(151643, jnp.bfloat16), (50257, jnp.float32),
                                           (1000, jnp.bfloat16)])
def test_the_logits_paths_lower_for_cuda_at_widths_tma_cannot_tile(columns, dtype,
                                                                   monkeypatch):
  """Rows that are not a multiple of 32 bytes (odd widths; 1000 bf16 columns, 16 bytes
  short): the logits paths' statistics kernel loads them itself, a column a load
  (``mosaic_rows.direct_columns``; JAX 0.12's layout inference takes no other layout
  there), with kept sets, in place (the gradient by XLA's pass) and at a ragged ``T``."""
  monkeypatch.setattr(plan, "target", lambda *a, mesh=None: HOPPER)
  labels, g = S((TOKENS,), jnp.int32), S((TOKENS,), jnp.float32)
  logits = S((TOKENS, columns), dtype)
  keep = S((TOKENS, -(-columns // 32)), jnp.uint32)
  objective = lambda logp, entropy, a: a * logp + 0.01 * entropy
  token_loss = lambda x, l, a: jax.grad(
      lambda x: jaxce.token_loss(objective, x, l, a)[0])(x)
  assert _lowered_kernels(lambda x, l, g, k: _logits(x, l, g, keep=k), logits, labels, g, keep)
  assert _lowered_kernels(lambda *a: _logits(*a, backward_in_place=True), logits, labels, g)
  assert _lowered_kernels(token_loss, logits, labels, g)


def test_a_shard_of_a_sharded_call_lowers_for_cuda(monkeypatch):
  """Qwen3's 151936 columns over 4 devices inside ``shard_map``: each shard's 37984."""
  monkeypatch.setattr(plan, "target", lambda *a, mesh=None: HOPPER)
  mesh = Mesh(devices(4), ("v",))
  labels, g = S((TOKENS,), jnp.int32), S((TOKENS,), jnp.float32)
  weight = S((DEPTH, 151936), jnp.bfloat16, sharding=NamedSharding(mesh, P(None, "v")))
  assert _lowered_kernels(_over_shards(_fused, mesh), S((TOKENS, DEPTH), jnp.bfloat16),
                          weight, labels, g)


@pytest.mark.parametrize("path", ["fused", "logits"])
def test_the_kernel_forward_over_shards_gathers_once_and_reduces_nothing(path, monkeypatch):
  """Qwen3's 151936 columns over 2 devices: the kernels' forward (the fused and the logits
  paths, a user's ``jit`` of the public call in ``shard_map``) combines the shards with
  one all-gather of the shards' partial sums, whose result is typed invariant over the
  vocabulary's axis: no all-reduce follows the merge (a ``pmax`` of its equal outputs
  once cost each call 3 small collectives, a share of the 0.3 ms a call that kept the
  logits path at 0.557x of one GPU on 2 H200s)."""
  monkeypatch.setattr(plan, "target", lambda *a, mesh=None: HOPPER)
  mesh = Mesh(devices(2), ("v",))
  labels = S((TOKENS,), jnp.int32)
  if path == "fused":
    call = lambda x, w, labels: jaxce.linear_logprobs_and_entropy(x, w, labels, vocab_axis="v")
    specs, args = (P(), P(None, "v"), P()), (S((TOKENS, DEPTH), jnp.bfloat16),
                                             S((DEPTH, 151936), jnp.bfloat16))
  else:
    call = lambda x, labels: jaxce.logprobs_and_entropy(x, labels, vocab_axis="v")
    specs, args = (P(None, "v"), P()), (S((TOKENS, 151936), jnp.bfloat16),)
  sharded = jax.shard_map(call, mesh=mesh, in_specs=specs, out_specs=(P(), P()))
  text = _cuda_program(sharded, *args, labels)
  assert "mosaic_gpu" in text
  assert text.count("stablehlo.all_gather") == 1
  assert "stablehlo.all_reduce" not in text


@pytest.mark.parametrize("sharded", [False, True], ids=["local", "shard_map"])
@pytest.mark.parametrize("path", ["fused", "objective"])
def test_each_block_copy_waits_for_the_call_before(path, sharded, monkeypatch):
  """Qwen3's 151936 columns over 2 devices (inside ``shard_map``), and a local call at a
  shard's 75968 columns: the forward's vocab blocks are copied out of the weight one at a
  time, each from an optimization barrier that joins the weight with the statistics the
  call before wrote, and the next call writes into the statistics that come out of it
  (so XLA keeps both operands of the barrier). XLA's schedule otherwise made every
  block's copy before the first call, all alive at once: over several devices (2 H200s,
  T = 32768, D = 4096: 9 copies, 0.58 GiB), and on one GPU in the fused fwd+bwd (151936
  columns, T = 16192: 17 copies, 1.1 GiB), where a barrier on a token that nothing else
  read had been dropped."""
  monkeypatch.setattr(plan, "target", lambda *a, mesh=None: HOPPER)
  if sharded:
    mesh = Mesh(devices(2), ("v",))
    hidden, labels = S((TOKENS, 4096), jnp.bfloat16), S((TOKENS,), jnp.int32)
    if path == "fused":
      call = lambda h, w, l: jaxce.linear_logprobs_and_entropy(h, w, l, vocab_axis="v")
      out_specs = (P(), P())
    else:
      call = lambda h, w, l: _objective(h, w, l, jnp.ones(l.shape, jnp.float32),
                                        vocab_axis="v")
      out_specs = (P(), P(None, "v"))
    program = jax.shard_map(call, mesh=mesh, in_specs=(P(), P(None, "v"), P()),
                            out_specs=out_specs)
    text = _cuda_program(program, hidden, S((4096, 151936), jnp.bfloat16), labels)
  else:
    text = _forward_program(path, 75968)
  calls, barriers = [], []
  for line in text.splitlines():
    call = re.match(r"\s*(%[0-9]+)(?::[0-9]+)? = (?:func\.)?call @vocab_block[_0-9]*\(([^)]*)\)",
                    line)
    if call:
      calls.append((call.group(1), call.group(2).split(", ")))
    barrier = re.match(r"\s*(%[0-9]+):2 = stablehlo.optimization_barrier (\S+), (\S+) : "
                       r"tensor<4096x75968xbf16>", line)
    if barrier:
      barriers.append(barrier.groups())
  assert len(calls) > 3 and len(barriers) == len(calls) - 1, (len(calls), len(barriers))
  weight = None
  for (before, _), (barrier, held, written), (_, operands) in zip(calls, barriers, calls[1:]):
    assert written.split("#")[0] == before, (before, written)  # the call before's statistics
    assert operands[3] == f"{barrier}#1", (barrier, operands)  # the next call writes there
    assert weight is None or held == weight, (held, weight)  # the barriers in a chain
    assert re.search(rf"stablehlo.slice {barrier}#0 ", text), barrier  # its block's copy
    weight = f"{barrier}#0"


@pytest.mark.parametrize("path", ["fused", "objective"])
def test_shards_of_whole_tile_segments_are_read_in_place(path, monkeypatch):
  """Qwen3.5's 248320 columns over 2 devices inside ``shard_map``: each shard's 124160
  columns are 2 of the vocabulary's 4 segments of whole tiles, read where they lie in one
  call, with no vocab block copied out, although 124160 columns on one device are 8
  segments of 15520 (the forward once took the shard for those, and on a GPU made a
  kernel call over no columns after its blocks)."""
  monkeypatch.setattr(plan, "target", lambda *a, mesh=None: HOPPER)
  mesh = Mesh(devices(2), ("v",))
  sharded = _over_shards(_fused if path == "fused" else _objective, mesh)
  weight = S((DEPTH, 248320), jnp.bfloat16, sharding=NamedSharding(mesh, P(None, "v")))
  args = (S((TOKENS, DEPTH), jnp.bfloat16), weight, S((TOKENS,), jnp.int32),
          S((TOKENS,), jnp.float32))
  text = _cuda_program(sharded, *args)
  assert "mosaic_gpu" in text
  assert "vocab_block" not in text
  assert not re.search(rf"stablehlo.pad .*-> tensor<{DEPTH}x[0-9]+xbf16>", text)


def _unread_barrier_results(text):
  """The results of ``text``'s optimization barriers that nothing after them in their
  region reads, unless the same operand passes the barrier as a result that is read (XLA
  drops an unread result's operand from the barrier, and with it the order the barrier
  was there to keep)."""
  lines, unread = [re.sub(r'"[^"]*"', '""', line) for line in text.splitlines()], []
  for i, line in enumerate(lines):
    barrier = re.match(r"\s*(%[0-9A-Za-z_]+)(?::([0-9]+))? = stablehlo.optimization_barrier "
                       r"([^:]*) :", line)
    if not barrier:
      continue
    name, count = barrier.group(1), int(barrier.group(2) or 1)
    operands = barrier.group(3).split(", ")
    results = [f"{name}#{k}" for k in range(count)] if count > 1 else [name]
    later, depth = [], 0
    for following in lines[i + 1:]:  # up to the end of the barrier's region
      end = next((k for k, c in enumerate(following)
                  if (depth := depth + (c == "{") - (c == "}")) < 0), None)
      later.append(following if end is None else following[:end])
      if end is not None:
        break
    rest = "\n".join(later)
    read = {operand for operand, result in zip(operands, results)
            if re.search(rf"{re.escape(result)}(?![0-9#])", rest)}
    unread += [(result, operand) for operand, result in zip(operands, results)
               if operand not in read]
  return unread


# The fused backward with token chunks outer and its vocab blocks unrolled (as at
# T = 65536 on a shard of 18992 columns); both paths' forwards at a shard's width whose
# vocab blocks are copied out of the weight one at a time.
BARRIERS = [pytest.param("fused", DEPTH, 768, dict(chunk_size=256, vocab_block_size=128),
                         id="fused-token-outer"),
            pytest.param("fused", 4096, 75968, {}, id="fused-75968"),
            pytest.param("objective", 4096, 75968, {}, id="objective-75968")]


@pytest.mark.parametrize("sharded", [False, True], ids=["local", "shard_map"])
@pytest.mark.parametrize("path,depth,columns,kwargs", BARRIERS)
def test_every_barrier_result_is_read(path, depth, columns, kwargs, sharded, monkeypatch):
  """fwd+bwd lowered for CUDA, on one device and over 2 inside ``shard_map`` (``columns``
  on each): every result of every optimization barrier is read. The fused backward's
  first unrolled block once sliced its columns from a barrier whose other result (the
  chunk's rows) nothing read, so XLA could drop the rows from it and hoist the first
  block's columns out of the chunk loop, a copy held for the whole backward."""
  monkeypatch.setattr(plan, "target", lambda *a, mesh=None: HOPPER)
  call = _fused if path == "fused" else _objective
  num_shards = 2 if sharded else 1
  args = (S((TOKENS, depth), jnp.bfloat16), S((depth, num_shards * columns), jnp.bfloat16),
          S((TOKENS,), jnp.int32), S((TOKENS,), jnp.float32))
  if kwargs:  # (the plan a shard runs)
    chosen = plan.of(lambda h, w, l: jaxce.linear_logprobs_and_entropy(h, w, l, **kwargs),
                     args[0], S((depth, columns), jnp.bfloat16), args[2])
    assert chosen.backward_order == "token" and chosen.unrolled_blocks, chosen
  if sharded:
    program = _over_shards(call, Mesh(devices(2), ("v",)), **kwargs)
  else:
    program = lambda h, w, l, g: call(h, w, l, g, **kwargs)
  text = _cuda_program(program, *args)
  assert _kernel_calls(text) and text.count("stablehlo.optimization_barrier") > 3
  assert not _unread_barrier_results(text)
