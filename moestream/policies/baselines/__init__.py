"""Baselines: reactive caches (lru, lfu) and simple predictors (static, token, cooccur, token-cooccur)."""
