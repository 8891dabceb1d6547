"""Every production manifest can run: what it names exists, the serving image has what the model imports,
the cache flags are the ones Triton reads, and the GPU batching window sits inside the alerts.

Fast: nothing here starts a server or builds an image (no container runtime on the test machines).
"""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.conftest import ROOT

DEPLOY = ROOT / "deployments"
TRITON = DEPLOY / "triton"
MANIFESTS = sorted(p for p in DEPLOY.rglob("*") if p.is_file() and p.suffix in {".yml", ".yaml", ".json", ".conf", ".sh"}
                   or p.name == "Dockerfile")
# a repository path as manifests write them: deployments/..., configs/..., flows/..., or ./x / ../x beside the file
PATH_RE = re.compile(r"(?<![\w/.$-])((?:\.\.?/|(?:deployments|configs|flows|llmpipe|scripts)/)[\w./-]*\w)")


def _named_paths(manifest: Path) -> list[tuple[str, Path]]:
    """(as written, resolved) for each repository path a manifest names, in its text and comments."""
    text = manifest.read_text()
    if manifest.suffix == ".json":  # a Prefect job template: its descriptions are Prefect's prose, not our paths
        text = json.dumps(_without(json.loads(text), "description"))
    found = []
    for named in PATH_RE.findall(text):
        base = manifest.parent if named.startswith(".") else ROOT
        found.append((named, (base / named).resolve()))
    return found


def _without(obj: object, key: str) -> object:
    if isinstance(obj, dict):
        return {k: _without(v, key) for k, v in obj.items() if k != key}
    return [_without(v, key) for v in obj] if isinstance(obj, list) else obj


def test_manifests_are_found() -> None:
    names = {p.relative_to(DEPLOY).as_posix() for p in MANIFESTS}
    assert {"prefect.yaml", "gpu-pool.json", "triton/docker-compose.yml", "triton/Dockerfile",
            "triton/entrypoint.sh", "monitoring/alerts.yml"} <= names


@pytest.mark.parametrize("manifest", MANIFESTS, ids=lambda p: p.relative_to(DEPLOY).as_posix())
def test_every_path_a_manifest_names_exists(manifest: Path) -> None:
    missing = [text for text, path in _named_paths(manifest) if not path.exists()]
    assert not missing, f"{manifest.relative_to(ROOT)} names paths that do not exist: {missing}"


def test_the_path_check_sees_a_missing_file(tmp_path: Path) -> None:
    planted = tmp_path / "prefect.yaml"
    planted.write_text("# prefect work-pool create x --base-job-template deployments/no-such-pool.json\n")
    assert [t for t, p in _named_paths(planted) if not p.exists()] == ["deployments/no-such-pool.json"]


def test_prefect_entrypoints_name_flows_that_exist() -> None:
    spec = yaml.safe_load((DEPLOY / "prefect.yaml").read_text())
    for dep in spec["deployments"]:
        file, func = dep["entrypoint"].split(":")
        tree = ast.parse((ROOT / file).read_text())
        assert func in {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}, dep["entrypoint"]


def test_gpu_pool_template_defines_every_variable_it_uses() -> None:
    pool = json.loads((DEPLOY / "gpu-pool.json").read_text())
    used = set(re.findall(r"\{\{\s*(\w+)\s*\}\}", json.dumps(pool["job_configuration"])))
    props = pool["variables"]["properties"]
    assert used and used <= set(props), used - set(props)
    # the pool's jobs get the GPUs, and run the image prefect.yaml's GPU pool names
    requests = props["container_create_kwargs"]["default"]["device_requests"]
    assert requests and all(["gpu"] in r["capabilities"] for r in requests)
    spec = yaml.safe_load((DEPLOY / "prefect.yaml").read_text())
    assert props["image"]["default"] == spec["definitions"]["work_pools"]["gpu"]["job_variables"]["image"]


# -- the serving image -------------------------------------------------------------------------------

def _dockerfile() -> list[tuple[str, str]]:
    lines = [ln.strip() for ln in (TRITON / "Dockerfile").read_text().splitlines()]
    return [tuple(ln.split(None, 1)) for ln in lines if ln and not ln.startswith("#")]  # type: ignore[misc]


def test_dockerfile_copies_files_that_exist_and_compose_builds_it() -> None:
    steps = _dockerfile()
    assert steps[0] == ("ARG", "TRITON_IMAGE") and steps[1] == ("FROM", "${TRITON_IMAGE}")
    copies = [args.split()[0] for op, args in steps if op == "COPY"]
    assert copies and all((TRITON / c).is_file() for c in copies), copies
    assert any(op == "RUN" and "requirements.txt" in args for op, args in steps)
    entry = json.loads(dict(steps)["ENTRYPOINT"])
    assert Path(entry[-1]).name == "entrypoint.sh"
    compose = yaml.safe_load((TRITON / "docker-compose.yml").read_text())
    for name, svc in compose["services"].items():
        if name.startswith("triton-"):
            assert svc["build"]["context"] == "." and "TRITON_IMAGE" in svc["build"]["args"]
            assert svc["command"][0].startswith("--"), "the entrypoint runs tritonserver: the command is its arguments"


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


