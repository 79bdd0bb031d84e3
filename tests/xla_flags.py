"""XLA flags every test process compiles with (tests/conftest.py sets them; tests that give a
subprocess its own XLA_FLAGS add them)."""

# Tiny test models spend most of their CPU in XLA's LLVM back end, not in running: the tests
# compile with LLVM optimisation off (a trainer run takes ~35% less CPU). XLA's own graph passes
# still run, so programs are the same up to float rounding (the float64 parity tests pass with it);
# benchmarks and the README's commands compile at the default level. Subprocesses inherit it.
TEST_XLA_FLAGS = "--xla_backend_optimization_level=0"
