"""Learned expert predictors (torch models) behind the policies that train them offline.

Models live here so that policy modules stay light to import: a policy imports these lazily, when
it fits or loads. Nothing here knows the cache, the simulator or the engine.
"""
