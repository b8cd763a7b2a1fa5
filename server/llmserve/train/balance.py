"""DeepSeek-V3's auxiliary-loss-free load balancing, and the expert loads it reports.

Every router (transformers' `DeepseekV3TopkRouter`, in the trunk and in an MTP layer) chooses its experts by
sigmoid score + a per-expert correction bias, which takes no gradient. After each optimizer step the bias of
an expert that took more than the mean load over that step's tokens goes down by `speed`, of one that took
less up by `speed` (DeepSeek-V3, section 2.1.2: gamma). The loads are counted by a forward hook on each
router (its chosen expert ids), so nothing in transformers' forward changes.
"""

from __future__ import annotations

import torch
from torch import nn


class ExpertBalance:
    def __init__(self, modules: list[nn.Module], speed: float) -> None:
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

        self.routers = [m for module in modules for m in module.modules() if isinstance(m, DeepseekV3TopkRouter)]
        self.speed = speed
        self.step_loads = [torch.zeros(r.num_experts, device=r.weight.device) for r in self.routers]
        self.total_loads = [torch.zeros_like(t) for t in self.step_loads]
        for i, r in enumerate(self.routers):
            r.register_forward_hook(self._counter(i))

    def _counter(self, i: int):
        def count(module, args, output) -> None:
            ids = output[2].flatten()  # (router_logits, topk_weights, topk_indices)
            loads = torch.bincount(ids, minlength=module.num_experts).float()
            if module.training:  # a training step's tokens (not the held-out checks')
                self.step_loads[i] += loads
            self.total_loads[i] += loads

        return count

    @torch.no_grad()
    def update(self) -> None:
        """After an optimizer step: each bias towards the mean load of the step's tokens; the counts restart."""
        for r, loads in zip(self.routers, self.step_loads):
            r.e_score_correction_bias += self.speed * torch.sign(loads.mean() - loads)
            loads.zero_()

    def reset_totals(self) -> None:
        for t in self.total_loads:
            t.zero_()

    def report(self) -> list[dict]:
        """Per router, since the last reset: the busiest and the idlest expert's load over the mean."""
        out = []
        for t in self.total_loads:
            mean = t.mean().item()
            ratios = {"max_over_mean": t.max().item() / mean, "min_over_mean": t.min().item() / mean} if mean else {}
            out.append({k: round(v, 3) for k, v in ratios.items()})
        return out
