"""DiffusionGemma: a block-diffusion model (an encoder caches the past; a decoder denoises a canvas of
tokens with bidirectional attention over several steps), which moestream's next-token engine cannot run."""

from moestream.families.base import FAMILIES, FamilyAdapter


@FAMILIES.register("diffusion_gemma")
class DiffusionGemmaAdapter(FamilyAdapter):
    refused = ("block-diffusion generation: it denoises a canvas of tokens with bidirectional attention, "
               "not one next token at a time")
