"""Switch Transformers: an encoder-decoder whose every other block has a top-1 sparse MLP of `expert_{e}` modules
(wi, wo), MoE layers numbered over encoder blocks, then decoder blocks. The experts module is a ModuleDict, not an
experts implementation: this file declares its layout and the engine swaps the module."""

from moestream.families.base import FAMILIES, ExpertPart, FamilyAdapter, MoEBlock
from moestream.families.tiny import Sizes

# index of the feed-forward sublayer inside a block: after self-attention (and cross-attention)
FF_SUBLAYER = {"encoder": 1, "decoder": 2}


@FAMILIES.register("switch_transformers")
class SwitchTransformersAdapter(FamilyAdapter):
    auto_class = "AutoModelForSeq2SeqLM"
    parts = (ExpertPart("wi", ("experts.expert_{expert}.wi.weight",)),
             ExpertPart("wo", ("experts.expert_{expert}.wo.weight",)))
    uses_experts_registry = False
    fixed_top_k = 1

    def expert_parts(self, config) -> tuple[ExpertPart, ...]:
        return self.parts

    def num_experts(self, config) -> int:
        return int(config.num_experts)

    def num_shared_experts(self, config) -> int:
        return 0

    def expert_tensor(self, experts_module, expert: int, param: str):
        return getattr(experts_module[f"expert_{expert}"], param).weight

    def blocks(self, config) -> list[MoEBlock]:
        stacks = (("encoder", config.num_layers, config.encoder_sparse_step, 0),  # (stack, blocks, step, first id)
                  ("decoder", config.num_decoder_layers, config.decoder_sparse_step, config.num_layers))
        sparse = [(f"{stack}.block.{block}.layer.{FF_SUBLAYER[stack]}.mlp", first + block)
                  for stack, num_blocks, step, first in stacks for block in range(num_blocks)
                  if step > 0 and (block % step == 1 or step == 1)]
        return [MoEBlock(index, layer_id, prefix, f"{prefix}.experts")
                for index, (prefix, layer_id) in enumerate(sparse)]

    def tiny_config_kwargs(self, sizes: Sizes) -> dict:
        num_heads = max(1, sizes.hidden_size // 16)
        return dict(
            vocab_size=sizes.vocab_size, d_model=sizes.hidden_size, d_ff=sizes.intermediate_size,
            d_kv=sizes.hidden_size // num_heads, num_heads=num_heads, num_layers=sizes.num_layers,
            num_decoder_layers=sizes.num_layers, num_sparse_encoder_layers=max(1, sizes.num_layers // 2),
            num_sparse_decoder_layers=max(1, sizes.num_layers // 2), num_experts=sizes.num_experts,
            expert_capacity=4096,  # no token dropped at test sizes; a smaller capacity drops tokens
            router_jitter_noise=0.0,
            tie_word_embeddings=False,  # tied, a random T5 predicts its input token again and again
            initializer_factor=0.3,  # at 1.0 random decoder states are alike: one expert takes most tokens
        )
