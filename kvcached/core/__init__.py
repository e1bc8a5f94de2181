"""The cache core: the prefix tree over chained block hashes, tiers, eviction and the manager facade."""
