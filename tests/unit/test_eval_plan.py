"""Which models the evaluate stage evaluates, and which copy an evaluation of the same weights."""

from tasks.stages import PASS_K_MODELS, plan_evaluations


def test_same_weights_reuse_the_sampled_models_evaluation_and_the_sampled_go_first():
    # the control chose step 0 (the reference's weights), GRPO its last step
    digests = {"reference": "r", "grpo": "g", "sft_continued": "r", "grpo_last": "g",
               "sft_continued_last": "c"}  # fmt: skip
    plan = plan_evaluations(digests, PASS_K_MODELS)
    assert plan == {"reference": None, "grpo": None, "sft_continued": "reference",
                    "grpo_last": "grpo", "sft_continued_last": None}  # fmt: skip
    # evaluated in this order: the sampled (longest) first, then the rest as given
    assert [m for m, same in plan.items() if same is None] == [
        "reference", "grpo", "sft_continued_last"]  # fmt: skip


def test_a_sampled_model_never_copies_an_evaluation_without_pass_k():
    # the champion has no pass@k; GRPO with the same weights is evaluated with it
    plan = plan_evaluations({"champion": "x", "grpo": "x"}, ("grpo",))
    assert plan == {"grpo": None, "champion": "grpo"}
    # two sampled models with one set of weights: the second copies the first, pass@k included
    assert plan_evaluations({"grpo": "x", "sft_continued": "x"}, PASS_K_MODELS) == {
        "grpo": None, "sft_continued": "grpo"}  # fmt: skip
    # nothing shared: every model evaluated, none copied
    assert set(plan_evaluations({"a": "1", "b": "2"}, ()).values()) == {None}


def test_sampled_pass_k_draws_from_every_part_of_a_set_built_generator_by_generator():
    from grpo.eval.run import pass_k_rows

    rows = [{"id": f"{g}-{i}", "generator": g} for g in ("a", "b", "c", "d") for i in range(50)]
    picked = pass_k_rows(rows, 40, seed=0)
    assert len(picked) == 40 and len({r["id"] for r in picked}) == 40
    assert {r["generator"] for r in picked} == {"a", "b", "c", "d"}  # the first 40 are all "a"
    assert [rows.index(r) for r in picked] == sorted(rows.index(r) for r in picked)  # set order
    assert picked == pass_k_rows(rows, 40, seed=0)  # the same problems for every model
    assert picked != pass_k_rows(rows, 40, seed=1)
