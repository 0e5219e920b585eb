#!/usr/bin/env python3
"""Flags a careless user types, through the real command: each is refused at the edge with one
line that names the flag and the allowed range, before any work starts (no internal check, no
crash, no run that goes ahead with a value that makes no sense), and the messages are ones a
person can act on: the CLI parser's errors on one line without 308-digit ranges, an unknown
subcommand named, control characters in names escaped.

Run by CTest with the path of the weightlift binary (tests/cli/harness.py has the rules)."""
import os
import sys
import tempfile

from harness import TINY, Suite, write_tiny_model


def with_flag(prefix, base, flag, value):
    """prefix + base's flags (a dict) with `flag` set to `value`: CLI11 refuses a flag given
    twice, so the flag under test replaces its base value."""
    flags = dict(base, **{flag: value})
    return prefix + [x for kv in flags.items() for x in kv]


def sampling(s, d):
    cfg, w, _ = write_tiny_model(d)
    gen = ["generate", "--config", cfg, "--weights", w]
    base = {"--max-new-tokens": "4"}
    for flag, value, allowed in (("--top-p", "0", "(0, 1]"), ("--top-p", "1.5", "(0, 1]"),
                                 ("--top-p", "nan", "(0, 1]"), ("--top-k", "-5", "[0,"),
                                 # In (0, 1] as a double, 0 as the float sampling holds.
                                 ("--top-p", "1e-300", "single precision"),
                                 ("--temperature", "nan", "[0, 1000000]"),
                                 ("--temperature", "-1", "[0, 1000000]"),
                                 ("--temperature", "inf", "[0, 1000000]"),
                                 ("--max-new-tokens", "-1", "[0,")):
        s.expect_error(f"generate {flag} {value}", with_flag(gen, base, flag, value), flag, allowed)
    s.expect_error("generate: an empty prompt", with_flag(gen, base, "--prompt", ""), "--prompt")
    s.expect_error("generate: an empty stop string", with_flag(gen, base, "--stop", ""), "--stop")


def threads(s, d):
    for value in ("100000", "-1", "1e3"):
        s.expect_error(f"--threads {value}", ["--threads", value, "model-info"], "--threads",
                       "[0, 1024]")


def optimizer(s, d):
    _, _, batch = write_tiny_model(d)
    train = ["train", "--preset", "tiny", "--batch-file", batch, "--quiet", "--out",
             os.path.join(d, "run")]
    base = {"--steps": "2", "--batch": "1", "--seq": "8"}
    for flag, value, allowed in (("--lr", "nan", "(0, inf)"), ("--lr", "-1", "(0, inf)"),
                                 ("--lr", "0", "(0, inf)"), ("--lr", "inf", "(0, inf)"),
                                 ("--min-lr", "-1", "[0, inf)"),
                                 ("--adam-eps", "0", "(0, inf)"),
                                 ("--adam-eps", "1e-50", "single precision"),
                                 ("--beta2", "0.9999999999", "single precision"),
                                 ("--beta1", "1", "[0, 1)"), ("--beta2", "-3", "[0, 1)"),
                                 ("--beta2", "nan", "[0, 1)"),
                                 ("--weight-decay", "-0.1", "[0, inf)"),
                                 ("--grad-clip", "-1", "[0, inf)"),
                                 ("--warmup-steps", "-1", "[0,"),
                                 ("--steps", "0", "[1,"),
                                 ("--steps", "99999999999999999999999", "[1,"),
                                 ("--steps", "abc", "[1,"),
                                 ("--batch", "0", "[1,"), ("--micro-batches", "-2", "[1,"),
                                 ("--timeout", "0", "(0, 86400]"), ("--pp", "0", "[1,"),
                                 ("--tp", "0", "[1,"),
                                 ("--seq", "-1", "[0,"), ("--eval-every", "-1", "[0,"),
                                 ("--checkpoint-every", "-5", "[0,"),
                                 ("--seed", "-1", "[0,"),
                                 ("--capacity-factor", "0", "(0, inf)"),
                                 ("--capacity-factor", "-1", "(0, inf)"),
                                 ("--capacity-factor", "nan", "(0, inf)"),
                                 ("--capacity-factor", "inf", "(0, inf)")):
        s.expect_error(f"train {flag} {value}", with_flag(train, base, flag, value), flag,
                       allowed)
    # Each in range alone, but the cosine would climb from --lr to --min-lr.
    s.expect_error("train --min-lr above --lr", with_flag(train, base, "--lr", "1e-5") +
                   ["--min-lr", "3e-4"], "--min-lr 0.0003", "--lr 1e-05")
    for value in ("inf", "1e20", "0"):
        s.expect_error(f"bench train --timeout {value}",
                       ["bench", "train", "--preset", "tiny", "--steps", "1", "--timeout", value],
                       "--timeout", "(0, 86400]")


