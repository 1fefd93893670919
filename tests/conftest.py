"""Test setup: 8 simulated CPU devices, float64 for the references, a compilation cache
shared by every process of a run, XLA's classic CPU emitters at optimization level 1 on
jaxlib 0.10, how pytest-xdist spreads the tests, and a fix of the Mosaic GPU
interpreter's end-of-kernel check for several simulated devices.

The environment must be set before JAX initialises its backends, so it is set here, at
import.

Compilation dominates the suite's time on CPU (docs/development.md, "Where the suite's
time goes"). On CPU (not on a GPU, where XLA autotunes per program), JAX's persistent
compilation cache (``.jax_cache/`` in the checkout, every
program however fast it compiled) lets a program compiled once be loaded, not compiled
again, by the other xdist worker, by the subprocesses the tests start (they inherit the
environment: the benchmark's smoke runs, the notebook's kernel, the two-process example)
and by the next run in this checkout. A cached program is the one XLA compiled from the
same HLO, options and JAX version, so the tests check the same programs either way.
``JAX_COMPILATION_CACHE_DIR`` set beforehand chooses another folder.

On CPU with jaxlib 0.10, XLA compiles the tests' programs with its classic CPU emitters
(``--xla_cpu_use_fusion_emitters=false``), which compile in about two thirds of the time
the MLIR fusion emitters, the default there, take, and with the backend's optimization
level 1 (``--xla_backend_optimization_level=1``, not the default 3: a fifth less again),
for results that agree with the default's to rounding: every test passes either way, and
the outputs that differ do so by a few units in the last place of the values they are
computed from (docs/development.md, "Where the suite's time goes"; level 0 changes more
than rounding and is not used). jaxlib 0.11 and later have only the fusion emitters, so
there (CI runs the whole suite on jaxlib 0.12 too) the tests compile as users' programs
do; ``XLA_FLAGS`` that name either flag keep their setting.
"""

import os
from importlib import metadata


def _jaxlib_version() -> tuple[int, ...]:
  """jaxlib's (major, minor), read without importing JAX; () where unknown."""
  try:
    return tuple(int(part) for part in metadata.version("jaxlib").split(".")[:2])
  except (metadata.PackageNotFoundError, ValueError):
    return ()


os.environ.setdefault("JAX_PLATFORMS", "cpu")
flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in flags:
  os.environ["XLA_FLAGS"] = (flags + " --xla_force_host_platform_device_count=8").strip()
if os.environ["JAX_PLATFORMS"] == "cpu":
  # (CPU only: on a GPU the tests that compare separate compilations or processes, where
  # XLA autotunes its GEMMs per program, must compile each program afresh)
  os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", os.path.join(
      os.path.dirname(os.path.dirname(os.path.abspath(__file__))), ".jax_cache"))
  os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
  os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
  if () < _jaxlib_version() < (0, 11):
    if "xla_cpu_use_fusion_emitters" not in flags:
      os.environ["XLA_FLAGS"] += " --xla_cpu_use_fusion_emitters=false"
    if "xla_backend_optimization_level" not in flags:
      os.environ["XLA_FLAGS"] += " --xla_backend_optimization_level=1"

import jax  # noqa: E402

jax.config.update("jax_enable_x64", True)
# Tests check the maths, not TF32 rounding: on GPUs, float32 matmuls default to TF32.
jax.config.update("jax_default_matmul_precision", "highest")


import pytest  # noqa: E402


def _interpreter_checks_barriers_after_every_device():
  """Work around a race in JAX's Mosaic GPU interpreter (JAX 0.11-0.12) with several
  simulated devices: at the end of a kernel each device checks that no barrier remains
  allocated in the interpreter's memory, which every device shares, before the devices
  wait for each other; a device that finishes first sees another's barriers still in
  use ("Barrier remains allocated"). Here the check runs once every device has finished
  the kernel (at the devices' barrier that precedes the clean-up), over the same
  allocations: the same check, no longer racing. Off GPUs only (the tests' interpreter);
  a JAX without these internals is left as it is."""
  try:
    from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks  # pylint: disable=import-outside-toplevel
  except ImportError:
    return
  names = ("_assert_no_barriers_allocated", "_clean_up_shared_memory", "_get_shared_memory",
           "fail_on_exception")
  if not all(hasattr(gpu_callbacks, n) for n in names):
    return

  @gpu_callbacks.fail_on_exception
  def check_later(token):  # (at the kernel's end: see clean_up)
    return token

  @gpu_callbacks.fail_on_exception
  def clean_up(token):
    memory = gpu_callbacks._get_shared_memory()  # pylint: disable=protected-access
    memory.barrier.wait()  # every device has finished the kernel
    memory.assert_no_barriers_allocated()
    memory.clean_up_barrier.wait()
    return token

  gpu_callbacks._assert_no_barriers_allocated = check_later  # pylint: disable=protected-access
  gpu_callbacks._clean_up_shared_memory = clean_up  # pylint: disable=protected-access


if os.environ["JAX_PLATFORMS"] == "cpu":
  _interpreter_checks_barriers_after_every_device()


@pytest.fixture(autouse=True)
def _float64_stays_on():
  """A test that turns JAX's x64 mode off (directly or through code it calls) would make
  every later test in its worker compare float32 results at float64 tolerances: fail it
  where it happens."""
  yield
  assert jax.config.read("jax_enable_x64"), "this test left jax_enable_x64 off"


# Modules whose tests run in one xdist worker: Tunix's cases share its eager programs (their
# compiles are most of their time), the benchmark's tests share one smoke run (a
# module-scoped fixture, which each worker would otherwise run again).
ONE_WORKER = ("test_tunix.py", "test_bench.py")


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
  """Under ``-n`` (``--dist load``, the default): the tests of each ``ONE_WORKER`` module
  go to one worker, first (the longest units first, so neither worker is left with one at
  the end); the others are spread one by one, as ``--dist load`` does."""
  if config.getvalue("dist") != "load":
    return None
  from xdist.scheduler import LoadScopeScheduling  # pylint: disable=import-outside-toplevel

  class OneWorkerModules(LoadScopeScheduling):
    def _split_scope(self, nodeid):
      module = nodeid.split("::", 1)[0]
      return module if os.path.basename(module) in ONE_WORKER else nodeid

  return OneWorkerModules(config, log)
