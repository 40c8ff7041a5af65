"""reasoning-gym as a task source: disjoint splits at distinct seeds, the sizes asked for, the
generator's checker as a TRL-style reward on hand-made completions, and the errors a config
meets."""

import re

import pytest

pytest.importorskip("reasoning_gym", reason="the real extra (make install-real)")

from grpo.config import ConfigError, load_config  # noqa: E402
from grpo.data import reasoning_gym as rgd  # noqa: E402
from grpo.data.files import DataError  # noqa: E402
from reward_fns import reasoning_gym_exact_reward, reasoning_gym_reward, verdicts  # noqa: E402

MIX = ["data.task=reasoning_gym",
       "data.generators=[{name: chain_sum, config: {max_terms: 3}}, {name: gcd, weight: 2}]",
       "data.num_train=60", "data.num_sft=12", "data.num_sft_val=9", "data.num_select=9",
       "data.num_heldout=15"]  # fmt: skip


def _cfg(*extra):
    return load_config(None, [*MIX, *extra])


def test_the_splits_are_disjoint_sized_by_weight_and_reproducible():
    data = _cfg().data
    sets = rgd.make_sets(data)
    sizes = {k: len(v) for k, v in sets.items()}
    assert sizes == {"heldout:chain_sum": 15, "heldout:gcd": 15, "sft_val": 9, "sft": 12,
                     "train": 60, "select": 9}  # fmt: skip
    # weights 1 : 2 -> a third of each split is chain_sum
    assert sum(r["generator"] == "chain_sum" for r in sets["train"]) == 20
    assert sum(r["generator"] == "gcd" for r in sets["sft"]) == 8
    # no question in two sets (nor twice in one), however the generators repeat
    questions = [r["prompt"] for rows in sets.values() for r in rows]
    assert len(questions) == len(set(questions))
    # an out-of-distribution generator is drawn at a seed of its own, against every set
    ood = rgd.eval_rows("rg:products", data)
    assert len(ood) == 15 and not {r["prompt"] for r in ood} & set(questions)
    # the mix: every generator's held-out set, one of each in turn (its first rows hold both)
    mix = rgd.eval_rows("rg:mix", data)
    assert [r["prompt"] for r in mix[::2]] == [r["prompt"] for r in sets["heldout:chain_sum"]]
    assert [r["prompt"] for r in mix[1::2]] == [r["prompt"] for r in sets["heldout:gcd"]]
    # the same config draws the same sets in a fresh draw (not the cache)
    again = rgd._make_sets.__wrapped__(rgd._key(data))
    assert [r["prompt"] for r in again["train"]] == [r["prompt"] for r in sets["train"]]
    # another data.seed draws other problems
    other = rgd.make_sets(_cfg("data.seed=7").data)
    assert {r["prompt"] for r in other["train"]} != {r["prompt"] for r in sets["train"]}
    # SFT rows show the answer format; RL rows carry no target
    assert sets["sft"][0]["worked_solution"] == f"<answer>{sets['sft'][0]['answer']}</answer>"
    assert "worked_solution" not in sets["train"][0]


def test_every_split_and_generator_has_its_own_seed():
    seeds = {rgd.split_seed(1234, s, j) for s in rgd.SPLITS for j in range(3)}
    assert len(seeds) == len(rgd.SPLITS) * 3
    assert rgd.shares(7, [1.0, 1.0, 1.0]) == [3, 2, 2] and sum(rgd.shares(61, [1, 2, 3])) == 61


def _entry(data, generator):
    return next(r for r in rgd.make_sets(data)["heldout:" + generator])


