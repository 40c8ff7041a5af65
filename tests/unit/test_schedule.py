"""Learning-rate multipliers by hand."""

import pytest

from grpo.engine.schedules import lr_lambda


def test_warmup_then_cosine_linear_and_constant():
    cos = lr_lambda(10, 110, "cosine")
    assert cos(0) == pytest.approx(0.1) and cos(9) == pytest.approx(1.0)
    assert cos(10) == pytest.approx(1.0)
    assert cos(60) == pytest.approx(0.5)  # half way through the decay
    assert cos(110) == pytest.approx(0.0, abs=1e-12)
    assert lr_lambda(0, 100, "linear")(25) == pytest.approx(0.75)
    assert lr_lambda(5, 100, "constant")(50) == 1.0