def counts_and_sizes(s, d):
    for flag, value, allowed in (("--timeout", "0", "[1, 86400]"),
                                 ("--timeout", "-5", "[1, 86400]"),
                                 ("--max-bytes", "99999999999G", "--max-bytes"),
                                 ("--max-bytes", "64Q", "K, M, G, T"),
                                 ("--min-bytes", "-1", "--min-bytes"),
                                 ("--factor", "1", "[2,"), ("--iters", "-1", "[0,"),
                                 ("--turn-blocks", "0", "[1,"),
                                 ("--ops", "allreduce,allgatter", "'allgatter'"),
                                 ("--ops", ",", "no collective")):
        # Small sizes and one call each: on a tree that accepted the flag this runs, briefly.
        base = {"--ops": "allreduce", "--max-bytes": "1K", "--iters": "1", "--warmup": "0"}
        s.expect_error(f"bench collectives {flag} {value}",
                       with_flag(["bench", "collectives"], base, flag,
                                 value), flag, allowed)
    # A run's flags from a file (--run-config) are held to the same rules as the command line.
    for name, text, needles in (
            ("misspelt.json", '{"gruop": 8}', ("--run-config", "rl.gruop", "names no flag")),
            ("misspelt.toml", 'gruop = 8\n', ("--run-config", "rl.gruop", "names no flag")),
            ("range.toml", 'group = 0\n', ("--group", "[1,")),
            ("nested.json", '{"group": {"a": 1}}', ("group", "not object")),
            ("broken.json", '{"group": 8', ("--run-config", "JSON"))):
        path = os.path.join(d, name)
        with open(path, "w") as f:
            f.write(text)
        s.expect_error(f"rl --run-config {name}", ["rl", "--run-config", path], *needles)
    # The trainer's ranks: checked before any process connects.
    for extra, needles in ((["--trainers", "0"], ("--trainers", "[1,")),
                           (["--trainer-dp-mode", "zero9"],
                            ("'zero9'", "ddp, zero1, zero2 or fsdp")),
                           (["--trainers", "2", "--sft-batch", "31"],
                            ("--sft-batch 31", "2 data-parallel ranks")),
                           (["--trainers", "2", "--trainer-tp", "3"],
                            ("--trainer-tp 3", "does not divide --trainers 2")),
                           (["--trainers", "2", "--trainer-ep", "3"],
                            ("--trainer-ep 3", "data-parallel size 2")),
                           (["--preset", "tiny", "--trainers", "8", "--trainer-tp", "8",
                             "--sft-batch", "32"], ("--trainer-tp", "num_heads 4")),
                           (["--trainers", "4", "--trainer-tp", "2", "--trainer-ep", "4"],
                            ("--trainer-ep 4", "data-parallel size 2")),
                           (["--trainer-ep", "0"], ("--trainer-ep", "[1,")),
                           (["--capacity-factor", "0"], ("--capacity-factor", "(0, inf)")),
                           (["--capacity-factor", "nan"], ("--capacity-factor", "(0, inf)")),
                           (["--preset", "tiny", "--trainers", "4", "--trainer-pp", "4"],
                            ("--trainer-pp 4", "the model has 2")),
                           (["--trainers", "3", "--trainer-pp", "2"],
                            ("--trainer-tp x --trainer-pp = 2", "does not divide --trainers 3")),
                           (["--trainers", "2"], ("at least 3 processes", "--trainers 2", "has 1")),
                           (["--preset", "tiny", "--rollout-tp", "3"],
                            ("--rollout-tp 3", "num_heads 4")),
                           (["--rollout-tp", "2"], ("--rollout-tp 2", "at least 3 processes")),
                           (["--preset", "tiny", "--rollout-ep", "3"],
                            ("--rollout-ep 3", "does not divide the model's 4 experts")),
                           (["--rollout-ep", "2", "--rollout-tp", "2"],
                            ("--rollout-tp x --rollout-ep = 4", "at least 5 processes")),
                           (["--rollout-ep", "0"], ("--rollout-ep", "[1,")),
                           (["--rollout-slots", "-1"], ("--rollout-slots", "[0,")),
                           (["--join", "--rollout-ep", "2"], ("--rollout-ep 2", "one process")),
                           (["--join"], ("--join", "WEIGHTLIFT_JOB_TOKEN is not set")),
                           (["--join", "--rollout-tp", "2"], ("--rollout-tp 2", "one process"))):
        s.expect_error("rl " + " ".join(extra), ["rl"] + extra, *needles,
                       env={"WEIGHTLIFT_JOB_TOKEN": ""})
    fifo = os.path.join(d, "run_config_fifo")
    os.mkfifo(fifo)
    s.expect_error("rl --run-config a FIFO", ["rl", "--run-config", fifo], "--run-config",
                   "FIFO", timeout=10)
    for flag, value, allowed in (("--model-link-gbps", "nan", "(0, 1000000]"),
                                 ("--model-reduce-gbps", "inf", "(0, 1000000]"),
                                 ("--model-alpha-us", "1e308", "[0, 1000000]"),
                                 ("--model-segment", "2T", "[1, 1G]")):
        s.expect_error(f"bench collectives --model {flag} {value}",
                       ["bench", "collectives", "--model", flag, value], flag, allowed)
    for flag, value, allowed in (("--timeout", "0", "[1, 86400]"), ("--trainers", "0", "[1,"),
                                 ("--updates", "0", "[1,"),
                                 ("--watermark-bytes", "-1", "bytes"),
                                 ("--bucket-bytes", "12X", "K, M, G, T")):
        s.expect_error(f"bench transfer {flag} {value}",
                       ["bench", "transfer", "--preset", "tiny", "--ranks", "threads",
                        "--memcpy-bytes", "1M", flag, value], flag, allowed)
    for flag, value, allowed in (("--senders", "0", "[1, 1024]"), ("--bytes", "0", "[1, 1G]"),
                                 ("--puts", "-5", "[1,"), ("--window", "0", "[1,")):
        s.expect_error(f"bench puts {flag} {value}", ["bench", "puts", flag, value], flag,
                       allowed)
    for flag, value, allowed in (("--trainers", "0", "[1,"), ("--receivers", "-2", "[1,"),
                                 ("--tp", "0", "[1,"), ("--mesh-size", "-1", "[0,")):
        s.expect_error(f"transfer plan {flag} {value}", ["transfer", "plan", flag, value], flag,
                       allowed)
    for flag, value, allowed in (("--nic-gbps", "0", "(0, inf)"),
                                 ("--nic-gbps", "nan", "(0, inf)"),
                                 ("--barrier-ms", "-1", "[0, inf)"),
                                 ("--trainers", "-256", "[1,")):
        s.expect_error(f"transfer simulate {flag} {value}", ["transfer", "simulate", flag, value],
                       flag, allowed)
    for value in ("0", "100000"):
        s.expect_error(f"launch -n {value}", ["launch", "-n", value, "--", "true"], "--nprocs",
                       "[1, 1024]")
    s.expect_error("launch --master-port 70000",
                   ["launch", "-n", "1", "--master-port", "70000", "--", "true"],
                   "--master-port", "[0, 65535]")
    s.expect_error("bench train --batch 0", ["bench", "train", "--preset", "tiny", "--seq", "16", "--batch", "0"],
                   "--batch", "[1,")


