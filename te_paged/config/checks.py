"""Argument checks for the library's entry points: each raises naming the argument, the value
and what is accepted, before anything is allocated (a caller's mistake loses nothing)."""

from __future__ import annotations

import enum
import math

import torch

__all__ = ["require_bool", "require_choice", "require_device", "require_int", "require_real"]


def require_int(name: str, value: object, minimum: int | None = None) -> int:
    """``value`` as an int (a bool or float is refused: ``page_size=64.0`` is a mistake)."""
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"{name} must be an int, got {value!r} ({type(value).__name__})")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


def require_real(name: str, value: object, minimum: float = 0.0, *, strict: bool = False) -> float:
    """``value`` as a finite real ``>= minimum`` (``> minimum`` with ``strict``)."""
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise TypeError(f"{name} must be a number, got {value!r} ({type(value).__name__})")
    bound = ">" if strict else ">="
    if not math.isfinite(value) or value < minimum or (strict and value == minimum):
        raise ValueError(f"{name} must be finite and {bound} {minimum:g}, got {value}")
    return float(value)


def require_bool(name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False, got {value!r}")
    return value


def require_choice(name: str, value: object, enum_cls: type[enum.Enum]) -> enum.Enum:
    """The member of ``enum_cls`` that ``value`` (a member or its value) names."""
    try:
        return enum_cls(value)
    except ValueError:
        allowed = ", ".join(repr(m.value) for m in enum_cls)
        raise ValueError(f"{name}={value!r} is not one of {allowed}") from None


def require_device(name: str, device: object) -> torch.device:
    """A ``torch.device`` that exists here: a CUDA device needs CUDA and a valid index."""
    if not isinstance(device, (str, torch.device)):
        raise TypeError(f"{name} must be a torch.device or a string, got {device!r}")
    try:
        dev = torch.device(device)
    except RuntimeError as e:
        raise ValueError(f"{name}={device!r} is not a device ({e})") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"{name}={device!r} but CUDA is not available here; use device='cpu'")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ValueError(
                f"{name}={device!r} but only {torch.cuda.device_count()} CUDA device(s) exist"
            )
    elif dev.type != "cpu":
        raise ValueError(f"{name}={device!r}: te_paged runs on 'cpu' or 'cuda' devices")
    return dev
