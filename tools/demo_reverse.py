"""The README's demo: a small GPT-OSS-shaped model learns to reverse four-digit strings on the CPU. A short
supervised cold start teaches the answer's format and part of the skill; GRPO then raises the held-out
accuracy (strings never seen in training) to near 1.

    python tools/demo_reverse.py [--gpu] [--cold-start-steps N] [OVERRIDES...]

    cold start  configs/demo_reverse.yaml with run.mode=sft: 64 training strings a step with their reversals
                (OUT/cold_start)
    RL          the same config, run.init_from_hf = the cold start's HF export (OUT/rl); its step-0
                evaluation is the cold start's held-out accuracy (greedy, 200 held-out strings)
    plot        OUT/both_phases.png: the cold start's loss, then RL's reward, held-out accuracy and entropy

--gpu: the GPU variant, configs/demo_reverse_gpu.yaml: six-digit strings, four layers of width 256, 64 prompts
x 8 samples, 200 GRPO steps and 1,000 held-out strings after a cold start of 60 steps of 256 strings at lr
1e-3 (output in outputs/demo_reverse_gpu); meant for one GPU, under 10 minutes on an H100.

OVERRIDES (config fields, e.g. run.seed=1 run.steps=100) apply to both phases, except that the cold start's
mode, length and learning rate are its own; run.output_dir=OUT (default outputs/demo_reverse) names the
output directory. The last line printed is the summary (megatron_gptoss.two_phase): the held-out accuracy
where RL started ("start") and after RL ("final"), and the wall times.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from megatron_gptoss import two_phase

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs/demo_reverse.yaml"
COLD_START = ["run.mode=sft", "optim.lr=3.0e-3", "optim.warmup_steps=5"]
# (config, cold-start steps, the cold start's own settings, default output directory): the CPU demo, --gpu
VARIANTS = {
    False: (CONFIG, 35, COLD_START, "outputs/demo_reverse"),
    True: (ROOT / "configs/demo_reverse_gpu.yaml", 60, [*COLD_START[:1], "optim.lr=1.0e-3", *COLD_START[2:]],
           "outputs/demo_reverse_gpu"),
}  # fmt: skip
PLOTTED = ["loss/total", "reward/train_mean", "reward/eval_mean", "eval/accuracy", "loss/entropy",
           "mismatch/abs_diff_mean", "mismatch/abs_diff_max", "train/grad_norm"]  # fmt: skip


def main(argv: list[str] | None = None) -> dict:
    variant = argparse.ArgumentParser(add_help=False)
    variant.add_argument("--gpu", action="store_true")
    config, steps, cold_start, out = VARIANTS[variant.parse_known_args(argv)[0].gpu]
    parser = two_phase.make_parser(__doc__, cold_start_steps=steps)
    parser.add_argument("--gpu", action="store_true", help="the GPU variant (configs/demo_reverse_gpu.yaml)")
    args, overrides = two_phase.parse(parser, argv, out)
    demo = two_phase.TwoPhase(config, args.out, overrides)
    demo.cold_start(args.cold_start_steps, cold_start)
    demo.rl()
    return demo.finish(PLOTTED)


if __name__ == "__main__":
    main()
