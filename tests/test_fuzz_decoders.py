"""Fuzzing the decoders behind the gossip layer's: rendezvous store frames, state transfers
and checkpoint records (tests/gossip/test_fuzz.py covers gossip packets).

Inputs are real encodings mutated at random (bit flips, truncations, splices, random bytes)
and structurally (a node of the decoded msgpack replaced by a hostile value: huge or
negative numbers, NaN, long strings, deep nesting, wrong types), then sealed or signed
with the right secret, so that they reach the parsers behind the authentication: what a
peer holding the secret, or a corrupted disk, could present. Whatever arrives, the
decoder raises only its documented error or drops and counts the input; nothing crashes
the process, and the store keeps serving.
"""

from __future__ import annotations

import collections
import math
import random
import time

import msgpack
import pytest
import torch
import xxhash
import zmq

from ftcomm.errors import StateError
from ftcomm.runtime import rendezvous
from ftcomm.training import checkpoint_files, plain
from ftcomm.training.state import TrainingState

pytestmark = pytest.mark.timeout(300)

SECRET = b"fuzz-secret"


def hostile_value(rng: random.Random, depth: int = 0) -> object:
    choice = rng.randrange(14)
    if choice == 0:
        return rng.choice([-1, 0, 1, 2**31, 2**53 + 1, 2**63 - 1, -(2**63), 2**64 - 1])
    if choice == 1:
        return rng.choice([math.nan, math.inf, -math.inf, -0.0, 1e308])
    if choice == 2:
        return "x" * rng.choice([0, 1, 300, 70_000])
    if choice == 3:
        return bytes(rng.randrange(256) for _ in range(rng.choice([0, 1, 8, 65])))
    if choice == 4:  # deep nesting
        value: object = []
        for _ in range(rng.choice([10, 70, 300])):
            value = [value]
        return value
    if choice == 5:
        return {rng.choice([0, -1, 2**64 - 1, 1.5, b"k", "k", None, True]): hostile_value(rng, depth + 1)
                if depth < 2 else 1}
    if choice == 6:
        return [hostile_value(rng, depth + 1) for _ in range(rng.randrange(4))] if depth < 3 else []
    if choice == 7:
        return None
    if choice == 8:
        return rng.choice([True, False])
    if choice == 9:
        return msgpack.ExtType(rng.randrange(128), b"\x00" * rng.randrange(10))
    if choice == 10:
        return [0, "float32", [2, 2], 16]  # a tensor-table entry, wherever it lands
    if choice == 11:
        return rng.random()
    if choice == 12:
        return "../" * 5
    return []


def mutate_structure(rng: random.Random, value: object) -> object:
    """``value`` with one node (map value, list item, or the whole) replaced."""
    if rng.random() < 0.1:
        return hostile_value(rng)
    if isinstance(value, dict) and value:
        key = rng.choice(list(value))
        copy = dict(value)
        if rng.random() < 0.15:
            del copy[key]
        else:
            copy[key] = mutate_structure(rng, value[key])
        return copy
    if isinstance(value, list) and value:
        i = rng.randrange(len(value))
        copy = list(value)
        copy[i] = mutate_structure(rng, value[i])
        return copy
    return hostile_value(rng)


def mutate_bytes(rng: random.Random, raw: bytes) -> bytes:
    kind = rng.randrange(5)
    data = bytearray(raw)
    if kind == 0 and data:
        for _ in range(rng.randrange(1, 8)):
            data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
        return bytes(data)
    if kind == 1:
        return bytes(data[:rng.randrange(len(data) + 1)])
    if kind == 2:
        return bytes(data) + bytes(rng.randrange(256) for _ in range(rng.randrange(1, 64)))
    if kind == 3 and data:
        a, b = sorted(rng.randrange(len(data)) for _ in range(2))
        return bytes(data[:a] + data[b:] + data[a:b])
    return bytes(rng.randrange(256) for _ in range(rng.randrange(0, 200)))


def packed(value: object) -> bytes | None:
    try:
        return msgpack.packb(value, use_bin_type=True)
    except (TypeError, ValueError, OverflowError):
        return None


def bodies(rng: random.Random, valid: list[bytes], count: int):
    """``count`` bodies derived from the valid ones, half structural, half byte-level."""
    decoded = [msgpack.unpackb(v, raw=False, strict_map_key=False) for v in valid]
    made = 0
    while made < count:
        i = rng.randrange(len(valid))
        if rng.random() < 0.5:
            body = packed(mutate_structure(rng, decoded[i]))
            if body is None:
                continue
        else:
            body = mutate_bytes(rng, valid[i])
        made += 1
        yield body


