"""The llm-d integration (deploy/kustomize/llm-d): every overlay rendered by `kubectl kustomize`
from the vendored llm-d bases and the turbowire component, every object valid for the API server
(built-in kinds against the Kubernetes 1.31 schemas, the DisaggregatedSet and the PodMonitor
against their vendored CRDs, unknown fields refused), and every engine a turbowire engine: its
--kv-transfer-config accepted by vLLM's own argument parser and by the connector's own config
parser, with the role of its pod, the side-channel host from the pod IP and the token from a
Secret. The checks are also run where they must fail: on llm-d's unpatched bases, on a tampered
component, and on a base whose arguments moved (kustomize itself refuses that one)."""

from __future__ import annotations

import copy
import hashlib
import json
import re
import shlex
import shutil
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from support.k8s_schemas import KUBE_VERSION, crd_errors, load_crd

from turbowire.connector.codecs import known_presets
from turbowire.connector.config import TurboWireConfig

REPO = Path(__file__).resolve().parents[2]
LLMD = REPO / "deploy" / "kustomize" / "llm-d"
VENDOR = LLMD / "vendor"
GUIDE = VENDOR / "llm-d" / "guides" / "pd-disaggregation"
OVERLAYS = {p.parent.name: p.parent for p in sorted(LLMD.glob("overlays/*/kustomization.yaml"))}
#: llm-d's own bases, unpatched: what the overlays start from
BASES = {
    "deployments": GUIDE / "modelserver" / "gpu" / "vllm" / "base",
    "disaggregatedset": GUIDE / "modelserver" / "gpu" / "vllm-ds" / "base",
}
CRDS = {
    "DisaggregatedSet": VENDOR / "lws" / "disaggregatedset.x-k8s.io_disaggregatedsets.yaml",
    "PodMonitor": REPO / "tests" / "data" / "prometheus-operator-crds"
    / "monitoring.coreos.com_podmonitors.yaml",
}
#: the namespace `kubectl apply -n` gives the objects (the overlays set none, as llm-d's)
NAMESPACE = "llm-d-pd"
IMAGE = "turbowire/vllm-turbowire:0.1.0"
AUTH_SECRET = {"name": "turbowire-auth", "key": "token"}
ROLE_LABEL = "llm-d.ai/role"
KV_ROLES = {"prefill": "kv_producer", "decode": "kv_consumer"}
#: what the kubelet would put in the pod's environment for the test
POD_IP = "10.1.2.3"
TOKEN = "a-token-of-enough-chars"
#: the DisaggregatedSet CRD's one CEL rule (x-kubernetes-validations), checked by hand below
DS_RULE = (
    "self.roles.filter(r, !has(r.scaling) || r.scaling.mode != 'External').all(r, "
    "!has(r.spec.replicas) || r.spec.replicas == 0) || self.roles.filter(r, !has(r.scaling) "
    "|| r.scaling.mode != 'External').all(r, has(r.spec.replicas) && r.spec.replicas > 0)"
)


class KustomizeError(Exception):
    """`kubectl kustomize` refused a directory (its stderr is the message)."""


def kustomize(directory: Path) -> list[dict[str, Any]]:
    """The objects `kubectl kustomize DIR` renders (offline: every base is local)."""
    kubectl = shutil.which("kubectl")
    assert kubectl, (
        "kubectl is not on PATH: this machine kind ships it (Debian package kubectl, with "
        "Kustomize 5); Debian's own kubernetes-client (1.20) is too old for components"
    )
    out = subprocess.run(
        [kubectl, "kustomize", str(directory)],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    if out.returncode != 0:
        raise KustomizeError(f"kubectl kustomize {directory}: {out.stderr.strip()}")
    return [d for d in yaml.safe_load_all(out.stdout) if d]


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[dict[str, Any]]]:
    return {name: kustomize(path) for name, path in OVERLAYS.items()}


@pytest.fixture(scope="module")
def crds() -> dict[str, dict[str, Any]]:
    return {kind: load_crd(path, "v1") for kind, path in CRDS.items()}


# -- the engines of a render -----------------------------------------------------------------------


@dataclass
class Engine:
    """One vLLM pod template of a render: a Deployment's, or a DisaggregatedSet role's."""

    where: str
    role: str
    template: dict[str, Any]

    @property
    def container(self) -> dict[str, Any]:
        containers = self.template["spec"]["containers"]
        (container,) = [c for c in containers if c["name"] == "modelserver"]
        return container


