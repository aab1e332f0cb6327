"""Argument checks shared by the :mod:`flat_kvcache.torch` modules (private)."""

from __future__ import annotations

import operator
from typing import SupportsIndex, TypeAlias

import torch

#: Anything ``torch.device`` accepts.
DeviceLike: TypeAlias = "torch.device | str | int"

_DTYPE_ALIASES: dict[str, torch.dtype] = {
    "fp8": torch.float8_e4m3fn,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "half": torch.float16,
    "fp32": torch.float32,
    "float": torch.float32,
}


def as_int(value: object, name: str, *, minimum: int) -> int:
    """``value`` as an int (anything with ``__index__``, not a bool) that is ``>= minimum``."""
    if isinstance(value, bool) or not isinstance(value, SupportsIndex):
        raise TypeError(f"{name} must be an int, not {type(value).__name__}")
    result = operator.index(value)
    if result < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {result}")
    return result


def as_dtype(value: object, name: str) -> torch.dtype:
    """A floating torch dtype from a ``torch.dtype`` or a name (``"bfloat16"``, ``"fp8_e4m3"``...)."""
    if isinstance(value, torch.dtype):
        dtype = value
    elif isinstance(value, str):
        key = value.strip().lower().removeprefix("torch.")
        candidate = _DTYPE_ALIASES.get(key, getattr(torch, key, None))
        if not isinstance(candidate, torch.dtype):
            raise ValueError(f"{name}: unknown dtype {value!r}")
        dtype = candidate
    else:
        raise TypeError(f"{name} must be a torch.dtype or a dtype name, not {type(value).__name__}")
    if not dtype.is_floating_point:
        raise ValueError(f"{name} must be a floating dtype, got {dtype}")
    return dtype


def is_integer_dtype(dtype: torch.dtype) -> bool:
    """True for integer tensor dtypes (not floating, complex or bool)."""
    return not (dtype.is_floating_point or dtype.is_complex or dtype == torch.bool)


def storage_dtype(dtype: torch.dtype) -> torch.dtype:
    """One-byte floats (fp8) are stored as uint8: several kernels and ops cannot take them."""
    return torch.uint8 if dtype.itemsize == 1 else dtype


def as_device(device: DeviceLike) -> torch.device:
    """A ``torch.device`` from a device, a name (``"cuda:0"``) or a CUDA index."""
    return device if isinstance(device, torch.device) else torch.device(device)
