"""``batch_invariant=True``: each token's ``logp`` and ``entropy`` are the same bits (raw
bits compared, not allclose) whatever the call around it, on the logits, fused and
objective paths: the number of tokens (1, 7, 1000, 4096) and the token's position and
neighbours; ``chunk_size`` and ``vocab_block_size``; the vocabulary over 1, 2, 4 and 8
simulated devices (``sharded_*``, inside ``shard_map``, explicitly split arrays; 216
columns, 27 per device at 8, none a multiple of the CPU matmul tile's 128, the last 5
padding); forward only or inside ``value_and_grad``; the objective path the same bits as
the per-token path. Per-token temperature, softcap, ignored neighbours, kept sets. The
option is needed (without it some of these differ), stays as exact as the default vs
float64, its gradients are right, and a NaN row stays contained."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from helpers import adversarial_logits, assert_close, devices, jaxce, reference

V, VOCAB, D = 216, 211, 24
PROBES = 5
SOFTCAP = 30.0


def _rows(seed, tokens):
  """``tokens`` rows of every per-token input: bf16 logits (peaked, shifted), bf16 hidden
  states whose logits spread like them, labels, temperatures, where, advantages."""
  rng = np.random.default_rng(seed)
  return dict(logits=adversarial_logits(rng, (tokens, V), scale=3.0, offset=-12.0, peak=12.0),
              hidden=rng.normal(size=(tokens, D)) * 1.5,
              labels=rng.integers(0, VOCAB, tokens), temperature=rng.uniform(0.6, 1.4, tokens),
              where=rng.random(tokens) < 0.8, adv=rng.normal(size=tokens))


PROBE = _rows(0, PROBES)
PROBE["where"][:] = True
WEIGHT = jnp.asarray(np.random.default_rng(1).normal(size=(D, V)) * 0.8, jnp.bfloat16)


def _batch(tokens, positions, seed=2):
  """``tokens`` rows: random neighbours with the probes at ``positions``."""
  rows = _rows(seed, tokens)
  for name, value in rows.items():
    value[positions] = PROBE[name]
  return rows


def _call(path, rows, invariant=True, differentiate=False, **kw):
  """``(logp, entropy)`` of every row by ``path``; inside ``jit(value_and_grad)`` when
  ``differentiate``."""
  x = jnp.asarray(rows["logits"], jnp.bfloat16)
  h = jnp.asarray(rows["hidden"], jnp.bfloat16)
  common = dict(temperature=rows["temperature"], where=rows["where"], vocab_size=VOCAB,
                batch_invariant=invariant, **kw)
  fused = dict(common, logit_softcap=SOFTCAP)
  objective = lambda logp, entropy, adv: -adv * logp - 0.01 * entropy
  labels, adv = rows["labels"], rows["adv"]
  if path == "logits":
    fn = lambda x, w: jaxce.logprobs_and_entropy(x, labels, **common)
  elif path == "fused":
    fn = lambda x, w: jaxce.linear_logprobs_and_entropy(h, w, labels, **fused)
  elif path == "token_loss":
    fn = lambda x, w: jaxce.token_loss(objective, x, labels, adv, **common)
  else:
    fn = lambda x, w: jaxce.linear_token_loss(objective, h, w, labels, adv, **fused)
  objective_path = path in ("token_loss", "linear_token_loss")
  if not differentiate:
    out = fn(x, WEIGHT)
    return out[1] if objective_path else out

  def loss(x, w):
    out = fn(x, w)
    if objective_path:
      return out[0], out[1]
    return jnp.sum(out[0] * rows["adv"]) + jnp.sum(out[1]), out

  (_, out), _ = jax.jit(jax.value_and_grad(loss, (0, 1), has_aux=True))(x, WEIGHT)
  return out


def _bits(out, positions):
  return tuple(np.asarray(a)[positions].view(np.uint32) for a in out)


def _same(got, want, what):
  for name, g, w in zip(("logp", "entropy"), got, want):
    assert np.array_equal(g, w), (
        f"{what}: {name} differs at probes {np.nonzero(g != w)[0]}: "
        f"{g.view(np.float32)} vs {w.view(np.float32)}")


def _contexts(path, invariant=True, **options):
  """``(what, positions, call)``: the probes inside calls of every kind (``options``: more
  keywords for every call)."""
  out = []
  call_path = lambda rows, **kw: _call(path, rows, invariant=invariant, **options, **kw)
  for p in range(PROBES):
    out.append((f"probe {p} alone (T = 1)", [0],
                lambda p=p: call_path({k: v[p:p + 1] for k, v in PROBE.items()})))
  rng = np.random.default_rng(3)
  for tokens in (7, 1000, 4096):
    positions = rng.permutation(tokens)[:PROBES]
    if tokens == 4096:
      positions[0] = tokens - 1  # the last row (a clamped last chunk)
    out.append((f"T = {tokens}", positions, lambda t=tokens, q=positions: call_path(_batch(t, q))))
  positions = rng.permutation(1000)[:PROBES]
  chunks = [dict(chunk_size=c) for c in ((1, 64, 999) if path == "logits" else (3,))]
  if path == "fused":
    chunks += [dict(chunk_size=64, vocab_block_size=b) for b in (7, 100)]
  for kw in chunks:
    out.append((f"T = 1000, {kw}", positions,
                lambda kw=kw: call_path(_batch(1000, positions, seed=4), **kw)))
  out.append(("inside value_and_grad", positions,
              lambda: call_path(_batch(1000, positions, seed=5), differentiate=True)))
  return out


@pytest.mark.parametrize("path", ["logits", "fused", "token_loss", "linear_token_loss"])
def test_the_same_bits_in_every_call(path):
  """Every context gives the probes' bits of the per-token path's call on the probes
  alone (so the objective paths' outputs are the per-token path's bits too)."""
  per_token = "fused" if path.startswith("linear") or path == "fused" else "logits"
  want = _bits(_call(per_token, PROBE), slice(None))
  _same(_bits(_call(path, PROBE), slice(None)), want, f"{path} vs {per_token}")
  for k, (what, positions, call) in enumerate(_contexts(path)):
    expected = tuple(a[k:k + 1] for a in want) if k < PROBES else want  # (one probe alone)
    _same(_bits(call(), positions), expected, f"{path}, {what}")


@pytest.mark.parametrize("path", ["logits", "token_loss"])
def test_the_triton_kernels_hold_it_in_either_mode(path):
  """The logits paths' Triton kernels (interpreted off GPUs) are batch-invariant by
  construction, with or without the option: the probes' bits alone are their bits in
  every context, and the objective path's are the per-token path's."""
  for invariant in (True, False):
    want = _bits(_call("logits", PROBE, invariant, implementation="triton"), slice(None))
    contexts = _contexts(path, invariant, implementation="triton")
    contexts = [c for c in contexts if "chunk_size" not in c[0]]  # (no chunks: one pass)
    for k, (what, positions, call) in enumerate(contexts):
      expected = tuple(a[k:k + 1] for a in want) if k < PROBES else want
      _same(_bits(call(), positions), expected, f"{path}, {what}, option {invariant}")
    plan = jaxce.plan.of(lambda x: jaxce.logprobs_and_entropy(
        x, PROBE["labels"], batch_invariant=invariant, implementation="triton"),
        jnp.asarray(PROBE["logits"], jnp.bfloat16))
    assert plan.invariant_to == jaxce.plan.INVARIANCES[:4]


def _sharded_forms(path, shards, rows):
  """``(logp, entropy)`` of ``rows`` with the vocabulary over ``shards`` devices: by
  ``sharded_*``, inside ``shard_map`` and on explicitly split arrays."""
  mesh = Mesh(np.array(devices(shards)), ("v",))
  x = jnp.asarray(rows["logits"], jnp.bfloat16)
  h = jnp.asarray(rows["hidden"], jnp.bfloat16)
  labels = jnp.asarray(rows["labels"])
  kw = dict(temperature=rows["temperature"], where=rows["where"], vocab_size=VOCAB,
            batch_invariant=True, implementation="xla")
  if path == "logits":
    operands = (x,)
    local = lambda *a, **k: jaxce.logprobs_and_entropy(*a, labels, **kw, **k)
    sharded = lambda *a: jaxce.sharded_logprobs_and_entropy(*a, labels, mesh=mesh,
                                                            vocab_axis="v", **kw)
    specs = (P(None, "v"),)
  else:
    operands = (h, WEIGHT)
    kw.update(logit_softcap=SOFTCAP)
    local = lambda *a, **k: jaxce.linear_logprobs_and_entropy(*a, labels, **kw, **k)
    sharded = lambda *a: jaxce.sharded_linear_logprobs_and_entropy(*a, labels, mesh=mesh,
                                                                   vocab_axis="v", **kw)
    specs = (P(), P(None, "v"))
  inside = jax.shard_map(lambda *a: local(*a, vocab_axis="v"), mesh=mesh, in_specs=specs,
                         out_specs=(P(), P()))
  yield "sharded", sharded(*operands)
  yield "inside shard_map", inside(*operands)
  explicit = jax.make_mesh((shards,), ("v",), axis_types=(jax.sharding.AxisType.Explicit,),
                           devices=devices(shards))
  with jax.set_mesh(explicit):
    split = operands[:-1] + (jax.device_put(operands[-1], NamedSharding(explicit, specs[-1])),)
    yield "explicitly split", local(*split)


@pytest.mark.parametrize("path", ["logits", "fused"])
@pytest.mark.parametrize("shards", [1, 2, 4, 8])
def test_the_same_bits_on_any_number_of_vocab_shards(path, shards):
  """XLA's exact sums (the path that holds ``"shards"``; the default on CPUs) give the same
  bits on 1, 2, 4 and 8 vocab shards as on one device."""
  positions = [6, 0, 3, 1, 5]
  want = _bits(_call(path, PROBE, implementation="xla"), slice(None))
  for what, out in _sharded_forms(path, shards, _batch(7, positions)):
    _same(_bits(out, positions), want, f"{path}, {shards} shards, {what}")


@pytest.mark.parametrize("path", ["logits", "fused"])
def test_kept_sets_keep_the_bits(path):
  """Kept sets (each probe its own) give the same bits alone and among 1000 tokens."""
  rng = np.random.default_rng(6)
  mask = rng.random((1000, V)) < 0.4
  positions = rng.permutation(1000)[:PROBES]
  rows = _batch(1000, positions, seed=7)
  keep = jaxce.keep.pack(mask)
  alone = _call(path, PROBE, keep=keep[positions])
  among = _call(path, rows, keep=keep)
  _same(_bits(among, positions), _bits(alone, slice(None)), f"{path} with kept sets")


def test_the_option_is_needed():
  """Without it XLA's float sums and matmuls give the same probes other bits in some of
  these calls (they round by the shapes they run at), so the tests above can fail. On a
  GPU XLA's row reductions at these tiny shapes happen not to, and the default kernels
  are batch-invariant themselves: there the fused path's default XLA matmul, at a hidden
  dim where cuBLAS picks its kernel by the number of rows, shows it."""
  differs = []
  if jax.default_backend() == "cpu":
    for path in ("logits", "fused"):
      want = _bits(_call(path, PROBE, invariant=False, implementation="xla"), slice(None))
      for what, positions, call in _contexts(path, invariant=False)[PROBES:PROBES + 3]:
        if any(not np.array_equal(g, w) for g, w in zip(_bits(call(), positions), want)):
          differs.append(f"{path}, {what}")
  else:
    rng = np.random.default_rng(9)
    hidden = jnp.asarray(rng.normal(size=(4096, 2048)), jnp.bfloat16)
    weight = jnp.asarray(rng.normal(size=(2048, 4096)) / 45, jnp.bfloat16)
    labels = jnp.asarray(rng.integers(0, 4096, 4096), jnp.int32)
    f = jax.jit(lambda h, l: jaxce.linear_logprobs_and_entropy(h, weight, l,
                                                               implementation="xla"))
    alone = np.concatenate([np.asarray(f(hidden[i:i + 1], labels[i:i + 1])[0]) for i in range(8)])
    among = np.asarray(f(hidden, labels)[0])[:8]
    if not np.array_equal(alone.view(np.uint32), among.view(np.uint32)):
      differs.append("fused, T = 4096")
  assert differs, "batch_invariant=False gave the same bits everywhere"


@pytest.mark.parametrize("path", ["logits", "fused"])
def test_as_exact_as_the_default(path):
  """vs float64 on the same bf16 inputs (the fused path's: its logits in float64): no
  further from float64 than the default's float sums plus one float32 ulp of the largest
  scaled logit, and on the logits path within 5e-6 (the fused path's own f32 matmul and
  softcap add their rounding, the same with and without the option)."""
  rows = _batch(1000, [0, 1, 2, 3, 4], seed=8)
  x = np.asarray(jnp.asarray(rows["logits"], jnp.bfloat16), np.float64)
  if path == "fused":
    h = np.asarray(jnp.asarray(rows["hidden"], jnp.bfloat16), np.float64)
    x = SOFTCAP * np.tanh(h @ np.asarray(WEIGHT, np.float64) / SOFTCAP)
  want = reference.logprobs_and_entropy(jnp.asarray(x), rows["labels"],
                                        temperature=rows["temperature"], where=rows["where"],
                                        vocab_size=VOCAB)
  ulp = np.spacing(np.float32(np.max(np.abs(x / rows["temperature"][:, None]))))
  for name, inv, default, w in zip(("logp", "entropy"), _call(path, rows),
                                   _call(path, rows, invariant=False), want):
    err = np.max(np.abs(np.asarray(inv, np.float64) - np.asarray(w)))
    err_default = np.max(np.abs(np.asarray(default, np.float64) - np.asarray(w)))
    assert path != "logits" or err <= 5e-6, f"{path} {name}: {err:.2e} from float64"
    assert err <= err_default + ulp, f"{path} {name}: {err:.2e} vs the default's {err_default:.2e}"


def test_exact_sums_are_exact_at_a_real_vocabulary():
  """V = 151936 (151665 real ids): rows whose mass is spread over many small terms (each
  exp(z - m) ~ 1e-3, where truncating the terms' limbs too coarsely biases the sum by
  2^-bits / 1e-3 of itself) and peaked rows, per-token temperature: the exact sums' logp
  and entropy within 4e-6 of float64 (the f32 rounding of log s ~ 12) and no further
  than XLA's float sums plus that. At a few hundred columns truncation is invisible."""
  rng = np.random.default_rng(11)
  vocab, real = 151936, 151665
  x = rng.normal(size=(6, vocab)) * 2.0
  x[3:] = adversarial_logits(rng, (3, vocab), scale=3.0, offset=-12.0, peak=12.0)
  x = np.asarray(jnp.asarray(x, jnp.bfloat16), np.float64)
  labels = rng.integers(0, real, 6)
  temperature = rng.uniform(0.7, 1.3, 6)
  common = dict(temperature=temperature, vocab_size=real, implementation="xla")
  want = reference.logprobs_and_entropy(jnp.asarray(x), labels, temperature=temperature,
                                        vocab_size=real)
  xb = jnp.asarray(x, jnp.bfloat16)
  exact = jaxce.logprobs_and_entropy(xb, labels, batch_invariant=True, **common)
  floats = jaxce.logprobs_and_entropy(xb, labels, **common)
  for name, e, f, w in zip(("logp", "entropy"), exact, floats, want):
    err = np.abs(np.asarray(e, np.float64) - np.asarray(w))
    err_float = np.abs(np.asarray(f, np.float64) - np.asarray(w))
    assert np.max(err) <= 4e-6, f"{name}: {err} from float64"
    assert np.max(err) <= np.max(err_float) + 4e-6, f"{name}: {err} vs XLA's {err_float}"


def test_the_exact_paths_matmuls_keep_their_shape():
  """The exact fused path's forward matmuls have the platform's tile shape whatever the
  number of tokens (7, 100, 1000): a matmul's row bits depend on its shape, which XLA:CPU
  hides (it gives a row the same bits at any row count) and GPUs do not. Read from the
  compiled program's dots."""
  import re
  tile = jaxce.plan.INVARIANT_MATMUL_TILE[jaxce.plan.budget_platform()]
  for tokens in (7, 100, 1000):
    rows = _rows(12, tokens)
    h = jnp.asarray(rows["hidden"], jnp.bfloat16)
    f = jax.jit(lambda h, w: jaxce.linear_logprobs_and_entropy(
        h, w, rows["labels"], batch_invariant=True, implementation="xla", vocab_size=VOCAB))
    text = f.lower(h, WEIGHT).as_text()
    dots = re.findall(r"stablehlo\.dot_general.*?\(tensor<(\d+)x(\d+)x\w+>, "
                      r"tensor<(\d+)x(\d+)x\w+>\)", text)
    assert dots, "no matmul found"
    for lhs_rows, depth, _, columns in dots:
      assert (int(lhs_rows), int(columns)) == tile, (tokens, lhs_rows, columns, tile)


@pytest.mark.parametrize("path", ["logits", "fused", "token_loss", "linear_token_loss"])
def test_gradients_match_float64(path):
  """float64 inputs (the exact sums then keep 77 bits): outputs and gradients with random
  per-token cotangents against the reference, ragged and padded shapes."""
  rng = np.random.default_rng(9)
  tokens = 45
  rows = _rows(10, tokens)
  x = jnp.asarray(rows["logits"])
  h, w = jnp.asarray(rows["hidden"]), jnp.asarray(np.asarray(WEIGHT, np.float64))
  a, b = rng.normal(size=tokens), rng.normal(size=tokens)
  common = dict(temperature=rows["temperature"], where=rows["where"], vocab_size=VOCAB)
  labels = rows["labels"]
  objective = lambda logp, entropy, a, b: a * logp + b * entropy
  ref_options = dict(common)
  if path in ("logits", "token_loss"):
    operands, ref = (x,), lambda x: reference.logprobs_and_entropy(x, labels, **ref_options)
  else:
    operands = (h, w)
    ref = lambda h, w: reference.logprobs_and_entropy(
        SOFTCAP * jnp.tanh(h @ w / SOFTCAP), labels, **ref_options)
    common = dict(common, logit_softcap=SOFTCAP)
  if path == "logits":
    fn = lambda x: jaxce.logprobs_and_entropy(x, labels, batch_invariant=True, **common)
  elif path == "fused":
    fn = lambda h, w: jaxce.linear_logprobs_and_entropy(h, w, labels, batch_invariant=True,
                                                        **common)
  else:
    run = jaxce.token_loss if path == "token_loss" else jaxce.linear_token_loss
    fn = lambda *o: run(objective, *o, labels, a, b, batch_invariant=True, **common)
  weighted = lambda f: lambda *o: (lambda out: jnp.sum(a * out[0]) + jnp.sum(b * out[1]))(f(*o))
  if path in ("token_loss", "linear_token_loss"):
    got = jax.grad(lambda *o: fn(*o)[0], tuple(range(len(operands))))(*operands)
  else:
    got = jax.grad(weighted(fn), tuple(range(len(operands))))(*operands)
  expected = jax.grad(weighted(ref), tuple(range(len(operands))))(*operands)
  for g, e in zip(got, expected):
    assert_close(g, e, 1e-10, f"{path} gradient")
  if path in ("logits", "fused"):
    for g, e in zip(fn(*operands), ref(*operands)):
      assert_close(g, e, 1e-10, f"{path} outputs")


def test_a_nan_row_stays_contained():
  rows = _batch(40, [0, 1, 2, 3, 4], seed=11)
  rows["logits"][20, 7] = np.nan
  rows["logits"][21, 9] = np.inf
  rows["where"][20:22] = True
  logp, entropy = _call("logits", rows)
  assert np.isnan(logp[20]) and not np.isfinite(logp[21])
  _same(_bits((logp, entropy), [0, 1, 2, 3, 4]), _bits(_call("logits", PROBE), slice(None)),
        "beside NaN and inf rows")


def test_too_many_columns_is_an_error():
  logits = jax.ShapeDtypeStruct((2, 2**20 + 1), jnp.bfloat16)
  with pytest.raises(ValueError, match="batch_invariant=True sums at most 1048576"):
    jax.eval_shape(lambda x: jaxce.logprobs_and_entropy(x, jnp.zeros(2, jnp.int32),
                                                        batch_invariant=True), logits)
  with pytest.raises(TypeError, match="batch_invariant must be True or False"):
    jaxce.logprobs_and_entropy(jnp.zeros((2, 4)), jnp.zeros(2, jnp.int32), batch_invariant=1)


def test_the_planner_says_which_path_holds_it():
  """On a Hopper GPU the Mosaic kernels hold the option (batch-invariant by construction);
  elsewhere XLA's exact sums, with the platform's matmul tile. Either way the plan says
  what the bits do not depend on, and a kernel that cannot hold it is refused."""
  h = jax.ShapeDtypeStruct((512, 64), jnp.bfloat16)
  w = jax.ShapeDtypeStruct((64, 1024), jnp.bfloat16)
  labels = jax.ShapeDtypeStruct((512,), jnp.int32)
  target = jaxce.plan.target()
  got = jaxce.plan.of(jaxce.linear_logprobs_and_entropy, h, w, labels, batch_invariant=True)
  if target.platform == "gpu" and target.capability == "9.0":
    assert got.backend == "mosaic" and not got.exact_sums and got.matmul_tile is None
    assert got.invariant_to == jaxce.plan.INVARIANCES[:4]
  else:
    assert got.backend == "xla" and got.exact_sums
    assert got.matmul_tile == jaxce.plan.INVARIANT_MATMUL_TILE[jaxce.plan.budget_platform()]
    assert got.invariant_to == jaxce.plan.INVARIANCES
  with pytest.raises(ValueError, match="batch_invariant=True"):
    jaxce.plan.of(jaxce.linear_logprobs_and_entropy, h, w, labels, batch_invariant=True,
                  implementation="triton")
  exact = jaxce.plan.of(jaxce.linear_logprobs_and_entropy, h, w, labels, batch_invariant=True,
                        implementation="xla")
  assert exact.exact_sums and exact.invariant_to == jaxce.plan.INVARIANCES
  default = jaxce.plan.of(jaxce.linear_logprobs_and_entropy, h, w, labels, implementation="xla")
  assert not default.exact_sums and default.invariant_to == ()


@pytest.mark.parametrize("path", ["token_loss", "linear_token_loss"])
def test_objective_paths_on_8_vocab_shards(path):
  """``sharded_token_loss`` / ``sharded_linear_token_loss`` over 8 devices give the
  per-token path's bits on one device."""
  positions = [6, 0, 3, 1, 5]
  rows = _batch(7, positions)
  mesh = Mesh(np.array(devices(8)), ("v",))
  kw = dict(temperature=rows["temperature"], where=rows["where"], vocab_size=VOCAB,
            batch_invariant=True, mesh=mesh, vocab_axis="v")
  objective = lambda logp, entropy, adv: -adv * logp - 0.01 * entropy
  if path == "token_loss":
    _, out = jaxce.sharded_token_loss(objective, jnp.asarray(rows["logits"], jnp.bfloat16),
                                      rows["labels"], rows["adv"], **kw)
    want = _call("logits", PROBE)
  else:
    _, out = jaxce.sharded_linear_token_loss(
        objective, jnp.asarray(rows["hidden"], jnp.bfloat16), WEIGHT, rows["labels"],
        rows["adv"], logit_softcap=SOFTCAP, **kw)
    want = _call("fused", PROBE)
  _same(_bits(out, positions), _bits(want, slice(None)), f"{path} on 8 shards")
