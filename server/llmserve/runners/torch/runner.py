"""TorchRunner: HF Llama/Qwen2 safetensors on CUDA (bf16) or CPU (fp32).

Owns the weights, the paged KV cache (`[layers, 2, blocks, KVH, block_size, D]`),
the device sampler, the decode CUDA graphs and SPECULATE_METHOD's head proposer, if
it has one (head_proposer.py: called at fixed points of the step). One `execute` = one packed
mixed batch: inputs uploaded in one copy, one forward, logits of the sampled
rows only, sampling on the device, one device-to-host copy of the tokens.
A step with prompt-logprob chunks (base.py) also takes logits of their prompt
positions, a slice of rows at a time, and always runs eagerly.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from llmserve.config import Config
from llmserve.engine.runner_contract import ModelRunner, SeqChunk, StepBatch, StepResult, split_prompt_logprobs
from llmserve.kernels import switches
from llmserve.kernels.attention import AttnMeta, tile_tokens
from llmserve.layers.kv_cache import kv_spec_for
from llmserve.layers.model_config import ModelConfig
from llmserve.layers.parallel import SINGLE, TensorParallel, check_shardable
from llmserve.layers.quant.methods import method_for
from llmserve.layers.sampler import DeviceSampler
from llmserve.models.registry import build_model
from llmserve.runners.torch import inputs as step_inputs
from llmserve.runners.torch.cuda_graphs import DecodeGraphs, VerifyPack, decode_splits
from llmserve.runners.torch.head_proposer import HeadProposer, build_head, target_step
from llmserve.runners.torch.inputs import StepInputs, Uploader, host_arrays, work_items

log = logging.getLogger(__name__)

# Prompt positions whose logits are taken at once: bounds the [rows, vocab] temporaries (float logits,
# log_softmax) well inside the sampler scratch the KV-cache sizing leaves room for.
PLP_ROWS = 64


@dataclass
class _Launched:
    """A launched step: its tokens (device, and the pinned host copy in flight) and timing."""

    host: torch.Tensor
    tokens: torch.Tensor
    logprobs: object  # tokens -> logprobs, or None
    start: object  # CUDA event (or perf_counter time on CPU) of the step's start
    end: torch.cuda.Event | None
    # Steps with prompt-logprob chunks: those chunks and (target logprob, top ids, top logprobs), host copies.
    plp: tuple[list[SeqChunk], tuple[torch.Tensor, torch.Tensor, torch.Tensor]] | None = None
    # Verification steps: each sampled chunk's rows, and its number of new tokens (host copy).
    rows: list[int] | None = None
    num_new: torch.Tensor | None = None


def pick_device(config: Config) -> torch.device:
    if config.device == "cuda" or (config.device == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise RuntimeError("LLMSERVE_DEVICE=cuda but torch sees no CUDA device")
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class TorchRunner(ModelRunner):
    # Launches are asynchronous on CUDA; on CPU the same code runs synchronously (and is what the
    # tests check overlapped scheduling with).
    overlap = True

    def __init__(self, model_dir: str, config: Config, tp: TensorParallel = SINGLE) -> None:
        """`tp`: this rank of a tensor-parallel group (parallel.py): every rank builds the same runner
        over its shard and runs every step; rank 0's result is the one used (executor/)."""
        self.config = config
        self.tp = tp
        kernels = switches.apply(config)  # LLMSERVE_KERNEL_SWITCHES: the process's, read where the kernels run
        if kernels.pdl and tp.size > 1:  # PDL (kernels/pdl.py): with several ranks not measured
            kernels.pdl = False
            log.info("decode kernels launched without PDL (MP_NUM > 1)")
        cfg_path = config.model_config_path or str(Path(model_dir) / "config.json")
        mc = ModelConfig.from_file(cfg_path)
        check_shardable(mc, tp.size)
        self.device = pick_device(config)
        cuda = self.device.type == "cuda"
        self.asynchronous = cuda
        self.dtype = torch.bfloat16 if cuda else torch.float32
        self.block_size = config.block_size
        self.max_model_len = min(config.max_seq_len, mc.max_position_embeddings)
        self.max_blocks_per_seq = -(-self.max_model_len // self.block_size)
        self.eos_token_ids = frozenset(mc.eos_token_ids)
        self.vocab_size = mc.vocab_size
        t0 = time.perf_counter()
        method = method_for(model_dir, config, self.device, self.dtype)
        # The architecture's class (models/registry.py: Llama / Qwen2, DeepSeek-V2/V3), which checks `config` first
        self.model = build_model(mc, model_dir, config, self.device, self.dtype, self.max_model_len + 1, method, tp)
        # Shapes below are this rank's (its heads, KV heads); vocabulary and layers are the model's.
        self.model_config = mc = self.model.local
        log.info(
            "loaded %.2f GB of weights (%s) in %.1f s",
            self.model.weight_bytes / 1e9,
            method.name,
            time.perf_counter() - t0,
        )
        self.uploader = Uploader(self.device)
        # A head proposer (mtp): built before the KV cache, which holds its layers, and the graphs.
        self.head: HeadProposer | None = build_head(self, model_dir, config)
        self._last_tokens = torch.zeros(0, dtype=torch.long, device=self.device)
        self._last_rows: dict[str, int] = {}
        # Prompt tokens of one request per step: a CPU step over 2048 tokens deep in a long prompt
        # takes seconds; on CUDA the whole step budget.
        self.default_long_prefill_tokens = 0 if self.device.type == "cuda" else 256
        # H100/H200: ~990 TFLOP/s of dense bf16 over 3.35-4.8 TB/s, 2 bytes and 2 FLOPs per weight.
        self.saturation_tokens = 256 if cuda else 16
        self.sampler = DeviceSampler(self.vocab_size, self.device, config.seed)
        self.num_sms = torch.cuda.get_device_properties(self.device).multi_processor_count if cuda else 1
        self.max_batch = config.batch_size
        # Logits rows a step may sample on the GPU (the KV sizing leaves scratch for them): a full decode
        # batch, and with speculation at least 512 (verification samples k + 1 rows a request).
        spec = config.speculate_method != "none"
        self.max_sampled_rows = max(min(self.max_batch, 512), 512 if spec else 0) if cuda else 0
        # The KV cache of a bf16 model is fp16 (the same bytes with 3 more bits of mantissa, so that
        # attention's tensor-core products need no conversion: kernels/attention.py), or int8 / FP8
        # with a scale per token and head (USE_CACHE_KV_INT8, KV_CACHE_DTYPE): kv_cache.py.
        self.kv_spec = kv_spec_for(
            config.kv_cache_quant, self.dtype, self._kv_layers, mc.num_key_value_heads, self.block_size, mc.head_dim,
            mc.kv_latent_dim,  # MLA: one latent row a token (kv_cache.py)
        )  # fmt: skip
        self.kv_dtype = self.kv_spec.dtype
        self.num_kv_blocks = self._size_kv_cache()
        self.kv_cache = self.kv_spec.allocate(self.num_kv_blocks, self.device)
        self.graphs: DecodeGraphs | None = None
        drafts = config.speculate_max_draft_tokens if config.speculate_method != "none" else 0
        # the ref switch's torch ops, or a family's torch paths (graph_blocker), wait on the host
        why = "the ref kernel switch's ops" if kernels.ref else self.model.graph_blocker(self.kv_cache, drafts + 1)
        if cuda and config.cuda_graphs and why:
            log.info("decode steps run eagerly: %s cannot be captured as CUDA graphs", why)
        elif cuda and config.cuda_graphs:
            self.graphs = DecodeGraphs(
                self.model, self.kv_cache, min(self.max_batch, 512), self.max_blocks_per_seq, self.num_sms, drafts,
                self.head,
            )  # fmt: skip
            self.graphs.capture()

    # ---- KV cache sizing ------------------------------------------------------
    @property
    def _kv_layers(self) -> int:
        return self.model_config.num_hidden_layers + (self.head.kv_layers if self.head is not None else 0)

    def _block_bytes(self) -> int:
        return self.kv_spec.block_bytes

    def _size_kv_cache(self) -> int:
        """Blocks of the KV cache: every rank sizes its own, and all take the smallest (one block
        table serves every rank)."""
        return self.tp.all_min(self._kv_blocks_that_fit())

    def _kv_blocks_that_fit(self) -> int:
        fixed = self.config.num_kv_blocks_from_block_bs
        if fixed is not None:
            return fixed
        if self.device.type != "cuda":
            want = self.max_batch * self.max_blocks_per_seq
            return max(self.max_blocks_per_seq, min(want, (2 << 30) // self._block_bytes()))
        # Profile the largest step (a full prefill chunk plus logits and sampling buffers
        # for a full batch), then give the KV cache its share of what is left.
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        base = torch.cuda.memory_allocated(self.device)
        self._warmup_prefill(self.config.max_step_tokens)
        scratch = torch.empty(
            self.max_sampled_rows * self.vocab_size * 4 * 6, dtype=torch.uint8, device=self.device
        )  # sampler/graphs
        del scratch
        peak = torch.cuda.max_memory_allocated(self.device) - base
        torch.cuda.empty_cache()
        free, _ = torch.cuda.mem_get_info(self.device)
        budget = self.config.kv_cache_memory_fraction * (free - peak)
        n = int(budget // self._block_bytes())
        if n < self.max_blocks_per_seq:
            raise RuntimeError(
                f"only {n} KV blocks fit in GPU memory; one sequence of MAX_SEQ_LEN needs "
                f"{self.max_blocks_per_seq} (lower MAX_SEQ_LEN or use a smaller model)"
            )
        log.info("KV cache: %d blocks (%.1f GB); step peak %.2f GB", n, n * self._block_bytes() / 1e9, peak / 1e9)
        return n

    @torch.inference_mode()
    def _warmup_prefill(self, num_tokens: int) -> None:
        kv = self.kv_spec.allocate(-(-num_tokens // self.block_size), self.device)
        mc, dev = self.model_config, self.device
        ids, slots, meta = step_inputs.prefill_inputs(num_tokens, mc, self.block_size, self.vocab_size, dev)
        # Rotary positions stay inside the model's table when the step budget exceeds MAX_SEQ_LEN.
        hidden = self.model.forward(ids, slots % self.max_model_len, slots, meta, kv)
        self.model.logits(hidden[-1:])
        del kv, hidden

    # ---- one step ---------------------------------------------------------------
    def prepare(self, batch: StepBatch, arrays: dict) -> StepInputs:
        a = arrays
        B = len(batch.chunks)
        q_lens = a["q_lens"]
        decode_only = a["ids"].shape[0] == B
        mc = self.model_config
        H, KVH = mc.num_attention_heads, mc.num_key_value_heads
        block_t = tile_tokens(H, KVH, decode_only)
        dec_bt = tile_tokens(H, KVH, True)
        if decode_only:
            item_seq, item_q = work_items(q_lens, block_t)
            dec_seq = dec_q = np.zeros(0, dtype=np.int64)
        else:  # prefill chunks in large tiles, single tokens in small ones
            single = q_lens == 1
            item_seq, item_q = work_items(np.where(single, 0, q_lens), block_t)
            dec_seq = np.flatnonzero(single)
            dec_q = np.zeros_like(dec_seq)
        splits = decode_splits(B, KVH, self.num_sms) if decode_only else 1
        plp = [a["plp_tok"], a["plp_target"]] if "plp_tok" in a else []
        v = self.uploader.upload(
            [a["ids"], a["positions"], a["slots"], a["cu_q"], a["seq_lens"], a["bt"], item_seq, item_q,
             a["sample_tok"], dec_seq, dec_q, *plp]
        )  # fmt: skip
        meta = AttnMeta(v[3], v[4], v[5], v[6], v[7], block_t, splits, v[9], v[10], dec_bt)
        x = StepInputs(v[0], v[1], v[2], meta, v[8])
        if plp:
            x.plp_idx, x.plp_target = v[11], v[12]
        return x

    def _mark_start(self) -> None:
        """Start of the step's device work (host preparation excluded), for model_time."""
        if self.device.type == "cuda":
            self._t_start = torch.cuda.Event(enable_timing=True)
            self._t_start.record()
        else:
            self._t_start = time.perf_counter()

    def _fill_pending(self, batch: StepBatch, ids: torch.Tensor, a: dict) -> None:
        """Write into `ids` (device) the tokens the last step drew for this step's PENDING inputs."""
        step_inputs.fill_pending(ids, a, batch.chunks, self._last_tokens, self._last_rows)

    @torch.inference_mode()
    def forward_logits(self, batch: StepBatch, ids: torch.Tensor | None = None) -> torch.Tensor:
        """Logits [sampled rows, V] (float32) of a step; writes its K/V. `ids`: the step's input tokens
        on the device (a draft model's own proposals, never read back), else the chunks' token_ids."""
        return self._forward(batch, ids)[0]

    def _forward(
        self, batch: StepBatch, ids: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, StepInputs | None, np.ndarray | None, dict | None]:
        """Sampled rows' logits, the step's final hidden states, its device inputs (None when a graph
        ran it: `graphs.inputs()` gives them), where each packed token's row is in the hidden
        states (None: in order; a replayed graph's are in its padded layout), and its host arrays
        (None for a verification step replayed as a graph: packed without them, cuda_graphs.VerifyPack)."""
        B = len(batch.chunks)
        g = self.graphs
        if g is not None and (q := g.verify_q(batch.chunks)):  # every chunk its last token and drafts
            self._mark_start()
            pack = VerifyPack(batch.chunks, self.block_size, q)
            logits = g.replay(pack, q=q)
            # Pinned: a pageable copy would wait for the graph, and the host work after it with it.
            layout = pack.rows
            (rows,) = self.uploader.upload([layout])
            return logits[rows.long()], g.last_hidden, None, layout, None
        a = host_arrays(batch.chunks, self.block_size)
        self._mark_start()
        # The graphs return the logits of sampled rows only, not of prompt-logprob positions.
        if g is not None and "plp_tok" not in a and a["bt"].shape[1] <= g.max_blocks:
            if a["ids"].shape[0] == B and g.bucket(B) is not None:  # decode only
                fill = (
                    (lambda dst: dst.copy_(ids)) if ids is not None else (lambda dst: self._fill_pending(batch, dst, a))
                )
                logits = g.replay(a, fill)
                layout = np.arange(B)
                if a["sampled"].shape[0] == B:
                    return logits[:B], g.last_hidden, None, layout, a
                (sampled,) = self.uploader.upload([a["sampled"]])  # pinned: a pageable copy would wait
                return logits[sampled.long()], g.last_hidden, None, layout, a
        x = self.prepare(batch, a)
        self._fill_pending(batch, x.input_ids, a)
        if ids is not None:
            x.input_ids.copy_(ids)
        hidden = self.model.forward(x.input_ids, x.positions, x.slot_mapping, x.meta, self.kv_cache)
        return self.model.logits(hidden[x.sample_idx.long()]), hidden, x, None, a

    def _prompt_logprobs(
        self, hidden: torch.Tensor, x: StepInputs, k: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(logprob of each target, top-k ids, top-k logprobs) at the prompt positions, on the device.

        Raw model distribution: log_softmax of the logits, no bias, penalty or temperature. (Sampled tokens'
        logprobs, sampler.py, are also taken before temperature, but after the logit bias, penalties and
        the min_tokens mask, which belong to sampling the output and mean nothing at a prompt position.)"""
        idx, target = x.plp_idx.long(), x.plp_target.long()
        chosen, top_v, top_i = [], [], []
        for s in range(0, idx.shape[0], PLP_ROWS):
            ls = torch.log_softmax(self.model.logits(hidden[idx[s : s + PLP_ROWS]]), dim=-1)
            chosen.append(ls.gather(1, target[s : s + PLP_ROWS, None])[:, 0])
            v, i = ls.topk(k, dim=-1)
            top_v.append(v)
            top_i.append(i)
        return torch.cat(chosen), torch.cat(top_i), torch.cat(top_v)

    @torch.inference_mode()
    def submit(self, batch: StepBatch) -> _Launched:
        """Launch a step (forward + sampling, no host sync); its tokens stay on the device for the
        next step's PENDING inputs and are copied back asynchronously for `result`."""
        if batch.finished_req_ids:
            self.sampler.drop(batch.finished_req_ids)
            if self.head is not None:
                self.head.drop(batch.finished_req_ids)
        self._t_start = None
        logits, hidden, x, layout, a = self._forward(batch)
        plp = None
        if a is not None and "plp_tok" in a:
            asking = [c for c in batch.chunks if c.prompt_logprobs]
            k = max(1, max(c.request.params.prompt_logprobs or 0 for c in asking))
            plp = (asking, self._prompt_logprobs(hidden, x, min(k, self.vocab_size)))
        sampled = [c for c in batch.chunks if c.sample]
        reqs = [c.request for c in sampled]
        if any(c.token_bitmask is not None for c in sampled):  # structured output
            step_inputs.apply_bitmasks(logits, sampled, self.vocab_size, self.uploader)
        num_new = rows = num_new_dev = None
        if any(c.draft_token_ids for c in sampled):  # verification (serial steps: no PENDING follows)
            out_index = [c.start + c.num_tokens - len(c.draft_token_ids) - c.request.num_prompt_tokens for c in sampled]
            tokens, num_new_dev, lps = self.sampler.verify(logits, sampled, out_index)
            rows, num_new = [c.num_sampled_rows for c in sampled], self._to_host(num_new_dev)
        elif reqs:
            out_index = [c.start + c.num_tokens - c.request.num_prompt_tokens for c in sampled]
            tokens, lps = self.sampler.sample(logits, reqs, out_index)
        else:
            tokens, lps = logits.new_zeros(0, dtype=torch.long), None
        self._last_tokens, self._last_rows = tokens, {r.req_id: i for i, r in enumerate(reqs)}
        if self.head is not None and not batch.proposer_state:  # no proposals next step: skip the head
            self.head.drop([r.req_id for r in reqs])  # what it kept for them is now stale
        elif self.head is not None:
            step = target_step(batch.chunks, hidden, x, layout, a, tokens, num_new_dev, self.graphs, self.block_size)
            self.head.after_step(step)
        host = self._to_host(tokens)
        if plp is not None:  # copied with the tokens: result() must not wait on the next step's work
            plp = (plp[0], tuple(self._to_host(t) for t in plp[1]))
        end = None
        if self.device.type == "cuda":
            end = torch.cuda.Event(enable_timing=True)
            end.record()
        return _Launched(host, tokens, lps, self._t_start, end, plp, rows, num_new)

    def _to_host(self, t: torch.Tensor) -> torch.Tensor:
        """An asynchronous copy into pinned memory (on CUDA), readable once the step's end event is."""
        cuda = self.device.type == "cuda"
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=cuda)
        host.copy_(t, non_blocking=cuda)
        return host

    def result(self, handle: _Launched) -> StepResult:
        h = handle
        if h.end is not None:
            h.end.synchronize()  # the step's one wait for the device
            model_time = h.start.elapsed_time(h.end) / 1e3
        else:
            model_time = time.perf_counter() - h.start
        row_lps = h.logprobs(h.tokens) if h.logprobs is not None else None
        plp = None
        if h.plp is not None:
            chunks, (chosen, top_i, top_v) = h.plp
            plp = split_prompt_logprobs(chunks, chosen.tolist(), top_i.tolist(), top_v.tolist())
        flat = h.host.tolist()
        if h.rows is None:  # one token per sampled chunk
            tokens = [[t] for t in flat]
            lps = [None if lp is None else [lp] for lp in row_lps] if row_lps is not None else None
        else:  # each chunk's rows, up to its first rejected draft
            tokens, lps, r = [], [] if row_lps is not None else None, 0
            for n_rows, n_new in zip(h.rows, h.num_new.tolist()):
                tokens.append(flat[r : r + n_new])
                if lps is not None:
                    got = row_lps[r : r + n_new]
                    lps.append(None if got[0] is None else got)
                r += n_rows
        return StepResult(tokens, lps, model_time=model_time, prompt_logprobs=plp)

    def done(self, handle: _Launched) -> bool:
        return handle.end is None or handle.end.query()

    def execute(self, batch: StepBatch) -> StepResult:
        return self.result(self.submit(batch))

    def build_proposer(self, config: Config):
        if self.head is not None:  # built with the runner (its KV layers, its graphs)
            return self.head
        if config.speculate_method == "draft":
            from llmserve.runners.torch.draft import DraftModelProposer

            return DraftModelProposer(config, self)
        return super().build_proposer(config)

    def shutdown(self) -> None:
        self.graphs = None
        self.kv_cache = None
        self.model = None
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
