"""ModelRunner over a Paddle static graph (`paddle.inference`), CPU here, GPU with paddlepaddle-gpu.

The graph (docs/model_format.md) takes one packed step and writes its K/V into per-layer
caches in place. The caches are Paddle tensors owned here and bound to the predictor once
(`share_external_data`); each step only copies the small index arrays in.

With MP_NUM > 1 each rank of llmserve.executor's group runs one of these over its graph `rank_<r>`
(ranks.py joins the graph's communicator first); every rank ends a step with the whole logits.
"""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import paddle
import paddle.inference as paddle_infer
from paddle.base import core

from llmserve.config import Config
from llmserve.engine.runner_contract import (
    ModelRunner,
    SeqChunk,
    StepBatch,
    StepResult,
    TokenLogprobs,
    split_prompt_logprobs,
)
from llmserve.layers.model_config import ModelConfig
from llmserve.models.layout import ModelFormatError, detect_model_format, paddle_program_path
from llmserve.runners.paddle.graph import INPUT_SPECS, cache_names
from llmserve.runners.paddle.inputs import build_step_inputs
from llmserve.runners.paddle.opcheck import check_kernels

if TYPE_CHECKING:
    from llmserve.runners.paddle.ranks import PaddleRank

GIB = 1 << 30
TORCH_HINT = "Serve the Hugging Face checkpoint with the torch runner (LLMSERVE_RUNNER=torch)"


def rank_dirs(model_dir: Path) -> list[str]:
    """The export's rank_<k> directories, in rank order (one static graph per tensor-parallel rank)."""
    ranks = [d for d in model_dir.glob("rank_*") if d.is_dir() and re.fullmatch(r"rank_\d+", d.name)]
    return [d.name for d in sorted(ranks, key=lambda d: int(d.name[5:]))]


def _span(n: int) -> str:
    return "rank_0" if n == 1 else f"rank_0 ... rank_{n - 1}"


def paddle_device(config: Config) -> str:
    return "gpu" if paddle.is_compiled_with_cuda() and config.device != "cpu" else "cpu"


def check_ranks(model_dir: Path, config: Config) -> None:
    """MP_NUM against the export's rank dirs and this Paddle build: one message, before anything loads."""
    mp, ranks = config.mp_num, rank_dirs(model_dir)
    if mp == len(ranks) == 1:
        return
    problems = []
    if len(ranks) != mp:
        problems.append(f"MP_NUM={mp} but {model_dir} holds {len(ranks)} rank graph(s) ({', '.join(ranks) or 'none'})")
    if mp == 1:
        problems.append(
            f"the Paddle runner serves one-rank exports: re-export with `llmserve export --mp 1`. {TORCH_HINT}"
        )
    # On GPU, paddle.inference would create the graphs' communicator itself (NCCL, rank_mapping.csv):
    # not written, as nothing here could test it. On CPU the ranks join a gloo group (ranks.py).
    elif paddle_device(config) == "gpu":
        problems.append(
            f"MP_NUM={mp}: serving per-rank static graphs ({_span(mp)}) on GPU (NCCL) is not implemented in the "
            f"Paddle runner. LLMSERVE_DEVICE=cpu runs the ranks on CPU over gloo; or: {TORCH_HINT}"
        )
    elif not hasattr(core, "ProcessGroupGloo"):
        problems.append(
            f"MP_NUM={mp}: this Paddle ({paddle.__version__}) was built without gloo, which the ranks of "
            f"{_span(mp)} need on CPU. {TORCH_HINT}"
        )
    if problems:
        raise ValueError("; ".join(problems))


def check_config(model_dir: Path, config: Config) -> None:
    """Every setting the Paddle runner cannot serve this export with, in one message (at start: with
    MP_NUM > 1, before any rank starts)."""
    if detect_model_format(model_dir) != "paddle":
        raise ModelFormatError(
            f"{model_dir} is a Hugging Face checkpoint; the paddle runner needs a static-graph export "
            "(rank_0/model.json + model.pdiparams): export it with llmserve.runners.paddle.export.export_hf "
            "or use the torch runner"
        )
    check_ranks(model_dir, config)
    unsupported = ["USE_CACHE_KV_INT8=1"] if config.use_cache_kv_int8 else []
    unsupported += [f"KV_CACHE_DTYPE={config.kv_cache_dtype}"] if config.kv_cache_dtype != "auto" else []
    # A Paddle export runs its graph's own ops: quantizing it means exporting a quantized graph.
    unsupported += [f"QUANT_TYPE={config.quant_type}"] if config.quant_type else []
    if unsupported:
        raise ValueError(f"the paddle runner does not support {', '.join(unsupported)}; use the torch runner")


def mem_available() -> int:
    """Bytes the kernel reports as available (MemAvailable in /proc/meminfo)."""
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("MemAvailable not found in /proc/meminfo")


