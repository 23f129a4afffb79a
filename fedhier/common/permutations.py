"""Many seeded permutations at once, bit for bit those of :func:`fedhier.common.rng.generator`.

``generator(seed, purpose, *ids).permutation(n)`` costs ~19 µs of Python and C overhead per
call (SeedSequence hashing, PCG64 seeding, a Generator object), which is most of the cost of
the mini-batch order when there are thousands of (client, epoch) pairs. :func:`permutations`
computes the same permutations for many id tuples with whole-array NumPy operations: NumPy's
own algorithms, re-implemented on arrays with one row per tuple:

1. ``SeedSequence(entropy)``: the entropy words hashed into a pool of four uint32 words
   (``mix_entropy``), then ``generate_state(4, uint64)``;
2. ``PCG64``: a 128-bit LCG seeded from those words (``pcg_setseq_128_srandom_r``), whose
   outputs are XSL-RR of the state after each step; 32-bit draws use each 64-bit output
   twice, low half first;
3. ``Generator.permutation(n)``: ``arange(n)`` shuffled by Fisher-Yates from the end, each
   position's partner drawn in ``[0, i]`` by masked rejection (``random_interval``).

The 128-bit arithmetic is done on (high, low) pairs of uint64 words. tests/test_permutations.py
compares the result with NumPy's on thousands of tuples; where the fast path does not apply
(ids of 2**32 or more, few tuples, long permutations) the generators are simply called.
"""

from __future__ import annotations

import numpy as np

from fedhier.common.rng import generator, purpose_tag

_U32 = np.uint32
_U64 = np.uint64
_LOW32 = _U64(0xFFFFFFFF)

# numpy/random/bit_generator.pyx (SeedSequence)
_INIT_A, _MULT_A = 0x43B0D7E5, 0x931E8875
_INIT_B, _MULT_B = 0x8B51F9DD, 0x58F38DED
_MIX_MULT_L, _MIX_MULT_R = 0xCA01F9DD, 0x4973F715
_XSHIFT = _U32(16)
_POOL_SIZE = 4
# numpy/random/src/pcg64 (PCG_DEFAULT_MULTIPLIER_128)
_PCG_MULT_HIGH, _PCG_MULT_LOW = _U64(2549297995355413924), _U64(4865540595714422341)

#: Below this many tuples calling the generators is as fast.
MIN_BATCH = 64
#: Longest permutation the array path computes: it loops over positions, so its cost grows
#: with the longest permutation however few tuples need it.
MAX_LENGTH = 512


