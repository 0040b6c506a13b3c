"""Shape buckets: few distinct shapes (so steady use compiles nothing new), little padding."""
from kernels_pallas import next_power_of_2


def bucket(n: int, step: int) -> int:
    """Powers of two up to `step`, then multiples of `step`."""
    return next_power_of_2(n) if n <= step else -(-n // step) * step


def page_width_bucket(n: int) -> int:
    """Page-table widths: powers of two up to 8, then the next number with three significant
    bits (10, 12, 14, 16, 20, 24, 28, 32, 40, ...): four buckets per doubling above 8 (so
    more than multiples of 8 give below 32 pages, fewer above 64) and under 25% padding
    beyond 8 pages, where attention reads every page of the width."""
    if n <= 8:
        return next_power_of_2(n)
    step = 1 << (n.bit_length() - 3)
    return -(-n // step) * step


def page_width_floor(n: int) -> int:
    """The largest `page_width_bucket` value <= n (0 for 0): a shared page count cut down to
    few distinct shapes."""
    if n <= 8:
        return 0 if n <= 0 else 1 << (n.bit_length() - 1)
    step = 1 << (n.bit_length() - 3)
    return n // step * step
