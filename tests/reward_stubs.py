"""Rewards the reward-checker tests pass as --reward specs (tests.reward_stubs:name): a module of its own, so that
the checker's worker processes import it quickly."""
import os
import time
import reward


def slow_checker(response, row):
    """A checker that hangs on 'HANG' and crashes on 'CRASH' (used by score_batch tests)."""
    if "HANG" in response:
        time.sleep(3600)
    if "CRASH" in response:
        os._exit(1)
    return reward.is_correct(response, row["answer"])


def low_reward(response, row):
    """A reward whose range goes below -1 (used by the failed-reward test): the response is the reward."""
    if "RAISE" in response:
        raise ValueError("raised on purpose")
    return "garbage" if "GARBAGE" in response else float(response)
