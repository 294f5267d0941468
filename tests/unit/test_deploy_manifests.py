"""deploy/k8s and deploy/docker-compose agree with the code: env names, ports, paths, commands."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path
from types import SimpleNamespace

import kubernetes_validate
import pytest
import yaml

from common.config import ENV_PREFIX, build_config, env_name, flat_values, resolve_values, settings
from learner.config import LearnerConfig
from server.config import ServerConfig

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
SCRIPTS = tomllib.loads((DEPLOY.parent / "pyproject.toml").read_text())["project"]["scripts"]
CONFIGS = {"diloco-server": ServerConfig, "diloco-learner": LearnerConfig}


def k8s_objects() -> dict[tuple[str, str], dict]:
    objects = {}
    for path in sorted((DEPLOY / "k8s").glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            objects[(doc["kind"], doc["metadata"]["name"])] = doc
    return objects


def port_of(listen: str) -> int:
    return int(listen.rpartition(":")[2])


def config_of(command: str, env: dict[str, str]) -> SimpleNamespace:
    """Build the daemon's config from the manifest's environment, as the daemon would; its
    settings by flat name (`config.listen`), whichever section holds them."""
    cls = CONFIGS[command]
    unknown = [k for k in env if k.startswith(ENV_PREFIX) and k not in _env_names(cls)]
    assert not unknown, f"{command} has no setting for {unknown}"
    return SimpleNamespace(**flat_values(build_config(cls, resolve_values(cls, None, env))))


def _env_names(cls) -> set[str]:
    return {env_name(name) for name in settings(cls)}


# Values from the downward API stand in as a placeholder of the right type.
DOWNWARD_PLACEHOLDERS = {
    "metadata.name": "pod-name",
    "metadata.labels['apps.kubernetes.io/pod-index']": "0",
}


def pod_env(container: dict) -> dict[str, str]:
    return {
        e["name"]: e["value"] if "value" in e else DOWNWARD_PLACEHOLDERS[downward_path(e)]
        for e in container["env"]
    }


def downward_path(env: dict) -> str:
    return env["valueFrom"]["fieldRef"]["fieldPath"]


def shard_addresses(server: str) -> list[str]:
    """The learner's --server: one address, or every shard's in shard order."""
    return server.split(",") if isinstance(server, str) else list(server)


def test_k8s_server_agrees_with_the_code() -> None:
    objects = k8s_objects()
    sts = objects[("StatefulSet", "diloco-server")]
    pod = sts["spec"]["template"]
    (container,) = pod["spec"]["containers"]
    assert container["command"][0] in SCRIPTS
    config = config_of(container["command"][0], pod_env(container))
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {
        "grpc": port_of(config.listen),
        "metrics": port_of(config.metrics_listen),
        "health": port_of(config.health_listen),
    }
    assert int(pod["metadata"]["annotations"]["prometheus.io/port"]) == ports["metrics"]
    # The kubelet's grpc probe speaks no TLS: with TLS on, it must ask the plaintext health port.
    assert config.tls_cert and not config.insecure
    assert container["readinessProbe"]["grpc"]["port"] == ports["health"]
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    assert mounts["state"] == config.state_dir
    assert sts["spec"]["volumeClaimTemplates"][0]["metadata"]["name"] == "state"
    service = objects[("Service", "diloco-server")]
    assert {p["targetPort"] for p in service["spec"]["ports"]} == set(ports) - {"health"}
    assert service["spec"]["selector"] == pod["metadata"]["labels"]


def test_k8s_learners_agree_with_the_code() -> None:
    objects = k8s_objects()
    pod = objects[("Deployment", "diloco-learner")]["spec"]["template"]
    (container,) = pod["spec"]["containers"]
    assert container["command"][0] in SCRIPTS
    config = config_of(container["command"][0], pod_env(container))
    sts = objects[("StatefulSet", "diloco-server")]
    service = objects[("Service", sts["spec"]["serviceName"])]
    grpc_port = next(p["port"] for p in service["spec"]["ports"] if p["name"] == "grpc")
    # Every shard by its DNS name under the headless Service, in shard (ordinal) order.
    name, domain = sts["metadata"]["name"], service["metadata"]["name"]
    expected = [f"{name}-{i}.{domain}:{grpc_port}" for i in range(sts["spec"]["replicas"])]
    assert shard_addresses(config.server) == expected
    metrics_port = port_of(config.metrics_listen)
    assert int(pod["metadata"]["annotations"]["prometheus.io/port"]) == metrics_port
    assert [p["containerPort"] for p in container["ports"]] == [metrics_port]


def test_k8s_shards_are_a_statefulset_with_a_volume_and_dns_name_each() -> None:
    objects = k8s_objects()
    sts = objects[("StatefulSet", "diloco-server")]
    (container,) = sts["spec"]["template"]["spec"]["containers"]
    env = {e["name"]: e for e in container["env"]}
    assert sts["spec"]["replicas"] >= 2
    assert int(env["DILOCO_SHARD_COUNT"]["value"]) == sts["spec"]["replicas"]
    # The shard index is the pod's ordinal, from the label Kubernetes >= 1.28 sets.
    assert downward_path(env["DILOCO_SHARD_INDEX"]) == (
        "metadata.labels['apps.kubernetes.io/pod-index']"
    )
    config = config_of(container["command"][0], pod_env(container))
    assert (config.shard_index, config.shard_count) == (0, sts["spec"]["replicas"])
    service = objects[("Service", sts["spec"]["serviceName"])]
    assert service["spec"]["clusterIP"] == "None"  # headless: one DNS record per shard
    assert service["spec"]["publishNotReadyAddresses"] is True
    (claim,) = sts["spec"]["volumeClaimTemplates"]
    assert claim["spec"]["accessModes"] == ["ReadWriteOnce"]


def image_user() -> int:
    """The numeric user deploy/Dockerfile's image runs as."""
    users = [line.split()[1] for line in (DEPLOY / "Dockerfile").read_text().splitlines()
             if line.startswith("USER ")]  # fmt: skip
    assert len(users) == 1, users
    return int(users[0].split(":")[0])


