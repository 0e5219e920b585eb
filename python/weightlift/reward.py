"""A reward function in Python, served as weightlift's reward process in one line.

    # my_reward.py
    import weightlift.reward

    def reward(prompt, completion, row):          # row: the dataset line, as a dict
        return 1.0 if completion.strip() == row["answer"] else 0.0

    weightlift.reward.serve(reward)

    $ weightlift rl --dataset problems.jsonl --reward-cmd "python3 my_reward.py" ...

The function returns a number (the reward), or a dict with "reward" and optionally "correct"
(a bool: what held-out accuracy counts; by default a reward of 1 or more). It is called once
per completion, in order; a function taking a fourth argument also receives ``ended`` (False
for a completion cut at the length limit). An exception, a reward
that is not a finite number, or anything printed to stdout by the function stops the run with
an error naming the sample and the end of this process's stderr (so print diagnostics to
stderr).
"""
from __future__ import annotations

import inspect
import json
import math
import sys
from typing import Any, Callable, Dict, Optional, TextIO


def _reply(value: Any) -> Dict[str, Any]:
    out = dict(value) if isinstance(value, dict) else {"reward": value}
    if isinstance(out.get("reward"), bool) or not isinstance(out.get("reward"), (int, float)):
        raise TypeError(f"the reward function returned {value!r}: expected a number or a dict "
                        "with a numeric 'reward'")
    out["reward"] = float(out["reward"])
    if not math.isfinite(out["reward"]):
        raise ValueError(f"the reward function returned {out['reward']}: not finite")
    if "correct" in out and not isinstance(out["correct"], bool):
        raise TypeError(f"'correct' is {out['correct']!r}: expected a bool")
    return out


def serve(fn: Callable[..., Any], stdin: Optional[TextIO] = None,
          stdout: Optional[TextIO] = None) -> None:
    """Answers weightlift's queries on stdin with ``fn(prompt, completion, row[, ended])`` on
    stdout until stdin ends."""
    stdin = stdin or sys.stdin
    out = stdout or sys.stdout
    # The function's own prints must not be read as replies: they go to stderr.
    sys.stdout = sys.stderr
    wants_ended = len(inspect.signature(fn).parameters) >= 4
    try:
        for line in stdin:
            if not line.strip():
                continue
            q = json.loads(line)
            args = (q["prompt"], q["completion"], q.get("row"))
            value = fn(*args, q.get("ended", False)) if wants_ended else fn(*args)
            out.write(json.dumps(_reply(value)) + "\n")
            out.flush()
    finally:
        sys.stdout = out
