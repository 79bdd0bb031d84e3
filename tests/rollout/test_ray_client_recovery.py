"""RayRolloutClient's handling of a dead manager, without a cluster: a fake manager whose calls
die on demand (ray.get patched). What the replacement is restored to, when a call is retried,
which errors are not a manager death, and the error of a second death. The real thing (a manager
process SIGKILLed mid-produce) is tests/rollout/test_ray_recovery.py (slow)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from ray.exceptions import ActorDiedError, RayActorError, RayTaskError

from jaxloop.rollout.api import ManagerFailedError
from jaxloop.rollout.ray import client as ray_client
from jaxloop.rollout.ray.client import RayRolloutClient
from jaxloop.rollout.ray.transport import ObjectStoreTransport, Publication, ReplayChain


class FakeManager:
    """Method calls return (name, args); `deaths` of them (in order) die instead."""

    def __init__(self, log: list, deaths: list[str], cursor: dict):
        self.log, self.deaths, self.cursor = log, deaths, dict(cursor)

    def __getattr__(self, name):
        manager = self

        class Method:
            @staticmethod
            def remote(*args):
                return (manager, name, args)

        return Method


def _get(call, timeout=None):
    manager, name, args = call
    manager.log.append((name, args))
    if manager.deaths and manager.deaths[0] == name:
        manager.deaths.pop(0)
        raise ActorDiedError()
    if name == "produce_step":
        update = args[0]
        before = dict(manager.cursor)
        manager.cursor = {"pos": before["pos"] + 1}
        return (
            [f"sample of update {update} at {before['pos']}"],
            {"engine_restarts": 0.0},
            dict(manager.cursor),
        )
    if name == "restore":
        manager.cursor = dict(args[0])
    if name == "task_error":
        raise RayTaskError("task_error", "tb", RayActorError()).as_instanceof_cause()
    return manager.cursor if name == "state" else None


def _client(monkeypatch, deaths: list[list[str]]):
    """A client whose n-th manager dies on the calls deaths[n] (a manager per replacement)."""
    monkeypatch.setattr(ray_client.ray, "get", _get)
    monkeypatch.setattr(ray_client.ray, "kill", lambda *a, **k: None)
    client = object.__new__(RayRolloutClient)
    client.log = []
    client._placement_group = None
    # the committed version 3: one publication (its manifest stands in for a real one)
    publication = Publication(SimpleNamespace(version=3), ("chunk",), ObjectStoreTransport(), 1, "")
    client.chain = ReplayChain((publication,))
    client._cursor = {"pos": 0}
    client.manager_restarts = 0
    client._engine_restarts = [0.0, 0.0]
    managers = iter(FakeManager(client.log, d, {"pos": 0}) for d in deaths)
    client.manager = next(managers)

    def start():
        client.log.append(("new manager", ()))
        client.manager = next(managers)
        return {}

    client._start_manager = start
    return client


def test_manager_death_in_produce_restores_the_cursor_before_it_and_retries(monkeypatch):
    client = _client(monkeypatch, [[], []])
    assert client.produce(0)[0] == ["sample of update 0 at 0"]
    client.log.clear()
    client.manager.deaths = ["produce_step"]  # dies in update 1's produce
    client.manager.cursor = {"pos": 1}
    samples, stats = client.produce(1)
    # the replacement: restored to the cursor before update 1, the committed policy republished,
    # then update 1 again: the batch an unkilled run gets
    assert client.log == [
        ("produce_step", (1,)),
        ("new manager", ()),
        ("restore", ({"pos": 1},)),
        ("serve", (client.chain,)),
        ("produce_step", (1,)),
    ]
    assert samples == ["sample of update 1 at 1"]
    assert stats["manager_restarts"] == 1.0 and client._cursor == {"pos": 2}
    assert client.produce(2)[0] == ["sample of update 2 at 2"]


def test_restore_then_death_uses_the_restored_cursor(monkeypatch):
    client = _client(monkeypatch, [["produce_step"], []])
    client.restore({"pos": 7})
    assert client.produce(7)[0] == ["sample of update 7 at 7"]
    assert ("restore", ({"pos": 7},)) in client.log[client.log.index(("new manager", ())) :]


def test_a_task_error_is_not_a_manager_death(monkeypatch):
    client = _client(monkeypatch, [[]])
    with pytest.raises(RayActorError):  # an engine's death that escaped the manager's call
        client._call("update 0", "task_error")
    assert ("new manager", ()) not in client.log and client.manager_restarts == 0


def test_a_second_death_is_one_error_naming_the_update(monkeypatch):
    client = _client(monkeypatch, [["produce_step"], ["produce_step"], []])
    with pytest.raises(ManagerFailedError, match=r"^update 4: the rollout manager died again"):
        client.produce(4)
    assert client.manager_restarts == 1 and client._cursor == {"pos": 0}


def test_a_replacement_that_dies_while_restored_is_one_error(monkeypatch):
    client = _client(monkeypatch, [["evaluate"], ["restore"]])
    with pytest.raises(ManagerFailedError, match=r"^evaluation: the rollout manager died .* too"):
        client.evaluate()
