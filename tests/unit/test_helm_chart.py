"""The Helm chart (helm/turbowire): rendered by the real Helm engine (helm-python-sdk wraps Helm's
Go SDK), linted, every object validated against the Kubernetes 1.31 schemas (ServiceMonitor,
PodMonitor and PrometheusRule against prometheus-operator's published CRDs), the schema refusing
bad values, and every engine's --kv-transfer-config accepted by the connector's own parser; the
store path (transport store/both) with the chart's Redis and with an external one."""

from __future__ import annotations

import copy
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import helm_python
import kubernetes_validate
import pytest
import yaml
from support.k8s_schemas import KUBE_VERSION, crd_errors, load_crd

from turbowire.codec import list_presets
from turbowire.connector.codecs import known_presets
from turbowire.connector.config import CONFIG_KEYS, TRANSPORTS, TurboWireConfig, parse_size

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "helm" / "turbowire"
EXAMPLES = sorted((CHART / "examples").glob("*.yaml"))
CRD_KINDS = {"ServiceMonitor", "PodMonitor", "PrometheusRule"}
RELEASE, NAMESPACE = "tw", "llm"
POD_IP = "10.1.2.3"

#: every values set the tests render: the defaults and each example file
CASES: dict[str, dict[str, Any]] = {"defaults": {}} | {
    p.name: yaml.safe_load(p.read_text()) for p in EXAMPLES
}
#: the defaults with every optional object switched on
ALL_ON: dict[str, Any] = {
    "redis": {"enabled": True},
    "proxy": {"adminTokenSecret": "tw-proxy-admin",
              "tenantSalt": {"from": "header:X-Tenant-Id", "secretName": "tw-tenant-salt"}},
    "monitoring": {
        key: {"enabled": True}
        for key in ("serviceMonitor", "podMonitor", "prometheusRule", "grafanaDashboard")
    },
}
CASES["all-on"] = ALL_ON
#: the store path: store and both, with the chart's Redis and with an external one
EXTERNAL_REDIS = "rediss://redis.shared-infra.svc:6380/2"
CASES["store-in-chart"] = {"turbowire": {"transport": "store"}, "redis": {"enabled": True}}
CASES["both-in-chart"] = {
    "turbowire": {
        "transport": "both",
        "store": {
            "namespace": "team-a.qwen",
            "localCpuBytes": "2GiB",
            "localDisk": "/cache/turbowire-store",
            "ttlSeconds": 600,
            "chunkTokens": 512,
        },
        "extraConfig": {"load_failure_policy": "recompute"},
    },
    "redis": {"enabled": True, "port": 6380},
}
CASES["store-external"] = {
    "turbowire": {"transport": "store", "store": {"localCpuBytes": 0}},
    "redis": {"url": EXTERNAL_REDIS},
}
CASES["both-external"] = {
    "turbowire": {
        "transport": "both",
        # the directory in another Redis than the bytes: the proxy must read that one
        "extraConfig": {"directory_url": "redis://directory.shared-infra.svc:6379/0"},
    },
    "redis": {"url": "redis://redis.shared-infra.svc:6379/3"},
}
#: an external Redis whose password is in the operator's own Secret (redis.auth.existingSecret)
CASES["store-external-auth"] = {
    "turbowire": {"transport": "both"},
    "redis": {"url": "redis://redis.shared-infra.svc:6379/4",
              "auth": {"existingSecret": "shared-redis-password"}},
}
#: side-channel TLS: a kubernetes.io/tls Secret with the CA in another Secret, and a per-pod
#: certificate from cert-manager's csi-driver (the pod IP as IP SAN, which a shared Secret lacks)
TLS_DIR = "/etc/turbowire/side-channel-tls"
CASES["side-channel-tls"] = {
    "turbowire": {"sideChannel": {"tls": {
        "enabled": True, "secretName": "tw-side-channel-tls", "caSecretName": "tw-side-channel-ca",
        "caKey": "ca.pem",
    }}},
}  # fmt: skip
CSI_VOLUME = {
    "csi": {
        "driver": "csi.cert-manager.io",
        "readOnly": True,
        "volumeAttributes": {
            "csi.cert-manager.io/issuer-name": "tw-ca",
            "csi.cert-manager.io/ip-sans": "${POD_IP}",
            "csi.cert-manager.io/key-usages": "server auth,client auth",
        },
    }
}
CASES["side-channel-tls-csi"] = {
    "turbowire": {"sideChannel": {"tls": {"enabled": True, "volume": CSI_VOLUME}}},
}
#: chart value under turbowire.store -> connector key (the README's and values.yaml's contract)
STORE_VALUES = {
    "namespace": "store_namespace",
    "localCpuBytes": "store_local_cpu_bytes",
    "localDisk": "store_local_disk",
    "ttlSeconds": "store_ttl_seconds",
    "chunkTokens": "store_chunk_tokens",
}
#: connector keys the chart sets from its own values, refused in turbowire.extraConfig
TLS_KEYS = {"side_channel_tls_cert", "side_channel_tls_key", "side_channel_tls_ca"}
RESERVED = {
    "preset", "side_channel_port", "side_channel_host", "auth_token", "transport", "store_url",
} | set(STORE_VALUES.values()) | TLS_KEYS  # fmt: skip


def tls_on(values: dict[str, Any]) -> bool:
    tls = values.get("turbowire", {}).get("sideChannel", {}).get("tls", {})
    return bool(tls.get("enabled"))


@pytest.fixture(scope="module")
def tls_files(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """What the mounted TLS volume holds: tls.crt/tls.key (IP SAN: the pod IP) and ca.crt."""
    import ipaddress

    from cryptography import x509
    from support.pki import CA, ENGINE_EKU

    root = tmp_path_factory.mktemp("side-channel-tls")
    ca = CA("turbowire chart test CA")
    cert, key = ca.issue("engine", [x509.IPAddress(ipaddress.ip_address(POD_IP))], ENGINE_EKU)
    (root / "tls.crt").write_bytes(cert)
    (root / "tls.key").write_bytes(key)
    (root / "ca.crt").write_bytes(ca.pem)
    return root


def expected_store(values: dict[str, Any]) -> dict[str, Any] | None:
    """The store keys each engine's kv_connector_extra_config must carry (None: transport nixl)."""
    tw = values.get("turbowire", {})
    transport = tw.get("transport", "nixl")
    if transport == "nixl":
        return None
    redis = values.get("redis", {})
    if redis.get("enabled"):
        url = f"redis://{RELEASE}-turbowire-redis:{redis.get('port', 6379)}"
    else:
        url = redis["url"]
    store = tw.get("store", {})
    out = {"transport": transport, "store_url": url, "store_namespace": store.get("namespace")}
    out["store_namespace"] = out["store_namespace"] or RELEASE
    for value, key in STORE_VALUES.items():
        if value != "namespace" and store.get(value) is not None:
            out[key] = store[value]
    return out


@pytest.fixture(scope="module")
def chart():
    return helm_python.Chart.load(str(CHART))


def render(chart, values: dict[str, Any]) -> list[dict[str, Any]]:
    out = chart.render(values, name=RELEASE, namespace=NAMESPACE)
    docs = []
    for path, text in sorted(out.items()):
        if path.endswith("NOTES.txt"):
            continue
        docs += [d for d in yaml.safe_load_all(text) if d]
    return docs


@pytest.fixture(scope="module")
def rendered(chart) -> dict[str, list[dict[str, Any]]]:
    return {name: render(chart, values) for name, values in CASES.items()}


def of_kind(docs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] == kind]


