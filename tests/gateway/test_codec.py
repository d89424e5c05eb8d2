"""Token ids and logprobs are stored in 8 bytes per token and round-trip."""

from inharness.gateway.codec import pack_ids, pack_logprobs, unpack_ids, unpack_logprobs


def test_ids_round_trip_at_four_bytes_each() -> None:
    ids = [0, 1, 151_643, 2**32 - 1]
    blob = pack_ids(ids)
    assert len(blob) == 4 * len(ids)
    assert unpack_ids(blob) == ids


def test_logprobs_round_trip_at_float32_precision() -> None:
    lps = [0.0, -0.123456789, -17.5]
    blob = pack_logprobs(lps)
    assert len(blob) == 4 * len(lps)
    assert unpack_logprobs(blob) == [float(__import__("numpy").float32(x)) for x in lps]
    assert unpack_ids(b"") == [] and unpack_logprobs(None) == []
