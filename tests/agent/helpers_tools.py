"""User tools for tests/agent (imported by `module:function` from the agent config)."""

FACTS = {"zorblat": "7341", "quenvy": "bluegreen"}


def lookup(key: str) -> str:
    return FACTS.get(key, f"no entry for {key!r}")


def add(a: int, b: int) -> dict:
    return {"sum": a + b}


def broken(x: int) -> str:
    raise RuntimeError("the tool's backend is down")


def sleep(seconds: float) -> str:
    import time

    time.sleep(seconds)
    return f"slept {seconds}"
