"""Single-process references of the learner step and its optimizer, for tests that compare the parallel
learner (any layout, world 1 included) with a plain model: the same PPO step written directly on one
`GPTOSSModel`, and AdamW over fp32 master weights written in plain PyTorch."""

from __future__ import annotations

import torch

from megatron_gptoss.config import OptimConfig, PPOConfig
from megatron_gptoss.parallel.lr_schedule import lr_at
from megatron_gptoss.rl.batch import RolloutBatch, packed_logprobs
from megatron_gptoss.rl.learner import MetricTotals, micro_loss, prepare_with, run_epochs
from megatron_gptoss.rl.ppo_loss import loss_denominators


class MasterWeightAdamW:
    """AdamW whose state and master weights are fp32, whatever the model's parameter dtype."""

    def __init__(self, params: list[torch.nn.Parameter], cfg: OptimConfig, total_steps: int):
        self.params = [p for p in params if p.requires_grad]
        self.master = [p.detach().float().clone().requires_grad_(True) for p in self.params]
        self.cfg, self.total_steps, self.step_count = cfg, total_steps, 0
        self.inner = torch.optim.AdamW(
            self.master,
            lr=cfg.lr,
            betas=(cfg.adam_beta1, cfg.adam_beta2),
            eps=cfg.adam_eps,
            weight_decay=cfg.weight_decay,
        )

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None

    def grad_norm(self) -> torch.Tensor:
        """Global L2 norm of the current gradients (fp32)."""
        norms = [p.grad.float().norm() for p in self.params if p.grad is not None]
        return torch.linalg.vector_norm(torch.stack(norms)) if norms else torch.zeros(())

    @torch.no_grad()
    def step(self) -> dict[str, float]:
        """Clip, update and copy back. A non-finite gradient norm skips the update (logged)."""
        norm = self.grad_norm()
        lr = lr_at(self.cfg, self.step_count, self.total_steps)
        if not torch.isfinite(norm):
            print("step %d skipped: non-finite gradient norm %s", self.step_count, norm.item())
            self.zero_grad()
            return {"train/grad_norm": float(norm), "train/lr": lr, "train/skipped": 1.0}
        scale = 1.0
        if self.cfg.clip_grad > 0 and float(norm) > self.cfg.clip_grad:
            scale = self.cfg.clip_grad / (float(norm) + 1e-6)
        for p, m in zip(self.params, self.master):
            m.grad = None if p.grad is None else p.grad.float() * scale
        for group in self.inner.param_groups:
            group["lr"] = lr
        self.inner.step()
        moved = sum(float((m.double() - p.double()).pow(2).sum()) for p, m in zip(self.params, self.master))
        size = sum(float(p.double().pow(2).sum()) for p in self.params)
        for p, m in zip(self.params, self.master):
            p.copy_(m)
        self.step_count += 1
        self.zero_grad()
        ratio = (moved / size) ** 0.5  # ||new - old|| / ||old||, as the distributed optimizer reports it
        return {
            "train/grad_norm": float(norm),
            "train/lr": lr,
            "train/skipped": 0.0,
            "train/update_ratio": ratio,
        }

    def state_dict(self) -> dict:
        return {"inner": self.inner.state_dict(), "master": self.master, "step": self.step_count}

    def load_state_dict(self, state: dict) -> None:
        self.inner.load_state_dict(state["inner"])
        with torch.no_grad():
            for m, saved in zip(self.master, state["master"]):
                m.copy_(saved)
            for p, m in zip(self.params, self.master):
                p.copy_(m)
        self.step_count = state["step"]


@torch.no_grad()
def prepare(
    policy, batch: RolloutBatch, cfg: PPOConfig, temperature: float, group_size: int, reference=None
) -> tuple[RolloutBatch, dict[str, float]]:
    """Advantages, old and reference log-probs, and rollout-correction weights (mask updated for MIS)."""
    ref = None if reference is None else (lambda b: packed_logprobs(reference, b, temperature)[0])
    return prepare_with(lambda b: packed_logprobs(policy, b, temperature)[0], ref, batch, cfg, group_size)


def accumulate_gradients(
    policy, mini_batch: RolloutBatch, cfg: PPOConfig, temperature: float, on_policy: bool, dp_group=None
) -> dict[str, float]:
    """Forward and backward over the micro-batches of one mini-batch (gradients accumulate in .grad).
    Each micro-batch's loss is normalised by the whole mini-batch's denominators."""
    micro_batches = [
        mini_batch.select(idx) for idx in torch.arange(len(mini_batch)).chunk(cfg.num_micro_batches)
    ]
    denom = loss_denominators([m.loss_mask for m in micro_batches], dp_group)
    totals = MetricTotals()
    for micro in micro_batches:
        logprobs, entropy = packed_logprobs(policy, micro, temperature)
        loss, metrics = micro_loss(micro, logprobs, entropy, cfg, denom, on_policy)
        loss.backward()
        totals.add(metrics)
    return totals.result()


def update(
    policy,
    optimizer: MasterWeightAdamW,
    batch: RolloutBatch,
    cfg: PPOConfig,
    temperature: float,
    generator=None,
) -> dict[str, float]:
    """PPO epochs over shuffled mini-batches; one optimizer step per mini-batch. Returns averaged metrics."""

    def step(mini: RolloutBatch, on_policy: bool) -> dict[str, float]:
        metrics = accumulate_gradients(policy, mini, cfg, temperature, on_policy)
        metrics.update(optimizer.step())
        return metrics

    return run_epochs(batch, cfg, generator, step)
