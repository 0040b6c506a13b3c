"""Token ids as the int32 little-endian bytes the radix trie keys its pages by."""
from __future__ import annotations

import array
import functools
import struct
from typing import Sequence

import numpy as np

from jaxrl_cache.checks import as_count


@functools.lru_cache(maxsize=4096)
def _uint32s(n: int) -> struct.Struct:
    """Packs n little-endian uint32s."""
    return struct.Struct(f"<{n}I")


@functools.lru_cache(maxsize=4096)
def _pages_format(n: int, size: int) -> struct.Struct:
    """Splits the first n * size bytes into n bytes objects of `size` in one C call."""
    return struct.Struct(f"{size}s" * n)


def split_pages(data: bytes, size: int) -> tuple[bytes, ...]:
    """The whole `size`-byte chunks of data, in order."""
    return _pages_format(len(data) // size, size).unpack_from(data)


def pack_tokens(tokens: Sequence[int], name: str) -> bytes:
    """int32 little-endian bytes of token ids, each an integer in [0, 2**31): one C-level
    pass for a list or tuple of ints, numpy for the rest (which also names what is wrong; a
    sequence of bools is refused, as numpy types it bool)."""
    if type(tokens) in (list, tuple) and tokens and type(tokens[0]) is int:
        try:  # "<I" refuses non-integers, negatives and >= 2**32; the top bytes the rest
            data = _uint32s(len(tokens)).pack(*tokens)
        except Exception:  # the numpy path below names what is wrong
            data = b"\xff" * 4
        if data[3::4].isascii():
            return data
    if isinstance(tokens, (str, bytes)) or not isinstance(tokens, (Sequence, np.ndarray)):
        raise TypeError(f"{name} must be a sequence of integer token ids, got "
                        f"{type(tokens).__name__} {tokens!r:.80}")
    arr = np.asarray(tokens)
    if arr.size and (arr.ndim != 1 or not np.issubdtype(arr.dtype, np.integer)):
        raise TypeError(f"{name} must be a 1-D sequence of integer token ids, got "
                        f"{tokens!r:.80}")
    if arr.size and (arr.min() < 0 or arr.max() > 2**31 - 1):
        raise ValueError(f"{name}: token ids must be in [0, 2**31), got {tokens!r:.80}")
    return arr.astype("<i4").tobytes()


class PackedTokens(bytes):
    """Token ids as the int32 bytes the trie keys its pages by, checked once. Every cache call
    that takes tokens takes one of these as it is, so a caller that packs a prompt once
    (`PackedTokens.of`) and extends it by each sample's output (`extend` converts only the
    new tokens) does no per-token Python work on the prompt again. Build it only with `of`
    and `extend`."""
    __slots__ = ()

    @classmethod
    def of(cls, tokens: Sequence[int], name: str = "tokens") -> PackedTokens:
        """tokens: ints in [0, 2**31) (list, tuple or 1-D integer array)."""
        return tokens if type(tokens) is cls else cls(pack_tokens(tokens, name))

    def extend(self, tokens: Sequence[int], name: str = "tokens") -> PackedTokens:
        """These tokens followed by `tokens`."""
        data = pack_tokens(tokens, name)
        return PackedTokens(self + data) if data else self

    def head(self, n: int) -> PackedTokens:
        """The first n tokens."""
        return PackedTokens(self[:4 * as_count(n, "n")])

    @property
    def num_tokens(self) -> int:
        return len(self) >> 2

    def tolist(self) -> list[int]:
        return array.array("i", self).tolist()

    def __repr__(self) -> str:
        return f"PackedTokens({self.tolist()!r:.80})"
