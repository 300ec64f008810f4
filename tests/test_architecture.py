"""The package layout is the architecture: each floor imports only the floors below it, there
are no import cycles (in ``proxy/`` and ``inference/``), the runtime never imports the tooling,
``sluice serve`` loads neither the tooling nor the local model stack it does not need, and each
runtime function and tooling module stays small enough to hold one role."""

from __future__ import annotations

import ast
import os
import textwrap
from pathlib import Path

import pytest

from tests.support import run_python

ROOT = Path(__file__).resolve().parent.parent
PROXY = ROOT / "proxy"
INFERENCE = ROOT / "inference"

# Lower floors first. A module may import its own floor and any floor below it.
FLOORS: dict[str, int] = {
    "proxy.protocol": 0,
    "proxy.config": 0,
    # The guards' public hook API and their windows: what user code imports, sans-IO.
    "proxy.guards": 0,
    # ZeroMQ on trio: read by the runtime's KV-event subscriber and the tooling's fake publisher.
    "proxy.zmq_trio": 0,
    "proxy.testing": 1,  # the fake upstream: a tool, standing on the floor alone
    "proxy.ops": 1,
    "proxy.relay": 2,
    "proxy.backends": 3,
    "proxy.server": 4,
    "proxy.api": 5,
    "proxy.cli": 6,
    "proxy.bench": 7,
}
# Imports inside a function (loaded only when that function runs) that may point upwards:
# the CLI's tooling subcommands.
LAZY_UPWARD = {("proxy.cli", "proxy.bench")}
# Packages that must not import a given library anywhere (the server layer owns them).
SERVER_ONLY = ("hypercorn", "quart_trio")
SANS_IO = ("trio", "quart", "hypercorn", "quart_trio", "httpx")
# The tooling: run beside Sluice (the bench, the fake upstream), never imported by what serves.
TOOLING = ("proxy.bench", "proxy.testing")
# The packages that serve requests: none of them may import the tooling, even lazily.
RUNTIME_PACKAGES = ("proxy.api", "proxy.relay", "proxy.backends", "proxy.server", "proxy.ops")
# One role per function: past this many lines a runtime function holds several.
MAX_RUNTIME_FUNCTION_LINES = 120
# One role per module of the tooling.
MAX_TOOLING_MODULE_LINES = 900


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def floor_of(module: str) -> str | None:
    for floor in sorted(FLOORS, key=len, reverse=True):
        if module == floor or module.startswith(floor + "."):
            return floor
    return None


