"""The plain answer each report opens with (eval/answer.py), on hand-made studies: what to
serve, by how much, the commands that serve it, and where the load cannot say."""

from __future__ import annotations

import pytest

from agents.summary import run_answer, summary_text
from envs.scenario import Scenario
from eval.answer import load_answer, pick, serve_commands, unseparated
from eval.capacity import CapacityResult, CapacityStudy
from eval.compare import Comparison
from eval.harness import PolicyResult, paired_verdict

SC = Scenario()  # h100-sxm + llama-3-8b, TTFT 2 s / ITL 100 ms
RUN = "runs/demo"
LEARNED = f"model:{RUN}"


def res(name, kind, serving, *per):
    return CapacityResult(name, kind, tuple(per), (), serving=serving)


def study(learned, teacher, fixed=(6.0, 6.5, 7.0)):
    """The final comparison's serving study: the best fixed budget 2,896 and a cliff above it."""
    rungs = {2435: res("static:2435", "static", ("budget", "2435"), 5.8, 6.2, 6.6),
             2896: res("static:2896", "static", ("budget", "2896"), *fixed),
             3444: res("static:3444", "static", ("budget", "3444"), 2.9, 3.0, 3.1)}
    policies = {LEARNED: res(LEARNED, "learned", ("model", RUN), *learned),
                "time-budget-deadline:16": res("time-budget-deadline:16", "rule",
                                               ("rule", "time-budget-deadline:16"), *teacher),
                "vllm-default": res("vllm-default", "default", ("default", "8192"), 2.0, 2.1, 2.2)}
    return CapacityStudy(SC, policies, rungs)


def first_line(studies):
    answer = run_answer(studies, LEARNED, "time-budget-deadline:16")
    text = summary_text("demo", "h100-sxm + llama-3-8b", {}, None, [], studies, LEARNED,
                        {"shares": {"1": 0.9, "16": 0.1}, "passes": 100}, answer)
    return text.splitlines()[2], answer


def test_a_win_names_what_to_serve_by_how_much_and_the_commands():
    # The learned policy 10% ahead of the fixed budget on every stream, and 4.8% ahead of
    # its teacher (1.10/1.05 - 1 on each): serve it, as a table.
    line, answer = first_line({"serving": study((6.6, 7.15, 7.7), (6.3, 6.825, 7.35))})
    assert line.startswith("**Serve the learned policy (as a table): 10.0% more requests/s than the "
                           "best fixed budget (2,896 tokens) under TTFT 2 s / ITL 100 ms, on 3 "
                           "held-out streams (+10.0% ± 0.0%).")
    assert "The learning added 4.8% capacity to the rule it started from, time-budget-deadline:16" in line
    assert answer.commands == (
        f"python -m eval export {RUN} --out {RUN}/table.json",
        f"python -m policies.table check {RUN}/table.json --hardware h100-sxm --model llama-3-8b "
        "--slo-ttft-s 2 --slo-itl-s 0.1",
        f"CHUNKPILOT_TABLE={RUN}/table.json vllm serve meta-llama/Meta-Llama-3-8B-Instruct "
        "--scheduler-cls policies.vllm_scheduler.AsyncTableScheduler --max-num-batched-tokens 16384")


def test_a_tie_with_the_teacher_serves_the_teacher_and_says_the_learning_added_nothing():
    # Both 5% ahead of the fixed budget; the learned policy 0.5% ahead of its teacher on two
    # streams and 0.5% behind on the third: a tie, so the simpler rule is served.
    line, answer = first_line({"serving": study((6.3, 6.825, 7.35), (6.2685, 6.7909, 7.3868))})
    assert line.startswith("**Serve time-budget-deadline:16: 4.8% more requests/s")  # 6.2685 / 6 ... 7.3868 / 7
    assert "The learned policy ties the rule it started from, time-budget-deadline:16" in line
    assert "the learning added nothing you can count on" in line
    assert ("(+4.8% ± 1.5%). The learned policy (as a table) is further ahead of the fixed budget "
            "(+5.0%) but not beyond the interval against time-budget-deadline:16") in line
    assert answer.commands[0] == ("python -m eval export --rule time-budget-deadline:16 --hardware "
                                  "h100-sxm --model llama-3-8b --slo-ttft-s 2 --slo-itl-s 0.1 --out "
                                  "tables/h100-sxm__llama-3-8b__time-budget-deadline-16.json")


def test_a_clone_that_serves_as_its_rule_is_not_said_to_be_further_ahead():
    line, _ = first_line({"serving": study((6.3, 6.825, 7.35), (6.3, 6.825, 7.35))})
    assert line.startswith("**Serve time-budget-deadline:16: 5.0% more requests/s")
    assert "further ahead" not in line


