"""Agent-style rollouts against vLLM's engine in its own process (an AsyncLLM), each scenario run in a
process of its own by test_vllm_rollouts.py: ``python _vllm_rollout_tasks.py SCENARIO OUT.json [ARGS]``
writes its findings as JSON.

``agent``: one AsyncLLM, a ``from_pretrained`` policy and four switches:

1. 64 multi-turn trajectories at once (asyncio, ``agenerate``), each turn's prompt the previous tokens
   plus a calculator tool's answer, inside one ``manager.inference()``, the policy trained a step; checked
   teacher-forced against transformers on the weights (all 64), and rerun whole with transformers'
   greedy ``generate`` (the first 8);
2. long requests still running when the user leaves INFER with ``InFlight.WAIT``, then a training step
   and at once the next switch, whose update would reach any request still running;
3. the same with ``InFlight.ABORT``, then a training step;
4. greedy generation on the last weights.

References for 2 to 4 are transformers' greedy choices, teacher-forced, on the weights the requests
started with.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import tempfile
import threading
import time
from typing import Any

from _vllm_server_tasks import ENGINE_ARGS, VLLM_ENV, lm_step, save_policy

NUM_TRAJECTORIES = 64
NUM_TURNS = 3
TURN_TOKENS = 6
TOOL_OPEN, TOOL_CLOSE, DIGIT_0 = 250, 251, 240
"""Token ids of the tool answer's frame and of the digit 0 (digits are 240..249)."""
TIE = 1e-5
"""Log-probs closer than this are a tie (the engine's token then counts as transformers' choice)."""
NUM_GENERATE_CHECKED = 8
"""Trajectories also rerun whole with transformers' ``generate`` (the rest are checked teacher-forced)."""
LONG_TOKENS = 200
LONG_PROMPTS = [[1, 2, 3, 4], [9, 8, 7], [5, 17, 33, 2, 11], [(7 * i + 3) % 200 + 1 for i in range(40)]]


def calculator(tokens: list[int]) -> list[int]:
    """The tool: the sum of a turn's generated token ids modulo 1000, in decimal digit tokens, framed."""
    return [TOOL_OPEN, *(DIGIT_0 + int(d) for d in str(sum(tokens) % 1000)), TOOL_CLOSE]


def first_prompts() -> list[list[int]]:
    return [[(31 * i + 7 * j + 1) % 230 + 1 for j in range(4 + i % 9)] for i in range(NUM_TRAJECTORIES)]


def hf_greedy(model: Any, prompt: list[int], max_tokens: int) -> list[int]:
    import torch

    with torch.no_grad():
        ids = model.generate(torch.tensor([prompt]), max_new_tokens=max_tokens, min_new_tokens=max_tokens,
                             do_sample=False, pad_token_id=0, eos_token_id=None)
    return ids[0, len(prompt):].tolist()


def hf_rollout(model: Any, prompt: list[int]) -> list[list[int]]:
    """The reference trajectory: every turn's greedy tokens from transformers, the tool run in between."""
    ids, turns = list(prompt), []
    for _ in range(NUM_TURNS):
        tokens = hf_greedy(model, ids, TURN_TOKENS)
        turns.append(tokens)
        ids = ids + tokens + calculator(tokens)
    return turns


def teacher_forced(model: Any, prompts: list[list[int]],
                   trajectories: list[list[list[int]]]) -> tuple[list, list]:
    """Transformers' greedy choice at every generated position of every trajectory, from one forward over
    all of them (right-padded; each turn's prompt is the previous tokens and the tool's answer, recomputed
    here), and per trajectory the largest log-prob gap between transformers' best token and the engine's.
    Where the gap is within ``TIE`` the engine's token counts as transformers' choice (exact near-ties can
    flip with batching)."""
    import torch

    seqs, spans = [], []
    for prompt, turns in zip(prompts, trajectories):
        ids, mine = list(prompt), []
        for tokens in turns:
            mine.append((len(ids), len(tokens)))
            ids = ids + list(tokens) + calculator(list(tokens))
        seqs.append(ids)
        spans.append(mine)
    width = max(len(ids) for ids in seqs)
    batch = torch.tensor([ids + [0] * (width - len(ids)) for ids in seqs])
    mask = torch.tensor([[1] * len(ids) + [0] * (width - len(ids)) for ids in seqs])
    with torch.no_grad():
        logprobs = torch.log_softmax(model(input_ids=batch, attention_mask=mask).logits.double(), dim=-1)
    choices, gaps = [], []
    for b, (ids, mine) in enumerate(zip(seqs, spans)):
        turns, worst = [], 0.0
        for start, n in mine:
            row = []
            for i in range(start, start + n):
                at = logprobs[b, i - 1]
                gap = float(at.max() - at[ids[i]])
                worst = max(worst, gap)
                row.append(ids[i] if gap <= TIE else int(at.argmax()))
            turns.append(row)
        choices.append(turns)
        gaps.append(worst)
    return choices, gaps


