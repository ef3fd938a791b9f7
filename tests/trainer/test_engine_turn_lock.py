"""The engine rank's lock between its decoding thread and the learner's calls (`trainer.engine_process`):
a call waits for the current engine step, not for the rows in flight. `threading.Lock` fails this: the
thread that releases it and takes it again at once keeps it for seconds."""

import threading
import time

from megatron_gptoss.trainer.engine_process import TurnLock

STEP_S = 0.005


def _waits(lock, calls: int = 8) -> tuple[list[float], int]:
    """A thread steps (STEP_S of work under the lock) without pause; the caller takes the lock `calls`
    times. Returns each call's wait and the steps the thread made."""
    stop = threading.Event()
    steps = [0]

    def decode() -> None:
        while not stop.is_set():
            with lock:
                start = time.perf_counter()
                while time.perf_counter() - start < STEP_S:
                    pass
                steps[0] += 1

    thread = threading.Thread(target=decode, daemon=True)
    thread.start()
    time.sleep(0.02)
    waits = []
    try:
        for _ in range(calls):
            start = time.perf_counter()
            with lock:
                waits.append(time.perf_counter() - start)
            time.sleep(0.005)
    finally:
        stop.set()
        thread.join(timeout=30)
    return waits, steps[0]


def test_a_call_waits_for_one_engine_step_not_for_the_batch():
    waits, steps = _waits(TurnLock())
    assert max(waits) < 0.5, waits  # one step is 5 ms; slack for a loaded 2-core machine
    assert steps >= len(waits), steps  # the thread went on stepping between the calls
