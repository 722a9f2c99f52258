"""Generate the chart's derived files; ``--check`` exits 1 when a committed one is stale.

One source of truth: Helm reads only files inside the chart, so the Grafana dashboard and the
Prometheus rules of ``deploy/`` are copied into ``files/`` (byte for byte), and
``values.schema.json`` is built here: its preset enum comes from ``turbowire.codec.list_presets()``,
the transport enum from the connector's ``TRANSPORTS``, and the ``turbowire.extraConfig`` and
``turbowire.store`` keys and their types from the connector's ``CONFIG_KEYS``
(``connector/config.py``). tests/unit/test_helm_chart.py runs ``--check``.

    python helm/turbowire/generate.py            # rewrite files/ and values.schema.json
    python helm/turbowire/generate.py --check    # what the tests run
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any

CHART = Path(__file__).resolve().parent
REPO = CHART.parents[1]

#: chart file -> its source in deploy/ (copied byte for byte)
COPIES: dict[str, str] = {
    "files/rules.yaml": "deploy/prometheus/rules.yaml",
    "files/turbowire.json": "deploy/grafana/turbowire.json",
}

#: chart value under turbowire.store -> the connector key it renders (transport store/both only)
STORE_VALUES: dict[str, str] = {
    "namespace": "store_namespace",
    "localCpuBytes": "store_local_cpu_bytes",
    "localDisk": "store_local_disk",
    "ttlSeconds": "store_ttl_seconds",
    "chunkTokens": "store_chunk_tokens",
}
#: connector keys the chart sets from its own values (refused in turbowire.extraConfig; the
#: template's list in _helpers.tpl "turbowire.kvTransferConfig" must name the same keys)
RESERVED_KEYS: dict[str, str] = {
    "preset": "turbowire.preset",
    "side_channel_port": "turbowire.sideChannelPort",
    "side_channel_host": "the pod IP (set by the chart)",
    "auth_token": "turbowire.authToken (a Secret)",
    "transport": "turbowire.transport",
    "store_url": "redis.enabled or redis.url",
    "side_channel_tls_cert": "turbowire.sideChannel.tls",
    "side_channel_tls_key": "turbowire.sideChannel.tls",
    "side_channel_tls_ca": "turbowire.sideChannel.tls",
} | {key: f"turbowire.store.{value}" for value, key in STORE_VALUES.items()}

# sizes as the connector's parse_size reads them (bare K/M/G binary; KB/MB/GB decimal)
CONNECTOR_SIZE = r"^[0-9]+(\.[0-9]+)?([kKmMgG]([iI]?[bB])?|[bB])?$"
# Kubernetes quantities (resource.Quantity)
QUANTITY = r"^[0-9]+(\.[0-9]+)?(m|k|Ki|Mi|Gi|Ti|Pi|M|G|T|P|E|Ei)?$"
DURATION = r"^[0-9]+(ms|s|m|h)$"


def _kind_schema(kind: Any) -> dict[str, Any]:
    """JSON schema of one connector value kind (the connector still validates at start)."""
    from turbowire.connector import config as c

    if isinstance(kind, c.Size):
        return {
            "oneOf": [
                {"type": "integer", "minimum": kind.minimum},
                {"type": "string", "pattern": CONNECTOR_SIZE},
            ],
            "description": f"bytes >= {c.format_size(kind.minimum)}: an integer or '64MiB', '1GiB'",
        }
    if isinstance(kind, c.Seconds):
        return {"type": "number", "minimum": kind.minimum}
    if isinstance(kind, c.Int):
        return {"type": "integer", "minimum": kind.minimum, "maximum": kind.maximum}
    if isinstance(kind, c.Choice):
        return {"enum": list(kind.choices)}
    if isinstance(kind, c.Names):
        return {
            "oneOf": [
                {"type": "array", "items": {"type": "string", "minLength": 1}, "minItems": 1},
                {"type": "string", "minLength": 1},
            ]
        }
    if isinstance(kind, c.Fraction):
        return {"type": "number", "exclusiveMinimum": 0, "maximum": 1}
    if isinstance(kind, c.PeerList):
        return {
            "oneOf": [
                {"type": "array", "items": {"type": "string", "minLength": 1}},
                {"type": "string"},
            ],
            "description": "CIDRs, IPs or host names, each with an optional port",
        }
    if isinstance(kind, c.ParamsByName):
        return {
            "type": "object",
            "additionalProperties": {"type": "object", "additionalProperties": {"type": "string"}},
        }
    if isinstance(kind, c.Text):
        return {"type": ["string", "null"]} if kind.nullable else {"type": "string"}
    raise TypeError(f"no schema for value kind {type(kind).__name__}")


def _store_schema() -> dict[str, Any]:
    """turbowire.store: each value typed as its connector key, null meaning the default."""
    from turbowire.connector import config as c

    properties = {}
    for value, key in STORE_VALUES.items():
        schema = _kind_schema(c.CONFIG_KEYS_BY_NAME[key].kind)
        if key == "store_namespace":
            schema = {**schema, "pattern": c.STORE_NAME_RE.pattern}
        default = "the release name" if key == "store_namespace" else "the connector's default"
        properties[value] = {
            "anyOf": [schema, {"type": "null"}],
            "description": f"{key} (transport store/both); null: {default}",
        }
    return _obj(properties, additionalProperties=False)


def _obj(properties: dict[str, Any], **extra: Any) -> dict[str, Any]:
    return {"type": "object", "properties": properties, **extra}


def _count(minimum: int = 0) -> dict[str, Any]:
    return {"type": "integer", "minimum": minimum}


PORT = {"type": "integer", "minimum": 1, "maximum": 65535}
STR = {"type": "string"}
BOOL = {"type": "boolean"}
OBJ = {"type": "object"}
LIST = {"type": "array"}
ARGS = {"type": "array", "items": {"type": "string"}}


def _probe() -> dict[str, Any]:
    return _obj(
        {"periodSeconds": _count(1), "failureThreshold": _count(1)},
        required=["periodSeconds", "failureThreshold"],
    )


def _resources() -> dict[str, Any]:
    quantities = {
        "type": "object",
        "additionalProperties": {
            "oneOf": [
                {"type": "string", "pattern": QUANTITY},
                {"type": "number", "minimum": 0},
            ]
        },
    }
    return _obj({"requests": quantities, "limits": quantities, "claims": LIST})


def _pdb() -> dict[str, Any]:
    either = {"oneOf": [_count(0), {"type": "string", "pattern": r"^[0-9]+%$"}]}
    return _obj({"enabled": BOOL, "maxUnavailable": either, "minAvailable": either})


def _side_channel_tls() -> dict[str, Any]:
    """turbowire.sideChannel.tls: the side channel's TLS files (side_channel_tls_cert/_key/_ca)."""
    name = {"type": "string", "pattern": r"^([a-z0-9]([-a-z0-9.]*[a-z0-9])?)?$", "maxLength": 253}
    return _obj(
        {
            "enabled": {**BOOL, "description": "serve and call the side channel over mutual TLS"},
            "secretName": {
                **name,
                "description": "a kubernetes.io/tls Secret (tls.crt, tls.key); or use volume",
            },
            "caSecretName": {**name, "description": "Secret with the CA bundle; empty: secretName"},
            "caKey": {"type": "string", "minLength": 1, "description": "key of the CA bundle"},
            "volume": {
                **OBJ,
                "description": "instead of the Secrets: a volume source providing tls.crt, "
                "tls.key and ca.crt (e.g. cert-manager's csi-driver, one certificate per pod)",
            },
        },
        required=["enabled"],
        additionalProperties=False,
    )


