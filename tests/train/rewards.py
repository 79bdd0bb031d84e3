"""A dense test reward (any response gets a varied score), so tiny test runs have gradients."""


def char_code_reward(response: str, label: str) -> float:
    return (ord(response[0]) % 3) / 2.0 if response else 0.0
