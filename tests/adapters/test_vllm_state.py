"""VLLMEngine's one state record (hybridmem.adapters.vllm.inprocess.state): each change checks where it
starts, the same change twice is a no-op, and the tags vLLM holds asleep follow from the tags' states."""

from __future__ import annotations

import pytest

from hybridmem.adapters.vllm.inprocess.state import EngineState, TagState, WeightsContent
from hybridmem.errors import PhaseError


def test_a_new_record_is_all_resident_and_current():
    state = EngineState(sleep_mode=True)
    assert state["weights"] is TagState.RESIDENT and state["kv_cache"] is TagState.RESIDENT
    assert state.content is WeightsContent.CURRENT and state.asleep == []
    state.check_serving("generate")
    with pytest.raises(ValueError, match="'kv'"):
        state["kv"]


def test_a_level_2_sleep_discards_both_and_a_wake_brings_one_back():
    state = EngineState(sleep_mode=True)
    state.slept(2)
    assert state["weights"] is TagState.RELEASED and state["kv_cache"] is TagState.RELEASED
    assert state.content is WeightsContent.STALE and state.asleep == ["weights", "kv_cache"]
    with pytest.raises(RuntimeError, match="every tag awake"):  # vLLM ignores a sleep while a tag sleeps
        state.slept(2)
    state.woke("weights")
    state.woke("weights")  # twice: no-op
    assert state.asleep == ["kv_cache"] and state.resident("weights")
    with pytest.raises(PhaseError, match="phase RELEASED; 'kv_cache' is not resident"):
        state.check_serving("generate with vLLM")
    state.woke("kv_cache")
    with pytest.raises(PhaseError, match="phase STALE; the weights were discarded"):
        state.check_serving("generate with vLLM")
    state.loaded()
    state.check_serving("generate with vLLM")


def test_a_level_1_sleep_keeps_the_weights_on_host_until_their_copy_is_dropped():
    state = EngineState(sleep_mode=True)
    state.written_in_place()
    state.slept(1)  # LLM.sleep resets the prefix cache: only the post-load processing is owed
    assert state["weights"] is TagState.ON_HOST and state.content is WeightsContent.REPROCESS_OWED
    with pytest.raises(PhaseError, match="phase ON_HOST"):
        state.loaded()
    state.host_copy_dropped()
    state.host_copy_dropped()  # twice: no-op
    assert state["weights"] is TagState.RELEASED and state.content is WeightsContent.STALE


def test_an_in_place_update_owes_a_prefix_reset_then_its_processing():
    state = EngineState(sleep_mode=True)
    state.written_in_place()
    assert state.content is WeightsContent.UPDATED
    state.prefix_reset()
    state.prefix_reset()  # twice: no-op
    assert state.content is WeightsContent.REPROCESS_OWED
    state.served()
    assert state.content is WeightsContent.CURRENT
    state.served()
    assert state.content is WeightsContent.CURRENT


def test_without_a_sleep_mode_only_the_record_moves():
    state = EngineState(sleep_mode=False)
    state.marked(["weights", "kv_cache"], TagState.RELEASED)
    assert state["weights"] is TagState.RELEASED and state.asleep == []
    assert state.content is WeightsContent.CURRENT  # the weights never left
    with pytest.raises(RuntimeError, match="sleep mode"):
        state.slept(2)
    with pytest.raises(RuntimeError, match="only without a sleep mode"):
        EngineState(sleep_mode=True).marked(["weights"], TagState.RELEASED)
    state.marked(["weights"], TagState.RESIDENT)
    assert state.resident("weights") and not state.resident("kv_cache")
