"""Offline validation of Kubernetes objects as the API server would judge them, shared by the
tests of the Helm chart (tests/unit/test_helm_chart.py) and of the llm-d Kustomize overlays
(tests/unit/test_kustomize_llmd.py): built-in kinds against the Kubernetes schemas that
``kubernetes-validate`` ships (``KUBE_VERSION``), custom resources against their vendored CRDs
(``load_crd``, ``crd_errors``)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import yaml

KUBE_VERSION = "1.31"


def python_pattern(pattern: str) -> str:
    """A Go (RE2) pattern for Python's re: RE2 takes a flag group such as ``(?i)`` anywhere, Python
    only at the start, so a later one scopes the rest: ``^(?i)(a|b)$`` -> ``^(?i:(a|b)$)`` (right
    for a top-level flag group, the only kind in the CRDs; check_schema compiles every pattern)."""
    match = re.search(r"\(\?([ims]+)\)", pattern)
    if match is None or match.start() == 0:
        return pattern
    rest = python_pattern(pattern[match.end() :])
    return f"{pattern[: match.start()]}(?{match.group(1)}:{rest})"


def api_server_schema(schema: dict[str, Any], *, structural: bool = True) -> dict[str, Any]:
    """A CRD's OpenAPI v3 schema as a JSON Schema (draft 4) that refuses what the API server would.

    - ``x-kubernetes-*`` keys are dropped, except ``x-kubernetes-list-type`` (and its
      ``x-kubernetes-list-map-keys``): ``set`` and ``map`` lists refuse duplicates, as the API
      server does (checked by ``_list_type``). ``x-kubernetes-int-or-string`` accepts an integer
      or a string (the CRDs already say so with ``anyOf``; added where they do not).
    - Unknown fields are refused: Kubernetes prunes every field a structural schema does not list
      (a typo silently loses the setting; under ``fieldValidation=Strict``, kubectl's default, the
      request is refused). Emulated, recursively, with ``additionalProperties: false`` wherever the
      schema lists ``properties``, has no ``additionalProperties`` of its own and no
      ``x-kubernetes-preserve-unknown-fields: true``. Not inside ``anyOf``/``allOf``/``oneOf``/
      ``not``: their branches are value validations that may list a subset of the properties.
    - ``pattern`` is Go's RE2: a ``(?i)`` after the start is scoped for Python (``python_pattern``).
    - ``nullable: true`` admits null; otherwise null is refused (the API server would drop a null
      of a non-nullable field: a rendered null is a template bug either way).
    - Defaulting, as far as ``required`` goes: the API server fills in a missing field that has
      a ``default`` before it validates, so such a field is not required here (LWS's
      ``rolloutStrategy.type``). Otherwise validation sees the object as rendered.
    - Not emulated: CEL rules (``x-kubernetes-validations``: the prometheus-operator CRDs have
      none; the one rule of LWS's DisaggregatedSet CRD is checked by test_kustomize_llmd.py
      itself), admission webhooks, and Go's ``format`` checks beyond what jsonschema's format
      checker knows. ``metadata`` (``type: object`` in every CRD) is validated as an ObjectMeta
      by ``crd_errors``.
    """
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if key == "properties":
            out[key] = {name: api_server_schema(sub) for name, sub in value.items()}
        elif key in ("items", "additionalProperties") and isinstance(value, dict):
            out[key] = api_server_schema(value)
        elif key in ("anyOf", "allOf", "oneOf"):
            out[key] = [api_server_schema(sub, structural=False) for sub in value]
        elif key == "not":
            out[key] = api_server_schema(value, structural=False)
        elif key in ("x-kubernetes-list-type", "x-kubernetes-list-map-keys"):
            out[key] = value
        elif key == "pattern":
            out[key] = python_pattern(value)
        elif key == "required":
            defaulted = {n for n, sub in schema.get("properties", {}).items() if "default" in sub}
            if kept := [name for name in value if name not in defaulted]:
                out[key] = kept
        elif key.startswith("x-kubernetes-") or key == "nullable":
            continue
        else:
            out[key] = value
    if schema.get("x-kubernetes-int-or-string") and "anyOf" not in schema:
        out["anyOf"] = [{"type": "integer"}, {"type": "string"}]
    if schema.get("nullable") and isinstance(out.get("type"), str):
        out["type"] = [out["type"], "null"]
    if (
        structural
        and "properties" in schema
        and "additionalProperties" not in schema
        and not schema.get("x-kubernetes-preserve-unknown-fields")
    ):
        out["additionalProperties"] = False
    return out


def _list_type(validator, list_type: str, instance: Any, schema: dict[str, Any]):
    """``x-kubernetes-list-type``: a ``set`` has unique items, a ``map`` unique map keys."""
    if not validator.is_type(instance, "array"):
        return
    keys = schema.get("x-kubernetes-list-map-keys", [])
    seen: set[str] = set()
    for index, item in enumerate(instance):
        if list_type == "set":
            ident = json.dumps(item, sort_keys=True)
        elif list_type == "map" and isinstance(item, dict):
            ident = json.dumps({k: item.get(k) for k in keys}, sort_keys=True)
        else:
            continue
        if ident in seen:
            yield jsonschema.ValidationError(
                f"duplicate entry {ident} in a list of type {list_type!r}", path=[index]
            )
        seen.add(ident)


CRDValidator = jsonschema.validators.extend(
    jsonschema.Draft4Validator, {"x-kubernetes-list-type": _list_type}
)


def load_crd(path: Path, version: str) -> dict[str, Any]:
    """A published CRD file, with a validator of its ``version`` schema as ``api_server_schema``
    turns it: ``{"crd", "version", "validator"}``, the entries ``crd_errors`` reads. The version
    must be the one the CRD serves and stores (objects are validated as that version)."""
    # the C loader when PyYAML has it: CRDs embedding pod templates run to megabytes
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    crd = yaml.load(path.read_text(), Loader=loader)
    versions = [v for v in crd["spec"]["versions"] if v["name"] == version]
    if len(versions) != 1 or not (versions[0]["served"] and versions[0]["storage"]):
        raise ValueError(f"{path.name}: version {version!r} is not the served storage version")
    schema = api_server_schema(versions[0]["schema"]["openAPIV3Schema"])
    CRDValidator.check_schema(schema)
    return {
        "crd": crd,
        "version": version,
        "validator": CRDValidator(schema, format_checker=CRDValidator.FORMAT_CHECKER),
    }


def crd_errors(crds: dict[str, dict[str, Any]], doc: dict[str, Any]) -> list[str]:
    """Every reason the API server, with the published CRD installed, would refuse ``doc``
    (``crds``: kind -> ``load_crd``)."""
    entry = crds.get(doc.get("kind"))
    if entry is None:
        return [f"kind {doc.get('kind')!r}: no CRD among {sorted(crds)}"]
    crd, validator = entry["crd"], entry["validator"]
    errors = []
    want = f"{crd['spec']['group']}/{entry['version']}"
    if doc.get("apiVersion") != want:
        errors.append(f"apiVersion: {doc.get('apiVersion')!r}, the CRD serves {want!r}")
    if doc.get("kind") != crd["spec"]["names"]["kind"]:
        errors.append(f"kind: {doc.get('kind')!r}, the CRD's is {crd['spec']['names']['kind']!r}")
    if crd["spec"]["scope"] == "Namespaced" and not (doc.get("metadata") or {}).get("namespace"):
        errors.append("metadata.namespace: missing, the CRD is namespaced")
    for error in sorted(validator.iter_errors(doc), key=lambda e: list(map(str, e.absolute_path))):
        path = ".".join(map(str, error.absolute_path)) or "<root>"
        errors.append(f"{path}: {error.message}")
    # metadata is `type: object` in the CRD: the API server validates it as an ObjectMeta
    meta = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": doc.get("metadata")}
    try:
        kubernetes_validate.validate(meta, KUBE_VERSION, strict=True)
    except kubernetes_validate.ValidationError as error:
        path = ".".join(map(str, error.absolute_path))
        errors.append(f"{path}: {error.message}")
    return errors
