"""What runs inside vLLM's interpreter: raygym's adapter server, its weight-transfer backend in vLLM's
workers, LoRA, MoE repacking and checksums.
"""
