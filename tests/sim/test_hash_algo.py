"""The block hash algorithm (G3, --prefix-caching-hash-algo): the simulator's cheap default
decides exactly what the engine's BLAKE2b decides, and a report echoes it only when it is not
the simulator's own."""

import pytest

from kvserve.cli import main
from kvserve.sim.deployment import Deployment
from kvserve.sim.workloads import WorkloadSpec, generate

# Shared system prompts (prefix hits), a pool small enough to preempt, priorities unused.
SPEC = WorkloadSpec(num_requests=60, rate=40.0, prompt_len="uniform:20,120",
                    output_len="uniform:4,60", prefix_groups=3, prefix_len="fixed:64",
                    prefix_fraction=0.7, seed=5)
SETTINGS = {"max_num_seqs": 16, "max_model_len": 512, "num_kv_blocks": 60, "block_size": 8}


def run(algo=None):
    settings = SETTINGS if algo is None else {**SETTINGS, "prefix_caching_hash_algo": algo}
    return Deployment(model="llama-3.1-8b", hardware="h100-sxm").simulate(
        generate(SPEC), settings, seed=0)


def test_builtin_and_blake2b_make_the_same_run():  # G3: a hash only decides equality
    echo, result = run()
    echo_blake, result_blake = run("blake2b")
    assert "prefix_caching_hash_algo" not in echo["cache"]  # the default report's shape
    assert echo_blake["cache"].pop("prefix_caching_hash_algo") == "blake2b"
    assert echo == echo_blake
    counts = ("prefix_cache_queries", "prefix_cache_hits", "num_preemptions",
              "num_recomputed_tokens", "num_scheduled_tokens")
    assert [getattr(result, c) for c in counts] == [getattr(result_blake, c) for c in counts]
    assert result.prefix_cache_hits > 0 and result.num_preemptions > 0  # both exercised
    assert [(r.request_id, r.metrics, r.num_output_tokens, r.itl_sum)
            for r in result.records] == [(r.request_id, r.metrics, r.num_output_tokens,
                                          r.itl_sum) for r in result_blake.records]
    assert bytes(result.itl_samples) == bytes(result_blake.itl_samples)


def test_an_unknown_algorithm_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as info:
        main(["simulate", "--prefix-caching-hash-algo", "md5", "--prompt-len", "9"])
    assert info.value.code == 2
    assert "argument --prefix-caching-hash-algo: invalid choice: 'md5' (choose from " \
        "blake2b, builtin)" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # vLLM's own: what does its job here (the flags pass)
        main(["simulate", "--prefix-caching-hash-algo", "sha256", "--prompt-len", "9"])
    assert "vLLM's sha256 is not taken here: blake2b is the collision-resistant hash" in \
        capsys.readouterr().err
