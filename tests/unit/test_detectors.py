"""The detectors' room (hvd_resilient/detect): every peer detector is armed from one allgather
of every detector's offer, the same way under every backend."""

from __future__ import annotations

from typing import Any

from hvd_resilient.detect import Detectors
from hvd_resilient.detect.gloo_watch import GlooWatch
from hvd_resilient.detect.silent_peers import SilentPeers


class _Recorder:
    def __init__(self, name: str) -> None:
        self.name = name
        self.armed: tuple[int, list[Any]] | None = None
        self.disarmed = 0

    def offer(self, rank: int) -> Any:
        return f"{self.name}@{rank}"

    def arm(self, me: int, everyone: list[Any]) -> int:
        self.armed = (me, everyone)
        return len(everyone) - 1

    def disarm(self) -> None:
        self.disarmed += 1


def test_each_detector_is_armed_with_every_ranks_offer_of_its_own() -> None:
    a, b = _Recorder("a"), _Recorder("b")
    room = Detectors(a, b)
    world = [Detectors(_Recorder("a"), _Recorder("b")).offers(r) for r in range(3)]
    assert room.arm(1, world) == {"a": 2, "b": 2}
    assert a.armed == (1, ["a@0", "a@1", "a@2"]) and b.armed == (1, ["b@0", "b@1", "b@2"])
    room.disarm()
    assert (a.disarmed, b.disarmed) == (1, 1)


def test_arming_goes_through_the_backends_allgather_once() -> None:
    calls: list[Any] = []

    def allgather(obj: Any) -> list[Any]:
        calls.append(obj)
        return [obj, {"a": "a@1"}]

    a = _Recorder("a")
    assert Detectors(a).arm_with(0, allgather) == {"a": 1}
    assert calls == [{"a": "a@0"}] and a.armed == (0, ["a@0", "a@1"])


def test_the_real_detectors_fill_the_protocol() -> None:
    for cls in (GlooWatch, SilentPeers):
        for member in ("name", "offer", "arm", "disarm"):
            assert hasattr(cls, member), f"{cls.__name__} lacks {member}"
        assert cls.arm.__code__.co_varnames[1:3] == ("me", "everyone")
    assert {GlooWatch.name, SilentPeers.name} == {"connections", "heartbeats"}