def engines(docs: list[dict[str, Any]]) -> list[Engine]:
    out = []
    for doc in docs:
        name = f"{doc['kind']}/{doc['metadata']['name']}"
        if doc["kind"] == "Deployment":
            template = doc["spec"]["template"]
            out.append(Engine(name, template["metadata"]["labels"][ROLE_LABEL], template))
        elif doc["kind"] == "DisaggregatedSet":
            for role in doc["spec"]["roles"]:
                lwt = role["spec"]["leaderWorkerTemplate"]
                for key in ("leaderTemplate", "workerTemplate"):
                    if key in lwt:
                        template = lwt[key]
                        label = template["metadata"]["labels"][ROLE_LABEL]
                        assert label == role["name"], (name, role["name"], label)
                        out.append(Engine(f"{name} {role['name']}.{key}", label, template))
    return out


def pod_env(container: dict[str, Any]) -> dict[str, str]:
    """The environment the kubelet would give the container: literal values (with $(VAR) of the
    variables before them expanded), the pod IP for status.podIP, the test token for the
    turbowire Secret (other references left out)."""
    env: dict[str, str] = {}
    for item in container.get("env", []):
        if "value" in item:
            env[item["name"]] = kubelet_expand(item["value"], env)
            continue
        source = item.get("valueFrom", {})
        if source.get("fieldRef", {}).get("fieldPath") == "status.podIP":
            env[item["name"]] = POD_IP
        elif source.get("secretKeyRef") == AUTH_SECRET:
            env[item["name"]] = TOKEN
    return env


def kubelet_expand(text: str, env: dict[str, str]) -> str:
    """$(VAR) references, as the kubelet expands them (unknown ones stay as they are)."""
    return re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: env.get(m[1], m[0]), text)


def vllm_args(args: list[str]) -> Any:
    """The engine's arguments through vLLM 0.32's own `vllm serve` parser."""
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    return make_arg_parser(FlexibleArgumentParser()).parse_args(args)


@dataclass
class Checked:
    """What connector_problems found, and what it parsed (None where it could not)."""

    problems: list[str]
    args: Any = None
    config: TurboWireConfig | None = None


def connector_problems(role: str, args: list[str], container: dict[str, Any]) -> Checked:
    """Why vLLM started with ``args`` (as the process gets them) in ``container`` would not be a
    turbowire engine of ``role``."""
    env = pod_env(container)
    problems = []
    if args.count("--kv-transfer-config") != 1 or any(
        a.startswith("--kv-transfer-config=") for a in args
    ):
        return Checked([f"not exactly one --kv-transfer-config: {args}"])
    try:
        kv = json.loads(args[args.index("--kv-transfer-config") + 1])
    except ValueError as exc:
        return Checked([f"--kv-transfer-config is not JSON ({exc})"])
    if kv.get("kv_connector") != "TurboWireConnector":
        problems.append(f"kv_connector {kv.get('kv_connector')!r}")
    if kv.get("kv_connector_module_path") != "turbowire.connector":
        problems.append(f"kv_connector_module_path {kv.get('kv_connector_module_path')!r}")
    if kv.get("kv_role") != KV_ROLES[role]:
        problems.append(f"kv_role {kv.get('kv_role')!r} on a {role} pod")
    try:
        ns = vllm_args(args)
    except SystemExit as exc:  # argparse's way of refusing
        return Checked([*problems, f"vLLM's parser refuses the arguments ({exc})"])
    from turbowire.serving.launch import HTTP_GUARD

    if ns.middleware != [HTTP_GUARD]:
        problems.append(f"--middleware {ns.middleware}")
    if ns.kv_transfer_config.kv_role != kv.get("kv_role"):
        problems.append(f"vLLM reads kv_role {ns.kv_transfer_config.kv_role!r}")
    if problems:
        return Checked(problems, ns)
    extra = kv.get("kv_connector_extra_config", {})
    if "auth_token" in extra:
        problems.append("auth_token inline in kv_connector_extra_config (vLLM logs it)")
    # the connector's own parser, as TurboWireConnector runs it at start (connector.load_config)
    try:
        cfg = TurboWireConfig.from_extra_config(extra, environ=env, known_presets=known_presets())
        cfg.check_resolvable()
    except Exception as exc:  # noqa: BLE001 - the connector's refusal is the finding
        return Checked([*problems, f"the connector refuses its config: {exc}"], ns)
    items = {e["name"]: e for e in container.get("env", [])}
    token = items.get("TURBOWIRE_AUTH_TOKEN", {})
    if token.get("valueFrom", {}).get("secretKeyRef") != AUTH_SECRET or cfg.auth_token != TOKEN:
        problems.append(f"the token does not come from the Secret {AUTH_SECRET}: {token}")
    pod_ip = items.get("POD_IP", {}).get("valueFrom")
    if cfg.side_channel_host != POD_IP or pod_ip != {"fieldRef": {"fieldPath": "status.podIP"}}:
        problems.append(f"side_channel_host {cfg.side_channel_host!r} is not the pod IP")
    if role == "decode" and cfg.save_schedule != "after_forward":
        problems.append(f"decode save_schedule {cfg.save_schedule!r}")
    return Checked(problems, ns, cfg)


