#!/usr/bin/python3
"""The example's reward, served to `weightlift rl --reward-cmd` with weightlift.reward: 1 for
the right sum, and a small penalty per character beyond the answer's length, so the policy
learns to stop once it has answered (the built-in `number` verifier pays any completion
whose last number is right)."""
import re

import weightlift.reward


def reward(prompt, completion, row, ended):
    numbers = re.findall(r"-?\d+", completion)
    right = ended and bool(numbers) and numbers[-1] == row["answer"]
    extra = max(0, len(completion) - len(row["answer"]))
    return {"reward": (1.0 if right else 0.0) - 0.05 * extra, "correct": right}


if __name__ == "__main__":
    weightlift.reward.serve(reward)
