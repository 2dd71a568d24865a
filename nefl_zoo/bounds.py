"""Numbers and network addresses from options, settings and files, checked before they are used.

Standard library only: the torch-free runtime, the CLI and the Flower commands share it. Each
check returns what it was given, or raises ``ValueError`` as one line naming the option or
field, what it must be and what it got (``--poll: must be a number in (0, 3600], got inf``).

The limits say where a setting turns into a mistake: past them a loop would wait for ever, a
window would never fill, or a product of two settings would overflow.
"""

from __future__ import annotations

import ipaddress
import math
import re

MIN_MS = 0.001  # a microsecond: no inference request is quicker (a latency ratio over it stays finite)
MAX_MS = 86_400_000  # a day, in ms: beyond any deadline or latency of one request
MAX_WAIT_S = 86_400  # a day, in seconds: the longest quiet period or backoff step a policy waits
MAX_POLL_S = 3_600  # an hour between two requests for work
MAX_TIMEOUT_S = 604_800  # a week for one round's replies
MAX_WINDOW = 10_000  # observations a policy keeps (it sorts them at every request)
MAX_THREADS = 1_024
MAX_RUNS = 100_000  # timed (or untimed) rounds of a benchmark
MAX_BATCH = 65_536
MAX_PORT = 65_535

_HOST = re.compile(r"[A-Za-z0-9_]([A-Za-z0-9_-]{0,62})(\.[A-Za-z0-9_]([A-Za-z0-9_-]{0,62}))*\.?")


def _shown(bound: float) -> str:
    return str(int(bound)) if float(bound).is_integer() else repr(float(bound))


def _wanted(low: float, high: float, open_low: bool, open_high: bool, integer: bool) -> str:
    if integer:
        return f"an integer >= {_shown(low)}" if high == math.inf else f"an integer in {_shown(low)}..{_shown(high)}"
    if high == math.inf:
        return f"a finite number {'>' if open_low else '>='} {_shown(low)}"
    return f"a number in {'(' if open_low else '['}{_shown(low)}, {_shown(high)}{')' if open_high else ']'}"


def number(name: str, value: object, low: float, high: float = math.inf, *, open_low: bool = False,
           open_high: bool = False, integer: bool = False):
    """``value`` if it is a number (an ``int`` when ``integer``; never a ``bool``, NaN or an
    infinity) from ``low`` to ``high``, the ends excluded when ``open_low`` / ``open_high``;
    else ``ValueError``: ``NAME: must be a number in (0, 1], got 1.5``."""
    kinds = int if integer else (int, float)
    ok = isinstance(value, kinds) and not isinstance(value, bool)
    if ok and isinstance(value, float):
        ok = math.isfinite(value)
    if ok:
        ok = (value > low if open_low else value >= low) and (value < high if open_high else value <= high)
    if not ok:
        raise ValueError(f"{name}: must be {_wanted(low, high, open_low, open_high, integer)}, got {value!r}")
    return value


def host(name: str, text: object) -> str:
    """``text`` if it is a host name, an IPv4 address or an IPv6 address (bare: ``::1``);
    else ``ValueError`` naming ``name``."""
    if isinstance(text, str) and ":" in text:
        try:
            ipaddress.IPv6Address(text)
            return text
        except ValueError:
            pass
    elif isinstance(text, str) and len(text) <= 253 and _HOST.fullmatch(text):
        return text
    raise ValueError(f"{name}: must be a host name or an IP address, got {text!r}")


def address(name: str, text: object) -> tuple[str, int]:
    """``HOST:PORT`` (an IPv6 host in brackets: ``[::1]:9094``) as ``(host, port)``, the port
    in 1..65535; else ``ValueError``: ``NAME: must be HOST:PORT, got 'host:' (no port)``."""

    def refuse(why: str) -> ValueError:
        return ValueError(f"{name}: must be HOST:PORT, got {text!r} ({why})")

    if not isinstance(text, str):
        raise refuse("not text")
    if "://" in text:
        raise refuse("an address, not a URL: leave out the scheme")
    raw_host, colon, raw_port = text.rpartition(":")
    if not colon:
        raise refuse("no port")
    if raw_host.startswith("[") and raw_host.endswith("]"):
        raw_host = raw_host[1:-1]
        if ":" not in raw_host:
            raise refuse("brackets hold an IPv6 address")
    elif ":" in raw_host:
        raise refuse(f"an IPv6 address goes in brackets: [{raw_host}]:{raw_port}")
    if not raw_host:
        raise refuse("no host")
    if not raw_port:
        raise refuse("no port")
    if not (raw_port.isascii() and raw_port.isdigit() and len(raw_port) <= 5) or not 1 <= int(raw_port) <= MAX_PORT:
        raise refuse(f"the port must be in 1..{MAX_PORT}")
    try:
        return host(name, raw_host), int(raw_port)
    except ValueError:
        raise refuse(f"{raw_host!r} is not a host name or an IP address") from None


__all__ = ["address", "host", "number", "MAX_BATCH", "MAX_MS", "MAX_POLL_S", "MAX_PORT", "MAX_RUNS", "MAX_THREADS",
           "MAX_TIMEOUT_S", "MAX_WAIT_S", "MAX_WINDOW", "MIN_MS"]
