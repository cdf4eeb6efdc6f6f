"""Qwen4-Exp: its attention layers always build a QSA token indexer, whose fields the config leaves None, so
a small test model sets them small (one indexer key head, as the config requires, and a budget of 8 tokens,
so that selection bites); its hyper-connection mixer's rank is shrunk too; the rest is derived."""

from moestream.families.base import FAMILIES, FamilyAdapter


@FAMILIES.register("qwen4_exp")
class Qwen4ExpAdapter(FamilyAdapter):
    tiny_fields = dict(indexer_n_heads=2, indexer_kv_heads=1, indexer_head_dim=16, indexer_budget=8,
                       indexer_compress_ratio=2, hc_lowrank=16)
