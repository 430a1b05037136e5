"""Multi-LoRA serving (SGLang's --lora-paths): adapter configs (lora_config.py) and the
LoRAManager that holds their weights and adds their deltas per token (lora_manager.py)."""
