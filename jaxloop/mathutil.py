"""Integer helpers shared by every layer (no imports: anything may use them)."""


def ceil_div(n: int, d: int) -> int:
    """n / d rounded up, for positive d."""
    return -(-n // d)


def round_up(n: int, multiple: int) -> int:
    """The smallest multiple of `multiple` that is >= n."""
    return ceil_div(n, multiple) * multiple
