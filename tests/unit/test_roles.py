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


VERSION = {"name": "m", "version": "3"}
# (key, who may set it: roles, and whether only the version's registrant) for every reserved kind
RESERVED = [
    ("registered_by", set(), False),
    ("promoted_by", set(), False),
    ("gate/decision", {"trainer", "approver"}, True),
    ("gate/vs_reference/diff", {"trainer", "approver"}, True),
    ("approval/by", {"trainer", "approver"}, True),
    ("promotion", {"trainer", "approver"}, True),
    ("manual/champion", {"approver"}, False),
]


@pytest.mark.parametrize("role", ORDER)
@pytest.mark.parametrize("key,setters,own_only", RESERVED)
def test_reserved_version_tags_are_written_only_by_whom_they_name(role, key, setters, own_only):
    set_tag, delete_tag = f"{API}/model-versions/set-tag", f"{API}/model-versions/delete-tag"
    args = {**VERSION, "key": key, "value": "x"}
    for registrant in ("alice", "bob", None):
        why = refusal(role, "POST", set_tag, args, user="alice", registrant=registrant)
        may = role == "admin" or (role in setters and (not own_only or registrant == "alice"))
        assert (why is None) == may, (role, key, registrant, why)
        if why is not None and role != "reader":
            assert "reserved" in why and key in why, why
        # deleting a reserved tag is the admin's alone, whoever registered the version
        gone = refusal(role, "DELETE", delete_tag, args, user="alice", registrant=registrant)
        assert (gone is None) == (role == "admin"), (role, key, gone)
    # a tag of the trainer's own stays allowed, set and deleted, on anyone's version
    mine = {**VERSION, "key": "note", "value": "x"}
    assert (refusal(role, "POST", set_tag, mine, user="alice", registrant="bob") is None) == (
        role != "reader"
    )
    assert (refusal(role, "DELETE", delete_tag, mine, user="a", registrant="b") is None) == (
        role != "reader"
    )


@pytest.mark.parametrize("role", ["trainer", "approver"])
def test_a_version_cannot_be_created_with_the_servers_tags(role):
    create = f"{API}/model-versions/create"
    forged = {"name": "m", "tags": [{"key": "registered_by", "value": "someone-else"}]}
    assert "only the server writes" in refusal(role, "POST", create, forged, user="a")
    evidence = {"name": "m", "tags": [{"key": "gate/decision", "value": "promoted"}]}
    assert refusal(role, "POST", create, evidence, user="a") is None  # its own registration
