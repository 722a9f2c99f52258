"""Fuzz targets for everything turbowire parses from the network (issue 17, "Fuzzing").

Each target is a plain function whose arguments hypothesis draws from the strategies it was
registered with (``@target(..., name=strategy)``); ``TARGETS`` lists them by name. The property
every target checks is the same in spirit: bytes or structures from a peer, a proxy, a store or an
LMCache file either parse/decode correctly or are refused with a *specific* turbowire exception (a
subclass of ``turbowire.errors.TurboWireError``, or the documented "None"/protocol-library error
where the API says so), never another exception type, a hang, or a write outside the destination
(canary guard regions around caches, blocks and slots not named in the item compared bit for bit
before and after).

Drivers: ``tests/unit/test_fuzz_slice.py`` (a short deterministic slice in CI) and
``tests/fuzz/run.py`` (every target for a time budget; ``make fuzz``). This module only defines
targets; nothing in tests/fuzz is collected by pytest (tests/fuzz/conftest.py).

Heavy imports (vLLM through the connector metadata, LMCache) happen inside the targets that need
them, so a driver that runs one target pays only for that one.
"""

from __future__ import annotations

import os

# The Triton decode target runs the kernels in Triton's interpreter on CPU; Triton reads the
# variable when it is first imported (tests/conftest.py sets it the same way for pytest).
os.environ.setdefault("TRITON_INTERPRET", "1")

import asyncio  # noqa: E402
import contextlib  # noqa: E402
import functools  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import struct  # noqa: E402
import tempfile  # noqa: E402
import types  # noqa: E402
import zlib  # noqa: E402
from collections import Counter  # noqa: E402
from collections.abc import Callable, Sequence  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402
from hypothesis import note  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from turbowire.errors import TurboWireError  # noqa: E402


@contextlib.contextmanager
def single_threaded() -> Any:
    """Drivers run the targets in this: they move tiny tensors, and torch's intra-op threads
    only contend (on a 2-core machine a clone of 64 KiB took 20-60 ms with two threads, 0.2 ms
    with one). Restores the thread count after (pytest runs other tests in the process)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


# ---- registry --------------------------------------------------------------------------------
@dataclass(frozen=True)
class Target:
    """One fuzz target: ``fn(**drawn)`` checks ``prop`` for arguments drawn from ``strategies``."""

    name: str
    fn: Callable[..., None]
    strategies: dict[str, st.SearchStrategy]
    prop: str
    ci_examples: int  # examples of the CI slice (tests/unit/test_fuzz_slice.py)
    weight: float  # share of run.py's time budget, relative to the other targets
    # explicit examples every driver runs first (regressions: inputs that once failed)
    examples: Callable[[], list[dict[str, Any]]] | None = None

    def hypothesis_test(self, wrap: Callable[..., None] | None = None) -> Callable[[], None]:
        """``fn`` (or ``wrap``, a wrapper of it) under ``@given`` and its explicit examples."""
        from hypothesis import example, given

        test: Any = given(**self.strategies)(wrap or self.fn)
        for ex in self.examples() if self.examples else ():
            test = example(**ex)(test)
        return test


TARGETS: dict[str, Target] = {}


def target(
    *, prop: str, ci_examples: int = 40, weight: float = 1.0,
    examples: Callable[[], list[dict[str, Any]]] | None = None, **strategies: st.SearchStrategy
) -> Callable[[Callable[..., None]], Callable[..., None]]:
    """Register ``fn`` as a fuzz target named after the function."""

    def register(fn: Callable[..., None]) -> Callable[..., None]:
        TARGETS[fn.__name__] = Target(fn.__name__, fn, strategies, prop, ci_examples, weight,
                                      examples)
        return fn

    return register


class UnexpectedError(AssertionError):
    """A parser raised something other than the exceptions its contract allows."""


class FuzzTimeout(Exception):
    """Raised by a driver's watchdog inside an example that ran too long (a hang)."""


def attempt(
    what: str,
    fn: Callable[..., Any],
    *args: Any,
    allowed: tuple[type[BaseException], ...] = (TurboWireError,),
    **kwargs: Any,
) -> tuple[BaseException | None, Any]:
    """(None, result) or (the allowed exception, None); any other exception fails the target."""
    try:
        return None, fn(*args, **kwargs)
    except FuzzTimeout:
        raise
    except allowed as exc:
        return exc, None
    except Exception as exc:
        raise UnexpectedError(
            f"{what} raised {type(exc).__module__}.{type(exc).__name__} (allowed: "
            f"{', '.join(a.__name__ for a in allowed)}): {exc}"
        ) from exc


# ---- shared strategies ------------------------------------------------------------------------
U16 = (1 << 16) - 1
U32 = (1 << 32) - 1
U64 = (1 << 64) - 1


def uint(bits: int) -> st.SearchStrategy[int]:
    """Unsigned ints of a field width, biased to the edges a parser must handle."""
    top = (1 << bits) - 1
    return st.one_of(
        st.integers(0, 4), st.sampled_from([top, top - 1, 1 << (bits - 1), (1 << (bits - 1)) - 1]),
        st.integers(0, top),
    )


def _wire_text(max_size: int = 40) -> st.SearchStrategy[str]:
    """Strings protobuf can carry (valid UTF-8: no lone surrogates)."""
    return st.text(st.characters(exclude_categories=("Cs",)), max_size=max_size)


JSON_SCALARS = st.one_of(
    st.none(), st.booleans(), st.integers(), st.integers(-(1 << 80), 1 << 80),
    st.floats(allow_nan=True, allow_infinity=True), _wire_text(30),
)
JSON_VALUES = st.recursive(
    JSON_SCALARS,
    lambda inner: st.lists(inner, max_size=6) | st.dictionaries(_wire_text(12), inner, max_size=6),
    max_leaves=25,
)


def _deep(n: int, kind: str) -> str:
    return ("[" * n + "]" * n) if kind == "list" else ('{"a":' * n + "1" + "}" * n)


DEEP_JSON = st.builds(_deep, st.sampled_from([200, 5_000, 100_000]), st.sampled_from(["list",
                                                                                      "dict"]))


def json_text() -> st.SearchStrategy[str]:
    """Text a JSON parser gets from a peer: valid JSON of any shape, near-JSON, deep nesting."""
    return st.one_of(
        JSON_VALUES.map(lambda v: json.dumps(v)),  # NaN / Infinity included, as Python writes them
        _wire_text(60),
        DEEP_JSON,
        st.sampled_from(['{"a": 1', "nul", "[1,]", '{"a":1}{"b":2}', "1" * 5000, "-0", "1e999"]),
    )