def test_a_loss_serves_the_fixed_budget():
    # Nothing beats the fixed budget beyond the interval: set it, and say how close the
    # closest policy came; the learned policy behind its teacher on every stream.
    line, answer = first_line({"serving": study((5.7, 6.2, 6.6), (6.0, 6.6, 6.9))})
    assert line.startswith("**No gain you can count on over a fixed 2,896 tokens: set "
                           "`--max-num-batched-tokens 2896` (6.50 ± 1.24 req/s under TTFT 2 s / ITL "
                           "100 ms, on 3 held-out streams). The closest policy, "
                           "time-budget-deadline:16, is ")
    assert "The learned policy serves less than the rule it started from" in line
    assert answer.commands == ("vllm serve meta-llama/Meta-Llama-3-8B-Instruct "
                               "--max-num-batched-tokens 2896",)


def test_where_no_fixed_budget_serves_the_policy_that_does_is_named():
    s = study((0.5, 0.6, 0.7), (0.0, 0.0, 0.0), fixed=(0.0, 0.0, 0.0))
    s.rungs = {b: res(r.policy, "static", r.serving, 0.0, 0.0, 0.0) for b, r in s.rungs.items()}
    s.policies["vllm-default"] = res("vllm-default", "default", ("default", "8192"), 0.0, 0.0, 0.0)
    line, _ = first_line({"serving": s})
    assert line.startswith("**Serve the learned policy (as a table): it meets TTFT 2 s / ITL 100 ms "
                           "(0.60 ± 0.25 req/s on 3 held-out streams) where no fixed budget does")
    assert ("The learned policy meets the SLO where the rule it started from, time-budget-deadline:16, "
            "does not on the serving scenario (serves 3 streams where the reference serves nothing)") in line


def test_the_simplest_policy_the_leader_does_not_beat_is_served():
    per = {"table:t": [1.2, 1.22, 1.18], "rule": [1.19, 1.2, 1.2], "static:2000": [1.05, 1.06, 1.04]}
    verdicts = {n: paired_verdict(p, [1.0, 1.0, 1.0]) for n, p in per.items()}
    servings = {"table:t": ("table", "t"), "rule": ("rule", "r"), "static:2000": ("budget", "2000")}
    # The fixed 2,000 is the simplest and beats the ladder's best, but the table beats it
    # in turn; the rule ties the table: the rule.
    assert pick(verdicts, per, servings) == "rule"
    assert pick({n: paired_verdict([1.0] * 3, [1.0] * 3) for n in per}, per, servings) is None
    # Without the rule, the table, though a fixed number beats the ladder too.
    del per["rule"], verdicts["rule"]
    assert pick(verdicts, per, servings) == "table:t"
    assert serve_commands(SC.with_fields(model="llama-3-70b-tp4"), ("budget", "724")) == (
        "vllm serve meta-llama/Meta-Llama-3-70B-Instruct --tensor-parallel-size 4 "
        "--max-num-batched-tokens 724",)


def run(goodput, ttft, itl):
    return {"goodput": goodput, "ttft_p99_s": ttft, "itl_p99_s": itl, "slo_ttft_s": 2.0,
            "slo_itl_s": 0.1}


def comparison(policies, ladder):
    return Comparison(SC, {n: PolicyResult(n, k, runs, serving) for n, (k, serving, runs) in policies.items()},
                      {b: PolicyResult(f"static:{b}", "static", runs, ("budget", str(b)))
                       for b, runs in ladder.items()})


def test_a_load_that_does_not_separate_the_policies_says_so_and_points_near_capacity():
    # At light load every budget serves every request within TTFT and TPOT; 16,384 and
    # vLLM's default stall running users past the p99 ITL target.
    light = [run(1.0, 0.9, 0.09)] * 2
    cmp = comparison({"vllm-default": ("default", ("default", "8192"), [run(1.0, 0.9, 0.22)] * 2),
                      "time-budget": ("rule", ("rule", "time-budget"), light)},
                     {2896: light, 16384: [run(1.0, 0.8, 0.358)] * 2})
    assert cmp.best_static()[0] == 2896 and unseparated(cmp)
    text = load_answer(cmp, 5.2, 1.3).text  # the best fixed budget's capacity: 1.3 times 4 req/s
    assert text.startswith("At 4 req/s, every policy that meets p99 TTFT 2 s / ITL 100 ms on every "
                           "stream serves 99% of requests or more within their targets: this load "
                           "does not separate them. vllm-default breaks p99 TTFT or ITL on some stream.")
    assert text.endswith("capacity under the SLO is about 5.2 req/s: compare near it (`--rate 4.94`), "
                         "or run `python -m eval capacity` with the same flags.")
    # Past capacity: nobody meets the p99 targets on any stream.
    heavy = [run(0.4, 9.0, 0.3)] * 2
    past = comparison({"time-budget": ("rule", ("rule", "time-budget"), heavy)}, {2896: heavy})
    assert unseparated(past) and load_answer(past).text.startswith(
        "No policy and no fixed budget meets p99 TTFT 2 s / ITL 100 ms on any stream at 4 req/s: "
        "the load is past capacity. Find where they part with `python -m eval capacity`")


