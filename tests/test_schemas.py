"""``/snapshot`` and ``/history`` against the JSON Schemas shipped in exporter/schemas: real
answers of agents on several simulated hosts, and the schemas' strictness (a key added or a type
changed without the schema fails here)."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import json
from collections.abc import Callable
from importlib import resources
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from referencing import Registry, Resource

from exporter.core.snapshot import Allocation
from tests.agent import exporter_cli as cli
from tests.agent import healthz_until, http_get, serve
from tests.helpers import until
from tests.kubelet import fake_kubelet


def schema(name: str) -> dict[str, Any]:
    """A schema as the package ships it (package data, not a path in the source tree)."""
    return json.loads(
        resources.files("exporter").joinpath("schemas", f"{name}.schema.json").read_text()
    )


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

#: MIG, XIDs, processes for the zombie reaper (one NVML lists but procfs does not show, an
#: orphan), a GPU that is down and one that is gone.
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
  - name: down
    errors: [{field: memory, error: GpuIsLost, from: 1s}]
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


#: The allocations and the waste action's findings: GPU 0 is given to a pod (the fake kubelet)
#: and GPU 1 to Slurm job 4242 (the job-mapping directory), both idle, each with a process
#: holding memory without using it (idle holders); the one on GPU 0 grows (a leak suspect).
ALLOCATED = """\
gpus:
  - name: NVIDIA H100 80GB HBM3
    processes:
      - {spawn: [sleep, "600"], memory: {from: 2GiB, to: 40GiB, over: 600s}}
  - name: NVIDIA H100 80GB HBM3
    processes:
      - {spawn: [sleep, "600"], memory: 3GiB}
"""
#: Every action runs often, so that each has a finding while the test waits.
ACTIONS = """\
actions:
  zombie_reaper: {every: 200ms, min_age: 300ms, protect_users: []}
  thermal: {every: 200ms}
  recommend: {every: 200ms}
  health: {every: 200ms}
  waste: {every: 200ms, for: 500ms, leak: {samples: 3, min_growth: 1MiB}}
"""
PODS = [("team-a", "notebook", "main", "nvidia.com/gpu", ["0"])]


def agent_args(tmp_path: Path, scenario: str, stack: contextlib.ExitStack) -> list[str]:
    """``serve``'s arguments for ``scenario`` (a fake kubelet, if it needs one, in ``stack``)."""
    if scenario == "builtin":
        return ["--simulate"]
    config = tmp_path / "config.yaml"
    config.write_text(ACTIONS)
    path = tmp_path / f"{scenario}.yaml"
    path.write_text(MIG if scenario == "mig" else ALLOCATED)
    args = ["--simulate", str(path), "--config", str(config)]
    if scenario == "allocated":
        jobs = tmp_path / "jobs"
        jobs.mkdir()
        (jobs / "1").write_text("4242 0\n")  # as a Slurm prolog writes it
        (tmp_path / "kubelet").mkdir()
        kubelet = stack.enter_context(fake_kubelet(tmp_path / "kubelet", PODS))
        args += ["--slurm-job-dir", str(jobs), "--kubelet-socket", kubelet.path]
    return args


def judged(document: dict[str, Any]) -> bool:
    """Every action has said something in ``document`` (the findings' shapes are checked too)."""
    up = [g for g in document["gpus"] if g["up"]]
    return (
        document["reaper"] is not None
        and all(g["thermal"] is not None for g in up)
        and any(g["recommended"] is not None for g in up)
    )


#: What each scenario's document must show before it is checked: the parts that are empty or
#: null on a plain host, so that the schema is checked against them filled in.
SHOWS = {
    "builtin": lambda d: True,
    "mig": lambda d: (
        any(g["mig_devices"] for g in d["gpus"])
        and any(g["xids"] for g in d["gpus"])
        and any(not g["up"] for g in d["gpus"])
        and d["reaper"]["recent"]
        and all(g["health"] is not None for g in d["gpus"] if g["up"])
        and any(p["reaper"]["class"] for g in d["gpus"] for p in g["processes"] or ())
    ),
    "allocated": lambda d: (
        {a["source"] for g in d["gpus"] for a in g["allocations"]} == {"kubelet", "job_dir"}
        and all((g["waste"] or {}).get("allocated_idle") for g in d["gpus"])
        and any(
            (p["waste"] or {}).get("leak_growth_bytes") and p["waste"]["idle_holder"]
            for g in d["gpus"]
            for p in g["processes"] or ()
        )
    ),
}


@pytest.mark.parametrize("scenario", ["builtin", "mig", "allocated"])
def test_snapshot_and_history_follow_their_schemas(tmp_path, scenario):
    with contextlib.ExitStack() as stack:
        args = agent_args(tmp_path, scenario, stack)
        agent, port = stack.enter_context(serve(tmp_path, "--interval", "0.2", *args))
        healthz_until(agent, port)

        def get(path: str) -> Any:
            status, body = http_get(f"http://127.0.0.1:{port}{path}")
            assert status == 200, body
            return json.loads(body)

        def ready() -> dict[str, Any] | None:
            document = get("/snapshot")
            return document if judged(document) and SHOWS[scenario](document) else None

        document = until(ready, f"the {scenario} host's findings", timeout=20)
        check(SNAPSHOT, document)
        agent_document(document)
        uuid = document["gpus"][-1]["uuid"]
        for query in ("?gpu=0", f"?gpu={uuid}&gpu=0"):
            check(SNAPSHOT, get(f"/snapshot{query}"))
        for query in ("", "?seconds=1", "?seconds=0.1", "?gpu=0", "?gpu=0&gpu=1", "?seconds=1e9"):
            history = get(f"/history{query}")
            check(HISTORY, history)
            assert history["gpus"] and history["samples"] >= 1, query
        if scenario == "allocated":  # what only the agent adds is held to its keys too
            assert_strict(SNAPSHOT, document, AGENT_CHANGES)
            assert_strict(HISTORY, get("/history"), HISTORY_CHANGES)


