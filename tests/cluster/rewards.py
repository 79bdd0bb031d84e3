"""The dense test reward (tests/train/rewards.py), held once per process when the test asks: with
JAXLOOP_TEST_HOLD_AFTER=<a checkpoint dir> and that checkpoint committed, the first reward call
writes `<pid>` into JAXLOOP_TEST_HOLD_MARKERS and sleeps, so a test can remove a node while every
trainer process is mid-run. Without the variables it is char_code_reward, bit for bit."""

import os
import time

from tests.train.rewards import char_code_reward

HOLD_S = 300.0  # bounded: a process the test fails to stop still ends by itself
_held = False


def held_char_code_reward(response: str, label: str) -> float:
    global _held
    after = os.environ.get("JAXLOOP_TEST_HOLD_AFTER")
    if after and not _held and os.path.isdir(after):
        _held = True
        markers = os.environ["JAXLOOP_TEST_HOLD_MARKERS"]
        with open(os.path.join(markers, str(os.getpid())), "w") as f:
            f.write(str(os.getpid()))
        time.sleep(HOLD_S)
    return char_code_reward(response, label)
