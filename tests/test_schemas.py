"""``/snapshot`` and ``/history`` against the JSON Schemas shipped in exporter/schemas: real
answers of agents on several simulated hosts, and the schemas' strictness (a key added or a type
changed without the schema fails here)."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from referencing import Registry, Resource

from tests.agent import exporter_cli as cli
from tests.agent import healthz_until, http_get, serve
from tests.helpers import until

SCHEMAS = Path(__file__).resolve().parent.parent / "exporter" / "schemas"


def schema(name: str) -> dict[str, Any]:
    return json.loads((SCHEMAS / f"{name}.schema.json").read_text())


REGISTRY = Registry().with_resources(
    (f"gpu-exporter/{name}.schema.json", Resource.from_contents(schema(name)))
    for name in ("health", "snapshot", "history")
)
SNAPSHOT = jsonschema.Draft202012Validator(schema("snapshot"), registry=REGISTRY)
HISTORY = jsonschema.Draft202012Validator(schema("history"), registry=REGISTRY)
#: What only the agent's /snapshot has (status --json has not): always there, maybe null.
AGENT_KEYS = (
    {"reaper", "health"},
    {"health", "waste", "thermal", "recommended"},
    {"reaper", "waste"},
)

MIG = """\
gpus:
  - name: NVIDIA H100 80GB HBM3
    gpm: true
    mig_devices:
      - {uuid: MIG-11111111-2222-4333-8444-555555555555, profile: 1g.10gb, fields: {sm_active: 0.3}}
    processes:
      - {spawn: [sleep, "600"], memory: 2GiB, mig: MIG-11111111-2222-4333-8444-555555555555}
  - name: NVIDIA A100-SXM4-40GB
    xids: [{at: 0s, code: 79}, {at: 1s, code: 13}]
    processes:
      - {pid: 4000000, memory: 3GiB}
      - {spawn: [sleep, "600"], orphan: true, orphan_after: 300ms, memory: 1GiB}
  - name: lost
    present: {until: 1s}
"""


def check(validator: jsonschema.Draft202012Validator, document: Any) -> None:
    errors = sorted(validator.iter_errors(document), key=lambda e: list(e.path))
    assert not errors, "\n".join(f"{list(e.path)}: {e.message}" for e in errors[:5])


def agent_document(document: dict[str, Any]) -> None:
    """What the agent adds is there on every level (null when its action has nothing)."""
    top, gpu_keys, process_keys = AGENT_KEYS
    assert top <= document.keys()
    for gpu in document["gpus"]:
        assert gpu_keys <= gpu.keys(), gpu.keys()
        for proc in gpu["processes"] or ():
            assert process_keys <= proc.keys()


@pytest.mark.parametrize("scenario", ["builtin", "mig"])
def test_snapshot_and_history_follow_their_schemas(tmp_path, scenario):
    args = ["--interval", "0.2"]
    if scenario == "builtin":
        args += ["--simulate"]
    else:
        path = tmp_path / "mig.yaml"
        path.write_text(MIG)
        config = tmp_path / "config.yaml"
        config.write_text(
            "actions:\n  zombie_reaper: {every: 200ms, min_age: 300ms, protect_users: []}\n"
            "  thermal: {every: 200ms}\n  recommend: {every: 200ms}\n  waste: {every: 200ms}\n"
        )
        args += ["--simulate", str(path), "--config", str(config)]
    with serve(tmp_path, *args) as (agent, port):
        healthz_until(agent, port)

        def snapshot(query: str = "") -> dict[str, Any]:
            status, body = http_get(f"http://127.0.0.1:{port}/snapshot{query}")
            assert status == 200, body
            return json.loads(body)

        # wait until every action has said something, so the findings' shapes are checked too
        def judged() -> dict[str, Any] | None:
            doc = snapshot()
            ready = doc["reaper"] is not None and all(
                g["thermal"] is not None or not g["up"] for g in doc["gpus"]
            )
            return doc if ready and any(g["recommended"] is not None for g in doc["gpus"]) else None

        document = until(judged, "every action's finding", timeout=20)
        check(SNAPSHOT, document)
        agent_document(document)
        if scenario == "mig":
            gpus = {g["info"]["name"] if g["info"] else "": g for g in document["gpus"]}
            assert gpus["NVIDIA H100 80GB HBM3"]["mig_devices"]
            until(lambda: snapshot()["reaper"]["recent"], "a reaper decision", timeout=20)
            check(SNAPSHOT, snapshot())
        check(SNAPSHOT, snapshot("?gpu=0"))
        for query in ("", "?seconds=1", "?gpu=0&gpu=1"):
            status, body = http_get(f"http://127.0.0.1:{port}/history{query}")
            assert status == 200, body
            check(HISTORY, json.loads(body))


def test_status_json_follows_the_snapshot_schema():
    done = cli("status", "--simulate", "--json")
    assert done.returncode == 0, done.stderr
    check(SNAPSHOT, json.loads(done.stdout))


def test_the_schemas_are_strict():
    done = cli("status", "--simulate", "--json")
    document = json.loads(done.stdout)
    check(SNAPSHOT, document)
    for change in (
        lambda d: d.update(surprise=1),
        lambda d: d["gpus"][0].update(surprise=1),
        lambda d: d["gpus"][0]["info"].update(surprise=1),
        lambda d: d["gpus"][0]["processes"][0].update(surprise=1),
        lambda d: d["host"].update(surprise=1),
        lambda d: d["gpus"][0].update(index="0"),
        lambda d: d["gpus"][0].update(memory_used_bytes=1.5),
        lambda d: d["gpus"][0]["processes"][0].pop("pid"),
        lambda d: d["gpus"][0].pop("utilization_ratio"),
    ):
        changed = copy.deepcopy(document)
        change(changed)
        assert not SNAPSHOT.is_valid(changed), change
    history = {"version": 1, "interval_seconds": 1.0, "now": 1.0, "seconds": 0.0, "samples": 0}
    assert HISTORY.is_valid({**history, "gpus": []})
    assert not HISTORY.is_valid({**history, "gpus": [], "extra": 1})
    assert not HISTORY.is_valid({**history, "version": 2, "gpus": []})
