"""Vision-language support: images in data and requests, image tokens and M-RoPE positions, the Qwen2-VL family."""
