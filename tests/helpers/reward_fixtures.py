"""User reward functions for the scorer tests, named `reward_fixtures:<function>` and imported in the
scorer's worker processes (the tests' directory is on the path the workers inherit)."""

import os
import time


def misbehave(messages, row):
    """Does what the row's extra_info["do"] says: "hang" (sleeps forever), "slow" (sleeps half a second),
    "raise", "die" (ends its process without a word), "nan", "text" (returns a string); scores 1 with a
    metric otherwise."""
    action = row["extra_info"].get("do")
    if action == "slow":
        time.sleep(0.5)
    if action == "hang":
        while True:
            time.sleep(60)
    if action == "raise":
        raise RuntimeError("boom")
    if action == "die":
        os._exit(3)
    if action == "nan":
        return float("nan")
    if action == "text":
        return "one"
    return {"reward": 1.0, "messages": float(len(messages))}


def pid(messages, row):
    """The worker's process id (which process scored the row)."""
    return float(os.getpid())


not_callable = 3