def engine_problems(engine: Engine) -> list[str]:
    """Why this pod of a render would not be a working turbowire engine of its role ([] when it
    is): connector_problems, and what the pod spec adds (ports, drain)."""
    container = engine.container
    args = [kubelet_expand(a, pod_env(container)) for a in container.get("args", [])]
    checked = connector_problems(engine.role, args, container)
    problems, ns, cfg = checked.problems, checked.args, checked.config
    if ns is not None and not ns.disable_hybrid_kv_cache_manager:
        problems.append("the hybrid KV cache manager is not disabled")
    if problems or cfg is None:
        return problems
    ports = {p["name"]: p["containerPort"] for p in container.get("ports", [])}
    if ports.get("side-channel") != cfg.side_channel_port:
        problems.append(f"side-channel port {ports.get('side-channel')} != {cfg.side_channel_port}")
    if ports.get("modelserver") != ns.port:
        problems.append(f"the modelserver port {ports.get('modelserver')} is not vLLM's {ns.port}")
    drain = container.get("lifecycle", {}).get("preStop", {}).get("exec", {}).get("command")
    grace = engine.template["spec"].get("terminationGracePeriodSeconds", 30)
    if not drain or drain[0] != "sleep" or not int(drain[1]) < grace:
        problems.append(f"preStop {drain} does not drain within the grace period {grace}")
    elif engine.role == "prefill" and int(drain[1]) < cfg.lease_seconds:
        problems.append(f"prefill drains {drain[1]} s, less than the lease {cfg.lease_seconds} s")
    return problems


# -- render, validate ------------------------------------------------------------------------------


def test_there_is_an_overlay_per_llmd_variant() -> None:
    assert set(OVERLAYS) == set(BASES) == {"deployments", "disaggregatedset"}


@pytest.mark.parametrize("overlay", sorted(OVERLAYS))
def test_overlay_renders_the_objects_of_its_variant(rendered, overlay: str) -> None:
    kinds = sorted(d["kind"] for d in rendered[overlay])
    want = {"deployments": ["Deployment", "Deployment", "PodMonitor", "ServiceAccount"],
            "disaggregatedset": ["DisaggregatedSet", "PodMonitor", "ServiceAccount"]}[overlay]
    assert kinds == want
    assert sorted(e.role for e in engines(rendered[overlay])) == ["decode", "prefill"]


@pytest.mark.parametrize("overlay", sorted(OVERLAYS))
def test_every_object_passes_strict_validation(rendered, crds, overlay: str) -> None:
    for doc in copy.deepcopy(rendered[overlay]):
        doc["metadata"].setdefault("namespace", NAMESPACE)  # kubectl apply -n
        if doc["kind"] in crds:
            assert crd_errors(crds, doc) == [], doc["metadata"]["name"]
        else:
            assert doc["apiVersion"] in ("v1", "apps/v1"), doc["apiVersion"]
            kubernetes_validate.validate(doc, KUBE_VERSION, strict=True)
    for engine in engines(rendered[overlay]):
        # every engine's pod template against Kubernetes' own pod schema as well (for a
        # DisaggregatedSet: beside the copy of it its CRD embeds)
        pod = {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "x"},
               "template": engine.template}  # fmt: skip
        kubernetes_validate.validate(pod, KUBE_VERSION, strict=True)


def ds_rule_holds(doc: dict[str, Any]) -> bool:
    """DS_RULE in Python: the replicas of the roles not scaled externally are all 0 (or unset)
    or all > 0."""
    roles = [r for r in doc["spec"]["roles"] if r.get("scaling", {}).get("mode") != "External"]
    replicas = [r["spec"].get("replicas") for r in roles]
    return all(n in (None, 0) for n in replicas) or all(n is not None and n > 0 for n in replicas)


