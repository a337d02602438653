"""Without redis-py (e.g. a GPU box with only torch) the engine and CPU tier work; only a Redis tier fails,
with a clear message."""

from __future__ import annotations

import subprocess
import sys

SCRIPT = r"""
import sys

class NoRedis:
    def find_spec(self, name, path=None, target=None):
        if name == "redis" or name.startswith("redis."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None

sys.meta_path.insert(0, NoRedis())
from pdllm.shared.app.engine import PrefillingEngine  # noqa: F401
from pdllm.shared.kv_tier import CPUStoreConfig, KVMeta, KVTierConfig, RedisStoreConfig, build_kv_store

build_kv_store(KVTierConfig(cpu=CPUStoreConfig(capacity_bytes=1 << 20)), None)
try:
    build_kv_store(KVTierConfig(redis=RedisStoreConfig("redis://127.0.0.1:1")), None)
except ValueError as exc:
    print("ERROR", exc)
"""


def test_engine_and_cpu_tier_import_without_redis_py() -> None:
    res = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert "ERROR the Redis KV tier needs the redis package" in res.stdout