async def rollout(engine: Any, prompt: list[int]) -> list[dict[str, Any]]:
    """The user's agent loop for one trajectory: generate, call the tool, append its answer, repeat."""
    from hybridmem.engines import SamplingParams

    ids, turns = list(prompt), []
    for _ in range(NUM_TURNS):
        start = time.monotonic()
        out = await engine.agenerate(ids, SamplingParams(max_tokens=TURN_TOKENS, temperature=0.0))
        turns.append({"tokens": out.token_ids, "start": start, "end": time.monotonic(),
                      "finish_reason": out.finish_reason})
        ids = ids + out.token_ids + calculator(out.token_ids)
    return turns


def watch_running(engine: Any) -> list[tuple[float, int]]:
    """vLLM's own count of running requests after every engine step it reports (its scheduler's stats,
    taken where AsyncLLM hands them to its stat loggers), with the time it arrived."""
    manager = engine.client.llm.logger_manager
    seen: list[tuple[float, int]] = []
    record = manager.record

    def watched(*args: Any, **kwargs: Any) -> Any:
        stats = kwargs.get("scheduler_stats", args[0] if args else None)
        if stats is not None:
            seen.append((time.monotonic(), int(stats.num_running_reqs)))
        return record(*args, **kwargs)

    manager.record = watched
    return seen


def max_overlap(intervals: list[tuple[float, float]]) -> int:
    """The largest number of intervals open at one instant."""
    events = sorted([(s, 1) for s, _ in intervals] + [(e, -1) for _, e in intervals],
                    key=lambda x: (x[0], x[1]))
    best = now = 0
    for _, step in events:
        now += step
        best = max(best, now)
    return best


def run_rollouts(manager: Any, model: Any, model_dir: str) -> dict:
    """64 trajectories at once inside one ``manager.inference()``; checked against transformers."""
    import torch
    import transformers

    prompts = first_prompts()

    async def everything() -> list[list[dict[str, Any]]]:
        return list(await asyncio.gather(*(rollout(e, p) for p in prompts)))

    with manager.inference() as e:
        start = time.monotonic()
        trajectories = asyncio.run(everything())
        wall_s = time.monotonic() - start
        version = e.weight_version()
    got = [[turn["tokens"] for turn in t] for t in trajectories]
    expected, gaps = teacher_forced(model, prompts, got)
    untrained = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    first_turns = [(t[0]["start"], t[0]["end"]) for t in trajectories]
    return {
        "got": got, "expected": expected, "gaps": gaps,
        "generate_expected": [hf_rollout(model, p) for p in prompts[:NUM_GENERATE_CHECKED]],
        "untrained": teacher_forced(untrained, prompts, got)[0],
        "finish_reasons": sorted({turn["finish_reason"] for t in trajectories for turn in t}),
        "version": version, "wall_s": wall_s,
        "max_in_flight_first_turn": max_overlap(first_turns),
        "max_in_flight": max_overlap([(turn["start"], turn["end"]) for t in trajectories for turn in t]),
        "num_requests": sum(len(t) for t in trajectories),
    }


class LongRequests:
    """The user's agent loop in a thread of its own: long greedy requests, each result with the time it
    came back."""

    def __init__(self, engine: Any):
        from hybridmem.engines import SamplingParams

        self.engine, self.results = engine, []
        self.params = SamplingParams(max_tokens=LONG_TOKENS, temperature=0.0)
        self.thread = threading.Thread(target=lambda: self.results.extend(asyncio.run(self._all())))
        self.thread.start()

    async def _one(self, prompt: list[int]) -> dict[str, Any]:
        out = await self.engine.agenerate(prompt, self.params)
        return {"tokens": out.token_ids, "finish_reason": out.finish_reason, "end": time.monotonic()}

    async def _all(self) -> list[Any]:
        return list(await asyncio.gather(*(self._one(p) for p in LONG_PROMPTS), return_exceptions=True))

    def join(self) -> list[dict[str, Any]]:
        self.thread.join(timeout=600)
        return [r if isinstance(r, dict) else {"error": f"{type(r).__name__}: {r}", "tokens": []}
                for r in self.results]


