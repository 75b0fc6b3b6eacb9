"""--prefix-caching-hash-algo on the engine (G3): blake2b unless asked, builtin when asked,
from the same flags `kvserve serve` and `kvserve generate` parse."""

from __future__ import annotations

import pytest

from kvserve.cli import build_parser
from kvserve.engine.llm import build_engine
from kvserve.flags import engine_args
from tests.server.helpers import TINY


@pytest.mark.parametrize("argv, algo", [([], "blake2b"),
                                        (["--prefix-caching-hash-algo", "builtin"], "builtin")])
def test_the_engine_hashes_blocks_as_the_flag_says(argv, algo):  # G3
    args = build_parser().parse_args(["generate", *argv])
    settings = engine_args(args)
    engine = build_engine(TINY, num_kv_blocks=8, **{k: v for k, v in settings.items()
                                                    if k not in ("dtype", "seed")})
    assert engine.scheduler.cache_config.prefix_caching_hash_algo == algo
    assert engine.scheduler.kv.hash_algo == algo