def test_the_disaggregatedset_crd_rule_is_the_one_checked(rendered, crds) -> None:
    """The CRD's CEL rules are not evaluated by the schema validator: the vendored CRD has one,
    ds_rule_holds checks it (a refreshed CRD with other rules fails here)."""
    found = []

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            found.extend(r["rule"] for r in node.get("x-kubernetes-validations", []))
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(crds["DisaggregatedSet"]["crd"]["spec"]["versions"])
    assert [" ".join(r.split()) for r in found] == [DS_RULE]
    (doc,) = [d for d in rendered["disaggregatedset"] if d["kind"] == "DisaggregatedSet"]
    assert ds_rule_holds(doc)
    broken = copy.deepcopy(doc)
    broken["spec"]["roles"][1]["spec"]["replicas"] = 0
    assert not ds_rule_holds(broken)


@pytest.mark.parametrize(("path", "value", "wanted"), [
    ("spec.roles.0.spec.leaderWorkerTemplate.workerTemplate.spec.containers.0.envv", [],
     "Additional properties are not allowed ('envv' was unexpected)"),
    ("spec.roles.1.spec.rolloutStrategy.type", "Recreate", "is not one of ['RollingUpdate']"),
    ("spec.roles.0.name", "Prefill", "does not match"),
    ("spec.slices", "2", "'2' is not of type 'integer'"),
])  # fmt: skip
def test_disaggregatedset_validation_refuses_bad_objects(
    rendered, crds, path: str, value: Any, wanted: str
) -> None:
    """The validator can fail on the vendored CRD: a misspelled field, a value out of its enum,
    a role name its pattern refuses, a wrong type."""
    (doc,) = copy.deepcopy([d for d in rendered["disaggregatedset"]
                            if d["kind"] == "DisaggregatedSet"])  # fmt: skip
    doc["metadata"]["namespace"] = NAMESPACE
    assert crd_errors(crds, doc) == []
    *parents, last = path.split(".")
    node: Any = doc
    for part in parents:
        node = node[int(part)] if isinstance(node, list) else node[part]
    node[last] = value
    errors = crd_errors(crds, doc)
    assert any(wanted in e for e in errors), errors


# -- the engines -----------------------------------------------------------------------------------


@pytest.mark.parametrize("overlay", sorted(OVERLAYS))
def test_every_engine_is_a_turbowire_engine_of_its_role(rendered, overlay: str) -> None:
    for engine in engines(rendered[overlay]):
        assert engine_problems(engine) == [], engine.where
        assert engine.container["image"] == IMAGE, engine.where
        labels = engine.template["metadata"]["labels"]
        assert labels["app.kubernetes.io/part-of"] == "turbowire", engine.where


@pytest.mark.parametrize("overlay", sorted(OVERLAYS))
def test_the_unpatched_llmd_base_fails_the_checks(overlay: str) -> None:
    """llm-d's own manifests (NixlConnector, kv_both) are not turbowire engines: the checks the
    overlays pass can fail."""
    found = [(e.role, engine_problems(e)) for e in engines(kustomize(BASES[overlay]))]
    assert sorted(role for role, _ in found) == ["decode", "prefill"]
    for role, problems in found:
        assert "kv_connector 'NixlConnector'" in problems, problems
        assert f"kv_role 'kv_both' on a {role} pod" in problems, problems


def _ops(path: Path) -> list[dict[str, Any]]:
    return yaml.safe_load(path.read_text())


def _drop_env(name: str) -> Callable[[list[dict[str, Any]]], list[dict[str, Any]]]:
    return lambda ops: [o for o in ops if not (o["path"].endswith("/env/-")
                                               and o["value"]["name"] == name)]  # fmt: skip


def _edit_kv(edit: Callable[[dict[str, Any]], None]) -> Callable[[list[dict[str, Any]]], Any]:
    def apply(ops: list[dict[str, Any]]) -> list[dict[str, Any]]:
        for op in ops:
            if op["op"] == "replace" and op["path"].endswith("/args/5"):
                kv = json.loads(op["value"])
                edit(kv)
                op["value"] = json.dumps(kv)
        return ops

    return apply


