"""Which proxy a request to an upstream goes through (proxy/protocol/proxies.py, sans-IO): the
explicit setting, then the environment as curl and httpx read it."""

from __future__ import annotations

import pytest

from proxy.protocol.proxies import bypasses, proxy_for, redact

PROXY = "http://proxy.corp:3128"


@pytest.mark.parametrize(
    ("url", "configured", "environ", "expected"),
    [
        # Explicit wins over the environment; "none" is direct whatever it says.
        ("https://api.example.com", PROXY, {"HTTPS_PROXY": "http://other:1"}, PROXY),
        ("https://api.example.com", "none", {"HTTPS_PROXY": PROXY}, None),
        # The scheme's own variable, then ALL_PROXY; lower case before upper case.
        ("https://api.example.com", "", {"HTTPS_PROXY": PROXY}, PROXY),
        ("https://api.example.com", "", {"HTTP_PROXY": PROXY}, None),
        ("http://vllm:8000", "", {"HTTP_PROXY": PROXY}, PROXY),
        ("http://vllm:8000", "", {"ALL_PROXY": PROXY}, PROXY),
        ("http://vllm:8000", "", {"http_proxy": PROXY, "HTTP_PROXY": "http://x:1"}, PROXY),
        # curl's reading of a bare host:port.
        ("http://vllm:8000", "", {"http_proxy": "proxy.corp:3128"}, PROXY),
        # NO_PROXY.
        ("http://vllm:8000", "", {"HTTP_PROXY": PROXY, "NO_PROXY": "vllm"}, None),
        ("http://vllm:8000", "", {"HTTP_PROXY": PROXY, "no_proxy": "*"}, None),
        # httpoxy: under CGI, HTTP_PROXY may be a client's header.
        ("http://vllm:8000", "", {"HTTP_PROXY": PROXY, "REQUEST_METHOD": "GET"}, None),
        ("http://vllm:8000", "", {}, None),
    ],
)
def test_proxy_for(
    url: str, configured: str, environ: dict[str, str], expected: str | None
) -> None:
    assert proxy_for(url, configured, environ) == expected


@pytest.mark.parametrize(
    ("host", "port", "no_proxy", "direct"),
    [
        ("vllm.internal", 8000, "internal", True),
        ("vllm.internal", 8000, ".internal", True),
        ("vllm.internal", 8000, "*.internal", True),
        ("internal", 8000, ".internal", True),
        ("vllminternal", 8000, "internal", False),
        ("VLLM.Internal.", 8000, "vllm.internal", True),
        ("vllm.internal", 8000, "vllm.internal:9000", False),
        ("vllm.internal", 8000, "vllm.internal:8000", True),
        ("10.1.2.3", 8000, "10.0.0.0/8", True),
        ("11.1.2.3", 8000, "10.0.0.0/8", False),
        ("127.0.0.1", 80, "localhost, 127.0.0.1", True),
        ("::1", 80, "::1", True),
        ("::1", 8000, "[::1]:8000", True),
        ("example.com", 443, "", False),
        ("example.com", 443, " , ,", False),
    ],
)
def test_no_proxy_entries(host: str, port: int, no_proxy: str, direct: bool) -> None:
    assert bypasses(host, port, no_proxy) is direct


def test_passwords_never_reach_logs() -> None:
    assert redact("http://user:secret@proxy.corp:3128") == "http://user:***@proxy.corp:3128"
    assert redact(PROXY) == PROXY
