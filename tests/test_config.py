"""Settings: every variable of the configuration table, legacy aliases, one clear message per bad value;
`llmserve config` prints every one; docs/serving.md documents every one."""

import dataclasses
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from llmserve.config import Config, ConfigError

ROOT = Path(__file__).resolve().parents[1]

TABLE = [
    ("MODEL_DIR", None), ("model_name", None), ("HEALTH_HTTP_PORT", "HTTP_PORT"), ("SERVICE_GRPC_PORT", "GRPC_PORT"),
    ("METRICS_HTTP_PORT", "METRICS_PORT"), ("INTER_PROC_PORT", "INFER_QUEUE_PORT"),
    ("SERVICE_HTTP_PORT", "PUSH_MODE_HTTP_PORT"), ("PUSH_MODE_HTTP_WORKERS", None), ("MP_NUM", None),
    ("MP_NNODE", None), ("POD_IPS", None), ("POD_0_IP", None), ("MAX_SEQ_LEN", None), ("MAX_DEC_LEN", None),
    ("BATCH_SIZE", None), ("BLOCK_BS", None), ("BLOCK_RATIO", None), ("BLOCK_SIZE", None),
    ("MAX_CACHED_TASK_NUM", None), ("DISABLE_STREAMING", None), ("USE_WARMUP", None), ("USE_HF_TOKENIZER", None),
    ("USE_CACHE_KV_INT8", None), ("FD_MODEL_CONFIG_PATH", None), ("DISTRIBUTED_CONFIG", None),
    ("OUTPUT_LOG_TO_CONSOLE", None), ("INTER_PROC_PORT", "INTER_QUEUE_PORT"), ("SERVED_MODEL_NAME", None),
    ("TRITON_METRICS_PORT", None), ("LLMSERVE_HOST", None), ("LLMSERVE_CACHE_DIR", None),
    ("LLMSERVE_START_TIMEOUT", None), ("LLMSERVE_STOP_TIMEOUT", None), ("TRITONSERVER_BIN", None),
    ("TRITON_BACKEND_DIR", None), ("LLMSERVE_TRITON_STUB_PYTHONPATH", None),
]  # fmt: skip
INTERNAL = {
    "LLMSERVE_HTTP_PARENT_PID",
    "LLMSERVE_HTTP_SUPERVISOR_PID",
}  # set by the front end for its own workers: not settings


def test_every_table_variable_and_alias_is_read():
    settings = {env: aliases for env, aliases, _, _ in Config.settings_table()}
    for env, alias in TABLE:
        assert env in settings, env
        if alias:
            assert alias in settings[env], (env, alias)


def test_defaults_follow_the_seeds():
    c = Config.from_env(env={})
    assert (c.health_http_port, c.service_grpc_port, c.metrics_http_port, c.service_http_port) == (
        8110,
        8811,
        8722,
        9965,
    )
    assert (c.max_seq_len, c.max_dec_len, c.batch_size, c.block_ratio, c.block_size) == (8192, 1024, 50, 0.75, 64)
    assert c.max_cached_task_num == 128 and c.block_bs is None  # unset: sized from free memory


def test_legacy_alias_and_new_name():
    assert Config.from_env(env={"HTTP_PORT": "9001"}).health_http_port == 9001
    assert Config.from_env(env={"PUSH_MODE_HTTP_PORT": "-1"}).service_http_port == -1
    assert Config.from_env(env={"HEALTH_HTTP_PORT": "9002", "HTTP_PORT": "9001"}).health_http_port == 9002


def test_every_bad_value_is_named_at_once():
    with pytest.raises(ConfigError) as e:
        Config.from_env(env={"BATCH_SIZE": "zero", "BLOCK_RATIO": "1.5", "GRPC_PORT": "70000", "USE_WARMUP": "maybe"})
    msg = str(e.value)
    for name in ("BATCH_SIZE", "BLOCK_RATIO", "GRPC_PORT", "USE_WARMUP"):
        assert name in msg


@pytest.mark.parametrize(
    "env,named",
    [
        ({"MP_NNODE": "2", "POD_IPS": "10.0.0.1"}, "POD_IPS"),
        ({"MP_NNODE": "2", "POD_IPS": "10.0.0.1,10.0.0.2", "POD_0_IP": "10.0.0.2"}, "POD_0_IP"),
        ({"MP_NNODE": "2", "MP_NUM": "3", "POD_IPS": "10.0.0.1,10.0.0.2"}, "MP_NUM=3: must be a multiple"),
        ({"MP_NNODE": "2", "MP_NUM": "2", "POD_IPS": "10.0.0.1,10.0.0.2", "NODE_RANK": "2"}, "NODE_RANK"),
        ({"PUSH_MODE_HTTP_WORKERS": "9"}, "PUSH_MODE_HTTP_WORKERS"),
        ({"PUSH_MODE_HTTP_WORKERS": "-1"}, "PUSH_MODE_HTTP_WORKERS=-1: 0 \\(auto\\) to 8"),
        ({"MP_NUM": "2", "SPECULATE_METHOD": "mtp"}, "SPECULATE_METHOD=mtp with MP_NUM=2"),
        ({"MP_NUM": "2", "DIST_TIMEOUT": "0"}, "DIST_TIMEOUT"),
    ],
)
def test_multi_node_and_limits_are_checked(env, named):
    with pytest.raises(ConfigError, match=named):
        Config.from_env(env=env)