def recovery(s, d):
    """train --recovery: a strategy the layout cannot take, and failure drills that make no
    sense, are refused before any process waits for another."""
    import json

    def config(name, **changes):
        c = dict(TINY, **changes)
        path = os.path.join(d, name)
        with open(path, "w") as f:
            json.dump(c, f)
        return path

    four, three = config("four.json", num_layers=4), config("three.json", num_layers=3)
    tied = config("tied.json", num_layers=4, tie_embeddings=True)
    run = ["train", "--batch", "4", "--seq", "16", "--quiet", "--out", os.path.join(d, "ft")]
    for label, flags, needles in (
            ("an unknown strategy", ["--config", four, "--pp", "4", "--recovery", "checkfre"],
             ("checkfre", "checkfree+")),
            ("checkfree on 2 stages", ["--preset", "tiny", "--pp", "2", "--recovery",
                                       "checkfree"], ("--recovery", "at least 3 stages")),
            ("checkfree+ on 3 stages", ["--config", three, "--pp", "3", "--recovery",
                                        "checkfree+"], ("--recovery", "at least 4 stages")),
            ("stages that do not divide the layers", ["--config", four, "--pp", "3",
                                                      "--recovery", "checkfree"],
             ("--pp 3", "4 layers")),
            ("checkfree+ with odd micro-batches", ["--config", four, "--pp", "4",
                                                   "--micro-batches", "1", "--recovery",
                                                   "checkfree+"], ("--micro-batches", "even")),
            ("with --tp", ["--config", four, "--pp", "4", "--tp", "2", "--recovery",
                           "checkfree"], ("--recovery with --tp 2",)),
            ("with --dp-mode fsdp", ["--config", four, "--pp", "4", "--dp-mode", "fsdp",
                                     "--recovery", "checkfree"], ("--dp-mode fsdp",)),
            ("with tied embeddings", ["--config", tied, "--pp", "4", "--recovery", "checkfree"],
             ("tied embeddings",)),
            ("with f16", ["--config", four, "--pp", "4", "--precision", "f16", "--recovery",
                          "checkfree"], ("f16", "bf16")),
            ("with --pp-schedule 1f1b", ["--config", four, "--pp", "4", "--pp-schedule", "1f1b",
                                         "--recovery", "checkfree"], ("GPipe", "--pp-schedule")),
            ("a kill at iteration 0", ["--config", four, "--pp", "4", "--recovery", "checkfree",
                                       "--kill", "0:1"], ("--kill", "[1,")),
            ("a kill of no stage", ["--config", four, "--pp", "4", "--recovery", "checkfree",
                                    "--kill", "3:9"], ("--kill 3:9", "no stage of --pp 4")),
            ("a freeze without a colon", ["--config", four, "--pp", "4", "--recovery",
                                          "checkfree", "--freeze", "3"],
             ("--freeze '3'", "ITERATION:STAGE")),
            ("--fail-prob 1.5", ["--config", four, "--pp", "4", "--recovery", "checkfree",
                                 "--fail-prob", "1.5"], ("--fail-prob", "[0, 1]")),
            ("--lr-scale 0", ["--config", four, "--pp", "4", "--recovery", "checkfree",
                              "--lr-scale", "0"], ("--lr-scale", "(0, inf)")),
            ("--fail-prob without --recovery", ["--config", four, "--pp", "4", "--fail-prob",
                                                "0.1"], ("--fail-prob", "need --recovery")),
            ("one process for 4 stages", ["--config", four, "--pp", "4", "--recovery",
                                          "checkfree"], ("start --pp 4 processes, not 1",))):
        s.expect_error(f"train --recovery: {label}", run + flags, *needles)


