#!/usr/bin/env python3
"""Fetch the chat page's two JavaScript libraries from the npm registry into the package.

    python scripts/vendor_js.py          # (re)write proxy/api/static/vendor/
    python scripts/vendor_js.py --check  # download again and compare, write nothing

The page renders answers with ``marked`` (Markdown to HTML) and sanitises that HTML with
``DOMPurify`` before it touches the page: model output is untrusted. Both are served from the
package itself (no CDN), so the page works offline and its Content-Security-Policy can stay at
``script-src 'self'``.

Versions and the tarballs' ``dist.integrity`` (SRI sha512) are pinned here. For each package the
script asks the registry for ``/<name>/<version>``, checks that the registry still publishes the
pinned integrity, downloads the tarball, checks its sha512 against the pin, and extracts the
browser build and the licence files byte for byte (no file is modified). ``MANIFEST.json`` beside
them records where each file came from and its sha256; ``tests/api/test_chat_page.py`` checks the
files against it. To upgrade: change a version, set its integrity to the new one from
``https://registry.npmjs.org/<name>/<version>`` (``dist.integrity``), run the script, run the
chat page tests.

Standard library only.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import io
import json
import sys
import tarfile
import urllib.request
from pathlib import Path
from typing import Any

REGISTRY = "https://registry.npmjs.org"
VENDOR = Path(__file__).resolve().parents[1] / "proxy" / "api" / "static" / "vendor"

# name -> version, tarball integrity, {path in the tarball: file name in vendor/}
PINS: dict[str, dict[str, Any]] = {
    "marked": {
        "version": "18.2.1",
        "integrity": (
            "sha512-ii4bxCTCqqwpT86XZWgJNs+ZnAIZksmLGYMViWA7PDIXYIeNo1x6cDdX3JOip9NM/cI6p8z57FxliACboTruMA=="
        ),
        "files": {
            "package/lib/marked.umd.js": "marked.umd.js",
            "package/LICENSE": "marked.LICENSE",
        },
    },
    "dompurify": {
        "version": "3.5.0",
        "integrity": (
            "sha512-LYC0ZkE8P1V42JsRYTwMdme/2ET8SpOc5AA2eOFjP/IadvRd2fwiT4TVz5vkfy0XUx12aS2UaRkTnfVPNOv9vw=="
        ),
        "files": {
            "package/dist/purify.min.js": "purify.min.js",
            # DOMPurify is dual-licensed: Apache-2.0 or MPL-2.0.
            "package/LICENSE": "purify.LICENSE",
            "package/LICENSE-MPL": "purify.LICENSE-MPL",
        },
    },
}


def _get(url: str) -> bytes:
    request = urllib.request.Request(url, headers={"Accept": "application/json, */*"})
    with urllib.request.urlopen(request, timeout=60) as response:
        body: bytes = response.read()
        return body


def _sri_sha512(data: bytes) -> str:
    return "sha512-" + base64.b64encode(hashlib.sha512(data).digest()).decode("ascii")


def fetch(name: str, pin: dict[str, Any]) -> tuple[dict[str, bytes], dict[str, Any]]:
    """The pinned files of one package, checked, and their manifest entry."""
    version = pin["version"]
    meta = json.loads(_get(f"{REGISTRY}/{name}/{version}"))
    dist = meta["dist"]
    if dist.get("integrity") != pin["integrity"]:
        raise SystemExit(
            f"{name}@{version}: the registry now says integrity {dist.get('integrity')!r}, "
            f"the pin is {pin['integrity']!r}; refusing"
        )
    tarball = _get(dist["tarball"])
    actual = _sri_sha512(tarball)
    if actual != pin["integrity"]:
        raise SystemExit(f"{name}@{version}: tarball sha512 {actual} != pinned {pin['integrity']}")
    files: dict[str, bytes] = {}
    with tarfile.open(fileobj=io.BytesIO(tarball), mode="r:gz") as archive:
        for member_name, target in pin["files"].items():
            member = archive.getmember(member_name)
            if not member.isfile():
                raise SystemExit(f"{name}@{version}: {member_name} is not a plain file")
            extracted = archive.extractfile(member)
            assert extracted is not None
            files[target] = extracted.read()
    entry = {
        "version": version,
        "license": meta.get("license"),
        "tarball": dist["tarball"],
        "integrity": actual,
        "files": {
            target: {"from": source, "sha256": hashlib.sha256(files[target]).hexdigest()}
            for source, target in pin["files"].items()
        },
    }
    return files, entry


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--check", action="store_true", help="download and compare with vendor/; write nothing"
    )
    args = parser.parse_args(argv)
    manifest: dict[str, Any] = {}
    wanted: dict[str, bytes] = {}
    for name, pin in PINS.items():
        files, entry = fetch(name, pin)
        manifest[name] = entry
        wanted.update(files)
        print(f"{name}@{pin['version']}: tarball integrity ok ({entry['integrity'][:30]}…)")
    wanted["MANIFEST.json"] = (json.dumps(manifest, indent=2, sort_keys=True) + "\n").encode()
    if args.check:
        stale = [
            target
            for target, data in wanted.items()
            if not (VENDOR / target).is_file() or (VENDOR / target).read_bytes() != data
        ]
        extra = sorted({p.name for p in VENDOR.iterdir()} - set(wanted)) if VENDOR.is_dir() else []
        for target in stale:
            print(f"differs from the registry: vendor/{target}", file=sys.stderr)
        for target in extra:
            print(f"not from the registry: vendor/{target}", file=sys.stderr)
        return 1 if stale or extra else 0
    VENDOR.mkdir(parents=True, exist_ok=True)
    for target, data in wanted.items():
        (VENDOR / target).write_bytes(data)
        print(f"wrote vendor/{target} ({len(data):,} bytes)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
