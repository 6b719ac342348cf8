"""A device allocation that fails, said in one line: the phase, its shapes, the device's memory and the keys that
lower it, in place of XLA's traceback.

XLA reports a failed allocation as ``RESOURCE_EXHAUSTED: Out of memory while trying to allocate 111.14GiB ...
[executable_name='jit_train_step']``, raised as ``jax.errors.JaxRuntimeError`` (jaxlib's ``XlaRuntimeError``) from
the call that runs the program. ``out_of_memory_report`` wraps a phase and turns exactly that into
``DeviceOutOfMemory``; every other error passes through unchanged. ``python -m fp8rl_jax.main`` prints it as one
``error: ...`` line and exits with status 5 (``EXIT_OUT_OF_MEMORY``).
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable, Iterator, Sequence

import jax

EXIT_OUT_OF_MEMORY = 5  # python -m fp8rl_jax.main's exit status after DeviceOutOfMemory (2: a config error)


class DeviceOutOfMemory(RuntimeError):
    """A device allocation failed in a phase of the run. The message (one line) names the phase, its shapes, the
    device memory and the config keys that lower it; ``xla_message`` keeps XLA's own first line."""

    def __init__(self, message: str, xla_message: str = ""):
        super().__init__(message)
        self.xla_message = xla_message


def is_out_of_memory(error: BaseException) -> bool:
    """True for XLA's failed allocation: a ``JaxRuntimeError`` whose message says ``RESOURCE_EXHAUSTED``."""
    return isinstance(error, jax.errors.JaxRuntimeError) and "RESOURCE_EXHAUSTED" in str(error)


def _gib(n: float) -> str:
    return f"{n / 2**30:.1f} GiB"


def device_memory(devices: Sequence[jax.Device] | None = None) -> str:
    """The allocator's view of this process's devices in a few words: the limit, the peak in use and what is in use
    now, of the device with the highest peak (``Device.memory_stats``; CPU keeps none)."""
    devices = list(devices if devices is not None else jax.local_devices())
    seen = []
    for d in devices:
        stats = d.memory_stats() if hasattr(d, "memory_stats") else None
        if stats:
            seen.append((stats.get("peak_bytes_in_use", stats.get("bytes_in_use", 0)), d, stats))
    if not seen:
        return f"no allocator statistics on {devices[0].platform if devices else 'this backend'}"
    peak, device, stats = max(seen, key=lambda s: s[0])
    parts = [f"{_gib(stats['bytes_limit'])} limit" if "bytes_limit" in stats else "limit unknown",
             f"{_gib(peak)} peak in use"]
    if "bytes_in_use" in stats:
        parts.append(f"{_gib(stats['bytes_in_use'])} in use now")
    where = f"{device}" + (f", the fullest of {len(devices)}" if len(devices) > 1 else "")
    return f"{', '.join(parts)} ({where})"


def _xla_request(message: str) -> str:
    """What XLA's message says it asked for: ``'111.14GiB for jit_train_step'``, or ''."""
    size = re.search(r"allocate\s+([\d.]+\s*[KMGTP]?i?B)", message)
    program = re.search(r"executable_name='([^']+)'", message)
    words = [size.group(1) if size else "", f"for {program.group(1)}" if program else ""]
    return " ".join(w for w in words if w)


def out_of_memory_message(phase: str, shapes: str, knobs: Sequence[str], error: BaseException,
                          devices: Sequence[jax.Device] | None = None) -> str:
    """The one line ``DeviceOutOfMemory`` says (see ``out_of_memory_report``)."""
    request = _xla_request(str(error))
    line = (f"device out of memory in the {phase} phase" + (f" (XLA asked for {request})" if request else "")
            + f": {shapes}; device memory: {device_memory(devices)}")
    if knobs:
        line += f". Lower it with {', '.join(knobs)}"
    return " ".join(line.split())  # one line, whatever the parts hold


@contextlib.contextmanager
def out_of_memory_report(phase: str, shapes: str | Callable[[], str],
                         knobs: Sequence[str] | Callable[[], Sequence[str]]) -> Iterator[None]:
    """Run the ``with`` block; XLA's failed allocation in it becomes ``DeviceOutOfMemory`` (raised ``from None``:
    the message says what the traceback would not). ``shapes`` and ``knobs`` may be callables, read only then."""
    try:
        yield
    except Exception as e:
        if not is_out_of_memory(e):
            raise
        shapes = shapes() if callable(shapes) else shapes
        knobs = knobs() if callable(knobs) else knobs
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise DeviceOutOfMemory(out_of_memory_message(phase, shapes, knobs, e), first) from None
