"""The README's demo: a small GPT-OSS-shaped model learns to reverse four-digit strings on the CPU. A short
supervised cold start teaches the answer's format and part of the skill; GRPO then raises the held-out
accuracy (strings never seen in training) to near 1.

    python tools/demo_reverse.py [--cold-start-steps N] [OVERRIDES...]

    cold start  configs/demo_reverse.yaml with run.mode=sft: 64 training strings a step with their reversals
                (OUT/cold_start)
    RL          the same config, run.init_from_hf = the cold start's HF export (OUT/rl); its step-0
                evaluation is the cold start's held-out accuracy (greedy, 200 held-out strings)
    plot        OUT/both_phases.png: the cold start's loss, then RL's reward, held-out accuracy and entropy

OVERRIDES (config fields, e.g. run.seed=1 run.steps=100) apply to both phases, except that the cold start's
mode, length and learning rate are its own; run.output_dir=OUT (default outputs/demo_reverse) names the
output directory. The last line printed is the summary (megatron_gptoss.two_phase): the held-out accuracy
where RL started ("start") and after RL ("final"), and the wall times.
"""

from __future__ import annotations

from pathlib import Path

from megatron_gptoss import two_phase

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs/demo_reverse.yaml"
COLD_START = ["run.mode=sft", "optim.lr=3.0e-3", "optim.warmup_steps=5"]
PLOTTED = ["loss/total", "reward/train_mean", "reward/eval_mean", "eval/accuracy", "loss/entropy",
           "mismatch/abs_diff_mean", "mismatch/abs_diff_max", "train/grad_norm"]  # fmt: skip


def main(argv: list[str] | None = None) -> dict:
    parser = two_phase.make_parser(__doc__, cold_start_steps=35)
    args, overrides = two_phase.parse(parser, argv, "outputs/demo_reverse")
    demo = two_phase.TwoPhase(CONFIG, args.out, overrides)
    demo.cold_start(args.cold_start_steps, COLD_START)
    demo.rl()
    return demo.finish(PLOTTED)


if __name__ == "__main__":
    main()
