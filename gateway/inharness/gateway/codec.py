"""Compact encodings for token ids and logprobs: 4 bytes each, little-endian, no JSON lists.

A recorded token costs 8 bytes (uint32 id + float32 logprob) in the store.
"""

from collections.abc import Sequence

import numpy as np

_IDS = np.dtype("<u4")
_LOGPROBS = np.dtype("<f4")


def pack_ids(ids: Sequence[int]) -> bytes:
    return np.asarray(ids, dtype=_IDS).tobytes()


def unpack_ids(blob: bytes | None) -> list[int]:
    if not blob:
        return []
    return np.frombuffer(blob, dtype=_IDS).tolist()


def pack_logprobs(logprobs: Sequence[float]) -> bytes:
    return np.asarray(logprobs, dtype=_LOGPROBS).tobytes()


def unpack_logprobs(blob: bytes | None) -> list[float]:
    if not blob:
        return []
    return np.frombuffer(blob, dtype=_LOGPROBS).astype(np.float64).tolist()
