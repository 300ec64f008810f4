"""deploy/, checked offline: every Kubernetes manifest against the bundled API schemas in strict
mode, the systemd unit with systemd's own verifier, and both against the TOML they carry, so
that their timings cover Sluice's drain and their probes reach its port."""

from __future__ import annotations

import shutil
import subprocess
import tomllib
from collections import defaultdict
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from proxy.config import Config, ConfigError, check_public_bind, config_from_mapping
from proxy.ops.metrics import Metrics
from tests import containerfile

ROOT = Path(__file__).resolve().parents[1]
KUBERNETES = ROOT / "deploy" / "kubernetes"
SYSTEMD = ROOT / "deploy" / "systemd"
MANIFESTS = sorted(KUBERNETES.glob("*.yaml"))
# The oldest Kubernetes the manifests are written for (the kubelet's preStop sleep action is
# on by default from 1.30), and the newest whose schemas kubernetes-validate bundles.
KUBERNETES_VERSIONS = ("1.30", kubernetes_validate.latest_version())
# Where the unit's --config points, and the example installed there.
SYSTEMD_CONFIGS = {"/etc/sluice/sluice.toml": SYSTEMD / "sluice.toml"}
# The namespace every namespaced manifest names (namespace.yaml creates it).
NAMESPACE = "llm"
# The image as docs/container-image.md tags and pushes it, and the Deployment runs it.
CONTAINER_IMAGE_DOC = ROOT / "docs" / "container-image.md"
# Sluice exits this long after graceful_timeout at the latest (docs/operating.md, "Running
# it in production"): the stuck connections are dropped, then the pools close.
EXIT_AFTER_GRACE = 1.0


def documents(path: Path) -> list[dict[str, Any]]:
    with path.open(encoding="utf-8") as file:
        loaded = list(yaml.safe_load_all(file))
    assert all(isinstance(document, dict) for document in loaded), f"{path.name}: empty document"
    return loaded


def resources() -> dict[tuple[str, str], dict[str, Any]]:
    """Every manifest's resources, by (kind, name)."""
    found: dict[tuple[str, str], dict[str, Any]] = {}
    for path in MANIFESTS:
        for resource in documents(path):
            key = (resource["kind"], resource["metadata"]["name"])
            assert key not in found, f"{key} is defined twice"
            found[key] = resource
    return found


def sluice_deployment() -> dict[str, Any]:
    return resources()[("Deployment", "sluice")]


def sluice_container() -> dict[str, Any]:
    containers = sluice_deployment()["spec"]["template"]["spec"]["containers"]
    return next(container for container in containers if container["name"] == "sluice")


def secret_data(name: str) -> dict[str, str]:
    secret = resources()[("Secret", name)]
    return dict(secret.get("stringData", {}))


def container_env() -> dict[str, str]:
    """The container's environment as the pod gets it (a Secret's value stands in as "x")."""
    return {entry["name"]: entry.get("value", "x") for entry in sluice_container().get("env", [])}


def sluice_argv() -> list[str]:
    """What the container runs: its command (else the image's entry point), then its args."""
    container = sluice_container()
    command = container.get("command", containerfile.exec_form("ENTRYPOINT", "proxy"))
    return [*command, *container.get("args", [])]


def kubernetes_config() -> Config:
    """The TOML the Deployment is started with: the Secret file its --config names."""
    command = sluice_argv()
    config_path = Path(command[command.index("--config") + 1])
    pod = sluice_deployment()["spec"]["template"]["spec"]
    mount = next(
        mount
        for mount in sluice_container()["volumeMounts"]
        if Path(mount["mountPath"]) == config_path.parent
    )
    volume = next(volume for volume in pod["volumes"] if volume["name"] == mount["name"])
    text = secret_data(volume["secret"]["secretName"])[config_path.name]
    return config_from_mapping(tomllib.loads(text), "secret.yaml", env=container_env())


def container_port(reference: int | str) -> int:
    """A probe's or Service's port, a number or the name of one of the container's ports."""
    if isinstance(reference, int):
        return reference
    ports = {port["name"]: port["containerPort"] for port in sluice_container()["ports"]}
    return int(ports[reference])


def test_there_are_manifests() -> None:
    assert {path.name for path in MANIFESTS} >= {
        "namespace.yaml",
        "deployment.yaml",
        "service.yaml",
        "pdb.yaml",
        "hpa.yaml",
        "secret.yaml",
        "redis.yaml",
    }


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
@pytest.mark.parametrize("path", MANIFESTS, ids=lambda path: path.name)
def test_every_manifest_validates_in_strict_mode(path: Path, version: str) -> None:
    for resource in documents(path):
        kubernetes_validate.validate(resource, version, strict=True)


def test_strict_mode_refuses_a_misspelled_field() -> None:
    # What makes the test above worth having: a typo is an error, not an ignored field.
    deployment = sluice_deployment()
    pod = deployment["spec"]["template"]["spec"]
    pod["containers"][0]["readinesProbe"] = pod["containers"][0].pop("readinessProbe")
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, KUBERNETES_VERSIONS[0], strict=True)