# ---------------------------------------------------------------------- rendezvous store
@pytest.mark.parametrize("secret", [SECRET, None])
def test_the_store_drops_and_counts_every_malformed_frame_and_keeps_serving(secret):
    server = rendezvous.StoreServer("127.0.0.1", secret)
    framing = rendezvous.Framing(secret)
    context = zmq.Context()
    sock = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(f"tcp://127.0.0.1:{server.port}")
    rng = random.Random(7)
    valid = [msgpack.packb(r, use_bin_type=True) for r in (
        ["set", "k", b"v"], ["get", "k", 10], ["check", ["k", "j"]], ["wait", ["k"], 10], ["add", "n", 3],
        ["cas", "k", b"v", b"w"], ["delete", "j"], ["num"])]
    sealed_count, raw_count = 20_000, 10_000
    try:
        for body in bodies(rng, valid, sealed_count):  # behind the authentication: a peer with the secret
            sock.send(framing.seal(body)[0])
        frames = [framing.seal(v)[0] for v in valid]
        for _ in range(raw_count):  # unauthenticated garbage
            sock.send(mutate_bytes(rng, rng.choice(frames)))
        # The store still answers a genuine request once it has worked through the rest.
        client = rendezvous.StoreClient("127.0.0.1", server.port, secret, timeout=60.0)
        client.set("after", b"fuzz")
        assert client.get("after") == b"fuzz"
        client.close()
        assert server.drops["error"] == 0, server.drops
        assert sum(server.drops.values()) >= raw_count // 2, server.drops  # most byte-level mutations are dropped
        assert set(server.drops) <= {"size", "bad_version", "unauthenticated", "unexpected_auth", "bad_hmac",
                                     "bad_checksum", "malformed", "stale", "future", "replayed", "waiter_client_gone"}, server.drops
    finally:
        sock.close()
        context.term()
        server.close()


# ---------------------------------------------------------------------- state transfers
def test_a_state_transfer_manifest_is_refused_with_state_error_or_loaded_never_crashes():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    model(torch.randn(3, 4)).sum().backward()
    optimizer.step()
    source = TrainingState()
    source.register(model=model, optimizer=optimizer, note="hello", counts=[1, 2])
    manifest, data = source.pack(5)
    target_model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    target = TrainingState()
    target.register(model=target_model, optimizer=torch.optim.Adam(target_model.parameters(), lr=0.01),
                    note="", counts=[0, 0])
    rng = random.Random(11)
    outcomes: collections.Counter[str] = collections.Counter()
    started = time.monotonic()
    for body in bodies(rng, [manifest], 20_000):
        try:
            target.unpack(body, data)
            outcomes["loaded"] += 1
        except StateError:
            outcomes["refused"] += 1
    assert outcomes["refused"] > 10_000, outcomes
    assert time.monotonic() - started < 250


# ---------------------------------------------------------------------- checkpoint records
@pytest.mark.parametrize("signed", [True, False])
def test_a_checkpoint_record_is_refused_with_state_error_or_read_never_crashes(signed):
    key = checkpoint_files.checkpoint_key(SECRET, "fuzz-job") if signed else None
    state = TrainingState()
    state.register(model=torch.nn.Linear(3, 2), note="x")
    skeleton, tensors = plain.split(state.snapshot(4), "state")
    entries, size = plain.layout(tensors)
    buffer = bytearray(size)
    record = {"format": checkpoint_files.FORMAT, "step": 4, "time": 1.0, "size": size, "chunk": checkpoint_files.CHUNK,
              "tensors": entries, "checksums": checkpoint_files.checksums_of(buffer, entries, key),
              "structure": skeleton}
    valid = msgpack.packb(record, use_bin_type=True)
    assert checkpoint_files.decode_meta(checkpoint_files.meta_bytes(record, key), 4, key).step == 4
    rng = random.Random(13)
    outcomes: collections.Counter[str] = collections.Counter()
    for body in bodies(rng, [valid], 20_000):
        header = b"FTCS" + checkpoint_files._tag(key, body) if signed else \
            b"FTCK" + xxhash.xxh3_64_intdigest(body).to_bytes(8, "little")
        raw = header + body if rng.random() < 0.9 else mutate_bytes(rng, header + body)
        try:
            checkpoint_files.decode_meta(raw, 4, key)
            outcomes["read"] += 1
        except (StateError, ValueError) as exc:
            outcomes[type(exc).__name__] += 1
    assert outcomes["StateError"] > 10_000, outcomes