def test_the_generators_checker_is_a_reward_on_the_extracted_answer():
    row = _entry(_cfg().data, "chain_sum")
    gold = row["answer"]
    completions = [
        f"<think>adding</think><answer>{gold}</answer>",  # tagged
        f"<think>adding</think> {gold}",  # after </think>
        gold,  # the whole completion
        f"<answer>{gold}</answer> and then <answer>999999</answer>",  # the last tag counts
        f"<answer>it is {gold}</answer>",  # inside a longer text: the default partial credit
        "no answer at all",
    ]
    got = reasoning_gym_reward(completions=completions, rg_entry=[row["rg_entry"]] * 6)
    partial = len(gold) / len(f"it is {gold}")
    assert got == pytest.approx([1.0, 1.0, 1.0, 0.0, partial, 0.0])
    # the exact reward keeps only the checker's full marks: no credit for a padded answer
    exact = reasoning_gym_exact_reward(completions=completions, rg_entry=[row["rg_entry"]] * 6)
    assert exact == [1.0, 1.0, 1.0, 0.0, 0.0, 0.0]
    padded = [f"<answer>{gold}{gold[-1]}</answer>"]
    assert reasoning_gym_reward(completions=padded, rg_entry=[row["rg_entry"]]) == [
        pytest.approx(len(gold) / (len(gold) + 1))]  # fmt: skip
    assert reasoning_gym_exact_reward(completions=padded, rg_entry=[row["rg_entry"]]) == [0.0]
    assert reasoning_gym_exact_reward(completions=["x"], rg_entry=[None]) == [None]
    # chat-format completions, and a row of another source (None: not applicable)
    chat = [[{"role": "assistant", "content": f"<answer>{gold}</answer>"}], "x"]
    assert reasoning_gym_reward(completions=chat, rg_entry=[row["rg_entry"], None]) == [1.0, None]
    # correct is a score of 1; leniently, the last line without tags
    assert verdicts([f"<answer>it is {gold}</answer>", f"steps\n{gold}"], [row, row]) == [
        (False, False), (False, True)]  # fmt: skip
    # a math row beside it is judged by math-verify
    assert verdicts(["<answer>3/2</answer>"], [{"answer": "1.5"}]) == [(True, False)]


@pytest.mark.parametrize(
    ("sets", "words"),
    [
        (["data.task=reasoning_gym"], ["data.generators"]),
        (["data.generators=[{name: gcd}]"], ["data.generators", "reasoning_gym"]),
        ([*MIX[:1], "data.generators=[{name: gcd, config: {seed: 3}}]"], ["seed and size"]),
        ([*MIX[:1], "data.generators=[{name: gcd}, {name: gcd}]"], ["named twice"]),
    ],
)
def test_configs_that_cannot_work_are_refused(sets, words):
    with pytest.raises(ConfigError) as e:
        load_config(None, sets)
    for w in words:
        assert w in str(e.value), str(e.value)


def test_an_unknown_generator_or_config_is_one_line_naming_it():
    data = load_config(None, ["data.task=reasoning_gym",
                              "data.generators=[{name: chain_summ}]"]).data  # fmt: skip
    with pytest.raises(DataError, match="'chain_summ' is not a reasoning-gym generator.*chain_sum"):
        rgd.make_sets(data)
    gens = "data.generators=[{name: gcd, config: {min_value: 0}}]"
    data = load_config(None, ["data.task=reasoning_gym", gens]).data
    with pytest.raises(DataError, match="gcd config"):
        rgd.make_sets(data)
    # a generator too narrow for the sizes asked: named with its split
    gens = "data.generators=[{name: gcd, config: {max_value: 5}}]"
    data = load_config(None, ["data.task=reasoning_gym", "data.num_train=500", gens]).data
    with pytest.raises(DataError, match="gcd .* distinct new questions"):
        rgd.make_sets(data)