def test_the_secret_carries_a_config_sluice_serves() -> None:
    config = kubernetes_config()
    check_public_bind(config)  # host 0.0.0.0, so keys are required
    assert config.server.host == "0.0.0.0"
    assert config.keys
    assert config.limits.backend == "redis"


def test_probes_reach_the_configured_port() -> None:
    container, config = sluice_container(), kubernetes_config()
    assert container_port("http") == config.server.port
    probes = {kind: container[kind] for kind in ("startupProbe", "readinessProbe", "livenessProbe")}
    paths = {kind: probe["httpGet"]["path"] for kind, probe in probes.items()}
    assert paths == {
        "startupProbe": "/readyz",
        "readinessProbe": "/readyz",
        "livenessProbe": "/healthz",
    }
    for probe in probes.values():
        assert container_port(probe["httpGet"]["port"]) == config.server.port
    # A local model loads while the port answers, /readyz 503 until it is loaded: minutes.
    startup = probes["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 300


def test_the_grace_period_covers_prestop_drain_delay_and_graceful_timeout() -> None:
    pod = sluice_deployment()["spec"]["template"]["spec"]
    server = kubernetes_config().server
    prestop = sluice_container()["lifecycle"]["preStop"]["sleep"]["seconds"]
    # The preStop sleep carries the wait for the endpoints' removal, not drain_delay (both
    # would only add up to a longer stop).
    assert prestop > 0
    assert server.drain_delay == 0
    needed = prestop + server.drain_delay + server.graceful_timeout + EXIT_AFTER_GRACE
    assert pod["terminationGracePeriodSeconds"] >= needed


def test_the_pod_runs_unprivileged_on_a_read_only_root() -> None:
    pod = sluice_deployment()["spec"]["template"]["spec"]
    container = sluice_container()
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert container["securityContext"]["allowPrivilegeEscalation"] is False
    assert container["securityContext"]["capabilities"]["drop"] == ["ALL"]
    assert container["resources"]["requests"]
    assert container["resources"]["limits"]["memory"]
    mounts = {mount["mountPath"] for mount in container["volumeMounts"]}
    assert "/tmp" in mounts


def test_no_service_link_variables_reach_sluice() -> None:
    # Kubernetes sets <SERVICE>_SERVICE_HOST, <SERVICE>_PORT... for every Service, and the
    # Services here are named sluice*: Sluice reads SLUICE_* as config keys and would refuse.
    assert sluice_deployment()["spec"]["template"]["spec"]["enableServiceLinks"] is False
    text = secret_data("sluice-config")["sluice.toml"]
    with pytest.raises(ConfigError, match="SLUICE_SERVICE_HOST"):
        config_from_mapping(tomllib.loads(text), env={"SLUICE_SERVICE_HOST": "10.0.0.1"})


def test_each_upstream_key_comes_from_a_secret() -> None:
    sources = {
        entry["name"]: entry["valueFrom"]["secretKeyRef"]
        for entry in sluice_container()["env"]
        if "valueFrom" in entry
    }
    models = [model for model in kubernetes_config().models if model.backend == "upstream"]
    assert models
    for model in models:
        reference = sources[model.api_key_env]
        assert reference["key"] in secret_data(reference["name"])


def test_the_limits_redis_is_deployed_at_the_configured_url() -> None:
    url = kubernetes_config().limits.url
    found = resources()
    host, port = url.removeprefix("redis://").split("/")[0].split(":")
    service = found[("Service", host)]
    assert int(port) in {entry["port"] for entry in service["spec"]["ports"]}
    redis = found[("Deployment", host)]
    assert (
        service["spec"]["selector"].items()
        <= redis["spec"]["template"]["metadata"]["labels"].items()
    )


def test_service_pdb_and_hpa_point_at_the_sluice_pods() -> None:
    found = resources()
    labels = sluice_deployment()["spec"]["template"]["metadata"]["labels"]
    service = found[("Service", "sluice")]
    assert service["spec"]["selector"].items() <= labels.items()
    assert container_port(service["spec"]["ports"][0]["targetPort"]) == (
        kubernetes_config().server.port
    )
    pdb = found[("PodDisruptionBudget", "sluice")]
    assert pdb["spec"]["selector"]["matchLabels"].items() <= labels.items()
    hpa = found[("HorizontalPodAutoscaler", "sluice")]
    assert hpa["spec"]["scaleTargetRef"] == {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "name": "sluice",
    }
    (metric,) = hpa["spec"]["metrics"]
    assert metric["type"] == "Pods"
    assert metric["pods"]["metric"]["name"] == Metrics.active_streams.name


def test_every_resource_is_in_the_namespace_the_manifests_create() -> None:
    found = resources()
    namespace = found[("Namespace", NAMESPACE)]
    assert "namespace" not in namespace["metadata"]
    for (kind, name), resource in found.items():
        if kind != "Namespace":
            assert resource["metadata"].get("namespace") == NAMESPACE, f"{kind} {name}"


def test_the_image_is_this_version_as_the_docs_tag_it() -> None:
    with (ROOT / "pyproject.toml").open("rb") as file:
        version = tomllib.load(file)["project"]["version"]
    image = sluice_container()["image"]
    assert image == f"registry.example.com/{NAMESPACE}/sluice:{version}"
    # The page that says how to build, tag and push it names the same.
    assert f"buildah push {image}" in CONTAINER_IMAGE_DOC.read_text(encoding="utf-8")
    # Its entry point is the image's: sluice serve.
    assert sluice_argv()[:2] == ["sluice", "serve"]


def test_the_pod_runs_as_the_images_user() -> None:
    pod = sluice_deployment()["spec"]["template"]["spec"]["securityContext"]
    assert str(pod["runAsUser"]) == containerfile.UID == "10001"
    assert str(pod["runAsGroup"]) == containerfile.GID
    assert str(pod["fsGroup"]) == containerfile.GID


def test_the_images_cache_directory_is_a_volume() -> None:
    # The root filesystem is read-only: the one directory the image lets its user write (its
    # HOME and every cache) must be a volume, or a local model's caches fail to write.
    container = sluice_container()
    env = containerfile.env("proxy")
    assert env["HOME"] == env["XDG_CACHE_HOME"] == containerfile.CACHE_DIR
    assert env["HF_HOME"].startswith(containerfile.CACHE_DIR + "/")
    assert env["TORCHINDUCTOR_CACHE_DIR"].startswith(containerfile.CACHE_DIR + "/")
    (mount,) = [m for m in container["volumeMounts"] if m["mountPath"] == containerfile.CACHE_DIR]
    assert not mount.get("readOnly", False)
    pod = sluice_deployment()["spec"]["template"]["spec"]
    (volume,) = [v for v in pod["volumes"] if v["name"] == mount["name"]]
    assert "emptyDir" in volume
    # Nothing in the pod sets HOME or a cache elsewhere.
    names = {entry["name"] for entry in container.get("env", [])}
    assert not names & {"HOME", "XDG_CACHE_HOME", "HF_HOME", "TORCHINDUCTOR_CACHE_DIR"}


def unit_directives(text: str) -> dict[str, list[str]]:
    directives: dict[str, list[str]] = defaultdict(list)
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith(("#", ";", "[")):
            key, _, value = line.partition("=")
            directives[key].append(value)
    return directives


UNIT = SYSTEMD / "sluice.service"


def test_the_unit_stops_within_the_drain_of_the_config_it_names() -> None:
    directives = unit_directives(UNIT.read_text(encoding="utf-8"))
    (exec_start,) = directives["ExecStart"]
    words = exec_start.split()
    assert words[:2] == ["/opt/sluice/.venv/bin/sluice", "serve"]
    named = words[words.index("--config") + 1]
    config = config_from_mapping(
        tomllib.loads(SYSTEMD_CONFIGS[named].read_text(encoding="utf-8")), named, env={}
    )
    check_public_bind(config)
    (timeout,) = directives["TimeoutStopSec"]
    server = config.server
    assert float(timeout.removesuffix("s")) >= (
        server.drain_delay + server.graceful_timeout + EXIT_AFTER_GRACE
    )
    assert directives["KillMode"] == ["mixed"]
    assert directives["Restart"] == ["on-failure"]
    assert "-HUP" in directives["ExecReload"][0].split()


def test_the_unit_is_hardened() -> None:
    directives = unit_directives(UNIT.read_text(encoding="utf-8"))
    expected = {
        "NoNewPrivileges": "yes",
        "ProtectSystem": "strict",
        "ProtectHome": "yes",
        "PrivateTmp": "yes",
        "DynamicUser": "yes",
        "CapabilityBoundingSet": "",
        "RestrictAddressFamilies": "AF_INET AF_INET6 AF_UNIX",
    }
    assert {key: directives[key][-1] for key in expected} == expected


def test_systemd_analyze_verifies_the_unit(tmp_path: Path) -> None:
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze is not installed here (it comes with systemd)")
    sluice = shutil.which("sluice", path=str(Path(ROOT / ".venv" / "bin")))
    if sluice is None:
        pytest.skip("no sluice in .venv/bin for ExecStart (run `make` to install it)")
    unit = tmp_path / "sluice.service"
    text = UNIT.read_text(encoding="utf-8")
    unit.write_text(
        text.replace("/opt/sluice/.venv/bin/sluice", str(Path(sluice).resolve())),
        encoding="utf-8",
    )
    result = subprocess.run(
        [analyze, "verify", str(unit)], capture_output=True, text=True, timeout=60, check=False
    )
    # verify exits 0 on an unknown directive too: any word about this unit is a failure.
    said = [line for line in result.stderr.splitlines() if unit.name in line]
    assert result.returncode == 0 and not said, result.stderr
