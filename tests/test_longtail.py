"""benchmarks/async_longtail.py on one shared GPU: the engine's memory budget worked by hand, and the two
bundles placed by Ray on one GPU (a Ray cluster that declares one GPU; no GPU needed). CPU, ~10 s."""

import os
import sys

import pytest

from conftest import ROOT

sys.path.insert(0, str(ROOT / "benchmarks"))
from async_longtail import ENGINE_RESERVE_GIB, engine_memory, shared_gpu_bundles  # noqa: E402

GIB = 2**30


def test_engine_memory_by_hand():
    """56 GiB for the engine on a 140 GiB GPU, 1 GiB of weights: KV cache 56 - 1 - 4 (reserve) = 51 GiB;
    gpu_memory_utilization 56 / 140 = 0.4, the share vLLM checks is free at start."""
    assert ENGINE_RESERVE_GIB == 4
    kw = engine_memory(56, 1 * GIB, 140 * GIB)
    assert kw == {"kv_cache_memory_bytes": 51 * GIB, "gpu_memory_utilization": 0.4}
    with pytest.raises(ValueError, match="leaves 0.5 GiB of KV cache.*raise --gen-memory"):
        engine_memory(5.5, 1 * GIB, 140 * GIB)           # 5.5 - 1 - 4 = 0.5 GiB
    with pytest.raises(ValueError, match="not below the GPU's 140.0 GiB"):
        engine_memory(140, 1 * GIB, 140 * GIB)


def test_bundles_split_one_gpu():
    assert shared_gpu_bundles(0.6) == ({"CPU": 1, "GPU": 0.6}, {"CPU": 1, "GPU": 0.4})
    for bad in (0, 1, 1.5):
        with pytest.raises(ValueError, match="--gen-fraction"):
            shared_gpu_bundles(bad)


def test_ray_places_both_bundles_on_the_same_gpu():
    """The generator's bundle as actors/pool.py places it (its own STRICT_PACK group) and the trainer's as
    actors/placement.start_ranks does: Ray keeps the fractions and gives both actors GPU "0" (the same
    CUDA_VISIBLE_DEVICES); a third share no longer fits on the GPU."""
    import ray
    from ray.util.placement_group import placement_group_table

    from actors import placement

    @ray.remote(num_cpus=0)
    class Probe(placement.RankActor):
        def where(self):
            return ray.get_runtime_context().get_accelerator_ids()["GPU"], os.environ.get("CUDA_VISIBLE_DEVICES")

    ray.init(address="local", num_cpus=4, num_gpus=1, include_dashboard=False, log_to_driver=False)
    try:
        gen_res, train_res = shared_gpu_bundles(0.5)
        gen_pg = placement.create([dict(gen_res)], strategy="STRICT_PACK")
        placement.wait_ready(gen_pg, 60, "generator")
        gen = Probe.options(**placement.on_bundle(gen_pg, 0, num_cpus=1, num_gpus=gen_res["GPU"])).remote(0, 1)
        train_pg, (trainer,) = placement.start_ranks(Probe, 1, bundle=train_res, timeout_s=60)
        assert ray.get([gen.where.remote(), trainer.where.remote()], timeout=60) == [(["0"], "0"), (["0"], "0")]
        assert placement_group_table(gen_pg)["bundles"][0] == {"CPU": 1.0, "GPU": 0.5}
        assert placement_group_table(train_pg)["bundles"][0] == {"CPU": 1.0, "GPU": 0.5}
        assert not placement.create([{"GPU": 0.1}]).wait(timeout_seconds=2)      # the GPU is fully shared out
    finally:
        ray.shutdown()
