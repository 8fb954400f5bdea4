"""How a CPU pool's engine server is sized so that it does not starve the rest of the host
(inference/serving.py; docs/answers.md, "vLLM on a small CPU host")."""

import pytest

from inference import serving
from inference.models import Provider, Route
from inference.serving import PoolConfig, cpu_has_native_bf16, engine_cpu_cores, kv_cache_gib, served_dtype

AVX2 = "processor\t: 0\nflags\t\t: fpu sse2 avx avx2 fma\n\nprocessor\t: 1\nflags\t\t: fpu sse2 avx avx2 fma\n"
AVX512_BF16 = "processor\t: 0\nflags\t\t: fpu avx2 avx512f avx512_bf16\n"
AMX = "processor\t: 0\nflags\t\t: fpu avx2 amx_bf16 amx_tile\n"


def test_native_bf16_is_read_from_the_cpu_flags():
    assert [cpu_has_native_bf16(info) for info in (AVX2, AVX512_BF16, AMX, "")] == [False, True, True, False]


def test_auto_is_float32_on_a_cpu_without_native_bf16_and_the_models_own_elsewhere(monkeypatch):
    monkeypatch.setattr(serving, "cpu_has_native_bf16", lambda: False)
    assert [served_dtype("auto", ""), served_dtype("auto", "0"), served_dtype("bfloat16", "")] == [
        "float32",
        "auto",
        "bfloat16",
    ]
    monkeypatch.setattr(serving, "cpu_has_native_bf16", lambda: True)
    assert served_dtype("auto", "") == "auto"


def test_the_kv_cache_is_a_sixth_of_the_memory_available_within_bounds():
    gib = 2**30
    assert [kv_cache_gib(n * gib) for n in (2, 6, 13, 18, 60, 500)] == [1, 1, 2, 3, 8, 8]


def test_the_engine_binds_all_cores_but_the_first_quarter():
    assert [engine_cpu_cores(list(range(n))) for n in (1, 2, 4, 16)] == ["0", "1", "1-3", "4-15"]
    assert engine_cpu_cores([0, 2, 4, 6]) == "2,4,6"  # not a range: listed


def test_a_cpu_server_gets_its_cache_and_binding_unless_they_are_set_and_a_gpu_server_neither(monkeypatch):
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    monkeypatch.setattr(serving, "kv_cache_gib", lambda: 3)
    monkeypatch.setattr(serving, "engine_cpu_cores", lambda: "1")
    config = PoolConfig(model="/models/m")
    env = serving.vllm_env(config, "")
    assert (env["VLLM_CPU_KVCACHE_SPACE"], env["VLLM_CPU_OMP_THREADS_BIND"]) == ("3", "1")
    chosen = PoolConfig(model="/models/m", kv_cache_gib=5, cpu_cores="2-7", env={"VLLM_CPU_KVCACHE_SPACE": "2"})
    env = serving.vllm_env(chosen, "")
    assert (env["VLLM_CPU_KVCACHE_SPACE"], env["VLLM_CPU_OMP_THREADS_BIND"]) == ("2", "2-7")
    gpu = serving.vllm_env(config, "0")
    assert gpu["CUDA_VISIBLE_DEVICES"] == "0"
    assert "VLLM_CPU_KVCACHE_SPACE" not in gpu and "VLLM_CPU_OMP_THREADS_BIND" not in gpu


@pytest.mark.parametrize(
    ("route", "window", "tokens"),
    [
        (None, 4096, 4096 - 512 - 16),
        (Route(max_tokens=192, max_sources=3, max_source_tokens=None), 4096, 3 * 400 + 400),
        (Route(max_tokens=192, max_sources=3, max_source_tokens=100), 4096, 3 * 100 + 400),
        (Route(max_tokens=512, max_sources=8, max_source_tokens=None), 2048, 2048 - 512 - 16),
    ],
)
def test_the_warm_up_prompt_is_the_largest_the_route_sends(route, window, tokens):
    assert serving.warm_prompt_tokens(route, window) == tokens


@pytest.mark.django_db
def test_a_pool_that_up_no_longer_runs_is_disabled_and_registering_it_enables_it_again():
    config = PoolConfig(model="/models/demo", demo=True)
    serving.pool_register(config, ["http://127.0.0.1:8100/v1"], warming=True)
    other = Provider.objects.create(name="hosted", kind=Provider.Kind.OPENAI_COMPATIBLE, base_url="http://x/v1")
    route = Route.objects.get(name="gpu-pool")
    assert (route.is_default, route.citing, route.stop) == (True, "verifier", ["\n\n"])  # DEMO_ROUTE's

    assert serving.pool_off("gpu-pool") is True
    pool = Provider.objects.get(name="gpu-pool")
    assert (pool.enabled, pool.warming_since) == (False, None)
    assert Provider.objects.get(pk=other.pk).enabled is True
    assert serving.pool_off("gpu-pool") is False  # nothing left to disable
    assert serving.pool_off("hosted") is False  # not a pool: left as it is

    serving.pool_register(config, ["http://127.0.0.1:8100/v1"])
    assert Provider.objects.get(name="gpu-pool").enabled is True
