"""Builders of parsed harmony completions and rows for the reward tests."""


def completion(final=None, analysis="Let me think.", end="return"):
    """An analysis message then (when `final` is not None) a final message closed by `end`."""
    messages = [{"channel": "analysis", "recipient": None, "content": analysis}]
    if final is not None:
        messages.append({"channel": "final", "recipient": None, "content": final, "end": end})
    return messages


def gsm8k_row(answer):
    return {
        "ground_truth": f"Some reasoning.\n#### {answer}",
        "data_source": "openai/gsm8k",
        "extra_info": {},
    }


def ifeval_row(ids, kwargs):
    return {
        "ground_truth": {"instruction_id_list": ids, "kwargs": kwargs},
        "data_source": "google/IFEval",
        "extra_info": {},
    }
