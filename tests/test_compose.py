"""docker-compose.yml, its CPU override and the Dockerfile, checked as data (no Docker engine needed)."""
from __future__ import annotations

import dataclasses
import importlib.util
import re
from pathlib import Path

import pytest
import yaml

from shared.settings import ENV_PREFIX, Settings

ROOT = Path(__file__).resolve().parent.parent
SERVICES = {"gateway": "gateway", "scheduler": "scheduler", "gpu_worker": "gpu_worker"}
SETTING_VARS = {ENV_PREFIX + f.name.upper() for f in dataclasses.fields(Settings)}


class ComposeLoader(yaml.SafeLoader):
    """YAML as Compose reads it: `!reset` (drop an inherited value) becomes the string "!reset"."""


ComposeLoader.add_constructor("!reset", lambda loader, node: "!reset")


def load(name: str) -> dict:
    return yaml.load((ROOT / name).read_text(), Loader=ComposeLoader)


@pytest.fixture(scope="module")
def compose() -> dict:
    return load("docker-compose.yml")["services"]


def dockerfile_stages() -> set[str]:
    return set(re.findall(r"^FROM\s+\S+\s+AS\s+(\S+)", (ROOT / "Dockerfile").read_text(), re.M | re.I))


def test_redis_keeps_an_append_only_file_on_a_volume_and_has_a_healthcheck(compose):
    redis = compose["redis"]
    command = " ".join(redis["command"])
    assert "--appendonly yes" in command
    assert any(v.endswith(":/data") for v in redis["volumes"])
    assert "redis-cli" in redis["healthcheck"]["test"] and "ping" in redis["healthcheck"]["test"]


@pytest.mark.parametrize("service", sorted(SERVICES))
def test_services_start_after_redis_is_healthy_and_run_real_modules(compose, service):
    spec = compose[service]
    assert spec["depends_on"]["redis"]["condition"] == "service_healthy"
    assert spec["command"][:2] == ["python", "-m"] and spec["command"][2] == SERVICES[service]
    assert importlib.util.find_spec(spec["command"][2]) is not None
    env = spec["environment"]
    assert env["PAGEDSERVE_REDIS_URL"].startswith("redis://redis:")
    assert set(env) <= SETTING_VARS, f"unknown settings: {set(env) - SETTING_VARS}"
    assert spec["build"]["target"] in dockerfile_stages()


@pytest.mark.parametrize("service", ["gateway", "gpu_worker"])
def test_the_model_folder_is_mounted_where_the_model_setting_points(compose, service):
    spec = compose[service]
    # SOURCE:TARGET[:MODE], where SOURCE may hold `${VAR:-default}`.
    targets = [parts[1] if parts[-1] in ("ro", "rw") else parts[-1] for v in spec["volumes"]
               for parts in [v.rsplit(":", 2)]]
    assert any(spec["environment"]["PAGEDSERVE_MODEL"].startswith(t + "/") for t in targets)


def test_the_gateway_listens_on_all_interfaces_behind_a_published_port(compose):
    gateway = compose["gateway"]
    assert gateway["environment"]["PAGEDSERVE_HOST"] == "0.0.0.0"
    port = gateway["environment"]["PAGEDSERVE_PORT"]
    assert any(p.rsplit(":", 1)[1] == port for p in gateway["ports"])


def test_gpu_workers_reserve_a_gpu_and_can_be_scaled(compose):
    worker = compose["gpu_worker"]
    (device,) = worker["deploy"]["resources"]["reservations"]["devices"]
    assert device["driver"] == "nvidia" and "gpu" in device["capabilities"]
    # `--scale gpu_worker=N` needs replicas that do not collide: no fixed name, host port or worker id.
    assert not {"container_name", "ports", "hostname"} & set(worker)
    assert "PAGEDSERVE_WORKER_ID" not in worker["environment"]
    assert worker["build"]["target"] == "worker"


def test_the_cpu_override_drops_the_gpu_reservation_and_builds_cpu_torch(compose):
    worker = load("docker-compose.cpu.yml")["services"]["gpu_worker"]
    assert worker["deploy"] == "!reset"
    assert worker["build"]["args"]["TORCH_INDEX_URL"].endswith("/cpu")
    assert worker["environment"]["PAGEDSERVE_DEVICE"] == "cpu"
    assert set(worker["environment"]) <= SETTING_VARS
    assert "TORCH_INDEX_URL" in (ROOT / "Dockerfile").read_text()


def test_the_light_image_leaves_torch_out_and_the_context_leaves_the_venv_out():
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert dockerfile_stages() == {"light", "worker"}
    light = dockerfile.split(" AS worker")[0]
    assert "'torch'" in light and "--no-deps" in light
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert {".venv", ".git"} <= set(ignored)