@pytest.mark.parametrize("kind, name", [("StatefulSet", "diloco-server"),
                                        ("Deployment", "diloco-learner")])  # fmt: skip
def test_k8s_pods_run_as_the_images_user_and_write_only_to_volumes(kind: str, name: str) -> None:
    pod = k8s_objects()[(kind, name)]["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] == pod["securityContext"]["fsGroup"] == image_user()
    (container,) = pod["containers"]
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    config = config_of(container["command"][0], pod_env(container))
    mounts = {m["mountPath"] for m in container["volumeMounts"] if not m.get("readOnly")}
    written = config.state_dir if kind == "StatefulSet" else config.checkpoint_dir
    assert written in mounts and "/tmp" in mounts
    if kind == "Deployment":  # torch's threads follow the pod's CPU, not the node's cores
        assert config.torch_threads == int(container["resources"]["requests"]["cpu"])
        assert config.connect_timeout_s >= 300  # shards may be minutes from ready


@pytest.mark.parametrize("version", ["1.28", "1.33"])
def test_k8s_manifests_pass_the_api_schema_strictly(version: str) -> None:
    for kind, name in k8s_objects():
        doc = k8s_objects()[(kind, name)]
        assert kubernetes_validate.validate(doc, version, strict=True) == version


def test_prometheus_in_the_cluster_scrapes_every_annotated_pod_with_its_shard() -> None:
    config = yaml.safe_load((DEPLOY / "prometheus" / "k8s.yml").read_text())
    (job,) = config["scrape_configs"]
    # its own namespace only: a namespaced Role suffices (test below)
    assert job["kubernetes_sd_configs"] == [{"role": "pod", "namespaces": {"own_namespace": True}}]
    relabel = {r.get("target_label", r.get("action")): r for r in job["relabel_configs"]}
    assert relabel["keep"]["source_labels"] == [
        "__meta_kubernetes_pod_annotation_prometheus_io_scrape",
        "__meta_kubernetes_pod_label_app",
    ]
    keep = re.compile(relabel["keep"]["regex"])  # Prometheus anchors its regexes
    for app in ("diloco-server", "diloco-learner"):
        assert keep.fullmatch(f"true;{app}") and not keep.fullmatch(f"false;{app}")
    assert not keep.fullmatch("true;someone-else")
    addresses = [r for r in job["relabel_configs"] if r.get("target_label") == "__address__"]
    for ip, expected in [("10.1.2.3", "10.1.2.3:9100"), ("fd00::1", "[fd00::1]:9100")]:
        made = [
            re.fullmatch(r["regex"], f"{ip};9100").expand(r["replacement"].replace("$", "\\"))
            for r in addresses
            if re.fullmatch(r["regex"], f"{ip};9100")
        ]
        assert made == [expected]
    assert relabel["shard"]["source_labels"] == [
        "__meta_kubernetes_pod_label_apps_kubernetes_io_pod_index"
    ]
    pod = k8s_objects()[("StatefulSet", "diloco-server")]["spec"]["template"]["metadata"]
    assert pod["annotations"]["prometheus.io/scrape"] == "true"
    assert relabel["job"]["source_labels"] == ["__meta_kubernetes_pod_label_app"]
    assert pod["labels"]["app"] == "diloco-server"  # the job the dashboard's panels select


def test_prometheus_in_the_cluster_may_list_pods_of_its_namespace_and_reads_the_config() -> None:
    objects = k8s_objects()
    pod = objects[("Deployment", "diloco-prometheus")]["spec"]["template"]["spec"]
    account = pod["serviceAccountName"]
    assert ("ServiceAccount", account) in objects
    (binding,) = [
        o for (kind, _), o in objects.items()
        if kind == "RoleBinding" and {"kind": "ServiceAccount", "name": account} in o["subjects"]
    ]  # fmt: skip
    assert binding["roleRef"]["kind"] == "Role"  # not cluster-wide
    (rule,) = objects[("Role", binding["roleRef"]["name"])]["rules"]
    assert rule["resources"] == ["pods"] and {"list", "watch"} <= set(rule["verbs"])
    assert set(rule["verbs"]) <= {"get", "list", "watch"}  # reads, nothing more
    # The config file is deploy/prometheus/k8s.yml, as the ConfigMap the header's kubectl
    # command makes from it, under the name the flag reads; its rule files are keys of the
    # same ConfigMap, so they lie beside it in the mounted folder.
    (container,) = pod["containers"]
    config_flag = next(a for a in container["args"] if a.startswith("--config.file="))
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    volume = next(v for v in pod["volumes"] if "configMap" in v)
    key = config_flag.partition("=")[2].removeprefix(mounts[volume["name"]] + "/")
    command = configmap_command((DEPLOY / "k8s" / "prometheus.yaml").read_text())
    assert command[:4] == ["kubectl", "create", "configmap", volume["configMap"]["name"]]
    assert f"--from-file={key}=deploy/prometheus/k8s.yml" in command
    for rules in rule_files("k8s.yml"):
        assert f"--from-file={rules}=deploy/prometheus/{rules}" in command
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    data = next(a for a in container["args"] if a.startswith("--storage.tsdb.path="))
    assert data.partition("=")[2] in mounts.values()  # its one writable place is a volume


def configmap_command(header: str) -> list[str]:
    """The arguments of the `kubectl create configmap` command a manifest's comments give,
    its lines continued with a backslash joined."""
    lines = [line.lstrip("# ").rstrip() for line in header.splitlines() if line.startswith("#")]
    start = next(i for i, line in enumerate(lines) if line.startswith("kubectl create configmap"))
    words = []
    for line in lines[start:]:
        words += line.removesuffix("\\").split()
        if not line.endswith("\\"):
            return words
    raise AssertionError("the kubectl command's last line ends with a backslash")


def rule_files(prometheus_file: str) -> list[str]:
    """The rule files a Prometheus config loads, each a file beside it in deploy/prometheus."""
    listed = yaml.safe_load((DEPLOY / "prometheus" / prometheus_file).read_text())["rule_files"]
    assert listed and all((DEPLOY / "prometheus" / name).is_file() for name in listed), listed
    return listed


@pytest.mark.parametrize("cls", [ServerConfig, LearnerConfig])
def test_an_unknown_variable_is_caught(cls) -> None:
    with pytest.raises(AssertionError, match="no setting for"):
        config_of(next(k for k, v in CONFIGS.items() if v is cls), {"DILOCO_NOPE": "1"})


def compose_services(*files: str) -> dict[str, dict]:
    """Services of the compose files, later files overriding earlier ones (environments merge)."""
    services: dict[str, dict] = {}
    for name in files:
        for service, spec in yaml.safe_load((DEPLOY / name).read_text())["services"].items():
            merged = services.setdefault(service, {})
            env = {**merged.get("environment", {}), **spec.get("environment", {})}
            merged.update(spec)
            merged["environment"] = env
    return services


def scrape_targets(prometheus_file: str) -> dict[str, dict[str, str]]:
    """Each static target of a Prometheus config, with the labels it is given."""
    config = yaml.safe_load((DEPLOY / "prometheus" / prometheus_file).read_text())
    return {
        t: s.get("labels", {})
        for job in config["scrape_configs"]
        for s in job["static_configs"]
        for t in s["targets"]
    }


@pytest.mark.parametrize(
    "files, prometheus_file, host_of",
    [
        (["docker-compose.yml"], "compose.yml", lambda service, listen: service),
        (
            ["docker-compose.yml", "docker-compose.host.yml"],
            "host.yml",
            lambda service, listen: listen.rpartition(":")[0],
        ),
    ],
)
def test_compose_agrees_with_the_code(files, prometheus_file, host_of) -> None:
    services = compose_services(*files)
    daemons = {n: s for n, s in services.items() if s.get("command", [""])[0] in CONFIGS}
    configs = {n: config_of(s["command"][0], s["environment"]) for n, s in daemons.items()}
    assert len([n for n in daemons if n.startswith("learner")]) == 3
    shards = sorted(n for n in daemons if daemons[n]["command"][0] == "diloco-server")
    assert shards == ["server-0", "server-1"]
    expected_targets: dict[str, dict[str, str]] = {}
    addresses = []
    for name, config in configs.items():
        target = f"{host_of(name, config.metrics_listen)}:{port_of(config.metrics_listen)}"
        expected_targets[target] = {}
        if name in shards:
            index = shards.index(name)
            assert (config.shard_index, config.shard_count) == (index, len(shards))
            assert config.state_dir == daemons[name]["volumes"][0].split(":")[1]
            expected_targets[target] = {"shard": str(index)}
            addresses.append(f"{host_of(name, config.listen)}:{port_of(config.listen)}")
    volumes = [daemons[n]["volumes"][0].split(":")[0] for n in shards]
    assert len(set(volumes)) == len(shards)  # a state volume each
    for name, config in configs.items():
        if name not in shards:
            assert shard_addresses(config.server) == addresses
    assert scrape_targets(prometheus_file) == expected_targets
    assert any(s["environment"].get("DILOCO_SLOWDOWN") for s in daemons.values())


@pytest.mark.parametrize(
    "files, prometheus_file",
    [(["docker-compose.yml"], "compose.yml"),
     (["docker-compose.yml", "docker-compose.host.yml"], "host.yml")],
)  # fmt: skip
def test_compose_prometheus_mounts_its_config_and_rules_side_by_side(
    files: list[str], prometheus_file: str
) -> None:
    prometheus = compose_services(*files)["prometheus"]
    config = next(a for a in prometheus["entrypoint"] if a.startswith("--config.file="))
    folder = config.partition("=")[2].rpartition("/")[0]
    # host path by container path (the last override of a target wins, as in compose)
    mounted = {v.split(":")[1]: v.split(":")[0] for v in prometheus["volumes"]}
    assert mounted[config.partition("=")[2]] == f"./prometheus/{prometheus_file}"
    for rules in rule_files(prometheus_file):
        assert mounted[f"{folder}/{rules}"] == f"./prometheus/{rules}"


def test_grafana_provisioning_points_at_the_dashboard_and_prometheus() -> None:
    grafana = compose_services("docker-compose.yml")["grafana"]
    mounts = dict(v.rsplit(":", 2)[:2] for v in grafana["volumes"])
    provider = yaml.safe_load(
        (DEPLOY / "grafana" / "provisioning" / "dashboards" / "diloco.yml").read_text()
    )
    dashboard_dir = provider["providers"][0]["options"]["path"]
    assert mounts["./grafana/diloco.json"].startswith(dashboard_dir + "/")
    source = yaml.safe_load(
        (DEPLOY / "grafana" / "provisioning" / "datasources" / "prometheus.yml").read_text()
    )["datasources"][0]
    dashboard = yaml.safe_load((DEPLOY / "grafana" / "diloco.json").read_text())
    uids = {p["datasource"]["uid"] for p in dashboard["panels"]}
    assert uids == {source["uid"]}
    assert source["url"].endswith(":9090")


@pytest.mark.parametrize(
    "kind, name, secret",
    [
        ("StatefulSet", "diloco-server", "diloco-server-tls"),
        ("Deployment", "diloco-learner", "diloco-learner-tls"),
    ],
)
def test_k8s_tls_files_come_from_the_secret(kind: str, name: str, secret: str) -> None:
    objects = k8s_objects()
    pod = objects[(kind, name)]["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    config = config_of(container["command"][0], pod_env(container))
    assert not config.insecure
    volume = next(v for v in pod["volumes"] if v.get("secret", {}).get("secretName") == secret)
    mount = next(m for m in container["volumeMounts"] if m["name"] == volume["name"])
    keys = objects[("Secret", secret)]["stringData"]
    paths = [config.tls_cert, config.tls_key]
    paths.append(config.tls_client_ca if name == "diloco-server" else config.tls_ca)
    for path in paths:
        folder, _, key = path.rpartition("/")
        assert folder == mount["mountPath"] and key in keys


def test_k8s_images_are_tagged_with_the_projects_version() -> None:
    """IfNotPresent never pulls a tag again: the tag must change with each release."""
    version = tomllib.loads((DEPLOY.parent / "pyproject.toml").read_text())["project"]["version"]
    for kind, name in [("StatefulSet", "diloco-server"), ("Deployment", "diloco-learner")]:
        (container,) = k8s_objects()[(kind, name)]["spec"]["template"]["spec"]["containers"]
        assert container["image"] == f"decoupled-diloco:{version}"
        assert container["imagePullPolicy"] == "IfNotPresent"
