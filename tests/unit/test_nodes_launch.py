"""A node's place in a multi-node run, read from what Slurm or a torchrun-style job sets."""

from __future__ import annotations

import pytest

from grpo.config import load_config
from grpo.launch.runner import NodeError, launcher_command, refuse_node_by_node, this_node


@pytest.fixture
def two_nodes(tmp_path):
    hosts = tmp_path / "hostfile"
    hosts.write_text("# the cluster\nnode-a slots=2\nnode-b slots=2  # second\n")
    return load_config(None, [f"deepspeed.hostfile={hosts}"])


def test_node_rank_and_rendezvous_come_from_the_environment(two_nodes):
    env = {"SLURM_NODEID": "1", "MASTER_PORT": "29611"}
    node = this_node(two_nodes, env)
    assert (node.rank, node.hosts, node.master_addr, node.master_port) == (
        1, ("node-a", "node-b"), "node-a", 29611)  # fmt: skip
    assert node.describe() == "node 1 of 2 (node-b)"
    # NODE_RANK wins over SLURM_NODEID; MASTER_ADDR over the hostfile's first host
    env = {"NODE_RANK": "0", "SLURM_NODEID": "1", "MASTER_ADDR": "10.0.0.5", "MASTER_PORT": "7"}
    assert this_node(two_nodes, env).rank == 0
    cmd = launcher_command(two_nodes, ["-m", "grpo.launch.worker", "train"], env)
    i = cmd.index("--no_ssh")
    assert cmd[i : i + 5] == ["--no_ssh", "--node_rank", "0", "--master_addr", "10.0.0.5"]
    assert cmd[cmd.index("--master_port") + 1] == "7"
    assert cmd[-3:] == ["--module", "grpo.launch.worker", "train"]


def test_without_a_node_rank_or_a_hostfile_no_node_is_named(two_nodes):
    assert this_node(two_nodes, {"MASTER_PORT": "7"}) is None
    assert this_node(two_nodes, {"NODE_RANK": " ", "MASTER_PORT": "7"}) is None
    assert this_node(load_config(None, []), {"NODE_RANK": "1", "MASTER_PORT": "7"}) is None
    refuse_node_by_node(two_nodes, {"MASTER_PORT": "7"})  # ssh path: the pipeline may run
    # every node over ssh: the launcher is told neither --no_ssh nor a node rank
    cmd = launcher_command(two_nodes, ["x.py"], {})
    assert "--no_ssh" not in cmd and "--node_rank" not in cmd and cmd[-1] == "x.py"


@pytest.mark.parametrize(
    ("env", "overrides", "said"),
    [
        ({"NODE_RANK": "2", "MASTER_PORT": "7"}, [],
         r"NODE_RANK=2: expected a node index from 0 to 1 \(.*hostfile names 2"),
        ({"SLURM_NODEID": "-1", "MASTER_PORT": "7"}, [], "SLURM_NODEID=-1: expected a node index"),
        ({"NODE_RANK": "1"}, [], "set MASTER_PORT .* alike on every node"),
        ({"NODE_RANK": "1", "MASTER_PORT": "http"}, [], "set MASTER_PORT"),
        ({"NODE_RANK": "1", "MASTER_PORT": "7"}, ["deepspeed.master_port=29508"],
         "MASTER_PORT=7 but .* is 29508"),
    ],
)  # fmt: skip
def test_a_node_that_cannot_find_its_place_is_refused_in_one_line(two_nodes, env, overrides, said):
    cfg = load_config(None, [f"deepspeed.hostfile={two_nodes.deepspeed.hostfile}", *overrides])
    with pytest.raises(NodeError, match=said) as err:
        this_node(cfg, env)
    assert "\n" not in str(err.value)


def test_a_port_given_both_ways_alike_is_accepted(two_nodes):
    cfg = load_config(None, [f"deepspeed.hostfile={two_nodes.deepspeed.hostfile}",
                             "deepspeed.master_port=29508"])  # fmt: skip
    assert this_node(cfg, {"NODE_RANK": "1"}).master_port == 29508
    assert this_node(cfg, {"NODE_RANK": "1", "MASTER_PORT": "29508"}).master_port == 29508


def test_a_pipeline_started_node_by_node_is_refused(two_nodes):
    said = r"SLURM_NODEID is set \(node 1 of 2 \(node-b\)\): a pipeline starts every node"
    with pytest.raises(NodeError, match=said):
        refuse_node_by_node(two_nodes, {"SLURM_NODEID": "1", "MASTER_PORT": "7"})
