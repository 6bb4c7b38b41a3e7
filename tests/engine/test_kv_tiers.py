"""The KV cache's host and disk tiers on the embedded SmolLM2 with a 39-block device pool:
greedy outputs equal to an ample pool's while blocks are evicted to host memory and loaded
back, swapped out at preemption and swapped in, and read from disk by a second process; no
block leaked in any tier after finishes, aborts, preemptions and n > 1; damaged and foreign
block files are never served; bad values fail in one line."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from jaxkv import LLM, SamplingParams
from jaxkv.engine_args import EngineArgs
from jaxkv.core.block_pool import hash_block_tokens
from tests.conftest import TEST_ENGINE
from tests.engine.test_preemption import workload
from tests.helpers import assert_same_or_near_tie, margins_from_logprobs

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SMALL = dict(TEST_ENGINE, kv_cache_memory_bytes=None, num_gpu_blocks_override=40)


@pytest.fixture(scope="module")
def host():
    return LLM(**SMALL, swap_space=0.1)


@pytest.fixture(scope="module")
def swap():
    return LLM(**SMALL, swap_space=0.1, preemption_mode="swap")


def conversations():
    """8 documents of 150 tokens, each asked twice in turn: a 39-block pool holds about
    three, so every second turn misses on the device."""
    rng = np.random.default_rng(1)
    docs = [rng.integers(200, 20000, 150).tolist() for _ in range(8)]
    return [{"prompt_token_ids": d + [300 + turn] * 4} for turn in range(2) for d in docs]


def one_by_one(llm, prompts):
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=2)
    return [llm.generate(p, sp, use_tqdm=False)[0].outputs[0] for p in prompts]


def same_as(got, ref, what):
    for i, (a, b) in enumerate(zip(got, ref)):
        assert_same_or_near_tie(a.token_ids, b.token_ids, margins_from_logprobs(b.logprobs),
                                what=f"{what}, request {i}")


def no_leaks(llm):
    s, kv = llm.stats(), llm.llm_engine.scheduler.kv
    assert s.num_free_blocks == s.num_total_blocks and s.num_running == s.num_waiting == 0
    assert kv.host.num_pinned == 0 and kv.swapped == {}
    assert kv.host.num_used + len(kv.host.free_slots) == kv.host.num_slots


def test_host_tier_serves_evicted_blocks(llm, host):
    prompts = conversations()
    ref = one_by_one(llm, prompts)
    s0 = host.stats()
    got = one_by_one(host, prompts)
    s = host.stats()
    same_as(got, ref, "host tier vs ample pool")
    assert s.kv_offload_host_stored_blocks > s0.kv_offload_host_stored_blocks
    hits = s.kv_offload_host_hit_tokens - s0.kv_offload_host_hit_tokens
    assert hits >= 8 * 144  # every second turn's 9 full document blocks come from host memory
    computed = s.num_computed_prompt_tokens - s0.num_computed_prompt_tokens
    assert computed <= sum(len(p["prompt_token_ids"]) for p in prompts) - hits
    no_leaks(host)


def test_swap_preemption_keeps_outputs(llm, swap):
    prompts, params = workload()
    ref = llm.generate(prompts, params, use_tqdm=False)
    s0 = swap.stats()
    got = swap.generate(prompts, params, use_tqdm=False)
    s = swap.stats()
    assert s.num_preemptions > s0.num_preemptions and s.num_swapped_out > s0.num_swapped_out
    assert s.kv_offload_host_loaded_blocks > s0.kv_offload_host_loaded_blocks  # swapped back in
    same_as([o.outputs[0] for o in got], [o.outputs[0] for o in ref], "swap vs ample pool")
    no_leaks(swap)


def test_no_block_leaks_after_aborts_forks_and_preemption(swap):
    eng = swap.llm_engine
    rng = np.random.default_rng(2)
    for i in range(10):
        p = {"prompt_token_ids": rng.integers(200, 20000, int(rng.integers(20, 150))).tolist()}
        n = 3 if i % 3 == 0 else 1
        eng.add_request(f"r{i}", p, SamplingParams(n=n, temperature=0.8, seed=i, max_tokens=40,
                                                   ignore_eos=True))
    for _ in range(12):
        eng.step()
    eng.abort_request(["r0", "r4"])
    while eng.has_unfinished_requests():
        eng.step()
    eng.abort_request(["r1"])  # already finished: nothing to do
    assert swap.stats().num_preemptions > 0
    no_leaks(swap)


def disk_run(folder, *extra):
    p = subprocess.run([sys.executable, "-m", "tests.engine.kv_disk_check", folder, *extra],
                       cwd=ROOT, capture_output=True, text=True, timeout=900,
                       env={**os.environ, "PYTHONPATH": ROOT})
    line = next((x for x in p.stdout.splitlines() if x.startswith("DISK_RESULT ")), None)
    assert p.returncode == 0 and line, p.stderr[-3000:]
    return json.loads(line[len("DISK_RESULT "):])


def test_disk_tier_survives_a_restart_and_never_serves_bad_files(tmp_path):
    folder = str(tmp_path / "kv")
    first = disk_run(folder)
    assert first["computed"] == 1520 and first["disk_stored_blocks"] >= 94
    assert first["free_blocks"] == first["total_blocks"]
    second = disk_run(folder)  # a new process: everything but the last block from disk
    assert second["computed"] <= 16 and second["disk_hit_tokens"] >= 1504
    same = lambda r, what: assert_same_or_near_tie(  # noqa: E731
        r["tokens"], first["tokens"], [sorted(d.values())[-1] - sorted(d.values())[-2]
                                       for d in first["logprobs"]], what=what)
    same(second, "read from disk after a restart")
    # Damage two blocks of the system prompt by hand: block 60's file truncated (caught by its
    # size at lookup), block 30's contents changed at the same size (caught by its CRC at read).
    prompt, names, parent = first["prompt"], [], None
    for i in range(94):
        parent = hash_block_tokens(parent, prompt[16 * i:16 * (i + 1)])
        names.append(os.path.join(first["disk_dir"], parent.hex() + ".kvb"))
    with open(names[60], "r+b") as f:
        f.truncate(1000)
    with open(names[30], "r+b") as f:
        f.seek(100)
        b = f.read(1)
        f.seek(100)
        f.write(bytes([b[0] ^ 0xFF]))
    third = disk_run(folder)
    assert third["computed"] == 1520 - 30 * 16  # blocks 0..29 from disk, the rest computed
    same(third, "after damaged block files")
    # Another KV dtype is another model identity: its own folder, nothing read from ours.
    bf16 = disk_run(folder, "bfloat16")
    assert bf16["disk_dir"] != first["disk_dir"] and bf16["disk_hit_tokens"] == 0
    assert bf16["computed"] == 1520


@pytest.mark.parametrize("kw,msg", [
    (dict(swap_space=-1), "swap_space must be a finite number of GiB >= 0"),
    (dict(swap_space=float("inf")), "swap_space must be a finite number of GiB >= 0"),
    (dict(kv_offloading_size=float("nan")), "kv_offloading_size must be a finite number"),
    (dict(preemption_mode="swap"), "preemption_mode swap needs a host tier"),
    (dict(preemption_mode="later"), "preemption_mode must be one of"),
    (dict(swap_space=1, kv_offloading_size=2), "kv_offloading_size and swap_space"),
    (dict(kv_cache_disk_dir="d"), "kv_cache_disk_bytes must be given with kv_cache_disk_dir"),
    (dict(kv_cache_disk_dir="d", kv_cache_disk_bytes="1GiB"), "kv_cache_disk_dir needs a host tier"),
    (dict(swap_space=1, kv_cache_disk_dir="d", kv_cache_disk_bytes=-5), "kv_cache_disk_bytes must be positive"),
    (dict(swap_space=1, enable_prefix_caching=False), "swap_space needs enable_prefix_caching"),
    (dict(swap_space=1, num_processes=2), "swap_space is not supported by a multi-process engine"),
])
def test_bad_values_name_the_argument(kw, msg):
    with pytest.raises(ValueError, match=msg):
        EngineArgs(**kw)


def test_unwritable_disk_dir_and_tiny_sizes_fail_in_one_line(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(ValueError, match="kv_cache_disk_dir .* is not writable"):
        LLM(**SMALL, swap_space=0.01, kv_cache_disk_dir=str(blocker / "sub"), kv_cache_disk_bytes="1GiB")
    with pytest.raises(ValueError, match="swap_space .* holds no KV block"):
        EngineArgs(swap_space=1e-6).create_engine_config(platform="cpu")
    with pytest.raises(ValueError, match="swap_space .* is more than 70% of this machine's memory"):
        EngineArgs(swap_space=1e6).create_engine_config(platform="cpu")
