from __future__ import annotations

import itertools

import pytest

from hybridmem import Phase, PhaseError
from hybridmem.switch.machine import TRANSITIONS, PhaseMachine, Trigger

# The legal transitions, written out by hand from the design (not read from hybridmem.switch.machine), so a
# wrong row in the machine's table is a test failure: phase -> {trigger: destination}.
T, TI, I, TT, RB, F = (  # noqa: E741 - the phases' initials, so the table below reads as one
    Phase.TRAIN, Phase.TO_INFER, Phase.INFER, Phase.TO_TRAIN, Phase.ROLLING_BACK, Phase.FAILED
)
C = Phase.CLOSED
EXPECTED = {
    T: {"begin_infer": TI, "close": C},
    TI: {"end_infer": I, "begin_rollback": RB, "fail": F},
    I: {"begin_train": TT},
    TT: {"end_train": T, "abort_train": I, "fail": F},
    RB: {"end_rollback": T, "fail": F},
    F: {"recover": TT},
    C: {},
}
TRIGGERS = ["abort_train", "begin_infer", "begin_rollback", "begin_train", "close", "end_infer",
            "end_rollback", "end_train", "fail", "recover"]


def test_the_machine_knows_exactly_these_phases_and_triggers():
    assert set(EXPECTED) == set(Phase)
    assert sorted({t.value for t, _, _ in TRANSITIONS}) == sorted(t.value for t in Trigger) == TRIGGERS


def test_starts_in_train():
    assert PhaseMachine().phase is Phase.TRAIN


@pytest.mark.parametrize("start, trigger", list(itertools.product(list(Phase), TRIGGERS)))
def test_every_trigger_from_every_phase(start, trigger):
    machine = PhaseMachine(initial=start)
    legal = EXPECTED[start]
    if trigger in legal:
        machine.fire(Trigger(trigger), operation="test")
        assert machine.phase is legal[trigger]
    else:
        with pytest.raises(PhaseError) as info:
            machine.fire(Trigger(trigger), operation=f"fire {trigger}")
        assert info.value.current is start and start.name in str(info.value) and trigger in str(info.value)
        assert machine.phase is start  # an illegal trigger changes nothing


def test_a_full_cycle_and_the_failure_path():
    m = PhaseMachine()
    path = ["begin_infer", "end_infer", "begin_train", "end_train", "begin_infer", "begin_rollback",
            "end_rollback", "begin_infer", "fail", "recover", "end_train"]
    seen = []
    for trig in path:
        m.fire(Trigger(trig), operation=trig)
        seen.append(m.phase)
    assert seen == [Phase.TO_INFER, Phase.INFER, Phase.TO_TRAIN, Phase.TRAIN, Phase.TO_INFER,
                    Phase.ROLLING_BACK, Phase.TRAIN, Phase.TO_INFER, Phase.FAILED, Phase.TO_TRAIN,
                    Phase.TRAIN]


def test_a_trigger_that_is_not_a_trigger_is_a_type_error():
    with pytest.raises(TypeError, match=r"trigger='begin_infer' is not a Trigger; known: \['BEGIN_INFER'"):
        PhaseMachine().fire("begin_infer", operation="jump")


def test_only_machine_module_imports_transitions():
    import pathlib

    import hybridmem

    root = pathlib.Path(hybridmem.__file__).parent
    importers = sorted(str(p.relative_to(root)) for p in root.rglob("*.py")
                       if "import transitions" in p.read_text() or "from transitions" in p.read_text())
    assert importers == ["switch/machine.py"]
