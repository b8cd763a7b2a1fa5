"""Every setting of the stack, in one place.

Each setting has an environment variable (with its legacy alias, as in the
seeds' start scripts), a default and a validator. `Config.from_env()` reads
them all and reports every bad value at once, each naming its variable.
CLI flags mirror them by overriding fields (`dataclasses.replace`).
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


class ConfigError(ValueError):
    """One or more settings are invalid; the message names each variable."""


def _bool(raw: str) -> bool:
    v = raw.strip().lower()
    if v in ("1", "true", "yes", "on"):
        return True
    if v in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(f"expected 0/1, got {raw!r}")


def _port(raw: str) -> int:
    p = int(raw)
    if p != -1 and not 0 < p < 65536:
        raise ValueError(f"expected a port in 1..65535 (or -1), got {p}")
    return p


def _positive_int(raw: str) -> int:
    v = int(raw)
    if v <= 0:
        raise ValueError(f"expected a positive integer, got {v}")
    return v


def _ratio(raw: str) -> float:
    v = float(raw)
    if not 0.0 < v <= 1.0:
        raise ValueError(f"expected a value in (0, 1], got {v}")
    return v


def _opt_nonneg_int(raw: str) -> int | None:
    if raw.strip() == "":
        return None
    v = int(raw)
    if v < 0:
        raise ValueError(f"expected an integer >= 0, got {v}")
    return v


def _opt_positive_int(raw: str) -> int | None:
    return None if raw.strip() == "" else _positive_int(raw)


def _float(raw: str) -> float:
    try:
        v = float(raw)
    except ValueError:
        raise ValueError("expected a number (no unit: 60, not 60s)") from None
    if math.isnan(v):  # float() takes "nan", and every comparison with it is False: no check would catch it
        raise ValueError("expected a number, got nan")
    return v


def _str(raw: str) -> str:
    return raw


def _host(raw: str) -> str:
    if not raw.strip() or raw != raw.strip():
        raise ValueError("expected an address to bind (0.0.0.0: every interface; 127.0.0.1: this machine only)")
    return raw


# LLMSERVE_KERNEL_SWITCHES's keys: kernels/switches.py's `Switches` (what each does, its default)
KERNEL_SWITCHES = ("gemv", "skinny", "gemv_fuse", "gemv_norm", "pdl", "tp_fused_norm", "tp_gemv_push", "ref")


# The settings LLMSERVE_KERNEL_SWITCHES replaced: set, they are refused naming their key (not ignored).
RETIRED_SWITCHES = {
    "LLMSERVE_GEMV": "gemv",
    "LLMSERVE_SKINNY": "skinny",
    "LLMSERVE_GEMV_FUSE": "gemv_fuse",
    "LLMSERVE_GEMV_NORM": "gemv_norm",
    "LLMSERVE_PDL": "pdl",
    "LLMSERVE_TP_FUSED_NORM": "tp_fused_norm",
    "LLMSERVE_TP_GEMV_PUSH": "tp_gemv_push",
    "LLMSERVE_TORCH_KERNELS": "ref",
}


def parse_kernel_switches(raw: str) -> dict[str, bool]:
    """`gemv=0,pdl=0` as {"gemv": False, "pdl": False}: the switches it names (a later one wins)."""
    out = {}
    for item in filter(None, (i.strip() for i in raw.split(","))):
        key, _, value = (s.strip() for s in item.partition("="))
        if key not in KERNEL_SWITCHES:
            raise ValueError(f"unknown switch {key!r} (the switches: {', '.join(KERNEL_SWITCHES)})")
        if value not in ("0", "1"):
            raise ValueError(f"{item!r}: expected {key}=0 or {key}=1")
        out[key] = value == "1"
    return out


def _kernel_switches(raw: str) -> str:
    parse_kernel_switches(raw)
    return raw


def _speculate_method(raw: str) -> str:
    if raw not in SPECULATE_METHODS:
        raise ValueError(f"expected one of {', '.join(SPECULATE_METHODS)}")
    return raw


SPECULATE_METHODS = ("none", "ngram", "draft", "mtp")
QUANT_TYPES = ("", "weight_only_int8", "weight_only_int4", "fp8")
KV_CACHE_DTYPES = ("auto", "int8", "fp8")


def _choice(choices: tuple[str, ...]) -> Callable[[str], str]:
    def parse(raw: str) -> str:
        if raw not in choices:
            raise ValueError("expected one of " + ", ".join(c or "(empty)" for c in choices))
        return raw

    return parse


def _setting(env: str, default: Any, parse: Callable[[str], Any], *aliases: str, doc: str = ""):
    return field(default=default, metadata={"env": env, "aliases": aliases, "parse": parse, "doc": doc})


@dataclass(frozen=True)
class Config:
    # model
    model_dir: str = _setting("MODEL_DIR", "", _str, doc="model directory (demo model when empty or absent)")
    model_name: str = _setting("model_name", "", _str, doc="model to download, then serve")
    model_config_path: str = _setting(
        "FD_MODEL_CONFIG_PATH", "", _str, doc="model config (default MODEL_DIR/config.json)"
    )
    distributed_config: str = _setting(
        "DISTRIBUTED_CONFIG", "", _str, doc="rank mapping (default MODEL_DIR/rank_mapping.csv)"
    )
    use_hf_tokenizer: bool = _setting("USE_HF_TOKENIZER", False, _bool, doc="load the tokenizer through transformers")
    served_model_name: str = _setting(
        "SERVED_MODEL_NAME", "", _str, doc="the OpenAI `model` name (default: MODEL_DIR's name; `default` always works)"
    )
    runner: str = _setting("LLMSERVE_RUNNER", "auto", _str, doc="auto | paddle | torch")
    device: str = _setting("LLMSERVE_DEVICE", "auto", _str, doc="auto | cpu | cuda")
    cache_dir: str = _setting(
        "LLMSERVE_CACHE_DIR", "", _str, doc="demo model, Triton backends (default ~/.cache/llmserve)"
    )
    step_trace: str = _setting(
        "LLMSERVE_STEP_TRACE",
        "",
        _str,
        doc="diagnosis: append one line per engine step to this file (docs/engine.md: the step trace)",
    )
    intake_trace: str = _setting(
        "LLMSERVE_INTAKE_TRACE",
        "",
        _str,
        doc="diagnosis: append when each layer takes in each request to this file (serving/intake_trace.py)",
    )
    # ports
    health_http_port: int = _setting("HEALTH_HTTP_PORT", 8110, _port, "HTTP_PORT", doc="health probes")
    service_grpc_port: int = _setting("SERVICE_GRPC_PORT", 8811, _port, "GRPC_PORT", doc="Triton gRPC")
    metrics_http_port: int = _setting("METRICS_HTTP_PORT", 8722, _port, "METRICS_PORT", doc="Prometheus metrics")
    inter_proc_port: int = _setting(
        "INTER_PROC_PORT",
        56666,
        _port,
        "INTER_QUEUE_PORT",
        "INFER_QUEUE_PORT",
        doc="engine IPC (always bound to 127.0.0.1, whatever LLMSERVE_HOST says)",
    )
    triton_metrics_port: int = _setting(
        "TRITON_METRICS_PORT",
        8002,
        _port,
        doc="Triton's own metrics, re-exported on METRICS_HTTP_PORT (-1: Triton's metrics off)",
    )
    host: str = _setting(
        "LLMSERVE_HOST", "0.0.0.0", _host, doc="address every port but INTER_PROC_PORT binds to (0.0.0.0: all)"
    )
    service_http_port: int = _setting(
        "SERVICE_HTTP_PORT", 9965, _port, "PUSH_MODE_HTTP_PORT", doc="HTTP front end (-1: none)"
    )
    push_mode_http_workers: int = _setting(
        "PUSH_MODE_HTTP_WORKERS",
        0,
        int,
        doc="front-end processes (<= 8; 0: one per 4 CPUs the server may use, 1 to 4: a burst of requests is "
        "taken in by all of them at once)",
    )
    adapter_instances: int = _setting(
        "ADAPTER_INSTANCES",
        0,
        int,
        doc="Triton model instances (stub processes) of the adapter, which share the streams (<= 8; 0: "
        "one per 64 of BATCH_SIZE: one stub sends about 6,000 responses a second)",
    )
    # parallelism
    mp_num: int = _setting("MP_NUM", 1, _positive_int, doc="tensor-parallel degree: ranks over all nodes, one per GPU")
    mp_nnode: int = _setting("MP_NNODE", 1, _positive_int, doc="nodes (MP_NUM / MP_NNODE ranks on each)")
    pod_ips: str = _setting("POD_IPS", "", _str, doc="comma-separated IPs of the nodes, node 0 first (multi-node)")
    pod_0_ip: str = _setting("POD_0_IP", "", _str, doc="IP of node 0, which serves (default: the first of POD_IPS)")
    node_rank: int | None = _setting(
        "NODE_RANK", None, _opt_nonneg_int, doc="this node's index in POD_IPS (unset: the one holding this host's IP)"
    )
    dist_port: int = _setting(
        "DIST_PORT", 8730, _port, doc="MP_NUM > 1: rendezvous port of the ranks (torch.distributed's store, on node 0)"
    )
    dist_timeout: float = _setting(
        "DIST_TIMEOUT", 300.0, _float, doc="seconds the ranks wait for each other at start (then: an error naming who)"
    )
    dist_heartbeat_timeout: float = _setting(
        "DIST_HEARTBEAT_TIMEOUT",
        10.0,
        _float,
        doc="seconds a tensor-parallel rank may go without a heartbeat before its group is taken for hung and restarted",
    )
    # limits and scheduling
    max_seq_len: int = _setting("MAX_SEQ_LEN", 8192, _positive_int, doc="reject longer inputs")
    max_dec_len: int = _setting("MAX_DEC_LEN", 1024, _positive_int, doc="reject larger max/min_dec_len")
    batch_size: int = _setting("BATCH_SIZE", 50, _positive_int, doc="max running sequences")
    block_bs: int | None = _setting(
        "BLOCK_BS",
        None,
        _opt_positive_int,
        doc="KV blocks = BLOCK_BS * ceil(MAX_SEQ_LEN / BLOCK_SIZE); unset: sized from free memory",
    )
    block_ratio: float = _setting("BLOCK_RATIO", 0.75, _ratio, doc="share of KV blocks that admitting prompts may fill")
    block_size: int = _setting("BLOCK_SIZE", 64, _positive_int, doc="tokens per KV block")
    max_num_batched_tokens: int = _setting(
        "MAX_PREFILL_TOKENS",
        2048,
        _positive_int,
        doc="prompt tokens (and proposals) one step may compute (chunked prefill); each decoding request's token comes on top",
    )
    prefill_catch_up: int = _setting(
        "PREFILL_CATCH_UP",
        2,
        int,
        doc="prompt budget that steps leave unused while nothing waits, in the 8 steps after a request ended, is saved "
        "for later steps, up to this many MAX_PREFILL_TOKENS, so successors that arrive just after a step was scheduled "
        "do not queue behind it (0: off)",
    )
    long_prefill_tokens: int = _setting(
        "LONG_PREFILL_TOKENS",
        0,
        int,
        doc="most prompt tokens of one request per step (0: the runner's default: 256 on CPU, the step budget on CUDA)",
    )
    overlap_scheduling: bool = _setting(
        "LLMSERVE_OVERLAP", True, _bool, doc="schedule step N+1 while step N runs on the GPU (CUDA runner)"
    )
    # tool calls and reasoning in chat outputs (protocol/tool_calls.py, protocol/reasoning.py)
    tool_call_parser: str = _setting(
        "TOOL_CALL_PARSER", "hermes", _choice(("hermes", "llama3_json")), doc="format of the model's tool calls"
    )
    reasoning_parser: str = _setting(
        "REASONING_PARSER", "", _choice(("", "deepseek_r1", "qwen3")),
        doc="split <think>...</think> into reasoning_content (empty: off)",
    )  # fmt: skip
    # speculative decoding
    speculate_method: str = _setting(
        "SPECULATE_METHOD", "none", _speculate_method, doc="none | ngram (prompt lookup) | draft | mtp"
    )
    speculate_max_draft_tokens: int = _setting(
        "SPECULATE_MAX_DRAFT_TOKEN_NUM", 3, int, doc="most proposed tokens per request per step (k, 1..8)"
    )
    speculate_max_ngram_size: int = _setting(
        "SPECULATE_MAX_NGRAM_SIZE", 3, int, doc="ngram: longest suffix looked up in the request's own tokens (1..8)"
    )
    speculate_model_path: str = _setting(
        "SPECULATE_MODEL_PATH",
        "",
        _str,
        doc="draft: the draft model's directory; mtp: where the MTP weights are, when not in MODEL_DIR (HF safetensors)",
    )
    speculate_adaptive: bool = _setting(
        "SPECULATE_ADAPTIVE", True, _bool, doc="choose k per step from measured acceptance and step times (0: always k)"
    )
    kv_cache_memory_fraction: float = _setting(
        "KV_CACHE_MEMORY_FRACTION",
        0.9,
        _ratio,
        doc="share of free device memory for the KV cache when BLOCK_BS is unset",
    )
    enable_prefix_caching: bool = _setting(
        "ENABLE_PREFIX_CACHING", True, _bool, doc="reuse KV blocks of shared prompt prefixes"
    )
    max_cached_task_num: int = _setting(
        "MAX_CACHED_TASK_NUM", 128, _positive_int, doc="requests waiting beyond BATCH_SIZE: reject beyond it"
    )
    # behaviour
    disable_streaming: bool = _setting("DISABLE_STREAMING", False, _bool, doc="send the whole result at once")
    use_warmup: bool = _setting("USE_WARMUP", False, _bool, doc="warm up before ready")
    # quantization (docs/quantization.md)
    quant_type: str = _setting(
        "QUANT_TYPE",
        "",
        _choice(QUANT_TYPES),
        doc="quantize a bf16/fp16 checkpoint's linear layers at load: weight_only_int8 | weight_only_int4 | fp8 "
        "(empty: as the checkpoint is; GPTQ/AWQ/FP8 checkpoints are read by their own quantization_config)",
    )
    use_cache_kv_int8: bool = _setting("USE_CACHE_KV_INT8", False, _bool, doc="int8 KV cache (= KV_CACHE_DTYPE=int8)")
    kv_cache_dtype: str = _setting(
        "KV_CACHE_DTYPE", "auto", _choice(KV_CACHE_DTYPES), doc="KV cache: auto (the model's) | int8 | fp8"
    )
    check_health_interval: float = _setting("CHECK_HEALTH_INTERVAL", 10.0, _float, doc="engine heartbeat timeout (s)")
    drain_timeout: float = _setting(
        "LLMSERVE_DRAIN_TIMEOUT", 10.0, _float, doc="on SIGTERM: seconds requests in flight may take to finish"
    )
    start_timeout: float = _setting(
        "LLMSERVE_START_TIMEOUT", 600.0, _float, doc="start_server.sh: seconds to wait for ready"
    )
    stop_timeout: float = _setting(
        "LLMSERVE_STOP_TIMEOUT", 30.0, _float, doc="stop_server.sh: seconds to wait for exit before killing"
    )
    output_log_to_console: bool = _setting("OUTPUT_LOG_TO_CONSOLE", False, _bool, doc="logs to console instead of log/")
    log_dir: str = _setting("LOG_DIR", "log", _str, doc="log directory")
    api_key: str = _setting("API_KEY", "", _str, doc="require Authorization: Bearer <key> (empty: open)")
    edge_token: str = _setting(
        "LLMSERVE_EDGE_TOKEN",
        "",
        _str,
        doc="shared by the HTTP front end and the Triton adapter: requests the front end validated carry it and are "
        "not validated again (start_server.sh sets a random one; empty: the adapter validates every request)",
    )
    seed: int = _setting("LLMSERVE_SEED", 0, int, doc="engine seed for requests without their own")
    # runners and deployment
    paddle_threads: int = _setting(
        "LLMSERVE_PADDLE_THREADS", 0, int, doc="Paddle CPU math threads (0: the cores less one for the engine server)"
    )
    paddle_mkldnn: bool = _setting("LLMSERVE_PADDLE_MKLDNN", False, _bool, doc="oneDNN kernels for the Paddle runner")
    cuda_graphs: bool = _setting("LLMSERVE_CUDA_GRAPHS", True, _bool, doc="replay decode steps as CUDA graphs")
    triton_stub_pythonpath: str = _setting(
        "LLMSERVE_TRITON_STUB_PYTHONPATH", "", _str, doc="put first on the Triton stub's path (numpy<2 for its stub)"
    )
    tritonserver_bin: str = _setting("TRITONSERVER_BIN", "", _str, doc="a tritonserver binary (default: the wheel's)")
    triton_backend_dir: str = _setting(
        "TRITON_BACKEND_DIR", "", _str, doc="Triton backends directory (default: built from the wheel)"
    )
    # lab: kernel experiments (scripts/lab, docs/gpu.md), not a setting for users
    kernel_switches: str = _setting(
        "LLMSERVE_KERNEL_SWITCHES",
        "",
        _kernel_switches,
        doc="lab, for kernel experiments (not for serving): `key=0|1,...` turns kernel paths off against their "
        f"baselines ({', '.join(KERNEL_SWITCHES)}; each on but ref; kernels/switches.py)",
    )

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, **overrides: Any) -> Config:
        env = os.environ if env is None else env
        values: dict[str, Any] = {}
        errors: list[str] = []
        for f in dataclasses.fields(cls):
            names = (f.metadata["env"], *f.metadata["aliases"])
            name = next((n for n in names if n in env), None)
            if name is None:
                continue
            try:
                values[f.name] = f.metadata["parse"](env[name])
            except ValueError as e:
                errors.append(f"{name}={env[name]!r}: {e}")
        for name, key in RETIRED_SWITCHES.items():
            if name in env:
                errors.append(f"{name} is retired: set LLMSERVE_KERNEL_SWITCHES={key}=0 (or 1) instead")
        if errors:
            raise ConfigError("invalid settings: " + "; ".join(errors))
        values.update(overrides)
        cfg = cls(**values)
        cfg.validate()
        return cfg

    @classmethod
    def read(cls, name: str, env: Mapping[str, str] | None = None) -> Any:
        """One setting (field `name`) from the environment, its default when unset.

        For code that runs outside a started service, e.g. at import: a bad value of an *unrelated*
        setting must not get in its way (the service reports that one at start). A bad value of
        this setting raises ConfigError naming its variable, like from_env.
        """
        env = os.environ if env is None else env
        f = cls.__dataclass_fields__[name]
        var = next((n for n in (f.metadata["env"], *f.metadata["aliases"]) if n in env), None)
        if var is None:
            return f.default
        try:
            return f.metadata["parse"](env[var])
        except ValueError as e:
            raise ConfigError(f"invalid settings: {var}={env[var]!r}: {e}") from None

    def validate(self) -> None:
        errors = []
        if not 0 <= self.push_mode_http_workers <= 8:
            errors.append(f"PUSH_MODE_HTTP_WORKERS={self.push_mode_http_workers}: 0 (auto) to 8")
        if not 0 <= self.adapter_instances <= 8:
            errors.append(f"ADAPTER_INSTANCES={self.adapter_instances}: 0 (auto) to 8")
        if self.runner not in ("auto", "paddle", "torch"):
            errors.append(f"LLMSERVE_RUNNER={self.runner!r}: expected auto, paddle or torch")
        if self.device not in ("auto", "cpu", "cuda"):
            errors.append(f"LLMSERVE_DEVICE={self.device!r}: expected auto, cpu or cuda")
        if self.mp_num % self.mp_nnode:
            errors.append(f"MP_NUM={self.mp_num}: must be a multiple of MP_NNODE={self.mp_nnode} (ranks per node)")
        if self.mp_num > 1 and self.speculate_method in ("draft", "mtp"):
            errors.append(
                f"SPECULATE_METHOD={self.speculate_method} with MP_NUM={self.mp_num}: not sharded yet (ngram is)"
            )
        ips = self.node_ips
        if self.mp_nnode > 1:
            if len(ips) != self.mp_nnode:
                errors.append(f"POD_IPS={self.pod_ips!r}: MP_NNODE={self.mp_nnode} needs that many IPs")
            elif self.pod_0_ip and self.pod_0_ip != ips[0]:
                errors.append(f"POD_0_IP={self.pod_0_ip!r}: must be the first of POD_IPS ({ips[0]})")
        if self.node_rank is not None and self.node_rank >= self.mp_nnode:
            errors.append(f"NODE_RANK={self.node_rank}: must be below MP_NNODE={self.mp_nnode}")
        if not self.dist_heartbeat_timeout > 1.0:
            errors.append(
                f"DIST_HEARTBEAT_TIMEOUT={self.dist_heartbeat_timeout}: must be more than 1 s (ranks beat every 0.5 s)"
            )
        if not self.dist_timeout > 0:
            errors.append(f"DIST_TIMEOUT={self.dist_timeout}: must be a positive number of seconds")
        if self.check_health_interval <= 0:
            errors.append(f"CHECK_HEALTH_INTERVAL={self.check_health_interval}: must be positive")
        if self.prefill_catch_up < 0:
            errors.append(f"PREFILL_CATCH_UP={self.prefill_catch_up}: must be >= 0 (0: off)")
        if self.long_prefill_tokens < 0:
            errors.append(f"LONG_PREFILL_TOKENS={self.long_prefill_tokens}: must be >= 0 (0: the runner's default)")
        if not 1 <= self.speculate_max_draft_tokens <= 8:
            errors.append(f"SPECULATE_MAX_DRAFT_TOKEN_NUM={self.speculate_max_draft_tokens}: must be in 1..8")
        if not 1 <= self.speculate_max_ngram_size <= 8:
            errors.append(f"SPECULATE_MAX_NGRAM_SIZE={self.speculate_max_ngram_size}: must be in 1..8")
        if self.speculate_method == "draft":
            if not self.speculate_model_path:
                errors.append(
                    "SPECULATE_METHOD=draft needs SPECULATE_MODEL_PATH: the draft model's directory "
                    "(an HF safetensors checkpoint with the target's tokenizer)"
                )
        elif self.speculate_model_path and self.speculate_method != "mtp":
            errors.append(
                f"SPECULATE_MODEL_PATH={self.speculate_model_path!r}: SPECULATE_METHOD={self.speculate_method} "
                "uses no speculative model (unset it, or choose draft or mtp)"
            )
        if self.use_cache_kv_int8 and self.kv_cache_dtype == "fp8":
            errors.append("USE_CACHE_KV_INT8=1 and KV_CACHE_DTYPE=fp8: choose one KV cache format")
        if self.paddle_threads < 0:
            errors.append(f"LLMSERVE_PADDLE_THREADS={self.paddle_threads}: must be >= 0 (0: automatic)")
        try:
            parse_kernel_switches(self.kernel_switches)
        except ValueError as e:
            errors.append(f"LLMSERVE_KERNEL_SWITCHES={self.kernel_switches!r}: {e}")
        for name, v in (("LLMSERVE_START_TIMEOUT", self.start_timeout), ("LLMSERVE_STOP_TIMEOUT", self.stop_timeout)):
            if not v > 0:
                errors.append(f"{name}={v}: must be a positive number of seconds")
        if self.drain_timeout < 0:
            errors.append(f"LLMSERVE_DRAIN_TIMEOUT={self.drain_timeout}: must be >= 0")
        if errors:
            raise ConfigError("invalid settings: " + "; ".join(errors))

    @property
    def kv_cache_quant(self) -> str:
        """The KV cache's quantized format: "" (the model's dtype), "int8" or "fp8"."""
        return "int8" if self.use_cache_kv_int8 else ("" if self.kv_cache_dtype == "auto" else self.kv_cache_dtype)

    def to_env(self, *names: str) -> dict[str, str]:
        """Every setting (or the fields `names`) as its environment variable: how a child process gets this
        exact config."""
        env = {}
        for f in dataclasses.fields(self):
            if names and f.name not in names:
                continue
            v = getattr(self, f.name)
            env[f.metadata["env"]] = "" if v is None else str(int(v)) if isinstance(v, bool) else str(v)
        return env

    @property
    def node_ips(self) -> list[str]:
        return [ip.strip() for ip in self.pod_ips.split(",") if ip.strip()]

    @property
    def cache_path(self) -> Path:
        """LLMSERVE_CACHE_DIR, or ~/.cache/llmserve when unset."""
        return Path(self.cache_dir).expanduser() if self.cache_dir else Path.home() / ".cache" / "llmserve"

    @property
    def local_host(self) -> str:
        """How this machine reaches our own servers, for URLs and host:port strings: a wildcard bind on
        loopback, an IPv6 address in brackets."""
        if self.host in ("0.0.0.0", "::", ""):
            return "127.0.0.1"
        return f"[{self.host}]" if ":" in self.host else self.host

    @property
    def http_workers(self) -> int:
        """PUSH_MODE_HTTP_WORKERS, or one front-end process per 4 CPUs this process may run on (1 to 4)."""
        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        return self.push_mode_http_workers or min(4, max(1, cpus // 4))

    @property
    def triton_instances(self) -> int:
        """ADAPTER_INSTANCES, or one stub per 64 streams of BATCH_SIZE (at most 8)."""
        return self.adapter_instances or min(8, -(-self.batch_size // 64))

    @property
    def max_step_tokens(self) -> int:
        """Tokens of the largest step: the prompt budget and what catch-up saved of earlier steps'
        (PREFILL_CATCH_UP budgets at most), plus one token per running request (decoding requests'
        tokens are not counted against MAX_PREFILL_TOKENS)."""
        return (1 + self.prefill_catch_up) * self.max_num_batched_tokens + self.batch_size

    @property
    def max_blocks_per_seq(self) -> int:
        return -(-self.max_seq_len // self.block_size)

    @property
    def num_kv_blocks_from_block_bs(self) -> int | None:
        """KV blocks fixed by BLOCK_BS, or None to size them from free memory."""
        return None if self.block_bs is None else self.block_bs * self.max_blocks_per_seq

    @classmethod
    def settings_table(cls) -> list[tuple[str, tuple[str, ...], Any, str]]:
        """(variable, aliases, default, meaning) for docs and `llmserve config`."""
        return [
            (f.metadata["env"], f.metadata["aliases"], f.default, f.metadata["doc"]) for f in dataclasses.fields(cls)
        ]
