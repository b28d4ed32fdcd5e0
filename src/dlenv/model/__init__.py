"""Models by name or FILE.py:factory, pretrained weights and their cache, fine-tuning, activation checkpointing
and shrinking a model.
"""