def test_http_workers_default_to_a_quarter_of_the_cpus(monkeypatch):
    """Unset (0): one front-end process per 4 CPUs the server may run on, 1 to 4; a value given is kept."""
    for cpus, want in [(1, 1), (2, 1), (7, 1), (8, 2), (16, 4), (64, 4)]:
        monkeypatch.setattr("os.sched_getaffinity", lambda pid, n=cpus: set(range(n)))
        assert Config.from_env(env={}).http_workers == want, cpus
        assert Config.from_env(env={"PUSH_MODE_HTTP_WORKERS": "3"}).http_workers == 3


def test_tensor_parallel_settings_are_accepted():
    c = Config.from_env(env={"MP_NUM": "4", "MP_NNODE": "2", "POD_IPS": "10.0.0.1, 10.0.0.2", "NODE_RANK": "1"})
    assert (c.mp_num, c.mp_nnode, c.node_ips, c.node_rank) == (4, 2, ["10.0.0.1", "10.0.0.2"], 1)


def test_inter_queue_port_is_an_alias_of_inter_proc_port():
    assert Config.from_env(env={"INTER_QUEUE_PORT": "8813"}).inter_proc_port == 8813
    assert Config.from_env(env={"INFER_QUEUE_PORT": "8814"}).inter_proc_port == 8814
    assert Config.from_env(env={"INTER_PROC_PORT": "8815", "INTER_QUEUE_PORT": "8813"}).inter_proc_port == 8815
    with pytest.raises(ConfigError, match="INTER_QUEUE_PORT='x'"):
        Config.from_env(env={"INTER_QUEUE_PORT": "x"})


@pytest.mark.parametrize("var", ["LLMSERVE_START_TIMEOUT", "LLMSERVE_STOP_TIMEOUT"])
@pytest.mark.parametrize("value", ["60s", "0", "-1", "nan", ""])
def test_bad_timeouts_are_named(var, value):
    with pytest.raises(ConfigError) as e:
        Config.from_env(env={var: value})
    assert str(e.value).count(var) == 1 and "\n" not in str(e.value)
    assert Config.from_env(env={var: "2.5"}).__getattribute__(var.removeprefix("LLMSERVE_").lower()) == 2.5


@pytest.mark.parametrize("env,named", [({"LLMSERVE_HOST": ""}, "LLMSERVE_HOST"), ({"TRITON_METRICS_PORT": "0"}, "TRITON_METRICS_PORT"),
                                       ({"LLMSERVE_KERNEL_SWITCHES": "ref=2"}, "LLMSERVE_KERNEL_SWITCHES"),
                                       ({"CHECK_HEALTH_INTERVAL": "nan"}, "CHECK_HEALTH_INTERVAL")])  # fmt: skip
def test_new_settings_are_checked(env, named):
    with pytest.raises(ConfigError, match=named):
        Config.from_env(env=env)


def test_read_one_setting_ignores_the_others():
    env = {"BATCH_SIZE": "many", "LLMSERVE_KERNEL_SWITCHES": "ref=1", "INTER_QUEUE_PORT": "9000"}
    assert Config.read("kernel_switches", env) == "ref=1" and Config.read("inter_proc_port", env) == 9000
    assert Config.read("triton_metrics_port", env) == 8002  # unset: the default
    with pytest.raises(ConfigError, match="BATCH_SIZE='many'"):
        Config.read("batch_size", env)


def test_cache_path_and_local_host():
    assert Config(cache_dir="/x/y").cache_path == Path("/x/y")
    assert Config().cache_path == Path.home() / ".cache" / "llmserve"
    assert Config().local_host == "127.0.0.1" and Config(host="10.1.2.3").local_host == "10.1.2.3"
    assert Config(host="::").local_host == "127.0.0.1" and Config(host="::1").local_host == "[::1]"


