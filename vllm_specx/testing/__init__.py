"""Test helpers shared across vllm-specx: tiny local models and engine start-up.

Nothing here downloads anything: models and tokenizers are built on the spot.
"""