def engines(docs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [
        d
        for d in of_kind(docs, "Deployment")
        if d["metadata"]["labels"]["app.kubernetes.io/component"] in ("prefill", "decode")
    ]


def arg_after(args: list[str], flag: str) -> str:
    assert args.count(flag) == 1, (flag, args)
    return args[args.index(flag) + 1]


# -- one source of truth ---------------------------------------------------------------------------


def test_generated_files_are_in_sync() -> None:
    out = subprocess.run(
        [sys.executable, str(CHART / "generate.py"), "--check"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    # the copies are byte-identical to deploy/ (Helm reads only files inside the chart)
    assert (CHART / "files/rules.yaml").read_bytes() == (
        REPO / "deploy/prometheus/rules.yaml"
    ).read_bytes()
    assert (CHART / "files/turbowire.json").read_bytes() == (
        REPO / "deploy/grafana/turbowire.json"
    ).read_bytes()


def test_schema_presets_come_from_the_codec() -> None:
    schema = json.loads((CHART / "values.schema.json").read_text())
    turbowire = schema["properties"]["turbowire"]["properties"]
    assert turbowire["preset"]["enum"] == list_presets()
    # one source of truth: the connector's transports, its keys (less the ones the chart sets)
    assert turbowire["transport"]["enum"] == list(TRANSPORTS) == ["nixl", "store", "both"]
    extra = set(turbowire["extraConfig"]["properties"])
    assert extra == {k.name for k in CONFIG_KEYS} - RESERVED
    assert "directory_url" in extra
    assert set(turbowire["store"]["properties"]) == set(STORE_VALUES)


# -- render, lint, validate ------------------------------------------------------------------------


@pytest.mark.parametrize("case", list(CASES))
def test_lint_is_clean(case: str) -> None:
    report = helm_python.lint(
        str(CHART), CASES[case], strict=True, namespace=NAMESPACE, kube_version="v1.31.0"
    )
    assert not report["errors"], report
    # severity 1 (info) is "icon is recommended"; warnings and errors fail
    assert [m for m in report["messages"] if m["severity"] >= 2] == [], report


@pytest.mark.parametrize("case", list(CASES))
def test_every_object_validates_for_kubernetes_131(rendered, case: str) -> None:
    docs = rendered[case]
    assert docs
    for doc in docs:
        if doc["kind"] in CRD_KINDS:
            continue  # prometheus-operator CRDs: validated against their own schemas below
        kubernetes_validate.validate(doc, KUBE_VERSION, strict=True)


@pytest.mark.parametrize("case", list(CASES))
def test_objects_expected(rendered, case: str) -> None:
    docs = rendered[case]
    kinds = {(d["kind"], d["metadata"]["name"]) for d in docs}
    full = f"{RELEASE}-turbowire"
    for kind, name in [
        ("Deployment", f"{full}-prefill"),
        ("Deployment", f"{full}-decode"),
        ("Deployment", f"{full}-proxy"),
        ("Service", f"{full}-prefill"),
        ("Service", f"{full}-decode"),
        ("Service", f"{full}-proxy"),
        ("ServiceAccount", full),
        ("PodDisruptionBudget", f"{full}-prefill"),
        ("PodDisruptionBudget", f"{full}-decode"),
        ("NetworkPolicy", f"{full}-prefill"),
    ]:
        assert (kind, name) in kinds, (kind, name)
    values = CASES[case]
    existing = values.get("turbowire", {}).get("authToken", {}).get("existingSecret")
    assert (("Secret", f"{full}-auth") in kinds) == (not existing)
    assert (("Deployment", f"{full}-redis") in kinds) == bool(
        values.get("redis", {}).get("enabled")
    )
    for doc in docs:
        assert doc["metadata"].get("namespace") in (NAMESPACE, "monitoring"), doc["metadata"]


# -- engines ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", list(CASES))
def test_kv_transfer_config_is_accepted_by_the_connector(
    rendered, tls_files: Path, case: str
) -> None:
    deployments = engines(rendered[case])
    assert len(deployments) == 2
    values = CASES[case]
    preset = values.get("turbowire", {}).get("preset", "tq4")
    store = expected_store(values)
    extras = {}
    for dep in deployments:
        role = dep["metadata"]["labels"]["app.kubernetes.io/component"]
        (container,) = dep["spec"]["template"]["spec"]["containers"]
        env = {e["name"]: e for e in container["env"]}
        # $(POD_IP) is expanded by the kubelet from the container's env
        assert env["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
        raw = arg_after(container["args"], "--kv-transfer-config").replace("$(POD_IP)", POD_IP)
        # the TLS files are read at start: the test's PKI stands for the mounted volume
        raw = raw.replace(TLS_DIR + "/", f"{tls_files}/")
        kv = json.loads(raw)
        assert kv["kv_connector"] == "TurboWireConnector"
        assert kv["kv_connector_module_path"] == "turbowire.connector"
        assert kv["kv_role"] == {"prefill": "kv_producer", "decode": "kv_consumer"}[role]
        extra = extras[role] = kv["kv_connector_extra_config"]
        own = set(values.get("turbowire", {}).get("extraConfig", {}))
        # a decode engine saves after the forward (FULL CUDA graphs) unless extraConfig says
        want_schedule = values.get("turbowire", {}).get("extraConfig", {}).get(
            "save_schedule", "after_forward" if role == "decode" else None)
        assert extra.get("save_schedule") == want_schedule, extra
        if role == "decode":
            own |= {"save_schedule"}
        if tls_on(values):
            own |= TLS_KEYS
            assert {k: extra[k] for k in TLS_KEYS} == {
                "side_channel_tls_cert": f"{tls_files}/tls.crt",
                "side_channel_tls_key": f"{tls_files}/tls.key",
                "side_channel_tls_ca": f"{tls_files}/ca.crt",
            }
        if store is None:
            # nixl: exactly what the chart rendered before the store path (no transport key)
            assert set(extra) == {"preset", "side_channel_port", "side_channel_host"} | own
        else:
            assert (
                set(extra)
                == {"preset", "side_channel_port", "side_channel_host"} | set(store) | own
            ), extra
            assert {k: extra[k] for k in store} == store
        # the token reaches the connector through its default env variable, from the Secret
        assert "secretKeyRef" in env["TURBOWIRE_AUTH_TOKEN"]["valueFrom"]
        assert "TURBOWIRE_REDIS_URL" not in env  # the Redis reaches the connector as store_url
        cfg = TurboWireConfig.from_extra_config(
            extra,
            environ={"TURBOWIRE_AUTH_TOKEN": "a-token-of-enough-chars"},
            known_presets=known_presets(),
        )
        assert cfg.preset == preset
        assert cfg.transport == (store or {}).get("transport", "nixl")
        if store is not None:
            assert cfg.uses_store and cfg.store_url == store["store_url"]
            assert cfg.store_namespace == store["store_namespace"]
            assert cfg.directory_url == extra.get("directory_url", store["store_url"])
            assert cfg.load_failure_policy != "fail"
            if "store_local_cpu_bytes" in store:
                assert cfg.store_local_cpu_bytes == parse_size("x", store["store_local_cpu_bytes"])
            for key in ("store_local_disk", "store_ttl_seconds", "store_chunk_tokens"):
                if key in store:
                    assert getattr(cfg, key) == store[key], key
        assert cfg.side_channel_host == POD_IP
        if tls_on(values):
            from turbowire.connector.sidechannel.server import SideChannelTLS

            tls = SideChannelTLS.from_config(cfg)
            assert tls is not None and tls.mode == "mTLS"  # serves TLS, requires client certs
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        assert ports["side-channel"] == cfg.side_channel_port
        # the connector's own path, as the issue asks: no environment at all
        TurboWireConfig.from_extra_config(kv["kv_connector_extra_config"], environ={})
    # both roles read and write one store
    assert {k: v for k, v in extras["prefill"].items() if k.startswith(("store", "transport"))} == {
        k: v for k, v in extras["decode"].items() if k.startswith(("store", "transport"))
    }


@pytest.mark.parametrize("case", list(CASES))
def test_side_channel_tls_is_mounted_read_only_where_the_config_points(rendered, case) -> None:
    """turbowire.sideChannel.tls: both engines mount the certificate, key and CA read-only at
    one directory and their kv-transfer-config names the three files there; the proxy (no side
    channel) mounts nothing; TLS off: no volume and no TLS key."""
    values = CASES[case]
    tls = values.get("turbowire", {}).get("sideChannel", {}).get("tls", {})
    for dep in of_kind(rendered[case], "Deployment"):
        spec = dep["spec"]["template"]["spec"]
        role = dep["metadata"]["labels"]["app.kubernetes.io/component"]
        volumes = {v["name"]: v for v in spec.get("volumes", [])}
        for container in spec["containers"]:
            mounts = [m for m in container.get("volumeMounts", [])
                      if m["name"] == "side-channel-tls"]
            args = container.get("args", [])
            if role not in ("prefill", "decode") or not tls.get("enabled"):
                assert not mounts and "side-channel-tls" not in volumes
                if "--kv-transfer-config" in args:
                    extra = json.loads(arg_after(args, "--kv-transfer-config"))[
                        "kv_connector_extra_config"]
                    assert not TLS_KEYS & set(extra)
                continue
            assert mounts == [{"name": "side-channel-tls", "mountPath": TLS_DIR, "readOnly": True}]
            extra = json.loads(arg_after(args, "--kv-transfer-config"))["kv_connector_extra_config"]
            assert extra["side_channel_tls_cert"] == f"{TLS_DIR}/tls.crt"
            assert extra["side_channel_tls_key"] == f"{TLS_DIR}/tls.key"
            assert extra["side_channel_tls_ca"] == f"{TLS_DIR}/ca.crt"
            volume = volumes["side-channel-tls"]
            if tls.get("volume"):
                assert {k: v for k, v in volume.items() if k != "name"} == tls["volume"]
                continue
            projected = volume["projected"]
            assert projected["defaultMode"] == 0o440  # owner and fsGroup read, nobody writes
            files = {
                item["path"]: (src["secret"]["name"], item["key"])
                for src in projected["sources"] for item in src["secret"]["items"]
            }
            ca_secret = tls.get("caSecretName") or tls["secretName"]
            assert files == {
                "tls.crt": (tls["secretName"], "tls.crt"),
                "tls.key": (tls["secretName"], "tls.key"),
                "ca.crt": (ca_secret, tls.get("caKey", "ca.crt")),
            }


def test_side_channel_tls_ca_defaults_to_the_tls_secret(chart) -> None:
    values = {"turbowire": {"sideChannel": {"tls": {"enabled": True, "secretName": "tw-tls"}}}}
    for dep in engines(render(chart, values)):
        (volume,) = [v for v in dep["spec"]["template"]["spec"]["volumes"]
                     if v["name"] == "side-channel-tls"]
        sources = [s["secret"] for s in volume["projected"]["sources"]]
        assert [s["name"] for s in sources] == ["tw-tls", "tw-tls"]
        assert sources[1]["items"] == [{"key": "ca.crt", "path": "ca.crt"}]


def test_store_values_are_not_rendered_with_nixl(chart) -> None:
    """turbowire.store.* apply to store/both only: with nixl the engines' config stays as it was."""
    values = {
        "turbowire": {"store": {"namespace": "x", "ttlSeconds": 60}},
        "redis": {"enabled": True},
    }
    for dep in engines(render(chart, values)):
        (container,) = dep["spec"]["template"]["spec"]["containers"]
        extra = json.loads(arg_after(container["args"], "--kv-transfer-config"))[
            "kv_connector_extra_config"
        ]
        role = dep["metadata"]["labels"]["app.kubernetes.io/component"]
        decode_only = {"save_schedule"} if role == "decode" else set()
        assert set(extra) == {"preset", "side_channel_port", "side_channel_host"} | decode_only


def test_decode_engines_save_after_the_forward_unless_extra_config_says_otherwise(chart) -> None:
    """The decode engine stages nothing for NIXL: ``save_schedule: after_forward`` lets vLLM keep
    its FULL CUDA graphs (the connector asks for PIECEWISE only for a layerwise save)."""
    from turbowire.connector.connector import TurboWireConnector

    for given, want in ((None, {"prefill": None, "decode": "after_forward"}),
                        ("layerwise", {"prefill": "layerwise", "decode": "layerwise"})):
        values = {} if given is None else {"turbowire": {"extraConfig": {"save_schedule": given}}}
        for dep in engines(render(chart, values)):
            role = dep["metadata"]["labels"]["app.kubernetes.io/component"]
            (container,) = dep["spec"]["template"]["spec"]["containers"]
            extra = json.loads(arg_after(container["args"], "--kv-transfer-config"))[
                "kv_connector_extra_config"]
            assert extra.get("save_schedule") == want[role]
            piecewise = TurboWireConnector.requires_piecewise_for_cudagraph(extra)
            assert piecewise is (want[role] != "after_forward")


@pytest.mark.parametrize("transport", ["store", "both"])
def test_store_without_redis_fails_with_the_message(chart, transport: str) -> None:
    with pytest.raises(helm_python.HelmError) as info:
        chart.render({"turbowire": {"transport": transport}}, name=RELEASE, namespace=NAMESPACE)
    message = str(info.value)
    assert f"turbowire.transport={transport} needs a Redis" in message, message
    assert "redis.enabled" in message and "redis.url" in message, message


@pytest.mark.parametrize("case", list(CASES))
def test_probes_hit_the_port_vllm_serves(rendered, case: str) -> None:
    for dep in engines(rendered[case]):
        spec = dep["spec"]["template"]["spec"]
        (container,) = spec["containers"]
        port = int(arg_after(container["args"], "--port"))
        named = {p["name"]: p["containerPort"] for p in container["ports"]}
        assert named["http"] == port
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            get = container[probe]["httpGet"]
            assert get["path"] == "/health"
            target = get["port"]
            assert (named[target] if isinstance(target, str) else target) == port, probe
        mounts = {m["mountPath"] for m in container["volumeMounts"]}
        assert "/dev/shm" in mounts
        # the grace period covers the preStop drain (and the drain covers the lease)
        drain = int(container["lifecycle"]["preStop"]["exec"]["command"][1])
        assert spec["terminationGracePeriodSeconds"] > drain
        role = dep["metadata"]["labels"]["app.kubernetes.io/component"]
        if role == "prefill":
            kv = json.loads(arg_after(container["args"], "--kv-transfer-config"))
            assert drain >= kv["kv_connector_extra_config"].get("lease_seconds", 30)
    docs = rendered[case]
    for svc in of_kind(docs, "Service"):
        component = svc["metadata"]["labels"]["app.kubernetes.io/component"]
        if component in ("prefill", "decode"):
            (dep,) = [
                d
                for d in engines(docs)
                if d["metadata"]["labels"]["app.kubernetes.io/component"] == component
            ]
            (container,) = dep["spec"]["template"]["spec"]["containers"]
            assert svc["spec"]["ports"][0]["targetPort"] == "http"
            assert svc["spec"]["ports"][0]["port"] == int(arg_after(container["args"], "--port"))


def test_gpu_and_scheduling_values_reach_the_pods(rendered) -> None:
    rdma = rendered["values-multi-node-rdma.yaml"]
    for dep in engines(rdma):
        spec = dep["spec"]["template"]["spec"]
        (container,) = spec["containers"]
        assert container["resources"]["limits"]["nvidia.com/gpu"] == 4
        assert spec["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-H200"}
        assert spec["tolerations"][0]["key"] == "nvidia.com/gpu"
        env = {e["name"]: e.get("value") for e in container["env"]}
        assert env["UCX_TLS"] == "rc,cuda_copy,cuda_ipc,tcp"
        assert env["UCX_NET_DEVICES"] == "mlx5_0:1,mlx5_1:1"
        assert "--tensor-parallel-size" in container["args"]
    replicas = {
        d["metadata"]["labels"]["app.kubernetes.io/component"]: d["spec"]["replicas"]
        for d in engines(rdma)
    }
    assert replicas == {"prefill": 2, "decode": 4}
    for dep in engines(rendered["values-cpu-test.yaml"]):
        (container,) = dep["spec"]["template"]["spec"]["containers"]
        assert "nvidia.com/gpu" not in json.dumps(container["resources"])


def component(docs: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    (obj,) = [
        d
        for d in of_kind(docs, kind)
        if d["metadata"]["labels"]["app.kubernetes.io/component"] == name
    ]
    return obj


@pytest.mark.parametrize("case", list(CASES))
def test_proxy_reads_the_store_directory(rendered, case: str) -> None:
    docs = rendered[case]
    (container,) = component(docs, "Deployment", "proxy")["spec"]["template"]["spec"]["containers"]
    args = container["args"]
    store = expected_store(CASES[case])
    if store is None:
        assert "--directory" not in args and "--store-namespace" not in args
        return
    (engine, *_) = engines(docs)
    (engine_container,) = engine["spec"]["template"]["spec"]["containers"]
    extra = json.loads(arg_after(engine_container["args"], "--kv-transfer-config"))[
        "kv_connector_extra_config"
    ]
    # the directory the engines write (directory_url, by default the store_url) and their namespace
    assert arg_after(args, "--directory") == extra.get("directory_url", store["store_url"])
    assert arg_after(args, "--store-namespace") == store["store_namespace"]


def test_proxy_points_at_the_engine_services(rendered) -> None:
    docs = rendered["defaults"]
    proxy = component(docs, "Deployment", "proxy")
    (container,) = proxy["spec"]["template"]["spec"]["containers"]
    assert container["command"] == ["turbowire"] and container["args"][0] == "proxy"
    services = {s["metadata"]["name"]: s for s in of_kind(docs, "Service")}
    for flag, role in (("--prefill", "prefill"), ("--decode", "decode")):
        url = arg_after(container["args"], flag)
        name = f"{RELEASE}-turbowire-{role}"
        assert url == f"http://{name}.{NAMESPACE}.svc:{services[name]['spec']['ports'][0]['port']}"
    port = int(arg_after(container["args"], "--port"))
    assert container["ports"][0]["containerPort"] == port
    assert container["readinessProbe"]["httpGet"]["path"] == "/health"


# -- network policy, monitoring --------------------------------------------------------------------


@pytest.mark.parametrize("case", list(CASES))
def test_side_channel_and_nixl_ports_open_only_to_the_release(rendered, case: str) -> None:
    docs = rendered[case]
    policies = {
        p["metadata"]["labels"]["app.kubernetes.io/component"]: p
        for p in of_kind(docs, "NetworkPolicy")
    }
    release_only = {"app.kubernetes.io/name": "turbowire", "app.kubernetes.io/instance": RELEASE}
    for dep in engines(docs):
        role = dep["metadata"]["labels"]["app.kubernetes.io/component"]
        (container,) = dep["spec"]["template"]["spec"]["containers"]
        named = {p["name"]: p["containerPort"] for p in container["ports"]}
        env = {e["name"]: e.get("value") for e in container["env"]}
        start, end = (int(x) for x in env["UCX_TCP_PORT_RANGE"].split("-"))
        policy = policies[role]
        assert (
            policy["spec"]["podSelector"]["matchLabels"] == dep["spec"]["selector"]["matchLabels"]
        )
        private = {named["side-channel"]} | set(range(start, end + 1))
        for rule in policy["spec"]["ingress"]:
            opened = set()
            for p in rule["ports"]:
                opened |= set(range(p["port"], p.get("endPort", p["port"]) + 1))
            if opened & private:
                assert rule["from"] == [{"podSelector": {"matchLabels": release_only}}], rule
                assert opened == private
            else:
                assert opened == {named["http"]}


@pytest.mark.parametrize("case", list(CASES))
def test_redis_open_only_to_the_release(rendered, case: str) -> None:
    """The chart's Redis admits this release's pods (engines and proxy) on its port, nobody else."""
    docs = rendered[case]
    redis = CASES[case].get("redis", {})
    policies = [
        p
        for p in of_kind(docs, "NetworkPolicy")
        if p["metadata"]["labels"]["app.kubernetes.io/component"] == "redis"
    ]
    if not redis.get("enabled"):
        assert not policies
        assert not [
            d for d in of_kind(docs, "Deployment") if d["metadata"]["name"].endswith("-redis")
        ]
        return
    (policy,) = policies
    deployment = component(docs, "Deployment", "redis")
    service = component(docs, "Service", "redis")
    port = redis.get("port", 6379)
    assert (
        policy["spec"]["podSelector"]["matchLabels"]
        == deployment["spec"]["selector"]["matchLabels"]
    )
    release_only = {"app.kubernetes.io/name": "turbowire", "app.kubernetes.io/instance": RELEASE}
    assert policy["spec"]["ingress"] == [
        {
            "from": [{"podSelector": {"matchLabels": release_only}}],
            "ports": [{"protocol": "TCP", "port": port}],
        }
    ]
    # the engines and the proxy carry the labels the rule admits
    for name in ("prefill", "decode", "proxy"):
        labels = component(docs, "Deployment", name)["spec"]["template"]["metadata"]["labels"]
        assert release_only.items() <= labels.items(), name
    assert service["spec"]["ports"][0]["port"] == port
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    assert arg_after(container["args"], "--port") == str(port)
    # a cache: evicts before the kubelet OOM-kills it
    assert arg_after(container["args"], "--maxmemory") == redis.get("maxmemory", "384mb")
    assert arg_after(container["args"], "--maxmemory-policy") == "allkeys-lru"
    store = expected_store(CASES[case])
    if store is not None:
        assert store["store_url"] == f"redis://{service['metadata']['name']}:{port}"


# -- the store's Redis password (issue 33, M6) -----------------------------------------------------

REDIS_AUTH_SECRET = f"{RELEASE}-turbowire-redis-auth"


def containers(doc: dict[str, Any]) -> list[dict[str, Any]]:
    spec = doc["spec"]["template"]["spec"]
    return spec.get("initContainers", []) + spec["containers"]


def env_of(container: dict[str, Any], name: str) -> dict[str, Any] | None:
    found = [e for e in container.get("env", []) if e["name"] == name]
    assert len(found) <= 1, found
    return found[0] if found else None


def secret_ref(container: dict[str, Any], name: str) -> tuple[str, str] | None:
    """(Secret, key) that env ``name`` comes from; None when unset; fails on a literal value."""
    entry = env_of(container, name)
    if entry is None:
        return None
    assert "value" not in entry, f"{name} is a literal in the pod spec"
    ref = entry["valueFrom"]["secretKeyRef"]
    return ref["name"], ref["key"]


def store_clients(docs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The main container of every engine and of the proxy (the Redis clients)."""
    deps = engines(docs) + [component(docs, "Deployment", "proxy")]
    return [d["spec"]["template"]["spec"]["containers"][0] for d in deps]


def assert_clients_take_the_password_from(docs: list[dict[str, Any]], secret: str | None) -> None:
    for container in store_clients(docs):
        expected = None if secret is None else (secret, "password")
        assert secret_ref(container, "TURBOWIRE_STORE_PASSWORD") == expected, container["name"]


def redis_password_secrets(docs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [d for d in of_kind(docs, "Secret") if d["metadata"]["name"] == REDIS_AUTH_SECRET]


def assert_redis_requires(docs: list[dict[str, Any]], secret: str) -> None:
    """The chart's Redis starts from a redis.conf an init container builds in memory from the
    Secret's file, and its probe authenticates through REDISCLI_AUTH from the same Secret."""
    deployment = component(docs, "Deployment", "redis")
    pod = deployment["spec"]["template"]["spec"]
    (init,) = pod["initContainers"]
    (redis,) = pod["containers"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    init_mounts = {m["name"]: m["mountPath"] for m in init["volumeMounts"]}
    redis_mounts = {m["name"]: m["mountPath"] for m in redis["volumeMounts"]}
    auth = [n for n, v in volumes.items() if "secret" in v]
    (auth_volume,) = auth
    assert volumes[auth_volume]["secret"]["secretName"] == secret
    assert [i["key"] for i in volumes[auth_volume]["secret"]["items"]] == ["password"]
    assert init_mounts[auth_volume] + "/password" in init["command"][-1]
    assert auth_volume not in redis_mounts  # only the init container reads the Secret's file
    (conf_volume,) = [n for n in init_mounts if n != auth_volume]
    assert volumes[conf_volume]["emptyDir"]["medium"] == "Memory"
    conf = f"{redis_mounts[conf_volume]}/redis.conf"
    assert f"{init_mounts[conf_volume]}/redis.conf" in init["command"][-1]
    assert "requirepass" in init["command"][-1]
    assert redis["args"][0] == conf  # redis-server reads a config file only as its 1st argument
    assert "--requirepass" not in redis["args"]
    assert secret_ref(redis, "REDISCLI_AUTH") == (secret, "password")
    assert redis["readinessProbe"]["exec"]["command"][0] == "redis-cli"


@pytest.mark.parametrize("case", list(CASES))
def test_no_password_literal_in_any_pod_spec(rendered, case: str) -> None:
    """Wherever a password exists (the chart's generated Secret), it is in that Secret only: not
    in a Deployment, not in an argument, not in an env value, not in a store URL."""
    import base64

    docs = rendered[case]
    secrets = redis_password_secrets(docs)
    passwords = [base64.b64decode(s["data"]["password"]).decode() for s in secrets]
    assert all(len(p) >= 32 for p in passwords)
    for doc in docs:
        if doc["kind"] == "Secret":
            continue
        text = json.dumps(doc)
        for password in passwords:
            assert password not in text, (case, doc["kind"], doc["metadata"]["name"])
        if doc["kind"] == "Deployment":
            for container in containers(doc):
                for name in ("TURBOWIRE_STORE_PASSWORD", "REDISCLI_AUTH"):
                    secret_ref(container, name)  # from a Secret, never a literal
                assert not any("requirepass" in a for a in container.get("args", []))
    for engine in engines(docs):
        extra = json.loads(arg_after(engine["spec"]["template"]["spec"]["containers"][0]["args"],
                                     "--kv-transfer-config"))["kv_connector_extra_config"]
        assert not any("password" in str(k) for k in extra), extra
        for key in ("store_url", "directory_url"):
            if key in extra:
                assert "@" not in extra[key], extra[key]


def test_chart_redis_requires_a_password_by_default(rendered) -> None:
    """redis.enabled alone: a generated Secret, the Redis requires its password, engines and
    proxy take it by secretKeyRef."""
    docs = rendered["store-in-chart"]
    (secret,) = redis_password_secrets(docs)
    assert set(secret["data"]) == {"password"}
    assert_redis_requires(docs, REDIS_AUTH_SECRET)
    assert_clients_take_the_password_from(docs, REDIS_AUTH_SECRET)
    both = rendered["both-in-chart"]  # another port: the probe and the env are the same
    assert_redis_requires(both, REDIS_AUTH_SECRET)
    assert_clients_take_the_password_from(both, REDIS_AUTH_SECRET)


def test_existing_secret_is_honoured(chart, rendered) -> None:
    docs = render(chart, {"turbowire": {"transport": "store"},
                          "redis": {"enabled": True, "auth": {"existingSecret": "my-redis-pw"}}})
    assert not redis_password_secrets(docs)  # nothing generated
    assert_redis_requires(docs, "my-redis-pw")
    assert_clients_take_the_password_from(docs, "my-redis-pw")
    # an external Redis: the clients get the operator's Secret, nothing is deployed or created
    external = rendered["store-external-auth"]
    assert not redis_password_secrets(external)
    assert not [d for d in of_kind(external, "Deployment") if d["metadata"]["name"].endswith(
        "-redis")]
    assert_clients_take_the_password_from(external, "shared-redis-password")
    # an external Redis without a Secret: the chart knows no password, the clients get none
    assert_clients_take_the_password_from(rendered["store-external"], None)


def test_auth_disabled_renders_redis_without_a_password(chart) -> None:
    docs = render(chart, {"turbowire": {"transport": "store"},
                          "redis": {"enabled": True, "auth": {"enabled": False}}})
    assert not redis_password_secrets(docs)
    pod = component(docs, "Deployment", "redis")["spec"]["template"]["spec"]
    assert "initContainers" not in pod
    assert [v["name"] for v in pod["volumes"]] == ["data"]
    (redis,) = pod["containers"]
    assert redis["args"][0] == "--port" and "env" not in redis
    assert_clients_take_the_password_from(docs, None)
    # the existing Secret is ignored too when auth is off
    off = render(chart, {"turbowire": {"transport": "store"},
                         "redis": {"url": "redis://r:6379", "auth": {"enabled": False,
                                                                    "existingSecret": "x"}}})
    assert_clients_take_the_password_from(off, None)


def test_transport_nixl_gives_no_client_the_password(chart) -> None:
    docs = render(chart, {"redis": {"enabled": True}})
    assert_redis_requires(docs, REDIS_AUTH_SECRET)  # deployed (and locked), but unused
    assert_clients_take_the_password_from(docs, None)


@pytest.mark.parametrize("case", list(CASES))
def test_monitoring_objects(rendered, case: str) -> None:
    docs = rendered[case]
    monitoring = CASES[case].get("monitoring", {})
    services = of_kind(docs, "Service")
    for kind, key in (("ServiceMonitor", "serviceMonitor"), ("PodMonitor", "podMonitor")):
        objs = of_kind(docs, kind)
        assert len(objs) == (1 if monitoring.get(key, {}).get("enabled") else 0), kind
        for obj in objs:
            assert obj["apiVersion"] == "monitoring.coreos.com/v1"
            spec = obj["spec"]
            endpoints = spec.get("endpoints") or spec.get("podMetricsEndpoints")
            assert endpoints and all(
                e["port"] == "http" and e["path"] == "/metrics" for e in endpoints
            )
            wanted = spec["selector"]["matchLabels"]
            matched = [
                s
                for s in services
                if wanted.items() <= s["metadata"]["labels"].items()
                and s["metadata"]["labels"]["app.kubernetes.io/component"] != "redis"
            ]
            assert {s["metadata"]["labels"]["app.kubernetes.io/component"] for s in matched} == {
                "prefill",
                "decode",
                "proxy",
            }
            assert all(s["spec"]["ports"][0]["name"] == "http" for s in matched)
    rules = of_kind(docs, "PrometheusRule")
    assert len(rules) == (1 if monitoring.get("prometheusRule", {}).get("enabled") else 0)
    for rule in rules:
        deploy = yaml.safe_load((REPO / "deploy/prometheus/rules.yaml").read_text())
        assert rule["spec"] == deploy
        for group in rule["spec"]["groups"]:
            assert group["name"] and group["rules"]
            for r in group["rules"]:
                assert ("record" in r) != ("alert" in r) and r["expr"]
        alerts = {r["alert"] for g in rule["spec"]["groups"] for r in g["rules"] if "alert" in r}
        assert {"TurboWirePrefillIdle", "TurboWireNotDisaggregated"} <= alerts
    dashboards = [
        d
        for d in of_kind(docs, "ConfigMap")
        if d["metadata"].get("labels", {}).get("grafana_dashboard") == "1"
    ]
    assert len(dashboards) == (1 if monitoring.get("grafanaDashboard", {}).get("enabled") else 0)
    for cm in dashboards:
        assert cm["data"]["turbowire.json"] == (
            REPO / "deploy/grafana/turbowire.json"
        ).read_text().rstrip("\n")
        assert json.loads(cm["data"]["turbowire.json"])["uid"] == "turbowire-kv"


# -- prometheus-operator CRDs ----------------------------------------------------------------------

#: prometheus-operator's published CRDs, vendored unchanged (see the README.md next to them)
CRD_DIR = REPO / "tests" / "data" / "prometheus-operator-crds"
CRD_FILES = {
    "ServiceMonitor": "monitoring.coreos.com_servicemonitors.yaml",
    "PodMonitor": "monitoring.coreos.com_podmonitors.yaml",
    "PrometheusRule": "monitoring.coreos.com_prometheusrules.yaml",
}
CRD_VERSION = "v1"


@pytest.fixture(scope="module")
def crds() -> dict[str, dict[str, Any]]:
    """kind -> the published CRD, and its v1 schema as ``api_server_schema`` turns it."""
    return {kind: load_crd(CRD_DIR / name, CRD_VERSION) for kind, name in CRD_FILES.items()}


def test_every_crd_kind_is_rendered_and_validated(rendered) -> None:
    """Some case renders each prometheus-operator kind (all-on: all of them), so the test below
    validates each against its CRD; and every CRD kind the chart renders has a vendored CRD."""
    kinds = {d["kind"] for docs in rendered.values() for d in docs if d["kind"] in CRD_KINDS}
    assert kinds == CRD_KINDS == set(CRD_FILES)
    assert {d["kind"] for d in rendered["all-on"]} >= CRD_KINDS
    for docs in rendered.values():
        assert all(
            d["apiVersion"] != "monitoring.coreos.com/v1" or d["kind"] in CRD_KINDS for d in docs
        )


@pytest.mark.parametrize("case", list(CASES))
def test_prometheus_operator_objects_match_the_published_crds(rendered, crds, case: str) -> None:
    """Each ServiceMonitor, PodMonitor and PrometheusRule the case renders is one the API server
    accepts with prometheus-operator's CRDs installed (see ``api_server_schema``)."""
    for doc in rendered[case]:
        if doc["kind"] in CRD_KINDS:
            errors = crd_errors(crds, doc)
            assert not errors, (doc["kind"], doc["metadata"]["name"], errors)


_DROP = object()


def _edit(doc: dict[str, Any], path: str, value: Any) -> None:
    """Sets the field at a dotted path (list indexes are numbers) to value, or to value(field)
    where value is callable; deletes it where value is _DROP."""
    *parents, last = path.split(".")
    node: Any = doc
    for part in parents:
        node = node[int(part)] if isinstance(node, list) else node[part]
    key: Any = int(last) if isinstance(node, list) else last
    if value is _DROP:
        del node[key]
    elif callable(value):
        node[key] = value(node[key])
    else:
        node[key] = value


#: (id, kind, edits to the all-on object, an error each must produce (path: message fragment))
CRD_BAD: list[tuple[str, str, list[tuple[str, Any]], list[str]]] = [
    (
        "servicemonitor-spec.endpoint",
        "ServiceMonitor",
        [("spec.endpoint", [{"port": "http"}]), ("spec.endpoints", _DROP)],
        ["spec: Additional properties are not allowed ('endpoint' was unexpected)",
         "spec: 'endpoints' is a required property"],
    ),
    (
        "servicemonitor-interval-30",
        "ServiceMonitor",
        [("spec.endpoints.0.interval", 30)],
        ["spec.endpoints.0.interval: 30 is not of type 'string'"],
    ),
    (
        "servicemonitor-interval-pattern",
        "ServiceMonitor",
        [("spec.endpoints.0.interval", "half a minute")],
        ["spec.endpoints.0.interval: 'half a minute' does not match"],
    ),
    (
        "servicemonitor-nested-typo",
        "ServiceMonitor",
        [("spec.endpoints.0.scrapeTimout", "10s")],
        ["spec.endpoints.0: Additional properties are not allowed ('scrapeTimout' was unexpected)"],
    ),
    (
        "servicemonitor-apiversion",
        "ServiceMonitor",
        [("apiVersion", "monitoring.coreos.com/v1alpha1")],
        ["apiVersion: 'monitoring.coreos.com/v1alpha1', the CRD serves 'monitoring.coreos.com/v1'"],
    ),
    (
        "servicemonitor-null",
        "ServiceMonitor",
        [("spec.endpoints.0.path", None)],
        ["spec.endpoints.0.path: None is not of type 'string'"],
    ),
    (
        "servicemonitor-label-not-a-string",
        "ServiceMonitor",
        [("metadata.labels.release", 1)],
        ["metadata.labels.release: 1 is not of type 'string'"],
    ),
    (
        "podmonitor-endpoint-typo",
        "PodMonitor",
        [("spec.podMetricsEndpoints.0.prot", "http")],
        ["spec.podMetricsEndpoints.0: Additional properties are not allowed ('prot' was"],
    ),
    (
        "podmonitor-no-selector",
        "PodMonitor",
        [("spec.selector", _DROP)],
        ["spec: 'selector' is a required property"],
    ),
    (
        "prometheusrule-rule-without-expr",
        "PrometheusRule",
        [("spec.groups.0.rules.0.expr", _DROP)],
        ["spec.groups.0.rules.0: 'expr' is a required property"],
    ),
    (
        "prometheusrule-expr-a-list",
        "PrometheusRule",
        [("spec.groups.0.rules.0.expr", ["up"])],
        ["spec.groups.0.rules.0.expr: ['up'] is not valid under any of the given schemas"],
    ),
    (
        "prometheusrule-duplicate-group",
        "PrometheusRule",
        [("spec.groups", lambda g: [g[0], copy.deepcopy(g[0]), *g[1:]])],
        ["spec.groups.1: duplicate entry {\"name\": "],
    ),
]  # fmt: skip


@pytest.mark.parametrize(("kind", "edits", "wanted"), [c[1:] for c in CRD_BAD],
                         ids=[c[0] for c in CRD_BAD])  # fmt: skip
def test_crd_validation_refuses_bad_objects(
    rendered, crds, kind: str, edits: list[tuple[str, Any]], wanted: list[str]
) -> None:
    """The validator can fail: misspelled fields, wrong types, a rule without expr are refused."""
    (doc,) = copy.deepcopy(of_kind(rendered["all-on"], kind))
    assert crd_errors(crds, doc) == []
    for path, value in edits:
        _edit(doc, path, value)
    errors = crd_errors(crds, doc)
    for want in wanted:
        assert any(e.startswith(want) for e in errors), (want, errors)


def test_crd_int_or_string_accepts_both(rendered, crds) -> None:
    """x-kubernetes-int-or-string (a rule's expr) takes an integer as well as a string."""
    (doc,) = copy.deepcopy(of_kind(rendered["all-on"], "PrometheusRule"))
    for expr in (1, "vector(1)"):
        _edit(doc, "spec.groups.0.rules.0.expr", expr)
        assert crd_errors(crds, doc) == [], expr


# -- the schema refuses bad values -----------------------------------------------------------------

BAD_VALUES: list[tuple[dict[str, Any], str]] = [
    ({"turbowire": {"preset": "tq5"}}, "preset"),
    ({"turbowire": {"transport": "foo"}}, "transport"),
    ({"turbowire": {"transport": "carrier-pigeon"}}, "transport"),
    ({"turbowire": {"transport": "store"}}, "redis.enabled"),
    (
        {
            "turbowire": {"transport": "both", "extraConfig": {"load_failure_policy": "fail"}},
            "redis": {"enabled": True},
        },
        "load_failure_policy",
    ),
    ({"turbowire": {"extraConfig": {"store_url": "redis://r:6379"}}}, "store_url"),
    ({"turbowire": {"extraConfig": {"store_namespace": "x"}}}, "store_namespace"),
    ({"turbowire": {"extraConfig": {"store_ttl_seconds": 60}}}, "store_ttl_seconds"),
    ({"turbowire": {"store": {"namespace": "a/b"}}}, "namespace"),
    ({"turbowire": {"store": {"localCpuBytes": "lots"}}}, "localCpuBytes"),
    ({"turbowire": {"store": {"ttlSeconds": 0}}}, "ttlSeconds"),
    ({"turbowire": {"store": {"chunkTokens": 0}}}, "chunkTokens"),
    ({"turbowire": {"store": {"ttl": 60}}}, "ttl"),
    ({"turbowire": {"extraConfig": {"directory_url": "http://x"}}}, "directory_url"),
    ({"redis": {"maxmemory": "lots"}}, "maxmemory"),
    ({"prefill": {"replicas": -1}}, "replicas"),
    ({"decode": {"replicas": "two"}}, "replicas"),
    ({"decode": {"shmSize": "16 gigs"}}, "shmSize"),
    ({"resources": {"limits": {"memory": "lots"}}}, "memory"),
    ({"turbowire": {"extraConfig": {"staging_bytes": "1 lot"}}}, "staging_bytes"),
    ({"turbowire": {"extraConfig": {"stagingbytes": "1GiB"}}}, "stagingbytes"),
    ({"turbowire": {"extraConfig": {"preset": "tq3"}}}, "preset"),
    ({"turbowire": {"extraConfig": {"transport": "nixl"}}}, "transport"),
    ({"turbowire": {"extraConfig": {"load_failure_policy": "retry"}}}, "load_failure_policy"),
    ({"turbowire": {"extraConfig": {"lease_seconds": 0}}}, "lease_seconds"),
    ({"turbowire": {"sideChannelPort": 70000}}, "sideChannelPort"),
    ({"turbowire": {"authToken": {"value": "short"}}}, "value"),
    ({"turbowire": {"sideChannel": {"tls": {"enabled": True}}}}, "turbowire.sideChannel.tls"),
    ({"turbowire": {"sideChannel": {"tls": {"enabled": True, "secretName": "a",
                                            "volume": CSI_VOLUME}}}}, "not both"),
    ({"turbowire": {"sideChannel": {"tls": {"enabled": True, "volume": CSI_VOLUME,
                                            "caSecretName": "ca"}}}}, "caSecretName"),
    ({"turbowire": {"sideChannel": {"tls": {"enabled": "yes"}}}}, "enabled"),
    ({"turbowire": {"sideChannel": {"tls": {"enabled": True, "secret": "a"}}}}, "secret"),
    ({"turbowire": {"sideChannel": {"tls": {"enabled": True, "secretName": "Not_A_Name"}}}},
     "secretName"),
    ({"turbowire": {"extraConfig": {"side_channel_tls_cert": "/x.crt"}}}, "side_channel_tls_cert"),
    ({"turbowire": {"extraConfig": {"side_channel_tls_ca": "/ca.crt"}}}, "side_channel_tls_ca"),
    ({"ucx": {"env": {"TLS": "tcp"}}}, "TLS"),
    ({"redis": {"enabled": True, "url": "redis://x:6379/0"}}, "redis"),
    ({"redis": {"url": "x:6379"}}, "url"),
    ({"monitoring": {"serviceMonitor": {"enable": True}}}, "enable"),
    ({"prefill": {"drainSeconds": 10}}, "drainSeconds"),
    ({"turbowire": {"extraConfig": {"lease_seconds": 60}}}, "lease_seconds"),
    ({"decode": {"terminationGracePeriodSeconds": 30}}, "terminationGracePeriodSeconds"),
]


@pytest.mark.parametrize(("values", "field"), BAD_VALUES, ids=[f for _, f in BAD_VALUES])
def test_bad_values_are_refused_naming_the_field(chart, values: dict[str, Any], field: str) -> None:
    with pytest.raises(helm_python.HelmError) as info:
        chart.render(values, name=RELEASE, namespace=NAMESPACE)
    assert field in str(info.value), str(info.value)


# -- checkov ---------------------------------------------------------------------------------------

#: checkov findings the chart accepts, each with the reason (see the chart README, "Security").
CHECKOV_JUSTIFIED: dict[str, str] = {
    # checkov without a Prisma key reports no severities: every failed check must be listed here
    "CKV_K8S_11": "no CPU limit on GPU engines by default: CFS throttling stalls vLLM's scheduler "
    "loop; CPU requests are set (the CPU example sets limits)",
    "CKV_K8S_15": "pullPolicy IfNotPresent: engine images are many GB; pin image.digest instead",
    "CKV_K8S_43": "image.digest is supported and recommended; the default is the chart's tag",
    "CKV_K8S_22": "engines: vLLM, Triton and FlashInfer write JIT caches and compiled kernels "
    "outside /tmp (the proxy and Redis run read-only)",
    "CKV_K8S_35": "the engines read the side-channel token (auth_token_env) and the store's "
    "Redis password (TURBOWIRE_STORE_PASSWORD) from environment variables, as redis-cli in the "
    "Redis probe does (REDISCLI_AUTH); redis-server itself reads it from a file",
    "CKV_K8S_18": "values-single-node.yaml only: hostIPC for CUDA IPC between the prefill and "
    "decode pods of one node",
    "CKV_K8S_25": "values-multi-node-rdma.yaml only: IPC_LOCK for RDMA memory registration",
}


def _checkov() -> str:
    """checkov lives in its own venv (`make setup` builds .venv-checkov: it pins packaging 23.2,
    which pytest cannot run with); CHECKOV overrides the path."""
    path = os.environ.get("CHECKOV") or str(REPO / ".venv-checkov" / "bin" / "checkov")
    if not Path(path).exists():
        path = shutil.which("checkov") or path
    assert Path(path).exists(), f"checkov not found at {path}: run `make setup` (or set CHECKOV)"
    return path


def test_checkov_has_no_unjustified_finding(rendered, tmp_path: Path) -> None:
    for case, docs in rendered.items():
        (tmp_path / f"{case}.yaml").write_text(yaml.safe_dump_all(docs))
    out = subprocess.run(
        [
            _checkov(),
            "-d",
            str(tmp_path),
            "--framework",
            "kubernetes",
            "-o",
            "json",
            "--quiet",
            "--compact",
            "--skip-download",
        ],
        capture_output=True,
        text=True,
        check=False,
        timeout=300,
    )
    report = json.loads(out.stdout)
    reports = report if isinstance(report, list) else [report]
    failed = [
        (c["check_id"], c.get("severity"), c["resource"], c["file_path"])
        for r in reports
        for c in r.get("results", {}).get("failed_checks", [])
    ]
    unjustified = sorted({f for f in failed if f[0] not in CHECKOV_JUSTIFIED})
    assert not unjustified, unjustified


# -- README ----------------------------------------------------------------------------------------

CONTRACT = [
    "model.name", "prefill.replicas", "decode.replicas", "turbowire.preset", "turbowire.transport",
    "turbowire.store.namespace", "turbowire.store.localCpuBytes", "turbowire.store.localDisk",
    "turbowire.store.ttlSeconds", "turbowire.store.chunkTokens",
    "turbowire.extraConfig", "turbowire.sideChannel.tls.enabled",
    "turbowire.sideChannel.tls.secretName", "turbowire.sideChannel.tls.caSecretName",
    "turbowire.sideChannel.tls.caKey", "turbowire.sideChannel.tls.volume", "redis.enabled",
    "redis.url", "redis.auth.enabled", "redis.auth.existingSecret", "redis.maxmemory",
    "redis.maxmemoryPolicy", "monitoring.serviceMonitor.enabled",
    "monitoring.podMonitor.enabled", "monitoring.prometheusRule.enabled",
    "monitoring.grafanaDashboard.enabled", "networkPolicy.enabled", "image.repository",
    "image.tag", "resources", "ucx.env",
]  # fmt: skip


@pytest.mark.parametrize("name", CONTRACT)
def test_contract_values_exist_and_are_documented(chart, name: str) -> None:
    node: Any = chart.values
    for part in name.split("."):
        assert isinstance(node, dict) and part in node, name
        node = node[part]
    assert f"`{name}`" in (CHART / "README.md").read_text(), name


@pytest.mark.parametrize("case", sorted(CASES))
def test_engine_args_parse_with_vllms_own_parser_and_carry_the_guard(rendered, case: str) -> None:
    """Every flag the chart gives an engine is one vLLM 0.32's `vllm serve` accepts, and every
    engine refuses transfer params smuggled in vllm_xargs (turbowire.connector.http_guard)."""
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    from turbowire.serving.launch import HTTP_GUARD

    for dep in engines(rendered[case]):
        (container,) = dep["spec"]["template"]["spec"]["containers"]
        args = make_arg_parser(FlexibleArgumentParser()).parse_args(container["args"])
        assert args.middleware == [HTTP_GUARD], container["args"]


def _engine_http_from(docs: list[dict[str, Any]]) -> dict[str, Any]:
    """role -> the ``from`` of the ingress rule that opens the engine's API port (None: any);
    the chart writes it after the side-channel/UCX rule."""
    out = {}
    for policy in of_kind(docs, "NetworkPolicy"):
        role = policy["metadata"]["labels"]["app.kubernetes.io/component"]
        if role in ("prefill", "decode"):
            rule = policy["spec"]["ingress"][-1]
            assert len(rule["ports"]) == 1 and "endPort" not in rule["ports"][0], rule
            out[role] = rule.get("from")
    return out


def test_engine_api_is_open_to_the_proxy_and_monitoring_only_by_default(chart) -> None:
    """The engines' API accepts kv_transfer_params: by default only this release's proxy (and
    the monitoring namespace, for /metrics) reach it; httpFrom replaces that, [] opens it."""
    proxy = {"podSelector": {"matchLabels": {
        "app.kubernetes.io/name": "turbowire", "app.kubernetes.io/instance": RELEASE,
        "app.kubernetes.io/component": "proxy"}}}
    monitoring = {"namespaceSelector": {"matchLabels": {
        "kubernetes.io/metadata.name": "monitoring"}}}
    for role, source in _engine_http_from(render(chart, {})).items():
        assert source == [proxy, monitoring], (role, source)
    opened = render(chart, {"networkPolicy": {"httpFrom": []}})
    assert set(_engine_http_from(opened).values()) == {None}
    own = [{"ipBlock": {"cidr": "10.9.0.0/16"}}]
    for source in _engine_http_from(render(chart, {"networkPolicy": {"httpFrom": own}})).values():
        assert source == own


def test_proxy_admin_token_and_tenant_salts_come_from_secrets(chart) -> None:
    docs = render(chart, ALL_ON)
    proxy = component(docs, "Deployment", "proxy")
    (container,) = proxy["spec"]["template"]["spec"]["containers"]
    args = container["args"]
    assert arg_after(args, "--tenant-salt-from") == "header:X-Tenant-Id"
    mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in proxy["spec"]["template"]["spec"]["volumes"]}
    for flag, secret in (("--admin-token-file", "tw-proxy-admin"),
                         ("--tenant-salt-secret-file", "tw-tenant-salt")):
        path = Path(arg_after(args, flag))
        mount = mounts[str(path.parent)]
        assert mount["readOnly"] and volumes[mount["name"]]["secret"]["secretName"] == secret
    plain = component(render(chart, {}), "Deployment", "proxy")
    assert "--admin-token-file" not in plain["spec"]["template"]["spec"]["containers"][0]["args"]
    with pytest.raises(Exception, match="tenantSalt.secretName"):
        render(chart, {"proxy": {"tenantSalt": {"from": "api-key"}}})
