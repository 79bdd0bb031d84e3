"""A dense test reward (any response gets a varied score), so tiny test runs have gradients."""


def char_code_reward(response: str, label: str) -> float:
    return (ord(response[0]) % 3) / 2.0 if response else 0.0


def overflow_reward(response: str, label: str) -> float:
    """Finite, but group sums overflow float32: GRPO advantages (and so the loss) become NaN."""
    return 3.0e38


def one_reward(response: str, label: str) -> float:
    """Every response is right: a warm start's validation reward is 1.0 after its first step."""
    return 1.0
