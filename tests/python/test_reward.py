"""weightlift.reward.serve: a Python reward function served as weightlift's reward process,
as `weightlift rl --reward-cmd` speaks to it (tests/rl/process_test.cc runs it in a real job)."""
import io
import json
import subprocess
import sys

import pytest

import weightlift.reward as reward


def serve(fn, queries):
    out = io.StringIO()
    reward.serve(fn, io.StringIO("".join(json.dumps(q) + "\n" for q in queries)), out)
    return [json.loads(line) for line in out.getvalue().splitlines()]


QUERY = {"prompt": "2+2=", "completion": "4", "ended": True, "row": {"answer": "4"}}


def test_numbers_dicts_and_the_fourth_argument():
    assert serve(lambda p, c, row: float(c == row["answer"]), [QUERY]) == [{"reward": 1.0}]
    assert serve(lambda p, c, row: {"reward": 0.5, "correct": False}, [QUERY]) == [
        {"reward": 0.5, "correct": False}]
    cut = dict(QUERY, ended=False)
    assert serve(lambda p, c, row, ended: 1 if ended else -1, [QUERY, cut]) == [
        {"reward": 1.0}, {"reward": -1.0}]


@pytest.mark.parametrize("value", ["1", None, True, float("nan"), {"score": 1},
                                   {"reward": 1, "correct": "yes"}])
def test_a_reply_that_is_not_a_finite_reward_is_an_error(value):
    with pytest.raises((TypeError, ValueError)):
        serve(lambda p, c, row: value, [QUERY])


def test_prints_of_the_function_go_to_stderr_not_into_the_replies():
    script = ("import weightlift.reward as r\n"
              "def f(p, c, row):\n"
              "    print('thinking about', c)\n"
              "    return 2\n"
              "r.serve(f)\n")
    done = subprocess.run([sys.executable, "-c", script], input=json.dumps(QUERY) + "\n",
                          capture_output=True, text=True, timeout=60, check=True)
    assert done.stdout == '{"reward": 2.0}\n'
    assert "thinking about 4" in done.stderr