def messages(s, d):
    s.expect_error("unknown subcommand", ["trian"], "trian", "train")
    s.expect_error("unknown subcommand of transfer", ["transfer", "plna"], "plna", "simulate")
    s.expect_error("no subcommand", [], "subcommand", "train")
    s.expect_error("unknown flag", ["model-info", "--presett", "tiny"], "--presett")
    s.expect_error("a flag without its value", ["model-info", "--preset"], "--preset")
    s.expect_error("control characters in a preset name",
                   ["model-info", "--preset", "evil\x1b[31m\nred\x07"], "\\x1b", "\\x0a",
                   forbidden=("\x1b",))
    s.expect_error("control characters in a file name",
                   ["model-info", "--config", os.path.join(d, "no\rsuch\x1b[2J.json")], "\\x0d")


def layouts(s, d):
    """model-info's per-rank table: a layout the model cannot take is named, not planned."""
    s.expect_error("model-info --pp past the layers", ["model-info", "--preset", "tiny", "--pp",
                                                       "99"], "--pp 99", "layers")
    s.expect_error("model-info --dp-mode zero3", ["model-info", "--dp-mode", "zero3"],
                   "--dp-mode", "ddp, zero1, zero2 or fsdp")
    s.expect_error("model-info --dp 0", ["model-info", "--dp", "0"], "--dp", "[1, 1048576]")
    s.expect_error("model-info --ep that does not divide --dp",
                   ["model-info", "--preset", "tiny", "--dp", "2", "--ep", "4"], "--ep 4",
                   "data-parallel size 2")
    s.expect_error("model-info --ep that does not divide the experts",
                   ["model-info", "--preset", "tiny", "--dp", "3", "--ep", "3"], "--ep 3",
                   "4 experts")
    s.expect_error("model-info --tp that does not divide the heads",
                   ["model-info", "--preset", "small", "--tp", "3"], "--tp", "num_heads 8")
    s.expect_error("model-info activations: rows that do not divide",
                   ["model-info", "--preset", "tiny", "--dp", "3", "--batch", "8"],
                   "--batch 8", "3 data-parallel ranks")
    s.expect_error("model-info activations: --seq past the model",
                   ["model-info", "--preset", "tiny", "--batch", "8", "--seq", "999"],
                   "--seq 999", "128 positions")
    s.expect_error("model-info --pp-schedule zigzag",
                   ["model-info", "--preset", "tiny", "--pp", "2", "--pp-schedule", "zigzag"],
                   "--pp-schedule 'zigzag'", "1f1b, gpipe or zb")
    _, _, batch = write_tiny_model(d)
    s.expect_error("train --pp-schedule zb with --dp-mode zero2",
                   ["train", "--preset", "tiny", "--batch-file", batch, "--batch", "2", "--seq",
                    "8", "--pp", "2", "--pp-schedule", "zb", "--dp-mode", "zero2", "--out",
                    os.path.join(d, "zb")],
                   "--pp-schedule zb", "--dp-mode zero2")
    s.expect_error("train --ep past the ranks",
                   ["train", "--preset", "tiny", "--batch-file", batch, "--batch", "1", "--seq",
                    "8", "--ep", "2", "--out", os.path.join(d, "ep")],
                   "--ep 2", "data-parallel size 1")
    code, _, err = s.run([s.exe, "train", "--preset", "tiny", "--batch-file", batch, "--batch", "1",
                          "--seq", "8", "--ep", "2", "--out", os.path.join(d, "ep")])
    s.report("train --ep past the ranks does not blame the batch file", err.strip(),
             [] if code != 0 and "--batch-file" not in err else [f"exit {code}: {err}"])
    s.expect_error("train --tp past the ranks",
                   ["train", "--preset", "tiny", "--batch-file", batch, "--batch", "1", "--seq",
                    "8", "--tp", "2", "--out", os.path.join(d, "tp")],
                   "--tp 2", "does not divide the 1 ranks")
    s.expect_error("train --batch-file whose rows do not divide the micro-batches",
                   ["train", "--preset", "tiny", "--batch-file", batch, "--batch", "1", "--seq",
                    "8", "--micro-batches", "2", "--out", os.path.join(d, "mb")],
                   "--batch-file", "holds 1 rows", "2 micro-batches")


def main():
    s = Suite(sys.argv[1], tempfile.mkdtemp(prefix="wl-bad-flags-"))
    for group in (sampling, threads, optimizer, counts_and_sizes, messages, layouts, recovery):
        with tempfile.TemporaryDirectory(dir=s.scratch) as d:
            s.scratch_case = d
            group(s, d)
    os.rmdir(s.scratch)
    s.finish()


if __name__ == "__main__":
    main()