def test_at_a_load_that_separates_them_the_goodput_winner_that_meets_the_slo_is_served():
    best = [run(0.90, 1.5, 0.09), run(0.80, 1.6, 0.09)]
    cmp = comparison({"time-budget-deadline-kv": ("rule", ("rule", "time-budget-deadline-kv"),
                                                  [run(0.99, 1.2, 0.095), run(0.88, 1.4, 0.098)]),
                      "table:big": ("table", ("table", "big"), [run(1.0, 0.5, 0.4), run(1.0, 0.5, 0.4)])},
                     {2896: best, 16384: [run(1.0, 0.4, 0.5)] * 2})
    assert not unseparated(cmp)
    a = load_answer(cmp)
    # +10% on each stream (0.99/0.90, 0.88/0.80); table:big breaks p99 ITL and is not named.
    assert a.text.startswith("Serve time-budget-deadline-kv: goodput 0.935 against 0.850 for the best "
                             "fixed budget that meets the p99 targets (2,896 tokens), at 4 req/s under "
                             "TTFT 2 s / ITL 100 ms, on 2 streams (+10.0% ± 0.0%). table:big breaks")
    assert a.commands[0].startswith("python -m eval export --rule time-budget-deadline-kv")


@pytest.mark.parametrize("kind, what, first, served", [
    ("budget", "2896", "vllm serve", ""),
    ("default", "8192", "vllm serve", ""),
    ("table", "tables/x.json", "python -m policies.table check tables/x.json", "tables/x.json"),
    ("rule", "time-budget", "python -m eval export --rule time-budget",
     "tables/h100-sxm__llama-3-8b__time-budget.json"),
    ("model", RUN, f"python -m eval export {RUN} --out {RUN}/table.json", f"{RUN}/table.json")])
def test_every_way_of_serving_ends_in_a_vllm_serve_line(kind, what, first, served):
    commands = serve_commands(SC, (kind, what))
    assert commands[0].startswith(first)
    assert commands[-1].startswith(f"CHUNKPILOT_TABLE={served} vllm serve " if served else "vllm serve ")
    if served:  # a table is checked against the deployment before it is served
        assert f"python -m policies.table check {served} --hardware h100-sxm" in commands[-2]


def test_commands_name_the_served_model_and_the_engine_settings_a_table_is_built_for():
    sc = SC.with_fields(model="qwen2.5-32b", per_pass_overhead_s=0.003, max_num_seqs=128)
    export, check, serve = serve_commands(sc, ("rule", "time-budget-deadline-kv:4"))
    assert export == ("python -m eval export --rule time-budget-deadline-kv:4 --hardware h100-sxm "
                      "--model qwen2.5-32b --slo-ttft-s 2 --slo-itl-s 0.1 --per-pass-overhead-s 0.003 "
                      "--max-num-seqs 128 --out tables/h100-sxm__qwen2.5-32b__time-budget-deadline-kv-4.json")
    assert serve.split(" --scheduler-cls")[0].endswith(
        "vllm serve Qwen/Qwen2.5-32B-Instruct --max-num-seqs 128")
    assert serve_commands(SC.with_fields(model="llama-3-8b-q4"), ("budget", "362"))[0].startswith(
        "vllm serve MODEL ")


def test_a_winner_no_table_holds_is_named_beside_the_fixed_budget():
    s = study((6.0, 6.5, 7.0), (6.0, 6.5, 7.0))
    s.policies["time-budget-kv"] = res("time-budget-kv", "rule", None, 6.6, 7.15, 7.7)
    line, answer = first_line({"serving": s})
    assert line.startswith("**No gain you can count on over a fixed 2,896 tokens")
    assert "time-budget-kv beats it (+10.0% ± 0.0%), but no table holds it" in line
    assert answer.commands[0].endswith("--max-num-batched-tokens 2896")


def test_the_learning_sentence_when_one_stream_cannot_judge():
    from agents.summary import learning_sentence

    from eval.harness import paired_verdict as v
    text = learning_sentence({"serving": ("time-budget-deadline:16", v([1.1], [1.0]))})
    assert text.startswith("Against the rule it started from, time-budget-deadline:16, the learned "
                           "policy is not judged: +10.0%, one stream: no interval (raise --final-seeds).")


def test_a_policy_cloned_from_each_conditions_own_teacher_is_not_said_to_start_from_one_rule():
    from agents.summary import learning_sentence, mixed_start

    from eval.harness import paired_verdict as v
    verdicts = {"serving": ("time-budget-deadline-kv:16", v([0.9, 0.95, 0.92], [1.0, 1.0, 1.0]))}
    text = learning_sentence(verdicts, mixed_start({}))
    assert text.startswith("The learned policy serves less than the best fixed choice overall (each "
                           "training condition was cloned from its own), time-budget-deadline-kv:16 (")
    assert "started from" not in text
    given = learning_sentence(verdicts, mixed_start({"teacher_given": True}))
    assert given.startswith("The learned policy serves less than the given teacher overall (each")


def test_a_smoke_run_gives_no_answer_to_act_on():
    a = run_answer({"serving": study((6.6, 7.15, 7.7), (6.3, 6.825, 7.35))}, LEARNED, None,
                   ["A smoke run: 8 training conditions."])
    assert a.text == "Not an answer to act on: A smoke run: 8 training conditions." and not a.commands