def _requirements() -> dict[str, str]:
    reqs = {}
    for line in (TRITON / "requirements.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name = re.match(r"[\w.-]+", line).group(0)
            reqs[name.lower()] = line[len(name):].strip()
    return reqs


def test_the_image_has_every_package_the_model_imports() -> None:
    import sys

    model = ROOT / "llmpipe" / "serving" / "triton_model.py"
    third_party = _imports(model) - set(sys.stdlib_module_names) - {"__future__", "triton_python_backend_utils"}
    reqs = _requirements()
    assert third_party and third_party <= set(reqs), third_party - set(reqs)
    # the same torch and transformers the pipeline trains and quantizes with
    project = (ROOT / "pyproject.toml").read_text()
    assert f'"torch{reqs["torch"]}"' in project
    assert f'"transformers{reqs["transformers"]}"' in project
    assert reqs["numpy"].endswith("<2"), "Triton 2.51's Python-backend stub is built against numpy 1"


# -- entrypoint.sh: one --cache-config flag per setting, as Triton reads them ------------------------

def _entrypoint(**env: str) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith(("TRITON_", "REDIS_"))}
    # `echo` stands in for tritonserver's argv: what is checked is the command line the script builds
    return subprocess.run(["bash", str(TRITON / "entrypoint.sh"), "--model-repository=/models"],
                          env={**base, "TRITONSERVER": "echo", **env}, capture_output=True, text=True, timeout=30)


def test_entrypoint_cache_flags() -> None:
    assert _entrypoint().stdout.split() == ["--model-repository=/models", "--cache-config=local,size=268435456"]
    redis = _entrypoint(TRITON_CACHE="redis", REDIS_HOST="cache", REDIS_PORT="6380", REDIS_PASSWORD="pw").stdout.split()
    assert redis == ["--model-repository=/models", "--cache-config=redis,host=cache", "--cache-config=redis,port=6380",
                     "--cache-config=redis,password=pw"]
    assert _entrypoint(TRITON_CACHE="none").stdout.split() == ["--model-repository=/models"]
    bad = _entrypoint(TRITON_CACHE="memcached")
    assert bad.returncode == 2 and "TRITON_CACHE must be local, redis or none, got 'memcached'" in bad.stderr


# -- the GPU batching window and the alerts agree ------------------------------------------------------

def _alert(name: str) -> str:
    rules = yaml.safe_load((DEPLOY / "monitoring" / "alerts.yml").read_text())["groups"][0]["rules"]
    return next(r["expr"] for r in rules if r["alert"] == name)


def test_gpu_batching_window_sits_inside_the_alerts() -> None:
    from llmpipe.serving.config import DeployConfig

    gpu = DeployConfig(target="gpu")
    queue_ms = float(re.search(r"/ 1000 > (\d+)", _alert("TritonQueueTimeHigh")).group(1))
    p99_ms = float(re.search(r"/ 1000 > (\d+)", _alert("TritonP99LatencyOverSlo")).group(1))
    window_ms = gpu.max_queue_delay_us / 1000
    # at light load every request waits the whole window: it must leave the queue alert most of its room
    assert window_ms <= queue_ms / 4, (window_ms, queue_ms)
    assert window_ms <= p99_ms / 10, (window_ms, p99_ms)
    assert p99_ms == gpu.slo_p99_ms, "the p99 alert is the deploy stage's objective"


def test_the_project_image_installs_the_project_and_leaves_local_state_out() -> None:
    text = (ROOT / "Dockerfile").read_text()
    assert "COPY . ." in text and "pip install --no-cache-dir -e '.[all]'" in text
    assert "bash scripts/install.sh" in text and (ROOT / "scripts" / "install.sh").is_file()
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert {".venv", ".llmpipe", ".git"} <= set(ignored)


def _threshold(name: str) -> float:
    """The number an alert's expression compares with (its last ``> N``)."""
    return float(re.findall(r"> (\d+(?:\.\d+)?)\s*$", _alert(name).strip())[-1])


def test_streaming_objectives_agree_with_the_gpu_preset_and_the_buckets() -> None:
    from llmpipe.serving.config import DeployConfig
    from llmpipe.serving.openai_api import ITL_BUCKETS, TTFT_BUCKETS
    from llmpipe.serving.repository import render_config

    gpu = DeployConfig(target="gpu")
    ttft_ms = _threshold("StreamTimeToFirstTokenOverSlo")
    itl_ms = _threshold("StreamInterTokenLatencyOverSlo")
    assert ttft_ms == gpu.slo_p99_ms, "the TTFT alert is the deploy stage's objective"
    # the streaming model has no batching window (streams join between decode steps); a stream answered
    # in one piece (no streaming model) waits the batch model's window: it leaves the objective its room
    assert re.search(r"max_queue_delay_microseconds: 0\b", render_config(gpu, streaming=True))
    assert gpu.max_queue_delay_us / 1000 <= ttft_ms / 10
    # a first token waits at most one decode step and its own prefill, each within the ITL objective
    assert 2 * itl_ms <= ttft_ms
    for ms, buckets in ((ttft_ms, TTFT_BUCKETS), (itl_ms, ITL_BUCKETS)):
        # the objective is a bucket bound with neighbours within 25%: histogram_quantile resolves it
        i = buckets.index(ms / 1000)
        assert 0 < i < len(buckets) - 1 and buckets[i - 1] >= 0.75 * ms / 1000 and buckets[i + 1] <= 1.25 * ms / 1000