def is_module_file(module: str) -> bool:
    path = ROOT.joinpath(*module.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def imports_of(path: Path) -> list[tuple[str, bool]]:
    """(imported module, whether the import is at module level) for every import."""
    tree = ast.parse(path.read_text(), str(path))
    package = (
        module_name(path) if path.name == "__init__.py" else module_name(path).rpartition(".")[0]
    )
    found: list[tuple[str, bool]] = []

    def visit(node: ast.AST, top: bool) -> None:
        for child in ast.iter_child_nodes(node):
            nested = top and not isinstance(
                child, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda
            )
            if isinstance(child, ast.Import):
                found.extend((alias.name, top) for alias in child.names)
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    anchor = package.split(".")
                    anchor = anchor[: len(anchor) - child.level + 1]
                    base = ".".join([*anchor, base] if base else anchor)
                # ``from package import module`` imports that module (and runs the package's
                # __init__ first, which is no dependency of the importer on the re-exports).
                if not all(is_module_file(f"{base}.{alias.name}") for alias in child.names):
                    found.append((base, top))
                found.extend((f"{base}.{alias.name}", top) for alias in child.names)
            visit(child, nested)

    visit(tree, True)
    return found


def proxy_modules() -> dict[str, Path]:
    return {module_name(path): path for path in PROXY.rglob("*.py")}


def all_modules() -> dict[str, Path]:
    """Every module of ``proxy/`` and ``inference/`` (the local model stack)."""
    return {**proxy_modules(), **{module_name(path): path for path in INFERENCE.rglob("*.py")}}


def is_tooling(module: str) -> bool:
    return module.startswith(tuple(f"{package}." for package in TOOLING)) or module in TOOLING


def test_every_module_sits_on_a_floor() -> None:
    homeless = [name for name in proxy_modules() if name != "proxy" and floor_of(name) is None]
    assert homeless == []


def test_each_floor_imports_only_the_floors_below_it() -> None:
    modules = proxy_modules()
    wrong = []
    for name, path in modules.items():
        floor = floor_of(name)
        if floor is None:
            continue
        for target, top in imports_of(path):
            target_floor = floor_of(target)
            if target_floor is None or target_floor == floor:
                continue
            if FLOORS[target_floor] > FLOORS[floor] and not (
                not top and (floor, target_floor) in LAZY_UPWARD
            ):
                wrong.append(f"{name} -> {target}")
            elif FLOORS[target_floor] == FLOORS[floor]:
                wrong.append(f"{name} -> {target} (same floor, another package)")
    assert wrong == []


def test_no_import_cycles_between_modules() -> None:
    modules = all_modules()
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        for target, _ in imports_of(path):
            if target in modules and target != name:
                graph[name].add(target)
    # Tarjan's strongly connected components: any component of two or more is a cycle.
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def connect(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in graph[node]:
            if target not in index:
                connect(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            # A package's __init__ re-exporting its own modules is no cycle of layers.
            if len(component) > 1:
                cycles.append(sorted(component))

    for node in graph:
        if node not in index:
            connect(node)
    assert cycles == []


@pytest.mark.parametrize("library", SERVER_ONLY)
def test_server_libraries_are_used_only_by_the_server_layer(library: str) -> None:
    users = sorted(
        name
        for name, path in proxy_modules().items()
        if floor_of(name) != "proxy.server"
        and any(target.split(".")[0] == library for target, _ in imports_of(path))
    )
    assert users == []


def test_protocol_is_sans_io() -> None:
    users = sorted(
        f"{name} -> {target}"
        for name, path in proxy_modules().items()
        if floor_of(name) == "proxy.protocol"
        for target, _ in imports_of(path)
        if target.split(".")[0] in SANS_IO
    )
    assert users == []


def test_serve_loads_no_tooling_and_no_model_stack(tmp_path: Path) -> None:
    """An upstream-only ``sluice serve``, started for real and stopped: what it imported. With
    no tracing endpoint, nothing of OpenTelemetry either (tracing off costs nothing)."""
    config = tmp_path / "upstream.toml"
    config.write_text(
        textwrap.dedent(
            """
            [server]
            host = "127.0.0.1"
            port = 0
            [upstream]
            preconnect = 0
            [models.remote]
            upstreams = ["http://127.0.0.1:9"]
            """
        )
    )
    script = textwrap.dedent(
        f"""
        import sys, trio
        from proxy.cli import build_parser, configure_logging
        from proxy.config import load_config
        from proxy.api.app import create_app
        from proxy.server.run import serve

        build_parser().parse_args(["serve", "--config", {str(config)!r}])
        configure_logging("WARNING")
        config = load_config({str(config)!r})
        app = create_app(config)

        async def main():
            stop = trio.Event()
            async with trio.open_nursery() as nursery:
                await nursery.start(lambda task_status: serve(
                    app, config, shutdown_trigger=stop.wait, task_status=task_status))
                stop.set()

        trio.run(main)
        forbidden = ("proxy.bench", "proxy.testing", "torch", "transformers", "matplotlib",
                     "proxy.backends.local", "opentelemetry", "proxy.ops.otel_adapter",
                     "proxy.api.identity", "jwt", "cryptography")
        print(sorted(name for name in sys.modules if name.startswith(forbidden)))
        """
    )
    result = run_python(
        script,
        env={name: value for name, value in os.environ.items() if not name.startswith("OTEL_")},
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1] == "[]", result.stdout


def test_grep_for_the_server_libraries_lands_only_in_the_server_layer() -> None:
    """The check anyone can do by hand: ``grep -r "hypercorn\\|quart_trio" proxy/``."""
    found = sorted(
        str(path.relative_to(ROOT))
        for path in PROXY.rglob("*")
        if path.is_file()
        and path.suffix in {".py", ".html", ".js", ".css"}
        and not path.is_relative_to(PROXY / "server")
        and any(word in path.read_text() for word in SERVER_ONLY)
    )
    assert found == []


def test_the_runtime_never_imports_the_tooling() -> None:
    """Not even inside a function: the bench and the fake run beside the app (the CLI starts
    them), so nothing that serves a request can reach them."""
    wrong = sorted(
        f"{name} -> {target}"
        for name, path in proxy_modules().items()
        if name.startswith(RUNTIME_PACKAGES)
        for target, _ in imports_of(path)
        if is_tooling(target)
    )
    assert wrong == []


def test_inference_imports_nothing_of_the_proxy() -> None:
    wrong = sorted(
        f"{name} -> {target}"
        for name, path in all_modules().items()
        if name.startswith("inference")
        for target, _ in imports_of(path)
        if target.split(".")[0] == "proxy"
    )
    assert wrong == []


def long_functions(path: Path) -> list[tuple[str, int]]:
    """(name, lines) of each function in ``path`` longer than the runtime's limit."""
    tree = ast.parse(path.read_text(), str(path))
    return [
        (node.name, lines)
        for node in ast.walk(tree)
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        and node.end_lineno is not None
        and (lines := node.end_lineno - node.lineno + 1) > MAX_RUNTIME_FUNCTION_LINES
    ]


def test_no_runtime_function_is_over_the_limit() -> None:
    """Runtime: everything but the tooling (what ``sluice serve`` can import), and
    ``inference/``."""
    found = [
        f"{name}.{function} ({lines} lines)"
        for name, path in sorted(all_modules().items())
        if not is_tooling(name)
        for function, lines in long_functions(path)
    ]
    assert found == []


def test_no_tooling_module_is_over_the_limit() -> None:
    found = sorted(
        f"{path.relative_to(ROOT)} ({lines} lines)"
        for name, path in proxy_modules().items()
        if is_tooling(name)
        and (lines := len(path.read_text().splitlines())) > MAX_TOOLING_MODULE_LINES
    )
    assert found == []


def test_the_checks_above_see_what_they_guard(tmp_path: Path) -> None:
    """The scanners find a long function when there is one, and tell the tooling apart."""
    sample = tmp_path / "sample.py"
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_RUNTIME_FUNCTION_LINES))
    sample.write_text(f"def long():\n{body}\n\ndef short():\n    return 1\n")
    assert long_functions(sample) == [("long", MAX_RUNTIME_FUNCTION_LINES + 1)]
    assert is_tooling("proxy.testing.fake_upstream") and is_tooling("proxy.bench")
    assert not is_tooling("proxy.server.run") and not is_tooling("proxy.benchmarks")


def called_names(path: Path) -> list[tuple[str, int]]:
    """(name, line) of every call in ``path``: ``f(...)`` gives "f", ``x.y.f(...)`` gives "f"."""
    tree = ast.parse(path.read_text(), str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            func = node.func
            if isinstance(func, ast.Name):
                found.append((func.id, node.lineno))
            elif isinstance(func, ast.Attribute):
                found.append((func.attr, node.lineno))
    return found


def callers_of(name: str, under: tuple[str, ...] = ("proxy",)) -> set[str]:
    """The runtime modules (under the given packages) that call ``name``."""
    return {
        module
        for module, path in proxy_modules().items()
        if module.startswith(under)
        and not is_tooling(module)
        and any(called == name for called, _ in called_names(path))
    }


def test_one_responder_is_the_only_way_in() -> None:
    """Every entry (the fast path, Quart's API routes, the WebSocket) asks the one responder,
    and the pipeline's steps are taken there alone, in the order written there once."""
    assert callers_of("respond") == {
        "proxy.server.fast_path",
        "proxy.api.routes",
        "proxy.api.ws",
    }
    # The steps that make or refuse a request: nowhere but the responder.
    for step in ("relay", "parse", "authenticate"):
        assert callers_of(step, ("proxy.api", "proxy.server")) == {"proxy.api.responder"}, step
    # The responder is one class, and the fast path knows it only as the server's interface.
    assert "class Responder" in (PROXY / "api" / "responder.py").read_text()
    assert "proxy.api" not in (PROXY / "server" / "fast_path.py").read_text()


def test_one_writer_is_the_only_way_out() -> None:
    """Every answer, on either server, is written by server/writer.py: the servers only call
    it; the head is made by one function; a relay's body is written in one place."""
    assert callers_of("write_answer") == {"proxy.server.asgi", "proxy.server.fast_path"}
    # The header block of every response Sluice writes (a refusal of bad framing included).
    assert callers_of("header_block") == {
        "proxy.server.writer",
        "proxy.server.connection_server",
    }
    assert callers_of("write_through") == {"proxy.server.writer"}
    assert callers_of("attach", ("proxy.server",)) == {"proxy.server.writer"}


def test_the_server_gets_sluices_objects_explicitly() -> None:
    """Nothing rides on hypercorn's Config as an extra attribute, read back with getattr."""
    server = PROXY / "server"
    found = sorted(
        str(path.relative_to(ROOT))
        for path in server.rglob("*.py")
        if "sluice_" in path.read_text()
    )
    assert found == []


def foreign_private_reads(path: Path) -> list[str]:
    """``x._name`` in ``path`` where ``x`` is not self, cls or super(), and ``_name`` is not
    an attribute the module gives its own objects (``self._name = ...`` or a class body's)."""
    tree = ast.parse(path.read_text(), str(path))
    own: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            own.add(node.attr)
        elif isinstance(node, ast.ClassDef):
            for item in node.body:
                targets = item.targets if isinstance(item, ast.Assign) else []
                if isinstance(item, ast.AnnAssign):
                    targets = [item.target]
                own.update(t.id for t in targets if isinstance(t, ast.Name))
                if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef):
                    own.add(item.name)
    wrong = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute) or not node.attr.startswith("_"):
            continue
        if node.attr.startswith("__") or node.attr in own:
            continue
        value = node.value
        if isinstance(value, ast.Name) and value.id in ("self", "cls"):
            continue
        if isinstance(value, ast.Call) and getattr(value.func, "id", None) == "super":
            continue
        wrong.append(f"{path.relative_to(ROOT)}:{node.lineno}: {ast.unparse(node)}")
    return wrong


def test_no_module_at_the_seam_reaches_into_anothers_private_fields() -> None:
    """The relay, the server and the api layer use each other's public interfaces; only the
    adapters touch a library's internals (each checked at start-up)."""
    seam = [PROXY / "relay", PROXY / "server", PROXY / "api"]
    found = [
        line
        for folder in seam
        for path in sorted(folder.rglob("*.py"))
        if "adapters" not in path.parts
        for line in foreign_private_reads(path)
    ]
    assert found == []
