"""Published designs, one module each: MoE-Infinity, ExpertFlow, fMoE and ProMoE, with their ablations."""
