"""Shape buckets: few distinct shapes (so steady use compiles nothing new), little padding."""
from kernels_pallas._common import next_power_of_2


def bucket(n: int, step: int) -> int:
    """Powers of two up to `step`, then multiples of `step`."""
    return next_power_of_2(n) if n <= step else -(-n // step) * step
