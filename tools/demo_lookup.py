"""The lookup demo: a small GPT-OSS-shaped model learns, by GRPO on the CPU, to call a tool holding facts it
cannot know (`megatron_gptoss.envs.lookup`), after a cold start in which at most 5% of the conversations call
it.

    python tools/demo_lookup.py [--cold-start-steps N] [--sft N] [OVERRIDES...]

    data        OUT/data (tools/make_lookup_task.py): train.jsonl (a question on each of 157 training keys),
                test.jsonl (the 43 held-out keys), sft.jsonl (cold-start conversations: 80% calculator
                calls, 5% lookup calls on training keys, the rest "I do not know." to a lookup question)
    cold start  configs/demo_lookup.yaml with run.mode=sft on sft.jsonl (OUT/cold_start); its loss is a
                sampled softmax over the output layer (sft.sampled_vocab: every token the conversations train
                on and 4,096 rows drawn from the rest), about 3x cheaper a step than the full 201,088 rows;
                RL's log-probs are over the full vocabulary
    RL          the same config with agent.enabled=true (the calculator and lookup tools), run.init_from_hf =
                the cold start's HF export (OUT/rl); its step-0 evaluation is the cold start's: greedy, every
                held-out key, the call rate (eval/call_rate) and the reward (eval/accuracy)
    plot        OUT/both_phases.png: the cold start's metrics, then RL's, on one step axis
    copies      teacher-forced on a lookup conversation of every held-out key, how often the cold start's
                most likely token is the key where the call copies it and the value where the answer
                copies it (`copy_rates`; in OUT/summary.json)

OVERRIDES (config fields, e.g. run.steps=20 rollout.temperature=0.7) apply to both phases, except that the
cold start's mode, length, learning rate and schedule are its own (set last); run.output_dir=OUT (default
outputs/demo_lookup) names the output directory. The last line printed is the summary
(megatron_gptoss.two_phase): the held-out reward (eval/accuracy) and call rate (eval/call_rate) where RL
started ("start") and after RL ("final"), the copy rates and the wall times.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from megatron_gptoss import two_phase

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs/demo_lookup.yaml"
COLD_START = ["run.mode=sft", "optim.lr=3.0e-3", "optim.warmup_steps=5", "optim.lr_schedule=cosine"]
# The plot's panels: the cold start's loss, then RL's rewards, held-out accuracy and call rates, mismatch.
PLOTTED = ["loss/total", "reward/train_mean", "reward/eval_mean", "eval/accuracy", "agent/call_rate",
           "eval/call_rate", "mismatch/abs_diff_mean", "mismatch/abs_diff_max", "train/grad_norm",
           "response/length_mean"]  # fmt: skip


def copy_rates(hf_dir: Path, out: Path) -> dict[str, float]:
    """Teacher-forced copy rates of the HF model in `hf_dir` on a lookup conversation of every held-out key
    (written to `out`): the share whose argmax token is the key where the call writes it ("key"), the value
    where the final answer writes it ("value"), both ("both"). The key and value are the first and last
    trained tokens that are three-digit numbers."""
    import random

    import torch

    from megatron_gptoss.data.conversations import ConversationSet
    from megatron_gptoss.envs import lookup
    from megatron_gptoss.harmony import get_tokenizer
    from megatron_gptoss.hf.io import load_hf

    rng = random.Random(0)
    out.write_text("".join(json.dumps(lookup.lookup_call(k, rng)) + "\n" for k in lookup.split_keys(True)))
    examples = ConversationSet([str(out)], 0, "low", 4096).examples
    tokenizer = get_tokenizer()
    model = load_hf(hf_dir, dtype=torch.float32, attention_backend="eager").eval()  # as the trainer
    weight = model.output_weight()

    def is_number(token: int) -> bool:
        text = tokenizer.decode([token]).strip()
        return text.isdigit() and len(text) == 3

    hits = {"key": 0, "value": 0, "both": 0}
    with torch.no_grad():
        for example in examples:
            ids = example.token_ids
            numbers = [
                i
                for i in range(example.num_prompt_tokens, len(ids))
                if example.trained[i] and is_number(ids[i])
            ]
            hidden = model.hidden_states(torch.tensor([ids]))[0]
            key, value = (
                int((hidden[i - 1] @ weight.t()).argmax()) == ids[i] for i in (numbers[0], numbers[-1])
            )
            hits["key"] += key
            hits["value"] += value
            hits["both"] += key and value
    return {name: count / len(examples) for name, count in hits.items()}


def main(argv: list[str] | None = None) -> dict:
    parser = two_phase.make_parser(__doc__, cold_start_steps=600)
    parser.add_argument("--sft", type=int, default=2000, help="cold-start conversations (default 2000)")
    args, overrides = two_phase.parse(parser, argv, "outputs/demo_lookup")
    demo = two_phase.TwoPhase(CONFIG, args.out, overrides)
    data = args.out / "data"
    subprocess.run(
        [sys.executable, str(ROOT / "tools/make_lookup_task.py"), "--sft", str(args.sft), "--out", str(data)],
        check=True,
    )
    files = [
        f"data.train_files=[{data / 'train.jsonl'}]",
        f"data.eval_files=[{data / 'test.jsonl'}]",
        f"sft.train_files=[{data / 'sft.jsonl'}]",
    ]
    cold_start = demo.cold_start(args.cold_start_steps, COLD_START, files)
    copies = copy_rates(cold_start, args.out / "held_out_calls.jsonl")
    print(f"cold start, teacher-forced on the held-out keys: {copies}")
    demo.rl(["agent.enabled=true"], files)
    return demo.finish(PLOTTED, {f"cold_start_copies_{name}": rate for name, rate in copies.items()})


if __name__ == "__main__":
    main()
