"""Settings: every variable of the configuration table, legacy aliases, one clear message per bad value."""

import pytest

from llmserve.config import Config, ConfigError

TABLE = [
    ("MODEL_DIR", None), ("model_name", None), ("HEALTH_HTTP_PORT", "HTTP_PORT"), ("SERVICE_GRPC_PORT", "GRPC_PORT"),
    ("METRICS_HTTP_PORT", "METRICS_PORT"), ("INTER_PROC_PORT", "INFER_QUEUE_PORT"),
    ("SERVICE_HTTP_PORT", "PUSH_MODE_HTTP_PORT"), ("PUSH_MODE_HTTP_WORKERS", None), ("MP_NUM", None),
    ("MP_NNODE", None), ("POD_IPS", None), ("POD_0_IP", None), ("MAX_SEQ_LEN", None), ("MAX_DEC_LEN", None),
    ("BATCH_SIZE", None), ("BLOCK_BS", None), ("BLOCK_RATIO", None), ("BLOCK_SIZE", None),
    ("MAX_CACHED_TASK_NUM", None), ("DISABLE_STREAMING", None), ("USE_WARMUP", None), ("USE_HF_TOKENIZER", None),
    ("USE_CACHE_KV_INT8", None), ("FD_MODEL_CONFIG_PATH", None), ("DISTRIBUTED_CONFIG", None),
    ("OUTPUT_LOG_TO_CONSOLE", None),
]  # fmt: skip


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
        ({"MP_NNODE": "2", "POD_IPS": "10.0.0.1,10.0.0.2"}, "MP_NNODE"),
        ({"PUSH_MODE_HTTP_WORKERS": "9"}, "PUSH_MODE_HTTP_WORKERS"),
        ({"MP_NUM": "2"}, "MP_NUM"),
    ],
)
def test_multi_node_and_limits_are_checked(env, named):
    with pytest.raises(ConfigError, match=named):
        Config.from_env(env=env)