def _eos_ids(model_dir: Path, mc: ModelConfig) -> frozenset[int]:
    ids = set(mc.eos_token_ids)
    gen = model_dir / "generation_config.json"
    if gen.is_file():  # chat models often list extra end tokens there (e.g. <|im_end|>)
        eos = json.loads(gen.read_text()).get("eos_token_id")
        ids.update(eos if isinstance(eos, list) else [] if eos is None else [eos])
    return frozenset(ids)


def _kv_heads(rank_dir: Path, mc: ModelConfig) -> int:
    """KV heads of this rank's caches: its range in tp.json (sharded exports), else the model's."""
    tp = rank_dir / "tp.json"
    if not tp.is_file():
        return mc.num_key_value_heads
    k0, k1 = json.loads(tp.read_text())["key_value_heads"]
    return k1 - k0


def prompt_logprobs(chunks: list[SeqChunk], logits: np.ndarray) -> list[list[TokenLogprobs]]:
    """StepResult.prompt_logprobs from the logits rows of the asking chunks' prompt positions.

    Raw model distribution: log_softmax of the logits, no bias, penalty or temperature. (Sampled tokens'
    logprobs, engine/sampler.py, are also taken before temperature, but after the logit bias, penalties
    and the min_tokens mask, which belong to sampling the output and mean nothing at a prompt position.)"""
    targets = np.fromiter((t for c in chunks for t in c.prompt_logprob_targets()), np.int64)
    k = min(logits.shape[1], max(c.request.params.prompt_logprobs or 0 for c in chunks if c.prompt_logprobs))
    if not len(targets):
        return split_prompt_logprobs(chunks, [], [], [])
    x = logits.astype(np.float32, copy=False)
    x = x - x.max(axis=1, keepdims=True)
    ls = x - np.log(np.exp(x).sum(axis=1, keepdims=True))
    rows = np.arange(len(targets))
    chosen = ls[rows, targets]
    top = np.zeros((len(targets), 0), np.int64)
    if k:  # the k best without sorting the vocabulary; ties: the lower id first
        best = np.argpartition(-ls, k - 1, axis=1)[:, :k]
        vals = ls[rows[:, None], best]
        top = np.take_along_axis(best, np.lexsort((best, -vals), axis=1), axis=1)
    top_vals = ls[rows[:, None], top]
    return split_prompt_logprobs(chunks, chosen.tolist(), top.tolist(), top_vals.tolist())


