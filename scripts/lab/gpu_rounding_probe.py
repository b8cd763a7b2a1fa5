"""How rounding-sensitive is a random Llama-3-8B-shaped model? HF's own bf16 forward vs its fp32 one.

Explains the 8B parity figure of docs/gpu.md: if HF bf16 is already far from HF fp32 on random
weights, no bf16 implementation with other rounding can be within 1e-2 of HF bf16. Prints, for a few
weight inits, the worst and mean per-row relative L2 error of the logits of one 300-token prompt.

    python scripts/lab/gpu_rounding_probe.py        # on a GPU with >= 80 GB
"""

import math
import time

import torch
import transformers


def rel_rows(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return (a - b).norm(dim=-1) / b.norm(dim=-1)


def main() -> None:
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=4096, rope_theta=500000.0,
        rms_norm_eps=1e-5,
    )  # fmt: skip
    layers = cfg.num_hidden_layers
    with torch.device("cuda"):
        model = transformers.LlamaForCausalLM(cfg).float().eval()
    ids = torch.randint(0, cfg.vocab_size, (1, 300), device="cuda")

    def out_proj(name: str) -> bool:
        return "o_proj" in name or "down_proj" in name

    inits = {
        "std 0.02": lambda n, p: p.normal_(0, 0.02),
        "std 0.02, o/down / sqrt(2L)": lambda n, p: p.normal_(0, 0.02 / (math.sqrt(2 * layers) if out_proj(n) else 1)),
        "fan-in 1/sqrt(d_in)": lambda n, p: p.normal_(0, 1 / math.sqrt(p.shape[1])),
        "fan-in, o/down / sqrt(2L)": lambda n, p: p.normal_(
            0, 1 / math.sqrt(p.shape[1]) / (math.sqrt(2 * layers) if out_proj(n) else 1)
        ),
    }
    for name, init in inits.items():
        t = time.time()
        with torch.no_grad():
            for n, p in model.named_parameters():
                if "norm" in n:
                    p.fill_(1.0)
                elif "embed" in n:
                    p.normal_(0, 0.02)
                else:
                    init(n, p)
            ref = model(ids).logits[0].float()
            inv = {k: v.clone() for k, v in model.named_buffers() if "inv_freq" in k}
            model.to(torch.bfloat16)
            for k, v in model.named_buffers():  # keep the rotary frequencies exact, as a bf16 load does
                if k in inv:
                    v.data = inv[k]
            got = model(ids).logits[0].float()
            model.to(torch.float32)
            for k, v in model.named_buffers():
                if k in inv:
                    v.data = inv[k]
        r = rel_rows(got, ref)
        print(
            f"{name:32s} HF bf16 vs fp32: worst row {float(r.max()):.2e}, mean {float(r.mean()):.2e}; "
            f"logit std {float(ref.std()):.2f} ({time.time() - t:.1f} s)",
            flush=True,
        )


if __name__ == "__main__":
    main()