#: (id, component file, how it is broken, a problem the decode engine must then show)
TAMPERED: list[tuple[str, str, Callable[[list[dict[str, Any]]], Any], str]] = [
    ("no-token", "decode-deployment.yaml", _drop_env("TURBOWIRE_AUTH_TOKEN"),
     "the token does not come from the Secret"),
    ("no-pod-ip", "decode-deployment.yaml", _drop_env("POD_IP"),
     "side_channel_host='$(POD_IP)' does not resolve"),
    ("producer-on-decode", "decode-deployment.yaml",
     _edit_kv(lambda kv: kv.update(kv_role="kv_producer")),
     "kv_role 'kv_producer' on a decode pod"),
    ("unknown-preset", "decode-deployment.yaml",
     _edit_kv(lambda kv: kv["kv_connector_extra_config"].update(preset="tq5")),
     "preset='tq5' is unknown"),
    ("misspelled-key", "decode-deployment.yaml",
     _edit_kv(lambda kv: kv["kv_connector_extra_config"].update(side_chanel_port=5701)),
     "'side_chanel_port' -> 'side_channel_port'"),
    ("hybrid-kept", "decode-deployment.yaml",
     lambda ops: [o for o in ops if o.get("value") != "--disable-hybrid-kv-cache-manager"],
     "the hybrid KV cache manager is not disabled"),
    ("no-guard", "decode-deployment.yaml",
     lambda ops: [o for o in ops if "http_guard" not in str(o.get("value"))
                  and o.get("value") != "--middleware"], "--middleware []"),
]  # fmt: skip


@pytest.mark.parametrize(("name", "edit", "wanted"), [(t[1], t[2], t[3]) for t in TAMPERED],
                         ids=[t[0] for t in TAMPERED])  # fmt: skip
def test_a_broken_component_is_caught(tmp_path: Path, name: str, edit, wanted: str) -> None:
    tree = tmp_path / "llm-d"
    shutil.copytree(LLMD, tree)
    patch = tree / "components" / "turbowire" / name
    patch.write_text(yaml.safe_dump(edit(_ops(patch)), sort_keys=False))
    (decode,) = [e for e in engines(kustomize(tree / "overlays" / "deployments"))
                 if e.role == "decode"]  # fmt: skip
    problems = engine_problems(decode)
    assert any(wanted in p for p in problems), problems


@pytest.mark.parametrize("overlay", sorted(OVERLAYS))
def test_a_base_whose_arguments_moved_fails_the_render(tmp_path: Path, overlay: str) -> None:
    """llm-d inserting an argument before --kv-transfer-config must not leave NixlConnector
    in place (or replace the wrong argument): the component's JSON-patch tests stop kustomize."""
    tree = tmp_path / "llm-d"
    shutil.copytree(LLMD, tree)
    base = tree / BASES[overlay].relative_to(LLMD)
    files = [base / "patch-prefill.yaml"] if overlay == "deployments" else [
        base / "disaggregatedset.yaml"]
    for path in files:
        text = path.read_text()
        assert text.count('- "--block-size=128"\n') >= 1
        moved = re.sub(r'( *)- "--block-size=128"\n', r'\g<0>\1- "--enforce-eager"\n', text)
        path.write_text(moved)
    with pytest.raises(KustomizeError, match=r"testing value /spec/.*/containers/0/args/4 failed"):
        kustomize(tree / "overlays" / overlay)


# -- monitoring and routing ------------------------------------------------------------------------


def selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    """A LabelSelector (matchLabels, matchExpressions In/NotIn/Exists/DoesNotExist) on labels."""
    if not selector.get("matchLabels", {}).items() <= labels.items():
        return False
    for expr in selector.get("matchExpressions", []):
        key, op, values = expr["key"], expr["operator"], expr.get("values", [])
        ok = {"In": key in labels and labels[key] in values,
              "NotIn": key not in labels or labels[key] not in values,
              "Exists": key in labels, "DoesNotExist": key not in labels}[op]  # fmt: skip
        if not ok:
            return False
    return True


@pytest.mark.parametrize("overlay", sorted(OVERLAYS))
def test_the_podmonitor_scrapes_vllms_metrics_on_every_engine(rendered, overlay: str) -> None:
    (monitor,) = [d for d in rendered[overlay] if d["kind"] == "PodMonitor"]
    spec = monitor["spec"]
    assert "namespaceSelector" not in spec  # its own namespace: the engines'
    (endpoint,) = spec["podMetricsEndpoints"]
    assert endpoint["path"] == "/metrics"
    for engine in engines(rendered[overlay]):
        assert selects(spec["selector"], engine.template["metadata"]["labels"]), engine.where
        ports = {p["name"]: p["containerPort"] for p in engine.container["ports"]}
        args = vllm_args(engine.container["args"])
        assert ports[endpoint["port"]] == args.port, engine.where  # vLLM's own /metrics
    # this guide's pods only: a pod of another llm-d guide in the namespace is not scraped
    other = dict(engines(rendered[overlay])[0].template["metadata"]["labels"])
    other["llm-d.ai/guide"] = "another-guide"
    assert not selects(spec["selector"], other)