def _engine(role: str) -> dict[str, Any]:
    return _obj(
        {
            "replicas": {**_count(0), "description": f"number of {role} engines (>= 0)"},
            "port": {**PORT, "description": "vLLM --port (probes and metrics use it)"},
            "extraArgs": ARGS,
            "env": LIST,
            "resources": _resources(),
            "nodeSelector": {"type": "object", "additionalProperties": {"type": "string"}},
            "tolerations": LIST,
            "affinity": OBJ,
            "runtimeClassName": STR,
            "priorityClassName": STR,
            "hostIPC": BOOL,
            "podLabels": OBJ,
            "podAnnotations": OBJ,
            "shmSize": {
                "type": "string",
                "pattern": QUANTITY,
                "description": "a Kubernetes quantity such as 16Gi",
            },
            "drainSeconds": _count(0),
            "terminationGracePeriodSeconds": _count(1),
            "strategy": OBJ,
            "probes": _obj(
                {"startup": _probe(), "readiness": _probe(), "liveness": _probe()},
                required=["startup", "readiness", "liveness"],
            ),
            "securityContext": OBJ,
            "extraVolumes": LIST,
            "extraVolumeMounts": LIST,
            "podDisruptionBudget": _pdb(),
        },
        required=["replicas", "port", "shmSize", "drainSeconds", "terminationGracePeriodSeconds"],
        additionalProperties=False,
    )