def leave_running(manager: Any, engine: Any, running: list[tuple[float, int]]) -> tuple[LongRequests, dict]:
    """Enter INFER, start the long requests, leave once vLLM runs them all and has stepped them a few times
    (they are mid-request): the switch follows ``engine.in_flight``."""
    with manager.inference():
        seen = len(running)
        requests = LongRequests(engine)
        deadline = time.monotonic() + 300
        while sum(1 for _, n in running[seen:] if n >= len(LONG_PROMPTS)) < 3 and time.monotonic() < deadline:
            time.sleep(0.005)
        left = time.monotonic()
    switched = time.monotonic()
    return requests, {"policy": engine.in_flight.value, "last_aborted": engine.last_aborted, "left": left,
                      "switched": switched,
                      "max_vllm_running": max((n for _, n in running[seen:]), default=0)}


def snapshot(model: Any, model_dir: str) -> Any:
    """A transformers model holding ``model``'s weights now (the reference for requests started on them)."""
    import torch
    import transformers

    copy = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    copy.load_state_dict({k: v.detach().clone() for k, v in model.state_dict().items()})
    return copy


def checked(requests: LongRequests, reference: Any, figures: dict) -> dict:
    results = requests.join()
    expected, gaps = teacher_forced(reference, LONG_PROMPTS, [[r["tokens"]] for r in results])
    return {**figures, "results": results, "expected": [e[0] for e in expected], "gaps": gaps}


def agent(out: str) -> dict:
    """One engine, four switches: the rollouts; leaving with requests running under InFlight.WAIT, then a
    training step and at once the next switch (its update would reach any request still running); the same
    under InFlight.ABORT; greedy generation on the last weights."""
    import torch
    import transformers

    from hybridmem import ShardingManager
    from hybridmem.adapters.vllm.server import InFlight, VLLMServerEngine
    from hybridmem.engines import SamplingParams

    clock = time.monotonic()
    phases: dict[str, float] = {}

    def phase(name: str) -> None:
        nonlocal clock
        phases[name] = round(time.monotonic() - clock, 2)
        clock = time.monotonic()

    model_dir = save_policy(tempfile.mkdtemp(prefix="policy-"))
    engine = VLLMServerEngine.start_async(model_dir, engine_kwargs={"in_flight": InFlight.WAIT},
                                          **{**ENGINE_ARGS, "max_num_seqs": NUM_TRAJECTORIES})
    try:
        running = watch_running(engine)
        model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        manager = ShardingManager(model, engine, optimizer=opt)
        phase("start")
        lm_step(model, opt, 0, model.config.vocab_size)
        res = {"rollouts": run_rollouts(manager, model, model_dir)}
        res["rollouts"]["max_vllm_running"] = max((n for _, n in running), default=0)
        phase("rollouts")
        waited, wait_figures = leave_running(manager, engine, running)
        before_wait = snapshot(model, model_dir)
        lm_step(model, opt, 1, model.config.vocab_size)
        engine.in_flight = InFlight.ABORT
        # its entry commits the step's weights
        aborted, abort_figures = leave_running(manager, engine, running)
        before_abort = snapshot(model, model_dir)
        lm_step(model, opt, 2, model.config.vocab_size)
        greedy = SamplingParams(max_tokens=LONG_TOKENS, temperature=0.0)
        with manager.inference() as e:
            after = [o.token_ids for o in e.generate(LONG_PROMPTS, greedy)]
            version = e.weight_version()
        manager.close()
        phase("leave")
        res["wait"] = checked(waited, before_wait, wait_figures)
        res["abort"] = checked(aborted, before_abort, abort_figures)
        expected, gaps = teacher_forced(model, LONG_PROMPTS, [[t] for t in after])
        res["after"] = {"got": after, "expected": [e[0] for e in expected], "gaps": gaps, "version": version,
                        "generate_expected": hf_greedy(model, LONG_PROMPTS[0], LONG_TOKENS)}
        phase("references")
        res["phases_s"] = phases
        return res
    finally:
        engine.close()


SCENARIOS = {"agent": agent}

if __name__ == "__main__":
    os.environ.update(VLLM_ENV)
    name, out_path, *rest = sys.argv[1:]
    result = SCENARIOS[name](out_path, *rest)
    with open(out_path, "w") as f:
        json.dump(result, f)
