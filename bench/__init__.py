"""Benchmarks of jaxce against its peers: ``python -m bench`` (see bench/README.md).

Modules:
  configs: one benchmark configuration (:class:`configs.Config`) and the named suites.
  inputs:  host-made (numpy) inputs shared by the JAX and PyTorch runners.
  floors:  the hardware floors (HBM bandwidth, matmul rate) and each row's floor time.
  impls:   the JAX implementations (jaxce, plain JAX, scan + remat, optax, tokamax).
  impls_torch: the PyTorch implementations (eager, Liger-Kernel, Cut Cross-Entropy).
  runner:  one configuration in one fresh process: ``python -m bench.runner --json CONFIG``.
  report:  the JSON results file, its markdown table and the memory plot.
  grpo_step: the GRPO training step of examples/ at named sizes: ``python -m bench.grpo_step``.
  machine_floors, kernel_pieces: the fused path's GEMMs at the machine's best, and jaxce's
           kernels one at a time beside them.
  head_profile, precision, batch_invariant, invariant_cost: GPU measurements outside the
           suites (the fused path piece by piece, float32 precision, batch invariance and
           its cost), each ``python -m bench.<module>``.
"""