def build_schema() -> dict[str, Any]:
    """values.schema.json."""
    from turbowire.codec import list_presets
    from turbowire.connector.config import CONFIG_KEYS, STORE_URL_SCHEMES, TRANSPORTS

    extra_keys = {k.name: _kind_schema(k.kind) for k in CONFIG_KEYS if k.name not in RESERVED_KEYS}
    # Redis URLs of the connector's schemes (its Text rules are code, not a schema); empty: unset
    schemes = "|".join(re.escape(s.removesuffix("://")) for s in STORE_URL_SCHEMES)
    redis_url = f"^(({schemes})://.+)?$"
    extra_keys["directory_url"]["pattern"] = redis_url
    monitor = _obj({"enabled": BOOL, "labels": OBJ}, additionalProperties=False)
    return {
        "$schema": "https://json-schema.org/draft-07/schema#",
        "title": "turbowire chart values (generated by generate.py: do not edit)",
        "type": "object",
        "properties": {
            "nameOverride": STR,
            "fullnameOverride": STR,
            "global": OBJ,
            "image": _obj(
                {
                    "repository": {"type": "string", "minLength": 1},
                    "tag": STR,
                    "digest": {"type": "string", "pattern": r"^(sha256:[0-9a-f]{64})?$"},
                    "pullPolicy": {"enum": ["Always", "IfNotPresent", "Never"]},
                    "pullSecrets": LIST,
                },
                additionalProperties=False,
            ),
            "model": _obj(
                {
                    "name": {
                        "type": "string",
                        "minLength": 1,
                        "description": "Hugging Face id or path (--model)",
                    },
                    "servedModelName": STR,
                    "extraArgs": ARGS,
                    "hfTokenSecret": _obj({"name": STR, "key": STR}),
                    "cache": _obj(
                        {
                            "existingClaim": STR,
                            "sizeLimit": {"type": "string", "pattern": QUANTITY},
                        }
                    ),
                },
                required=["name"],
                additionalProperties=False,
            ),
            "turbowire": _obj(
                {
                    "preset": {
                        "enum": list_presets(),
                        "description": "a codec preset (turbowire presets)",
                    },
                    "transport": {
                        "enum": list(TRANSPORTS),
                        "description": "nixl: P/D hand-off over NIXL; store: the shared store "
                        "(Redis); both: the two (store and both need redis.enabled or redis.url)",
                    },
                    "store": _store_schema(),
                    "sideChannelPort": PORT,
                    "sideChannel": _obj(
                        {"tls": _side_channel_tls()}, additionalProperties=False
                    ),
                    "extraConfig": {
                        "type": "object",
                        "description": "other kv_connector_extra_config keys "
                        "(README 'Connector configuration')",
                        "properties": extra_keys,
                        "additionalProperties": False,
                    },
                    "authToken": _obj(
                        {
                            "existingSecret": STR,
                            "secretKey": {"type": "string", "minLength": 1},
                            "value": {
                                "type": "string",
                                "pattern": r"^(.{8,})?$",
                                "description": "empty or at least 8 characters",
                            },
                        },
                        additionalProperties=False,
                    ),
                },
                required=["preset", "transport", "sideChannelPort"],
                additionalProperties=False,
            ),
            "resources": _resources(),
            "ucx": _obj(
                {
                    "env": {
                        "type": "object",
                        "propertyNames": {"pattern": "^UCX_[A-Z0-9_]+$"},
                        "additionalProperties": {"type": ["string", "number", "boolean"]},
                    },
                    "tcpPortRange": _obj(
                        {"enabled": BOOL, "start": PORT, "end": PORT},
                        required=["enabled", "start", "end"],
                    ),
                },
                additionalProperties=False,
            ),
            "podSecurityContext": OBJ,
            "prefill": _engine("prefill"),
            "decode": _engine("decode"),
            "proxy": _obj(
                {
                    "replicas": _count(0),
                    "port": PORT,
                    "timeoutSeconds": {"type": "number", "exclusiveMinimum": 0},
                    "maxConcurrency": _count(1),
                    "adminTokenSecret": STR,
                    "tenantSalt": _obj(
                        {
                            "from": {
                                "type": "string",
                                "pattern": "^$|^api-key$|^header:[A-Za-z0-9-]+$",
                            },
                            "secretName": STR,
                        },
                        additionalProperties=False,
                    ),
                    "terminationGracePeriodSeconds": _count(1),
                    "service": _obj(
                        {
                            "type": {"enum": ["ClusterIP", "NodePort", "LoadBalancer"]},
                            "port": PORT,
                            "annotations": OBJ,
                        }
                    ),
                    "resources": _resources(),
                    "nodeSelector": OBJ,
                    "tolerations": LIST,
                    "affinity": OBJ,
                    "podLabels": OBJ,
                    "podAnnotations": OBJ,
                    "securityContext": OBJ,
                    "podDisruptionBudget": _pdb(),
                },
                additionalProperties=False,
            ),
            "redis": _obj(
                {
                    "enabled": BOOL,
                    "url": {
                        "type": "string",
                        "pattern": redis_url,
                        "description": "redis://host:port/db of an external Redis",
                    },
                    "auth": _obj(
                        {
                            "enabled": {
                                **BOOL,
                                "description": "the Redis requires a password (a Secret, key "
                                "`password`); engines and proxy get TURBOWIRE_STORE_PASSWORD",
                            },
                            "existingSecret": {
                                "type": "string",
                                "pattern": r"^([a-z0-9]([-a-z0-9.]*[a-z0-9])?)?$",
                                "maxLength": 253,
                                "description": "a Secret with key `password` (also for an "
                                "external redis.url); empty: the chart creates one",
                            },
                        },
                        required=["enabled"],
                        additionalProperties=False,
                    ),
                    "image": {"type": "string", "minLength": 1},
                    "port": PORT,
                    "maxmemory": {
                        "type": "string",
                        "pattern": r"^([0-9]+([kKmMgG][bB]?)?)?$",
                        "description": "Redis maxmemory such as 384mb (empty: no limit)",
                    },
                    "maxmemoryPolicy": {
                        "enum": [
                            "noeviction",
                            "allkeys-lru",
                            "allkeys-lfu",
                            "allkeys-random",
                            "volatile-lru",
                            "volatile-lfu",
                            "volatile-random",
                            "volatile-ttl",
                        ],
                    },
                    "resources": _resources(),
                },
                additionalProperties=False,
            ),
            "monitoring": _obj(
                {
                    "interval": {"type": "string", "pattern": DURATION},
                    "scrapeTimeout": {"type": "string", "pattern": DURATION},
                    "serviceMonitor": monitor,
                    "podMonitor": monitor,
                    "prometheusRule": monitor,
                    "grafanaDashboard": _obj(
                        {"enabled": BOOL, "namespace": STR, "folder": STR},
                        additionalProperties=False,
                    ),
                },
                additionalProperties=False,
            ),
            "networkPolicy": _obj(
                {"enabled": BOOL, "httpFrom": {"type": ["array", "null"]}, "metricsFrom": LIST,
                 "proxyFrom": LIST},
                additionalProperties=False,
            ),
            "serviceAccount": _obj(
                {"create": BOOL, "name": STR, "annotations": OBJ}, additionalProperties=False
            ),
        },
        "additionalProperties": False,
    }


def expected_files() -> dict[str, bytes]:
    """Chart path -> the bytes it must hold."""
    out = {dst: (REPO / src).read_bytes() for dst, src in COPIES.items()}
    out["values.schema.json"] = (json.dumps(build_schema(), indent=2) + "\n").encode()
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 when a file is stale")
    args = parser.parse_args(argv)
    stale = []
    for rel, data in expected_files().items():
        path = CHART / rel
        if path.exists() and path.read_bytes() == data:
            continue
        if args.check:
            stale.append(rel)
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(data)
            print(f"wrote {path.relative_to(REPO)}")
    if stale:
        sys.stderr.write(f"stale chart files {stale}: run python helm/turbowire/generate.py\n")
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
