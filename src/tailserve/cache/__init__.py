"""Don't compute twice: result cache tiers (L1 in-process, L2 Redis), keys, coalescing,
invalidation, and the feature store."""

from __future__ import annotations

import time

from tailserve.cache.keys import KeyBuilder, KeyRule, schema_hash
from tailserve.cache.memory import MemoryCache
from tailserve.cache.tiered import CachePolicy, ModelView, ResultCache
from tailserve.modelconfig import ModelConfig


def model_view(
    cache: ResultCache,
    config: ModelConfig,
    version: int,
) -> ModelView:
    """How one served version of a model uses the cache, from its model.yaml."""
    settings = config.cache
    feature_version = settings.feature_version
    if config.features is not None:
        feature_version = f"{feature_version}|features:{config.features.version}"
    schema = schema_hash((s.name, s.datatype, s.shape) for s in config.inputs)
    rule = KeyRule(
        exclude=frozenset(settings.key.exclude),
        round=dict(settings.key.round),
        parameters=tuple(settings.key.parameters),
    )
    keys = KeyBuilder(config.name, version, schema, feature_version, rule)
    l1_settings = settings.l1

    def make() -> MemoryCache:
        return MemoryCache(
            max_entries=l1_settings.max_entries,
            max_bytes=l1_settings.max_bytes,
            policy=l1_settings.policy,
            clock=time.monotonic,
            on_evict=cache.evicted(config.name),
            enabled=l1_settings.enabled,
        )

    l1_ttl = l1_settings.ttl_s if l1_settings.ttl_s is not None else settings.ttl_s
    l2_ttl = settings.l2_ttl_s if settings.l2_ttl_s is not None else settings.ttl_s
    policy = CachePolicy(
        l1_ttl_s=min(l1_ttl, l2_ttl) if settings.l2 else l1_ttl,
        l2_ttl_s=l2_ttl,
        grace_s=settings.stale_s,
        overload_s=settings.stale_if_overloaded_s,
        use_l2=settings.l2,
        lease_s=settings.lease_ms / 1e3,
        feature_version=feature_version,
    )
    return ModelView(config.name, version, keys, cache.l1_for(config.name, make), policy)


__all__ = ["ModelView", "ResultCache", "model_view"]
