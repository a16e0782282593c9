"""Validation of backend URLs and ZMQ endpoints (standard library only: ``kvforge --help`` imports it)."""

from __future__ import annotations

from urllib.parse import urlsplit

__all__ = ["check_zmq_endpoint", "normalize_backend_url"]


def normalize_backend_url(url: object) -> str:
    """``http(s)://host[:port][/prefix]`` without a trailing slash; raises ValueError naming the problem."""
    if not isinstance(url, str) or not url:
        raise ValueError(f"backend URL: expected a non-empty string, got {url!r:.80}")
    if len(url) > 2048 or any(c.isspace() or ord(c) < 32 for c in url):
        raise ValueError(f"backend URL {url!r:.80}: expected no spaces or control characters")
    try:
        u = urlsplit(url)
        port = u.port  # a port out of range or not a number raises here
    except ValueError as exc:
        raise ValueError(f"backend URL {url!r:.80}: not a URL ({exc})") from None
    if u.scheme not in ("http", "https") or not u.hostname:
        raise ValueError(f"backend URL {url!r:.80}: expected http://host[:port] or https://host[:port]")
    if u.query or u.fragment or u.username or u.password:
        raise ValueError(f"backend URL {url!r:.80}: expected no query, fragment or credentials")
    host = f"[{u.hostname}]" if ":" in u.hostname else u.hostname
    netloc = host if port is None else f"{host}:{port}"
    return f"{u.scheme}://{netloc}{u.path}".rstrip("/")


def check_zmq_endpoint(name: str, ep: object) -> str | None:
    """``ep`` if it is a ZMQ endpoint (tcp://, ipc://, inproc://) or None; else ValueError naming ``name``."""
    if ep is None:
        return None
    if not isinstance(ep, str) or not ep.startswith(("tcp://", "ipc://", "inproc://")) or len(ep) > 512:
        raise ValueError(f"{name}: expected a ZMQ endpoint like tcp://host:5557, got {ep!r:.80}")
    return ep
