"""The process group's store under torchrun: each restart of a group reads only its own keys."""

from __future__ import annotations

import torch.distributed as dist

from autopar.runtime.distributed import attempt_store


def test_a_restarted_group_does_not_read_the_dead_groups_addresses() -> None:
    agent = dist.HashStore()  # stands for the agent's store, which outlives its workers
    env = {"TORCHELASTIC_USE_AGENT_STORE": "True", "WORLD_SIZE": "2"}
    first = attempt_store(agent, {**env, "TORCHELASTIC_RESTART_COUNT": "0"})
    first.set("default_pg/0//cpu//rank_0", "dead address")
    again = attempt_store(agent, {**env, "TORCHELASTIC_RESTART_COUNT": "1"})
    assert not again.check(["default_pg/0//cpu//rank_0"])  # the restart waits for the live rank's
    smaller = attempt_store(agent, {**env, "TORCHELASTIC_RESTART_COUNT": "0", "WORLD_SIZE": "1"})
    assert not smaller.check(["default_pg/0//cpu//rank_0"])
    assert attempt_store(agent, {}) is agent  # no agent store (plain env://): nothing to scope
