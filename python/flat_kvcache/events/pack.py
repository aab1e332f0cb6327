"""A MessagePack writer for the subset vLLM's KV events need.

It covers nil, bool, int, float64, str, bin, array and map, and chooses the shortest form for
each value, as the ``msgpack`` and ``msgspec`` packages do, so the bytes are the same as theirs.
"""

from __future__ import annotations

import struct

__all__ = ["WideMap", "packb"]


_PACK_B = struct.Struct(">B").pack
_PACK_H = struct.Struct(">H").pack
_PACK_I = struct.Struct(">I").pack
_PACK_Q = struct.Struct(">Q").pack
_PACK_b = struct.Struct(">b").pack
_PACK_h = struct.Struct(">h").pack
_PACK_i = struct.Struct(">i").pack
_PACK_q = struct.Struct(">q").pack
_PACK_d = struct.Struct(">d").pack


def _pack_int(value: int, out: bytearray) -> None:
    """The shortest MessagePack int: unsigned forms for values >= 0, signed ones below."""
    if value >= 0:
        if value < 0x80:
            out.append(value)  # positive fixint
        elif value <= 0xFF:
            out += b"\xcc" + _PACK_B(value)
        elif value <= 0xFFFF:
            out += b"\xcd" + _PACK_H(value)
        elif value <= 0xFFFF_FFFF:
            out += b"\xce" + _PACK_I(value)
        elif value <= 0xFFFF_FFFF_FFFF_FFFF:
            out += b"\xcf" + _PACK_Q(value)
        else:
            raise OverflowError(f"int {value} does not fit in MessagePack (at most 2**64 - 1)")
    elif value >= -32:
        out.append(value & 0xFF)  # negative fixint
    elif value >= -0x80:
        out += b"\xd0" + _PACK_b(value)
    elif value >= -0x8000:
        out += b"\xd1" + _PACK_h(value)
    elif value >= -0x8000_0000:
        out += b"\xd2" + _PACK_i(value)
    elif value >= -0x8000_0000_0000_0000:
        out += b"\xd3" + _PACK_q(value)
    else:
        raise OverflowError(f"int {value} does not fit in MessagePack (at least -2**63)")


def _pack_length(length: int, fix_tag: int, fix_limit: int, tags: bytes, out: bytearray, what: str) -> None:
    """A length header: the fix form below ``fix_limit`` (if any), then 8/16/32-bit forms.

    ``tags`` holds the 8-, 16- and 32-bit tag bytes (0 for a form the type does not have).
    """
    if length < fix_limit:
        out.append(fix_tag | length)
    elif length <= 0xFF and tags[0]:
        out += bytes((tags[0], length))
    elif length <= 0xFFFF:
        out += bytes((tags[1],)) + _PACK_H(length)
    elif length <= 0xFFFF_FFFF:
        out += bytes((tags[2],)) + _PACK_I(length)
    else:
        raise OverflowError(f"{what} of length {length} does not fit in MessagePack")


class WideMap(dict[str, object]):
    """A map written with the 16-bit header whatever its size (vLLM's ``layout="map"`` needs it)."""


def _pack(value: object, out: bytearray) -> None:
    if value is None:
        out.append(0xC0)
    elif value is True:
        out.append(0xC3)
    elif value is False:
        out.append(0xC2)
    elif isinstance(value, int):
        _pack_int(value, out)
    elif isinstance(value, float):
        out += b"\xcb" + _PACK_d(value)
    elif isinstance(value, str):
        data = value.encode("utf-8")
        _pack_length(len(data), 0xA0, 32, b"\xd9\xda\xdb", out, "str")
        out += data
    elif isinstance(value, bytes | bytearray | memoryview):
        data = bytes(value)
        _pack_length(len(data), 0, 0, b"\xc4\xc5\xc6", out, "bin")
        out += data
    elif isinstance(value, list | tuple):
        _pack_length(len(value), 0x90, 16, b"\x00\xdc\xdd", out, "array")
        for item in value:
            _pack(item, out)
    elif isinstance(value, dict):
        _pack_length(len(value), 0x80, 0 if type(value) is WideMap else 16, b"\x00\xde\xdf", out, "map")
        for key, item in value.items():
            _pack(key, out)
            _pack(item, out)
    else:
        raise TypeError(f"cannot encode {type(value).__name__} as MessagePack")


def packb(value: object) -> bytes:
    """``value`` as MessagePack bytes (None, bool, int, float, str, bytes, list/tuple, dict).

    Floats are always float64 and ints take their shortest form, like ``msgpack.packb`` with
    its defaults and msgspec's encoder. Anything else is a TypeError; an int outside
    ``[-2**63, 2**64)`` is an OverflowError.
    """
    out = bytearray()
    _pack(value, out)
    return bytes(out)
