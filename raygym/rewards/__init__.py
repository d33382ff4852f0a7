"""Rewards: built-in verifiers, custom reward functions read by their signature (raygym, TRL, verl), LLM
judges and on-policy distillation.
"""