def run_config(**env: str) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if not any(k in (f.metadata["env"], *f.metadata["aliases"])
                                                              for f in dataclasses.fields(Config))}  # fmt: skip
    return subprocess.run(
        [sys.executable, "-m", "llmserve.cli", "config"],
        env={**clean, **env},
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_llmserve_config_prints_every_setting_with_its_aliases_and_source():
    r = run_config(INTER_QUEUE_PORT="8813", BATCH_SIZE="7", API_KEY="secret-key")
    assert r.returncode == 0, r.stderr
    lines = {line.split(" ", 1)[0]: line for line in r.stdout.splitlines()}
    fields = dataclasses.fields(Config)
    assert list(lines) == [f.metadata["env"] for f in fields]  # every field, once, in order
    for f in fields:
        line = lines[f.metadata["env"]]
        for alias in f.metadata["aliases"]:
            assert alias in line.split(" = ")[0], line
        assert f.metadata["doc"] in line, line
    assert lines["INTER_PROC_PORT"].startswith(
        "INTER_PROC_PORT (INTER_QUEUE_PORT, INFER_QUEUE_PORT) = 8813  # set by INTER_QUEUE_PORT"
    )
    assert lines["BATCH_SIZE"].startswith("BATCH_SIZE = 7  # set, default 50")
    assert lines["TRITON_METRICS_PORT"].startswith("TRITON_METRICS_PORT = 8002  # default")
    assert "secret-key" not in r.stdout and "<set, hidden>" in lines["API_KEY"]


def test_llmserve_config_names_a_bad_setting():
    r = run_config(LLMSERVE_STOP_TIMEOUT="30s")
    assert r.returncode == 2 and "LLMSERVE_STOP_TIMEOUT='30s'" in r.stderr and "Traceback" not in r.stderr


def test_every_setting_is_documented_and_every_llmserve_variable_is_a_setting():
    rows = {}
    doc = (ROOT / "docs" / "serving.md").read_text()
    table = doc[doc.index("## Settings") :].split("\n## ", 1)[0]
    for line in table.splitlines():
        if m := re.match(r"^\| `([^`]+)`(?:, `([^`]+)`)? \| ([^|]*)\|", line):
            rows[m[1]] = rows[m[2] or m[1]] = m[3]
    envs = set()
    for f in dataclasses.fields(Config):
        env = f.metadata["env"]
        envs |= {env, *f.metadata["aliases"]}
        assert env in rows, f"{env} is not in docs/serving.md's settings table"
        for alias in f.metadata["aliases"]:
            assert f"`{alias}`" in rows[env], f"{env}'s alias {alias} is not in docs/serving.md"
    # Every LLMSERVE_* name the package or the scripts use is a setting of Config (or internal).
    sources = [*(ROOT / "server").rglob("*.py"), ROOT / "start_server.sh", ROOT / "stop_server.sh"]
    used = {n for p in sources for n in re.findall(r"LLMSERVE_[A-Z0-9_]+", p.read_text())}
    from llmserve.config import RETIRED_SWITCHES

    assert used - envs - INTERNAL - RETIRED_SWITCHES.keys() == set()


def test_a_retired_kernel_setting_is_refused_naming_its_switch():
    with pytest.raises(ConfigError, match=r"LLMSERVE_GEMV is retired: set LLMSERVE_KERNEL_SWITCHES=gemv=0"):
        Config.from_env(env={"LLMSERVE_GEMV": "0"})


@pytest.mark.parametrize(
    "raw,named",
    [("gemv=2", "'gemv=2': expected gemv=0 or gemv=1"), ("ref", "'ref': expected ref=0 or ref=1"),
     ("gemv=0,fast=1", "unknown switch 'fast' (the switches: gemv, skinny,")],
)  # fmt: skip
def test_a_bad_kernel_switch_is_named(raw, named):
    for check in (lambda: Config.from_env(env={"LLMSERVE_KERNEL_SWITCHES": raw}), Config(kernel_switches=raw).validate):
        with pytest.raises(ConfigError) as e:
            check()
        assert f"LLMSERVE_KERNEL_SWITCHES={raw!r}: {named}" in str(e.value)


def test_kernel_switches_are_a_lab_setting_read_where_they_are_used(monkeypatch):
    """One lab setting holds them (not for users); kernels read the process's switches when they run, never the
    environment at import: without a runner to apply a config's, they are the defaults."""
    t = pytest.importorskip("torch").zeros(1)
    from llmserve.config import KERNEL_SWITCHES
    from llmserve.kernels import HAS_TRITON, switches, use_triton

    assert Config.__dataclass_fields__["kernel_switches"].metadata["doc"].startswith("lab, for kernel experiments")
    assert tuple(f.name for f in dataclasses.fields(switches.Switches)) == KERNEL_SWITCHES
    assert switches.parse("") == switches.Switches() and not switches.Switches().ref  # the rest on
    assert switches.parse(" gemv=0, pdl=0,gemv=1 ") == switches.Switches(pdl=False)  # a later one wins
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert use_triton(t) == HAS_TRITON
    assert switches.apply(Config(kernel_switches="ref=1")) is switches.current and not use_triton(t)
    switches.apply(Config())
    assert switches.current == switches.Switches() and use_triton(t) == HAS_TRITON
    code = "import llmserve.models.llama; from llmserve.kernels import switches; print(switches.current.ref)"
    env = {**os.environ, "BATCH_SIZE": "many", "LLMSERVE_KERNEL_SWITCHES": "ref=1,bad"}
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.split() == ["False"], r.stderr[-2000:]