class PaddleRunner(ModelRunner):
    default_long_prefill_tokens = 256  # CPU: a 2048-token chunk deep in an 8k prompt takes 14 s on 2 cores

    def __init__(self, model_dir: str, config: Config, sampler, rank: PaddleRank | None = None):
        self.model_dir = Path(model_dir)
        check_config(self.model_dir, config)
        if config.mp_num > 1 and rank is None:
            raise ValueError(
                f"MP_NUM={config.mp_num}: the Paddle runner's ranks start through llmserve.executor's executor"
            )
        self.rank = rank
        self.config = config
        self.sampler = sampler
        self.model_config = mc = ModelConfig.from_file(config.model_config_path or self.model_dir / "config.json")
        self.device = paddle_device(config)
        r = rank.rank if rank else 0
        program = paddle_program_path(self.model_dir, r)
        check_kernels(program, self.device)  # before the predictor: name every op we cannot run
        self.predictor = self._create_predictor(program, self.model_dir / f"rank_{r}" / "model.pdiparams")
        self._check_inputs(mc)

        self.block_size = config.block_size
        self.max_model_len = min(config.max_seq_len, mc.max_position_embeddings)
        self.vocab_size = mc.vocab_size
        self.eos_token_ids = _eos_ids(self.model_dir, mc)
        kv_dim = _kv_heads(self.model_dir / f"rank_{r}", mc) * mc.head_dim
        block_bytes = 2 * mc.num_hidden_layers * config.block_size * kv_dim * 4  # K and V, all layers, float32
        self.num_kv_blocks = self._num_kv_blocks(config, mc, block_bytes)
        self.kv_caches: list[paddle.Tensor] = []
        for name in cache_names(mc.num_hidden_layers):
            cache = paddle.zeros([self.num_kv_blocks * self.block_size, kv_dim], "float32")
            if self.device == "cpu" and not cache.place.is_cpu_place():  # GPU build told to run on CPU
                cache = cache.cpu()
            self.predictor.get_input_handle(name).share_external_data(cache)  # bound once, written in place
            self.kv_caches.append(cache)
        self._inputs = {name: self.predictor.get_input_handle(name) for name, _, _ in INPUT_SPECS}
        self._logits = self.predictor.get_output_handle(self.predictor.get_output_names()[0])

    def _create_predictor(self, program: Path, params: Path):
        cfg = paddle_infer.Config(str(program), str(params))
        if self.device == "gpu":
            cfg.enable_use_gpu(256, 0)
        else:
            cfg.disable_gpu()
            # oneDNN picks kernels by shape and can change results run to run; opt in for speed.
            if self.config.paddle_mkldnn:
                cfg.enable_mkldnn()
                # Paddle 3.3's pass folds our dynamic-shape reshapes into the wrong output type.
                cfg.delete_pass("operator_reshape_onednn_fuse_pass")
            else:
                cfg.disable_mkldnn()
            # 0: every core (the engine server sets LLMSERVE_PADDLE_THREADS to leave itself one); a rank
            # of several on a node: its share of the cores.
            threads = self.rank.threads if self.rank else self.config.paddle_threads or len(os.sched_getaffinity(0))
            cfg.set_cpu_math_library_num_threads(threads)
        cfg.switch_ir_optim(True)
        cfg.disable_glog_info()
        return paddle_infer.create_predictor(cfg)

    def _check_inputs(self, mc: ModelConfig) -> None:
        expected = [name for name, _, _ in INPUT_SPECS] + cache_names(mc.num_hidden_layers)
        found = self.predictor.get_input_names()
        if sorted(expected) != sorted(found):
            raise ModelFormatError(
                f"{self.model_dir}: the graph's inputs do not follow our contract (docs/model_format.md); "
                f"expected {expected}, found {found}. Re-export the model with llmserve.runners.paddle.export."
            )

    def _num_kv_blocks(self, config: Config, mc: ModelConfig, bytes_per_block: int) -> int:
        fixed = config.num_kv_blocks_from_block_bs
        if fixed is not None:
            return fixed
        # Activations of the largest step: attention scores (tokens x heads x context, a few
        # copies), MLP and hidden states. The predictor (weights) is already loaded.
        tokens, ctx = config.max_step_tokens, self.max_model_len
        act = 4 * tokens * (3 * mc.num_attention_heads * ctx + 3 * mc.intermediate_size + 8 * mc.hidden_size)
        share = self.rank.per_node if self.rank else 1  # the ranks of a node share its memory
        budget = config.kv_cache_memory_fraction * mem_available() / share - act - GIB // 4
        blocks = min(int(budget // bytes_per_block), config.batch_size * config.max_blocks_per_seq)
        if self.rank:  # one block table serves every rank
            blocks = self.rank.all_min(blocks)
        if blocks < config.max_blocks_per_seq:
            raise MemoryError(
                f"KV cache: memory for {max(blocks, 0)} blocks of {config.block_size} tokens, fewer than one "
                f"MAX_SEQ_LEN={config.max_seq_len} sequence needs ({config.max_blocks_per_seq}); "
                "lower MAX_SEQ_LEN / MAX_PREFILL_TOKENS or set BLOCK_BS"
            )
        return blocks

    def forward(self, chunks: list[SeqChunk]) -> tuple[np.ndarray, float]:
        """Run one step; logits [N, V] of the sampled positions of the chunks with sample=True (in
        order: the last 1 + k of a chunk with k drafts, SeqChunk.num_sampled_rows), then of the prompt
        positions of chunks with prompt_logprobs (SeqChunk.num_prompt_logprobs each), and model seconds."""
        inputs = build_step_inputs(chunks, self.block_size)
        if inputs["block_tables"].max() >= self.num_kv_blocks:  # the graph would write out of the cache
            raise ValueError(f"block id {inputs['block_tables'].max()} >= num_kv_blocks {self.num_kv_blocks}")
        for name, handle in self._inputs.items():
            handle.copy_from_cpu(inputs[name])
        t0 = time.perf_counter()
        self.predictor.run()
        logits = self._logits.copy_to_cpu()
        return logits[: int(inputs["num_logits"])], time.perf_counter() - t0

    def execute(self, batch: StepBatch) -> StepResult:
        if batch.finished_req_ids:
            self.sampler.drop(batch.finished_req_ids)
        logits, model_time = self.forward(batch.chunks)
        sampled = [c for c in batch.chunks if c.sample]
        rows = sum(c.num_sampled_rows for c in sampled)
        t0 = time.perf_counter()
        plp = None
        if any(c.prompt_logprobs for c in batch.chunks):
            plp = prompt_logprobs(batch.chunks, logits[rows:])
            logits = logits[:rows]
        token_ids, logprobs = self.sampler.sample_chunks(logits, sampled) if sampled else ([], None)
        return StepResult(
            token_ids=token_ids,
            logprobs=logprobs,
            model_time=model_time,
            sample_time=time.perf_counter() - t0,
            prompt_logprobs=plp,
        )

    def shutdown(self) -> None:
        self.kv_caches = []
        self._inputs = {}
        self.predictor = None
        self.rank = None  # its group: Paddle keeps the communicator itself (ranks.py)