def permutations(seed: int, purpose: str, ids: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Row k: ``generator(seed, purpose, *ids[k]).permutation(lengths[k])``, padded with -1.

    Args:
        ids: int [K, m] the id tuples; lengths: int [K] permutation lengths (>= 0).

    Returns:
        int64 [K, max(lengths)]: row k's first ``lengths[k]`` entries are its permutation.
    """
    ids = np.asarray(ids, dtype=np.int64).reshape(len(lengths), -1)
    lengths = np.asarray(lengths, dtype=np.int64)
    out = np.full((len(lengths), int(lengths.max(initial=0))), -1, dtype=np.int64)
    fast = (lengths <= MAX_LENGTH) if _fits_one_word(seed, ids) else np.zeros(len(lengths), bool)
    if fast.sum() < MIN_BATCH:
        fast[:] = False
    for k in np.flatnonzero(~fast):
        out[k, :lengths[k]] = generator(seed, purpose, *ids[k].tolist()).permutation(
            int(lengths[k]))
    if fast.any():
        rows = np.flatnonzero(fast)
        words = np.column_stack([np.full(len(rows), seed), np.full(len(rows),
                                 purpose_tag(purpose)), ids[rows]]).astype(_U32)
        state, increment = _pcg64_states(_seed_sequence_state(words))
        short = _shuffled(_Pcg64(state, increment), lengths[rows])
        out[rows, :short.shape[1]] = short
    return out


def _fits_one_word(seed: int, ids: np.ndarray) -> bool:
    """Every entropy value is one uint32 word (SeedSequence splits larger ints into more)."""
    return 0 <= seed < 2**32 and bool(((ids >= 0) & (ids < 2**32)).all())


# ------------------------------------------------------------------------------ SeedSequence
class _HashConstant:
    """The running ``hash_const`` of one SeedSequence pass (the same for every row)."""

    def __init__(self, init: int, mult: int) -> None:
        self.value, self.mult = init, mult

    def hashmix(self, value: np.ndarray) -> np.ndarray:
        value = value ^ _U32(self.value)
        self.value = (self.value * self.mult) & 0xFFFFFFFF
        value = value * _U32(self.value)
        return value ^ (value >> _XSHIFT)


def _mix(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    result: np.ndarray = _U32(_MIX_MULT_L) * x - _U32(_MIX_MULT_R) * y  # uint32, wrapping
    return result ^ (result >> _XSHIFT)


def _seed_sequence_state(words: np.ndarray) -> np.ndarray:
    """``SeedSequence(entropy).generate_state(4, uint64)`` per row of uint32 words [K, w]:
    uint64 [4, K]."""
    count, width = words.shape
    hashing = _HashConstant(_INIT_A, _MULT_A)
    pool = [hashing.hashmix(words[:, i] if i < width else np.zeros(count, _U32))
            for i in range(_POOL_SIZE)]
    for src in range(_POOL_SIZE):
        for dst in range(_POOL_SIZE):
            if src != dst:
                pool[dst] = _mix(pool[dst], hashing.hashmix(pool[src]))
    for src in range(_POOL_SIZE, width):
        for dst in range(_POOL_SIZE):
            pool[dst] = _mix(pool[dst], hashing.hashmix(words[:, src]))
    hashing = _HashConstant(_INIT_B, _MULT_B)
    state32 = [hashing.hashmix(pool[i % _POOL_SIZE]) for i in range(2 * 4)]
    return np.stack([state32[2 * k].astype(_U64) | (state32[2 * k + 1].astype(_U64) << _U64(32))
                     for k in range(4)])


# ------------------------------------------------------------------------------ PCG64
def _multiply_64(a: np.ndarray, b: np.uint64) -> tuple[np.ndarray, np.ndarray]:
    """Full 128-bit product of uint64 arrays a and a uint64 b: (high, low)."""
    a0, a1 = a & _LOW32, a >> _U64(32)
    b0, b1 = b & _LOW32, b >> _U64(32)
    p00, p01, p10, p11 = a0 * b0, a0 * b1, a1 * b0, a1 * b1
    middle = (p00 >> _U64(32)) + (p01 & _LOW32) + (p10 & _LOW32)
    low = (p00 & _LOW32) | (middle << _U64(32))
    high = p11 + (p01 >> _U64(32)) + (p10 >> _U64(32)) + (middle >> _U64(32))
    return high, low


def _step(high: np.ndarray, low: np.ndarray, inc_high: np.ndarray,
          inc_low: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """state * multiplier + increment, mod 2**128."""
    carry_high, new_low = _multiply_64(low, _PCG_MULT_LOW)
    new_high = carry_high + low * _PCG_MULT_HIGH + high * _PCG_MULT_LOW
    summed = new_low + inc_low
    return new_high + inc_high + (summed < new_low).astype(_U64), summed


def _pcg64_states(seeds: np.ndarray) -> tuple[tuple[np.ndarray, np.ndarray],
                                              tuple[np.ndarray, np.ndarray]]:
    """PCG64 seeded with generate_state's words [4, K]: ((state high, low), (inc high, low))."""
    init_high, init_low, seq_high, seq_low = seeds
    inc_high = (seq_high << _U64(1)) | (seq_low >> _U64(63))
    inc_low = (seq_low << _U64(1)) | _U64(1)
    high, low = inc_high.copy(), inc_low.copy()  # one step from state 0
    low_sum = low + init_low
    high = high + init_high + (low_sum < low).astype(_U64)
    high, low = _step(high, low_sum, inc_high, inc_low)
    return (high, low), (inc_high, inc_low)


class _Pcg64:
    """K PCG64 streams, with NumPy's buffered 32-bit draws."""

    def __init__(self, state: tuple[np.ndarray, np.ndarray],
                 inc: tuple[np.ndarray, np.ndarray]) -> None:
        self.high, self.low = state
        self.inc_high, self.inc_low = inc
        self.has_half = np.zeros(len(self.high), dtype=bool)
        self.half = np.zeros(len(self.high), dtype=_U32)

    def next_uint32(self, rows: np.ndarray) -> np.ndarray:
        """One 32-bit draw for each stream in ``rows`` (int indices); the others keep state."""
        value = np.empty(len(rows), dtype=_U32)
        buffered = self.has_half[rows]
        value[buffered] = self.half[rows[buffered]]
        self.has_half[rows[buffered]] = False
        fresh = rows[~buffered]
        if len(fresh):
            high, low = _step(self.high[fresh], self.low[fresh], self.inc_high[fresh],
                              self.inc_low[fresh])
            self.high[fresh], self.low[fresh] = high, low
            mixed = high ^ low
            rotation = high >> _U64(58)
            output = (mixed >> rotation) | (mixed << ((_U64(64) - rotation) & _U64(63)))
            value[~buffered] = (output & _LOW32).astype(_U32)
            self.half[fresh] = (output >> _U64(32)).astype(_U32)
            self.has_half[fresh] = True
        return value


def _shuffled(streams: _Pcg64, lengths: np.ndarray) -> np.ndarray:
    """``Generator.permutation(lengths[k])`` of stream k: int64 [K, max length], -1 padded."""
    width = int(lengths.max(initial=0))
    out = np.tile(np.arange(width, dtype=np.int64), (len(lengths), 1))
    for i in range(width - 1, 0, -1):
        rows = np.flatnonzero(lengths > i)
        mask = (1 << i.bit_length()) - 1  # the smallest 2**k - 1 >= i
        partner = np.empty(len(rows), dtype=np.int64)
        pending = np.arange(len(rows))
        while len(pending):
            drawn = streams.next_uint32(rows[pending]) & _U32(mask)
            accepted = drawn <= i
            partner[pending[accepted]] = drawn[accepted]
            pending = pending[~accepted]
        here = out[rows, i].copy()
        out[rows, i] = out[rows, partner]
        out[rows, partner] = here
    out[np.arange(width)[None, :] >= lengths[:, None]] = -1
    return out
