"""The XLA flags of the test session. Its programs are tiny, so compiling them costs far more
than running them: XLA's CPU backend compiles without LLVM's optimisation passes
(`--xla_backend_optimization_level=0`: the same HLO, a fifth to two fifths less CPU per
compiling test, measured on the learner and trainer tests). The runs whose cost is execution (the
learning runs: a warm start and 60 updates) keep XLA's default, which runs them faster."""

DEVICES = 8  # the fake CPU devices of the sharding tests
FAST_COMPILE = "--xla_backend_optimization_level=0"
SESSION_FLAGS = f"--xla_force_host_platform_device_count={DEVICES} {FAST_COMPILE}"


def with_default_compiler(env: dict) -> dict:
    """`env` without FAST_COMPILE: XLA's default optimisation, for runs that execute far longer
    than they compile."""
    flags = [f for f in env.get("XLA_FLAGS", "").split() if f != FAST_COMPILE]
    return {**env, "XLA_FLAGS": " ".join(flags)}
