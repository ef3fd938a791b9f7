"""A LoRA RL run of the one trainer on 2 gloo ranks (the demo's model and task, the learner at tensor
parallel 2, a KL penalty in the reward). With the embedded engine at tensor parallel 2 it shares the
learner's frozen base and the sync copies the adapters only; with the engine at tensor parallel 1 (two
replicas) the bridge sends merged weights. Either way the engine's log-probs equal the learner's every step
(a sync skipped after the first shows as a mismatch: the engine's adapters are its own copy); the shared
sync moves a small fraction of the merged one's bytes. The reference policy is the base (adapters
disabled): its KL to the policy is exactly 0 at the first step, where B = 0, and positive once the
adapters train; the on-policy ratio is exactly 1; a run stopped and resumed logs bit for bit the metrics of
one that never stopped. The adapters-only checkpoints export merged and as PEFT adapters."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from helpers.harness import pool
from helpers.scripts import load_script
from torch.distributed.checkpoint import FileSystemReader

from megatron_gptoss.checkpoint.lora import load_policy
from megatron_gptoss.config import load_config
from megatron_gptoss.hf.names import match_ours, to_hf
from megatron_gptoss.model.lora import adapters_disabled
from megatron_gptoss.trainer import colocated, loop

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "configs/layouts/tiny_rl_tp2_pp2_cpu.yaml"
STEPS = 3
TARGETS = "linear_qkv,linear_proj,router,linear_fc1,linear_fc2"
LORA = ["model.lora.rank=4", "model.lora.alpha=8", f"model.lora.targets={TARGETS}",
        "parallel.pipeline_model_parallel_size=1", "algorithm.kl_in_reward_coef=0.01",
        "rollout.prompts_per_step=8", "rollout.n_samples_per_prompt=4", "run.tensorboard=false",
        "run.progress=false", "run.eval_every=0", f"run.steps={STEPS}", "optim.warmup_steps=0"]  # fmt: skip


def train(out: str, overrides: list[str], skip_sync: bool = False) -> None:
    cfg = load_config(CONFIG, [*LORA, f"run.output_dir={out}", *overrides])
    if not skip_sync:
        loop.run(cfg)
    else:  # the engine keeps the adapters of the first sync
        calls, original = {"n": 0}, colocated.Colocated.sync

        def first_only(self):
            calls["n"] += 1
            return original(self) if calls["n"] == 1 else {}

        colocated.Colocated.sync = first_only  # type: ignore[method-assign]
        try:
            loop.run(cfg)
        finally:
            colocated.Colocated.sync = original  # type: ignore[method-assign]
    dist.barrier()


def metrics(out: Path) -> dict[int, dict]:
    return {line["step"]: line for line in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    base = tmp_path_factory.mktemp("lora")
    workers = pool(2)
    workers.run(train, str(base / "whole"), [])
    workers.run(train, str(base / "stopped"), ["run.steps=2"])
    workers.run(train, str(base / "stopped"), ["run.resume=auto"])
    workers.run(train, str(base / "merged"), ["rollout.tensor_parallel_size=1"])
    workers.run(train, str(base / "stale"), [], True)
    logs = {name: metrics(base / name) for name in ("whole", "stopped", "merged", "stale")}
    with pytest.raises(AssertionError, match="trained on the base"):  # another seed: another base
        workers.run(train, str(base / "stopped"), ["run.resume=auto", "run.seed=1"])
    with pytest.raises(AssertionError, match="LoRA adapters of rank 4 .* model.lora.rank=2"):
        workers.run(train, str(base / "stopped"), ["run.resume=auto", "model.lora.rank=2"])
    # one more step in another layout (tp 1 x dp 2): the adapters are resharded from the step-3 checkpoint
    other = ["run.resume=auto", f"run.steps={STEPS + 1}", "parallel.tensor_model_parallel_size=1",
             "rollout.tensor_parallel_size=1"]  # fmt: skip
    workers.run(train, str(base / "stopped"), other)
    logs["relaid"] = metrics(base / "stopped")
    return base, logs


def test_engine_matches_learner_and_the_reference_is_the_base(runs):
    _, logs = runs
    whole, merged, stale = logs["whole"], logs["merged"], logs["stale"]
    assert sorted(whole) == sorted(merged) == list(range(STEPS + 1))
    for step in range(1, STEPS + 1):
        for line in (whole[step], merged[step]):
            assert line["mismatch/tokens"] > 0
            assert line["mismatch/abs_diff_max"] <= 1e-5, (step, line["mismatch/abs_diff_max"])
            assert line["pg/ratio_max"] == 1.0 and line["pg/ratio_min"] == 1.0
        shared_bytes, merged_bytes = whole[step]["sync/bytes"], merged[step]["sync/bytes"]
        assert 0 < 10 * shared_bytes < merged_bytes, (shared_bytes, merged_bytes)
    shared_bytes, merged_bytes = whole[1]["sync/bytes"], merged[1]["sync/bytes"]
    print(f"sync bytes on rank 0: shared base {shared_bytes:.0f}, merged {merged_bytes:.0f}")
    assert stale[1]["mismatch/abs_diff_max"] <= 1e-5
    assert stale[STEPS]["mismatch/abs_diff_max"] > 1e-3  # the engine kept the first sync's adapters
    assert whole[1]["kl_reward/kl"] == 0.0  # B = 0: the policy is the base
    assert whole[1]["train/grad_norm"] > 0
    assert whole[STEPS]["kl_reward/kl"] != 0.0  # the adapters moved the policy away from the base


def test_checkpoints_hold_the_adapters_and_their_optimizer_state_only(runs):
    base, _ = runs
    step = max((base / "whole" / "checkpoints").glob("step_*"))
    manifest = json.loads((step / "manifest.json").read_text())
    assert manifest["contents"]["adapters_only"] and manifest["base"] == {"seed": 0}
    stored = FileSystemReader(str(step)).read_metadata().state_dict_metadata
    params = {k.split("/", 1)[1] for k in stored if k.startswith("model/")}
    optim = {k.split("/", 1)[1] for k in stored if k.startswith("optim")}
    assert params and all(".lora." in name for name in params), sorted(params)
    assert len(params) == 2 * 5 * 4  # a and b of 5 targets in each of the demo model's 4 layers
    assert optim and all(".lora." in name for name in optim), sorted(optim)


def test_resume_in_another_layout_keeps_the_trained_adapters(runs):
    _, logs = runs
    line = logs["relaid"][STEPS + 1]
    assert line["mismatch/abs_diff_max"] <= 1e-5 and line["pg/ratio_max"] == 1.0
    assert line["kl_reward/kl"] != 0.0  # fresh adapters (B = 0) would give exactly 0


def test_resume_continues_bit_for_bit(runs):
    _, logs = runs
    whole, stopped = logs["whole"], logs["stopped"]
    assert sorted(stopped) == sorted(whole)
    for step in range(1, STEPS + 1):
        assert stopped[step].keys() >= whole[step].keys()  # the stopped run evaluated at its end
        for key, value in whole[step].items():
            if not key.startswith(("time/", "idle/")):  # idle/*: shares of wall time
                assert stopped[step][key] == value, (step, key)


def rel_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    ours, ref = ours.detach().double(), ref.detach().double()
    return float((ours - ref).norm() / ref.norm().clamp_min(1e-30))


def test_merged_export_loads_in_transformers_with_our_logits(runs, world_of_one, tmp_path):
    """convert_dist_to_hf on the adapters-only checkpoint: the base rebuilt from its seed, W + scale * B A
    written in HF layout; transformers' logits equal those of our model running its adapters."""
    from transformers import GptOssForCausalLM

    base, _ = runs
    checkpoint = base / "whole" / "checkpoints"
    report = load_script("convert_dist_to_hf").main(
        [str(checkpoint), str(tmp_path / "hf"), "--dtype", "float32"]
    )
    assert report["lora"] == "merge"
    step = max(checkpoint.glob("step_*"))
    ours, _ = load_policy(step)
    ids = torch.randint(0, ours.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    hf = GptOssForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    with torch.no_grad():
        logits, theirs = ours(ids), hf(ids).logits
        with adapters_disabled(ours):
            base_logits = ours(ids)
    err, moved = rel_err(theirs, logits), rel_err(base_logits, logits)
    print(f"merged export in transformers vs ours: {err:.2e}; the base alone vs ours: {moved:.2e}")
    assert err < 1e-5
    assert moved > 1e-4  # the adapters trained: the merge matters


def test_peft_export_loads_into_transformers_with_our_logits(runs, world_of_one, tmp_path):
    """convert_dist_to_hf --lora peft: the adapters alone in PEFT's format, every target (fused QKV split,
    router, per-expert fc1 / fc2) included; PeftModel on transformers' model of the base weights gives the
    logits of our model running its adapters."""
    from peft import PeftModel  # the dev extra
    from transformers import GptOssConfig, GptOssForCausalLM

    base, _ = runs
    checkpoint = base / "whole" / "checkpoints"
    report = load_script("convert_dist_to_hf").main(
        [str(checkpoint), str(tmp_path / "adapter"), "--dtype", "float32", "--lora", "peft"]
    )
    assert report["lora"] == "peft"
    ours, _ = load_policy(max(checkpoint.glob("step_*")))
    hf_cfg = {k: v for k, v in ours.config.to_hf_config().items() if k not in ("architectures", "model_type")}
    hf = GptOssForCausalLM(GptOssConfig(**hf_cfg)).float().eval()
    state = {}
    for name, p in ours.named_parameters():
        if ".lora." not in name:
            state.update(to_hf(match_ours(name), p.detach(), ours.config))
    missing, unexpected = hf.load_state_dict(state, strict=False)
    assert not missing and not unexpected, (missing, unexpected)
    peft_model = PeftModel.from_pretrained(hf, str(tmp_path / "adapter")).eval()
    ids = torch.randint(0, ours.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits, theirs = ours(ids), peft_model(input_ids=ids).logits
    err = rel_err(theirs, logits)
    print(f"PEFT adapters in transformers vs ours: {err:.2e}")
    assert err < 1e-5