def assert_strict(
    validator: jsonschema.Draft202012Validator,
    document: dict[str, Any],
    changes: tuple[Callable[[dict[str, Any]], Any], ...],
) -> None:
    """Each of ``changes``, made to a copy of the valid ``document``, makes it invalid."""
    check(validator, document)
    for number, change in enumerate(changes):
        changed = copy.deepcopy(document)
        change(changed)
        assert not validator.is_valid(changed), f"change {number} was not rejected"


def first_process(d: dict[str, Any]) -> dict[str, Any]:
    return next(p for g in d["gpus"] for p in g["processes"] or ())


#: A key added, renamed or retyped in what the agent adds to the Snapshot.
AGENT_CHANGES: tuple[Callable[[dict[str, Any]], Any], ...] = (
    lambda d: d["health"].update(surprise=1),
    lambda d: d["health"].update(ok="yes"),
    lambda d: d["reaper"].update(surprise=1),
    lambda d: d["reaper"]["recent"].append({"event": "found"}),
    lambda d: d["gpus"][0]["waste"].update(surprise=1),
    lambda d: d["gpus"][0]["waste"].update(idle_holders=1.5),
    lambda d: d["gpus"][0]["thermal"].update(level="0"),
    lambda d: d["gpus"][0].update(recommended=1),
    lambda d: d["gpus"][0]["allocations"][0].update(surprise=1),
    lambda d: d["gpus"][0]["allocations"][0].pop("source"),
    lambda d: first_process(d)["reaper"].update(surprise=1),
    lambda d: first_process(d)["waste"].update(surprise=1),
    lambda d: first_process(d)["waste"].update(leak_growth_bytes="1"),
    lambda d: first_process(d).update(waste={}),
)
#: The same for /history.
HISTORY_CHANGES: tuple[Callable[[dict[str, Any]], Any], ...] = (
    lambda d: d.update(surprise=1),
    lambda d: d.update(version=2),
    lambda d: d.update(samples=1.5),
    lambda d: d.pop("interval_seconds"),
    lambda d: d["gpus"][0].update(surprise=[]),
    lambda d: d["gpus"][0].pop("power_watts"),
    lambda d: d["gpus"][0].update(index="0"),
    lambda d: d["gpus"][0]["memory_used_bytes"].append(1.5),
    lambda d: d["gpus"][0]["utilization_ratio"].append("0.5"),
    lambda d: d["gpus"][0]["timestamps"].append(None),
)


def test_status_json_follows_the_snapshot_schema():
    done = cli("status", "--simulate", "--json")
    assert done.returncode == 0, done.stderr
    check(SNAPSHOT, json.loads(done.stdout))


def test_the_schemas_are_strict():
    """A key added, a key missing or a type changed in the Snapshot's own objects fails (the
    agent's additions and /history: the "allocated" host above)."""
    done = cli("status", "--simulate", "--json")
    document = json.loads(done.stdout)
    changes: tuple[Callable[[dict[str, Any]], Any], ...] = (
        lambda d: d.update(surprise=1),
        lambda d: d["gpus"][0].update(surprise=1),
        lambda d: d["gpus"][0]["info"].update(surprise=1),
        lambda d: d["gpus"][0]["processes"][0].update(surprise=1),
        lambda d: d["host"].update(surprise=1),
        lambda d: d["gpus"][0].update(index="0"),
        lambda d: d["gpus"][0].update(memory_used_bytes=1.5),
        lambda d: d["gpus"][0]["processes"][0].pop("pid"),
        lambda d: d["gpus"][0].pop("utilization_ratio"),
        lambda d: d["gpus"][0].update(temperature_celsius="35"),
        lambda d: d["gpus"][0]["fields"].update(power="70"),
        lambda d: d["errors"].append({"source": "gpu"}),
    )
    assert_strict(SNAPSHOT, document, changes)
    history = {"version": 1, "interval_seconds": 1.0, "now": 1.0, "seconds": 0.0, "samples": 0}
    assert HISTORY.is_valid({**history, "gpus": []})
    assert not HISTORY.is_valid({**history, "gpus": [], "extra": 1})
    assert not HISTORY.is_valid({**history, "version": 2, "gpus": []})


def test_every_allocation_source_follows_the_schema():
    """Each source an allocation can come from (``sampling.owners``), the ``processes`` one
    included, which no simulated host shows (it needs real Slurm cgroups)."""
    document = json.loads(cli("status", "--simulate", "--json").stdout)
    for allocation in (
        Allocation("77", source="processes"),
        Allocation("78"),
        Allocation(source="kubelet", namespace="a", pod="b", container="c"),
    ):
        document["gpus"][0]["allocations"] = [dataclasses.asdict(allocation)]
        check(SNAPSHOT, document)
    document["gpus"][0]["allocations"][0]["source"] = "elsewhere"
    assert not SNAPSHOT.is_valid(document)


@pytest.mark.parametrize("name", ["snapshot", "history"])
def test_every_property_is_described(name):
    """The schema is the documentation of its route: each property says what it holds."""
    undescribed: list[str] = []

    def walk(node: Any, where: str) -> None:
        if isinstance(node, dict):
            for key, value in node.get("properties", {}).items():
                if isinstance(value, dict) and not value.keys() & {"description", "title"}:
                    undescribed.append(f"{where}/{key}")
            for key, value in node.items():
                walk(value, f"{where}/{key}")
        elif isinstance(node, list):
            for i, value in enumerate(node):
                walk(value, f"{where}/{i}")

    walk(schema(name), "")
    assert not undescribed, undescribed
