"""The role check of the served MLflow (infra.roles.refusal), for every role against every
kind of request, without a server: the served end-to-end matrix is in test_serve_tls."""

import pytest

from infra.roles import refusal, role_from

API = "/api/2.0/mlflow"
CHAMPION = {"name": "m", "alias": "champion", "version": "3"}
# (method, path, args, who may): every write a pipeline or a person makes, and reads
REQUESTS = [
    ("GET", f"{API}/experiments/get-by-name", {}, "reader"),
    ("POST", f"{API}/runs/search", {}, "reader"),
    ("POST", "/ajax-api/2.0/mlflow/experiments/search", {}, "reader"),
    ("POST", "/api/3.0/mlflow/traces/search", {}, "reader"),
    ("POST", "/graphql", {}, "reader"),
    ("GET", "/", {}, "reader"),
    ("PATCH", f"{API}/users/update-password", {}, "reader"),
    ("POST", f"{API}/experiments/create", {"name": "x"}, "trainer"),
    ("POST", f"{API}/runs/create", {}, "trainer"),
    ("POST", f"{API}/runs/log-batch", {}, "trainer"),
    ("PUT", "/api/2.0/mlflow-artifacts/artifacts/1/x/model.safetensors", {}, "trainer"),
    ("POST", f"{API}/registered-models/create", {"name": "m"}, "trainer"),
    ("POST", f"{API}/model-versions/create", {"name": "m"}, "trainer"),
    ("POST", f"{API}/model-versions/set-tag", {}, "trainer"),
    ("POST", f"{API}/registered-models/alias", {**CHAMPION, "alias": "challenger"}, "trainer"),
    ("DELETE", f"{API}/registered-models/alias", {"name": "m", "alias": "challenger"}, "trainer"),
    ("POST", f"{API}/registered-models/alias", CHAMPION, "approver"),
    ("POST", "/ajax-api/2.0/mlflow/registered-models/alias", CHAMPION, "approver"),
    ("DELETE", f"{API}/registered-models/alias", {"name": "m", "alias": "champion"}, "approver"),
    ("DELETE", f"{API}/model-versions/delete", {"name": "m", "version": "3"}, "approver"),
    ("DELETE", f"{API}/registered-models/delete", {"name": "m"}, "approver"),
    ("POST", f"{API}/registered-models/rename", {"name": "m"}, "approver"),
]
ORDER = ("reader", "trainer", "approver", "admin")


@pytest.mark.parametrize("role", ORDER)
def test_each_role_may_exactly_what_its_rank_allows(role):
    for method, path, args, least in REQUESTS:
        allowed = ORDER.index(role) >= ORDER.index(least)
        why = refusal(role, method, path, args)
        assert (why is None) == allowed, (role, method, path, why)
        if why is not None:  # the refusal says what the account is and what to do
            assert ("reader" in why) if role == "reader" else ("approver" in why), why


def test_an_account_is_admin_its_highest_role_or_a_reader():
    assert role_from(True, set()) == "admin"
    assert role_from(False, {"trainer", "approver"}) == "approver"
    assert role_from(False, {"trainer", "someone-elses-role"}) == "trainer"
    assert role_from(False, set()) == "reader"
