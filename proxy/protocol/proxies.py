"""Which HTTP proxy, if any, a request to an upstream URL goes through (sans-IO).

An explicit ``proxy`` in the config wins; otherwise the environment decides, as curl and
httpx read it: ``http_proxy`` / ``https_proxy`` / ``all_proxy`` (lower case first, then upper
case), and ``no_proxy`` / ``NO_PROXY`` for the hosts that go direct. The choice is made here,
once per replica, so that its requests and its health checks cannot disagree about it.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Mapping
from urllib.parse import urlsplit

# The explicit "no proxy, whatever the environment says" (config.PROXY_DIRECT).
DIRECT = "none"


def redact(url: str) -> str:
    """The URL without its password, fit for logs and errors."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = f"{parts.username}:***@{parts.hostname}" + (f":{parts.port}" if parts.port else "")
    return parts._replace(netloc=netloc).geturl()


def proxy_for(url: str, configured: str, environ: Mapping[str, str]) -> str | None:
    """The proxy URL for requests to ``url``, or None to connect directly.

    ``configured`` is the model's ``proxy`` setting: a URL, :data:`DIRECT`, or "" for the
    environment's choice.
    """
    if configured == DIRECT:
        return None
    if configured:
        return configured
    parts = urlsplit(url)
    scheme = parts.scheme
    proxy = _env(environ, f"{scheme}_proxy") or _env(environ, "all_proxy")
    # httpoxy: under CGI, HTTP_PROXY may come from a client's "Proxy:" request header.
    if scheme == "http" and "REQUEST_METHOD" in environ and not environ.get("http_proxy"):
        proxy = _env(environ, "all_proxy")
    if not proxy:
        return None
    if bypasses(parts.hostname or "", parts.port, _env(environ, "no_proxy")):
        return None
    # "proxy.corp:3128" in the environment means http://proxy.corp:3128, as curl reads it.
    return proxy if "://" in proxy else f"http://{proxy}"


def _env(environ: Mapping[str, str], name: str) -> str:
    value = environ.get(name.lower())
    if value is None:
        value = environ.get(name.upper(), "")
    return value.strip()


def bypasses(host: str, port: int | None, no_proxy: str) -> bool:
    """Whether ``no_proxy`` (comma separated) sends ``host`` direct. Entries: ``*``; a host
    name, which also matches its subdomains (``example.com``, ``.example.com``,
    ``*.example.com``); an IP address or a CIDR block; any of these with ``:port``."""
    host = host.lower().strip("[]").rstrip(".")
    address = _address(host)
    for raw in no_proxy.split(","):
        entry = raw.strip().lower()
        if not entry:
            continue
        if entry == "*":
            return True
        entry, entry_port = _split_port(entry)
        if entry_port is not None and entry_port != port:
            continue
        entry = entry.strip("[]")
        if address is not None:
            try:
                if address in ipaddress.ip_network(entry, strict=False):
                    return True
            except ValueError:
                pass
            continue
        entry = entry.removeprefix("*").removeprefix(".").rstrip(".")
        if entry and (host == entry or host.endswith("." + entry)):
            return True
    return False


def _address(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        return ipaddress.ip_address(host)
    except ValueError:
        return None


def _split_port(entry: str) -> tuple[str, int | None]:
    """``host:port`` into its parts; a bare IPv6 address (several colons) has no port."""
    if entry.startswith("["):
        host, _, rest = entry[1:].partition("]")
        port = rest.removeprefix(":")
        return host, int(port) if port.isdigit() else None
    if entry.count(":") == 1:
        host, _, port = entry.partition(":")
        if port.isdigit():
            return host, int(port)
    return entry, None