@pytest.mark.parametrize("overlay", sorted(OVERLAYS))
def test_the_routers_inference_pool_selects_the_engines(rendered, overlay: str) -> None:
    """llm-d's router chart creates the InferencePool from router.modelServers.matchLabels (the
    guide's values, vendored): it must still select both roles' pods."""
    values = yaml.safe_load((GUIDE / "router" / "pd-disaggregation.values.yaml").read_text())
    pool = {"matchLabels": values["router"]["modelServers"]["matchLabels"]}
    assert pool["matchLabels"]
    for engine in engines(rendered[overlay]):
        assert selects(pool, engine.template["metadata"]["labels"]), engine.where


# -- KServe (deploy/README.md) ---------------------------------------------------------------------


def kserve_example() -> dict[str, Any]:
    """The LLMInferenceService of deploy/README.md, "turbowire in KServe"."""
    text = (REPO / "deploy" / "README.md").read_text()
    section = text.split("\n## turbowire in KServe\n", 1)[1].split("\n## ", 1)[0]
    (block,) = re.findall(r"```yaml\n(.*?)```", section, re.DOTALL)
    return yaml.safe_load(block)


def kserve_problems(service: dict[str, Any]) -> dict[str, list[str]]:
    """role -> connector_problems of its engine as KServe's templates start it: the kubelet
    expands $(VAR) in the env values, then `eval "exec vllm serve /mnt/models ... --port N ...
    ${VLLM_ADDITIONAL_ARGS} $@"` splits the value into words and removes their quotes (shlex
    does the same for this value: no variables, no backslashes). Decode's vLLM listens on 8001
    behind the routing sidecar, prefill's on 8000."""
    out = {}
    for role, spec, port in (("decode", service["spec"]["template"], "8001"),
                             ("prefill", service["spec"]["prefill"]["template"], "8000")):
        (main,) = [c for c in spec["containers"] if c["name"] == "main"]
        words = shlex.split(pod_env(main).get("VLLM_ADDITIONAL_ARGS", ""))
        out[role] = connector_problems(role, ["/mnt/models", "--port", port, *words], main).problems
    return out  # fmt: skip


def test_the_kserve_example_gives_both_engines_turbowire() -> None:
    service = kserve_example()
    assert (service["apiVersion"], service["kind"]) == (
        "serving.kserve.io/v1alpha2", "LLMInferenceService")
    assert kserve_problems(service) == {"decode": [], "prefill": []}


def test_the_kserve_example_checks_can_fail() -> None:
    """The two mistakes the README warns about: POD_IP after VLLM_ADDITIONAL_ARGS (the kubelet
    leaves $(POD_IP) as it is) and the JSON not single-quoted (eval strips its quotes)."""
    late = kserve_example()
    env = late["spec"]["template"]["containers"][0]["env"]
    env.append(env.pop(0))
    assert env[-1]["name"] == "POD_IP"
    assert "does not resolve" in " ".join(kserve_problems(late)["decode"])
    bare = kserve_example()
    (env,) = [e for e in bare["spec"]["prefill"]["template"]["containers"][0]["env"]
              if e["name"] == "VLLM_ADDITIONAL_ARGS"]  # fmt: skip
    env["value"] = env["value"].replace("'", "")
    assert "is not JSON" in " ".join(kserve_problems(bare)["prefill"])


# -- vendored files --------------------------------------------------------------------------------


def test_vendored_files_are_the_upstream_ones() -> None:
    """Every vendored file is listed in VENDORED.md with its checksum, and matches it."""
    table = dict(re.findall(r"^\| `([^`]+)` \| `([0-9a-f]{64})` \|$",
                            (VENDOR / "VENDORED.md").read_text(), re.MULTILINE))  # fmt: skip
    files = {str(p.relative_to(VENDOR)) for p in VENDOR.rglob("*") if p.is_file()}
    assert files - {"VENDORED.md"} == set(table)
    for name, digest in table.items():
        assert hashlib.sha256((VENDOR / name).read_bytes()).hexdigest() == digest, name