def test_the_out_of_format_set_asks_the_same_problems_in_other_words():
    """rg:reworded:<name>: each held-out question rewritten by hand-written templates, the same
    numbers and the same gold answer, scored by the generator's own checker; ids kept, so the
    two phrasings pair problem by problem."""
    from grpo.data.rewording import reword

    assert reword("chain_sum", "State the final answer to the following arithmetic problem: "
                  "98 + 93 =") == "Work out 98 + 93 and say what number it comes to."  # fmt: skip
    assert reword("gcd", "Find the Greatest Common Divisor (GCD) of these numbers: 60, 100. "
                  "Give only the GCD as your final answer.") == (
        "Which is the biggest whole number that divides 60 and 100 with no remainder?")  # fmt: skip
    bits = "How many 1 bits are there in the binary representation of the number 638?"
    assert reword("count_bits", bits) == "Write 638 in base 2. How many of its digits are ones?"
    data = _cfg().data
    plain, worded = rgd.eval_rows("rg:mix", data), rgd.eval_rows("rg:reworded:mix", data)
    assert [r["id"] for r in worded] == [r["id"] for r in plain]
    for p, w in zip(plain, worded):
        assert w["prompt"] != p["prompt"] and w["answer"] == p["answer"]
        assert set(re.findall(r"\d+", w["prompt"])) == set(re.findall(r"\d+", p["prompt"]))
    # the reward still grades the same answers: the entry is the generator's own
    row = worded[0]
    good = f"<answer>{row['answer']}</answer>"
    assert reasoning_gym_reward([good, "<answer>-1</answer>"], rg_entry=[row["rg_entry"]] * 2) == [
        1.0, 0.0]  # fmt: skip
    # a generator without a rewording, or a question of another form, is an error, never the
    # original question passed through
    with pytest.raises(DataError, match="no rewording for generator 'spell_backward'"):
        reword("spell_backward", "Spell this word backward: cat")
    with pytest.raises(DataError, match="rg:reworded:gcd: a question does not have the form"):
        reword("gcd", "What is the GCD of 4 and 6?")


LEGS = ["data.task=reasoning_gym", "tools.functions=[calculator]",
        "data.worked_solutions=calculator", "data.num_train=20", "data.num_sft=8",
        "data.num_sft_val=8", "data.num_select=3", "data.num_heldout=40",
        "data.generators=[{name: leg_counting, "
        "config: {min_animals: 2, max_animals: 2}}]"]  # fmt: skip


def test_calculator_demonstrations_pass_the_problems_expression_and_answer_its_result():
    from grpo.env.calculator import calculator
    from grpo.env.render import demo_turns

    sets = rgd.make_sets(load_config(None, LEGS).data)
    for r in sets["sft"] + sets["sft_val"]:
        (call, response, answer) = (t for _, t in demo_turns(r["worked_solution"]))
        animals = r["rg_entry"]["metadata"]["animals"]
        # hand-made from the question: count x legs of each kind, in the question's order
        legs = {"spider": 8, "chicken": 2, "snake": 0, "cow": 4, "woodlouse": 14, "crab": 10}
        expression = re.search(r'"expression": "([^"]+)"', call).group(1)
        terms = expression.split("+")
        assert [int(t.split("*")[0]) for t in terms] == list(animals.values())
        for (name, _), t in zip(animals.items(), terms, strict=True):
            if name in legs:
                assert int(t.split("*")[1]) == legs[name]
        assert response == calculator(expression) == r["answer"]
        assert answer.endswith(f"<answer>{r['answer']}</answer>")
    # a generator without a calculator demonstration is named, before anything is drawn
    gcd = [*LEGS[:-1], "data.generators=[{name: gcd}]"]
    with pytest.raises(DataError, match="gcd has no calculator demonstration.*leg_counting"):
        rgd.make_sets(load_config(None, gcd).data)


def test_the_library_defaults_set_goes_beyond_a_narrower_training_config():
    data = load_config(None, LEGS).data
    sets = rgd.make_sets(data)
    trained = rgd.eval_rows("rg:leg_counting", data)
    beyond = rgd.eval_rows("rg:defaults:leg_counting", data)
    assert trained == sets["heldout:leg_counting"] and len(beyond) == 40
    assert {len(r["rg_entry"]["metadata"]["animals"]) for r in trained} == {2}
    # the library's defaults: 3 to 10 kinds of animal, never the 2 trained on
    kinds = {len(r["rg_entry"]["metadata"]["animals"]) for r in beyond}
    assert min(kinds) >= 3 and max(kinds) > 3
    seen = {r["prompt"] for rows in sets.values() for r in rows}
    assert not seen & {r["prompt"] for r in beyond}
