"""XLA flags every test process compiles with (tests/conftest.py sets them; tests that give a
subprocess its own XLA_FLAGS add them)."""

# Tiny test models spend much of their CPU in XLA's LLVM back end rather than in running: the
# tests compile with LLVM at -O1 (a tiny trainer run: ~12% less CPU than the default -O2). XLA's
# own graph passes still run. Not -O0 (~35% less CPU): without LLVM's optimisations the embedded
# sampler's and the trainer's selected log-probs differ by up to 5.7e-6 in the early-exit tests,
# over the 3e-6 fp32 bound they check; at -O1 they stay within it. Benchmarks and the README's
# commands compile at the default level.
TEST_XLA_FLAGS = "--xla_backend_optimization_level=1"
