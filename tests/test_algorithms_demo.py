"""Every `algorithm.advantage` and `ppo.policy_loss` value runs the CPU demo (configs/demo_cpu.yaml) for two
steps at a tiny batch with finite metrics; DAPO's dynamic sampling and overlong penalty and the adaptive KL
penalty in the reward ride along on some of the runs (one process: the runs share it)."""

import math

import pytest

from megatron_gptoss.config import load_config
from megatron_gptoss.config.algorithm import ADVANTAGE_ESTIMATORS
from megatron_gptoss.config.train import POLICY_LOSSES
from megatron_gptoss.train import run
from megatron_gptoss.utils.metrics import read_metrics

TINY = [
    "run.steps=2",
    "run.eval_every=0",
    "run.progress=false",
    "run.tensorboard=false",
    "run.export_hf=false",
    "run.save_every=-1",
    "rollout.prompts_per_step=2",
    "rollout.n_samples_per_prompt=4",
    "env.eval_size=2",
    "optim.warmup_steps=0",
]
# (advantage, policy loss, extra overrides, metrics the run must log)
RUNS = [
    (
        "grpo",
        "ppo",
        ["dapo.dynamic_sampling=true", "dapo.max_extra_rounds=3", "dapo.overlong_buffer=2"],
        ["dapo/rounds", "dapo/batch_groups", "dapo/overlong_frac"],
    ),
    ("dr_grpo", "gspo", ["ppo.loss_agg_mode=seq-mean-token-mean"], []),
    ("rloo", "gspo_token", [], []),
    (
        "reinforce_pp",
        "ppo",
        [
            "algorithm.gamma=0.9",
            "algorithm.kl_in_reward_coef=0.05",
            "algorithm.kl_ctrl=adaptive",
            "ppo.kl_coef=0.01",
            "ppo.kl_estimator=k2",
        ],
        ["kl_reward/kl", "kl_reward/coef", "loss/kl"],
    ),
    ("reinforce_pp_baseline", "gspo", [], []),
    ("gae", "ppo", ["algorithm.lam=0.95", "critic.lr=1e-4"], ["critic/value_loss", "critic/explained_var"]),
]


def test_runs_cover_every_choice():
    assert {r[0] for r in RUNS} == set(ADVANTAGE_ESTIMATORS)
    assert {r[1] for r in RUNS} == set(POLICY_LOSSES)


@pytest.mark.parametrize("advantage,policy_loss,extra,expected", RUNS, ids=[f"{r[0]}-{r[1]}" for r in RUNS])
def test_two_demo_steps_have_finite_metrics(tmp_path, advantage, policy_loss, extra, expected):
    overrides = [f"algorithm.advantage={advantage}", f"ppo.policy_loss={policy_loss}", *extra]
    cfg = load_config("configs/demo_cpu.yaml", [f"run.output_dir={tmp_path}", *TINY, *overrides])
    run(cfg)
    steps = [r for r in read_metrics(tmp_path / "metrics.jsonl") if r["step"] > 0]
    assert [r["step"] for r in steps] == [1, 2]
    for record in steps:
        bad = {k: v for k, v in record.items() if isinstance(v, float) and not math.isfinite(v)}
        assert not bad, (advantage, policy_loss, bad)
        missing = [k for k in ["pg/loss", "train/grad_norm", *expected] if k not in record]
        assert not missing, (advantage, policy_loss, missing)
        assert record["train/skipped"] == 0.0
    assert steps[1]["train/lr"] > 0
    if "dapo/batch_groups" in expected:
        assert all(0 < r["dapo/batch_groups"] <= 2 for r in steps)
    if "kl_reward/coef" in expected:  # adaptive: the coefficient moved after the first step
        assert steps[0]["kl_reward/coef"] == 0.05 and steps[1]["kl_reward/coef"] != 0.05
