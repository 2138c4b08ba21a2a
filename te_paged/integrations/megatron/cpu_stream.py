"""``PlaceholderStream``: what the Megatron CPU shims hand out where Megatron asks for a CUDA
stream (:mod:`.cpu_shims`, :mod:`.cpu_loop_shims`). For CPU runs only; nothing else uses it."""

from __future__ import annotations

__all__ = ["PlaceholderStream"]


class PlaceholderStream:
    """Stands in for a CUDA stream on CPU, where every op has finished when it returns: waits
    and synchronisations are no-ops."""

    def wait_event(self, event: object) -> None:
        pass

    def wait_stream(self, stream: object) -> None:
        pass

    def synchronize(self) -> None:
        pass
