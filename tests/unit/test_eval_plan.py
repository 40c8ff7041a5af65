"""Which models the evaluate stage evaluates, and which copy an evaluation of the same weights."""

from tasks.stages import PASS_K_MODELS, plan_evaluations


def test_same_weights_reuse_the_sampled_models_evaluation_and_the_sampled_go_first():
    # the control chose step 0 (the reference's weights), GRPO its last step
    digests = {"reference": "r", "grpo": "g", "sft_continued": "r", "grpo_last": "g",
               "sft_continued_last": "c"}  # fmt: skip
    plan = plan_evaluations(digests, PASS_K_MODELS)
    assert plan == {"grpo": None, "sft_continued": None, "reference": "sft_continued",
                    "grpo_last": "grpo", "sft_continued_last": None}  # fmt: skip
    # evaluated in this order: the sampled (longest) first, then the rest as given
    assert [m for m, same in plan.items() if same is None] == [
        "grpo", "sft_continued", "sft_continued_last"]  # fmt: skip


def test_a_sampled_model_never_copies_an_evaluation_without_pass_k():
    # the champion has no pass@k; GRPO with the same weights is evaluated with it
    plan = plan_evaluations({"champion": "x", "grpo": "x"}, ("grpo",))
    assert plan == {"grpo": None, "champion": "grpo"}
    # two sampled models with one set of weights: the second copies the first, pass@k included
    assert plan_evaluations({"grpo": "x", "sft_continued": "x"}, PASS_K_MODELS) == {
        "grpo": None, "sft_continued": "grpo"}  # fmt: skip
    # nothing shared: every model evaluated, none copied
    assert set(plan_evaluations({"a": "1", "b": "2"}, ()).values()) == {None}
