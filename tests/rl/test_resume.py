"""Stop and resume: the resumed run's metrics equal, bit for bit, those of a run that never stopped."""

from megatron_gptoss.config import load_config
from megatron_gptoss.train import run
from megatron_gptoss.utils.metrics import read_metrics

FAST = [
    "model.preset=gpt_oss_tiny",
    "model.vocab_size=32",
    "rollout.prompts_per_step=3",
    "rollout.n_samples_per_prompt=4",
    "run.eval_every=0",
    "run.progress=false",
    "run.tensorboard=false",
    "env.eval_size=8",
    "run.save_every=2",
    "ppo.num_mini_batches=2",  # off-policy: the shuffle generator and old log-probs matter too
    "ppo.kl_coef=0.05",  # the reference policy is part of the state
]


def _learning_metrics(records):
    """Everything but wall-clock times (time/*, idle/*) and evaluations (the stopped run also evaluates at
    its last step)."""
    skip = ("time/", "idle/", "eval/", "reward/eval")
    return [{k: v for k, v in r.items() if not k.startswith(skip)} for r in records]


def test_resume_is_bitwise(tmp_path):
    straight = tmp_path / "straight"
    run(load_config("configs/demo_cpu.yaml", [*FAST, f"run.output_dir={straight}", "run.steps=4"]))

    stopped = tmp_path / "stopped"
    run(load_config("configs/demo_cpu.yaml", [*FAST, f"run.output_dir={stopped}", "run.steps=2"]))
    run(
        load_config(
            "configs/demo_cpu.yaml", [*FAST, f"run.output_dir={stopped}", "run.steps=4", "run.resume=auto"]
        )
    )

    a = _learning_metrics(read_metrics(straight / "metrics.jsonl"))
    b = _learning_metrics(read_metrics(stopped / "metrics.jsonl"))
    assert [r["step"] for r in b] == [0, 1, 2, 3, 4]
    assert a == b
