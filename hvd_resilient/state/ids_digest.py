"""An order-independent digest of sample ids: what makes exactly-once data use observable.

The digest of a multiset of ids is the sum, modulo 2**64, of splitmix64(id) over its members.
The samplers keep it for the epoch in progress (`sampler.py`); the trainer writes it, with the
count and the data set's expected pair, in an `epoch_end` event; `hvd-resilient report` checks
it (docs/data.md#exactly-once-observable-the-epoch_end-event).

Why a sum, and not the XOR of the hashes (the other usual order-independent digest): a sum
counts multiplicity, XOR only parity. Under XOR a sample used three times looks used once, and
a sample used twice looks like one never used, so XOR cannot tell a duplicate from a gap; under
the sum every extra use adds its hash once more. With the count beside it the difference
between the digest and the expected one says what went wrong: +h(i) with one sample too many
is sample i used twice, -h(i) with one too few is sample i missing (`single_id` finds i).

Why splitmix64 (the finaliser of Java's SplittableRandom, Steele et al. 2014): it is a
bijection on 64-bit integers, so two distinct ids never share a hash and one duplicated or
missing sample always changes the digest (never by luck); its output is well mixed, so several
errors cancel out only with a chance of about 2**-64; and it is a few integer operations,
about 10 ns per id vectorised with numpy, which every rank pays for every step's ids.

Stdlib only at import time: `hvd-resilient report` reads this module, numpy is imported by
the functions the samplers call.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

METHOD = "sum64-splitmix64"
"""The name the `epoch_end` event gives this digest (a reader refuses one it does not know)."""

MASK = (1 << 64) - 1
_GAMMA = 0x9E3779B97F4A7C15
_M1 = 0xBF58476D1CE4E5B9
_M2 = 0x94D049BB133111EB
_M1_INV = pow(_M1, -1, 1 << 64)
_M2_INV = pow(_M2, -1, 1 << 64)
_CHUNK = 1 << 22
"""Ids hashed per numpy call by `digest_range` (32 MiB of uint64 at a time)."""


def mix(i: int) -> int:
    """splitmix64's output for state `i`: a bijection of 0 .. 2**64-1."""
    z = (i + _GAMMA) & MASK
    z = ((z ^ (z >> 30)) * _M1) & MASK
    z = ((z ^ (z >> 27)) * _M2) & MASK
    return z ^ (z >> 31)


def _unshift(z: int, s: int) -> int:
    """The inverse of z ^ (z >> s)."""
    x = z
    for _ in range(64 // s + 1):
        x = z ^ (x >> s)
    return x


def unmix(h: int) -> int:
    """The id whose `mix` is `h`."""
    z = _unshift(h & MASK, 31)
    z = _unshift((z * _M2_INV) & MASK, 27)
    z = _unshift((z * _M1_INV) & MASK, 30)
    return (z - _GAMMA) & MASK


def digest(ids: Iterable[int]) -> int:
    """The digest of `ids` in plain Python (the report, the tests): sum of `mix`, mod 2**64."""
    total = 0
    for i in ids:
        total += mix(int(i))
    return total & MASK


def digest_array(ids: Sequence[int] | Any) -> int:
    """`digest` of a list or a numpy array of ids, vectorised (what the samplers call)."""
    import numpy as np

    z = np.asarray(ids, dtype=np.uint64)
    if z.size == 0:
        return 0
    # uint64 array arithmetic wraps modulo 2**64, as splitmix64 wants (no overflow warning:
    # numpy warns for scalars only).
    z = z + np.uint64(_GAMMA)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(_M1)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(_M2)
    z = z ^ (z >> np.uint64(31))
    return int(z.sum(dtype=np.uint64))


def digest_range(start: int, stop: int) -> int:
    """The digest of every id in start .. stop-1, in chunks (about 10 ms per million ids)."""
    import numpy as np

    total = 0
    for lo in range(start, stop, _CHUNK):
        total += digest_array(np.arange(lo, min(stop, lo + _CHUNK), dtype=np.uint64))
    return total & MASK


def single_id(difference: int, n: int) -> int | None:
    """The id in 0 .. n-1 whose hash is `difference` (the digest minus the expected one, or
    the other way round), or None: a difference of one hash names one sample."""
    i = unmix(difference & MASK)
    return i if 0 <= i < n else None


def to_hex(value: int) -> str:
    """How events carry a digest: 16 hex digits (a JSON number above 2**53 loses bits in jq
    and in JavaScript)."""
    return f"{value & MASK:016x}"


def from_hex(text: Any) -> int | None:
    """A digest written by `to_hex`; None for anything else."""
    if not isinstance(text, str) or len(text) != 16:
        return None
    try:
        return int(text, 16)
    except ValueError:
        return None