def flip_bits(buf: bytearray, positions: Sequence[int]) -> None:
    for p in positions:
        buf[p // 8] ^= 1 << (p % 8)


def mutate_bytes(data: st.DataObject, raw: bytes, label: str) -> tuple[bytes, str]:
    """A generic mutation of ``raw``: none, bit flips, truncation, extension, splice, garbage."""
    kind = data.draw(
        st.sampled_from(["none", "flip", "truncate", "extend", "splice", "garbage"]),
        label=f"{label}.mutation",
    )
    buf = bytearray(raw)
    if kind == "flip" and buf:
        flip_bits(buf, data.draw(st.lists(st.integers(0, len(buf) * 8 - 1), min_size=1,
                                          max_size=4, unique=True), label=f"{label}.bits"))
    elif kind == "truncate":
        buf = buf[: data.draw(st.integers(0, max(0, len(buf) - 1)), label=f"{label}.keep")]
    elif kind == "extend":
        buf += data.draw(st.binary(min_size=1, max_size=64), label=f"{label}.tail")
    elif kind == "splice" and buf:
        at = data.draw(st.integers(0, len(buf) - 1), label=f"{label}.at")
        chunk = data.draw(st.binary(min_size=1, max_size=16), label=f"{label}.bytes")
        buf[at : at + len(chunk)] = chunk
    elif kind == "garbage":
        buf = bytearray(data.draw(st.binary(min_size=len(buf), max_size=len(buf))))
    return bytes(buf), kind


# ======================================================================================
# (a) the chunk wire format: codec/wire.py, Codec.decode, kernels.decode_into (+ tail)
# ======================================================================================
HEAD_DIM = 64
NUM_LAYERS = 3
HEADS = 2
BLOCK = 16
NUM_BLOCKS = 8
TABLE_BLOCKS = 6  # a request's block table: enough for tokens 0..95
MAX_START = 48
MAX_TOKENS = 40
GUARD = 32  # cache elements of canary on either side of every cache
CACHE_KINDS = ("cpu_packed", "kv_first", "kv_first_hnd", "block_first")
DTYPES = ("bfloat16", "float16")
CACHE_ELEMS = NUM_BLOCKS * BLOCK * HEADS * HEAD_DIM * 2


def _presets() -> list[str]:
    from turbowire.codec import list_presets

    return list_presets()


PRESETS = _presets()


@functools.lru_cache(maxsize=None)
def codec_for(preset: str, num_layers: int = NUM_LAYERS) -> Any:
    from turbowire.codec import Codec

    return Codec(preset, HEAD_DIM, num_layers)


@functools.lru_cache(maxsize=2048)
def encoded_chunk(preset: str, layer: int, token_start: int, num_tokens: int, tag: int,
                  dtype: str, seed: int, num_layers: int = NUM_LAYERS) -> bytes:
    """A valid chunk of random K/V (keys with channel offsets, as real keys have)."""
    g = torch.Generator().manual_seed(seed * 7919 + token_start * 31 + num_tokens)
    shape = (num_tokens, HEADS, HEAD_DIM)
    k = torch.randn(shape, generator=g) * 2 + torch.randn(HEAD_DIM, generator=g) * 4
    v = torch.randn(shape, generator=g)
    dt = getattr(torch, dtype)
    codec = codec_for(preset, num_layers)
    return codec.encode(layer, k.to(dt), v.to(dt), tag=tag, token_offset=token_start).to_bytes()


def chunk_regions(preset: str, layer: int, token_start: int, num_tokens: int
                  ) -> dict[str, tuple[int, int]]:
    """Byte ranges [lo, hi) of a chunk's header and of each body section (k.codes, v.scales...)."""
    lay = codec_for(preset).layout(layer, num_tokens, HEADS, token_start)
    out = {"header": (0, 48), "header.checksums": (40, 48)}
    for name, stream, base in (("k", lay.k, lay.k_offset), ("v", lay.v, lay.v_offset)):
        for sec, (off, size) in stream.sections.items():
            if size:
                out[f"{name}.{sec}"] = (base + off, base + off + size)
    out["body"] = (48, lay.nbytes)
    return out


def _shape_view(kind: str, flat: torch.Tensor) -> torch.Tensor:
    inner = flat[GUARD : GUARD + CACHE_ELEMS]
    if kind == "cpu_packed":
        return inner.view(NUM_BLOCKS, HEADS, BLOCK, 2 * HEAD_DIM)
    if kind == "kv_first":
        return inner.view(2, NUM_BLOCKS, BLOCK, HEADS, HEAD_DIM)
    if kind == "kv_first_hnd":
        return inner.view(2, NUM_BLOCKS, HEADS, BLOCK, HEAD_DIM).permute(0, 1, 3, 2, 4)
    if kind == "block_first":
        return inner.view(NUM_BLOCKS, 2, BLOCK, HEADS, HEAD_DIM)
    raise ValueError(kind)


@dataclass
class GuardedCache:
    """A paged cache view in the middle of a flat allocation with canary elements around it."""

    kind: str
    backing: torch.Tensor  # flat, GUARD elements of canary on either side
    cache: torch.Tensor
    layout: Any

    @classmethod
    def make(cls, kind: str, dtype: str, seed: int) -> GuardedCache:
        from turbowire.kernels import PagedKVLayout

        g = torch.Generator().manual_seed(seed)
        bits = torch.randint(-(1 << 15), 1 << 15, (CACHE_ELEMS + 2 * GUARD,), dtype=torch.int16,
                             generator=g)
        backing = bits.view(getattr(torch, dtype))
        cache = _shape_view(kind, backing)
        return cls(kind, backing, cache, PagedKVLayout.from_cache(cache, head_dim=HEAD_DIM))

    def copy(self) -> GuardedCache:
        backing = self.backing.clone()
        return GuardedCache(self.kind, backing, _shape_view(self.kind, backing), self.layout)

    def bits(self) -> torch.Tensor:
        return self.backing.view(torch.int16)

    def mask(self, writes: Sequence[tuple[Any, int, int]]) -> torch.Tensor:
        """Elements that writing these (block_ids, token_start, num_tokens) ranges may change
        (tokens whose block id is missing or out of range mark nothing)."""
        flat = torch.zeros(self.backing.numel(), dtype=torch.bool)
        k, v = self.layout.views(_shape_view(self.kind, flat))
        for ids, start, count in writes:
            ids = [int(i) for i in ids]
            for t in range(max(0, start), start + count):
                b = t // BLOCK
                if b < len(ids) and 0 <= ids[b] < NUM_BLOCKS:
                    k[ids[b], t % BLOCK] = True
                    v[ids[b], t % BLOCK] = True
        return flat


def same_bits(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> bool:
    """Bitwise equal, except that any NaN equals any NaN (implementations may differ in payload)."""
    if torch.equal(a, b):
        return True
    fa, fb = a.view(dtype), b.view(dtype)
    return bool(((a == b) | (torch.isnan(fa) & torch.isnan(fb))).all())


@dataclass
class DecodeCall:
    """One decode_into call's inputs, built by a target."""

    preset: str
    layer: int
    cache: GuardedCache
    items: list[Any]  # DecodeItem
    source: bytes
    tail_skip: int = 0  # > 0: decode_tail_into(items[0], skip_tokens=tail_skip)


# Where the Triton implementation runs: the GPU when there is one and the interpreter is off
# (TRITON_INTERPRET=0 python tests/fuzz/run.py --target decode_triton), else the interpreter.
TRITON_DEVICE = torch.device(
    "cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1" else "cpu")


def _run_decode(call: DecodeCall, impl: str) -> tuple[BaseException | None, GuardedCache]:
    from turbowire.kernels import decode_into, decode_tail_into

    codec = codec_for(call.preset)
    cache = call.cache.copy()
    source = torch.frombuffer(bytearray(call.source), dtype=torch.uint8) if call.source else \
        torch.zeros(0, dtype=torch.uint8)
    device = TRITON_DEVICE if impl == "triton" else torch.device("cpu")
    backing = cache.backing.to(device)
    target = _shape_view(cache.kind, backing)
    src = source.to(device)
    if call.tail_skip:
        exc, _ = attempt("decode_tail_into", decode_tail_into, codec, call.layer, target,
                         cache.layout, call.items[0], src, call.tail_skip)
    else:
        exc, _ = attempt(f"decode_into(impl={impl})", decode_into, codec, call.layer, target,
                         cache.layout, call.items, src, impl=impl)
    if device.type == "cuda":
        torch.cuda.synchronize()
    assert torch.equal(src.cpu(), source), f"decode ({impl}) wrote into its source buffer"
    cache.backing.copy_(backing.cpu())
    return exc, cache


def expected_after(call: DecodeCall) -> GuardedCache:
    """The cache after a correct decode: the reference codec's K/V scattered into the slots."""
    codec = codec_for(call.preset)
    cache = call.cache.copy()
    for item in call.items:
        data = call.source[item.in_offset : item.in_offset + item.nbytes]
        k, v = codec.decode(call.layer, data, expected_tag=item.expected_tag,
                            expected_tokens=item.num_tokens, expected_offset=item.token_start)
        skip = call.tail_skip
        cache.layout.scatter(cache.cache, item.block_ids, item.token_start + skip, k[skip:],
                             v[skip:])
    return cache


def check_decode(call: DecodeCall, impls: Sequence[str], expect: str,
                 expect_type: type[BaseException] | None = None) -> None:
    """Run ``call`` with each implementation and check the decode contract.

    expect: "ok" (must decode, to the reference codec's values), "fail" (must raise a
    TurboWireError, of ``expect_type`` when given) or "any". Always: the source is not written; a
    refused call writes nothing at all; a decode writes only the slots its items name; every
    implementation gives the same outcome (exception type, or the same cache bits).
    """
    dtype = call.cache.backing.dtype
    original = call.cache.bits()
    skip = call.tail_skip
    allowed = call.cache.mask([(it.block_ids, it.token_start + skip, it.num_tokens - skip)
                               for it in call.items])
    outcomes: list[tuple[str, BaseException | None, GuardedCache]] = []
    for impl in impls:
        exc, after = _run_decode(call, impl)
        changed = after.bits() != original
        if exc is not None:
            assert not changed.any(), (
                f"{impl}: refused with {type(exc).__name__} but changed "
                f"{int(changed.sum())} cache elements (must write nothing)"
            )
        else:
            stray = changed & ~allowed
            assert not stray.any(), (
                f"{impl}: wrote {int(stray.sum())} elements outside the item's slots (first at "
                f"flat index {int(stray.nonzero()[0])}, guard {GUARD} elements each side)"
            )
        outcomes.append((impl, exc, after))
        note(f"{impl}: {type(exc).__name__ + ': ' + str(exc) if exc else 'decoded'}")
    first_impl, first_exc, first_after = outcomes[0]
    for impl, exc, after in outcomes[1:]:
        assert type(exc) is type(first_exc), (
            f"implementations disagree: {first_impl} -> "
            f"{type(first_exc).__name__ if first_exc else 'decoded'}, {impl} -> "
            f"{type(exc).__name__ if exc else 'decoded'}"
        )
        if exc is None:
            assert same_bits(after.bits(), first_after.bits(), dtype), (
                f"{impl} and {first_impl} decoded to different cache bytes"
            )
    if expect == "ok":
        for impl, exc, after in outcomes:
            assert exc is None, f"{impl} refused a valid chunk: {type(exc).__name__}: {exc}"
        want = expected_after(call)
        assert same_bits(first_after.bits(), want.bits(), dtype), (
            f"{first_impl} decoded a valid chunk to values other than the reference codec's"
        )
    elif expect == "fail":
        for impl, exc, _ in outcomes:
            assert exc is not None, f"{impl} accepted a chunk it must refuse"
            if expect_type is not None:
                assert isinstance(exc, expect_type), (
                    f"{impl} refused with {type(exc).__name__}, expected {expect_type.__name__}"
                )


def _guards(data: st.DataObject, n: int, label: str) -> bytes:
    return data.draw(st.binary(min_size=n, max_size=n), label=label)


def _decode_item(**kw: Any) -> Any:
    from turbowire.kernels import DecodeItem

    return DecodeItem(**kw)


# ---- (a1) random bytes -------------------------------------------------------------------
@target(
    prop="random bytes (and random bytes behind a valid magic/version) given to parse_header, "
         "Codec.decode and decode_into (reference, C) raise a TurboWireError, write nothing",
    ci_examples=150,
    raw=st.one_of(st.binary(max_size=400),
                  st.binary(max_size=400).map(lambda b: b"TWKV\x01\x03" + b)),
    preset=st.sampled_from(PRESETS),
    layer=st.integers(0, NUM_LAYERS - 1),
    num_tokens=st.integers(1, MAX_TOKENS),
    data=st.data(),
)
def chunk_random_bytes(raw: bytes, preset: str, layer: int, num_tokens: int,
                       data: st.DataObject) -> None:
    from turbowire.codec.wire import parse_header

    codec = codec_for(preset)
    for form in (raw, bytearray(raw), memoryview(raw)):
        attempt("parse_header", parse_header, form)
        attempt("Codec.decode", codec.decode, layer, form, expected_tag=None)
    if raw:
        attempt("parse_header(tensor)", parse_header,
                torch.frombuffer(bytearray(raw), dtype=torch.uint8))
    cache = GuardedCache.make(data.draw(st.sampled_from(CACHE_KINDS)), "bfloat16", len(raw))
    item = _decode_item(block_ids=list(range(TABLE_BLOCKS)), token_start=0, num_tokens=num_tokens,
                        in_offset=0, nbytes=len(raw), expected_tag=None)
    call = DecodeCall(preset, layer, cache, [item], raw)
    check_decode(call, ("reference", "cpu"), "fail" if len(raw) < 52 else "any")


# ---- (a2) a valid chunk, mutated or handed over with the wrong expectations ---------------
HONEST_MUTATIONS = (
    "none", "drop_tag", "flip", "flip", "flip_many", "truncate", "extend", "wrong_tag",
    "wrong_layer", "wrong_tokens", "wrong_start", "bad_blocks", "bad_offset", "garbage", "tail",
)


def _chunk_case(data: st.DataObject, preset: str, dtype: str) -> dict[str, Any]:
    layer = data.draw(st.integers(0, NUM_LAYERS - 1), label="layer")
    token_start = data.draw(st.one_of(st.just(0), st.integers(0, MAX_START // BLOCK).map(
        lambda b: b * BLOCK), st.integers(0, MAX_START)), label="token_start")
    num_tokens = data.draw(st.one_of(st.just(BLOCK), st.integers(1, MAX_TOKENS)),
                           label="num_tokens")
    tag = data.draw(st.one_of(st.just(0), uint(31), uint(64)), label="tag")
    seed = data.draw(st.integers(0, 3), label="seed")
    chunk = encoded_chunk(preset, layer, token_start, num_tokens, tag, dtype, seed)
    return dict(layer=layer, token_start=token_start, num_tokens=num_tokens, tag=tag, chunk=chunk)


@target(
    prop="a valid chunk decodes (reference and C agree bit for bit, only the item's slots "
         "change); bit flips in header/codes/scales/means/sinks, truncation, a wrong tag, layer, "
         "token range, block ids or byte range are refused with a TurboWireError and nothing "
         "is written; decode_tail_into writes only the tail",
    ci_examples=300,
    weight=3.0,
    preset=st.sampled_from(PRESETS),
    dtype=st.sampled_from(DTYPES),
    cache_kind=st.sampled_from(CACHE_KINDS),
    mutation=st.sampled_from(HONEST_MUTATIONS),
    data=st.data(),
)
def decode_chunk(preset: str, dtype: str, cache_kind: str, mutation: str,
                 data: st.DataObject) -> None:
    from turbowire.codec import CodecError, IncompatiblePayloadError
    from turbowire.kernels import BlockIndexError

    case = _chunk_case(data, preset, dtype)
    layer, start, count, tag = case["layer"], case["token_start"], case["num_tokens"], case["tag"]
    chunk = bytearray(case["chunk"])
    ids = data.draw(st.permutations(range(NUM_BLOCKS)), label="block_table")[:TABLE_BLOCKS]
    in_offset = placed = data.draw(st.integers(0, 4), label="in_offset/16") * 16
    nbytes = len(chunk)
    expected_tag: int | None = tag
    expect, expect_type, skip = "ok", None, 0
    layer_arg = layer
    regions = chunk_regions(preset, layer, start, count)
    if mutation == "drop_tag":
        expected_tag = None
    elif mutation in ("flip", "flip_many"):
        lo, hi = regions[data.draw(st.sampled_from(sorted(regions)), label="region")]
        bits = st.integers(lo * 8, hi * 8 - 1)
        n = 1 if mutation == "flip" else data.draw(st.integers(2, 6), label="flips")
        flip_bits(chunk, data.draw(st.lists(bits, min_size=n, max_size=n, unique=True),
                                   label="bits"))
        # wsum32 catches every single flipped bit; several may cancel (then: any outcome, but
        # the implementations must still agree)
        expect, expect_type = ("fail", CodecError) if n == 1 else ("any", None)
    elif mutation == "truncate":
        nbytes = data.draw(st.integers(0, len(chunk) - 1), label="nbytes")
        chunk = chunk[:nbytes]
        expect, expect_type = "fail", CodecError
    elif mutation == "extend":
        extra = data.draw(st.binary(min_size=1, max_size=64), label="extra")
        chunk += extra
        nbytes = len(chunk)
        expect = "any"
    elif mutation == "wrong_tag":
        expected_tag = data.draw(uint(64).filter(lambda t: t != tag), label="expected_tag")
        expect, expect_type = "fail", IncompatiblePayloadError
    elif mutation == "wrong_layer":
        layer_arg = data.draw(st.integers(0, NUM_LAYERS - 1).filter(lambda x: x != layer),
                              label="decode_layer")
        expect, expect_type = "fail", IncompatiblePayloadError
    elif mutation == "wrong_tokens":
        count = data.draw(st.integers(1, MAX_TOKENS).filter(lambda x: x != count),
                          label="item.num_tokens")
        expect, expect_type = "fail", IncompatiblePayloadError
    elif mutation == "wrong_start":
        start = data.draw(st.integers(0, MAX_START).filter(lambda x: x != start),
                          label="item.token_start")
        expect, expect_type = "fail", IncompatiblePayloadError
    elif mutation == "bad_blocks":
        first, last = start // BLOCK, (start + count - 1) // BLOCK
        how = data.draw(st.sampled_from(["out_of_range", "negative", "duplicate", "too_few"]),
                        label="bad_blocks")
        ids = list(ids)
        at = data.draw(st.integers(first, last), label="bad_at")
        if how == "out_of_range":
            ids[at] = data.draw(st.integers(NUM_BLOCKS, 1 << 40), label="bad_id")
        elif how == "negative":
            ids[at] = data.draw(st.integers(-(1 << 40), -1), label="bad_id")
        elif how == "duplicate":
            other = data.draw(st.integers(0, TABLE_BLOCKS - 1).filter(lambda j: j != at))
            ids[at] = ids[other]
        else:
            ids = ids[:last]
        expect, expect_type = "fail", BlockIndexError
    elif mutation == "bad_offset":
        total = placed + nbytes + 32
        in_offset = data.draw(st.one_of(st.integers(-(1 << 40), -1),
                                        st.integers(total - nbytes + 1, 1 << 40)),
                              label="item.in_offset")
        expect, expect_type = "fail", BlockIndexError
    elif mutation == "garbage":
        chunk = bytearray(data.draw(st.binary(min_size=len(chunk), max_size=len(chunk))))
        expect = "any"
    elif mutation == "tail":
        if count < 2:
            return
        skip = data.draw(st.integers(1, count - 1), label="skip_tokens")
    cache = GuardedCache.make(cache_kind, dtype, data.draw(st.integers(0, 3), label="cache_seed"))
    prefix = _guards(data, placed, "source_prefix")
    source = prefix + bytes(chunk) + _guards(data, 32, "source_suffix")
    item = _decode_item(block_ids=ids, token_start=start, num_tokens=count, in_offset=in_offset,
                        nbytes=nbytes, expected_tag=expected_tag)
    note(f"mutation={mutation} item={item} chunk={len(case['chunk'])} B")
    call = DecodeCall(preset, layer_arg, cache, [item], source, tail_skip=skip)
    impls = ("tail",) if skip else ("reference", "cpu")
    check_decode(call, impls, expect, expect_type)


# ---- (a3) forged chunks: checksums recomputed, so only the parser's own checks stand -------
_HEADER_FIELDS = {  # name: (index in codec.wire._HEADER's tuple, bits)
    "version": (1, 8), "hunits": (2, 8), "preset_id": (3, 16), "layer": (4, 16),
    "num_layers": (5, 16), "num_heads": (6, 16), "head_dim": (7, 16), "dtype": (8, 8),
    "flags": (9, 8), "reserved": (10, 16), "num_tokens": (11, 32), "token_offset": (12, 32),
    "body_nbytes": (13, 32), "tag": (14, 64),
}


def reseal(chunk: bytearray, *, body: bool = True) -> None:
    """Recompute the body checksum (over the body the header names) and the header checksum."""
    from turbowire.codec.wire import _HEADER, wsum32

    fields = list(_HEADER.unpack(bytes(chunk[:48])))
    if body:
        end = min(len(chunk), 48 + fields[13])
        seg = bytes(chunk[48:end])
        seg += bytes(-len(seg) % 4)
        fields[15] = wsum32(torch.frombuffer(bytearray(seg), dtype=torch.uint8)) if seg else 0
    head = _HEADER.pack(*fields)
    check = wsum32(torch.frombuffer(bytearray(head[:44]), dtype=torch.uint8))
    chunk[:48] = head[:44] + struct.pack("<I", check)


@target(
    prop="chunks whose header fields or body sections a peer forged, with both checksums "
         "recomputed (wsum32 is no MAC), decode or raise a TurboWireError; the reference and the "
         "C codec agree (exception type or cache bits) and write only the item's slots",
    ci_examples=250,
    weight=3.0,
    preset=st.sampled_from(PRESETS),
    dtype=st.sampled_from(DTYPES),
    cache_kind=st.sampled_from(CACHE_KINDS),
    data=st.data(),
)
def decode_forged(preset: str, dtype: str, cache_kind: str, data: st.DataObject) -> None:
    from turbowire.codec.wire import _HEADER

    case = _chunk_case(data, preset, dtype)
    layer, start, count, tag = case["layer"], case["token_start"], case["num_tokens"], case["tag"]
    chunk = bytearray(case["chunk"])
    what = data.draw(st.sampled_from(["header", "body", "both"]), label="forge")
    if what in ("body", "both"):
        regions = chunk_regions(preset, layer, start, count)
        names = sorted(n for n in regions if not n.startswith("header"))
        lo, hi = regions[data.draw(st.sampled_from(names), label="section")]
        fill = data.draw(st.sampled_from(["random", "ff", "00", "7f", "nan16", "inf16"]),
                         label="fill")
        n = hi - lo
        pattern = {"ff": b"\xff", "00": b"\x00", "7f": b"\x7f", "nan16": b"\x00\x7e",
                   "inf16": b"\x00\x7c"}
        chunk[lo:hi] = (data.draw(st.binary(min_size=n, max_size=n)) if fill == "random"
                        else (pattern[fill] * n)[:n])
    if what in ("header", "both"):
        fields = list(_HEADER.unpack(bytes(chunk[:48])))
        names = data.draw(st.lists(st.sampled_from(sorted(_HEADER_FIELDS)), min_size=1,
                                   max_size=3, unique=True), label="fields")
        for name in names:
            idx, bits = _HEADER_FIELDS[name]
            fields[idx] = data.draw(st.one_of(uint(bits), st.integers(
                max(0, fields[idx] - 2), min((1 << bits) - 1, fields[idx] + 2))), label=name)
        if data.draw(st.booleans(), label="consistent_flags"):
            fields[9] = 1 if fields[12] == 0 else 0
        chunk[:48] = _HEADER.pack(*fields)
        grow = data.draw(st.integers(0, 4096), label="grow")
        chunk += data.draw(st.binary(min_size=grow, max_size=grow), label="grown")
    reseal(chunk)
    ids = data.draw(st.permutations(range(NUM_BLOCKS)), label="block_table")[:TABLE_BLOCKS]
    nbytes = data.draw(st.sampled_from([len(case["chunk"]), len(chunk)]), label="nbytes")
    nbytes = min(nbytes, len(chunk))
    cache = GuardedCache.make(cache_kind, dtype, data.draw(st.integers(0, 3), label="cache_seed"))
    source = bytes(chunk) + _guards(data, 16, "source_suffix")
    item = _decode_item(block_ids=ids, token_start=start, num_tokens=count, in_offset=0,
                        nbytes=nbytes, expected_tag=tag)
    note(f"forged chunk header {_HEADER.unpack(bytes(chunk[:48]))}, item {item}")
    check_decode(DecodeCall(preset, layer, cache, [item], source), ("reference", "cpu"), "any")


# ---- (a4) a whole request: several items in one call, one of them bad ----------------------
@target(
    prop="decode_into with several chunks of one request is all-or-nothing: one flipped, "
         "truncated, forged or mistagged chunk and no slot of any item changes; reference and C "
         "agree",
    ci_examples=120,
    weight=2.0,
    preset=st.sampled_from(PRESETS),
    dtype=st.sampled_from(DTYPES),
    cache_kind=st.sampled_from(CACHE_KINDS),
    first_block=st.integers(0, 2),
    nitems=st.integers(2, 3),
    last_tokens=st.integers(1, BLOCK),
    bad=st.sampled_from(["none", "flip", "truncate", "wrong_tag", "forge_body", "garbage"]),
    data=st.data(),
)
def decode_request(preset: str, dtype: str, cache_kind: str, first_block: int, nitems: int,
                   last_tokens: int, bad: str, data: st.DataObject) -> None:
    from turbowire.codec import CodecError

    layer = data.draw(st.integers(0, NUM_LAYERS - 1), label="layer")
    ids = data.draw(st.permutations(range(NUM_BLOCKS)), label="block_table")[:TABLE_BLOCKS]
    which = data.draw(st.integers(0, nitems - 1), label="bad_item")
    source = bytearray()
    items = []
    expect, expect_type = "ok", None
    for i in range(nitems):
        b = first_block + i
        count = last_tokens if i == nitems - 1 else BLOCK
        tag = zlib.crc32(f"req\x00{b}".encode()) & 0x7FFFFFFF
        chunk = bytearray(encoded_chunk(preset, layer, b * BLOCK, count, tag, dtype, i))
        expected_tag: int | None = tag
        nbytes = len(chunk)
        if i == which and bad != "none":
            if bad == "flip":
                flip_bits(chunk, [data.draw(st.integers(0, len(chunk) * 8 - 1), label="bit")])
                expect, expect_type = "fail", CodecError
            elif bad == "truncate":
                nbytes = data.draw(st.integers(0, len(chunk) - 1), label="nbytes")
                chunk = chunk[:nbytes]
                expect, expect_type = "fail", CodecError
            elif bad == "wrong_tag":
                expected_tag = tag ^ data.draw(st.integers(1, U32), label="tag_xor")
                expect, expect_type = "fail", CodecError
            elif bad == "forge_body":
                lo = data.draw(st.integers(48, len(chunk) - 1), label="at")
                chunk[lo:] = data.draw(st.binary(min_size=len(chunk) - lo,
                                                 max_size=len(chunk) - lo))
                reseal(chunk)
                expect = "any"
            else:
                chunk = bytearray(data.draw(st.binary(min_size=len(chunk), max_size=len(chunk))))
                expect = "any"
        items.append(_decode_item(block_ids=ids, token_start=b * BLOCK, num_tokens=count,
                                  in_offset=len(source), nbytes=nbytes,
                                  expected_tag=expected_tag))
        source += chunk
        source += bytes(-len(source) % 16)
    cache = GuardedCache.make(cache_kind, dtype, which)
    call = DecodeCall(preset, layer, cache, items, bytes(source))
    check_decode(call, ("reference", "cpu"), expect, expect_type)


# ---- (a5) the Triton decode (Triton's interpreter on CPU; slow: few examples) -----------------
@target(
    prop="the Triton decode path (TRITON_INTERPRET=1 on CPU, or the GPU) refuses what the "
         "reference refuses, with the same exception type, and decodes the same bytes",
    ci_examples=0,
    weight=1.0,
    preset=st.sampled_from(PRESETS),
    mutation=st.sampled_from(["none", "flip", "truncate", "extend", "wrong_tag", "forge_header",
                              "forge_body", "garbage"]),
    cache_kind=st.sampled_from(("kv_first", "kv_first_hnd", "block_first")),
    dtype=st.sampled_from(DTYPES),
    data=st.data(),
)
def decode_triton(preset: str, mutation: str, cache_kind: str, dtype: str,
                  data: st.DataObject) -> None:
    from turbowire.codec import CodecError
    from turbowire.codec.wire import _HEADER

    case = _chunk_case(data, preset, dtype)
    layer, start, count, tag = case["layer"], case["token_start"], case["num_tokens"], case["tag"]
    chunk = bytearray(case["chunk"])
    expect, expect_type = "ok", None
    if mutation == "flip":
        flip_bits(chunk, [data.draw(st.integers(0, len(chunk) * 8 - 1), label="bit")])
        expect, expect_type = "fail", CodecError
    elif mutation == "truncate":
        chunk = chunk[: data.draw(st.integers(48, len(chunk) - 1), label="nbytes")]
        expect, expect_type = "fail", CodecError
    elif mutation == "extend":
        chunk += data.draw(st.binary(min_size=1, max_size=64), label="extra")
        expect = "any"
    elif mutation == "wrong_tag":
        tag ^= data.draw(st.integers(1, U32), label="tag_xor")
        expect, expect_type = "fail", CodecError
    elif mutation == "forge_header":
        fields = list(_HEADER.unpack(bytes(chunk[:48])))
        for name in data.draw(st.lists(st.sampled_from(sorted(_HEADER_FIELDS)), min_size=1,
                                       max_size=3, unique=True), label="fields"):
            idx, bits = _HEADER_FIELDS[name]
            fields[idx] = data.draw(uint(bits), label=name)
        chunk[:48] = _HEADER.pack(*fields)
        grow = data.draw(st.integers(0, 4096), label="grow")
        chunk += bytes(grow)
        reseal(chunk)
        expect = "any"
    elif mutation == "forge_body":
        lo = data.draw(st.integers(48, len(chunk) - 1), label="at")
        chunk[lo:] = data.draw(st.binary(min_size=len(chunk) - lo, max_size=len(chunk) - lo))
        reseal(chunk)
        expect = "any"
    elif mutation == "garbage":
        chunk = bytearray(data.draw(st.binary(min_size=len(chunk), max_size=len(chunk))))
        expect = "any"
    ids = data.draw(st.permutations(range(NUM_BLOCKS)), label="block_table")[:TABLE_BLOCKS]
    cache = GuardedCache.make(cache_kind, dtype, data.draw(st.integers(0, 3), label="cache_seed"))
    item = _decode_item(block_ids=ids, token_start=start, num_tokens=count, in_offset=0,
                        nbytes=len(chunk), expected_tag=tag)
    note(f"mutation={mutation} item={item} triton on {TRITON_DEVICE}")
    check_decode(DecodeCall(preset, layer, cache, [item], bytes(chunk) + bytes(16)),
                 ("reference", "triton"), expect, expect_type)


# ---- (a6) the LMCache container (turbowire/integrations/lmcache_serde.py) ---------------------
LMC_LAYERS, LMC_TOKENS = 2, 8


@functools.lru_cache(maxsize=16)
def _lmcache_case(preset: str, dtype: str, bind_key: bool, seed: int) -> tuple[Any, ...]:
    from lmcache.v1.distributed.api import ObjectKey

    from turbowire.integrations.lmcache_serde import (
        SerdeOptions,
        TurboWireDeserializer,
        TurboWireSerializer,
        _TurboWireCodecs,
    )

    codecs = _TurboWireCodecs(SerdeOptions.from_kwargs(
        {"preset": preset, "head_dim": HEAD_DIM, "bind_key": bind_key}))
    ser, de = TurboWireSerializer(codecs), TurboWireDeserializer(codecs)
    dt = getattr(torch, dtype)
    shape = torch.Size([2, LMC_LAYERS, LMC_TOKENS, HEADS * HEAD_DIM])
    g = torch.Generator().manual_seed(seed)
    kv = (torch.randn(tuple(shape), generator=g) * 2).to(dt)
    key = ObjectKey(chunk_hash=bytes(range(seed, seed + 16)), model_name="org/m", kv_rank=0)
    src = _lmc_obj(shape, dt)
    src.tensor.copy_(kv)
    from lmcache.v1.distributed.api import MemoryLayoutDesc

    size = ser.estimate_serialized_size(MemoryLayoutDesc(shapes=[shape], dtypes=[dt]))
    dst = _lmc_obj(torch.Size([size]), torch.uint8)
    assert ser.serialize(src, dst, key) == size
    blob = dst.tensor.numpy().tobytes()
    out = _lmc_obj(shape, dt)
    de.deserialize(dst, out, key)
    return de, key, shape, dt, blob, out.tensor.clone()


def _lmc_obj(shape: torch.Size, dtype: torch.dtype) -> Any:
    from lmcache.v1.memory_management import MemoryFormat, MemoryObjMetadata, TensorMemoryObj

    nbytes = shape.numel() * dtype.itemsize
    meta = MemoryObjMetadata(shape=shape, dtype=dtype, address=0, phy_size=nbytes, ref_count=1,
                             fmt=MemoryFormat.KV_2LTD, shapes=[shape], dtypes=[dtype])
    return TensorMemoryObj(torch.zeros(nbytes, dtype=torch.uint8), meta, None)


@target(
    prop="an LMCache L2 object (turbowire container) that is random, flipped, truncated, "
         "extended, forged (checksum recomputed) or another key's either decodes to the "
         "serialized values or raises a TurboWireError, leaving the destination untouched",
    ci_examples=80,
    preset=st.sampled_from(PRESETS),
    dtype=st.sampled_from(DTYPES),
    bind_key=st.booleans(),
    other_key=st.booleans(),
    data=st.data(),
)
def lmcache_container(preset: str, dtype: str, bind_key: bool, other_key: bool,
                      data: st.DataObject) -> None:
    from lmcache.v1.distributed.api import ObjectKey

    from turbowire.codec.wire import wsum32

    de, key, shape, dt, blob, want = _lmcache_case(preset, dtype, bind_key, 0)
    raw, kind = mutate_bytes(data, blob, "container")
    forged = False
    if data.draw(st.booleans(), label="forge_prefix") and len(raw) >= 48 + 4 * LMC_LAYERS:
        buf = bytearray(raw)
        at = data.draw(st.integers(0, 47 + 4 * LMC_LAYERS), label="forge_at")
        buf[at] = data.draw(st.integers(0, 255), label="forge_byte")
        prefix = bytearray(buf[: 48 + 4 * LMC_LAYERS])
        prefix[40:44] = bytes(4)
        buf[40:44] = struct.pack("<I", wsum32(torch.frombuffer(prefix, dtype=torch.uint8)))
        raw, forged = bytes(buf), True
    if other_key:
        key = ObjectKey(chunk_hash=bytes(16), model_name="org/other", kv_rank=1)
    if not raw:
        return
    src = _lmc_obj(torch.Size([len(raw)]), torch.uint8)
    src.tensor.copy_(torch.frombuffer(bytearray(raw), dtype=torch.uint8))
    dst = _lmc_obj(shape, dt)
    dst.tensor.view(torch.int16).fill_(0x5A5A)
    before = dst.tensor.clone()
    exc, _ = attempt("TurboWireDeserializer.deserialize", de.deserialize, src, dst, key)
    genuine = raw == blob and not (other_key and bind_key)
    note(f"mutation={kind} forged={forged} other_key={other_key} -> "
         f"{type(exc).__name__ if exc else 'decoded'}")
    if exc is not None:
        assert torch.equal(dst.tensor.view(torch.int16), before.view(torch.int16)), (
            "a refused object changed the destination"
        )
        assert not genuine, f"a valid object was refused: {type(exc).__name__}: {exc}"
        return
    assert not (other_key and bind_key), "an object bound to another key was decoded"
    # Whatever is accepted must be the stored object: every layer chunk is checksummed and every
    # prefix field checked against the layout, so only byte-identical chunks get this far.
    assert same_bits(dst.tensor.view(torch.int16), want.view(torch.int16), dt), (
        f"a damaged object ({kind}, forged prefix: {forged}) decoded to other values"
    )


# ======================================================================================
# (b) the side channel: protobuf messages, record_from_proto, StagingInfo, the servicer
# ======================================================================================
def _pb() -> Any:
    from turbowire.connector.sidechannel import sidechannel_pb2

    return sidechannel_pb2


def _uint32() -> st.SearchStrategy[int]:
    return uint(32)


def _uint64() -> st.SearchStrategy[int]:
    return uint(64)


def _spec_config() -> st.SearchStrategy[str]:
    canonical = st.dictionaries(_wire_text(12), JSON_VALUES, max_size=4).map(
        lambda d: json.dumps(d, sort_keys=True))
    return st.one_of(st.just(""), canonical, json_text())


def _kv_heads() -> st.SearchStrategy[list[int]]:
    return st.one_of(
        st.lists(_uint32(), max_size=8),
        st.integers(4094, 4098).map(lambda n: [8] * n),
    )


@st.composite
def record_messages(draw: Any) -> Any:
    """A CompatibilityRecord with random field values (some near our own)."""
    pb = _pb()
    return pb.CompatibilityRecord(
        model=draw(st.one_of(st.just("m"), _wire_text())),
        num_layers=draw(st.one_of(st.just(NUM_LAYERS), _uint32())),
        num_draft_layers=draw(st.one_of(st.just(0), _uint32())),
        kv_heads=draw(st.one_of(st.just([HEADS] * NUM_LAYERS), _kv_heads())),
        head_dim=draw(st.one_of(st.just(HEAD_DIM), _uint32())),
        block_size=draw(st.one_of(st.just(BLOCK), _uint32())),
        dtype=draw(st.one_of(st.just("bfloat16"), _wire_text())),
        preset=draw(st.one_of(st.just("tq4"), _wire_text())),
        format_version=draw(st.one_of(st.just(1), _uint32())),
        codec_format_version=draw(st.one_of(st.just(1), _uint32())),
        tp_size=draw(st.one_of(st.just(1), _uint32())),
        speculative_config=draw(_spec_config()),
    )


def _local_record(speculative: str = "") -> Any:
    from turbowire.connector.compat import CompatibilityRecord

    return CompatibilityRecord(
        model="m", num_layers=NUM_LAYERS, num_draft_layers=0, kv_heads=(HEADS,) * NUM_LAYERS,
        head_dim=HEAD_DIM, block_size=BLOCK, dtype="bfloat16", preset="tq4", format_version=1,
        codec_format_version=1, tp_size=1, speculative_config=speculative,
    )


LOCAL_SPECULATIVE = st.sampled_from([
    "", json.dumps({"method": "eagle", "model": "d", "num_speculative_tokens": 0},
                   sort_keys=True),
])


class _Aborted(Exception):
    """What grpc's ServicerContext.abort raises (it never returns)."""

    def __init__(self, code: Any, details: str) -> None:
        super().__init__(f"{code}: {details}")
        self.code = code


class FakeContext:
    def __init__(self) -> None:
        self.trailers: tuple[Any, ...] = ()

    def abort(self, code: Any, details: str) -> None:
        raise _Aborted(code, details)

    def set_trailing_metadata(self, md: Any) -> None:
        self.trailers = tuple(md)


def _staging_info() -> Any:
    from turbowire.connector.sidechannel.convert import StagingInfo

    return StagingInfo(agent_name="agent-p", agent_metadata=b"nixl-md", base_addr=1 << 20,
                       slot_bytes=1 << 16, num_slots=64, layer_offsets=(0, 4096, 8192),
                       device_id=0, mem_type="DRAM")


def _record_regressions() -> list[dict[str, Any]]:
    """Bug: compat._speculative_mismatch json.loads()s the peer's speculative_config unguarded."""
    rec = _pb().CompatibilityRecord
    return [dict(msg=rec(model="m", speculative_config=spec), local_spec=local, engine_id="d",
                 tp_rank=0)
            for spec, local in (("{", ""), ("[[1]]", '{"method": "eagle"}'), ("1", ""),
                                ("[" * 5000 + "]" * 5000, ""))]


@target(
    examples=_record_regressions,
    prop="a peer's CompatibilityRecord (random field values) gives record_from_proto a record "
         "or SideChannelProtocolError; comparing it with ours gives None or IncompatiblePeerError "
         "(on both sides); the Handshake servicer answers or aborts with a gRPC status, nothing "
         "else",
    ci_examples=100,
    weight=1.5,
    msg=record_messages(),
    local_spec=LOCAL_SPECULATIVE,
    engine_id=_wire_text(),
    tp_rank=st.one_of(st.just(0), _uint32()),
)
def sidechannel_record(msg: Any, local_spec: str, engine_id: str, tp_rank: int) -> None:
    from turbowire.connector.compat import IncompatiblePeerError
    from turbowire.connector.sidechannel.convert import MAX_LAYERS, record_from_proto
    from turbowire.connector.sidechannel.server import HandshakeCounters, SideChannelHandler

    ours = _local_record(local_spec)
    exc, theirs = attempt("record_from_proto", record_from_proto, msg)
    if exc is None:
        assert len(theirs.kv_heads) <= MAX_LAYERS
        for a, b in ((ours, theirs), (theirs, ours)):
            _, err = attempt("CompatibilityRecord.mismatch", a.mismatch, b)
            assert err is None or isinstance(err, IncompatiblePeerError), type(err)
            if a == b:
                assert err is None
            attempt("CompatibilityRecord.check", a.check, b)
    owner = types.SimpleNamespace(record=ours, counters=HandshakeCounters(),
                                  staging={0: _staging_info()}, engine_id="eng-p")
    req = _pb().HandshakeRequest(record=msg, engine_id=engine_id, tp_rank=tp_rank)
    ctx = FakeContext()
    exc, resp = attempt("SideChannel Handshake", SideChannelHandler(owner).Handshake, req, ctx,
                        allowed=(_Aborted,))
    if exc is None:
        assert isinstance(resp, _pb().HandshakeResponse)
        assert tp_rank == 0 and theirs == ours


@st.composite
def handshake_responses(draw: Any) -> Any:
    pb = _pb()
    num_layers = draw(st.integers(0, 5))
    slot_bytes = draw(st.one_of(st.just(1 << 16), _uint64()))
    offsets = draw(st.one_of(
        st.lists(st.integers(0, max(0, min(slot_bytes, U64) - 1)), max_size=num_layers),
        st.lists(_uint64(), max_size=6),
        st.integers(4095, 4098).map(lambda n: [0] * n),
    ))
    md_len = draw(st.sampled_from([0, 1, 16, (16 << 20), (16 << 20) + 1]))
    return pb.HandshakeResponse(
        engine_id=draw(_wire_text()),
        record=draw(record_messages()),
        agent_metadata=b"\x01" * md_len if md_len > 64 else draw(st.binary(min_size=md_len,
                                                                            max_size=md_len)),
        agent_name=draw(_wire_text()),
        staging=pb.StagingGeometry(
            base_addr=draw(_uint64()), slot_bytes=slot_bytes, num_slots=draw(_uint32()),
            layer_offsets=offsets, device_id=draw(_uint32()),
            mem_type=draw(st.one_of(st.sampled_from(["DRAM", "VRAM"]), _wire_text(8))),
        ),
    )


@target(
    prop="a HandshakeResponse with random staging geometry gives StagingInfo.from_response a "
         "StagingInfo whose pool is non-empty, whose memory type is DRAM/VRAM and whose layer "
         "offsets lie inside the slot, or SideChannelProtocolError",
    ci_examples=100,
    resp=handshake_responses(),
)
def sidechannel_staging(resp: Any) -> None:
    from turbowire.connector.sidechannel.convert import MAX_AGENT_METADATA, StagingInfo

    exc, info = attempt("StagingInfo.from_response", StagingInfo.from_response, resp)
    if exc is None:
        assert 0 < len(info.agent_metadata) <= MAX_AGENT_METADATA
        assert info.mem_type in ("DRAM", "VRAM")
        assert info.slot_bytes > 0 and info.num_slots > 0
        assert all(0 <= off < info.slot_bytes for off in info.layer_offsets)
        geo = resp.staging
        assert (info.base_addr, info.slot_bytes, info.num_slots, info.device_id) == (
            geo.base_addr, geo.slot_bytes, geo.num_slots, geo.device_id)
        assert list(info.layer_offsets) == list(geo.layer_offsets)


def _message_types() -> list[Any]:
    pb = _pb()
    return [pb.CompatibilityRecord, pb.StagingGeometry, pb.HandshakeRequest,
            pb.HandshakeResponse, pb.LeaseRequest, pb.LeaseReply, pb.PoolStatusRequest,
            pb.PoolStatusReply]


@st.composite
def wire_messages(draw: Any) -> tuple[Any, bytes]:
    """(message class, bytes): random bytes, or a valid serialization mutated."""
    pb = _pb()
    cls = draw(st.sampled_from(_message_types()))
    if draw(st.booleans()):
        return cls, draw(st.binary(max_size=300))
    valid = {
        pb.CompatibilityRecord: lambda: draw(record_messages()),
        pb.HandshakeRequest: lambda: pb.HandshakeRequest(record=draw(record_messages()),
                                                         engine_id="d", tp_rank=0),
        pb.HandshakeResponse: lambda: draw(handshake_responses()),
        pb.LeaseRequest: lambda: pb.LeaseRequest(request_ids=draw(st.lists(_wire_text(20),
                                                                            max_size=5))),
    }.get(cls, lambda: cls())()
    raw = valid.SerializeToString()
    buf = bytearray(raw)
    for _ in range(draw(st.integers(0, 3))):
        if buf:
            buf[draw(st.integers(0, len(buf) - 1))] = draw(st.integers(0, 255))
    return cls, bytes(buf[: draw(st.integers(0, len(buf)))]) if draw(st.booleans()) else bytes(buf)


def _bytes_regressions() -> list[dict[str, Any]]:
    rec = _pb().CompatibilityRecord
    return [dict(wire=(rec, rec(model="m", speculative_config="{").SerializeToString()))]


@target(
    examples=_bytes_regressions,
    prop="random and mutated bytes through every side-channel message's ParseFromString raise "
         "only protobuf's DecodeError; whatever parses goes through record_from_proto / "
         "StagingInfo.from_response / mismatch raising only turbowire errors",
    ci_examples=150,
    wire=wire_messages(),
)
def sidechannel_bytes(wire: tuple[Any, bytes]) -> None:
    from google.protobuf.message import DecodeError

    from turbowire.connector.compat import IncompatiblePeerError
    from turbowire.connector.sidechannel.convert import StagingInfo, record_from_proto

    cls, raw = wire
    msg = cls()
    exc, _ = attempt(f"{cls.__name__}.ParseFromString", msg.ParseFromString, raw,
                     allowed=(DecodeError,))
    if exc is not None:
        return
    pb = _pb()
    records = []
    if cls is pb.CompatibilityRecord:
        records.append(msg)
    elif cls in (pb.HandshakeRequest, pb.HandshakeResponse):
        records.append(msg.record)
    if cls is pb.HandshakeResponse:
        attempt("StagingInfo.from_response", StagingInfo.from_response, msg)
    for rec in records:
        err, theirs = attempt("record_from_proto", record_from_proto, rec)
        if err is None:
            _, m = attempt("mismatch", _local_record().mismatch, theirs)
            assert m is None or isinstance(m, IncompatiblePeerError)


def _lease_regressions() -> list[dict[str, Any]]:
    """Bug: a release from tp_rank 1 frees a lease whose only consumer is rank 0. Bug: a
    release naming another request's id (forged kv_transfer_params) freed that lease."""
    return [dict(leases=[("req", 1)], calls=[("release", ["req"], 1, "token")]),
            dict(leases=[("req", 2)], calls=[("release", ["req", "req"], 0, "token")]),
            dict(leases=[("req", 1)], calls=[("release", ["req"], 0, "none"),
                                             ("release", ["req"], 0, "wrong")])]


@target(
    examples=_lease_regressions,
    prop="lease release/heartbeat with random request ids, TP ranks and lease tokens "
         "(LeaseRequest fields) acknowledge exactly the leased ids presented with their lease "
         "token; a lease's slots return to the pool only after every one of its consumer ranks "
         "0..consumers-1 released it with the token",
    ci_examples=100,
    leases=st.lists(st.tuples(_wire_text(6), st.integers(1, 4)), max_size=4,
                    unique_by=lambda t: t[0]),
    calls=st.lists(st.tuples(st.sampled_from(["release", "heartbeat"]),
                             st.lists(_wire_text(6), max_size=6), st.one_of(st.integers(0, 4),
                                                                             _uint32()),
                             st.sampled_from(["token", "token", "none", "wrong"])),
                   max_size=8),
)
def sidechannel_lease(leases: list[tuple[str, int]],
                      calls: list[tuple[str, list[str], int, str]]) -> None:
    from turbowire.connector.sidechannel.server import SideChannelHandler
    from turbowire.connector.staging import StagingPool

    pool = StagingPool(num_slots=32, lease_seconds=30.0)
    slots_of: dict[str, list[int]] = {}
    consumers: dict[str, int] = {}
    token_of: dict[str, str] = {}
    for rid, n in leases:
        slots_of[rid] = pool.reserve(rid, 2)
        token_of[rid] = pool.lease(rid, consumers=n).token
        consumers[rid] = n
    released: dict[str, set[int]] = {rid: set() for rid, _ in leases}
    servicer = SideChannelHandler(types.SimpleNamespace(leases=pool))
    for verb, ids, rank, proof in calls:
        tokens = {"token": [token_of.get(rid, "0" * 32) for rid in ids], "none": [],
                  "wrong": ["f" * 32 for _ in ids]}[proof]
        req = _pb().LeaseRequest(request_ids=ids, engine_id="d", tp_rank=rank, lease_tokens=tokens)
        fn = servicer.ReleaseLease if verb == "release" else servicer.Heartbeat
        exc, reply = attempt(f"SideChannel {verb}", fn, req, FakeContext(), allowed=(_Aborted,))
        assert exc is None
        done, unknown, either = Counter(), Counter(), Counter()
        for rid in ids:
            if verb == "release" and proof == "token" and rid in released and \
                    rank >= consumers[rid]:
                either[rid] += 1  # not one of this lease's consumers: acknowledging or refusing
                continue  # are both fine, counting it towards freeing the slots is not
            live = proof == "token" and rid in released and \
                len(released[rid] & set(range(consumers[rid]))) < consumers[rid]
            (done if live else unknown)[rid] += 1
            if verb == "release" and live:
                released[rid].add(rank)
        got_done, got_unknown = Counter(reply.done), Counter(reply.unknown)
        assert got_done + got_unknown == Counter(ids), f"{verb}({ids}): {reply}"
        # refused: held leases named without their token, a part of unknown; never an id that
        # presented its own lease's token
        got_refused = Counter(reply.refused)
        assert all(got_refused[r] <= got_unknown[r] for r in got_refused), f"{verb}: {reply}"
        assert proof != "token" or not reply.refused, f"{verb}({ids}) with tokens: {reply}"
        for rid in set(ids):
            assert done[rid] <= got_done[rid] <= done[rid] + either[rid], (
                f"{verb}({ids}, tp_rank={rank}): done={list(reply.done)} unknown="
                f"{list(reply.unknown)}; {rid!r} should be done {done[rid]} time(s)")
            assert unknown[rid] <= got_unknown[rid] <= unknown[rid] + either[rid], (
                f"{verb}({ids}, tp_rank={rank}): done={list(reply.done)} unknown="
                f"{list(reply.unknown)}; {rid!r} should be unknown {unknown[rid]} time(s)")
    held_slots = 0
    for rid, n in leases:
        all_released = set(range(n)) <= released[rid]
        held = pool.has_lease(rid)
        assert held != all_released, (
            f"lease {rid!r} with {n} consumers released by ranks {sorted(released[rid])}: "
            f"{'still held' if held else 'freed'}"
        )
        held_slots += len(slots_of[rid]) if held else 0
    used = pool.snapshot().used_slots
    assert used == held_slots, (
        f"{used} staging slots in use, {held_slots} held by the leases left: a lease's slots "
        "return to the pool exactly when the lease goes")


_DIGESTS = ("a" * 24, "b" * 24, "")


@target(
    prop="a Heartbeat (the claim) with random prompt digests and token counts (LeaseRequest "
         "prompt_digests/prompt_tokens, any lengths) is aborted as INVALID_ARGUMENT or extends "
         "exactly the leases named with their token and either no digest or the staged prompt; "
         "a lease staged for another prompt is unknown and prompt_mismatch, never refused, "
         "never extended",
    ci_examples=100,
    staged=st.lists(st.tuples(st.sampled_from(_DIGESTS[:2]), st.integers(0, 3)), min_size=1,
                    max_size=3),
    calls=st.lists(st.tuples(
        st.lists(st.integers(0, 3), max_size=4),  # lease indexes (3: not leased)
        st.lists(st.sampled_from([*_DIGESTS, "c" * 65]), max_size=5),
        st.lists(st.one_of(st.integers(0, 3), _uint64()), max_size=5),
        st.booleans()), max_size=6),
)
def sidechannel_claim_prompt(staged: list[tuple[str, int]],
                             calls: list[tuple[list[int], list[str], list[int], bool]]) -> None:
    from turbowire.connector.sidechannel.server import SideChannelHandler
    from turbowire.connector.staging import StagingPool

    pool = StagingPool(num_slots=16, lease_seconds=30.0)
    token_of: dict[str, str] = {}
    for i, (digest, n) in enumerate(staged):
        pool.reserve(f"r{i}", 1)
        token_of[f"r{i}"] = pool.lease(f"r{i}", prompt_digest=digest, num_tokens=n).token
    servicer = SideChannelHandler(types.SimpleNamespace(leases=pool))
    for idx, digests, counts, with_token in calls:
        ids = [f"r{i}" for i in idx]
        tokens = [token_of.get(rid, "0" * 32) if with_token else "f" * 32 for rid in ids]
        req = _pb().LeaseRequest(request_ids=ids, lease_tokens=tokens, prompt_digests=digests,
                                 prompt_tokens=counts)
        exc, reply = attempt("Heartbeat", servicer.Heartbeat, req, FakeContext(),
                             allowed=(_Aborted,))
        well_formed = (not digests and not counts) or (
            len(digests) == len(ids) == len(counts) and all(len(d) <= 64 for d in digests))
        assert (exc is None) == well_formed, f"{req}: {exc}"
        if exc is not None:
            continue
        mism, refused, unknown = set(reply.prompt_mismatch), set(reply.refused), set(reply.unknown)
        assert mism <= unknown and not mism & refused and not set(reply.done) & unknown
        for i, rid in enumerate(ids):
            live = rid in token_of
            claim = (digests[i], counts[i]) if digests else ("", 0)
            same = not claim[0] or claim == staged[int(rid[1:])] if live else False
            if live and with_token and same:
                assert rid in reply.done, f"{rid} {claim} vs {staged}: {reply}"
            else:
                assert rid in unknown, f"{rid} {claim} vs {staged}: {reply}"
                if live and with_token:
                    assert rid in mism
                if live and not with_token:
                    assert rid in refused and rid not in mism


# ======================================================================================
# (c) kv_transfer_params (connector/params.py)
# ======================================================================================
PARAM_KEYS = ("do_remote_prefill", "do_remote_decode", "remote_engine_id", "remote_request_id",
              "remote_host", "remote_port", "remote_block_ids", "remote_num_tokens", "tp_size",
              "turbowire_preset", "turbowire_format_version", "turbowire_prompt_hash",
              "turbowire_lease_seconds", "turbowire_dense_bytes", "turbowire_wire_bytes",
              "turbowire_fallback")


def _weird_value(oversized: bool = False) -> st.SearchStrategy[Any]:
    """A field value of the wrong type or range; ``oversized`` adds 100 kB strings and lists at
    the MAX_BLOCKS bound (kv_transfer_params)."""
    values = [
        JSON_VALUES,
        st.integers(-(1 << 70), 1 << 70),
        st.sampled_from([True, False, 0, -1, 65536, 1 << 24, (1 << 24) + 1, 1 << 63, float("nan"),
                         float("inf"), float("-inf"), ""]),
        st.integers(0, 3).map(lambda n: [[0] * n]),
        st.lists(st.one_of(st.integers(-3, 3), st.booleans(), st.floats(), st.none()),
                 max_size=6),
    ]
    if oversized:
        values += [st.just("x" * 100_000),
                   st.sampled_from([1 << 20, (1 << 20) + 1]).map(lambda n: list(range(n)))]
    return st.one_of(*values)


@st.composite
def transfer_params(draw: Any) -> Any:
    from turbowire.connector.params import prefill_result

    if draw(st.integers(0, 9)) == 0:
        return draw(JSON_VALUES)  # not even an object
    num_tokens = draw(st.integers(0, 200))
    nslots = -(-num_tokens // BLOCK)
    params = prefill_result(
        engine_id=draw(_wire_text()), request_id=draw(_wire_text()), host="127.0.0.1",
        port=draw(st.integers(1, 65535)), slots=draw(st.lists(st.integers(0, 1 << 40),
                                                              min_size=nslots, max_size=nslots)),
        num_tokens=num_tokens, tp_size=draw(st.integers(1, 8)), preset="tq4", format_version=1,
        prompt_hash=draw(st.none() | st.text(max_size=24)), lease_seconds=30.0, dense_bytes=1,
        wire_bytes=1,
    )
    for _ in range(draw(st.integers(0, 4))):
        op = draw(st.sampled_from(["set", "delete", "unknown", "nest_slots"]))
        key = draw(st.sampled_from(PARAM_KEYS))
        if op == "set":
            params[key] = draw(_weird_value(oversized=True))
        elif op == "delete":
            params.pop(key, None)
        elif op == "unknown":
            params[draw(_wire_text(20))] = draw(_weird_value(oversized=True))
        else:
            params["remote_block_ids"] = [params.get("remote_block_ids")]
    return params


@target(
    prop="RemotePrefill.parse of any JSON-like kv_transfer_params (wrong types, huge/negative/"
         "duplicated ids, oversized lists and strings, unknown fields) returns a RemotePrefill "
         "whose fields are in range or raises TransferParamsError; valid params round-trip",
    ci_examples=150,
    params=transfer_params(),
    block_size=st.sampled_from([1, 16, 128]),
)
def remote_prefill_params(params: Any, block_size: int) -> None:
    from turbowire.connector.geometry import blocks_for_tokens
    from turbowire.connector.params import (
        MAX_TOKENS,
        RemotePrefill,
        TransferParamsError,
        is_remote_decode,
        is_remote_prefill,
    )

    exc, remote = attempt("RemotePrefill.parse", RemotePrefill.parse, params, block_size,
                          allowed=(TransferParamsError,))
    if isinstance(params, dict):
        attempt("is_remote_prefill", is_remote_prefill, params)
        attempt("is_remote_decode", is_remote_decode, params)
    if exc is not None:
        return
    assert isinstance(remote.engine_id, str) and isinstance(remote.request_id, str)
    assert isinstance(remote.host, str) and isinstance(remote.preset, str)
    assert 1 <= remote.port <= 65535 and not isinstance(remote.port, bool)
    assert 0 <= remote.num_tokens <= MAX_TOKENS
    assert len(remote.slots) == blocks_for_tokens(remote.num_tokens, block_size)
    assert all(type(s) is int and s >= 0 for s in remote.slots)
    assert type(remote.tp_size) is int and remote.tp_size >= 1
    assert type(remote.format_version) is int
    assert remote.prompt_hash is None or isinstance(remote.prompt_hash, str)
    assert remote.fallback is None or isinstance(remote.fallback, str)
    again = RemotePrefill.parse(
        {"remote_engine_id": remote.engine_id, "remote_request_id": remote.request_id,
         "remote_host": remote.host, "remote_port": remote.port,
         "remote_block_ids": list(remote.slots), "remote_num_tokens": remote.num_tokens,
         "tp_size": remote.tp_size, "turbowire_preset": remote.preset,
         "turbowire_format_version": remote.format_version,
         "turbowire_prompt_hash": remote.prompt_hash, "turbowire_fallback": remote.fallback},
        block_size,
    )
    assert again == remote


_MAC_TOKEN = "fuzz-shared-token-1"
MAC_HOSTS = ("10.0.0.5", "::1", "[::1]", "prefill-0.svc", "prefill-0.svc.", "127.0.0.2",
             "::ffff:10.0.0.5", "evil.example", "10.0.0.5:5700", "dns:///10.0.0.5", "unix:/x",
             "127.1", "a b", "", "h" * 300, "fe80::1%eth0", "Prefill-0.SVC")


@st.composite
def signed_params(draw: Any) -> tuple[dict[str, Any], dict[str, Any], list[str]]:
    """(params a prefill engine with the token signed, the MAC's input it signed, what a
    hostile client then did to them: changed, deleted or retyped fields, another MAC)."""
    from turbowire.connector.params import (
        PARAMS_MAC_FIELD,
        mac_fields,
        params_mac_key,
        prefill_result,
    )

    num_tokens = draw(st.integers(0, 100))
    nslots = -(-num_tokens // BLOCK)
    kw = dict(
        engine_id=draw(_wire_text(12)), request_id=draw(_wire_text(12)),
        host=draw(st.sampled_from(MAC_HOSTS[:6])), port=draw(st.integers(1, 65535)),
        slots=draw(st.lists(st.integers(0, 1 << 20), min_size=nslots, max_size=nslots,
                            unique=True)),
        num_tokens=num_tokens, tp_size=draw(st.integers(1, 4)), preset="tq4", format_version=2,
        prompt_hash=draw(st.text("0123456789abcdef", min_size=24, max_size=24)),
        lease_seconds=draw(st.sampled_from([30.0, 6.0, 0.5, 86400.0])),
        lease_token=draw(st.text("0123456789abcdef", min_size=32, max_size=32)),
        fallback=draw(st.none() | st.sampled_from(["staging_full", "incomplete"])),
    )
    params = prefill_result(**kw, dense_bytes=1, wire_bytes=1,
                            mac_key=params_mac_key(_MAC_TOKEN))
    signed = mac_fields(**kw)
    ops: list[str] = []
    for _ in range(draw(st.integers(0, 3))):
        op = draw(st.sampled_from(["set", "nudge", "delete", "mac", "host", "retype", "nest"]))
        key = draw(st.sampled_from([*PARAM_KEYS, "turbowire_lease_token", PARAMS_MAC_FIELD]))
        ops.append(f"{op}:{key}")
        if op == "set":
            params[key] = draw(_weird_value())
        elif op == "nudge" and isinstance(params.get(key), int) and not isinstance(
                params.get(key), bool):
            params[key] = params[key] + draw(st.sampled_from([-1, 1]))
        elif op == "delete":
            params.pop(key, None)
        elif op == "mac":
            params[PARAMS_MAC_FIELD] = draw(st.one_of(
                st.text("0123456789abcdef", min_size=64, max_size=64), _weird_value()))
        elif op == "host":
            params["remote_host"] = draw(st.sampled_from(MAC_HOSTS))
        elif op == "retype" and isinstance(params.get(key), float):
            params[key] = int(params[key]) if params[key].is_integer() else str(params[key])
        elif op == "nest":
            params["remote_block_ids"] = [params.get("remote_block_ids")]
    return params, signed, ops


@target(
    prop="a decode engine with an auth_token accepts kv_transfer_params only when every field it "
         "acts on (MAC_FIELDS) is what the prefill engine signed: RemotePrefill.parse + "
         "verify_mac of params a client changed, deleted, retyped or re-MACed either raise "
         "TransferParamsError (UnauthenticatedParamsError for a bad MAC) or yield exactly the "
         "signed values; remote_host is then a plain host name or IP literal",
    ci_examples=150,
    case=signed_params(),
)
def params_mac_verify(case: tuple[dict[str, Any], dict[str, Any], list[str]]) -> None:
    from turbowire.connector.params import RemotePrefill, TransferParamsError, params_mac_key
    from turbowire.connector.peers import ip_literal

    params, signed, ops = case
    note(f"ops={ops}")
    exc, remote = attempt("RemotePrefill.parse", RemotePrefill.parse, params, BLOCK,
                          allowed=(TransferParamsError,))
    if exc is not None:
        return
    exc, _ = attempt("verify_mac", remote.verify_mac, params_mac_key(_MAC_TOKEN),
                     allowed=(TransferParamsError,))
    if exc is not None:
        assert exc.reason in ("unauthenticated_params", "bad_params"), exc
        return
    assert remote.mac_fields() == signed, f"accepted altered params: {ops}"
    host = remote.host
    assert host.strip() == host and "/" not in host and "%" not in host and "@" not in host
    assert ip_literal(host) is not None or ":" not in host


_PEER_PIECES = ["10.0.0.0/8", "10.0.0.1/8", "fd00::/8", "::1", "[::1]", "[::1]:5700",
                "127.0.0.1", "127.0.0.1:5700", "prefill-0.svc", "prefill-0.svc:5600", "h:0",
                "h:65536", "h:1:2", "[x]", "[::1", "a b", "", "*", "::ffff:10.0.0.1",
                "0.0.0.0/0", "::/0", "Prefill-0.SVC.", "127.1", "dns://x"]


@st.composite
def peer_entries(draw: Any) -> list[Any]:
    pieces = st.one_of(st.sampled_from(_PEER_PIECES), _wire_text(30),
                       st.text("0123456789abcdef.:/[]%-", max_size=30),
                       st.integers(0, 70000).map(lambda p: f"host-a.svc:{p}"),
                       st.builds(lambda a, b, c, d, m: f"{a}.{b}.{c}.{d}/{m}",
                                 *[st.integers(0, 300)] * 4, st.integers(0, 40)))
    entries = draw(st.lists(pieces, max_size=8))
    if draw(st.integers(0, 20)) == 0:
        entries.append(draw(st.one_of(st.integers(), st.none(), st.lists(st.integers()))))
    return entries


@target(
    prop="prefill_peers of any strings (CIDRs, IPs, names, ports, brackets, junk) parse into a "
         "PeerAllowlist or raise PeerAllowlistError; allows() of any host and port never raises, "
         "admits each listed IP:port and name, and admits nothing for a host that is not a plain "
         "name or IP literal",
    ci_examples=150,
    entries=peer_entries(),
    hosts=st.lists(st.tuples(st.one_of(st.sampled_from(MAC_HOSTS), _wire_text(20),
                                       st.text("0123456789abcdef.:[]%", max_size=24)),
                             st.integers(-1, 70000)), max_size=6),
)
def peer_allowlist(entries: list[Any], hosts: list[tuple[str, int]]) -> None:
    from turbowire.connector.peers import (
        PeerAllowlist,
        PeerAllowlistError,
        ip_literal,
        is_valid_host,
    )

    exc, allow = attempt("PeerAllowlist.parse", PeerAllowlist.parse, entries,
                         allowed=(PeerAllowlistError,))
    if exc is not None:
        return
    for host, port in hosts:
        _, ok = attempt("allows", allow.allows, host, port, allowed=())
        if ok and not allow.empty:
            assert is_valid_host(host), f"admitted {host!r}"
    for entry in entries:
        if "/" in entry:
            continue
        host, port = entry, 1
        if entry.startswith("[") and "]:" in entry:
            host, port = entry.rsplit(":", 1)[0], int(entry.rsplit(":", 1)[1])
        elif entry.count(":") == 1:
            host, port = entry.split(":")[0], int(entry.split(":")[1])
        if ip_literal(host) is not None or is_valid_host(host):
            assert allow.allows(host, port), f"{entry!r} listed, {host}:{port} refused"


# ======================================================================================
# (d) the store: blob container, stored-chunk decode, directory values, tier frames
# ======================================================================================
STORE_CHUNK = BLOCK  # tokens per stored chunk in these targets


def _blob(preset: str, chunk_hash: bytes, token_start: int, rank: int = 0, tp: int = 1,
          seed: int = 0) -> tuple[bytes, Any]:
    from turbowire.store.blob import BlobHeader
    from turbowire.store.keys import chunk_tag

    tag = chunk_tag(chunk_hash)
    chunks = [encoded_chunk(preset, layer, token_start, STORE_CHUNK, tag, "bfloat16", seed)
              for layer in range(NUM_LAYERS)]
    header = BlobHeader(NUM_LAYERS, rank, tp, token_start, STORE_CHUNK, chunk_hash,
                        tuple(len(c) for c in chunks))
    return header.pack() + b"".join(chunks), header


@target(
    prop="store blobs (random, flipped, truncated, extended, spliced, header forged with its "
         "CRC recomputed) give parse_header a BlobHeader that describes exactly the blob, or "
         "BlobError; check_expected then accepts only the chunk asked for (else BlobMismatch)",
    ci_examples=200,
    preset=st.sampled_from(PRESETS),
    token_start=st.sampled_from([0, STORE_CHUNK, 4 * STORE_CHUNK]),
    form=st.sampled_from(["bytes", "bytearray", "memoryview"]),
    data=st.data(),
)
def store_blob(preset: str, token_start: int, form: str, data: st.DataObject) -> None:
    from turbowire.store.blob import _FIXED, BlobError, check_expected, parse_header

    chash = bytes(range(16))
    if data.draw(st.integers(0, 4), label="random") == 0:
        raw, kind = data.draw(st.binary(max_size=200), label="raw"), "random"
        hdr = None
    else:
        blob, hdr = _blob(preset, chash, token_start)
        raw, kind = mutate_bytes(data, blob, "blob")
        if data.draw(st.booleans(), label="forge"):
            buf = bytearray(raw)
            if len(buf) >= _FIXED.size + 4 * NUM_LAYERS + 4:
                at = data.draw(st.integers(4, _FIXED.size + 4 * NUM_LAYERS - 1), label="forge_at")
                buf[at] = data.draw(st.integers(0, 255), label="forge_byte")
                layers = struct.unpack_from("<H", buf, 6)[0]
                end = _FIXED.size + 4 * layers
                if end + 4 <= len(buf):
                    struct.pack_into("<I", buf, end, zlib.crc32(bytes(buf[:end])))
                raw, kind = bytes(buf), "forged"
    view = {"bytes": bytes, "bytearray": bytearray, "memoryview": memoryview}[form](raw)
    exc, header = attempt("blob.parse_header", parse_header, view, allowed=(BlobError,))
    if exc is not None:
        assert kind != "none", f"a valid blob was refused: {exc}"
        return
    assert header.total_nbytes == len(raw)
    assert len(header.layer_nbytes) == header.num_layers >= 1
    offs = header.layer_offsets()
    assert all(header.nbytes <= o <= len(raw) for o in offs)
    if hdr is None:
        return
    err, _ = attempt("blob.check_expected", check_expected, header, chunk_hash=chash,
                     token_start=token_start, num_tokens=STORE_CHUNK, rank=0, tp_size=1,
                     layer_nbytes=hdr.layer_nbytes, allowed=(BlobError,))
    if err is None:
        assert header == hdr, "check_expected accepted a blob header other than the one asked for"


@target(
    prop="StoreWorker.decode_chunk (the store load of one chunk, all layers) on a flipped, "
         "truncated, forged or other chunk's blob returns the tokens written or raises a "
         "TurboWireError; nothing outside the chunk's slots (and nothing at all on refusal) "
         "changes in any layer's cache",
    ci_examples=60,
    weight=1.5,
    preset=st.sampled_from(PRESETS),
    chunk_index=st.integers(0, 2),
    skip=st.sampled_from([0, 0, 5]),
    data=st.data(),
)
def store_decode_chunk(preset: str, chunk_index: int, skip: int, data: st.DataObject) -> None:
    from turbowire.connector.coder import HostCoder
    from turbowire.connector.metadata import StoreChunk, StoreLoad
    from turbowire.connector.store_worker import StoreWorker
    from turbowire.store.blob import parse_header as parse_blob
    from turbowire.store.keys import StoreScope

    chash = bytes([chunk_index] * 16)
    token_start = chunk_index * STORE_CHUNK
    blob, _ = _blob(preset, chash, token_start, seed=chunk_index)
    raw, kind = mutate_bytes(data, blob, "blob")
    if data.draw(st.booleans(), label="forge_layer") and kind == "none":
        hdr = parse_blob(raw)
        layer = data.draw(st.integers(0, NUM_LAYERS - 1), label="layer")
        lo = hdr.layer_offsets()[layer]
        chunk = bytearray(raw[lo : lo + hdr.layer_nbytes[layer]])
        at = data.draw(st.integers(48, len(chunk) - 1), label="at")
        chunk[at] ^= data.draw(st.integers(1, 255), label="xor")
        reseal(chunk)
        raw = raw[:lo] + bytes(chunk) + raw[lo + len(chunk):]
        kind = "forged"
    codec = codec_for(preset)
    caches = [GuardedCache.make("cpu_packed", "bfloat16", layer) for layer in range(NUM_LAYERS)]
    sizes = {ts: [codec.encoded_nbytes(layer, STORE_CHUNK, HEADS, ts)
                  for layer in range(NUM_LAYERS)] for ts in (0, token_start)}
    from turbowire.connector.geometry import KVGeometry, LayerSpec

    geometry = KVGeometry(tuple(LayerSpec(f"l.{i}", HEADS, HEAD_DIM) for i in range(NUM_LAYERS)),
                          BLOCK, "bfloat16")
    stub = types.SimpleNamespace(
        codec=codec, rank=0, scope=StoreScope("ns", "m", preset, 1, STORE_CHUNK, 1),
        layer_nbytes=lambda ts: sizes[ts], geometry=geometry,
        caches=types.SimpleNamespace(device=torch.device("cpu"),
                                     tensors=[c.cache for c in caches],
                                     layouts=[c.layout for c in caches],
                                     kv_scales=lambda layer: None),
    )
    stub.coder = HostCoder(codec, None, stub.caches, None, None, None, None)  # its store decode
    ids = list(range(NUM_BLOCKS))[::-1][:4]
    first = token_start + (skip if skip else 0)
    load = StoreLoad("r", ids, first, [StoreChunk(token_start, chash)])
    before = [c.bits().clone() for c in caches]
    masks = [c.mask([(ids, first, token_start + STORE_CHUNK - first)]) for c in caches]
    exc, written = attempt("StoreWorker.decode_chunk", StoreWorker.decode_chunk, stub, load,
                           load.chunks[0], raw)
    for c, b, m in zip(caches, before, masks, strict=True):
        changed = c.bits() != b
        if exc is not None:
            assert not changed.any(), f"refused ({type(exc).__name__}) but a cache changed"
        else:
            assert not (changed & ~m).any(), "store decode wrote outside the chunk's slots"
    if exc is None:
        assert written == token_start + STORE_CHUNK - first
    elif kind == "none":
        raise AssertionError(f"a valid stored chunk was refused: {type(exc).__name__}: {exc}")


@st.composite
def engine_entries(draw: Any) -> bytes | str:
    base = {
        "engine_id": draw(st.one_of(st.just("eng-1"), _wire_text(20))),
        "role": draw(st.one_of(st.just("kv_consumer"), JSON_VALUES)),
        "side_channel": draw(st.one_of(st.just("127.0.0.1:5700"), JSON_VALUES)),
        "http_url": draw(st.one_of(st.none(), st.just("http://127.0.0.1:8000"), JSON_VALUES)),
        "scope": draw(st.one_of(
            st.just({"namespace": "ns", "model": "m", "preset": "tq4", "format_version": 1,
                     "chunk_tokens": 256, "tp_size": 1}),
            st.dictionaries(st.sampled_from(["namespace", "model", "preset", "format_version",
                                             "chunk_tokens", "tp_size"]), _weird_value()),
            JSON_VALUES)),
        "record": draw(st.one_of(st.just({}), JSON_VALUES)),
        "heartbeat": draw(st.one_of(st.just(1.0), JSON_VALUES)),
    }
    if draw(st.booleans()):  # the registry hash's entries carry their expiry (issue 33, L6)
        base["expires_at"] = draw(st.one_of(st.just(2e9), JSON_VALUES))
    if draw(st.booleans()):
        scope = base["scope"]
        if isinstance(scope, dict) and scope:
            scope[draw(st.sampled_from(sorted(scope)))] = draw(_weird_value())
    text = draw(st.one_of(st.just(json.dumps(base)), json_text()))
    return text.encode("utf-8", "surrogatepass") if draw(st.booleans()) else text


def _entry_regressions() -> list[dict[str, Any]]:
    """Bugs: EngineEntry.from_json lets OverflowError (Infinity in the scope) and RecursionError
    (deeply nested JSON) escape."""
    entry = ('{"engine_id": "e", "role": "kv_consumer", "side_channel": "h:1", "scope": '
             '{"namespace": "ns", "model": "m", "preset": "tq4", "format_version": Infinity, '
             '"chunk_tokens": 256, "tp_size": 1}, "record": {}, "heartbeat": 1.0}')
    return [dict(raw=entry), dict(raw=_deep(5000, "list").encode())]


@target(
    examples=_entry_regressions,
    prop="an engine registration read from Redis (any bytes, any JSON, a scope with wrong "
         "types, NaN/Infinity, deep nesting) gives EngineEntry.from_json an entry with a valid "
         "scope and a finite heartbeat and expiry, or None; it never raises",
    ci_examples=150,
    raw=engine_entries(),
)
def store_engine_entry(raw: bytes | str) -> None:
    from turbowire.store.directory import EngineEntry
    from turbowire.store.keys import StoreScope

    _, entry = attempt("EngineEntry.from_json", EngineEntry.from_json, raw, allowed=())
    assert entry is None or isinstance(entry, EngineEntry)
    if entry is not None:
        StoreScope.from_dict(entry.scope)
        assert math.isfinite(entry.heartbeat) and math.isfinite(entry.expires_at)


def _directory_regressions() -> list[dict[str, Any]]:
    """Bug: StoreScope.from_dict lets OverflowError escape for Infinity / -Infinity."""
    scope = {"namespace": "ns", "model": "m", "preset": "tq4", "format_version": float("inf"),
             "chunk_tokens": 256, "tp_size": 1}
    return [dict(count=b"12", key=b"", scope=scope)]


@target(
    examples=_directory_regressions,
    prop="other directory values: StoreScope.from_dict of any JSON object gives a scope or "
         "StoreKeyError; a stored byte count gives _as_count a non-negative int or None; a SCAN "
         "key gives Directory._is_chunk_key a bool",
    ci_examples=150,
    count=st.one_of(st.binary(max_size=24), _wire_text(24),
                    st.sampled_from(["0" * 19, "9" * 19, "-1", " 1", "1e3", b"\xb2", b"12"])),
    key=st.one_of(st.binary(max_size=120), st.lists(_wire_text(8), max_size=9).map(
        lambda p: "/".join(p).encode("utf-8", "surrogatepass"))),
    scope=st.one_of(JSON_VALUES, st.dictionaries(
        st.sampled_from(["namespace", "model", "preset", "format_version", "chunk_tokens",
                         "tp_size"]), _weird_value())),
)
def store_directory_values(count: Any, key: bytes, scope: Any) -> None:
    from turbowire.store.directory import Directory, _as_count
    from turbowire.store.keys import StoreKeyError, StoreScope

    _, n = attempt("_as_count", _as_count, count, allowed=())
    assert n is None or (type(n) is int and n >= 0)
    _, is_key = attempt("Directory._is_chunk_key", Directory._is_chunk_key, key, allowed=())
    assert isinstance(is_key, bool)
    if isinstance(scope, dict):
        attempt("StoreScope.from_dict", StoreScope.from_dict, scope, allowed=(StoreKeyError,))


class _FakeMemoryObj:
    def __init__(self, view: memoryview) -> None:
        self.byte_array = view


@target(
    prop="the tier frame of a stored object (CPU/disk/Redis: magic, CRC, length, name) that is "
         "random or damaged gives ChunkStore._unstage the blob or None, and a disk file with any "
         "contents gives _read_disk_header a key or None; never an exception",
    ci_examples=150,
    name=st.sampled_from([b"ns/m/tq4/v1/c256/tp1/" + b"ab" * 16 + b"/r0", b"x"]),
    blob=st.binary(max_size=200),
    data=st.data(),
)
def store_tier_frames(name: bytes, blob: bytes, data: st.DataObject) -> None:
    from turbowire.store.tiers import FRAME, MAGIC, ChunkStore, _crc

    frame = FRAME.pack(MAGIC, _crc(name, blob), len(blob), len(name)) + name + blob
    raw, kind = mutate_bytes(data, frame, "frame")
    if data.draw(st.booleans(), label="other_name"):
        name = name[::-1]
        kind = "renamed"
    _, got = attempt("ChunkStore._unstage", ChunkStore._unstage, None, name,
                     _FakeMemoryObj(memoryview(raw)), allowed=())
    if kind == "none":
        assert got == blob
    else:
        assert got is None or got == bytes(raw[FRAME.size + len(name):])
    with tempfile.NamedTemporaryFile(suffix=".pt") as f:
        f.write(raw)
        f.flush()
        _, key = attempt("ChunkStore._read_disk_header", ChunkStore._read_disk_header, f.name,
                         allowed=())
    assert key is None or hasattr(key, "chunk_hash")


# ======================================================================================
# (e) the proxy: client bodies, engine answers (turbowire/serving/proxy.py)
# ======================================================================================
class _FakeRequest:
    def __init__(self, body: bytes, declared: str | None) -> None:
        self.headers = {} if declared is None else {"content-length": declared}
        self._body = body

    async def stream(self) -> Any:
        for i in range(0, len(self._body), 7):
            yield self._body[i : i + 7]
        if not self._body:
            yield b""


def _body_regressions() -> list[dict[str, Any]]:
    """Bugs: read_json_body lets RecursionError (a 10 kB body of brackets) and the ValueError of
    an integer literal over 4300 digits escape: the client gets a 500, not a 400."""
    return [dict(body=_deep(5000, "list").encode(), declared=None),
            dict(body=b'{"max_tokens": ' + b"1" * 5000 + b"}", declared=None)]


@target(
    examples=_body_regressions,
    prop="a client's request body (any bytes, any JSON, deep nesting, lying Content-Length, "
         "transfer params in vllm_xargs) gives read_json_body a dict without transfer params "
         "(top level or in vllm_xargs) or an HTTPException (400/413)",
    ci_examples=100,
    body=st.one_of(json_text().map(lambda s: s.encode("utf-8", "surrogatepass")),
                   st.binary(max_size=100),
                   st.dictionaries(_wire_text(10), JSON_VALUES, max_size=4).map(
                       lambda d: json.dumps({**d, "kv_transfer_params": {"x": 1}}).encode()),
                   st.tuples(st.dictionaries(st.sampled_from(
                       ["kv_transfer_params", "ec_transfer_params", "foo"]), JSON_VALUES,
                       max_size=3), JSON_VALUES).map(
                       lambda t: json.dumps({"prompt": "x", "vllm_xargs": t[0],
                                             "ec_transfer_params": t[1]}).encode())),
    declared=st.one_of(st.none(), st.sampled_from(["0", "10", "99999999", "-1", "abc", "١٢"])),
)
def proxy_request_body(body: bytes, declared: str | None) -> None:
    from fastapi import HTTPException

    from turbowire.serving.proxy import read_json_body

    exc, got = attempt("read_json_body", lambda: asyncio.run(
        read_json_body(_FakeRequest(body, declared), 1 << 20)), allowed=(HTTPException,))
    if exc is None:
        assert isinstance(got, dict) and "kv_transfer_params" not in got
        assert "ec_transfer_params" not in got
        xargs = got.get("vllm_xargs")
        if isinstance(xargs, dict):
            assert "kv_transfer_params" not in xargs and "ec_transfer_params" not in xargs
    else:
        assert exc.status_code in (400, 413)


def _tokenize_regressions() -> list[dict[str, Any]]:
    """Bug: dict(body["chat_template_kwargs"]) of a list / bool / string raises."""
    msgs = [{"role": "user", "content": "hi"}]
    return [dict(endpoint="/v1/chat/completions", body={"messages": msgs,
                                                        "chat_template_kwargs": kw})
            for kw in ([""], True, "ab")]


@target(
    examples=_tokenize_regressions,
    prop="tokenize_request of any client body returns the /tokenize request or the prompt's "
         "token ids, or raises UnsupportedPrompt",
    ci_examples=150,
    endpoint=st.sampled_from(["/v1/completions", "/v1/chat/completions"]),
    body=st.dictionaries(
        st.sampled_from(["model", "prompt", "messages", "prompt_embeds", "chat_template_kwargs",
                         "reasoning_effort", "documents", "continue_final_message",
                         "add_special_tokens", "tools", "chat_template"]), JSON_VALUES,
        max_size=6),
)
def proxy_tokenize_request(endpoint: str, body: dict[str, Any]) -> None:
    from turbowire.serving.proxy import UnsupportedPrompt, tokenize_request

    exc, req = attempt("tokenize_request", tokenize_request, endpoint, body,
                       allowed=(UnsupportedPrompt,))
    if exc is None:
        assert isinstance(req, (dict, list))
        if isinstance(req, list):
            assert req and all(type(t) is int for t in req)


def _sse_regressions() -> list[dict[str, Any]]:
    """Bugs: a usage line cut inside a UTF-8 character at a network chunk boundary
    (UnicodeDecodeError), a usage that is not an object (AttributeError), deep nesting."""
    line = 'data: {"usage": {"completion_tokens": 2}, "choices": [{"text": "\u4f60"}]}'.encode()
    cut = line[: line.index("\u4f60".encode()) + 1]  # the network chunk ends inside a character
    return [dict(chunk=cut), dict(chunk=b'data: {"usage": "x"}'),
            dict(chunk=b'data: {"usage": ' + _deep(5000, "list").encode() + b"}")]


@target(
    examples=_sse_regressions,
    prop="the proxy's SSE usage scan (PDProxy._scan_usage) of any decode-engine stream chunk "
         "never raises: a bad chunk must not cut the client's stream",
    ci_examples=150,
    chunk=st.one_of(
        st.binary(max_size=200),
        st.lists(st.one_of(JSON_VALUES.map(lambda v: json.dumps({"usage": v})),
                           DEEP_JSON.map(lambda s: '{"usage": ' + s + "}"),
                           _wire_text(30)), max_size=4).map(
            lambda lines: "\n".join("data: " + x for x in lines).encode("utf-8",
                                                                         "surrogatepass")),
        st.binary(max_size=40).map(lambda b: b'data: {"usage": "' + b + b'"}'),
    ),
)
def proxy_sse_usage(chunk: bytes) -> None:
    from turbowire.serving.proxy import PDProxy

    rec = types.SimpleNamespace(completion_tokens=None)
    attempt("PDProxy._scan_usage", PDProxy._scan_usage, rec, chunk, allowed=())


# ---- issue 33: tenant salts, admin/API-key headers, engine model lists, chat content --------
_HEADER_VALUES = st.one_of(
    st.none(), _wire_text(40), st.sampled_from([
        "Bearer abc", "bearer  abc ", "Bearer", "Bearer a b", "Basic abc", "Bearer \x00",
        "Bearer " + "k" * 5000, " ", "Bearer \u00e9\u4f60",
    ]),
)


@target(
    prop="the proxy's tenant options and headers: TenantSalt.parse of any --tenant-salt-from "
         "value and secret gives a TenantSalt or ProxyConfigError; tenant_of of any header values "
         "gives a non-empty printable id or None; the salt is always 'tw1' + 64 hex characters "
         "(a valid vLLM cache_salt); bearer_token never raises; apply_tenant_salt of any body "
         "sets the salt or answers 400/401",
    ci_examples=150,
    spec=st.one_of(_wire_text(30), st.sampled_from(["api-key", "header:X-Tenant-Id", "header:",
                                                     "header:authorization", "API-KEY "])),
    secret=st.one_of(_wire_text(40), st.just("s" * 20)),
    auth=_HEADER_VALUES, tenant_header=_HEADER_VALUES,
    body=st.dictionaries(st.sampled_from(["cache_salt", "prompt", "model"]), JSON_VALUES,
                         max_size=3),
)
def proxy_tenant_salt(spec: str, secret: str, auth: str | None, tenant_header: str | None,
                      body: dict[str, Any]) -> None:
    from fastapi import HTTPException

    from turbowire.serving.proxy import (
        ProxyConfigError,
        TenantSalt,
        apply_tenant_salt,
        bearer_token,
    )

    _, token = attempt("bearer_token", bearer_token, auth, allowed=())
    assert token is None or (token and not any(c.isspace() for c in token))
    headers = {k: v for k, v in (("authorization", auth), ("x-tenant-id", tenant_header))
               if v is not None}
    for source in (spec, "api-key", "header:X-Tenant-Id"):
        exc, salt = attempt("TenantSalt.parse", TenantSalt.parse, source, secret,
                            allowed=(ProxyConfigError,))
        if exc is not None:
            continue
        _, tenant = attempt("TenantSalt.tenant_of", salt.tenant_of, headers, allowed=())
        assert tenant is None or (tenant and tenant.isprintable())
        if tenant is not None:
            value = salt.salt(tenant, None)
            assert value.startswith("tw1") and len(value) == 67
            assert all(c in "0123456789abcdef" for c in value[3:])
        got = dict(body)
        exc, _ = attempt("apply_tenant_salt", apply_tenant_salt, salt, got, headers,
                         allowed=(HTTPException,))
        if exc is None:
            assert isinstance(got["cache_salt"], str) and got["cache_salt"].startswith("tw1")
        else:
            assert exc.status_code in (400, 401)


@target(
    prop="an engine's /v1/models answer (any JSON) gives parse_model_list a dict of ModelCards "
         "keyed by their names (LoRA cards with a path) or a ValueError; never another error",
    ci_examples=150,
    payload=st.one_of(
        JSON_VALUES,
        st.lists(st.fixed_dictionaries({}, optional={
            "id": st.one_of(_wire_text(12), JSON_VALUES), "parent": JSON_VALUES,
            "root": st.one_of(_wire_text(12), JSON_VALUES)}), max_size=6).map(
            lambda cards: {"object": "list", "data": cards}),
    ),
)
def proxy_model_list(payload: Any) -> None:
    from turbowire.serving.proxy import ModelCard, parse_model_list

    exc, cards = attempt("parse_model_list", parse_model_list, payload, allowed=(ValueError,))
    if exc is None:
        assert isinstance(cards, dict)
        for name, card in cards.items():
            assert isinstance(card, ModelCard) and card.name == name and name
            assert card.lora_path is None or (isinstance(card.lora_path, str) and card.lora_path)


@target(
    prop="a client's chat messages (any JSON) give unsupported_input a reason string or None "
         "(text only); a list holding an image_url part is never None",
    ci_examples=150,
    endpoint=st.sampled_from(["/v1/completions", "/v1/chat/completions"]),
    messages=JSON_VALUES,
    image=st.booleans(),
)
def proxy_chat_content(endpoint: str, messages: Any, image: bool) -> None:
    from turbowire.serving.proxy import unsupported_input

    if image:
        messages = [{"role": "user", "content": [{"type": "image_url",
                                                  "image_url": {"url": "x"}}]}, messages]
    _, reason = attempt("unsupported_input", unsupported_input, endpoint,
                        {"messages": messages}, allowed=())
    assert reason is None or isinstance(reason, str)
    if image and endpoint == "/v1/chat/completions":
        assert reason is not None


@target(
    prop="store key inputs from any request fields (salt, LoRA name/path, multimodal items of "
         "any type) give chain_inputs_of and chunk_hashes keys or StoreKeyError; keys are 16 "
         "bytes and equal inputs give equal keys",
    ci_examples=150,
    salt=st.one_of(st.none(), _wire_text(20), JSON_SCALARS),
    lora=st.one_of(st.none(), st.tuples(JSON_SCALARS, JSON_SCALARS)),
    mm=st.lists(st.tuples(st.one_of(_wire_text(10), JSON_SCALARS),
                          st.one_of(st.integers(-5, 600), JSON_SCALARS),
                          st.one_of(st.integers(-5, 600), JSON_SCALARS)), max_size=4),
    embeds=st.booleans(),
)
def store_chain_inputs(salt: Any, lora: Any, mm: list[tuple[Any, Any, Any]],
                       embeds: bool) -> None:
    from turbowire.store.keys import StoreKeyError, chain_inputs_of, chunk_hashes

    def fake() -> Any:
        return types.SimpleNamespace(
            prompt_token_ids=list(range(300)), prompt_embeds=object() if embeds else None,
            cache_salt=salt,
            lora_request=None if lora is None else types.SimpleNamespace(
                lora_name=lora[0], lora_path=lora[1]),
            mm_features=[types.SimpleNamespace(identifier=i, mm_position=types.SimpleNamespace(
                offset=o, length=n)) for i, o, n in mm])

    exc, inputs = attempt("chain_inputs_of", chain_inputs_of, fake(),
                          allowed=(StoreKeyError,))
    if embeds:
        assert exc is not None and exc.reason == "store_unsupported_input"
    if exc is not None:
        return
    _, again = attempt("chain_inputs_of", chain_inputs_of, fake(), allowed=())
    assert again == inputs
    _, hashes = attempt("chunk_hashes", chunk_hashes, list(range(300)), 64, inputs=inputs,
                        allowed=())
    assert len(hashes) == 4 and all(len(h) == 16 for h in hashes)
    assert hashes == chunk_hashes(list(range(300)), 64, inputs=again)



# ======================================================================================
# MLA latent chunks: codec/latent.py through kernels.decode_into (a LatentPages cache)
# ======================================================================================
LATENT, ROPE = 256, 64


@target(
    prop="a mutated or forged latent chunk decodes to exactly the original rows or is refused "
         "with a TurboWireError and writes nothing; a K/V chunk is refused as a latent chunk",
    ci_examples=30,
    preset=st.sampled_from(["raw", "tq4", "k8v4"]),
    token_start=st.sampled_from([0, BLOCK, 2 * BLOCK]),
    num_tokens=st.integers(1, BLOCK),
    data=st.data(),
)
def decode_latent_chunk(preset: str, token_start: int, num_tokens: int,
                        data: st.DataObject) -> None:
    from turbowire.codec import Codec
    from turbowire.kernels import DecodeItem, EncodeItem, LatentPages, decode_into, encode_into

    codec = Codec(preset, 128, NUM_LAYERS)
    g = torch.Generator().manual_seed(token_start + num_tokens)
    src = torch.randn(NUM_BLOCKS, 1, BLOCK, LATENT + ROPE, generator=g).bfloat16()
    pages = LatentPages.from_cache(src, LATENT, ROPE)
    table = list(range(TABLE_BLOCKS))
    staging = torch.zeros(1 << 16, dtype=torch.uint8)
    (n,) = encode_into(codec, 1, src, pages, [EncodeItem(table, token_start, num_tokens, 0, 5)],
                       staging)
    if data.draw(st.booleans(), label="kv_chunk"):  # a K/V chunk where a latent one belongs
        kv = codec.encode(1, torch.randn(num_tokens, 2, 128).bfloat16(),
                          torch.randn(num_tokens, 2, 128).bfloat16(), tag=5,
                          token_offset=token_start)
        original = kv.to_bytes()
    else:
        original = bytes(staging[:n].numpy())
    raw, kind = mutate_bytes(data, original, "chunk")
    note(f"mutation {kind}, {len(raw)} of {len(original)} bytes")
    source = torch.frombuffer(bytearray(raw or b"\0"), dtype=torch.uint8)
    dst = torch.full_like(src, 3.0)
    exc, _ = attempt("decode_into(latent)", decode_into, codec, 1, dst, pages,
                     [DecodeItem([6, 7, 0, 1, 2, 3], token_start, num_tokens, 0, len(raw),
                                 expected_tag=5)], source)
    if exc is not None:
        assert (dst == 3.0).all(), "a refused latent chunk wrote into the cache"
        return
    assert original != b"" and raw[:n] == bytes(staging[:n].numpy()), \
        "a changed or K/V chunk was accepted as the latent chunk"


__all__ = ["TARGETS", "FuzzTimeout", "Target", "UnexpectedError", "attempt", "single_threaded",
           "target"]
